"""smfree's benchmark: smfree beside NCCL (Gloo on CPU) in one run on one host.

Sections (`--only`), one module each:

1. bandwidth: time per op and GB/s for 4 KiB ... 1 GiB, one way and both ways at once, beside
   the copy engines' own limit (a single process's peer copy).
2. overlap: a bf16 GEMM loop's slowdown while P2P traffic moves tens of GiB each way.
3. profile: a torch.profiler trace of P2P ops; the CUDA kernels they launched, the copies.
4. pipeline: a synthetic 1F1B pipeline of GEMM stages over every rank; step time.
5. pipelining: torch.distributed.pipelining's schedules (GPipe, 1F1B, Interleaved1F1B and the
   zero-bubble ones the installed torch has) on an MLP, 2 and 4 stages, activations 32 KiB ...
   64 MiB; step time and its spread, CPU time in wait(), losses and gradients compared.
6. roundtrip: a dependent round trip (send, wait, receive back, wait) per message size, and
   the CPU time in wait() per send and per receive.
7. captured: exchanges, a 1F1B step and GEMM traffic captured in CUDA graphs and replayed,
   smfree against NCCL captured, beside the floor: the same copies captured with no handshake.
8. alltoall: every rank exchanging with every other at once (one batch_isend_irecv each),
   4 MiB ... 256 MiB per peer: µs per exchange and aggregate GB/s; a GEMM loop's slowdown under
   that traffic; smfree's mappings and staging memory afterwards.
9. collectives: all_gather_into_tensor and all_to_all_single on smfree's copy engines
   (SMFREE_COLLECTIVES) against NCCL, every rank, 64 KiB ... 256 MiB per piece: µs per call and
   aggregate GB/s beside the floor (the same pieces as bare peer copies from one process) and
   NCCL's own copy-engine path (or where it fails); a GEMM loop's slowdown beside each.
10. starvation: every same-host path run while a kernel holds every SM of both GPUs (or of
    the one GPU both ranks share); when each op ended, during the hold (no SM) or after it.
11. shared_gpu: two ranks on one GPU (which NCCL refuses) exchange both ways, 4 KiB ... 64 MiB:
    smfree's µs per exchange beside the copy floors timed on that GPU in the same run (D2H then
    H2D; D2H and H2D overlapped; a device-local copy).

Ranks pair up (0<->1, 2<->3, ...; with an odd world size the last rank idles) and all pairs run
at once; pipelines take the first ranks; alltoall and collectives take every rank. Rank 0
prints its figures and writes every figure to a JSON file (schema in `report.new_report`), from
which `python -m smfree_pg.bench.plot` draws PNG plots. 1 GB = 1e9 bytes.

On CUDA it spawns one rank per visible GPU itself, at least 2. Where ranks share a GPU (one GPU,
more ranks than GPUs, or the shared_gpu section) every rank runs on cuda:0 and only shared_gpu
runs (smfree alone: NCCL refuses two ranks on one GPU):

    python -m smfree_pg.bench
    python -m smfree_pg.bench --only shared_gpu --json out/shared.json
    python -m smfree_pg.bench --only bandwidth --sizes 4K,1M,256M --json out/bw.json
    python -m smfree_pg.bench --only pipelining,roundtrip --connections default,1

or runs under torchrun, which it detects (RANK and WORLD_SIZE set) and then does not spawn:

    torchrun --nproc-per-node=4 -m smfree_pg.bench --only overlap

`--device cpu` runs the pipelining and roundtrip sections on CPU tensors (smfree over UCX
against Gloo), which the tests use.
"""
