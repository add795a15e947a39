"""Anchors, keys and the on-disk entry format (Zarr v3); local and S3-compatible backends.

``import anchorkv.store`` registers the ``anchorkv.quant`` codec with zarr and numcodecs (as
zarr's own codec modules do), so plain zarr-python can then open entries; with the package
installed, zarr also finds it lazily through its ``zarr.codecs`` entry point.
"""

from anchorkv.store import zarr_codec as _zarr_codec
from anchorkv.store.errors import (
    CorruptEntry,
    EntryNotFound,
    FingerprintMismatch,
    FormatError,
    IncompleteEntry,
    InvalidAnchor,
    StoreError,
)
from anchorkv.store.keys import anchor_key, normalize_anchor, prefix_hash, token_key

_zarr_codec.register()

__all__ = [
    "CorruptEntry", "EntryNotFound", "FingerprintMismatch", "FormatError", "IncompleteEntry",
    "InvalidAnchor", "StoreError", "anchor_key", "normalize_anchor", "prefix_hash", "token_key",
]
