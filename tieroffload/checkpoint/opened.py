"""Reading a checkpoint: its directory opened once, its files through descriptors taken from
it, checked for size and checksum before anything is loaded."""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import zlib
from typing import Any, BinaryIO

from .schema import DTYPES, MAX_MANIFEST, CheckpointError, check_manifest

READ = 16 << 20


def _crc(f: BinaryIO) -> tuple[int, int]:
    """(bytes, CRC-32) of an open file, from its start."""
    crc = n = 0
    f.seek(0)
    while block := f.read(READ):
        crc, n = zlib.crc32(block, crc), n + len(block)
    return n, crc


class _Opened:
    """A checkpoint directory opened once. Its files are read through descriptors taken from
    it, so a save that replaces ``path`` meanwhile is never mixed in: a load reads one
    checkpoint whole, or fails. Only the caller's own (or root's) directory and regular files
    are read: no symlink inside it, no FIFO or device, nothing another user could have
    planted."""

    def __init__(self, path: str, parent: Any = None) -> None:
        """``path``, or (with ``parent``, a folder open as ``parent.fd``) its last part inside
        that folder, never following a link there."""
        self.path = path
        # ``path`` may be a symbolic link (``latest -> step-1000``): its target's owner is
        # checked; inside, nothing is followed.
        where, flags = ((os.path.basename(path), os.O_NOFOLLOW) if parent is not None
                        else (path, 0))
        try:
            self.fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | flags,
                              dir_fd=parent.fd if parent is not None else None)
        except OSError as e:
            raise CheckpointError(f"no checkpoint at {path} ({e.strerror})") from e
        self._files: dict[str, BinaryIO] = {}
        try:
            self._check_owner(os.fstat(self.fd), path)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _check_owner(st: os.stat_result, what: str) -> None:
        if st.st_uid not in (os.geteuid(), 0):
            raise CheckpointError(
                f"checkpoint {what} belongs to uid {st.st_uid}, not to this user (uid "
                f"{os.geteuid()}) or root: another user could have planted it; copy it into a "
                "directory of your own to load it")

    def open(self, name: str) -> BinaryIO:
        """A file of the checkpoint, opened for reading once, closed with the checkpoint."""
        if name in self._files:
            return self._files[name]
        where = os.path.join(self.path, name)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=self.fd)
        except OSError as e:
            why = "is a symbolic link, never followed" if e.errno == errno.ELOOP else \
                f"cannot be opened: {e.strerror}"
            raise CheckpointError(f"checkpoint file {where} {why}") from e
        f = self._files[name] = os.fdopen(fd, "rb")
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"checkpoint file {where} is not a regular file")
        self._check_owner(st, where)
        return f

    def names(self) -> list[str]:
        """What the directory holds, as listed through its descriptor."""
        return os.listdir(self.fd)

    def manifest(self) -> dict[str, Any]:
        """manifest.json, read and checked against the schema (``check_manifest``)."""
        f = self.open("manifest.json")
        where = os.path.join(self.path, "manifest.json")
        size = os.fstat(f.fileno()).st_size
        if size > MAX_MANIFEST:
            raise CheckpointError(f"checkpoint manifest {where} has {size} bytes, over the "
                                  f"{MAX_MANIFEST} a manifest can need")
        try:
            meta = json.loads(f.read())
        except (ValueError, RecursionError) as e:
            raise CheckpointError(f"checkpoint manifest {where} is unreadable: "
                                  f"{type(e).__name__}") from e
        check_manifest(meta, where)
        return meta

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> _Opened:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _complete(path: str, parent: Any = None) -> float | None:
    """The time ``path`` (with ``parent``: its last part, in the folder open as
    ``parent.fd``) got its manifest, where it holds a checkpoint whose manifest and data size
    are whole; else None."""
    try:
        with _Opened(path, parent) as ck:
            meta = ck.manifest()
            if "ranks" not in meta:
                _check_size(ck, meta)
            return os.fstat(ck.open("manifest.json").fileno()).st_mtime
    except CheckpointError:
        return None


def _check_size(ck: _Opened, meta: dict[str, Any]) -> BinaryIO:
    """The data file has the manifest's size, and every entry (well formed: see
    ``check_part``) lies inside it with exactly its elements' bytes (a short entry would
    leave the rest of a tensor unread and unchecked). Returns the data file, open."""
    path = ck.path
    data = os.path.join(path, "tensors.bin")
    f = ck.open("tensors.bin")
    size = os.fstat(f.fileno()).st_size
    if size != meta["size"]:
        what = "is truncated" if size < meta["size"] else "is longer than its manifest says"
        raise CheckpointError(f"checkpoint data {data} {what}: {size} bytes, the manifest says "
                              f"{meta['size']}")
    for e in meta["tensors"]:
        key, shape, offset, nbytes = e["key"], e["shape"], e["offset"], e["nbytes"]
        want = math.prod(shape) * DTYPES[e["dtype"]].itemsize
        if nbytes != want or offset + nbytes > size:
            raise CheckpointError(
                f"checkpoint {path}: {key} ({e['dtype']}{shape}) claims bytes "
                f"{offset}..{offset + nbytes}; it needs {want} bytes inside the {size} of "
                "tensors.bin")
    return f


def _verify(ck: _Opened, meta: dict[str, Any], data: BinaryIO) -> BinaryIO:
    """Checks the sizes and checksums of ``extra.pt`` and of every tensor in ``data``; returns
    ``extra.pt``, open."""
    path = ck.path
    extra = meta["extra"]
    ef = ck.open("extra.pt")
    got = _crc(ef)
    if got != (extra["nbytes"], extra["crc32"]):
        raise CheckpointError(f"checkpoint {path} is corrupt: extra.pt ({got[0]} bytes) fails "
                              f"its checksum")
    for e in meta["tensors"]:
        data.seek(e["offset"])
        crc, left = 0, e["nbytes"]
        while left:
            block = data.read(min(READ, left))
            if not block:
                break
            crc = zlib.crc32(block, crc)
            left -= len(block)
        if left or crc != e["crc32"]:
            raise CheckpointError(f"checkpoint {path} is corrupt: {e['key']} (bytes "
                                  f"{e['offset']}..{e['offset'] + e['nbytes']}) fails its "
                                  "checksum")
    return ef
