"""The one rule for directory arguments such as ``nvme_dir``: one path, or one per drive; and
swapping two paths in one step."""

from __future__ import annotations

import ctypes
import errno
import os

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_libc = ctypes.CDLL(None, use_errno=True)


def directories(value: str | os.PathLike | list | tuple | None, what: str = "nvme_dir"
                ) -> list[str]:
    """The directories ``value`` names, as strings ("~" expanded): [] for None, one for a path,
    each of a list or tuple (one directory per drive, striped). An empty list, or one naming a
    directory twice, is an error naming ``what``."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{what} is an empty list")
        out = [os.path.expanduser(os.fspath(d)) for d in value]
        real = [os.path.realpath(d) for d in out]
        twice = next((d for d, r in zip(out, real) if real.count(r) > 1), None)
        if twice is not None:
            raise ValueError(f"{what} names {twice!r} twice (one directory per drive, each "
                             "once: striping over one drive twice only splits its requests)")
        return out
    return [os.path.expanduser(os.fspath(value))]


def exchange(a: str, b: str, dir_fd: int | None = None) -> bool:
    """Swaps the paths ``a`` and ``b`` (both exist; relative to the directory open as
    ``dir_fd`` when given) in one step: Linux's renameat2 with RENAME_EXCHANGE, so a reader of
    ``b`` sees the old or the new, never nothing. False where the C library or the file system
    cannot (the caller then renames twice)."""
    renameat2 = getattr(_libc, "renameat2", None)
    if renameat2 is None:
        return False
    at = _AT_FDCWD if dir_fd is None else dir_fd
    if renameat2(at, os.fsencode(a), at, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)
