"""Files opened for async positional I/O, and files striped across several directories.

Checks what O_DIRECT needs before anything reaches the kernel and keeps buffers alive while the
kernel uses them.
"""

from __future__ import annotations

import asyncio
import collections
import errno as _errno
import os
import threading
from typing import Any

from .. import _native
from ..utils.sizes import MAX_SIZE
from .buffers import bytes_view, memory_of
from .engine import AlignmentError, Engine, Future, default_engine, error_for, warn_once


def check_span(offset: int, nbytes: int) -> None:
    """One-line ValueError unless [offset, offset + nbytes) is a range a file can have."""
    for name, v in (("offset", offset), ("nbytes", nbytes)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, not {type(v).__name__}")
        if v < 0:
            raise ValueError(f"{name} must be >= 0, not {v}")
    if offset + nbytes > MAX_SIZE:
        raise ValueError(f"offset {offset} + nbytes {nbytes} is past the largest file offset "
                         f"(2**63 - 1)")


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
        self._begin(os.fspath(path), mode, engine)
        if os.path.isdir(self.path):  # before O_DIRECT's EINVAL reads as a file-system limit
            raise error_for(_errno.EISDIR, "is a directory, not a file", self.path)
        flags = _MODES[mode] | os.O_CLOEXEC
        self.direct = direct
        if direct:
            try:
                self._fd = os.open(self.path, flags | os.O_DIRECT, 0o644)
            except OSError as e:
                if e.errno != _errno.EINVAL:
                    raise error_for(e.errno, e.strerror, self.path) from None
                warn_once(f"nodirect:{os.path.dirname(os.path.abspath(self.path))}",
                           f"{self.path}: the file system refuses O_DIRECT; "
                           "using buffered I/O for files there")
                self.direct = False
        if not self.direct:
            try:
                self._fd = os.open(self.path, flags, 0o644)
            except OSError as e:
                raise error_for(e.errno, e.strerror, self.path) from None
        self._adopt(self._fd, self.direct)

    @classmethod
    def from_fd(cls, fd: int, name: str, mode: str = "r+", engine: Engine | None = None,
                direct: bool = True) -> File:
        """A File over ``fd``, a regular file the caller opened (and checked) itself, with
        O_DIRECT if ``direct``: all I/O goes through that very descriptor, never a reopen by
        name. Once it returns, the File owns ``fd`` (``close`` closes it); ``name`` names it
        in errors."""
        self = cls.__new__(cls)
        self._begin(name, mode, engine)
        self._adopt(fd, direct)
        return self

    def _begin(self, path: str, mode: str, engine: Engine | None) -> None:
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {sorted(_MODES)}, not {mode!r}")
        self.path = path
        self.mode = mode
        self.engine = engine if engine is not None else default_engine()
        if self.engine.closed:
            raise error_for(_errno.EBADF, "the engine is closed", self.path)

    def _adopt(self, fd: int, direct: bool) -> None:
        self._fd, self.direct = fd, direct
        if direct:
            self.mem_align, self.align = _native.dio_alignment(fd)
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
            raise error_for(e.errno, msg, self.path, 0) from None

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
            raise error_for(_errno.EBADF, "file is open read-only (mode 'r')", self.path, offset)
        return self._submit(buf, offset, nbytes, write=True)

    def _submit(self, buf: Any, offset: int, nbytes: int | None, write: bool) -> Future:
        if self._closed:
            raise error_for(_errno.EBADF, "the file is closed", self.path, offset)
        if self.engine.closed:
            raise error_for(_errno.EBADF, "the engine is closed", self.path, offset)
        addr, size, keep = memory_of(buf, writable=not write)
        if nbytes is None:
            nbytes = size
        check_span(offset, nbytes)
        if nbytes > size:
            raise ValueError(f"buffer of {size} bytes is too small for a request of {nbytes} bytes")
        if self.direct:
            self._check_alignment(addr, nbytes, offset)
        req = self.engine._impl.submit(self._fd, addr, nbytes, offset, write, self.direct,
                                       self.align)
        self._inflight.add(req, keep)
        return Future(req, self.engine, self.path, offset, nbytes, write)

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
        view = bytes_view(buf)
        if nbytes is None:
            nbytes = len(view)
        check_span(offset, nbytes)
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


def open(path: str | os.PathLike, mode: str = "r", engine: Engine | None = None,
         direct: bool = True) -> File:
    """Opens ``path`` for async I/O: mode "r", "r+" or "w+"; O_DIRECT unless ``direct=False``
    (and buffered, with one log line, where the file system refuses O_DIRECT)."""
    return File(path, mode, engine, direct)
