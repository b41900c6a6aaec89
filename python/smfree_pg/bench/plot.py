"""PNG plots of a report written by `python -m smfree_pg.bench`.

    python -m smfree_pg.bench.plot bench-out/bench.json --out bench-out/

writes, for whichever sections the report holds:

- bandwidth.png: GB/s against message size, one way and both ways at once, for smfree, NCCL
  and the copy engines' limit (a single process's peer copy);
- gemm-slowdown.png: how much longer the bf16 GEMM loop took under smfree's and under NCCL's
  traffic than alone, per rank of the measured pair, with the GB/s each moved meanwhile;
- pipelining.png: step time over smfree / over the reference per schedule and activation size,
  one panel per stage count, the bars spanning the quartiles of the per-round ratios;
- roundtrip.png: µs per round trip against message size for both backends, the bars spanning
  the quartiles of the loops.

A report of a run under CUDA_DEVICE_MAX_CONNECTIONS gets its PNGs named with
'-connections-SETTING'.

Needs matplotlib (`pip install matplotlib`), which the GPU machines may lack: plot wherever the
JSON lands.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from smfree_pg.bench.bandwidth import MODE_TITLES, MODES
from smfree_pg.bench.report import SCHEMA
from smfree_pg.bench.sizes import format_size

# label, marker, line style, colour; the same colours in every plot
SERIES = {
    "smfree": ("smfree", "o", "-", "tab:green"),
    "nccl": ("NCCL", "s", "-", "tab:blue"),
    "copy_engine": ("copy-engine limit (1 process)", None, "--", "tab:gray"),
    "gloo": ("Gloo", "s", "-", "tab:blue"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m smfree_pg.bench.plot",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("report", help="JSON written by python -m smfree_pg.bench")
    parser.add_argument("--out", default=None,
                        help="folder for the PNGs (default: the report's folder)")
    return parser.parse_args(argv)


def load_report(path: str) -> dict:
    report = json.loads(Path(path).read_text())
    if report.get("schema") != SCHEMA:
        sys.exit(f"smfree_pg.bench.plot: {path} is not a {SCHEMA} report "
                 f"(schema {report.get('schema')!r})")
    return report


def describe(meta: dict) -> str:
    connections = meta.get("cuda_device_max_connections", "default")
    nccl = f", NCCL {meta['nccl']}" if meta["nccl"] else ""
    return (f"{meta['gpu'] or 'CPU tensors'}, torch {meta['torch']}{nccl}, "
            f"smfree {meta['smfree']}, world size {meta['world_size']}"
            + ("" if connections == "default" else f"\nCUDA_DEVICE_MAX_CONNECTIONS={connections}"))


def png_name(meta: dict, name: str) -> str:
    connections = meta.get("cuda_device_max_connections", "default")
    return f"{name}.png" if connections == "default" else f"{name}-connections-{connections}.png"


def plot_bandwidth(plt, section: dict, meta: dict, out: Path) -> Path:
    rows = section["rows"]
    sizes = [row["bytes"] for row in rows]
    fig, axes = plt.subplots(1, len(MODES), figsize=(13, 5), sharey=True)
    for ax, mode in zip(axes, MODES, strict=True):
        for key, (label, marker, style, colour) in SERIES.items():
            # The copy-engine limit is missing where rank 0 could not see rank 1's GPU.
            points = [(row["bytes"], row[key][mode]["GBps"]) for row in rows if row.get(key)]
            if points:
                ax.plot(*zip(*points, strict=True), marker=marker, linestyle=style,
                        color=colour, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [format_size(size) for size in sizes], rotation=45)
        ax.minorticks_off()
        ax.set_xlabel("message size")
        ax.set_title(MODE_TITLES[mode])
        ax.grid(True, alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("GB/s one way (1 GB = 1e9 B)")
    fig.suptitle(f"Point-to-point bandwidth, ops posted from Python, ranks 0 and 1\n"
                 f"{describe(meta)}")
    fig.tight_layout()
    return save(fig, plt, out / png_name(meta, "bandwidth"))


def plot_slowdown(plt, section: dict, meta: dict, out: Path) -> Path:
    ranks = [(rank, s) for rank, s in enumerate(section["ranks"][:2]) if s is not None]
    backends = ["smfree", "nccl"]
    width = 0.8 / len(backends)
    fig, ax = plt.subplots(figsize=(7, 5))
    for i, backend in enumerate(backends):
        label, _, _, colour = SERIES[backend]
        xs = [slot + (i - (len(backends) - 1) / 2) * width for slot in range(len(ranks))]
        figures = [summary[backend] for _, summary in ranks]
        bars = ax.bar(xs, [f["slowdown_pct"] for f in figures], width, color=colour, label=label)
        # A transfer that ended before the GEMM loop slowed only part of it: say so on the bar.
        ax.bar_label(bars, [f"{f['slowdown_pct']:+.1f} %\n{f['transfer_GBps']:.0f} GB/s"
                            + ("" if f["covered"] else "\n(ended early)") for f in figures],
                     padding=3, fontsize=9)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(ranks)),
                  [f"rank {rank}\nalone {s['alone_ms']:.2f} ms, {s['alone_TFLOPs']:.0f} TFLOP/s"
                   for rank, s in ranks])
    ax.set_ylabel("GEMM time under P2P traffic vs. alone (%)")
    ax.margins(y=0.25)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(title="traffic over")
    n = section["gemm_n"]
    ax.set_title(f"bf16 GEMM {n}x{n}x{n}, {section['gemms']} per loop, while each rank moves "
                 f"{format_size(section['bytes_each_way'])} each way\n{describe(meta)}",
                 fontsize=10)
    fig.tight_layout()
    return save(fig, plt, out / png_name(meta, "gemm-slowdown"))


def plot_pipelining(plt, section: dict, meta: dict, out: Path) -> Path:
    reference = SERIES[section["reference"]][0]
    counts = section["stages"]
    fig, axes = plt.subplots(1, len(counts), figsize=(7 * len(counts), 5), squeeze=False,
                             sharey=True)
    sizes = sorted({row["bytes"] for row in section["rows"]})
    schedules = section["schedules"]
    width = 0.8 / len(schedules)
    for ax, stages in zip(axes[0], counts, strict=True):
        for i, schedule in enumerate(schedules):
            rows = {row["bytes"]: row for row in section["rows"]
                    if row["stages"] == stages and row["schedule"] == schedule}
            xs = [slot + (i - (len(schedules) - 1) / 2) * width
                  for slot, size in enumerate(sizes) if size in rows]
            paired = [rows[size]["paired"] for size in sizes if size in rows]
            medians = [p["median"] for p in paired]
            ax.bar(xs, medians, width, label=schedule,
                   yerr=[[m - p["p25"] for m, p in zip(medians, paired)],
                         [p["p75"] - m for m, p in zip(medians, paired)]], capsize=2)
        ax.axhline(1, color="black", linewidth=0.8)
        ax.set_xticks(range(len(sizes)), [format_size(size) for size in sizes])
        ax.set_xlabel("activation per micro-batch")
        ax.set_title(f"{stages} stages")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].set_ylabel(f"step time, smfree / {reference} (median of rounds, IQR)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"torch.distributed.pipelining, {section['microbatches']} micro-batches, "
                 f"{section['layers_per_rank']} x Linear({section['hidden']}) per rank\n"
                 f"{describe(meta)}", fontsize=10)
    fig.tight_layout()
    return save(fig, plt, out / png_name(meta, "pipelining"))


def plot_roundtrip(plt, section: dict, meta: dict, out: Path) -> Path:
    rows = section["rows"]
    sizes = [row["bytes"] for row in rows]
    fig, ax = plt.subplots(figsize=(7, 5))
    for backend in ("smfree", section["reference"]):
        label, marker, style, colour = SERIES[backend]
        figures = [row[backend]["us"] for row in rows]
        medians = [f["median"] for f in figures]
        ax.errorbar(sizes, medians, yerr=[[m - f["p25"] for m, f in zip(medians, figures)],
                                          [f["p75"] - m for m, f in zip(medians, figures)]],
                    marker=marker, linestyle=style, color=colour, label=label, capsize=3)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [format_size(size) for size in sizes], rotation=45)
    ax.minorticks_off()
    ax.set_xlabel("message size")
    ax.set_ylabel("µs per round trip (median of loops, IQR)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(f"Dependent round trip (send, wait, receive back, wait)\n{describe(meta)}",
                 fontsize=10)
    fig.tight_layout()
    return save(fig, plt, out / png_name(meta, "roundtrip"))


def save(fig, plt, path: Path) -> Path:
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        import matplotlib
    except ImportError:
        sys.exit("smfree_pg.bench.plot needs matplotlib: pip install matplotlib")
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    report = load_report(args.report)
    out = Path(args.out) if args.out else Path(args.report).parent
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if "bandwidth" in report:
        written.append(plot_bandwidth(plt, report["bandwidth"], report["meta"], out))
    if "overlap" in report:
        written.append(plot_slowdown(plt, report["overlap"], report["meta"], out))
    if "pipelining" in report:
        written.append(plot_pipelining(plt, report["pipelining"], report["meta"], out))
    if "roundtrip" in report:
        written.append(plot_roundtrip(plt, report["roundtrip"], report["meta"], out))
    if not written:
        sys.exit(f"smfree_pg.bench.plot: {args.report} has no section to plot (bandwidth, "
                 "overlap, pipelining, roundtrip)")
    for path in written:
        print(path)


if __name__ == "__main__":
    main()
