"""The one rule for directory arguments such as ``nvme_dir``: one path, or one per drive."""

from __future__ import annotations

import os


def directories(value: str | os.PathLike | list | tuple | None, what: str = "nvme_dir"
                ) -> list[str]:
    """The directories ``value`` names, as strings: [] for None, one for a path, each of a list
    or tuple (one directory per drive, striped). An empty list is an error naming ``what``."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{what} is an empty list")
        return [os.fspath(d) for d in value]
    return [os.fspath(value)]
