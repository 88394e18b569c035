"""Async file I/O between host memory and NVMe, over the native engine.

The native core (``tieroffload._native``) takes addresses, sizes, descriptors and offsets; this
layer turns tensors, numpy arrays and buffer objects into those, checks what O_DIRECT needs before
anything reaches the kernel, keeps buffers alive while the kernel uses them, and turns failures into
``AIOError`` (an ``OSError`` that names the errno, the path and the offset).
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import errno as _errno
import logging
import os
import threading
import weakref
from typing import Any, Callable

import numpy as np
import torch

from . import _native

__all__ = [
    "AIOError",
    "AlignmentError",
    "Engine",
    "File",
    "Future",
    "aligned_empty",
    "backends",
    "default_engine",
    "open",
]

log = logging.getLogger("tieroffload.aio")

_said_once: set[str] = set()


def _warn_once(key: str, msg: str) -> None:
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


def _error(err: int, msg: str, path: str | None, offset: int | None = None) -> AIOError:
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
        if queue_depth < 1:
            raise ValueError(f"queue_depth must be at least 1, not {queue_depth}")
        if block_size < 512 or block_size % 512:
            raise ValueError(f"block_size must be a positive multiple of 512, not {block_size}")
        if backend in ("auto", "io_uring") and "io_uring" not in backends():
            _warn_once("uring", f"io_uring is unavailable: {_uring_refusal()}; "
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
    byte count or raises ``AIOError``; ``await fut`` works from asyncio."""

    __slots__ = ("_req", "_path", "_offset", "_nbytes", "_write")

    def __init__(self, req: Any, path: str, offset: int, nbytes: int, write: bool) -> None:
        self._req = req
        self._path = path
        self._offset = offset
        self._nbytes = nbytes
        self._write = write

    def done(self) -> bool:
        return self._req.done()

    def result(self, timeout: float | None = None) -> int:
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
            return _error(err, msg, self._path, offset)
        return _error(err, f"{os.strerror(err)} ({what} of {span})", self._path, offset)


def _memory(buf: Any, writable: bool) -> tuple[int, int, Any]:
    """(address, nbytes, object to keep alive) of a CPU tensor, numpy array or buffer object."""
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise ValueError(f"buffer must be a CPU tensor, not one on {buf.device}")
        if not buf.is_contiguous():
            raise ValueError("buffer tensor must be contiguous")
        return buf.data_ptr(), buf.numel() * buf.element_size(), buf
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("buffer array must be C-contiguous")
        if writable and not buf.flags.writeable:
            raise ValueError("buffer array is read-only; a read needs a writable buffer")
        return buf.ctypes.data, buf.nbytes, buf
    try:
        mv = memoryview(buf)
    except TypeError:
        raise TypeError(f"buffer must be a CPU tensor, a numpy array or a buffer object, "
                        f"not {type(buf).__name__}") from None
    if not mv.c_contiguous:
        raise ValueError("buffer must be contiguous")
    if writable and mv.readonly:
        raise ValueError(f"buffer {type(buf).__name__} is read-only; a read needs a writable one")
    arr = np.frombuffer(mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv, dtype=np.uint8)
    return arr.ctypes.data, arr.nbytes, (buf, mv, arr)


def aligned_empty(nbytes: int, pin: bool | None = None) -> torch.Tensor:
    """An uninitialised ``torch.uint8`` tensor of ``nbytes`` that O_DIRECT accepts: page aligned,
    exactly sized (no power-of-two rounding), and pinned for CUDA when a GPU is present (or
    ``pin=True``). Its memory goes back to the OS when the tensor is freed."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, not {nbytes}")
    if pin is None:
        pin = torch.cuda.is_available()
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    buf = _native.AlignedBuffer(nbytes)
    if pin:
        cudart = torch.cuda.cudart()
        addr = buf.address
        rc = cudart.cudaHostRegister(addr, nbytes, 0)
        if int(rc) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with {rc}")
        buf.set_on_free(lambda: cudart.cudaHostUnregister(addr))
    return torch.frombuffer(buf, dtype=torch.uint8)


class _Inflight:
    """Requests a file has in flight and the buffers they use: kept alive until done, so that
    dropping a Future never frees memory the kernel is still writing."""

    def __init__(self) -> None:
        self._items: collections.deque[tuple[Any, Any]] = collections.deque()
        self._lock = threading.Lock()

    def add(self, req: Any, keep: Any) -> None:
        with self._lock:
            items = self._items
            while items and items[0][0].done():
                items.popleft()
            if len(items) > 4096:
                self._items = items = collections.deque(i for i in items if not i[0].done())
            items.append((req, keep))

    def wait_all(self) -> None:
        with self._lock:
            items, self._items = self._items, collections.deque()
        for req, _ in items:
            req.wait(-1.0)


_MODES = {"r": os.O_RDONLY, "r+": os.O_RDWR, "w+": os.O_RDWR | os.O_CREAT | os.O_TRUNC}


class File:
    """A file opened for async positional I/O. Use ``aio.open``."""

    def __init__(self, path: str | os.PathLike, mode: str = "r", engine: Engine | None = None,
                 direct: bool = True) -> None:
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {sorted(_MODES)}, not {mode!r}")
        self.path = os.fspath(path)
        self.mode = mode
        self.engine = engine if engine is not None else default_engine()
        if self.engine.closed:
            raise _error(_errno.EBADF, "the engine is closed", self.path)
        flags = _MODES[mode] | os.O_CLOEXEC
        self.direct = direct
        if direct:
            try:
                self._fd = os.open(self.path, flags | os.O_DIRECT, 0o644)
            except OSError as e:
                if e.errno != _errno.EINVAL:
                    raise _error(e.errno, e.strerror, self.path) from None
                _warn_once(f"nodirect:{os.path.dirname(os.path.abspath(self.path))}",
                           f"{self.path}: the file system refuses O_DIRECT; "
                           "using buffered I/O for files there")
                self.direct = False
        if not self.direct:
            try:
                self._fd = os.open(self.path, flags, 0o644)
            except OSError as e:
                raise _error(e.errno, e.strerror, self.path) from None
        if self.direct:
            self.mem_align, self.align = _native.dio_alignment(self._fd)
        else:
            self.mem_align, self.align = 1, 1
        self._inflight = _Inflight()
        self._closed = False

    def fileno(self) -> int:
        return self._fd

    @property
    def closed(self) -> bool:
        return self._closed

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def allocate(self, nbytes: int) -> None:
        """Reserves ``nbytes`` on disk now (posix_fallocate), so a full disk fails here, early."""
        try:
            os.posix_fallocate(self._fd, 0, nbytes)
        except OSError as e:
            msg = f"{e.strerror} (reserving {nbytes} bytes)"
            raise _error(e.errno, msg, self.path, 0) from None

    def sync(self) -> None:
        """Waits for this file's requests, then fsyncs it."""
        self._inflight.wait_all()
        os.fsync(self._fd)

    def pread(self, buf: Any, offset: int = 0, nbytes: int | None = None) -> Future:
        """Reads ``nbytes`` (default: all of ``buf``) at ``offset`` into ``buf``."""
        return self._submit(buf, offset, nbytes, write=False)

    def pwrite(self, buf: Any, offset: int = 0, nbytes: int | None = None) -> Future:
        """Writes ``nbytes`` (default: all of ``buf``) from ``buf`` at ``offset``."""
        if self.mode == "r":
            raise _error(_errno.EBADF, "file is open read-only (mode 'r')", self.path, offset)
        return self._submit(buf, offset, nbytes, write=True)

    def _submit(self, buf: Any, offset: int, nbytes: int | None, write: bool) -> Future:
        if self._closed:
            raise _error(_errno.EBADF, "the file is closed", self.path, offset)
        if self.engine.closed:
            raise _error(_errno.EBADF, "the engine is closed", self.path, offset)
        addr, size, keep = _memory(buf, writable=not write)
        if nbytes is None:
            nbytes = size
        if nbytes < 0 or offset < 0:
            raise ValueError(f"nbytes ({nbytes}) and offset ({offset}) must be >= 0")
        if nbytes > size:
            raise ValueError(f"buffer of {size} bytes is too small for a request of {nbytes} bytes")
        if self.direct:
            self._check_alignment(addr, nbytes, offset)
        req = self.engine._impl.submit(self._fd, addr, nbytes, offset, write, self.direct,
                                       self.align)
        self._inflight.add(req, keep)
        return Future(req, self.path, offset, nbytes, write)

    def _check_alignment(self, addr: int, nbytes: int, offset: int) -> None:
        a, m = self.align, self.mem_align
        bad = []
        if addr % m:
            bad.append(f"buffer address {addr:#x} is not a multiple of {m} "
                       "(use aio.aligned_empty)")
        if nbytes % a:
            bad.append(f"size {nbytes} is not a multiple of {a}")
        if offset % a:
            bad.append(f"offset {offset} is not a multiple of {a}")
        if self.engine.block_size % a:
            bad.append(f"engine block_size {self.engine.block_size} is not a multiple of {a}")
        if bad:
            raise AlignmentError(_errno.EINVAL, "O_DIRECT cannot take this request: "
                                 + "; ".join(bad) + " (or open with direct=False)",
                                 self.path, offset)

    def close(self) -> None:
        """Waits for this file's requests, then closes it."""
        if self._closed:
            return
        self._closed = True
        self._inflight.wait_all()
        os.close(self._fd)

    def __enter__(self) -> File:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()

    def __repr__(self) -> str:
        return (f"File({self.path!r}, mode={self.mode!r}, direct={self.direct}, "
                f"backend={self.engine.backend!r})")


class Gather:
    """Several futures as one: ``result()`` is their total byte count, or the first error."""

    __slots__ = ("_futures",)

    def __init__(self, futures: list[Future]) -> None:
        self._futures = futures

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def result(self, timeout: float | None = None) -> int:
        return sum(f.result(timeout) for f in self._futures)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        for f in self._futures:
            e = f.exception(timeout)
            if e is not None:
                return e
        return None

    def __await__(self):
        async def total() -> int:
            return sum(await asyncio.gather(*self._futures))
        return total().__await__()


class StripedFile:
    """Files on several drives seen as one (RAID 0): logical stripe k of ``stripe`` bytes is in
    file ``k % n`` at offset ``(k // n) * stripe``. A request that spans stripes becomes one
    request per stripe, all in flight at once, so the drives' bandwidths add up."""

    def __init__(self, files: list[File], stripe: int) -> None:
        if not files:
            raise ValueError("StripedFile needs at least one file")
        self.files = files
        self.align = max(f.align for f in files)
        self.mem_align = max(f.mem_align for f in files)
        if stripe <= 0 or stripe % max(self.align, 1):
            raise ValueError(f"stripe {stripe} must be a positive multiple of {self.align}")
        self.stripe = stripe
        self.path = files[0].path
        self.paths = [f.path for f in files]
        self.direct = all(f.direct for f in files)

    @property
    def closed(self) -> bool:
        return all(f.closed for f in self.files)

    def _pieces(self, offset: int, nbytes: int) -> list[tuple[File, int, int, int]]:
        """(file, file offset, buffer offset, length) of each stripe the request touches."""
        n, s = len(self.files), self.stripe
        out = []
        pos = offset
        while pos < offset + nbytes:
            k, within = divmod(pos, s)
            length = min(s - within, offset + nbytes - pos)
            out.append((self.files[k % n], (k // n) * s + within, pos - offset, length))
            pos += length
        return out

    def _submit(self, buf: Any, offset: int, nbytes: int | None, write: bool) -> Gather:
        view = _bytes_view(buf)
        if nbytes is None:
            nbytes = len(view)
        if nbytes > len(view):
            raise ValueError(f"buffer of {len(view)} bytes is too small for a request of "
                             f"{nbytes} bytes")
        futures = []
        for f, at, a, length in self._pieces(offset, nbytes):
            piece = view[a:a + length]
            futures.append(f.pwrite(piece, at) if write else f.pread(piece, at))
        return Gather(futures)

    def pread(self, buf: Any, offset: int = 0, nbytes: int | None = None) -> Gather:
        return self._submit(buf, offset, nbytes, write=False)

    def pwrite(self, buf: Any, offset: int = 0, nbytes: int | None = None) -> Gather:
        return self._submit(buf, offset, nbytes, write=True)

    def allocate(self, nbytes: int) -> None:
        for i, f in enumerate(self.files):
            size = stripe_share(nbytes, len(self.files), i, self.stripe)
            if size:
                f.allocate(size)

    def sync(self) -> None:
        for f in self.files:
            f.sync()

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __repr__(self) -> str:
        return f"StripedFile({self.paths!r}, stripe={self.stripe})"


def stripe_share(nbytes: int, n: int, i: int, stripe: int) -> int:
    """Bytes of file ``i`` of ``n`` that ``nbytes`` striped in ``stripe`` bytes need (one file
    takes ``nbytes`` as it is)."""
    if n == 1:
        return nbytes
    stripes = -(-nbytes // stripe)
    return (stripes // n + (1 if i < stripes % n else 0)) * stripe


def _bytes_view(buf: Any) -> Any:
    """A sliceable byte view of ``buf`` that ``File`` accepts."""
    if isinstance(buf, torch.Tensor):
        if not buf.is_contiguous():
            raise ValueError("buffer tensor must be contiguous")
        return buf.reshape(-1).view(torch.uint8)
    mv = memoryview(buf)
    return mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv


def open(path: str | os.PathLike, mode: str = "r", engine: Engine | None = None,
         direct: bool = True) -> File:
    """Opens ``path`` for async I/O: mode "r", "r+" or "w+"; O_DIRECT unless ``direct=False``
    (and buffered, with one log line, where the file system refuses O_DIRECT)."""
    return File(path, mode, engine, direct)
