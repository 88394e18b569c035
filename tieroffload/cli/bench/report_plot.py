"""``tieroffload-bench report RUN.csv [--plot dash.png]``: a monitored run's summary and its
dashboard (memory per tier, I/O GB/s per kind against the disk, the share of each step spent
waiting, the loss), from the CSV that ``tieroffload.monitor.CSVWriter`` writes."""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
from typing import Any

from ...core.stats import KINDS
from .common import BenchError, check_output
from .report import figure

GiB = 1 << 30
MEMORY = (("params", "parameters"), ("grads", "gradients"), ("optimizer", "optimizer state"),
          ("activations", "activations"), ("staging", "staging"), ("parked", "parked pages"),
          ("tensors", "other tensors"), ("heap_free", "malloc free"), ("files", "code, files"),
          ("other", "other"))
LABELS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state",
          "activations": "activations"}
COLORS = {"params": "tab:blue", "grads": "tab:orange", "optimizer": "tab:green",
          "activations": "tab:purple"}
# each memory holder keeps its colour whichever others a run has (the kinds' as above)
HOLDER_COLORS = {**COLORS, "staging": "tab:cyan", "parked": "tab:olive", "tensors": "tab:brown",
                 "heap_free": "tab:pink", "files": "tab:gray", "other": "lightgray"}


def read_run(path: str | os.PathLike) -> dict[str, list[float | None]]:
    """The CSV's columns, as floats (None for an empty cell)."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as e:
        raise BenchError(f"{path}: {e.strerror}") from None
    if not rows or "step" not in rows[0]:
        raise BenchError(f"{path}: no records (a CSV written by tieroffload.monitor.CSVWriter "
                         "has a header with 'step' and one row per step)")
    return {k: [float(r[k]) if r[k] not in ("", None) else None for r in rows] for k in rows[0]}


def _col(run: dict[str, list], key: str) -> list[float]:
    return [v or 0.0 for v in run.get(key, [])]


def summary(run: dict[str, list]) -> str:
    """Medians over the run's steps, one line each."""
    steps = run["step"]
    wall = _col(run, "wall_s")
    med = statistics.median
    io = [(_col(run, "read_nvme")[i] + _col(run, "written_nvme")[i]) / wall[i] / 1e9
          for i in range(len(steps)) if wall[i] > 0]
    lines = [f"steps {int(steps[0])}-{int(steps[-1])} ({len(steps)})",
             f"step time      {med(wall):.3f} s median",
             f"waiting on I/O {100 * med(_col(run, 'wait_share')):.1f} % of the step, median",
             f"NVMe traffic   {med(io) if io else 0:.3f} GB/s median (read + write)",
             f"peak RSS       {max(_col(run, 'peak_rss')) / GiB:.2f} GiB"]
    loss = [v for v in run.get("loss", []) if v is not None]
    if loss:
        lines.append(f"loss           {loss[0]:.4f} -> {loss[-1]:.4f}")
    return "\n".join(lines)


def plot_dashboard(csv_path: str | os.PathLike, png_path: str | os.PathLike) -> Any:
    """Writes a PNG of four panels over the steps of a monitored run: memory (the RSS split
    by holder, its peak, and CUDA's allocated and reserved bytes where present), NVMe GB/s per
    kind with the disk's measured read and write GB/s, the share of each step spent waiting
    on I/O per kind, and the loss. Returns the Figure."""
    run = read_run(csv_path)
    steps = run["step"]
    fig = figure(figsize=(13, 8.5), layout="constrained")
    (mem, io), (wait, loss) = fig.subplots(2, 2, sharex=True)
    marker = "o" if len(steps) <= 30 else None

    parts = [(k, label, [v / GiB for v in _col(run, f"mem_{k}")]) for k, label in MEMORY
             if any(_col(run, f"mem_{k}"))]
    mem.stackplot(steps, *[p for _, _, p in parts], labels=[n for _, n, _ in parts],
                  colors=[HOLDER_COLORS[k] for k, _, _ in parts], alpha=0.85)
    mem.plot(steps, [v / GiB for v in _col(run, "peak_rss")], "k--", label="peak RSS (step)")
    for key, style, label in (("gpu_allocated", "r-", "GPU allocated"),
                              ("gpu_reserved", "r:", "GPU reserved")):
        if any(run.get(key) or []):
            mem.plot(steps, [v / GiB for v in _col(run, key)], style, label=label)
    mem.set_title("Memory: RAM (RSS) by holder")
    mem.set_ylabel("GiB")
    highest = max(max(line.get_ydata(), default=0) for line in mem.get_lines())
    mem.set_ylim(0, 1.45 * max(highest, max(_col(run, "rss")) / GiB))  # room for the legend
    mem.legend(fontsize=7, loc="upper left", ncol=4)

    wall = [w if w > 0 else float("nan") for w in _col(run, "wall_s")]
    top = 0.0
    for d, style, verb in (("read", "-", "read"), ("written", "--", "write")):
        total = [b / w / 1e9 for b, w in zip(_col(run, f"{d}_nvme"), wall)]
        top = max([top, *(t for t in total if t == t)])
        io.plot(steps, total, style, color="black", linewidth=2, label=f"all {verb}")
        for k in KINDS:
            gbps = [b / w / 1e9 for b, w in zip(_col(run, f"{d}_nvme_{k}"), wall)]
            if any(g > 0 for g in gbps):
                io.plot(steps, gbps, style, color=COLORS[k], marker=marker, markersize=3,
                        label=f"{LABELS[k]} {verb}")
    disk = 0.0
    for key, style, label in (("disk_read_gbps", "-", "disk read (measured)"),
                              ("disk_write_gbps", "--", "disk write (measured)")):
        figures = [v for v in run.get(key, []) if v is not None]
        if figures:
            disk = max(disk, figures[-1])
            io.axhline(figures[-1], color="gray", linestyle=style, linewidth=1.5, label=label)
    io.set_title("NVMe traffic per kind (bytes moved / step time)")
    io.set_ylabel("GB/s")
    if top > 0 and disk > 10 * top:  # the disk's line would flatten the traffic: log scale
        io.set_yscale("log")
        io.set_ylim(top / 3000, 2 * disk)
        io.set_title("NVMe traffic per kind (bytes moved / step time, log scale)")
    else:
        io.set_ylim(bottom=0)
    io.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside, not over

    shares = [[100 * s / w for s, w in zip(_col(run, f"wait_{k}_s"), wall)] for k in KINDS]
    wait.stackplot(steps, *shares, labels=[LABELS[k] for k in KINDS],
                   colors=[COLORS[k] for k in KINDS], alpha=0.85)
    wait.set_title("Share of each step spent waiting on I/O, per kind")
    wait.set_ylabel("% of step time")
    wait.set_xlabel("step")
    wait.set_ylim(0, max(5.0, 1.3 * max(map(sum, zip(*shares)), default=0)))
    wait.legend(fontsize=7, loc="upper left", ncol=4)

    losses = run.get("loss") or []
    points = [(s, v) for s, v in zip(steps, losses) if v is not None]
    if points:
        loss.plot(*zip(*points), "-", color="tab:red", marker=marker, markersize=3)
    else:
        loss.text(0.5, 0.5, "no loss recorded", ha="center", va="center",
                  transform=loss.transAxes)
    loss.set_title("Training loss")
    loss.set_ylabel("loss")
    loss.set_xlabel("step")
    for ax in (mem, io, wait, loss):
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)  # steps are whole numbers
    fig.suptitle(f"tieroffload run: {os.path.basename(os.fspath(csv_path))}, "
                 f"{len(steps)} steps, median step {statistics.median(_col(run, 'wall_s')):.3f} s")
    fig.savefig(png_path, dpi=80)
    return fig


def add_parser(sub: Any) -> None:
    """The ``report`` subcommand, on the main parser's subparsers."""
    p = sub.add_parser("report", help="summarise a monitored run's CSV, and plot its dashboard",
                       description="Reads the CSV that tieroffload.Monitor's CSVWriter wrote "
                                   "and prints medians; --plot writes the dashboard PNG.")
    p.add_argument("csv", metavar="RUN.csv", help="the monitor's CSV")
    p.add_argument("--plot", metavar="OUT.png", help="write the dashboard (PNG)")


def run(args: argparse.Namespace) -> int:
    """``tieroffload-bench report``: 0, or 2 with a one-line error."""
    try:
        check_output("--plot", args.plot, image=True)
        print(summary(read_run(args.csv)))
        if args.plot:
            plot_dashboard(args.csv, args.plot)
            print(f"dashboard written to {args.plot}")
    except BenchError as e:
        print(f"tieroffload-bench report: error: {e}", file=sys.stderr)
        return 2
    return 0
