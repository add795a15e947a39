"""`ZarrEntryStore`: the connector's `EntryStore` over `anchorkv.store.Store` (Zarr v3 entries).

Three things the store alone does not decide, decided here:

* **Which layout the store sees.** The store keeps logical, TP-independent arrays; it needs a
  `ModelLayout` only for the rank's field shapes, dtypes and shard axes. `store_layout` derives
  it from the model layout for any (tp_size, tp_rank), with one token per paged "block": a
  rank's latent rows `[n, row]` are then exactly the store's `[n, 1, row]` (no padding, no
  copy) and any token range can be read. The fingerprint (what an entry must agree with) is
  the same at every tp, so an entry written at tp=2 restores at tp=1 or 4.
* **Which codecs, resolved.** Per field from the config, with the group size resolved the way
  the entry format stores it (a field sharded along its last axis stores "whole" as the
  chunk's last axis, so the groups do not depend on tp); a codec the store cannot keep is
  refused at start-up.
* **The multi-rank commit.** Every rank writes its part with the same write id, derived from
  the save (request id, token count, anchor, tokens), then tries to commit: the last rank to
  finish publishes the entry; the others get `IncompleteEntry` and leave it to that one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from anchorkv.codec import (
    CodecSpec,
    Field,
    LayerKind,
    LayerLayout,
    ModelLayout,
    Packed,
    PageLayout,
)
from anchorkv.codec.layout import dense_strides
from anchorkv.codec.models import ROLE_ALIASES, Role
from anchorkv.connector.config import ConnectorConfig, field_codecs
from anchorkv.connector.plan import SaveSpec
from anchorkv.connector.storage import EntryRef
from anchorkv.store.backends import store_location
from anchorkv.store.commit import manifest_version
from anchorkv.store.errors import CorruptEntry, EntryNotFound, FormatError, IncompleteEntry
from anchorkv.store.format import array_layouts
from anchorkv.store.keys import TOKEN_BLOCK
from anchorkv.store.manifest import EntryInfo
from anchorkv.store.store import Store
from anchorkv.store.writer import EntryWriter

log = logging.getLogger("anchorkv.connector")

def store_layout(model: ModelLayout, tp_size: int, tp_rank: int) -> ModelLayout:
    """The layout the store is given for rank `tp_rank` of `tp_size`: every field dense at its
    rank-local shape, paged fields one token per block. Same fingerprint at every tp."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must lie in [0, tp_size={tp_size}), found {tp_rank}")
    pages: dict[int, PageLayout] = {}
    layers = []
    for layer in model.layers:
        page = pages.get(id(layer.page))
        if page is None:
            fields, offset = [], 0
            for f in layer.page.fields:
                logical = tuple(f.logical_shape) if layer.kind is LayerKind.STATE else (1, *f.logical_shape[1:])
                shape = list(logical)
                if f.shard_axis is not None:
                    shape[f.shard_axis] //= tp_size  # Field checks that tp divides it
                offset = -(-offset // f.itemsize) * f.itemsize
                nf = Field(f.name, f.dtype, tuple(shape), dense_strides(tuple(shape)), offset,
                           logical_shape=logical, shard_axis=f.shard_axis, tp_size=tp_size, tp_rank=tp_rank,
                           role=f.role)
                fields.append(nf)
                offset = nf.extent
            page = pages[id(layer.page)] = PageLayout(tuple(fields), offset)
        layers.append(LayerLayout(layer.name, layer.index, layer.kind, page, layer.window))
    return ModelLayout(model.architecture, tuple(layers), 1, tp_size, tp_rank, model=model.model,
                       weights=model.weights, model_config=model.model_config)


def wanted_codecs(config: ConnectorConfig, model: ModelLayout) -> dict[str, CodecSpec]:
    """The codec config applied to the model's fields: a key names a field or a role (see
    `Role`; ``conv`` and ``recurrent``, the names of Kimi-Linear's fields, also select the
    conv_state and ssm_state roles); a field's own name wins over its role; `raw` otherwise.

    Raises a `ValueError` for a key that is neither a role nor a field of this model."""
    fields = model.field_kinds()
    roles = {r.value for r in Role}
    unknown = sorted(k for k in config.codec if k not in fields and k not in roles and k not in ROLE_ALIASES)
    if unknown:
        raise ValueError(
            f"anchorkv: kv_connector_extra_config 'codec' names {unknown}, neither roles "
            f"({sorted(roles)}) nor fields of this model ({sorted(fields)})"
        )
    return field_codecs(config.codec, {name: f.role for name, f in fields.items()}, default=CodecSpec("raw", None))


def resolve_codecs(config: ConnectorConfig, model: ModelLayout) -> dict[str, CodecSpec]:
    """The codec of every field of the model, group sizes resolved as the entry stores them.

    Raises a `ValueError` naming the field, the codec and a working choice when the store
    cannot keep it (an unknown codec id, a group that does not divide the chunk's last axis).
    """
    wanted = wanted_codecs(config, model)
    try:
        arrays = array_layouts(model, wanted, 1)
    except FormatError as e:
        raise ValueError(
            f"anchorkv: kv_connector_extra_config 'codec' {({k: str(v) for k, v in wanted.items()})} "
            f"cannot be stored: {e}"
        ) from None
    out = {}
    for name, spec in wanted.items():
        resolved = arrays[name].codec.spec
        if spec.id != "raw" and spec.group != resolved.group:
            log.info("anchorkv: codec %s for field %r is stored as %s (groups within one chunk, "
                     "independent of tp)", spec, name, resolved)
        out[name] = resolved
    return out


def write_id_of(spec: SaveSpec, fingerprint_hash: str) -> str:
    """The id every rank uses for one save: the same inputs on every rank (the save's `nonce`
    included: the scheduler draws one per save), nothing random here."""
    h = hashlib.sha256()
    scope = (spec.scope,) if spec.scope else ()
    nonce = (spec.nonce,) if spec.nonce else ()
    for part in (spec.req_id, str(spec.num_tokens), spec.anchor or "", fingerprint_hash, *scope, *nonce):
        h.update(part.encode())
        h.update(b"\0")
    h.update(np.asarray(spec.token_ids[: spec.num_tokens], dtype="<i8").tobytes())
    return h.hexdigest()[:32]


def _open(config: ConnectorConfig) -> Store:
    try:
        return Store.open(config.store, capacity_bytes=config.capacity, **dict(config.storage_options))
    except Exception as e:
        raise ValueError(
            f"anchorkv: cannot open the store {config.store!r} (kv_connector_extra_config "
            f"'store'/'storage_options'): {e}"
        ) from e


#: The `Store`s `ZarrEntryStore(share=True)` opened in this process, by `_share_key`: (the
#: store, its users not closed), both held weakly (a store goes with its last user). At tp 1
#: vLLM builds the scheduler's connector and the worker's in one process (the engine core runs
#: both); with one `Store` a restore's manifest, parsed by the scheduler's lookup, is not read
#: and parsed again by the worker's first read of it (~1-1.5 ms of a Kimi-Linear restore), and
#: the process caches each manifest (~240 KiB) once, its capacity's usage counted once. (A test
#: harness simulating several engine processes in one gives each engine a registry of its own:
#: a `ZarrEntryStore` keeps the one it joined.)
_Registry = dict[tuple, tuple["weakref.ref[Store]", "weakref.WeakSet[ZarrEntryStore]"]]
_SHARED: _Registry = {}
_SHARED_LOCK = threading.Lock()


def _share_key(config: ConnectorConfig) -> tuple | None:
    """What must agree for two connectors to share a `Store`: the store (`store_location`), its
    capacity and options; None where they cannot be compared (an object among the options, e.g.
    a credential provider): then each opens its own."""
    try:
        key = (store_location(config.store), config.capacity, tuple(sorted(config.storage_options.items())))
        hash(key)
    except (TypeError, ValueError, OSError, RuntimeError):
        return None
    return key


def _share(registry: _Registry, key: tuple, config: ConnectorConfig, user: ZarrEntryStore) -> Store:
    """The `Store` of `key` open in this process (`registry`: `_SHARED`), else one opened now;
    `user` one of its users."""
    with _SHARED_LOCK:
        for k in [k for k, (ref, _) in registry.items() if ref() is None]:  # (gone with their users)
            del registry[k]
        held = registry.get(key)
        store = held[0]() if held else None
        if held is None or store is None:
            users: weakref.WeakSet[ZarrEntryStore] = weakref.WeakSet()
            store = _open(config)
            registry[key] = (weakref.ref(store), users)
        else:
            users = held[1]
            log.info("anchorkv: this process's connectors share one store (%s): a manifest the "
                     "scheduler's lookup read is not read again by the worker's restore", store.url)
        users.add(user)
        return store


class ZarrEntryStore:
    """`EntryStore` over a `Store` at `config.store` (a directory or ``s3://bucket/prefix``).

    `config` is the connector config as given; `self.config` is the same with the codecs
    resolved (what the worker must pack with). `model_layout` is the model at any tp.
    `share`: use the `Store` another `ZarrEntryStore(share=True)` of this process opened with
    the same store, capacity and options, if one is open (`close` closes it with its last
    user): the connectors of a one-process engine (tp 1), see `_SHARED`.
    """

    def __init__(self, config: ConnectorConfig, model_layout: ModelLayout, *, store: Store | None = None,
                 share: bool = False) -> None:
        self.model_layout = model_layout
        self.codecs = resolve_codecs(config, model_layout)
        self.config = dataclasses.replace(config, codec=dict(self.codecs))  # per field, resolved
        self.fingerprint_hash = model_layout.fingerprint_hash()
        #: the `_SHARED` key of the store this one shares (None: its own), and that registry
        self._shared: tuple | None = None
        self._registry = _SHARED
        self._closed = False
        if store is None:
            key = _share_key(config) if share else None
            store = _open(config) if key is None else _share(self._registry, key, config, self)
            self._shared = key
        self.store = store
        self._layouts: dict[tuple[int, int], ModelLayout] = {}
        #: a sliding-window field keeps rows from a multiple of this (whole blocks of an engine
        #: whose in-block token order is opaque: a row there is not one token's)
        self.window_align = 1

    @property
    def remote(self) -> bool:
        """Its reads are round trips (an object store, whose backend puts several shards at once):
        the worker reads a restore's parts `worker.REMOTE_READ_THREADS` at a time, not
        `READ_THREADS`."""
        return self.store.backend.write_concurrency > 1

    def __repr__(self) -> str:
        return f"ZarrEntryStore({self.store.url!r}, codecs={ {k: str(v) for k, v in self.codecs.items()} })"

    def set_model_layout(self, model_layout: ModelLayout) -> None:
        """Key lookups and saves to `model_layout` from now on (the same layers: the model's
        identity changed, see `AnchorKVConnector.set_xfer_handshake_metadata`)."""
        if model_layout.layers != self.model_layout.layers:
            raise ValueError("set_model_layout takes the same layers with another model identity")
        self.model_layout = model_layout
        self.fingerprint_hash = model_layout.fingerprint_hash()
        self._layouts.clear()

    def layout(self, tp_size: int, tp_rank: int) -> ModelLayout:
        key = (tp_size, tp_rank)
        out = self._layouts.get(key)
        if out is None:
            out = self._layouts[key] = store_layout(self.model_layout, tp_size, tp_rank)
        return out

    # ------------------------------------------------------------------ lookup

    def lookup(self, *, anchor: str | None, token_ids: list[int], max_tokens: int, multiple_of: int,
               mode: str, scope: str | None = None, shared: bool = False,
               exclude: frozenset[str] = frozenset(), why: list[str] | None = None) -> EntryRef | None:
        """The longest usable committed entry (see `EntryStore.lookup`); reads manifests only."""
        skipped = set(exclude)
        semantic = mode == "semantic" and anchor is not None
        for _ in range(16):  # each round skips one entry this host cannot decode; a bound
            found = self.store.match(
                fingerprint_hash=self.fingerprint_hash, tokens=token_ids,
                anchor=anchor, mode="semantic" if semantic else "exact",
                max_tokens=max_tokens, multiple_of=multiple_of, scope=scope, shared=shared and not semantic,
                exclude=skipped, why=why)
            if found is None:
                return None
            info = found.info
            missing = sorted({a.codec.id for a in info.arrays().values()
                              if a.codec.plugin and not a.codec.installed})
            if not missing:
                return EntryRef(info.id, info.num_tokens,
                                None if found.tokens == info.num_tokens else found.tokens, info.version)
            log.info("anchorkv: entry %s (%d tokens) needs codec plug-in(s) %s, not installed here; "
                     "looking for a shorter one", info.id, info.num_tokens, missing)
            skipped.add(info.id)
            if why is not None:
                why.append("plugin_missing")
        return None

    # ------------------------------------------------------------------ load

    def load(self, entry_id: str, layer: str, field: str, *, tp_size: int, tp_rank: int,
             rows: tuple[int, int] | None, host: Callable[[int], torch.Tensor] | None = None,
             version: str | None = None) -> Packed:
        """This rank's slice of one field of one layer (see `EntryStore.load`).

        Raises the store's `EntryNotFound`, `CorruptEntry` or `FingerprintMismatch` as they are,
        and `CorruptEntry` if the entry is now another write than `version`.
        """
        layout = self.layout(tp_size, tp_rank)
        info = self.entry(entry_id, version)
        if rows is None:
            return self.store.load(info, layout, layer, field, host=host)
        start, n = _token_slice(info, rows)
        p = self.store.load(info, layout, layer, field, start_token=start, num_blocks=n, host=host)
        return p.reshape(n, *p.shape[2:])

    def prepare(self, entry_id: str, parts: Sequence[tuple[str, str, tuple[int, int] | None]], *, tp_size: int,
                tp_rank: int, version: str | None = None) -> None:
        """Read the entry's manifest and plan the loads of `parts` (`(layer, field, rows)` as
        `load` takes them) on this thread, before they are read on several (`Store.prepare`;
        the worker calls it on a local store). Raises what those loads would for their plans."""
        info = self.entry(entry_id, version)
        self.store.prepare(info, self.layout(tp_size, tp_rank), [
            (layer, field, *((0, None) if rows is None else _token_slice(info, rows))) for layer, field, rows in parts])

    def entry(self, entry_id: str, version: str | None = None) -> EntryInfo:
        """The entry's manifest, of the write `version` when given: a manifest cached here of
        another write (the entry was deleted and written again since) is read again; if the
        entry is still another write, `CorruptEntry` (the restore fails and vLLM recomputes).
        Every load of one restore reads the same write, so no restore mixes two."""
        info = self.store.get(entry_id)
        if version is None or info.version == version:
            return info
        self.store.forget(entry_id)
        info = self.store.get(entry_id)
        if info.version != version:
            raise CorruptEntry(entry_id, "it was written again since the lookup that chose it (another write "
                                         "of the same tokens); recompute")
        return info

    def forget(self, entry_id: str) -> None:
        """Read the entry's manifest again at its next use (a load of it failed)."""
        self.store.forget(entry_id)

    def discard_damaged(self, entry_id: str, version: str | None) -> bool:
        """See `EntryStore.discard_damaged`: what `anchorkv gc --verify` would remove, at once.
        Nothing is deleted where the whole entry reads clean (the failure was not its data's),
        where it is pinned by a load of this process, or where it is another write by the time
        it is deleted (`Backend.remove_if`: a review found a repair deleting the good write that
        replaced the damaged one between its check and its delete)."""
        try:
            info = self.entry(entry_id, version)
        except (EntryNotFound, CorruptEntry):
            return False  # gone, another write, or a manifest no lookup returns
        problems = self.store.verify(info)
        if not problems or info.id in self.store.pins:
            return False

        if not self.store.backend.remove_if(info.path, lambda manifest: manifest_version(manifest) == info.version):
            return False
        self.store.forget(entry_id)
        log.warning("anchorkv: entry %s is damaged (%s%s); deleted, so the next save of its tokens writes it "
                    "again", entry_id, problems[0].removeprefix(f"entry {entry_id}: "),
                    f"; {len(problems) - 1} more problems" if len(problems) > 1 else "")
        return True

    # ------------------------------------------------------------------ save

    def save_part(self, spec: SaveSpec, parts: Mapping[tuple[str, str], Packed], *, tp_size: int,
                  tp_rank: int) -> int:
        """Write this rank's part; commit if it is the last to finish. Returns bytes written
        (0: nothing to write, e.g. the entry exists or the prompt is too short to key)."""
        n = spec.num_tokens
        if spec.anchor is None and n < TOKEN_BLOCK:
            log.debug("anchorkv: request %s: %d tokens without an anchor (< %d); not saved",
                      spec.req_id, n, TOKEN_BLOCK)
            return 0
        committed = self._committed(spec)
        if committed is not None and (spec.replace is None or committed.version != spec.replace):
            log.debug("anchorkv: request %s: an entry of its %d tokens exists; not saved again", spec.req_id, n)
            return 0
        layout = self.layout(tp_size, tp_rank)
        wid = write_id_of(spec, self.fingerprint_hash)
        writer = self.store.begin_entry(layout, self.codecs, spec.token_ids, num_tokens=n,
                                        anchor=spec.anchor, write_id=wid, scope=spec.scope,
                                        window_align=self.window_align)
        written = 0
        try:
            for (layer, fname), p in parts.items():
                first = 0  # a sliding window's part holds the entry's last rows (from its first_row)
                lay = layout.layer(layer)
                if lay.kind is LayerKind.PAGED:
                    if p.shape[0] != n and not (lay.window is not None and 0 < p.shape[0] < n):
                        raise ValueError(f"request {spec.req_id}: {layer}.{fname} holds {p.shape[0]} "
                                         f"token rows, the save is of {n} tokens")
                    first = n - p.shape[0]
                    p = p.reshape(p.shape[0], 1, *p.shape[1:])
                written += writer.write_layer(layer, fname, p, first_token=first)
            if tp_size == 1:
                writer.wait_writes()  # (its commit, from memory, needs no part marker)
            else:
                writer.finish_rank()
        except BaseException:
            if tp_size == 1:
                writer.abort()  # other ranks' parts are left to Store.gc
            else:
                writer.settle()  # the caller reuses `parts` once this returns
            raise
        self._try_commit(spec, wid, writer if tp_size == 1 else None)
        return written

    def entry_id_of(self, spec: SaveSpec) -> str:
        """The id of the entry `spec` saves."""
        return self.store.entry_id_for(self.fingerprint_hash, spec.token_ids, spec.num_tokens,
                                       anchor=spec.anchor, scope=spec.scope)

    def _committed(self, spec: SaveSpec) -> EntryInfo | None:
        info = self.store.lookup(fingerprint_hash=self.fingerprint_hash, tokens=spec.token_ids[: spec.num_tokens],
                                 anchor=spec.anchor, mode="exact", scope=spec.scope)
        return info if info is not None and info.num_tokens == spec.num_tokens else None

    def _try_commit(self, spec: SaveSpec, wid: str, writer: EntryWriter | None = None) -> EntryInfo | None:
        """Commit the write if every rank finished its part. Ranks that finish together may
        all commit it at once (in separate processes, or threads of one): the store's publish
        keeps exactly one entry, and a rank whose commit lost the race finds the winner's.
        `writer`: the only rank's (tp_size 1), committed from memory (no part marker).
        A failed commit raises unless an entry of the request's tokens is found committed that
        is not the write it was to replace (`spec.replace`, still there: found by review, a
        failed replace was reported saved)."""
        try:
            if writer is not None:
                info = writer.commit(replace=spec.replace)
            else:
                info = self.store.commit_staged(wid, replace=spec.replace)
        except IncompleteEntry as e:
            if writer is not None:  # the only rank's part lacks layers: no later rank completes it
                writer.abort()
                raise
            log.debug("anchorkv: request %s: not committed yet (%s); the last rank commits", spec.req_id, e)
            return None
        except Exception as e:
            won = self._committed(spec)  # another rank's commit of this write may have won
            if won is None or (spec.replace is not None and won.version == spec.replace):
                raise
            log.debug("anchorkv: request %s: committed by another rank (%s)", spec.req_id, e)
            return won
        log.debug("anchorkv: committed entry %s (%d tokens)", info.id, info.num_tokens)
        return info

    def close(self) -> None:
        """Close the store; a shared one (`share`) when no other user is left open. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._shared is not None:
            with _SHARED_LOCK:
                held = self._registry.get(self._shared)
                if not held or held[0]() is not self.store:
                    return  # (not registered as this one's: its other users' to close, or gc's)
                users = held[1]
                users.discard(self)
                if users:  # (another user still open)
                    return
                del self._registry[self._shared]
        self.store.close()


def _token_slice(info: EntryInfo, rows: tuple[int, int]) -> tuple[int, int]:
    """`ZarrEntryStore.load`'s token rows [start, stop) of a paged field as the store's
    `(start_token, num_blocks)` (its layouts' blocks are one token)."""
    start, stop = rows
    if not 0 <= start < stop <= info.num_tokens:
        raise ValueError(f"entry {info.id}: token rows [{start}, {stop}) requested, it holds "
                         f"tokens [0, {info.num_tokens})")
    return start, stop - start
