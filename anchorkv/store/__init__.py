"""Anchors, keys and the on-disk entry format (Zarr v3); local and S3-compatible backends.

``import anchorkv.store`` registers the ``anchorkv.quant`` codec with zarr and numcodecs (as
zarr's own codec modules do), so plain zarr-python can then open entries:

    import zarr
    import anchorkv.store
    entry = zarr.open_group("<store>/entries/<entry id from `anchorkv ls`>", mode="r")
    entry["recurrent"][3]   # float32, the dequantized state of the 4th KDA layer
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
