"""Pipeline-parallel GPT training on megatron-core, with the pipeline group on smfree.

No patch to megatron-core: the pipeline group is created with `backend="smfree"` and handed to
megatron-core's schedules through a `P2PCommunicator` and a `ProcessGroupCollection`; every
other group (tensor, data, embedding, WORLD) stays on NCCL.

One launch trains the same model from the same initial weights once per (P2P mode, backend)
pair, so NCCL and smfree are compared in one process, on one set of GPUs, in the same minutes
(`--rounds N` does it N times, alternating which backend goes first, for ratios less swayed by
the machine's drift; a pair's step time is then the median over all its rounds' steps):

    torchrun --nproc-per-node=2 examples/megatron_core_gpt.py
    torchrun --nproc-per-node=4 examples/megatron_core_gpt.py --vpp 2 --json out.json

With --full-graph, each run's forward_backward_func is megatron-core's full-iteration CUDA
graph (FullCudaGraphWrapper, capture_error_mode="thread_local"): one eager step, then the whole
step (every micro-batch's compute and pipeline P2P) is captured once and only replayed; the
optimizer step stays outside, as in megatron's training loop:

    torchrun --nproc-per-node=2 examples/megatron_core_gpt.py --full-graph

P2P modes (megatron-core's ModelParallelConfig):
  batched     batch_p2p_comm: each schedule step posts its isend/irecv in one batch
              (not at PP = 2 with virtual stages, which Megatron refuses too)
  unbatched   separate isend/irecv, waited on at once
  overlapped  separate isend/irecv left in flight across the next micro-batch's compute
              (overlap_p2p_comm; megatron-core allows it with virtual stages only)

`batch_p2p_sync` (a torch.cuda.synchronize() after each batch, a workaround for old PyTorch) is
off for both backends. At PP = 2 megatron-core's unbatched path sends one of the two
directions over the WORLD group, which is NCCL here: the example says so when it happens.

The data are synthetic but learnable (each token follows from the previous one), so the loss
falls; the last stage prints every step's loss, bitwise, per run, and whether the runs of a
mode agree. Needs one GPU per rank, world size = --pp (tensor and data parallel sizes are 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import smfree_pg  # noqa: F401  (registers backend "smfree")
from smfree_pg.bench.provenance import provenance

from megatron.core import parallel_state
from megatron.core.full_cuda_graph import FullCudaGraphWrapper
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

MODES = ("batched", "unbatched", "overlapped")
BACKENDS = ("nccl", "smfree")
# Groups the schedules read from the collection; "pp" is replaced by the backend under test.
SCHEDULE_GROUPS = ["tp", "cp", "pp", "embd", "pos_embd", "dp", "dp_cp"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--pp", type=int, default=None, help="pipeline stages (default: world size)")
    add("--vpp", type=int, default=1, help="virtual stages per rank (1: no interleaving)")
    add("--layers", type=int, default=16)
    add("--hidden", type=int, default=4096)
    add("--heads", type=int, default=32)
    add("--seq", type=int, default=2048)
    add("--vocab", type=int, default=32768)
    add("--micro-batch", type=int, default=1)
    add("--micro-batches", type=int, default=16, help="micro-batches per step")
    add("--steps", type=int, default=8, help="measured steps per run")
    add("--warmup-steps", type=int, default=2, help="steps run before the measured ones")
    add("--rounds", type=int, default=1,
        help="runs of each mode and backend, alternating which backend goes first")
    add("--lr", type=float, default=3e-4)
    add("--seed", type=int, default=1234)
    add("--modes", nargs="+", choices=MODES, default=None,
        help="P2P modes (default: batched unbatched, and overlapped with --vpp > 1)")
    add("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    add("--full-graph", action="store_true",
        help="replay each step as megatron-core's full-iteration CUDA graph, captured after "
        "one eager step (needs --warmup-steps >= 2)")
    add("--json", default=None, help="also write the results here (last stage)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.full_graph and args.warmup_steps < 2:
        parser.error("--full-graph captures at the second step: --warmup-steps must be >= 2")
    if "overlapped" in (args.modes or []) and args.vpp == 1:
        parser.error("mode 'overlapped' needs --vpp > 1 (megatron-core allows it only there)")
    return args


def choose_modes(args: argparse.Namespace) -> None:
    # At PP = 2 with virtual stages, one batch would hold both directions between the same two
    # ranks, which match in posting order on any backend: Megatron refuses that setting too.
    batched_ok = not (args.pp == 2 and args.vpp > 1)
    if args.modes is None:
        args.modes = (["batched"] if batched_ok else []) + ["unbatched"]
        args.modes += ["overlapped"] if args.vpp > 1 else []
    elif "batched" in args.modes and not batched_ok:
        sys.exit("megatron_core_gpt: batched P2P with virtual stages needs --pp > 2")


def init_distributed(args: argparse.Namespace) -> dict[str, dist.ProcessGroup]:
    """NCCL for WORLD and megatron-core's groups; one pipeline group per backend under test."""
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    world = dist.get_world_size()
    args.pp = args.pp or world
    if args.pp != world or args.pp < 2:
        sys.exit(f"megatron_core_gpt: --pp must equal the world size (>= 2); got --pp {args.pp} "
                 f"with {world} ranks")
    if args.layers % (args.pp * args.vpp):
        sys.exit(f"megatron_core_gpt: --layers {args.layers} must divide into "
                 f"{args.pp} x {args.vpp} stages")
    choose_modes(args)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vpp if args.vpp > 1 else None,
    )
    ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    return {
        "nccl": parallel_state.get_pipeline_model_parallel_group(),
        "smfree": dist.new_group(ranks, backend="smfree"),
    }


def make_config(args: argparse.Namespace) -> TransformerConfig:
    return TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        ffn_hidden_size=4 * args.hidden,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        pipeline_dtype=torch.bfloat16,
        pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vpp if args.vpp > 1 else None,
        deallocate_pipeline_outputs=True,
        batch_p2p_sync=False,
    )


def build_model(args: argparse.Namespace, config: TransformerConfig) -> list[Float16Module]:
    """One GPTModel chunk per virtual stage in bf16, as megatron's training loop builds them."""
    chunks = []
    for vp_stage in range(args.vpp):
        stage = vp_stage if args.vpp > 1 else None
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=args.vocab,
            max_sequence_length=args.seq,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False,
                                                               vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False,
                                                               vp_stage=stage),
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
            vp_stage=stage,
        )
        chunks.append(Float16Module(config, chunk.cuda()))
    return chunks


class SyntheticData:
    """Arithmetic progressions mod vocab with a random start and stride: learnable in context.

    Each model chunk gets its own iterator with the same seed, and draws once per micro-batch
    in micro-batch order, so the first stage's tokens and the last stage's labels agree. Every
    input is in the batch, which the full-iteration graph copies into its static buffers.
    """

    def __init__(self, args: argparse.Namespace, step: int):
        self.args = args
        self.generator = torch.Generator(device="cuda").manual_seed(args.seed * 1000 + step)
        seq = args.seq
        self.position_ids = torch.arange(seq, device="cuda").unsqueeze(0).expand(
            args.micro_batch, seq)
        # Megatron's convention: True marks a position that may not be attended to.
        self.attention_mask = torch.triu(
            torch.ones(seq, seq, dtype=torch.bool, device="cuda"), diagonal=1)[None, None]
        self.loss_mask = torch.ones(args.micro_batch, seq, device="cuda")

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        args = self.args
        start = torch.randint(0, args.vocab, (args.micro_batch, 1), device="cuda",
                              generator=self.generator)
        stride = torch.randint(1, 17, (args.micro_batch, 1), device="cuda",
                               generator=self.generator)
        sequence = (start + stride * torch.arange(args.seq + 1, device="cuda")) % args.vocab
        return {"tokens": sequence[:, :-1], "labels": sequence[:, 1:],
                "position_ids": self.position_ids, "attention_mask": self.attention_mask,
                "loss_mask": self.loss_mask}


def forward_step(data, model):
    batch = next(data)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])

    def loss_func(per_token_loss: torch.Tensor):
        mask = batch["loss_mask"].view(-1)
        loss = torch.sum(per_token_loss.float().view(-1) * mask) / mask.sum()
        # The schedule divides `loss` in place by the number of micro-batches: report a copy.
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def flops_per_step(args: argparse.Namespace) -> float:
    """Model FLOPs of a training step (forward + backward, no recomputation).

    Narayanan et al. (2021), with 3 instead of 4 passes: 72 B s L h^2 (1 + s/(6h) + V/(12 L h)).
    """
    batch = args.micro_batch * args.micro_batches
    s, layers, h, v = args.seq, args.layers, args.hidden, args.vocab
    return 72 * batch * s * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))


def train(args, chunks, config, initial, pp_group, mode, backend) -> dict:
    """Trains from the initial weights; returns per-step losses (last stage) and times."""
    # A captured backward accumulates into the gradients it found at capture: they stay
    # allocated and are zeroed in place.
    set_to_none = not args.full_graph
    for chunk, state in zip(chunks, initial):
        chunk.load_state_dict(state)
        chunk.zero_grad(set_to_none=set_to_none)
    config.batch_p2p_comm = mode == "batched"
    config.overlap_p2p_comm = mode == "overlapped"
    optimizer = torch.optim.AdamW([p for c in chunks for p in c.parameters()], lr=args.lr)
    pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=SCHEDULE_GROUPS)
    pg_collection.pp = pp_group
    communicator = P2PCommunicator(pp_group=pp_group, config=config)
    forward_backward = get_forward_backward_func()
    if args.full_graph:
        forward_backward = FullCudaGraphWrapper(forward_backward, cuda_graph_warmup_steps=1)
        forward_backward.reset_cuda_graph()  # its graphs are the class's: the last run's go
    model = chunks if args.vpp > 1 else chunks[0]

    losses, times = [], []
    for step in range(args.warmup_steps + args.steps):
        iterators = [SyntheticData(args, step) for _ in chunks]
        torch.cuda.synchronize()
        dist.barrier(device_ids=[torch.cuda.current_device()])
        began = time.perf_counter()
        results = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iterators if args.vpp > 1 else iterators[0],
            model=model,
            num_microbatches=args.micro_batches,
            seq_length=args.seq,
            micro_batch_size=args.micro_batch,
            forward_only=False,
            p2p_communicator=communicator,
            pg_collection=pg_collection,
        )
        optimizer.step()
        for chunk in chunks:
            chunk.zero_grad(set_to_none=set_to_none)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - began
        if step >= args.warmup_steps:
            times.append(elapsed)
        if results:
            losses.append(torch.stack([r["lm loss"] for r in results]).mean().item())
    del optimizer
    if args.full_graph:
        forward_backward.reset_cuda_graph()
    return {"mode": mode, "backend": backend, "losses": losses, "step_s": times}


def merge_rounds(runs: list[dict]) -> dict[str, dict[str, dict]]:
    """By mode, then backend: every round's step times together, and each round's median."""
    by_mode: dict[str, dict[str, dict]] = {}
    for run in runs:
        merged = by_mode.setdefault(run["mode"], {}).setdefault(
            run["backend"], {"mode": run["mode"], "backend": run["backend"],
                             "losses": run["losses"], "step_s": [], "round_medians_ms": [],
                             "losses_equal_across_rounds": True})
        merged["step_s"] += run["step_s"]
        merged["round_medians_ms"].append(statistics.median(run["step_s"]) * 1e3)
        merged["losses_equal_across_rounds"] &= run["losses"] == merged["losses"]
    return by_mode


def report(args: argparse.Namespace, runs: list[dict]) -> None:
    flops = flops_per_step(args)
    world = dist.get_world_size()
    print(f"\nGPT {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, "
          f"vocab {args.vocab}; PP {args.pp}, VPP {args.vpp}, {args.micro_batches} micro-batches "
          f"of {args.micro_batch}; bf16; {args.steps} measured steps after {args.warmup_steps}, "
          f"{args.rounds} round(s)"
          + ("; full-iteration CUDA graph" if args.full_graph else ""))
    print(f"{'mode':<11} {'backend':<7} {'step ms':>9} {'TFLOP/s/GPU':>12} {'vs nccl':>8}  "
          f"losses")
    by_mode = merge_rounds(runs)
    for mode, pair in by_mode.items():
        for backend, run in pair.items():
            step = statistics.median(run["step_s"])
            run["median_step_ms"] = step * 1e3
            run["tflops_per_gpu"] = flops / step / world / 1e12
            ratio = ""
            if backend != "nccl" and "nccl" in pair:
                ratio = f"{step / statistics.median(pair['nccl']['step_s']):.3f}"
                run["vs_nccl"] = float(ratio)
                run["vs_nccl_by_round"] = [
                    round(mine / theirs, 3) for mine, theirs
                    in zip(run["round_medians_ms"], pair["nccl"]["round_medians_ms"])]
            shown = " ".join(f"{loss:.4f}" for loss in run["losses"])
            print(f"{mode:<11} {backend:<7} {step * 1e3:9.1f} {run['tflops_per_gpu']:12.1f} "
                  f"{ratio:>8}  {shown}")
            if args.rounds > 1 and "vs_nccl_by_round" in run:
                print(f"{mode:<11} {backend:<7} by round: "
                      + " ".join(f"{r:.3f}" for r in run["vs_nccl_by_round"]))
            if not run["losses_equal_across_rounds"]:
                print(f"{mode:<11} {backend:<7} losses differ between rounds")
        if len(pair) == 2:
            same = [a == b for a, b in zip(pair["nccl"]["losses"], pair["smfree"]["losses"])]
            print(f"{mode:<11} losses bitwise equal on nccl and smfree: "
                  f"{sum(same)}/{len(same)} steps")
    if args.json:
        merged = [run for pair in by_mode.values() for run in pair.values()]
        with open(args.json, "w") as out:
            json.dump({"provenance": provenance(), "args": vars(args), "flops_per_step": flops,
                       "runs": merged,
                       "rounds": runs}, out, indent=1)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    groups = init_distributed(args)
    torch.manual_seed(args.seed)
    # The full-iteration graph registers the tracker's generators with its capture.
    model_parallel_cuda_manual_seed(args.seed, use_cudagraphable_rng=args.full_graph)
    config = make_config(args)
    chunks = build_model(args, config)
    initial = [{k: v.clone() if torch.is_tensor(v) else v for k, v in c.state_dict().items()}
               for c in chunks]
    last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    if args.pp == 2 and "unbatched" in args.modes and last_stage:
        print("note: at PP = 2, megatron-core's unbatched P2P sends one direction over the WORLD "
              "group (NCCL here) in both backends' runs")

    runs = []
    for round_index in range(args.rounds):
        for index, mode in enumerate(args.modes):
            # Alternate which backend goes first, so neither always runs on a warmer machine.
            first = (index + round_index) % 2 == 0
            order = args.backends if first else list(reversed(args.backends))
            for backend in order:
                run = train(args, chunks, config, initial, groups[backend], mode, backend)
                run["round"] = round_index
                runs.append(run)
                if last_stage:
                    print(f"{mode} on {backend} (round {round_index + 1}/{args.rounds}): median "
                          f"step {statistics.median(run['step_s']) * 1e3:.1f} ms, last loss "
                          f"{run['losses'][-1]:.4f}", flush=True)
    if last_stage:
        report(args, runs)
    dist.barrier(device_ids=[torch.cuda.current_device()])
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
