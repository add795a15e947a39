"""Anchors, keys and the on-disk entry format (Zarr v3); local and S3-compatible backends.

Every array of an entry is a standard Zarr v3 array, so zarr-python or tensorstore read it with
no plug-in (raw values; quantized fields as codes + scales, the dequantization stated in the
array attributes). With anchorkv installed, `open_entry` dequantizes:

    from anchorkv.store import open_entry
    entry = open_entry("<store>/entries/<entry id from `anchorkv ls`>")
    entry["recurrent"][3]   # float32, the state of the 4th KDA layer

This package imports nothing heavy (no torch, no zarr) until a submodule needs it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from anchorkv.store.errors import (
    CorruptEntry,
    EntryNotFound,
    FingerprintMismatch,
    FormatError,
    IncompleteEntry,
    InvalidAnchor,
    StoreError,
)

if TYPE_CHECKING:
    from anchorkv.store.reading import EntryValues


def open_entry(path: str | os.PathLike) -> EntryValues:
    """`anchorkv.store.reading.open_entry` (imported on first use)."""
    from anchorkv.store.reading import open_entry as _open_entry

    return _open_entry(path)


def __getattr__(name: str) -> object:  # keys needs blake3 and numpy: imported on first use
    if name in ("anchor_key", "normalize_anchor", "prefix_hash", "token_key"):
        from anchorkv.store import keys

        return getattr(keys, name)
    raise AttributeError(f"module 'anchorkv.store' has no attribute {name!r}")


__all__ = [
    "CorruptEntry", "EntryNotFound", "FingerprintMismatch", "FormatError", "IncompleteEntry",
    "InvalidAnchor", "StoreError", "anchor_key", "normalize_anchor", "open_entry", "prefix_hash", "token_key",
]
