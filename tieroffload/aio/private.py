"""Private files in a user's directory, reached only through descriptors.

The directory the user names is opened once (a symlink there is the user's own choice and is
followed, at that top level only). Everything below it is opened relative to a descriptor with
``O_NOFOLLOW`` and checked with ``fstat`` on the descriptor that is then used: no name is looked
up twice, so another user who can write to the directory cannot swap a folder or a file for a
symlink between a check and a use.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import stat

from .engine import Engine, warn_once
from .files import File

ALLOW_SHARED_ENV = "TIEROFFLOAD_ALLOW_SHARED_DIR"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def shared_allowed() -> bool:
    """Whether the user opted out of the shared-directory refusal
    (``TIEROFFLOAD_ALLOW_SHARED_DIR=1``)."""
    return os.environ.get(ALLOW_SHARED_ENV, "").strip().lower() in ("1", "true", "yes")


def private_group(gid: int) -> bool:
    """Whether ``gid`` is this user's own group (the user private groups Debian and Ubuntu
    make, where umask 002 leaves folders group-writable): the user's primary group, named as
    the user, with no other member."""
    try:
        user, group = pwd.getpwuid(os.geteuid()), grp.getgrgid(gid)
    except KeyError:
        return False
    return (gid == user.pw_gid and group.gr_name == user.pw_name
            and all(m == user.pw_name for m in group.gr_mem))


def shared(st: os.stat_result) -> bool:
    """Whether other users can rename what is in the directory ``st`` describes: it is
    writable by others, or by a group that is not the user's own, and has no sticky bit."""
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_ISVTX:
        return False
    return bool(mode & 0o002) or bool(mode & 0o020 and not private_group(st.st_gid))


def open_directory(directory: str | os.PathLike, what: str = "nvme_dir") -> tuple[int, str]:
    """(descriptor, absolute path) of an existing directory this user can write to. One that
    other users can write to (``shared``) is refused, as they could rename what is made in
    it, unless ``TIEROFFLOAD_ALLOW_SHARED_DIR=1``."""
    path = os.path.abspath(os.fspath(directory))
    try:
        fd = os.open(path, _DIR_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(errno.ENOENT, f"{what} does not exist or is not a directory",
                                path) from None
    try:
        st = os.fstat(fd)
        if not os.access(".", os.W_OK | os.X_OK, dir_fd=fd):
            raise PermissionError(errno.EACCES, f"{what} is not writable", path)
        mode = stat.S_IMODE(st.st_mode)
        if shared(st):
            if not shared_allowed():
                raise PermissionError(
                    errno.EPERM, f"{what} has mode {mode:04o}: other users can write to it and "
                    "it has no sticky bit, so they could redirect the files made there; "
                    f"`chmod go-w` or `chmod +t` it, or set {ALLOW_SHARED_ENV}=1", path)
    except BaseException:
        os.close(fd)
        raise
    return fd, path


def _open_below(parent_fd: int, name: str, flags: int, mode: int = 0o600) -> int:
    return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=parent_fd)


def private_folder(parent_fd: int, parent: str, name: str) -> tuple[int, str, str]:
    """(descriptor, path, name) of ``parent/name``, made (0700) or checked through its
    descriptor to be a directory this user owns and only it can enter. Where another user owns
    that name, this user gets ``name-uid<uid>`` beside it; a symlink there is an error."""
    uid = os.geteuid()
    for n in (name, f"{name}-uid{uid}"):
        path = os.path.join(parent, n)
        try:
            os.mkdir(n, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            pass
        try:
            fd = _open_below(parent_fd, n, _DIR_FLAGS)
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            raise PermissionError(errno.EPERM, "refusing to use a symlink or non-directory as "
                                  "the swap folder; remove it", path) from None
        st = os.fstat(fd)
        if st.st_uid != uid:
            os.close(fd)
            continue  # another user's: take our own
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o700)
        return fd, path, n
    raise PermissionError(errno.EPERM, "the swap folder belongs to another user", path)


def open_private(folder_fd: int, name: str, path: str, direct: bool = True) -> tuple[int, bool]:
    """(descriptor, O_DIRECT or not) of ``name`` in the folder, opened read-write, created 0600
    if missing; refuses a symlink, a hard link and a file of another user (what could make
    writes land in someone else's file). O_DIRECT where the file system takes it, else
    buffered (logged once per folder). ``path`` names it in errors."""
    flags = os.O_RDWR | os.O_CREAT
    try:
        try:
            fd = _open_below(folder_fd, name, flags | (os.O_DIRECT if direct else 0))
        except OSError as e:
            if not direct or e.errno != errno.EINVAL:
                raise
            direct = False
            warn_once(f"nodirect:{os.path.dirname(path)}", f"{path}: the file system refuses "
                      "O_DIRECT; using buffered I/O for files there")
            fd = _open_below(folder_fd, name, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PermissionError(errno.EPERM, "refusing to follow a symlink planted at the "
                                  "swap file's path; remove it", path) from None
        raise OSError(e.errno, e.strerror, path) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
        os.close(fd)
        raise PermissionError(errno.EPERM, "refusing a swap file that is not a regular file of "
                              "this user with one link; remove it", path)
    return fd, direct


def same_entry(dir_fd: int, name: str, fd: int) -> bool:
    """Whether ``name`` in the folder is (still) the file or folder open as ``fd``."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def unlink_if_same(dir_fd: int, name: str, fd: int) -> None:
    """Removes ``name`` from the folder if it is the file open as ``fd``."""
    if same_entry(dir_fd, name, fd):
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass


def rmdir_if_same(parent_fd: int, name: str, fd: int) -> None:
    """Removes the folder ``name`` if it is the one open as ``fd`` and it is empty."""
    if same_entry(parent_fd, name, fd):
        try:
            os.rmdir(name, dir_fd=parent_fd)
        except OSError:
            pass  # another rank's or process's file is still there


class ScratchFile(File):
    """A file made for a measurement in a directory checked as the swap's is, through the
    directory's descriptor (0600, never following a symlink, a file left by an earlier run
    truncated); ``close`` removes it."""

    _dir_fd: int
    _name: str

    @classmethod
    def create(cls, directory: str | os.PathLike, name: str, engine: Engine | None = None,
               direct: bool = True, what: str = "nvme_dir") -> ScratchFile:
        dir_fd, where = open_directory(directory, what)
        path = os.path.join(where, name)
        try:
            fd, direct = open_private(dir_fd, name, path, direct)
        except BaseException:
            os.close(dir_fd)
            raise
        try:
            os.ftruncate(fd, 0)
            f = cls.from_fd(fd, path, "r+", engine, direct)
        except BaseException:
            unlink_if_same(dir_fd, name, fd)
            os.close(fd)
            os.close(dir_fd)
            raise
        f._dir_fd, f._name = dir_fd, name
        return f

    def close(self) -> None:
        if self.closed:
            return
        unlink_if_same(self._dir_fd, self._name, self.fileno())
        super().close()
        os.close(self._dir_fd)
