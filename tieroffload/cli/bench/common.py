"""What every part of the NVMe bench shares: its sizes and limits, its error, input checks."""

from __future__ import annotations

import collections
import ctypes
import os
import shutil
import signal
import subprocess
import threading
from typing import Callable

from ... import aio
from ...aio import swap

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

BLOCK_SIZES = (128 * KiB, MiB, 8 * MiB)
QUEUE_DEPTHS = (1, 8, 32, 128)
QUICK_BLOCK_SIZES = (MiB,)
QUICK_QUEUE_DEPTHS = (8, 32)
DEFAULT_SIZE = GiB
QUICK_SIZE = 256 * MiB
MIN_SIZE = 8 * MiB
# Seconds one measurement may take before it stops submitting: bounds the slow points
# (queue depth 1, small blocks) so that a full sweep stays within minutes.
TIME_CAP = 1.0
QUICK_TIME_CAP = 0.5
# DeepSpeed's aio_handle reads or writes a whole tensor from file offset 0, so its figure covers
# at most this many bytes.
DEEPSPEED_MAX = GiB
# Configurations within this fraction of the best are taken as equal: the smaller one is advised.
WITHIN = 0.03
FIO = "fio"
ENGINE_PREFIX = "tieroffload/"


class BenchError(ValueError):
    """Bad input, told in one line (the CLI prints it and exits with code 2)."""


class FioFailed(RuntimeError):
    """fio ran but failed (e.g. a build without io_uring): the run goes on without it."""


def format_size(n: int) -> str:
    """128K, 1M, 8M, 1G: the short binary form fio and the table use."""
    for unit, scale in (("P", 1 << 50), ("T", 1 << 40), ("G", GiB), ("M", MiB), ("K", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n / MiB:.1f}M" if n >= MiB else str(n)



stopping = threading.Event()  # set by Ctrl-C (main._on_interrupt)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with(parent: int) -> Callable[[], None]:
    """Called in a child (``preexec_fn``, before exec; or first thing in a spawned worker):
    SIGKILL when the bench, ``parent``, dies (even by SIGKILL, Linux's PR_SET_PDEATHSIG);
    where it is gone already, exit at once."""
    def arm() -> None:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):  # not Linux: Ctrl-C's kill in run_child remains
            return
        if os.getppid() != parent:
            os._exit(1)
    return arm


def run_child(cmd: list[str]) -> subprocess.CompletedProcess:
    """``subprocess.run`` of a child (fio) that never outlives the bench: killed where the
    bench is interrupted (run kills it on any exception, KeyboardInterrupt included), and by
    the kernel where the bench is killed."""
    return subprocess.run(cmd, capture_output=True, text=True,
                          preexec_fn=die_with(os.getpid()))


def check_dir(directory: str) -> None:
    if not os.path.exists(directory):
        raise BenchError(f"--dir {directory}: no such directory")
    if not os.path.isdir(directory):
        raise BenchError(f"--dir {directory}: not a directory")


def check_space(directories: list[str], size: int, procs: int, aggregate: bool) -> None:
    """Each device must hold the most that is on it at one time: the sweep's scratch file, then
    (aggregate) ``procs`` files of ``size`` in the first directory, then ``procs`` striped files
    over all the directories (directories on one device counted together)."""
    devices = [os.stat(d).st_dev for d in directories]
    phases = [{devices[0]: size}]
    if aggregate:
        phases.append({devices[0]: procs * size})
        striped: dict[int, int] = collections.Counter()
        for i, dev in enumerate(devices):
            striped[dev] += procs * aio.stripe_share(size, len(directories), i, swap.STRIPE)
        phases.append(striped)
    first: dict[int, str] = {}
    for dev, directory in zip(devices, directories):
        first.setdefault(dev, directory)
    for dev, directory in first.items():
        need = max(phase.get(dev, 0) for phase in phases)
        free = shutil.disk_usage(directory).free
        if free < need:
            per = f" per process x --procs {procs}" if procs > 1 else ""
            raise BenchError(f"--dir {directory}: not enough free space for --size "
                             f"{format_size(size)}{per} ({need / 1e9:.3g} GB needed, "
                             f"{free / 1e9:.3g} GB free)")


def device_notes(directories: list[str]) -> list[str]:
    groups: dict[int, list[str]] = collections.defaultdict(list)
    for d in directories:
        groups[os.stat(d).st_dev].append(d)
    shared = [g for g in groups.values() if len(g) > 1]
    if len(shared) == 1 and len(shared[0]) == len(directories):
        return ["these directories share one device: their bandwidths do not add"]
    return [f"{' and '.join(g)} share one device: their bandwidths do not add" for g in shared]


# What matplotlib's savefig writes, by the file's suffix.
IMAGE_SUFFIXES = (".png", ".pdf", ".svg", ".svgz", ".jpg", ".jpeg", ".eps", ".ps", ".tif",
                  ".tiff", ".webp", ".pgf")


def check_output(flag: str, path: str | None, image: bool = False) -> None:
    """An output path that cannot be written (a missing or read-only folder, a folder at the
    path, with ``image`` a suffix matplotlib cannot write) fails now, not after minutes of
    measuring."""
    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise BenchError(f"{flag} {path}: no such directory {parent}")
    if os.path.isdir(path):
        raise BenchError(f"{flag} {path}: is a directory; give a file name in it")
    if not os.access(path if os.path.exists(path) else parent, os.W_OK):
        raise BenchError(f"{flag} {path}: not writable")
    if image and os.path.splitext(path)[1].lower() not in IMAGE_SUFFIXES:
        raise BenchError(f"{flag} {path}: not an image file name; end it in "
                         f"{', '.join(IMAGE_SUFFIXES[:3])} or another of {IMAGE_SUFFIXES}")
