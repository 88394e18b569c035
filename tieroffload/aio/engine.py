"""The engine: backends, request futures, and the errors every failure becomes.

The native core (``tieroffload._native``) takes addresses, sizes, descriptors and offsets and
runs them on io_uring or a thread pool; failures become ``AIOError`` (an ``OSError`` that names
the errno, the path and the offset).
"""

from __future__ import annotations

import asyncio
import atexit
import errno as _errno
import logging
import os
import threading
import weakref
from typing import Any, Callable

from .. import _native

MAX_QUEUE_DEPTH = 4096  # requests in flight; io_uring refuses rings much larger than this
MAX_THREADS = 1024
MAX_BLOCK_SIZE = 1 << 30  # a read or write moves at most about 2 GiB in one call


def check_io_settings(block_size: int, queue_depth: int, threads: int | None,
                      prefix: str = "") -> None:
    """Raises ValueError naming ``prefix + field`` and its value unless the engine settings work:
    block_size a positive multiple of 4096 (a page, which O_DIRECT accepts on every device),
    queue_depth in [1, MAX_QUEUE_DEPTH], threads (None: the default) in [1, MAX_THREADS]."""
    for name, value in (("block_size", block_size), ("queue_depth", queue_depth),
                        ("threads", threads)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{prefix}{name} must be an int, not {type(value).__name__}")
    if block_size < 4096 or block_size % 4096 or block_size > MAX_BLOCK_SIZE:
        raise ValueError(f"{prefix}block_size must be a multiple of 4096 between 4096 and "
                         f"{MAX_BLOCK_SIZE} (1 GiB), not {block_size}")
    if not 1 <= queue_depth <= MAX_QUEUE_DEPTH:
        raise ValueError(f"{prefix}queue_depth must be between 1 and {MAX_QUEUE_DEPTH}, "
                         f"not {queue_depth}")
    if threads is not None and not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"{prefix}threads must be between 1 and {MAX_THREADS}, not {threads}")

log = logging.getLogger("tieroffload.aio")

_said_once: set[str] = set()


def warn_once(key: str, msg: str) -> None:
    if key not in _said_once:
        _said_once.add(key)
        log.warning(msg)


class AIOError(OSError):
    """An I/O failure: ``errno``, ``strerror``, ``filename`` and ``offset`` (into the file)."""

    def __init__(self, err: int, msg: str, path: str | None = None, offset: int | None = None):
        super().__init__(err, msg, path)
        self.offset = offset

    def __str__(self) -> str:
        where = f" at offset {self.offset}" if self.offset is not None else ""
        return f"[Errno {self.errno}] {self.strerror}: {self.filename!r}{where}"


class AlignmentError(AIOError, ValueError):
    """A buffer, size or offset that O_DIRECT cannot take (errno EINVAL)."""


_error_classes: dict[type, type] = {}


def error_for(err: int, msg: str, path: str | None, offset: int | None = None) -> AIOError:
    """An AIOError that is also the matching builtin (FileNotFoundError for ENOENT, ...)."""
    base = type(OSError(err, msg))
    if base is OSError:
        return AIOError(err, msg, path, offset)
    cls = _error_classes.get(base)
    if cls is None:
        cls = _error_classes[base] = type(f"AIO{base.__name__}", (AIOError, base), {})
    return cls(err, msg, path, offset)


def backends() -> list[str]:
    """The backends that work in this process: io_uring when built and allowed, then threads."""
    names = ["threads"]
    if _native.uring_compiled() and _native.uring_probe() == 0:
        names.insert(0, "io_uring")
    return names


def _uring_refusal() -> str:
    if not _native.uring_compiled():
        return "tieroffload was built without liburing (install liburing-dev and reinstall)"
    err = _native.uring_probe()
    hint = " (a seccomp profile, e.g. Docker's default, blocks it)" if err == _errno.EPERM else ""
    return f"io_uring_setup failed with {_errno.errorcode.get(err, err)}: {os.strerror(err)}{hint}"


_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


class Engine:
    """Moves bytes between memory and files: each request is split into ``block_size`` pieces,
    at most ``queue_depth`` of them in flight; short transfers are resubmitted for the rest.

    ``backend``: "auto" (io_uring where it works, else threads), "io_uring" or "threads". When
    io_uring cannot be used here the engine falls back to threads and logs why, once.
    ``threads``: workers of the threads backend (default: ``min(queue_depth, 32)``).
    """

    def __init__(
        self,
        backend: str = "auto",
        queue_depth: int = 32,
        block_size: int = 1 << 20,
        threads: int | None = None,
        *,
        _short_io: int = 0,
    ) -> None:
        if backend not in ("auto", "io_uring", "threads"):
            raise ValueError(f"backend must be 'auto', 'io_uring' or 'threads', not {backend!r}")
        check_io_settings(block_size, queue_depth, threads)
        if backend in ("auto", "io_uring") and "io_uring" not in backends():
            warn_once("uring", f"io_uring is unavailable: {_uring_refusal()}; "
                                "using the threads backend")
            backend = "threads"
        elif backend == "auto":
            backend = "io_uring"
        self.queue_depth = queue_depth
        self.block_size = block_size
        self.threads = threads if threads is not None else min(queue_depth, 32)
        self._impl = _native.Engine(backend, queue_depth, block_size, self.threads, _short_io)
        _engines.add(self)

    @property
    def backend(self) -> str:
        """The backend in use: "io_uring" or "threads"."""
        return self._impl.backend

    @property
    def closed(self) -> bool:
        return self._impl.closed

    def close(self) -> None:
        """Waits for what is in flight, then stops the engine's threads."""
        self._impl.close()

    def __del__(self) -> None:
        # Closed here, where the native close() waits without the GIL, rather than in the
        # native destructor, which holds it: a done-callback still running in an I/O thread
        # needs the GIL to finish, and close() waits for it.
        impl = getattr(self, "_impl", None)
        if impl is not None:
            impl.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Engine(backend={self.backend!r}, queue_depth={self.queue_depth}, "
                f"block_size={self.block_size}, threads={self.threads})")


_default: Engine | None = None
_default_lock = threading.Lock()


def default_engine() -> Engine:
    """The process-wide engine used when ``engine=None``."""
    global _default
    with _default_lock:
        if _default is None or _default.closed:
            _default = Engine()
        return _default


@atexit.register
def _close_all() -> None:
    # I/O threads must be joined before the interpreter goes away.
    for eng in list(_engines):
        eng.close()


class Future:
    """The result of one read or write: ``result()`` blocks (without the GIL) and returns the
    byte count or raises ``AIOError``; ``await fut`` works from asyncio. A request that
    ``result()`` waits on goes ahead of the requests queued before it that nobody waits on
    yet: a read that compute needs now does not queue behind a write behind."""

    __slots__ = ("_req", "_engine", "_path", "_offset", "_nbytes", "_write")

    def __init__(self, req: Any, engine: Engine, path: str, offset: int, nbytes: int,
                 write: bool) -> None:
        self._req = req
        # Weak: a future kept by its own done-callback would otherwise hold the last reference
        # to the engine, whose close() then ran in the I/O thread that it joins.
        self._engine = weakref.ref(engine)
        self._path = path
        self._offset = offset
        self._nbytes = nbytes
        self._write = write

    def done(self) -> bool:
        return self._req.done()

    def result(self, timeout: float | None = None) -> int:
        engine = self._engine()
        if engine is not None and not self._req.done():
            engine._impl.hurry(self._req)
        if not self._req.wait(-1.0 if timeout is None else float(timeout)):
            raise TimeoutError(f"I/O on {self._path!r} not done after {timeout} s")
        err = self._req.error
        if err:
            raise self._failure(err, self._req.error_offset)
        return self._req.bytes

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            self.result(timeout)
        except AIOError as e:
            return e
        return None

    def add_done_callback(self, fn: Callable[[Future], None]) -> None:
        """Calls ``fn(self)`` once done: at once if it is, else from an I/O thread. As with
        ``concurrent.futures``, ``result()`` in another thread may return before ``fn`` has run."""
        self._req.on_done(lambda: fn(self))

    def __await__(self):
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()

        def settle() -> None:
            if waiter.cancelled():
                return
            try:
                waiter.set_result(self.result())
            except AIOError as e:
                waiter.set_exception(e)

        self._req.on_done(lambda: loop.call_soon_threadsafe(settle))
        return waiter.__await__()

    def _failure(self, err: int, offset: int) -> AIOError:
        what = "write" if self._write else "read"
        span = f"{self._nbytes} bytes at offset {self._offset}"
        if err == _errno.ENODATA and not self._write:
            try:
                size = os.stat(self._path).st_size
            except OSError:
                size = "?"
            msg = f"read past the end of the file ({what} of {span}; the file has {size} bytes)"
            return error_for(err, msg, self._path, offset)
        return error_for(err, f"{os.strerror(err)} ({what} of {span})", self._path, offset)


