"""The bench's results: medians per point, the recommended setting, the table and the plot."""

from __future__ import annotations

import collections
import os
import statistics
from typing import Any

from ...aio import swap
from ...aio.config import IOConfig
from ...aio.throughput import AGG_INFLIGHT, CHUNK
from . import common
from .common import ENGINE_PREFIX, WITHIN, BenchError, format_size


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median GB/s per (engine, direction, block size, queue depth), and its ratio to fio's
    median at the same point (None without fio)."""
    groups: dict[tuple[str, str, int, int], list[float]] = collections.defaultdict(list)
    for r in runs:
        groups[(r["engine"], r["direction"], r["block_size"], r["queue_depth"])].append(r["gbps"])
    medians = {k: statistics.median(v) for k, v in groups.items()}
    summary = []
    for (engine, direction, bs, qd), med in medians.items():
        ref = medians.get((common.FIO, direction, bs, qd))
        summary.append({"engine": engine, "direction": direction, "block_size": bs,
                        "queue_depth": qd, "gbps": med, "runs": len(groups[engine, direction,
                                                                            bs, qd]),
                        "ratio_to_fio": med / ref if ref else None})
    return summary


def recommend(summary: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tieroffload setting with the best harmonic mean of read and write GB/s; among those
    within WITHIN of it, the one with the least memory in flight (queue depth x block size)."""
    rows = {(r["engine"], r["direction"], r["block_size"], r["queue_depth"]): r for r in summary}
    scored = []
    for (engine, direction, bs, qd), read in rows.items():
        write = rows.get((engine, "write", bs, qd))
        if direction == "read" and engine.startswith(ENGINE_PREFIX) and write is not None:
            hmean = 2 / (1 / read["gbps"] + 1 / write["gbps"])
            scored.append((hmean, engine, bs, qd, read, write))
    best = max(s[0] for s in scored)
    _, engine, bs, qd, read, write = min(
        (s for s in scored if s[0] >= best * (1 - WITHIN)),
        key=lambda s: (s[2] * s[3], s[3], s[1] != ENGINE_PREFIX + "io_uring"))
    backend = engine[len(ENGINE_PREFIX):]
    recommended = IOConfig(backend=backend, block_size=bs, queue_depth=qd,
                           threads=qd if backend == "threads" else None).to_dict()
    fio_read = rows.get((common.FIO, "read", bs, qd))
    fio_write = rows.get((common.FIO, "write", bs, qd))
    figures = {"read_gbps": read["gbps"], "write_gbps": write["gbps"],
               "fio_read_gbps": fio_read["gbps"] if fio_read else None,
               "fio_write_gbps": fio_write["gbps"] if fio_write else None,
               "read_ratio_to_fio": read["ratio_to_fio"],
               "write_ratio_to_fio": write["ratio_to_fio"]}
    return recommended, figures


def format_table(result: dict[str, Any]) -> str:
    """The printed report: one line per (direction, block size, queue depth), each engine's
    median GB/s and, in brackets, its ratio to fio there; then the recommendation, the aggregate
    rows (when there are any) and notes."""
    rows = {(r["engine"], r["direction"], r["block_size"], r["queue_depth"]): r
            for r in result["summary"]}
    engines = [e for e in result["engines"] if any(r[0] == e for r in rows)]
    points = sorted({k[1:] for k in rows})
    labels = [e[len(ENGINE_PREFIX):] if e.startswith(ENGINE_PREFIX) else e for e in engines]
    width = 14
    out = [f"tieroffload-bench nvme: {format_size(result['size'])} in {result['dir']}, "
           f"median of {result['repeats']} runs in GB/s (1e9 B/s), (ratio to fio at the same "
           "block size and queue depth); io_uring and threads are tieroffload's backends",
           f"{'dir':<6}{'block':>6}{'qd':>5}  " + "".join(f"{x:>{width}}" for x in labels)]
    for direction, bs, qd in points:
        cells = []
        for e in engines:
            r = rows.get((e, direction, bs, qd))
            if r is None:
                cells.append("-")
            elif e == common.FIO or r["ratio_to_fio"] is None:
                cells.append(f"{r['gbps']:.2f}")
            else:
                cells.append(f"{r['gbps']:.2f} ({r['ratio_to_fio']:.2f})")
        out.append(f"{direction:<6}{format_size(bs):>6}{qd:>5}  "
                   + "".join(f"{c:>{width}}" for c in cells))
    rec, fig = result["recommended"], result["recommended_figures"]
    line = (f"recommended: backend={rec['backend']} block_size={format_size(rec['block_size'])} "
            f"queue_depth={rec['queue_depth']} threads={rec['threads']}: "
            f"read {fig['read_gbps']:.2f} GB/s, write {fig['write_gbps']:.2f} GB/s")
    if fig["read_ratio_to_fio"] is not None and fig["write_ratio_to_fio"] is not None:
        line += (f" ({fig['read_ratio_to_fio']:.2f} and {fig['write_ratio_to_fio']:.2f} of fio's "
                 f"{fig['fio_read_gbps']:.2f} and {fig['fio_write_gbps']:.2f})")
    out.append(line)
    out.extend(_aggregate_table(result))
    out.extend(f"note: {n}" for n in result["notes"])
    return "\n".join(out)


def _aggregate_table(result: dict[str, Any]) -> list[str]:
    rows = result.get("aggregate") or []
    if not rows:
        return []
    dirs = result["dirs"]
    over = (f"{dirs[0]} (1 dir) and striped in {format_size(swap.STRIPE)} over "
            f"{', '.join(dirs)} ({len(dirs)} dirs)" if len(dirs) > 1 else dirs[0])
    out = [f"aggregate at the recommended setting: {format_size(result['size'])} per process in "
           f"{format_size(min(CHUNK, result['size']))} requests, {AGG_INFLIGHT} in flight, over "
           f"{over}; GB/s (1e9 B/s)",
           f"{'dirs':>4}{'procs':>6}  {'dir':<6}{'total':>7}  per process"]
    for r in rows:
        per = " ".join(f"{g:.2f}" for g in r["per_proc_gbps"])
        out.append(f"{r['dirs']:>4}{r['procs']:>6}  {r['direction']:<6}{r['total_gbps']:>7.2f}  "
                   f"{per}")
    return out


def figure(**kw: Any) -> Any:
    """A matplotlib Figure drawn by the Agg canvas, leaving pyplot's backend (a notebook's
    inline one, say) as it was."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise BenchError("--plot needs matplotlib, which is not installed "
                         "(pip install matplotlib, or pip install 'tieroffload[bench]')") from None
    fig = Figure(**kw)
    FigureCanvasAgg(fig)
    return fig


def plot(result: dict[str, Any], path: str | os.PathLike) -> Any:
    """Writes a PNG: GB/s against queue depth, one panel per direction and block size, one line
    per engine (the serial loops are single points at queue depth 1). Returns the Figure (a
    notebook shows it)."""
    summary = result["summary"]
    block_sizes = sorted({r["block_size"] for r in summary})
    depths = sorted({r["queue_depth"] for r in summary})
    engines = result["engines"]
    fig = figure(figsize=(4.5 * len(block_sizes), 7.5))
    axes = fig.subplots(2, len(block_sizes), squeeze=False)
    for i, direction in enumerate(("read", "write")):
        top = 1.1 * max(r["gbps"] for r in summary if r["direction"] == direction)
        for j, bs in enumerate(block_sizes):
            ax = axes[i][j]
            for e in engines:
                pts = sorted((r["queue_depth"], r["gbps"]) for r in summary
                             if r["engine"] == e and r["direction"] == direction
                             and r["block_size"] == bs)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=e,
                            linestyle="--" if e == common.FIO else "-")
            ax.set_xscale("log", base=2)
            ax.set_xticks(depths, [str(d) for d in depths])
            ax.set_title(f"{direction}, {format_size(bs)} blocks")
            ax.set_xlabel("queue depth")
            ax.set_ylabel("GB/s (1e9 B/s)")
            ax.set_ylim(0, top)  # one scale per row, so block sizes compare at a glance
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.suptitle(f"tieroffload-bench nvme: {format_size(result['size'])} in {result['dir']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return fig
