"""The connector's view of the store: look up, load a rank's slice, save a rank's part.

`EntryStore` is the small contract the scheduler and worker sides use; `ZarrEntryStore`
implements it over `anchorkv.store`. Tests may substitute another implementation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from anchorkv.codec import Packed
from anchorkv.connector.plan import SaveSpec


@dataclass(frozen=True)
class EntryRef:
    """A committed entry: its id (picklable, sent to the workers), its prefix length, and how
    many of its first tokens the request it was found for shares (`shared` lookups; None: all)."""

    entry_id: str
    num_tokens: int
    shared_tokens: int | None = None
    #: which write of the entry the lookup found (`EntryInfo.version`): another process may
    #: delete an entry and write the same id again, and the loads of one restore (every field,
    #: every rank) must all read the write the scheduler found, or fail. None: any.
    version: str | None = None

    @property
    def tokens(self) -> int:
        """The entry's tokens the request can use."""
        return self.num_tokens if self.shared_tokens is None else self.shared_tokens


class EntryStore(Protocol):
    """What the connector needs of a store. Optional, called where present: `remote` (a
    property: reads are round trips, so a restore reads more parts at once) and
    `prepare(entry_id, parts, *, tp_size, tp_rank, version)`, which a restore from a store that
    is not remote calls on its load thread before its parts (`(layer, field, rows)` each, as
    `load` takes them) are read on several: whatever the loads work out before reading (a
    manifest, read plans) is done there once, and may raise what those loads would."""

    def lookup(self, *, anchor: str | None, token_ids: list[int], max_tokens: int,
               multiple_of: int, mode: str, scope: str | None = None, shared: bool = False,
               exclude: frozenset[str] = frozenset(), why: list[str] | None = None) -> EntryRef | None:
        """The longest usable entry: prefix length <= max_tokens, a multiple of `multiple_of`,
        whose prefix tokens match `token_ids` (exact mode) or that shares the anchor (semantic),
        saved under the same isolation `scope` (entries of another scope are never read).
        `shared` (exact mode, models without recurrent state): or an entry of any length whose
        first whole 256-token blocks `token_ids` shares, when those are more tokens
        (`EntryRef.shared_tokens`). Never an entry of `exclude` (ids). `why` gets the reasons
        entries were passed over (`Miss` values) when none is found."""

    def load(self, entry_id: str, layer: str, field: str, *, tp_size: int, tp_rank: int,
             rows: tuple[int, int] | None, host: Callable[[int], torch.Tensor] | None = None,
             version: str | None = None) -> Packed:
        """This rank's slice of one field of one layer: state fields `[1, *rank shape]`, paged
        fields the token rows [rows[0], rows[1]) as `[n, *row]`. Raises if missing or corrupt,
        or if the entry is now another write than `version` (`EntryRef.version`, when given).
        `host(nbytes)`, when given, is where the bytes go (`codec.HostArena`: a restore's parts
        in one page-locked buffer, which crosses to the GPU without a staging copy); an
        implementation may ignore it."""

    def forget(self, entry_id: str) -> None:
        """A load of the entry failed: whatever is cached of it is read again at its next use
        (it may have been deleted and written again by another process since it was cached)."""

    def discard_damaged(self, entry_id: str, version: str | None) -> bool:
        """A load of the entry failed its checks: check the whole entry and delete it if it is
        damaged and still the write `version`, so that the next save of its tokens writes it
        again (a save never replaces an entry that exists). True if deleted."""

    def entry_id_of(self, spec: SaveSpec) -> str:
        """The id of the entry `spec` saves (what a lookup of its tokens returns)."""

    def save_part(self, spec: SaveSpec, parts: dict[tuple[str, str], Packed], *, tp_size: int,
                  tp_rank: int) -> int:
        """Write this rank's part of the entry (unless an entry of its tokens exists that is not
        `spec.replace`); the entry becomes visible once every rank's part is written. Returns the
        bytes written. The parts' memory is the caller's again when this returns: nothing may
        read it later (the worker reuses its page-locked save buffers)."""
