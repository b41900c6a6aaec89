"""The command line of `python -m smfree_pg.bench`: common options, then each section's."""

from __future__ import annotations

import argparse
import sys

DEVICES = ("cuda", "cpu")


def parse_names(text: str, known: list[str], what: str) -> list[str]:
    """'a,b' -> the named ones, in `known`'s order."""
    chosen = {part.strip() for part in text.split(",")}
    unknown = chosen - set(known)
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown {what}(s) {sorted(unknown)}; choose from {', '.join(known)}")
    return [name for name in known if name in chosen]


def parse_connections(text: str) -> list[str]:
    """'default,1' -> ['default', '1']: settings of CUDA_DEVICE_MAX_CONNECTIONS, one run each."""
    settings = [part.strip() for part in text.split(",")]
    for setting in settings:
        if setting != "default" and not (setting.isdigit() and 1 <= int(setting) <= 32):
            raise argparse.ArgumentTypeError(
                f"--connections: {setting!r} is neither 'default' nor a number from 1 to 32")
    if len(set(settings)) != len(settings):
        raise argparse.ArgumentTypeError(f"--connections names a setting twice: {text!r}")
    return settings


def at_least(parser, args, minimum: int, *names: str) -> None:
    for name in names:
        if getattr(args, name) < minimum:
            parser.error(f"--{name.replace('_', '-')} must be at least {minimum}")


def build_parser(sections: dict, description: str) -> argparse.ArgumentParser:
    """The parser: common options, then each section's group, in `sections`' order."""
    parser = argparse.ArgumentParser(prog="python -m smfree_pg.bench", description=description)
    names = list(sections)
    add = parser.add_argument
    add("--only", type=lambda text: parse_names(text, names, "section"),
        help=f"sections to run, comma-separated (default: every section the device runs: "
        f"{','.join(names)} on CUDA, "
        f"{','.join(n for n, s in sections.items() if 'cpu' in s.DEVICES)} on CPU)")
    add("--json", default="bench-out/bench.json", metavar="PATH",
        help="where rank 0 writes every figure; profiler traces go beside it "
        "(default: %(default)s)")
    add("--nproc", type=int, help="ranks to spawn (default: visible GPUs, at least 2; 2 where "
        "ranks share a GPU or on CPU); ignored under torchrun")
    add("--timeout-min", type=float, default=5.0,
        help="group timeout in minutes; a section still running a minute past it ends "
        "the rank (default: %(default)s)")
    add("--device", choices=DEVICES, default="cuda",
        help="cuda: one GPU per rank, smfree against NCCL (with one GPU, or with the shared_gpu "
        "section, every rank on cuda:0 and smfree alone: NCCL refuses that); cpu: CPU tensors, smfree (over UCX) "
        "against Gloo, for the sections that run there (default: %(default)s)")
    add("--connections", type=parse_connections, metavar="SETTINGS",
        help="CUDA_DEVICE_MAX_CONNECTIONS for the ranks, comma-separated, 'default' = unset: "
        "one run per setting, each labelled with it; with several, each run's JSON (and "
        "traces) get '-connections-SETTING' in their name (default: the environment's)")
    for section in sections.values():
        section.add_arguments(parser)
    return parser


def parse_args(sections: dict, description: str, argv: list[str] | None = None
               ) -> argparse.Namespace:
    parser = build_parser(sections, description)
    args = parser.parse_args(argv)
    runnable = [name for name, section in sections.items() if args.device in section.DEVICES]
    args.only_given = args.only is not None
    if args.only is None:
        args.only = runnable
    elif not_here := [name for name in args.only if name not in runnable]:
        parser.error(f"section(s) {', '.join(not_here)} do not run on {args.device}; "
                     f"on {args.device}: {', '.join(runnable)}")
    if args.nproc is not None and args.nproc < 1:
        parser.error("--nproc must be at least 1")
    if args.timeout_min <= 0:
        parser.error("--timeout-min must be > 0")
    if args.device == "cpu" and args.connections:
        parser.error("--connections sets a CUDA setting: it needs --device cuda")
    for section in sections.values():
        section.check_arguments(args, parser)
    return args


def plan_ranks(args, sections: dict, gpus: int, ranks: int | None) -> tuple[int, bool]:
    """(ranks per host, whether they share cuda:0) for a CUDA run with `gpus` visible GPUs;
    `ranks`: --nproc, or torchrun's ranks per host (None: the default). Ranks share a GPU where a
    chosen section runs only there (shared_gpu), or where there are fewer GPUs than ranks. A
    section that needs a GPU per rank (NCCL, its reference, refuses two ranks on one GPU) is then
    refused, naming what runs instead (NCCL, the reference of most, refuses two ranks on one GPU,
    and a hold of every SM needs a GPU per rank); where --only was not given, the sections that cannot run
    with this placement are left out."""
    def runs(name: str, placement: str) -> bool:
        return placement in sections[name].PLACEMENTS

    too_few = gpus < (ranks or 2)
    if args.only_given:
        shared = too_few or any(not runs(name, "own") for name in args.only)
    else:
        shared = too_few
        args.only = [name for name in args.only if runs(name, "shared" if shared else "own")]
    if shared and gpus < 1:
        sys.exit("smfree bench: needs a CUDA GPU, found none")
    per_rank = [name for name in args.only if not runs(name, "shared" if shared else "own")]
    if per_rank and too_few:
        instead = ",".join(name for name, section in sections.items()
                           if runs(name, "shared") and "cuda" in section.DEVICES)
        sys.exit(f"smfree bench: {', '.join(per_rank)} need a GPU per rank; with {gpus} "
                 f"GPU(s) for {ranks or 2} ranks run --only {instead}")
    if per_rank:
        on_one = [name for name in args.only if not runs(name, "own")]
        sys.exit(f"smfree bench: {', '.join(on_one)} put every rank on one GPU and "
                 f"{', '.join(per_rank)} need a GPU per rank: run them apart")
    return ranks or (2 if shared else max(2, gpus)), shared
