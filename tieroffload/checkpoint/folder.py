"""A checkpoint's folders, reached only through descriptors.

The folder a checkpoint goes in is opened once (``O_DIRECTORY``; checked through that
descriptor as the swap's folder is: writable, not shared with other users without the sticky
bit). The temporary folder of a save, its rank parts and every file in them are then made,
opened, renamed and removed relative to a descriptor with ``O_NOFOLLOW``, and checked with
``fstat`` on the descriptor that is used: no name is looked up twice, so another user who can
write to the folder cannot swap a folder for a symbolic link between a check and a write.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import stat
from collections.abc import Callable
from typing import BinaryIO

from ..aio.private import open_directory
from ..utils.paths import exchange
from .schema import CheckpointError

MARK = ".tieroffload-save"  # in a save's temporary and old folders: "<tmp|old> <host> <pid>"
FILES = ("manifest.json", "tensors.bin", "extra.pt", MARK)  # what a checkpoint folder holds
RANK_DIR = re.compile(r"rank(0|[1-9][0-9]*)\Z")  # and, saved by several ranks, their parts
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class Folder:
    """A directory open as ``fd`` (``path`` names it in messages). What is in it is reached
    through ``fd`` only, never following a symbolic link."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path

    @classmethod
    def for_writing(cls, path: str) -> Folder:
        """``path``, a directory to save in: checked as ``nvme_dir`` is (``open_directory``)."""
        fd, where = open_directory(path, "checkpoint folder")
        return cls(fd, where)

    @classmethod
    def for_reading(cls, path: str) -> Folder:
        """``path`` opened as it is (a symbolic link the user named is followed)."""
        try:
            return cls(os.open(path, _DIR), path)
        except OSError as e:
            raise OSError(e.errno, e.strerror, path) from None

    def where(self, name: str) -> str:
        return os.path.join(self.path, name)

    def sub(self, name: str) -> Folder:
        """The folder ``name`` in this one: a directory of this user's, not a link to one."""
        try:
            fd = os.open(name, _DIR | os.O_NOFOLLOW, dir_fd=self.fd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise CheckpointError(f"{self.where(name)} is a symbolic link or a file, not a "
                                      "folder of this save: nothing was written there; remove "
                                      "it") from None
            raise OSError(e.errno, e.strerror, self.where(name)) from None
        if os.fstat(fd).st_uid != os.geteuid():
            os.close(fd)
            raise CheckpointError(f"{self.where(name)} belongs to another user: nothing was "
                                  "written there; remove it")
        return Folder(fd, self.where(name))

    def make(self, name: str) -> Folder:
        """A new folder ``name`` (0700, whatever the umask), opened."""
        try:
            os.mkdir(name, 0o700, dir_fd=self.fd)
        except OSError as e:
            raise OSError(e.errno, e.strerror, self.where(name)) from None
        sub = self.sub(name)
        os.fchmod(sub.fd, 0o700)
        return sub

    def create(self, name: str) -> BinaryIO:
        """A new file only this user may read (0600), open for writing."""
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600, dir_fd=self.fd)
        except OSError as e:
            raise OSError(e.errno, e.strerror, self.where(name)) from None
        return os.fdopen(fd, "wb")

    def read(self, name: str) -> BinaryIO:
        """A regular file in the folder, open for reading."""
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=self.fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CheckpointError(f"{self.where(name)} is not a regular file")
        return os.fdopen(fd, "rb")

    def lstat(self, name: str) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def is_dir(self, name: str) -> bool:
        st = self.lstat(name)
        return st is not None and stat.S_ISDIR(st.st_mode)

    def names(self) -> list[str]:
        return os.listdir(self.fd)

    def fsync(self) -> None:
        os.fsync(self.fd)

    def rename(self, a: str, b: str) -> None:
        os.rename(a, b, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def exchange(self, a: str, b: str) -> bool:
        """Swaps ``a`` and ``b`` in one step (``utils.paths.exchange``); False where the file
        system cannot."""
        return exchange(a, b, self.fd)

    def mark(self, kind: str, pid: int) -> None:
        """Marks this folder as the ``kind`` ("tmp" or "old") folder of process ``pid`` of this
        host: only a folder so marked is ever taken for a save's leftover."""
        _quiet(os.unlink, MARK, dir_fd=self.fd)
        with self.create(MARK) as f:
            f.write(f"{kind} {socket.gethostname()} {pid}\n".encode())

    def marked(self, name: str, kind: str, pid: int) -> bool:
        """Whether the folder ``name`` was marked ``mark(kind, pid)`` on this host."""
        try:
            with self.sub(name) as sub, sub.read(MARK) as f:
                return f.read(256).decode(errors="replace") == \
                    f"{kind} {socket.gethostname()} {pid}\n"
        except (CheckpointError, OSError):
            return False

    def remove_if_empty(self, name: str) -> None:
        """Removes the folder ``name`` if it holds nothing, or only a mark (a save killed
        between making its folder and finishing the mark leaves that): nothing else is lost."""
        try:
            with self.sub(name) as sub:
                if set(sub.names()) <= {MARK}:
                    _quiet(os.unlink, MARK, dir_fd=sub.fd)
        except (CheckpointError, OSError):
            return
        _quiet(os.rmdir, name, dir_fd=self.fd)

    def unmark(self) -> None:
        _quiet(os.unlink, MARK, dir_fd=self.fd)

    def remove_checkpoint(self, name: str) -> None:
        """Removes the checkpoint files (and rank parts) of the folder ``name``, then the folder
        if it is then empty: anything else in it stays, and so does the folder. A symbolic link
        (one planted at a temporary name) is not followed: nothing is removed."""
        if not self.is_dir(name):
            return
        try:
            ck = self.sub(name)
        except (CheckpointError, OSError):
            return
        with ck:
            for n in ck.names():
                if RANK_DIR.match(n) and ck.is_dir(n):
                    ck.remove_checkpoint(n)
                elif n in FILES:
                    _quiet(os.unlink, n, dir_fd=ck.fd)
        _quiet(os.rmdir, name, dir_fd=self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Folder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _quiet(fn: Callable[..., None], name: str, dir_fd: int) -> None:
    """``fn(name, dir_fd=dir_fd)`` (os.unlink or os.rmdir), whatever it raises."""
    try:
        fn(name, dir_fd=dir_fd)
    except OSError:
        pass
