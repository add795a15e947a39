"""The store's exceptions. Every message names the entry and says what was expected and found.

The connector catches `StoreError` on load and turns it into "recompute" (vLLM's
`failed_recving`); the subclasses let it log why.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every error the store raises on purpose."""


class InvalidAnchor(StoreError, ValueError):
    """An anchor name that is empty, too long, or has characters outside the allowed set."""


class EntryNotFound(StoreError, KeyError):
    """No committed entry at that id (it never existed, was deleted or evicted)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class CorruptEntry(StoreError):
    """A chunk or the manifest is missing, truncated, or fails its crc32c checksum."""

    def __init__(self, entry: str, what: str) -> None:
        super().__init__(f"entry {entry}: {what}")
        self.entry = entry


class FingerprintMismatch(StoreError):
    """The entry was written for another model (layers, field shapes or dtypes differ)."""


class IncompleteEntry(StoreError):
    """`commit` was called before every rank wrote its part, or a rank's part is missing chunks."""


class FormatError(StoreError, ValueError):
    """A codec, layout or field that the entry format cannot represent (e.g. an unknown codec)."""
