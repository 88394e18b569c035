"""Byte counts as people write them ("2GiB", "512M", 1e9)."""

from __future__ import annotations

import re

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1000, "KIB": 1 << 10, "M": 1 << 20, "MB": 1000**2,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1000**3, "GIB": 1 << 30, "T": 1 << 40,
          "TB": 1000**4, "TIB": 1 << 40, "P": 1 << 50, "PB": 1000**5, "PIB": 1 << 50}

MAX_SIZE = 1 << 63  # what an off_t holds


def parse_bytes(value: int | float | str) -> int:
    """``"2GiB"`` -> 2147483648. Bare K/M/G/T/P are binary (as dd and fio read them); KB/MB/GB are
    decimal. Raises ValueError naming the value when it is not a size."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, (int, float)):
        if value < 0 or value != value:
            raise ValueError(f"a size must be >= 0, not {value!r}")
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
        if m is None or m.group(2).upper() not in _UNITS:
            raise ValueError(f"not a size: {value!r} (write e.g. 4096, 512M, 2GiB)")
        n = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if n >= MAX_SIZE:  # inf, 1e400 and anything no machine holds
        raise ValueError(f"a size must be finite and below 2**63 bytes, not {value!r}")
    if n != int(n):
        raise ValueError(f"a size is a whole number of bytes, not {value!r} ({n} bytes)")
    return int(n)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
