"""Where entry bytes live: a local directory (default) or an S3-compatible object store.

Every backend implements `Backend` (the contract; `anchorkv.testing.backends.BackendTests` is
its conformance suite): whole-object reads and writes, byte-range reads (`read_ranges_into`:
an inner chunk of a shard), listing one level of a prefix, deleting a prefix, and `publish`,
the step that makes an entry visible. Paths are '/'-separated, relative to the store root, and
built by the store from hex keys and fixed names only (`anchorkv.store.paths`).

Local (`LocalBackend`): chunks go to a staging directory that `publish` renames into place
(atomic; the loser of two concurrent publishes of one entry gets False). Object store
(`ObjectBackend`): objects cannot be renamed, so chunks go straight under a prefix unique to
the write, and the entry's group ``zarr.json`` (its manifest) is put last; without it the
prefix is invisible garbage that `gc` removes.
"""

from __future__ import annotations

import os
from typing import Any

from anchorkv.store.backends._local import LocalBackend
from anchorkv.store.backends._object import ObjectBackend
from anchorkv.store.backends._protocol import Backend, Buffers, RangeCheck
from anchorkv.store.errors import StoreUnavailable
from anchorkv.store.paths import TRASH


def open_backend(url: str | os.PathLike, **options: Any) -> Backend:
    """A backend for a path (local) or an ``s3://`` URL."""
    text = os.fspath(url)
    if not text.strip():
        raise StoreUnavailable("expected a store: a directory path or s3://bucket/prefix, found an empty path "
                               "(--store / 'store')")
    if text.lower().startswith("s3:") and not text.startswith("s3://"):
        raise StoreUnavailable(f"an object-store URL looks like s3://bucket/prefix, found {text!r}; write it so "
                               "(for a local directory of that name, give ./" + text + ")")
    if text.startswith("s3://"):
        return ObjectBackend(text, **options)
    if "://" in text and not text.startswith("file://"):
        scheme = text.split("://", 1)[0]
        raise StoreUnavailable(f"unsupported store URL {text!r}: expected a local path or s3://bucket/prefix, found "
                               f"scheme {scheme}:// (for Google Cloud Storage use its S3-compatible endpoint: "
                               "s3://bucket/prefix?endpoint=https://storage.googleapis.com with HMAC keys)")
    if options:
        raise StoreUnavailable(f"a local store takes no storage_options, found {sorted(options)}; "
                               "they are for s3:// stores")
    return LocalBackend(text.removeprefix("file://"))


def store_location(url: str | os.PathLike) -> str:
    """The store `open_backend(url)` opens, as a string that names it alone: a local directory
    resolved (its `LocalBackend.url`; a relative path is another store after a chdir), an object
    store's URL as given."""
    text = os.fspath(url)
    if "://" in text and not text.startswith("file://"):
        return text
    return str(LocalBackend.resolve(text.removeprefix("file://")))


__all__ = ["TRASH", "Backend", "Buffers", "LocalBackend", "ObjectBackend", "RangeCheck", "open_backend",
           "store_location"]
