"""PNG plots of reports written by `python -m smfree_pg.bench` (and read from docs/bench/).

    python -m smfree_pg.bench.plot REPORT.json [REPORT.json ...] --out DIR

draws one figure per kind of section the reports hold, every report holding it in the same
figure, each labelled by its GPU and the SMFREE_* settings it ran under:

- roundtrip.png: µs per dependent round trip against message size (log axes), smfree and
  NCCL, and smfree's time over NCCL's (the paired ratio, its quartiles as bars);
- pipelining.png: torch.distributed.pipelining's step over smfree / over NCCL, by schedule and
  activation size, a panel per report and stage count (bars: the rounds' quartiles);
- gemm-slowdown.png: how much longer a bf16 GEMM loop took beside traffic than alone, smfree's
  traffic against NCCL's: uncaptured P2P ("overlap"), captured P2P ("captured") and
  collectives ("collectives"), per rank, with the GB/s each moved meanwhile;
- collectives.png: each collective's time over NCCL's by piece size, a panel per report,
  with the copy engines' floor (the same pieces as bare copies) over NCCL's as a tick;
- bandwidth.png: GB/s against message size, one way and both ways, smfree, NCCL and the copy
  engines' limit.

docs/benchmarks.md names the command that draws its figures. Needs matplotlib (`pip install
matplotlib`), which the GPU machines may lack: plot wherever the JSON lands.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from smfree_pg.bench.report import SCHEMA
from smfree_pg.bench.sizes import format_size

COLOURS = {"smfree": "tab:green", "nccl": "tab:blue", "floor": "black", "gloo": "tab:blue"}
NAMES = {"smfree": "smfree", "nccl": "NCCL", "gloo": "Gloo"}
SCHEDULE_COLOURS = ["tab:green", "tab:olive", "tab:cyan", "tab:purple", "tab:orange"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m smfree_pg.bench.plot",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", help="JSON written by python -m smfree_pg.bench")
    parser.add_argument("--out", default=None,
                        help="folder for the PNGs (default: the first report's folder)")
    return parser.parse_args(argv)


def load_report(path: str) -> dict:
    report = json.loads(Path(path).read_text())
    if report.get("schema") != SCHEMA:
        sys.exit(f"smfree_pg.bench.plot: {path} is not a {SCHEMA} report "
                 f"(schema {report.get('schema')!r})")
    return report


def gpu_name(meta: dict) -> str:
    return (meta.get("gpu") or "CPU").replace("NVIDIA ", "").split(" ")[0]


def label(report: dict) -> str:
    """'2 x H200, defaults' or '2 x H200, SMFREE_EAGER_BYTES=1048576'."""
    meta = report["meta"]
    settings = {k: v for k, v in meta.get("env", {}).items()
                if k.startswith("SMFREE_") and k != "SMFREE_LOG_LEVEL"}
    connections = meta.get("cuda_device_max_connections", "default")
    if connections != "default":
        settings["CUDA_DEVICE_MAX_CONNECTIONS"] = connections
    shown = ", ".join(f"{k}={v}" for k, v in settings.items()) or "defaults"
    return f"{meta['world_size']} x {gpu_name(meta)}, {shown}"


def versions(reports: list[dict]) -> str:
    seen = []
    for report in reports:
        meta = report["meta"]
        text = f"torch {meta['torch']}" + (f", NCCL {meta['nccl']}" if meta.get("nccl") else "")
        if text not in seen:
            seen.append(text)
    return "; ".join(seen)


def size_axis(ax, sizes: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [format_size(size) for size in sizes], rotation=45)
    ax.minorticks_off()
    ax.set_xlabel("message size")
    ax.grid(True, alpha=0.3)


def plot_roundtrip(plt, reports: list[dict], out: Path) -> Path:
    fig, (times, ratios) = plt.subplots(1, 2, figsize=(13, 5))
    sizes = sorted({row["bytes"] for r in reports for row in r["roundtrip"]["rows"]})
    for i, report in enumerate(reports):
        section = report["roundtrip"]
        rows = section["rows"]
        xs = [row["bytes"] for row in rows]
        style = ["-", "--", ":", "-."][i % 4]
        for backend in ("smfree", section["reference"]):
            if backend != "smfree" and i > 0:
                continue  # the reference of the first report only; the ratios are each run's
            medians = [row[backend]["us"]["median"] for row in rows]
            name = NAMES[backend] + (f" ({label(report)})" if backend == "smfree" else
                                     " (the first smfree line's run)")
            times.plot(xs, medians, marker="o" if backend == "smfree" else "s",
                       linestyle=style if backend == "smfree" else "-",
                       color=COLOURS[backend] if i == 0 or backend != "smfree" else None,
                       label=name)
        paired = [row["paired"] for row in rows]
        medians = [p["median"] for p in paired]
        ratios.errorbar(xs, medians, yerr=[[m - p["p25"] for m, p in zip(medians, paired)],
                                           [p["p75"] - m for m, p in zip(medians, paired)]],
                        marker="o", linestyle=style, capsize=3, label=label(report),
                        color=COLOURS["smfree"] if i == 0 else None)
    times.set_yscale("log")
    times.set_ylabel("µs per round trip (median of loops)")
    times.set_title("Time per round trip")
    ratios.axhline(1, color="black", linewidth=0.8)
    reference = NAMES[reports[0]["roundtrip"]["reference"]]
    ratios.set_ylabel(f"smfree / {reference} (paired; bars: quartiles)")
    ratios.set_title(f"smfree's time over {reference}'s, each in its run (below 1: smfree faster)")
    for ax in (times, ratios):
        size_axis(ax, sizes)
        ax.legend(fontsize=8)
    fig.suptitle("Dependent round trip: send, wait, receive it back, wait\n" + versions(reports),
                 fontsize=10)
    fig.tight_layout()
    return save(fig, plt, out / "roundtrip.png")


def plot_pipelining(plt, reports: list[dict], out: Path) -> Path:
    panels = [(report, stages) for report in reports for stages in report["pipelining"]["stages"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 5), squeeze=False,
                             sharey=True)
    schedules = []
    for report in reports:
        schedules += [s for s in report["pipelining"]["schedules"] if s not in schedules]
    width = 0.8 / len(schedules)
    for ax, (report, stages) in zip(axes[0], panels, strict=True):
        section = report["pipelining"]
        sizes = sorted({row["bytes"] for row in section["rows"] if row["stages"] == stages})
        for i, schedule in enumerate(schedules):
            rows = {row["bytes"]: row for row in section["rows"]
                    if row["stages"] == stages and row["schedule"] == schedule}
            if not rows:
                continue
            slots = [slot for slot, size in enumerate(sizes) if size in rows]
            xs = [slot + (i - (len(schedules) - 1) / 2) * width for slot in slots]
            paired = [rows[sizes[slot]]["paired"] for slot in slots]
            medians = [p["median"] for p in paired]
            ax.bar(xs, medians, width, label=schedule, color=SCHEDULE_COLOURS[i % 5],
                   yerr=[[m - p["p25"] for m, p in zip(medians, paired)],
                         [p["p75"] - m for m, p in zip(medians, paired)]], capsize=2)
        ax.axhline(1, color="black", linewidth=0.8)
        ax.set_xticks(range(len(sizes)), [format_size(size) for size in sizes])
        ax.set_xlabel("activation per micro-batch")
        ax.set_title(f"{stages} stages, {section['rounds']} rounds\n{label(report)}", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    reference = NAMES[reports[0]["pipelining"]["reference"]]
    axes[0][0].set_ylabel(f"step time, smfree / {reference} (median of rounds; bars: quartiles)")
    axes[0][0].set_ylim(bottom=0.5)
    axes[0][-1].legend(fontsize=8)
    first = reports[0]["pipelining"]
    fig.suptitle(f"torch.distributed.pipelining: {first['microbatches']} micro-batches, "
                 f"{first['layers_per_rank']} x Linear({first['hidden']}) per rank; below 1: "
                 f"smfree's step shorter\n{versions(reports)}", fontsize=10)
    fig.tight_layout()
    return save(fig, plt, out / "pipelining.png")


def gemm_groups(reports: list[dict]) -> list[tuple[str, list[dict]]]:
    """(what ran beside the GEMM, per rank {"smfree": ..., "nccl": ...}) in report order."""
    groups = []
    for report in reports:
        where = f"{report['meta']['world_size']} x {gpu_name(report['meta'])}"
        if "overlap" in report:
            section = report["overlap"]
            groups.append((f"P2P exchange, {format_size(section['chunk_bytes'])}\n{where}",
                           [r for r in section["ranks"] if r]))
        if "captured" in report:
            section = report["captured"]["overlap"]
            size = format_size(section["chunk_bytes"])
            groups.append((f"captured P2P exchange,\n{size}, {where}",
                           section["ranks"]))
        for gemm in report.get("collectives", {}).get("gemm", []):
            groups.append((f"{op_name(gemm['op'])},"
                           f"\n{format_size(gemm['bytes'])} pieces, {where}", gemm["ranks"]))
    return groups


def slowdown(figures: dict) -> float:
    return figures.get("paired_slowdown_pct", figures["slowdown_pct"])


def plot_slowdown(plt, reports: list[dict], out: Path) -> Path:
    groups = gemm_groups(reports)
    fig, ax = plt.subplots(figsize=(max(8, 2.2 * len(groups)), 5.5))
    ticks, names = [], []
    slot = 0
    for name, ranks in groups:
        for rank, figures in enumerate(ranks):
            for j, backend in enumerate(("smfree", "nccl")):
                x = slot + (j - 0.5) * 0.4
                value = slowdown(figures[backend])
                bar = ax.bar([x], [value], 0.4, color=COLOURS[backend],
                             label=NAMES[backend] if slot == 0 else None)
                ax.bar_label(bar, [f"{value:+.1f} %\n{figures[backend]['transfer_GBps']:.0f} GB/s"],
                             padding=2, fontsize=7)
            ticks.append(slot)
            names.append(f"rank {rank}")
            slot += 1
        ax.text(slot - len(ranks) / 2 - 0.5, -0.16, name, transform=ax.get_xaxis_transform(),
                ha="center", va="top", fontsize=8)
        slot += 0.6
    ax.set_xticks(ticks, names, fontsize=8)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_yscale("symlog", linthresh=10)
    ax.set_yticks([0, 2, 5, 10, 20, 50], ["0", "2", "5", "10", "20", "50"])
    ax.set_ylabel("GEMM time beside the traffic vs. alone (%, paired)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(title="traffic over")
    ax.margins(y=0.2)
    ax.set_title("bf16 GEMM 8192³ loop slowed by traffic on a side stream (labels: GB/s out of "
                 f"each rank meanwhile)\n{versions(reports)}", fontsize=10)
    fig.subplots_adjust(bottom=0.25, left=0.07, right=0.98)
    return save(fig, plt, out / "gemm-slowdown.png")


def op_name(op: str) -> str:
    """'all_gather_into_tensor in place' -> 'all-gather in place'."""
    name = op.replace("_into_tensor", "").replace("_single", "").replace("_", "-")
    return name if " " in name or not name.startswith("all-gather") else name + " out of place"


def plot_collectives(plt, reports: list[dict], out: Path) -> Path:
    fig, axes = plt.subplots(1, len(reports), figsize=(7.5 * len(reports), 5.5), squeeze=False,
                             sharey=True)
    for ax, report in zip(axes[0], reports, strict=True):
        rows = report["collectives"]["rows"]
        ops = list(dict.fromkeys(row["op"] for row in rows))
        sizes = sorted({row["bytes"] for row in rows})
        width = 0.8 / len(sizes)
        for j, size in enumerate(sizes):
            found = {row["op"]: row for row in rows if row["bytes"] == size}
            xs = [i + (j - (len(sizes) - 1) / 2) * width for i, op in enumerate(ops) if op in found]
            shown = [found[op] for op in ops if op in found]
            ax.bar(xs, [row["paired"]["median"] for row in shown], width,
                   label=f"{format_size(size)} pieces",
                   color=plt.cm.Greens(0.35 + 0.6 * j / len(sizes)))
            # The floor under 64 MiB is bound by one thread's launches: not drawn there.
            floors = [(x, row["floor"]["us"] / row["nccl"]["us"]) for x, row in zip(xs, shown)
                      if row.get("floor") and size >= 64 << 20]
            if floors:
                ax.scatter(*zip(*floors), marker="_", s=300, color=COLOURS["floor"], zorder=3,
                           label="copy-engine floor / NCCL" if j == len(sizes) - 1 else None)
        ax.axhline(1, color="tab:blue", linewidth=1, label="NCCL")
        ax.set_xticks(range(len(ops)), [op_name(op) for op in ops], rotation=30, ha="right",
                      fontsize=8)
        ax.set_title(label(report), fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("time per call, smfree / NCCL (paired median)")
    fig.suptitle("Collectives on the copy engines against NCCL; below 1: smfree faster\n"
                 + versions(reports), fontsize=10)
    fig.tight_layout()
    return save(fig, plt, out / "collectives.png")


def plot_bandwidth(plt, reports: list[dict], out: Path) -> Path:
    from smfree_pg.bench.bandwidth import MODE_TITLES, MODES
    fig, axes = plt.subplots(1, len(MODES), figsize=(13, 5), sharey=True)
    sizes = sorted({row["bytes"] for r in reports for row in r["bandwidth"]["rows"]})
    for ax, mode in zip(axes, MODES, strict=True):
        for report in reports:
            rows = report["bandwidth"]["rows"]
            for key, style in (("smfree", "-"), ("nccl", "-"), ("copy_engine", "--")):
                points = [(row["bytes"], row[key][mode]["GBps"]) for row in rows if row.get(key)]
                if points:
                    ax.plot(*zip(*points, strict=True), marker="o", linestyle=style,
                            color=COLOURS.get(key, "tab:gray"),
                            label=f"{NAMES.get(key, 'copy-engine limit')} ({label(report)})")
        size_axis(ax, sizes)
        ax.set_yscale("log")  # a linear axis flattens everything under 1 MiB
        ax.set_title(MODE_TITLES[mode])
        ax.legend(fontsize=8)
    axes[0].set_ylabel("GB/s one way (1 GB = 1e9 B)")
    fig.suptitle(f"Point-to-point bandwidth, ops posted from Python\n{versions(reports)}",
                 fontsize=10)
    fig.tight_layout()
    return save(fig, plt, out / "bandwidth.png")


PLOTS = {"roundtrip": plot_roundtrip, "pipelining": plot_pipelining,
         "collectives": plot_collectives, "bandwidth": plot_bandwidth}


def save(fig, plt, path: Path) -> Path:
    fig.savefig(path, dpi=110)
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

    reports = [load_report(path) for path in args.reports]
    out = Path(args.out) if args.out else Path(args.reports[0]).parent
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for section, plot in PLOTS.items():
        holding = [r for r in reports if section in r]
        if holding:
            written.append(plot(plt, holding, out))
    # A GEMM beside traffic: the overlap section, the captured one's, the collectives'.
    beside = [r for r in reports if "overlap" in r or "captured" in r
              or r.get("collectives", {}).get("gemm")]
    if beside:
        written.append(plot_slowdown(plt, beside, out))
    if not written:
        sys.exit("smfree_pg.bench.plot: no section to plot (roundtrip, pipelining, collectives, "
                 "bandwidth, overlap, captured)")
    for path in written:
        print(path)


if __name__ == "__main__":
    main()
