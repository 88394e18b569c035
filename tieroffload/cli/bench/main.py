"""``tieroffload-bench``: the command line over ``run_nvme``."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any

from . import report_plot
from .common import (
    DEFAULT_SIZE,
    QUICK_SIZE,
    BenchError,
    check_output,
    format_size,
    stopping,
)
from .report import figure, format_table, plot

EXTRA = "pip install 'tieroffload[bench]'"  # tqdm, aiofiles, matplotlib


def _run_nvme() -> Any:
    """``run_nvme``, whose import needs the ``bench`` extra: missing, a one-line error."""
    try:
        from .nvme import run_nvme
    except ImportError as e:
        if e.name not in ("tqdm", "aiofiles"):
            raise
        raise BenchError(f"nvme needs the bench extra ({e.name} is not installed): "
                         f"{EXTRA}") from None
    return run_nvme


def main(argv: list[str] | None = None) -> int:
    """``tieroffload-bench nvme --dir DIR [--dir DIR2 ...] [--procs N] [--size 1G] [--quick]
    [--json F] [--plot F]``."""
    parser = argparse.ArgumentParser(
        prog="tieroffload-bench",
        description="Measures the disk (fio), tieroffload on it and the alternatives, side by "
                    f"side, and says which I/O settings to use. Needs the bench extra: {EXTRA}.")
    sub = parser.add_subparsers(dest="command", required=True)
    nvme = sub.add_parser(
        "nvme", help="sequential O_DIRECT read/write sweep of one scratch file",
        description="Sweeps read and write over block sizes and queue depths for fio (io_uring), "
                    "each tieroffload backend, a Python loop, aiofiles and DeepSpeed (when it "
                    "loads); prints a table and the recommended settings. With several --dir "
                    "or --procs N, then measures the recommended setting striped over all the "
                    "directories and with N processes at once.")
    nvme.add_argument("--dir", required=True, action="append",
                      help="directory on the disk to measure; give it once per drive to also "
                           "measure them striped together (the sweep runs in the first)")
    nvme.add_argument("--procs", type=int, default=1,
                      help="also measure with this many processes at once, each with its own "
                           "files (default 1)")
    nvme.add_argument("--size", help="scratch file size, e.g. 1G, 512M, 1GiB "
                                     f"(default {format_size(DEFAULT_SIZE)}, "
                                     f"{format_size(QUICK_SIZE)} with --quick)")
    nvme.add_argument("--quick", action="store_true",
                      help="1M blocks at queue depth 8 and 32, one repeat (well under 30 s)")
    nvme.add_argument("--repeats", type=int,
                      help="interleaved repeats per point, medians reported (default 3, 1 quick)")
    nvme.add_argument("--json", metavar="OUT.json",
                      help="write every measurement and the recommended block")
    nvme.add_argument("--plot", metavar="OUT.png", help="write GB/s against queue depth (PNG)")
    report_plot.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "report":
        return report_plot.run(args)

    # SIGTERM takes the same way out as Ctrl-C, so the scratch file is removed either way;
    # the caller's handlers come back at the end (main may run inside a notebook or a test).
    stopping.clear()
    previous = {sig: signal.signal(sig, _on_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        check_output("--json", args.json)
        check_output("--plot", args.plot, image=True)
        if args.json and args.plot and os.path.abspath(args.json) == os.path.abspath(args.plot):
            raise BenchError(f"--json and --plot name the same file {args.plot}: give two")
        if args.plot:
            figure()  # matplotlib missing fails now, not after minutes of measuring
        run_nvme = _run_nvme()
        result = run_nvme(args.dir, args.size, quick=args.quick, repeats=args.repeats,
                          procs=args.procs)
        if stopping.is_set():
            raise KeyboardInterrupt
        print(format_table(result))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        if args.plot:
            plot(result, args.plot)
    except BenchError as e:
        print(f"tieroffload-bench nvme: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tieroffload-bench nvme: interrupted; scratch files removed", file=sys.stderr)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _on_interrupt(signum: int, frame: Any) -> None:
    """Ctrl-C's way out, for SIGINT and SIGTERM alike: sets ``stopping``, which the sweep checks
    before each point and loops running in other threads (aiofiles's event loop) check per
    block, then raises in the main thread."""
    stopping.set()
    raise KeyboardInterrupt
