"""Swap space on NVMe: one preallocated file per directory, carved into aligned extents."""

from __future__ import annotations

import bisect
import errno
import fcntl
import hashlib
import os
import stat

from ..utils.dist import rank
from ..utils.paths import directories
from ..utils.sizes import format_bytes
from .engine import Engine
from .files import StripedFile
from .files import open as aio_open


def free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def check_directory(directory: str, what: str = "nvme_dir") -> str:
    """The absolute path of an existing, writable directory, or a clear error."""
    path = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(path):
        raise FileNotFoundError(errno.ENOENT, f"{what} does not exist or is not a directory", path)
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, f"{what} is not writable", path)
    return path


def private_folder(directory: str, name: str) -> str:
    """``directory/name``, made (0700) or checked to be a real directory this user owns and
    only it can enter. Where another user owns that name, this user gets ``name-uid<uid>``
    beside it; a symlink there is an error."""
    uid = os.geteuid()
    for folder in (os.path.join(directory, name), os.path.join(directory, f"{name}-uid{uid}")):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(folder)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise PermissionError(errno.EPERM, "refusing to use a symlink or non-directory as "
                                  "the swap folder; remove it", folder)
        if st.st_uid != uid:
            continue  # another user's: take our own
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.chmod(folder, 0o700)
        return folder
    raise PermissionError(errno.EPERM, "the swap folder belongs to another user", folder)


def open_private(path: str) -> int:
    """A descriptor of ``path``, created 0600 if missing; refuses a symlink, a hard link and a
    file of another user (what could make writes land in someone else's file)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PermissionError(errno.EPERM, "refusing to follow a symlink planted at the "
                                  "swap file's path; remove it", path) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
        os.close(fd)
        raise PermissionError(errno.EPERM, "refusing a swap file that is not a regular file of "
                              "this user with one link; remove it", path)
    return fd


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino)


def remove_stale(folder: str) -> None:
    """Removes swap files whose lock no live process holds (left by a process that was
    killed); a live process's file is locked and left alone."""
    for name in os.listdir(folder):
        if not (name.startswith("tieroffload-") and name.endswith(".swap")):
            continue
        path = os.path.join(folder, name)
        try:
            # O_NONBLOCK: a FIFO planted under the name must not hang the open.
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # in use
        else:
            if os.fstat(fd).st_uid == os.geteuid():
                os.unlink(path)
        finally:
            os.close(fd)


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
        self.directories = [check_directory(d, what) for d in dirs]
        self.directory = self.directories[0]
        share = -(-nbytes // len(dirs)) + (STRIPE if len(dirs) > 1 else 0)
        for d in self.directories:
            free = free_bytes(d)
            if share > free:
                raise OSError(errno.ENOSPC, f"{what} has {free} bytes ({format_bytes(free)}) "
                              f"free; the swap space needs {share} bytes "
                              f"({format_bytes(share)}) there", d)
        self._claims: list[tuple[int, str, str]] = []  # (lock fd, path, rank folder)
        try:
            files = []
            for d in self.directories:
                fd, path, folder = self._claim(d, tag)
                self._claims.append((fd, path, folder))
                os.ftruncate(fd, 0)
                files.append(aio_open(path, "r+", engine=engine))
            self.path = self._claims[0][1]
            self.paths = [c[1] for c in self._claims]
            self.file = files[0] if len(files) == 1 else StripedFile(files, STRIPE)
            self.align = max(4096, self.file.align)
            self.capacity = self._round(nbytes)
            if self.capacity:
                self.file.allocate(self.capacity)
        except BaseException:
            self._remove()
            raise
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # sorted (offset, length)

    def _claim(self, directory: str, tag: str) -> tuple[int, str, str]:
        """Opens and locks the first free name: rank<r>/tieroffload-<tag>-rank<r>[-<n>].swap,
        in a folder this user owns (0700). A symlink or a file that is not ours is refused,
        never followed; swap files of processes that died (their lock is free) are removed."""
        r = rank()
        folder = private_folder(directory, f"rank{r}")
        remove_stale(folder)
        for n in range(1000):
            suffix = f"-{n}" if n else ""
            path = os.path.join(folder, f"tieroffload-{tag}-rank{r}{suffix}.swap")
            fd = open_private(path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)  # another live process owns this one
                continue
            if _same_file(fd, path):
                return fd, path, folder
            os.close(fd)  # removed as stale between our open and our lock: take another name
        raise OSError(errno.EEXIST, "no free swap file name", folder)

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
        share = -(-grow // len(self.directories)) + (STRIPE if len(self.directories) > 1 else 0)
        for d, path in zip(self.directories, self.paths):
            free = free_bytes(d)
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
        """Closes and deletes the swap files (and the rank folders they leave empty)."""
        if not self._claims:
            return
        self.file.close()
        self._remove()

    def _remove(self) -> None:
        for fd, path, folder in self._claims:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            os.close(fd)
            try:
                os.rmdir(folder)
            except OSError:
                pass  # another rank's or process's file is still there
        self._claims = []
