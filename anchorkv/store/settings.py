"""Settings shared by the store, its CLI and the connector: the default location, sizes, cores."""

from __future__ import annotations

import math
import os
import re
from typing import overload


def cores() -> int:
    """The CPU cores this process may run on (its affinity where the OS tells it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


#: Where the store lives when nobody says (the connector's and the CLI's default).
DEFAULT_STORE = os.path.join(os.path.expanduser("~"), ".cache", "anchorkv")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


@overload
def parse_size(value: None, key: str = ...) -> None: ...


@overload
def parse_size(value: str | float, key: str = ...) -> int: ...


@overload
def parse_size(value: object, key: str = ...) -> int | None: ...


def parse_size(value: object, key: str = "capacity") -> int | None:
    """`None`, an int of bytes, or a string like "200GB" / "1.5 TiB"."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{key} must be a size like 200GB or a number of bytes, found {value!r}")
    if isinstance(value, (int, float)):  # bytes: a whole number >= 1 (0.5 was taken as 0: every entry evicted)
        if not math.isfinite(value) or value < 1:
            raise ValueError(f"{key} must be a size like 200GB or a number of bytes >= 1, found {value!r}")
        return int(value)
    m = _SIZE.match(str(value))
    if not m:
        raise ValueError(f"{key} must be a size like 200GB or a number of bytes, found {value!r}")
    unit = m.group(2).lower().rstrip("b") if m.group(2).lower() not in ("b",) else ""
    if unit not in _UNITS:
        raise ValueError(f"{key}: unknown unit in {value!r}; use B, KB, MB, GB, TB or KiB..TiB")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ValueError(f"{key} must be positive, found {value!r}")
    return n
