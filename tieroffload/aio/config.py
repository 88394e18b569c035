"""Engine settings as a small frozen dataclass, loadable from the bench's JSON."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .engine import Engine, check_io_settings


@dataclass(frozen=True)
class IOConfig:
    """Settings of the async I/O engine. ``tieroffload-bench nvme --json`` writes a
    ``recommended`` block that ``IOConfig.from_dict`` (or ``from_json``) loads."""

    backend: str = "auto"
    block_size: int = 1 << 20
    queue_depth: int = 32
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "io_uring", "threads"):
            raise ValueError(f"io.backend must be 'auto', 'io_uring' or 'threads', "
                             f"not {self.backend!r}")
        check_io_settings(self.block_size, self.queue_depth, self.threads, prefix="io.")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> IOConfig:
        """Builds from a dict, e.g. the bench's ``recommended`` block (or the whole result that
        holds it); unknown keys are refused."""
        if isinstance(d, Mapping) and "recommended" in d:
            d = d["recommended"]
        if not isinstance(d, Mapping):
            raise TypeError(f"IOConfig.from_dict needs a dict of I/O settings (or a bench "
                            f"result with a 'recommended' dict), not {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown I/O settings {unknown}; known: {sorted(names)}")
        return cls(**d)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> IOConfig:
        """``from_dict`` of a JSON file; its errors name the file (and the line and column
        where it is not JSON)."""
        with open(path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{os.fspath(path)}: not valid JSON ({e.msg} at line "
                                 f"{e.lineno}, column {e.colno})") from None
        try:
            return cls.from_dict(d)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{os.fspath(path)}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def engine(self) -> Engine:
        """A new ``aio.Engine`` with these settings."""
        return Engine(self.backend, self.queue_depth, self.block_size, self.threads)
