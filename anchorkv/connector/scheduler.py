"""Scheduler side: find an entry for a request, plan its load, plan saves.

Runs in vLLM's scheduler process, on its hot loop: lookups read only the store's small index
(manifests), never chunk data, and nothing here blocks on I/O of cache bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import logging
import time
from typing import Any

from anchorkv.connector.config import ConnectorConfig
from anchorkv.connector.plan import (
    GroupInfo,
    GroupKind,
    LoadSpec,
    Metadata,
    SaveSpec,
    save_boundary,
    select_blocks,
    state_block_index,
)
from anchorkv.connector.storage import EntryRef, EntryStore

log = logging.getLogger("anchorkv.connector")

#: Seconds an entry whose load failed (corrupt, deleted, timed out) is not offered again.
BAD_ENTRY_TTL_S = 300.0


def anchor_of(request: Any) -> str | None:
    params = getattr(request, "kv_transfer_params", None) or {}
    anchor = params.get("anchor") if isinstance(params, dict) else None
    return anchor if anchor else None


@dataclass
class _Tracked:
    """What the scheduler side remembers of a live request."""

    anchor: str | None
    prompt: tuple[int, ...]
    blocks: list[list[int]] = field(default_factory=list)  # per group, as allocated so far
    loaded: int = 0  # tokens restored from the store (not saved again)
    prefill_saved: bool = False


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, groups: list[GroupInfo], mode: str,
                 store: EntryStore) -> None:
        self.config = config
        self.groups = groups
        self.mode = mode
        self.store = store
        self.block_size = next(g.block_size for g in groups if g.kind is GroupKind.PAGED)
        # req id -> (entry matched by the last lookup, tokens vLLM had computed locally then)
        self._found: dict[str, tuple[EntryRef, int]] = {}
        self._pending_loads: list[LoadSpec] = []
        self._pending_saves: list[SaveSpec] = []
        self._requests: dict[str, _Tracked] = {}
        self._loading: dict[str, str] = {}  # req id -> entry id of a planned load
        self._failed: set[str] = set()  # requests whose load failed: vLLM computes them
        self._bad_entries: dict[str, float] = {}  # entry id -> when its load failed

    def on_new_request(self, request: Any) -> None:
        self._requests[request.request_id] = _Tracked(anchor_of(request), tuple(request.prompt_token_ids or ()))

    # -------------------------------------------------------------------- lookup / load

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if request.request_id in self._failed:
            return 0, False  # its load failed once: recompute, do not retry
        if num_computed_tokens % self.block_size:
            # A load writes whole paged rows from a block boundary on. vLLM 0.33 floors the
            # local hit it presents to a block; should it not, load nothing rather than
            # misplace rows or overwrite the local hit's (shared) partial block.
            log.debug("anchorkv: request %s: local hit of %d tokens is not block-aligned; no load",
                      request.request_id, num_computed_tokens)
            self._found.pop(request.request_id, None)
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        # never the whole prompt: vLLM must compute at least one token to sample from
        limit = len(prompt) - 1
        multiple = 1 if self.mode == "none" else self.block_size
        try:
            ref = self.store.lookup(
                anchor=anchor_of(request), token_ids=prompt, max_tokens=limit,
                multiple_of=multiple, mode=self.config.lookup,
            )
        except Exception as e:  # a store outage is a cache miss, never a failed request
            log.warning("anchorkv: lookup for request %s failed (%s); computing it", request.request_id, e)
            return 0, False
        if ref is not None and self._is_bad(ref.entry_id):
            log.debug("anchorkv: entry %s failed to load recently; not offered", ref.entry_id)
            ref = None
        if ref is None or ref.num_tokens <= num_computed_tokens:
            self._found.pop(request.request_id, None)
            return 0, False
        self._found[request.request_id] = (ref, num_computed_tokens)
        return ref.num_tokens - num_computed_tokens, self.config.async_load

    def update_state_after_alloc(self, request: Any, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        found = self._found.pop(request.request_id, None)
        if found is None:
            return
        # The local hit as presented to the lookup: vLLM 0.33 sets request.num_computed_tokens
        # only after this call (it is 0 here for a new request, local + external for a
        # deferred load), so it cannot tell where the load starts.
        ref, start = found
        if start + num_external_tokens != ref.num_tokens:
            raise RuntimeError(
                f"anchorkv: vLLM accepted {num_external_tokens} external tokens for request "
                f"{request.request_id} after a local hit of {start}; the entry holds the state "
                f"after {ref.num_tokens} tokens only; this is a bug"
            )
        blocks = select_blocks(self.groups, block_ids, start, ref.num_tokens, self.mode)
        if blocks is None:
            raise RuntimeError(
                f"anchorkv: no blocks allocated for the state after {ref.num_tokens} tokens of "
                f"request {request.request_id} (block ids {block_ids}); this is a bug"
            )
        self._pending_loads.append(LoadSpec(request.request_id, ref.entry_id, start, ref.num_tokens, blocks))
        self._loading[request.request_id] = ref.entry_id
        tracked = self._requests.get(request.request_id)
        if tracked is not None:
            tracked.loaded = ref.num_tokens

    def _is_bad(self, entry_id: str) -> bool:
        t = self._bad_entries.get(entry_id)
        if t is not None and time.monotonic() - t > BAD_ENTRY_TTL_S:
            del self._bad_entries[entry_id]
            t = None
        return t is not None

    def loads_finished(self, finished: set[str], failed: set[str]) -> None:
        """Workers reported these loads done (`finished`) or failed (`failed`, a subset)."""
        for req_id in finished | failed:
            entry = self._loading.pop(req_id, None)
            if req_id in failed:
                self._failed.add(req_id)
                if entry is not None:
                    self._bad_entries[entry] = time.monotonic()
                log.info("anchorkv: load of request %s from entry %s failed; vLLM recomputes it",
                         req_id, entry)

    # -------------------------------------------------------------------- saves

    def build_meta(self, scheduler_output: Any) -> Metadata:
        meta = Metadata(loads=self._pending_loads, saves=self._pending_saves)
        self._pending_loads, self._pending_saves = [], []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._requests.get(new.req_id)
            if tracked is not None:
                tracked.blocks = [list(ids) for ids in new.block_ids]
                self._maybe_save_prefill(new.req_id, tracked, new.num_computed_tokens,
                                         scheduled.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._requests.get(req_id)
            if tracked is None or not tracked.blocks:
                continue
            if cached.new_block_ids[i] is not None:
                for g, ids in enumerate(cached.new_block_ids[i]):
                    tracked.blocks[g].extend(ids)
            self._maybe_save_prefill(req_id, tracked, cached.num_computed_tokens[i],
                                     scheduled.get(req_id, 0), meta)
        return meta

    def _maybe_save_prefill(self, req_id: str, tracked: _Tracked, computed: int, scheduled: int,
                            meta: Metadata) -> None:
        """After the step that computes a prompt's last token, save its last valid boundary."""
        prompt_len = len(tracked.prompt)
        if ("prefill" not in self.config.save_points or tracked.prefill_saved
                or not computed < prompt_len <= computed + scheduled):
            return
        tracked.prefill_saved = True
        n = save_boundary(prompt_len, self.block_size, self.mode)
        if n == 0 or n <= tracked.loaded:
            return  # nothing beyond what was restored from the store
        blocks = select_blocks(self.groups, tracked.blocks, 0, n, self.mode)
        if blocks is None:
            log.debug("anchorkv: request %s has no block with the state after %d tokens", req_id, n)
            return
        meta.saves.append(SaveSpec(req_id, tracked.anchor, tracked.prompt[:n], n, blocks))

    def request_finished(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        """Save prompt + generated tokens (the next turn restores them); hold the blocks till read."""
        req_id = request.request_id
        tracked = self._requests.pop(req_id, None)
        self._found.pop(req_id, None)
        self._failed.discard(req_id)
        self._loading.pop(req_id, None)
        n = request.num_computed_tokens
        if "finish" not in self.config.save_points or n < 1 or (tracked and n <= tracked.loaded):
            return False, None
        if state_block_index(n, self.block_size, self.mode) is None:
            log.debug("anchorkv: request %s ends at %d tokens, not a block boundary; not saved", req_id, n)
            return False, None
        blocks = select_blocks(self.groups, block_ids, 0, n, self.mode)
        if blocks is None:
            return False, None
        tokens = tuple(request.all_token_ids[:n])
        self._pending_saves.append(SaveSpec(req_id, anchor_of(request), tokens, n, blocks, release_blocks=True))
        return True, None
