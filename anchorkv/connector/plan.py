"""What to load and save, in plain dataclasses: the scheduler decides, the worker executes.

These cross from the scheduler process to the workers inside the connector metadata, so they
hold only picklable plain data. No vLLM import here.

Block ids, per KV-cache group (vLLM 0.33, checked with its real scheduler):
  * state groups (KDA), `mamba_cache_mode="none"`: one block per request, the state after all
    computed tokens;
  * state groups, `"align"`: the block table is indexed by position; the state after `n`
    tokens lives at index `(n - 1) // block_size` (the block of its last token: what
    `preprocess_mamba` reads for a request that starts with `n` computed tokens, whatever
    `n`, and where the kernels leave the state of a chunk that ends at `n`). Earlier blocks
    are nulled and freed by the scheduler as the request advances, so a block id is only
    trusted in the step vLLM hands it over (see `SchedulerSide`);
  * paged groups (MLA): block `i` holds tokens `[i * block_size, (i + 1) * block_size)`,
    `block_size` being the scheduler's (tokens per block id), not the attention kernel's;
  * sliding-window groups (paged, with a `window`): the same, but vLLM nulls and frees the
    blocks wholly before the first token the next query attends to; a load and a save touch
    only the blocks from that token's (`first_row`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from anchorkv.codec.models import window_start


class GroupKind(str, Enum):
    STATE = "state"
    PAGED = "paged"


@dataclass(frozen=True)
class GroupInfo:
    """One KV-cache group: its kind, block size in tokens and layer names."""

    index: int
    kind: GroupKind
    block_size: int
    layers: tuple[str, ...]
    #: sliding-window attention (paged groups): the tokens a query attends to, itself included
    window: int | None = None


def first_row(group: GroupInfo, start: int, num_tokens: int) -> int:
    """The first token whose rows a load of tokens [start, num_tokens) (a save: start 0)
    touches in a paged group: `start`, or in a sliding-window group the first row of the block
    that holds the first token the next query attends to, when later (the blocks before it are
    null, and no query after the entry reads them). Block-aligned when `start` is."""
    if group.window is None:
        return start
    return max(start, window_start(num_tokens, group.window, group.block_size))


@dataclass(frozen=True)
class LoadSpec:
    """Restore tokens [start, num_tokens) of entry `entry_id` into a request's blocks."""

    req_id: str
    entry_id: str
    start: int  # tokens already computed locally (block-aligned); paged rows from here on
    num_tokens: int
    blocks: tuple[tuple[int, ...], ...]  # per group: state groups the blocks to fill with the state
    #                                      (the first holds it in the table), paged groups the
    #                                      blocks of [start, num_tokens)
    sync: bool = False  # restore inside start_load_kv, before the forward that reads it
    version: str | None = None  # the write of the entry the lookup found (`EntryRef.version`)


@dataclass(frozen=True)
class SaveSpec:
    """Save the state after `num_tokens` tokens of a request under `anchor` (or its tokens)."""

    req_id: str
    anchor: str | None
    token_ids: tuple[int, ...]  # the first num_tokens tokens
    num_tokens: int
    blocks: tuple[tuple[int, ...], ...]  # per group: state groups (block,), paged groups the blocks of [0, num_tokens)
    release_blocks: bool = False  # a finishing request: report it in finished_sending once read
    scope: str | None = None  # the request's isolation scope (see scheduler.scope_of); None: unscoped
    #: drawn by the scheduler for each save it plans (every rank gets the same): the write id
    #: (`storage_zarr.write_id_of`) is then unique to this save, where request id and tokens
    #: alone repeat (a retried request with the same id, two instances serving one X-Request-Id)
    #: and two saves sharing a write id would stage into one place
    nonce: str = ""
    #: the write of this save's entry a load found damaged (`EntryRef.version`): the save
    #: publishes over it (every rank is told alike); None: an entry that exists is kept
    replace: str | None = None


@dataclass
class Metadata:
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)  # their blocks go back to the pool now


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def state_block_index(num_tokens: int, block_size: int, mode: str) -> int | None:
    """Where the state after `num_tokens` tokens lives in a state group's block list.

    None for no tokens. Align mode: the block of the last token, any `num_tokens`.
    """
    if mode == "none":
        return 0
    if num_tokens <= 0:
        return None
    return (num_tokens - 1) // block_size


def select_blocks(
    groups: list[GroupInfo],
    block_ids: tuple[list[int], ...] | list[list[int]],
    start: int,
    num_tokens: int,
    mode: str,
) -> tuple[tuple[int, ...], ...] | None:
    """Per group, the blocks that hold a request's state after `num_tokens` tokens and its
    paged rows [start, num_tokens) (a sliding-window group's from `first_row`). None if some
    group lacks a needed block (e.g. a null one)."""
    out: list[tuple[int, ...]] = []
    for g in groups:
        ids = list(block_ids[g.index])
        if g.kind is GroupKind.STATE:
            i = state_block_index(num_tokens, g.block_size, mode)
            if i is None or i >= len(ids) or ids[i] == 0:
                return None
            out.append((ids[i],))
        else:
            first, last = first_row(g, start, num_tokens) // g.block_size, cdiv(num_tokens, g.block_size)
            if last > len(ids) or any(b == 0 for b in ids[first:last]):
                return None
            out.append(tuple(ids[first:last]))
    return tuple(out)
