"""Swap space on NVMe: one preallocated file per directory, carved into aligned extents."""

from __future__ import annotations

import bisect
import errno
import fcntl
import hashlib
import os
import stat
from typing import NamedTuple

from ..utils.dist import rank
from ..utils.paths import directories
from ..utils.sizes import format_bytes
from .engine import Engine
from .files import File, StripedFile
from .private import (
    open_directory,
    open_private,
    private_folder,
    rmdir_if_same,
    same_entry,
    unlink_if_same,
)


def free_bytes(directory: str | int) -> int:
    """Bytes free to this user in ``directory`` (a path or a descriptor)."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def check_directory(directory: str | os.PathLike, what: str = "nvme_dir") -> str:
    """The absolute path of an existing directory this user can write to and others cannot
    redirect files in (see ``private.open_directory``), or a clear error."""
    fd, path = open_directory(directory, what)
    os.close(fd)
    return path


def remove_stale(folder_fd: int) -> None:
    """Removes swap files whose lock no live process holds (left by a process that was
    killed) from the folder open as ``folder_fd``; a live process's file is locked and left
    alone."""
    for name in os.listdir(folder_fd):
        if not (name.startswith("tieroffload-") and name.endswith(".swap")):
            continue
        try:
            # O_NONBLOCK: a FIFO planted under the name must not hang the open.
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                         dir_fd=folder_fd)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # in use
            unlink_if_same(folder_fd, name, fd)
        finally:
            os.close(fd)


class _Claim(NamedTuple):
    """One directory's swap file: the directory's descriptor, its private folder's descriptor
    and name in it, the file's name in that folder, and the File over the one descriptor the
    file was created, checked and locked through."""

    dir_fd: int
    folder_fd: int
    folder: str
    name: str
    file: File


def stable_tag(names: list[str]) -> str:
    """A short name that depends only on what is stored (parameter names, shapes, dtypes), so
    the same model gets the same swap name in every run, never a Python id()."""
    return hashlib.sha1("\n".join(names).encode()).hexdigest()[:12]


STRIPE = 4 << 20  # bytes per stripe across several directories


class SwapSpace:
    """A swap file of ``nbytes`` in ``directory``, reserved up front (posix_fallocate), locked
    against a second process that would pick the same name, removed by ``close()``. Each rank
    keeps its file in a folder of its own, ``<directory>/rank<r>``. Given several directories
    (one per drive), one file in each, striped: large units spread over all of them."""

    def __init__(self, directory: str | os.PathLike | list | tuple, nbytes: int, tag: str,
                 engine: Engine | None = None, what: str = "nvme_dir") -> None:
        dirs = directories(directory, what)
        share = -(-nbytes // len(dirs)) + (STRIPE if len(dirs) > 1 else 0)
        self._claims: list[_Claim] = []
        self.directories: list[str] = []
        try:
            for d in dirs:
                dir_fd, path = open_directory(d, what)
                try:
                    free = free_bytes(dir_fd)
                    if share > free:
                        raise OSError(errno.ENOSPC, f"{what} has {free} bytes "
                                      f"({format_bytes(free)}) free; the swap space needs "
                                      f"{share} bytes ({format_bytes(share)}) there", path)
                    claim = self._claim(dir_fd, path, tag, engine)
                except BaseException:
                    os.close(dir_fd)
                    raise
                self._claims.append(claim)
                self.directories.append(path)
            self.directory = self.directories[0]
            files = [c.file for c in self._claims]
            self.path = files[0].path
            self.paths = [f.path for f in files]
            self.file = files[0] if len(files) == 1 else StripedFile(files, STRIPE)
            self.align = max(4096, self.file.align)
            self.capacity = self._round(nbytes)
            if self.capacity:
                self.file.allocate(self.capacity)
        except BaseException:
            self._remove()
            raise
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # sorted (offset, length)

    def _claim(self, dir_fd: int, directory: str, tag: str, engine: Engine | None) -> _Claim:
        """Creates (or takes over) and locks the first free name,
        rank<r>/tieroffload-<tag>-rank<r>[-<n>].swap, in a folder this user owns (0700), each
        opened relative to its parent's descriptor: a symlink or a file that is not ours is
        refused, never followed, and the descriptor checked is the one the engine uses. Swap
        files of processes that died (their lock is free) are removed."""
        r = rank()
        folder_fd, folder, fname = private_folder(dir_fd, directory, f"rank{r}")
        try:
            remove_stale(folder_fd)
            for n in range(1000):
                name = f"tieroffload-{tag}-rank{r}{f'-{n}' if n else ''}.swap"
                path = os.path.join(folder, name)
                fd, direct = open_private(folder_fd, name, path)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)  # another live process owns this one
                    continue
                if not same_entry(folder_fd, name, fd):
                    os.close(fd)  # removed as stale between our open and our lock: another
                    continue
                try:
                    os.ftruncate(fd, 0)
                    return _Claim(dir_fd, folder_fd, fname, name,
                                  File.from_fd(fd, path, "r+", engine, direct))
                except BaseException:
                    unlink_if_same(folder_fd, name, fd)
                    os.close(fd)
                    raise
            raise OSError(errno.EEXIST, "no free swap file name", folder)
        except BaseException:
            rmdir_if_same(dir_fd, fname, folder_fd)
            os.close(folder_fd)
            raise

    def _round(self, n: int) -> int:
        return -(-n // self.align) * self.align

    def alloc(self, nbytes: int) -> int:
        """The offset of a free extent of ``nbytes`` (rounded up to the alignment); first fit,
        growing the file (and checking the disk) when nothing fits."""
        need = self._round(max(nbytes, 1))
        for i, (off, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (off + need, length - need)
                return off
        grow = need
        if self._free and self._free[-1][0] + self._free[-1][1] == self.capacity:
            off, length = self._free.pop()
            grow = need - length
        else:
            off = self.capacity
        share = -(-grow // len(self._claims)) + (STRIPE if len(self._claims) > 1 else 0)
        for c in self._claims:
            free, path = free_bytes(c.dir_fd), c.file.path
            if share > free:
                if off != self.capacity:
                    self._free.append((off, self.capacity - off))
                raise OSError(errno.ENOSPC, f"swap space cannot grow by {share} bytes: only "
                              f"{free} bytes free", path)
        self.capacity += grow
        self.file.allocate(self.capacity)
        return off

    def reserve(self, sizes: list[int]) -> None:
        """Makes sure extents of ``sizes`` bytes can be allocated later without the disk
        filling up: allocated now (the file grows, ENOSPC raised here) and freed again."""
        offsets = []
        try:
            for n in sizes:
                offsets.append(self.alloc(n))
        finally:
            for off, n in zip(offsets, sizes):
                self.free(off, n)

    def free(self, offset: int, nbytes: int) -> None:
        """Returns an extent; neighbours are merged."""
        length = self._round(max(nbytes, 1))
        i = bisect.bisect(self._free, (offset, 0))
        self._free.insert(i, (offset, length))
        merged: list[tuple[int, int]] = []
        for off, ln in self._free:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + ln)
            else:
                merged.append((off, ln))
        self._free = merged

    def close(self) -> None:
        """Deletes and closes the swap files (and the rank folders they leave empty)."""
        self._remove()

    def _remove(self) -> None:
        # Unlinked while still open and locked: a process that takes the name next cannot
        # have its file removed by us.
        for c in self._claims:
            unlink_if_same(c.folder_fd, c.name, c.file.fileno())
        for c in self._claims:
            c.file.close()
            rmdir_if_same(c.dir_fd, c.folder, c.folder_fd)
            os.close(c.folder_fd)
            os.close(c.dir_fd)
        self._claims = []
