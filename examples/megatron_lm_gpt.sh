#!/usr/bin/env bash
# A few GPT training steps of Megatron-LM core_v0.13.0 with
# patches/megatron-lm-core_v0.13.0-smfree.patch applied, pipeline groups on BACKEND.
#
# Run it from the patched Megatron-LM checkout, in an environment where smfree is installed:
#   BACKEND=smfree NPROC=2 bash /path/to/smfree/examples/megatron_lm_gpt.sh
#   BACKEND=nccl   NPROC=2 VPP=2 bash /path/to/smfree/examples/megatron_lm_gpt.sh
# Settings: BACKEND (smfree | nccl), NPROC (GPUs = pipeline stages), VPP (virtual stages per
# rank, 1 = plain 1F1B), BATCH (1: --batch-p2p-communication; interleaved schedule only, and
# Megatron refuses it at PP = 2), ITERS, LAYERS, HIDDEN, HEADS, SEQ, GBS (micro-batches of 1).
# Only Megatron's own modules are used (--transformer-impl local, fusions off), so neither
# Transformer Engine nor Apex is needed; the data are mock data.
set -euo pipefail

BACKEND=${BACKEND:-smfree}
NPROC=${NPROC:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
VPP=${VPP:-1}
BATCH=${BATCH:-0}
ITERS=${ITERS:-10}
LAYERS=${LAYERS:-8}
HIDDEN=${HIDDEN:-1024}
HEADS=${HEADS:-16}
SEQ=${SEQ:-1024}
GBS=${GBS:-16}

args=(
    --num-layers "$LAYERS" --hidden-size "$HIDDEN" --ffn-hidden-size $((4 * HIDDEN))
    --num-attention-heads "$HEADS" --seq-length "$SEQ" --max-position-embeddings "$SEQ"
    --micro-batch-size 1 --global-batch-size "$GBS"
    --train-iters "$ITERS" --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2
    --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.02
    --attention-dropout 0.0 --hidden-dropout 0.0 --bf16 --seed 1234
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size "$NPROC"
    --pipeline-model-parallel-comm-backend "$BACKEND"
    --transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion
    --no-bias-gelu-fusion --no-bias-dropout-fusion --no-persist-layer-norm --no-rope-fusion
    --mock-data --tokenizer-type NullTokenizer --vocab-size 32000
    --log-interval 1 --eval-iters 0 --eval-interval 100000 --distributed-timeout-minutes 3
    # Same losses, bit for bit, on either backend.
    --deterministic-mode
)
if [ "$VPP" -gt 1 ]; then
    args+=(--num-layers-per-virtual-pipeline-stage $((LAYERS / (NPROC * VPP))))
fi
if [ "$BATCH" = 1 ]; then
    args+=(--batch-p2p-communication)
fi

# As Megatron's launch scripts set it; smfree is fine with one hardware queue (docs/design.md).
export CUDA_DEVICE_MAX_CONNECTIONS=1
# --deterministic-mode requires NCCL_ALGO to be set, and cuBLAS a fixed workspace.
export NCCL_ALGO=${NCCL_ALGO:-Ring} CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
exec timeout -s INT "${TIMEOUT_S:-600}" torchrun --nproc-per-node="$NPROC" pretrain_gpt.py "${args[@]}"
