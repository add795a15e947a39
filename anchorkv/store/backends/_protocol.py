"""`Backend`: what the store needs of the place where entry bytes live."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from zarr.abc.store import Store as ZarrStore

#: What `Backend.write` takes: the file's bytes as a sequence of buffers, written in order.
Buffers = Sequence[bytes | bytearray | memoryview]
#: What `Backend.read_ranges_into` calls after each range: (the object's size, the range's index,
#: the bytes read into it); it raises to stop the read (`reader.read_planned`: a chunk's checksum).
RangeCheck = Callable[[int, int, int], None]


@runtime_checkable
class Backend(Protocol):
    """The contract every store backend implements (`anchorkv.testing.backends.BackendTests`
    checks it): whole-object reads and writes, byte-range reads, listing one level of a
    prefix, deletes, and `publish`, the step that makes an entry visible.

    Paths are '/'-separated and relative to the store root (`anchorkv.store.paths`). A path
    that does not exist raises `FileNotFoundError` from the reads, and is a no-op (or None, 0,
    an empty list) everywhere else.
    """

    #: The store's location as the user names it (a directory, ``s3://bucket/prefix``).
    url: str
    #: True: `publish` renames a staged directory into place, atomically, and the loser of two
    #: publishes of one entry gets False. False: objects cannot be renamed, so an entry's data
    #: goes straight under a prefix unique to the write and the manifest put publishes it.
    atomic_publish: bool
    #: How many shard writes of one save may be in flight at once: 1, the writing thread writes
    #: each in turn (a local write is a copy into the page cache); more, each write a round trip
    #: (an object store's put), they go on threads of their own, this many at once.
    write_concurrency: int

    # ------------------------------------------------------------------ the store itself
    def ensure_root(self) -> None:
        """Create the store's root if needed (a writer opening the store)."""

    def check_store(self) -> None:
        """`StoreUnavailable`, saying what is wrong, unless an anchorkv store is here (reads only)."""

    def zarr_store(self, read_only: bool = True) -> ZarrStore:
        """The same bytes as a zarr-python store (for readers that open entries with zarr)."""

    # ------------------------------------------------------------------ objects
    def read(self, path: str) -> bytes:
        """The whole object."""

    def read_ranges_into(self, path: str, ranges: list[tuple[int, list[memoryview]]],
                         check: RangeCheck | None = None) -> tuple[int, list[int]]:
        """Read byte ranges of an object into buffers: each range `(offset, buffers)` fills its
        buffers in order from `offset`. `check(the object's size, i, bytes read into range i)`,
        if given, is called for every range in order once its bytes are in (a local file: right
        after, before the next range is read); what it raises stops the read and propagates.
        Returns (the object's size, bytes read per range: less than asked where the object ends
        early)."""

    def write(self, path: str, buffers: Buffers, *, atomic: bool = False) -> None:
        """Write an object from `buffers` (creating its directories); `atomic`: readers see the
        old object or the new one, never a part (metadata)."""

    def stamp(self, path: str) -> object:
        """A token that changes whenever the object at `path` is replaced or removed (local: its
        inode, mtime and size; `()` when it is missing), so a manifest cached by one process
        is known stale once another deletes the entry and writes the same id again. None where
        no object is ever replaced under one path (an object store: an entry's name holds its
        write id), so what is cached stays true."""

    def exists(self, path: str) -> bool:
        """Whether the object (or, locally, the directory) exists."""

    def delete(self, path: str) -> None:
        """Delete one object (none there: nothing happens)."""

    def mtime(self, path: str) -> float | None:
        """The modification time of an object or directory (None: there is none)."""

    # ------------------------------------------------------------------ prefixes
    def list_dir(self, prefix: str) -> list[str]:
        """The names one level below `prefix`, sorted (none there: an empty list)."""

    def delete_tree(self, prefix: str) -> None:
        """Delete everything under `prefix`, so that the entry there vanishes at once."""

    def remove_if(self, prefix: str, still: Callable[[bytes | None], bool]) -> bool:
        """Delete the entry at `prefix` only if `still(its zarr.json, None if absent)` holds for
        the entry deleted (not for one another write put there meanwhile); True if deleted."""

    def tree_size(self, prefix: str) -> int:
        """Bytes of every object under `prefix` (0 if there is none)."""

    def newest_mtime(self, prefix: str) -> float | None:
        """The newest modification time of the objects under `prefix` (None: no object)."""

    def remove_empty_dir(self, prefix: str) -> bool:
        """Remove a key's `prefix` if it holds nothing but its group ``zarr.json``; True if removed."""

    def trash(self) -> list[str]:
        """Paths of what deletes left behind when their process died (they are garbage);
        a backend that deletes in place has none."""

    # ------------------------------------------------------------------ commit protocol
    def data_prefix(self, final: str, write_id: str) -> str:
        """Where the write `write_id` puts the data of the entry that will live at `final`."""

    def publish(self, staged: str, final: str) -> bool:
        """Make the entry written under `staged` visible at `final`; False if another write of
        the same entry was published first (the caller keeps that one)."""

    # ------------------------------------------------------------------ last use
    def touch_entry(self, entry: str) -> None:
        """Record a use of the entry at `entry` (for LRU eviction)."""

    def last_use(self, entry: str) -> float | None:
        """When the entry at `entry` was last used (None: never recorded)."""
