"""Scheduler side: find an entry for a request, plan its load, plan saves.

Runs in vLLM's scheduler process, on its hot loop: lookups read only the store's small index
(manifests), never chunk data, and nothing here blocks on I/O of cache bytes.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from anchorkv.connector.config import ConnectorConfig
from anchorkv.connector.counters import Counters, Miss
from anchorkv.connector.plan import (
    GroupInfo,
    GroupKind,
    LoadSpec,
    Metadata,
    SaveSpec,
    cdiv,
    first_row,
    select_blocks,
)
from anchorkv.connector.storage import EntryRef, EntryStore
from anchorkv.store.keys import TOKEN_BLOCK

log = logging.getLogger("anchorkv.connector")

#: Seconds an entry whose load failed (corrupt, deleted, timed out) is not offered again.
BAD_ENTRY_TTL_S = 300.0


def anchor_of(request: Any) -> str | None:
    params = getattr(request, "kv_transfer_params", None) or {}
    anchor = params.get("anchor") if isinstance(params, dict) else None
    return anchor if anchor else None


def scope_of(request: Any) -> str | None:
    """The request's isolation scope: a digest of what vLLM 0.33 folds into its block hashes to
    keep requests apart (`v1/core/kv_cache_utils.generate_block_hash_extra_keys`): the
    `cache_salt` and the LoRA adapter (name, path). None when it has neither (unscoped: the
    entries every unsalted request shares). Only a digest travels on: the salt never appears
    in a store path or manifest (the store hashes the scope again into keys and prefix hashes).
    Multimodal inputs and prompt embeddings, vLLM's other extra keys, are not in the scope:
    `cacheable` keeps such requests away from the store."""
    parts: list[tuple[str, ...]] = []  # (kind, its values)
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(("cache_salt", str(salt)))
    lora = getattr(request, "lora_request", None)
    if lora:
        parts.append(("lora", str(getattr(lora, "lora_name", "")), str(getattr(lora, "lora_path", ""))))
    if not parts:
        return None
    h = hashlib.sha256(b"anchorkv/request-scope/v1\0")
    for part in parts:
        for s in part:
            h.update(s.encode())
            h.update(b"\0")
        h.update(b"\1")
    return h.hexdigest()


def cacheable(request: Any) -> bool:
    """False for requests whose state depends on more than their tokens, scope and anchor:
    multimodal inputs or prompt embeddings (vLLM hashes those into its block hashes; anchorkv
    keys by token ids, so it neither restores nor saves such requests)."""
    return not (getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None)


@dataclass
class _Tracked:
    """What the scheduler side remembers of a live request (never its block ids: vLLM hands
    over the blocks holding a state in the step that state exists, and only those are read)."""

    anchor: str | None
    prompt: tuple[int, ...]
    scope: str | None = None
    cacheable: bool = True
    table: list[list[int]] | None = None  # without vLLM's block state only: the worker's view
    loaded: int = 0  # tokens restored from the store (not saved again)
    prefill_saved: bool = False
    boundary_saved: bool = False
    #: where the prompt leaves the prefix it shares with a request in vLLM's own prefix cache
    #: (0: none), as vLLM found it when it first admitted the request (`shared_prefix_boundary`;
    #: None: not admitted yet). Not read again when a preempted request resumes: vLLM then
    #: reports the request's own cached progress as a junction
    junction: int | None = None
    junction_saved: bool = False


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, groups: list[GroupInfo], mode: str,
                 store: EntryStore, *, granularity: int = 1, decode_only: bool = False) -> None:
        self.config = config
        #: restore only entries that leave the prompt's last token to compute (the decode
        #: kernel's path): the engine cannot prefill after restored tokens, see
        #: `vllm_layout.no_prefill_after_restore`
        self.decode_only = decode_only
        #: restorable entry lengths are multiples of this (the attention block where the
        #: platform's in-block token order is opaque, see `vllm_layout.opaque_kv_layout`)
        self.granularity = granularity
        self.groups = groups
        self.mode = mode
        self.store = store
        self.block_size = next(g.block_size for g in groups if g.kind is GroupKind.PAGED)
        self.state_groups = tuple(g.index for g in groups if g.kind is GroupKind.STATE)
        #: a model without recurrent state (attention, MLA) holds the state after k tokens in an
        #: entry's first k rows, so a prompt restores an entry of its own n tokens short of the
        #: last token (the same prompt again: a retry, a prefill/decode split; see
        #: `_tokens_to_load`); a hybrid's state, and a sliding-window layer's last rows, exist
        #: only at the entry's end (`whole_only`)
        self.whole_only = bool(self.state_groups) or any(g.window is not None for g in groups)
        self.prefix_loads = not self.whole_only
        # req id -> (entry matched by the last lookup, tokens vLLM had computed locally then,
        # tokens of the entry to restore)
        self._found: dict[str, tuple[EntryRef, int, int]] = {}
        self._pending_loads: list[LoadSpec] = []
        self._pending_saves: list[SaveSpec] = []
        self._requests: dict[str, _Tracked] = {}
        #: req id -> (entry id, write) of a planned async load
        self._loading: dict[str, tuple[str, str | None]] = {}
        self._aborted_loads: dict[str, tuple[str, str | None]] = {}  # the same, of requests finished while it runs
        self._failed: set[str] = set()  # requests whose load failed: vLLM computes them
        #: entry id -> (when its load failed, the write that failed): a new write of the id (the
        #: worker deletes an entry a load found damaged, and the next save writes it again) is
        #: not bad
        self._bad_entries: dict[str, tuple[float, str | None]] = {}
        self.stats = Counters()
        self._outcome: dict[str, Miss | None] = {}  # req id -> its last lookup's miss (None: found)

    def on_new_request(self, request: Any) -> None:
        self._requests[request.request_id] = _Tracked(anchor_of(request), tuple(request.prompt_token_ids or ()),
                                                      scope_of(request), cacheable(request))

    # -------------------------------------------------------------------- lookup / load

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if request.request_id in self._failed:
            return 0, False  # its load failed once (counted then): recompute, do not retry
        if not cacheable(request):
            self._outcome[request.request_id] = Miss.UNCACHEABLE
            return 0, False
        if num_computed_tokens % self.block_size:
            # A load writes whole paged rows from a block boundary on. vLLM 0.33 floors the
            # local hit it presents to a block; should it not, load nothing rather than
            # misplace rows or overwrite the local hit's (shared) partial block.
            log.debug("anchorkv: request %s: local hit of %d tokens is not block-aligned; no load",
                      request.request_id, num_computed_tokens)
            self._found.pop(request.request_id, None)
            self._outcome[request.request_id] = Miss.UNALIGNED
            return 0, False
        n = len(request.prompt_token_ids or ())
        ref, miss = self._lookup(request, n if self.prefix_loads else n - 1)
        take = 0 if ref is None else self._tokens_to_load(ref, n)
        if ref is not None and ref.tokens >= n and take < n - 1:  # the own entry, cut: a shorter one may give more
            shorter, _ = self._lookup(request, n - 1)
            shorter_take = 0 if shorter is None else self._tokens_to_load(shorter, n)
            if shorter_take > take:
                ref, take = shorter, shorter_take
        if ref is not None and take == 0:
            ref, miss = None, Miss.TOO_LONG
        if ref is not None and take <= num_computed_tokens:
            ref, miss = None, Miss.COVERED_LOCALLY
        if ref is not None and self.decode_only and n - take > 1:
            ref, miss = None, Miss.NEEDS_PREFILL
        self._outcome[request.request_id] = miss
        if ref is None:
            self._found.pop(request.request_id, None)
            return 0, False
        self._found[request.request_id] = (ref, num_computed_tokens, take)
        return take - num_computed_tokens, self.config.async_load

    def _tokens_to_load(self, ref: EntryRef, prompt_len: int) -> int:
        """Tokens of an entry a prompt of `prompt_len` tokens restores: all of a shorter entry
        it matches whole, or (`prefix_loads` only: an entry of the whole prompt, or the first
        whole 256-token blocks of one it shares) whole blocks short of the last token and of
        the shared part (a store read for the rows of a partial block would cost more than
        computing them, and the same prompt on the same engine finds those blocks in vLLM's own
        prefix cache: then nothing is read); an engine restoring single-token remainders
        (`decode_only`) takes all but the last token. 0: none."""
        if ref.tokens < prompt_len and ref.shared_tokens is None:
            return ref.tokens
        cap = min(ref.tokens, prompt_len - 1)
        step = self.granularity if self.decode_only else max(self.granularity, self.block_size)
        return cap // step * step

    def _lookup(self, request: Any, limit: int) -> tuple[EntryRef | None, Miss | None]:
        """The longest entry of at most `limit` tokens this engine can restore for `request`
        that has not failed to load recently: any length in both mamba modes (align mode reads
        the state of a request that starts with n computed tokens from the block of token
        n - 1, whatever n). `limit` is below the prompt's length (vLLM must compute one token to
        sample from), or as long as it with `prefix_loads` (`_tokens_to_load` cuts it). With it,
        why there is none (None when an entry was found).

        An anchored request whose anchor holds no entry it can use (a new conversation) looks
        among the entries keyed by tokens (exact mode): a junction's, saved for every request
        that starts with a shared prefix whatever its anchor (`_maybe_save_boundary`)."""
        prompt = list(request.prompt_token_ids or [])
        anchor = anchor_of(request)
        if len(prompt) < 2 or (anchor is None and len(prompt) < TOKEN_BLOCK):  # the store keys neither
            return None, Miss.TOO_SHORT
        ref, miss = self._lookup_under(request, prompt, anchor, limit)
        if (ref is None and miss is not Miss.STORE_ERROR and anchor is not None and self.config.lookup == "exact"
                and len(prompt) >= TOKEN_BLOCK):
            by_tokens, fallback_miss = self._lookup_under(request, prompt, None, limit)
            if by_tokens is not None or fallback_miss is Miss.STORE_ERROR:
                return by_tokens, fallback_miss
        return ref, miss

    def _lookup_under(self, request: Any, prompt: list[int], anchor: str | None,
                      limit: int) -> tuple[EntryRef | None, Miss | None]:
        """`_lookup` under one key: the anchor's, or the tokens' (`anchor` None)."""
        scope = scope_of(request)
        miss = Miss.NO_ENTRY
        bad: set[str] = set()
        for _ in range(64):  # each round excludes one bad entry; a bound, not a retry count
            if limit < 1:
                return None, miss
            why: list[str] = []
            try:
                ref = self.store.lookup(anchor=anchor, token_ids=prompt, max_tokens=limit,
                                        multiple_of=self.granularity, mode=self.config.lookup, scope=scope,
                                        shared=self.prefix_loads, exclude=frozenset(bad), why=why)
            except Exception as e:  # a store outage is a cache miss, never a failed request
                log.warning("anchorkv: lookup for request %s failed (%s); computing it", request.request_id, e)
                return None, Miss.STORE_ERROR
            if ref is None:
                # a bad entry passed over first explains the miss better than what came after
                if miss is Miss.NO_ENTRY and why:
                    miss = Miss(why[0]) if why[0] in Miss._value2member_map_ else Miss.NO_ENTRY
                return None, miss
            if not self._is_bad(ref.entry_id, ref.version):
                return ref, None
            log.debug("anchorkv: entry %s failed to load recently; trying other entries", ref.entry_id)
            bad.add(ref.entry_id)
            miss = Miss.BAD_ENTRY
            if ref.shared_tokens is None:  # a whole match: then look below its length, as always
                limit = ref.num_tokens - 1
        return None, miss

    def update_state_after_alloc(self, request: Any, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None:
        tracked = self._requests.get(request.request_id)
        if tracked is not None and tracked.junction is None:  # vLLM sets it before this call
            tracked.junction = int(getattr(request, "shared_prefix_boundary", 0) or 0)
        self._count_lookup(request, num_external_tokens)
        if num_external_tokens <= 0:
            return
        found = self._found.pop(request.request_id, None)
        if found is None:
            return
        # The local hit as presented to the lookup: vLLM 0.33 sets request.num_computed_tokens
        # only after this call (it is 0 here for a new request, local + external for a
        # deferred load), so it cannot tell where the load starts.
        ref, start, take = found
        if start + num_external_tokens != take:
            raise RuntimeError(
                f"anchorkv: vLLM accepted {num_external_tokens} external tokens for request "
                f"{request.request_id} after a local hit of {start}; the load restores the state "
                f"after {take} tokens only; this is a bug"
            )
        blocks = select_blocks(self.groups, block_ids, start, take, self.mode)
        if blocks is None:
            raise RuntimeError(
                f"anchorkv: no blocks allocated for the state after {take} tokens of "
                f"request {request.request_id} (block ids {block_ids}); this is a bug"
            )
        sync = not self.config.async_load
        self._pending_loads.append(LoadSpec(request.request_id, ref.entry_id, start, take, blocks, sync=sync,
                                            version=ref.version))
        if not sync:
            self._loading[request.request_id] = (ref.entry_id, ref.version)
        tracked = self._requests.get(request.request_id)
        if tracked is not None:
            tracked.loaded = take

    def _count_lookup(self, request: Any, num_external_tokens: int) -> None:
        """Count the lookup of a request vLLM admits now, once per admission (vLLM may ask
        `get_num_new_matched_tokens` several times before it can admit a request)."""
        if request.request_id not in self._outcome:
            return  # not looked up for this admission (its load finished, or failed earlier)
        miss = self._outcome.pop(request.request_id)
        if miss is None and num_external_tokens <= 0:
            miss = Miss.DECLINED
        self.stats.lookup(miss, tokens=max(num_external_tokens, 0), scoped=scope_of(request) is not None)
        if miss is not None:
            log.debug("anchorkv: request %s: computed, not restored (%s)", request.request_id, miss.value)

    def get_loaded_group_ids(self) -> tuple[int, ...]:
        """The groups a load restores completely (the state groups). vLLM then zeroes the
        paged blocks it allocates for the external tokens, so rows past the entry's end in its
        last block never hold stale bytes (the worker zeroes them again after writing)."""
        return self.state_groups

    def _is_bad(self, entry_id: str, version: str | None) -> bool:
        mark = self._bad_entries.get(entry_id)
        if mark is not None and time.monotonic() - mark[0] > BAD_ENTRY_TTL_S:
            del self._bad_entries[entry_id]
            mark = None
        return mark is not None and (mark[1] is None or version is None or mark[1] == version)

    def loads_finished(self, finished: set[str], failed: set[str]) -> None:
        """Workers reported these loads done (`finished`) or failed (`failed`, a subset)."""
        for req_id in finished | failed:
            entry = self._loading.pop(req_id, None)
            aborted = self._aborted_loads.pop(req_id, None)
            if req_id in failed:
                if aborted is None:  # (an aborted request is gone: nothing to recompute)
                    self._failed.add(req_id)
                entry = entry or aborted
                tracked = self._requests.get(req_id)
                if tracked is not None:
                    tracked.loaded = 0  # vLLM recomputes it: its own state is worth saving
                if entry is not None:
                    self._bad_entries[entry[0]] = (time.monotonic(), entry[1])
                    self.store.forget(entry[0])  # a new write of it is read, not a stale manifest
                log.info("anchorkv: load of request %s from entry %s failed; vLLM recomputes it",
                         req_id, entry and entry[0])

    # -------------------------------------------------------------------- saves

    def build_meta(self, scheduler_output: Any) -> Metadata:
        meta = Metadata(loads=self._pending_loads, saves=self._pending_saves,
                        preempted=set(getattr(scheduler_output, "preempted_req_ids", None) or ()))
        self._pending_loads, self._pending_saves = [], []
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        offers = block_state.boundary_state_offloads if block_state is not None else {}
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id in meta.preempted:
            tracked = self._requests.get(req_id)
            if tracked is not None:
                tracked.table = None  # its blocks are gone; a resumed request gets new ones
        steps = []
        for new in scheduler_output.scheduled_new_reqs:
            steps.append((new.req_id, new.num_computed_tokens, new.block_ids, True))
        cached = scheduler_output.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", None) or ())
        for i, req_id in enumerate(cached.req_ids):
            steps.append((req_id, cached.num_computed_tokens[i], cached.new_block_ids[i], req_id in resumed))
        for req_id, computed, new_ids, replaces in steps:
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            if block_state is not None:
                table = block_state.get_block_ids(req_id)
            else:  # vLLM without the block hand-off: keep the worker's view of the table
                if replaces or tracked.table is None:
                    tracked.table = [list(ids) for ids in new_ids] if new_ids is not None else None
                elif new_ids is not None:
                    for g, ids in enumerate(new_ids):
                        tracked.table[g].extend(ids)
                table = tracked.table
            if table is not None:
                if self.mode == "align" and req_id in offers:
                    self._maybe_save_boundary(req_id, tracked, table, offers[req_id], meta)
                self._maybe_save_prefill(req_id, tracked, computed, scheduled.get(req_id, 0), table,
                                         offers.get(req_id, ()), meta)
        if self.mode == "align":
            tables = {req_id: (computed, new_ids) for req_id, computed, new_ids, _ in steps}
            meta.loads = [self._with_running_block(spec, block_state, tables, scheduled)
                          for spec in meta.loads]
        if self._bad_entries:  # (hashes a save's tokens only while some entry is marked bad)
            meta.saves = [self._replacing(spec) for spec in meta.saves]
        return meta

    def _replacing(self, spec: SaveSpec) -> SaveSpec:
        """`spec`, told to publish over its entry's write that a load found damaged: the
        recomputed tokens' save would otherwise find that entry and write nothing (the worker's
        repair deletes it off the load path, usually after this save)."""
        entry = self.store.entry_id_of(spec)
        if not self._is_bad(entry, None):
            return spec
        version = self._bad_entries[entry][1]
        return spec if version is None else replace(spec, replace=version)

    def _with_running_block(self, spec: LoadSpec, block_state: Any, tables: dict, scheduled: dict) -> LoadSpec:
        """A sync load in align mode also fills the block of the step's last scheduled token:
        `preprocess_mamba` copies the state into it *before* `start_load_kv` runs, and the
        kernels read it from there."""
        if not spec.sync or spec.req_id not in tables:
            return spec
        computed, new_ids = tables[spec.req_id]
        table = block_state.get_block_ids(spec.req_id) if block_state is not None else new_ids
        curr = cdiv(computed + scheduled.get(spec.req_id, 0), self.block_size) - 1
        if table is None or curr == (spec.num_tokens - 1) // self.block_size:
            return spec
        blocks = []
        for g in self.groups:
            ids = spec.blocks[g.index]
            if g.kind is GroupKind.STATE:
                extra = list(table[g.index])[curr] if curr < len(table[g.index]) else 0
                if extra == 0:
                    raise RuntimeError(f"anchorkv: request {spec.req_id} has no state block at index "
                                       f"{curr} (block ids {table}); this is a bug")
                ids = (*ids, extra)
            blocks.append(ids)
        return replace(spec, blocks=tuple(blocks))

    def _maybe_save_prefill(self, req_id: str, tracked: _Tracked, computed: int, scheduled: int,
                            table: tuple[list[int], ...] | list[list[int]],
                            offers: Any, meta: Metadata) -> None:
        """In the step that computes a prompt's last token, save the state after the prompt,
        read from the blocks vLLM gives the request in this very step (read in this step's
        `wait_for_save`, after the forward, before any later step can reuse a block).

        A chunk that runs past the prompt (a preempted request recomputing its output
        tokens) leaves no state at the prompt's end; align mode then saves the longest
        boundary state vLLM offers in this step (`boundary_state_offloads`, exact blocks).

        Sliding-window attention without state: an entry restores only whole, so one of the
        prompt's own length would serve no prompt that is not longer; it is saved one token
        short (whole attention blocks where only those can be saved), which serves the same
        prompt sent again too, in the step whose chunk computes its last token: vLLM frees the
        blocks before the window of the chunk's first token in the step it schedules it, so a
        later chunk may no longer hold the window of a length inside an earlier one."""
        prompt_len = len(tracked.prompt)
        end = computed + scheduled
        if "prefill" not in self.config.save_points or tracked.prefill_saved or not tracked.cacheable:
            return
        window_only = self.whole_only and not self.state_groups
        n = (prompt_len - 1) // self.granularity * self.granularity if window_only else prompt_len
        if not computed < n <= end:
            return
        tracked.prefill_saved = True
        blocks = None
        if window_only or end == prompt_len:
            blocks = select_blocks(self.groups, table, 0, n, self.mode)
        elif self.mode == "align":
            n, blocks = self._offered_boundary(table, offers, prompt_len)
        if n <= tracked.loaded or blocks is None:
            log.debug("anchorkv: request %s: no state to save after its prompt this step", req_id)
            return
        self._plan_save(meta, req_id, tracked, n, blocks, tracked.anchor)

    def _maybe_save_boundary(self, req_id: str, tracked: _Tracked, table, offers, meta: Metadata) -> None:
        """Align mode: save boundary states from the state blocks vLLM offers in the step that
        computes them:

        - the prompt's last block boundary *below* its length: the same prompt sent again (a
          prefill/decode split, a retry) can restore only an entry shorter than the prompt; an
          entry at a block boundary restores at any tp (any entry length does);
        - the **junction**: where the prompt leaves the prefix it shares with a request vLLM
          holds in its prefix cache (a system prompt, a conversation's common start). vLLM
          stops the prefill there and keeps that state (`shared_prefix_boundary`, Marconi-style
          retention), but only in its own memory; saved, every prompt that starts with that
          prefix restores it after a restart or on another instance. A hybrid's state exists
          only at an entry's end, so without this entry such prompts restore nothing."""
        if "prefill" not in self.config.save_points or not tracked.cacheable:
            return
        target = (len(tracked.prompt) - 1) // self.block_size * self.block_size
        j = tracked.junction or 0
        # vLLM stops at the junction floored to a block (at the junction itself where it can
        # keep a state inside a block)
        junction = {j, j // self.block_size * self.block_size} - {0} if not tracked.junction_saved else set()
        if not tracked.boundary_saved and target > tracked.loaded:
            n, blocks = self._offered_boundary(table, [o for o in offers if int(o[2]) == target], target)
            if blocks is not None:
                tracked.boundary_saved = True
                if n in junction:  # the junction is the last boundary: one entry for both
                    self._plan_save(meta, req_id, tracked, n, blocks, self._junction_anchor(tracked, n), junction=True)
                    junction = set()
                else:
                    self._plan_save(meta, req_id, tracked, n, blocks, tracked.anchor)
        points = junction - {target}
        if points:
            n, blocks = self._offered_boundary(table, [o for o in offers if int(o[2]) in points],
                                               min(j, len(tracked.prompt) - 1))
            if blocks is not None and n > tracked.loaded:
                self._plan_save(meta, req_id, tracked, n, blocks, self._junction_anchor(tracked, n), junction=True)

    def _plan_save(self, meta: Metadata, req_id: str, tracked: _Tracked, n: int, blocks: tuple,
                   anchor: str | None, *, junction: bool = False) -> None:
        """Plan the save of the state after the prompt's first `n` tokens, from `blocks`, keyed
        under `anchor` (None: by its tokens); `junction`: a junction's, saved once and counted.
        Nothing is planned (nor counted) for a save the worker would drop: one the store cannot
        key (no anchor, under `TOKEN_BLOCK` tokens), or a state inside an attention block whose
        token order is opaque (`granularity`; see `WorkerSide._whole_blocks`)."""
        if (anchor is None and n < TOKEN_BLOCK) or (self.whole_only and n % self.granularity):
            return
        meta.saves.append(SaveSpec(req_id, anchor, tracked.prompt[:n], n, blocks, scope=tracked.scope,
                                   nonce=uuid.uuid4().hex))
        if junction:
            tracked.junction_saved = True
            self.stats.junction_saved()

    def _junction_anchor(self, tracked: _Tracked, n: int) -> str | None:
        """A junction's entry is keyed by its tokens, not the request's anchor: requests of any
        anchor (or none) that share the prefix find it (`_lookup`; its cache_salt scope is
        kept). One shorter than the store's token key (`TOKEN_BLOCK`, e.g. vLLM stopping inside
        a block at a 200-token system prompt) is kept under the anchor, or not saved at all
        without one. Semantic lookups trust the anchor and never read token-keyed entries: there
        an anchored request's junction stays under its anchor (it is often also the prompt's
        last boundary, which the same prompt sent again restores)."""
        if self.config.lookup == "semantic" and tracked.anchor is not None:
            return tracked.anchor
        return None if n >= TOKEN_BLOCK else tracked.anchor

    def _offered_boundary(self, table, offers, limit: int) -> tuple[int, tuple | None]:
        """The longest boundary <= limit that vLLM offers for every state group this step,
        with the offered state blocks and the request's paged blocks."""
        by_tokens: dict[int, dict[int, int]] = {}
        for group_id, block_id, tokens in offers:
            by_tokens.setdefault(int(tokens), {})[int(group_id)] = int(block_id)
        for n in sorted(by_tokens, reverse=True):
            per_group = by_tokens[n]
            if n > limit or set(self.state_groups) - set(per_group):
                continue
            out = []
            for g in self.groups:
                if g.kind is GroupKind.STATE:
                    out.append((per_group[g.index],))
                else:  # (a sliding window's blocks from its first row: vLLM nulls those before)
                    first, last = first_row(g, 0, n) // g.block_size, cdiv(n, g.block_size)
                    ids = list(table[g.index])[first:last]
                    if len(ids) < last - first or 0 in ids:
                        break
                    out.append(tuple(ids))
            else:
                return n, tuple(out)
        return 0, None

    def request_finished(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        """Save prompt + generated tokens (the next turn restores them) from the block ids
        vLLM hands over now; hold the blocks until the workers have read them."""
        req_id = request.request_id
        tracked = self._requests.pop(req_id, None)
        self._found.pop(req_id, None)
        self._outcome.pop(req_id, None)
        loading_from = self._loading.pop(req_id, None)
        if loading_from is not None:  # its workers still report the load's end: a failure still marks the entry
            self._aborted_loads[req_id] = loading_from
        self._failed.discard(req_id)
        n = request.num_computed_tokens
        if ("finish" not in self.config.save_points or n < 1 or (tracked and n <= tracked.loaded)
                or not cacheable(request)):
            return False, None
        if loading_from is not None:
            return False, None  # finished (aborted) while its load runs: nothing computed to save
        blocks = select_blocks(self.groups, block_ids, 0, n, self.mode)
        if blocks is None:
            log.debug("anchorkv: request %s: no blocks hold the state after %d tokens; not saved", req_id, n)
            return False, None
        tokens = tuple(request.all_token_ids[:n])
        self._pending_saves.append(SaveSpec(req_id, anchor_of(request), tokens, n, blocks, release_blocks=True,
                                            scope=scope_of(request), nonce=uuid.uuid4().hex))
        return True, None
