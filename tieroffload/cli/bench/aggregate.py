"""The bench's aggregate rows: several processes streaming their own files at once."""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import sys
import threading
from typing import Any

from tqdm import tqdm

from ...aio.throughput import bench_paths, run_files
from . import common


def _agg_worker(rank: int, barrier: Any, tasks: Any, results: Any, parent: int) -> None:
    """A spawned process: runs the tasks it is sent until None; a failure breaks the barrier
    so that the others stop too, and is sent back as text (aio's errors do not all pickle).
    It dies with the bench (it holds its task queue's write end too: no EOF would come)."""
    common.die_with(parent)()
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        while (task := tasks.get()) is not None:
            try:
                results.put((rank, run_files(rank, barrier, task), None))
            except Exception as e:
                barrier.abort()
                broken = isinstance(e, threading.BrokenBarrierError)
                results.put((rank, None, (broken, f"{type(e).__name__}: {e}")))
    except KeyboardInterrupt:
        pass  # the parent is stopping: the files went in run_files's finally


class _Workers:
    """``procs`` spawned processes that start each task together (a shared barrier)."""

    def __init__(self, procs: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.results = ctx.Queue()
        self.tasks = [ctx.SimpleQueue() for _ in range(procs)]
        # Kept here: the children unpickle its semaphores after start() returns.
        self.barrier = ctx.Barrier(procs)
        self.procs = [ctx.Process(target=_agg_worker, args=(r, self.barrier, self.tasks[r],
                                                             self.results, os.getpid()),
                                  name=f"tieroffload-bench-{r}", daemon=True)
                      for r in range(procs)]
        for p in self.procs:
            p.start()

    def run(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        for t in self.tasks:
            t.put(task)
        got: dict[int, Any] = {}
        errors: list[tuple[bool, str]] = []
        while len(got) + len(errors) < len(self.procs):
            try:
                rank, out, err = self.results.get(timeout=0.5)
            except queue.Empty:
                dead = [p for p in self.procs if p.exitcode is not None]
                if dead:
                    raise RuntimeError(f"bench process {dead[0].name} died (exit code "
                                       f"{dead[0].exitcode})") from None
                continue
            if err is None:
                got[rank] = out
            else:
                errors.append((err[0], f"bench process {rank}: {err[1]}"))
        if errors:
            # The first cause, not the broken barrier it left the others with.
            raise RuntimeError(min(errors)[1])
        return [got[r] for r in range(len(self.procs))]

    def close(self) -> None:
        for t, p in zip(self.tasks, self.procs):
            if p.exitcode is None:
                try:
                    t.put(None)
                except OSError:
                    pass
        for p in self.procs:
            p.join(10)
            if p.exitcode is None:
                p.terminate()  # SIGTERM: the worker still removes its files
                p.join(10)
            if p.exitcode is None:
                p.kill()
                p.join()
        self.results.close()


def aggregate_rows(directories: list[str], direct: list[bool], size: int, procs: int,
               io: dict[str, Any], progress: bool) -> tuple[list[dict[str, Any]], bool]:
    """The aggregate rows for (1 directory, all of them) x (1 process, ``procs``), and whether
    the reads were cold. One process runs here; several are spawned, and start together."""
    tag = str(os.getpid())
    configs = sorted({(k, p) for k in (1, len(directories)) for p in (1, procs)},
                     key=lambda c: (c[1], c[0]))
    rows: list[dict[str, Any]] = []
    cold = True
    workers = None
    bar = tqdm(total=len(configs), unit="run", disable=not progress, file=sys.stderr,
               desc="aggregate")
    try:
        for k, p in configs:
            bar.set_postfix_str(f"{k} dir{'s' if k > 1 else ''}, {p} "
                                f"process{'es' if p > 1 else ''}")
            task = {"dirs": directories[:k], "direct": direct[:k], "size": size, "io": io,
                    "tag": tag}
            if p == 1:
                outs = [run_files(0, threading.Barrier(1), task)]
            else:
                if workers is None:
                    workers = _Workers(procs)
                outs = workers.run(task)
            cold = bool(outs[0]["cold"]) and cold
            for direction in ("read", "write"):
                spans = [o[direction] for o in outs]
                wall = max(e for _, e, _ in spans) - min(s for s, _, _ in spans)
                rows.append({"dirs": k, "procs": p, "direction": direction,
                             "per_proc_gbps": [b / (e - s) / 1e9 for s, e, b in spans],
                             "total_gbps": sum(b for _, _, b in spans) / wall / 1e9})
            bar.update()
    finally:
        bar.close()
        if workers is not None:
            workers.close()
        # Whatever a killed process could not remove.
        for r in range(procs):
            for path in bench_paths(directories, tag, r):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
    return rows, cold
