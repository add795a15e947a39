"""A miniature vLLM engine on CPU: the real scheduler, the real allocator's views on every
simulated tensor-parallel rank, the real output aggregator, and a fake model that writes
deterministic cache contents and checks, before every forward step, every byte a model would
read, so a wrong restore or save shows up as a wrong byte read.

The worker hooks run in the order of vLLM 0.33's `gpu_model_runner.execute_model` and
`kv_connector_model_runner_mixin`: handle_preemptions, `_update_states` (zero
`new_block_ids_to_zero`, drop preempted/finished requests, resumed requests *replace* their
block table), `preprocess_mamba` (align mode: copy the state block of the last computed token
into the block of the last scheduled one), bind metadata, `start_load_kv` before the forward
only when the step has sync loads (after it otherwise), forward, `wait_for_save`,
`get_transfer_results`, clear metadata.

The fake model: the MLA latent row of token position p is a smooth function of (layer, p,
token); the KDA state after n tokens is pseudo-random, seeded by (layer, tokens[:n]), drawn
over the *logical* (TP-independent) shape and sliced to the rank, so ranks at any tp agree.
The cache pool starts as NaN bytes (0xFF), so a byte nobody wrote is a stale byte.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from tests.connector import vllm_harness as H

# The platform is chosen when vLLM is first imported: select the CPU one before anything here
# (or the connector module) imports vLLM, or the hybrid allocator turns itself off.
H._set_env()

#: The anchor the connector tests' requests carry.
ANCHOR = "alice-software-tokyo"
CONNECTOR = "AnchorKVConnector"
MODULE = "anchorkv.connector"


def latent_rows(layer: int, positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[n, 576] bf16: what the fake model writes for these token positions of an MLA layer."""
    c = torch.arange(576, dtype=torch.float32)
    x = torch.sin(positions[:, None].float() * 0.013 + tokens[:, None].float() * 0.7 + c * 0.05 + layer)
    x[:, 512:] *= 3.0
    return x.to(torch.bfloat16)


def logical_state(layer: int, tokens: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """The KDA state after `tokens`: conv [3, 3, 4096] bf16 and recurrent [32, 128, 128] fp32."""
    h = hashlib.sha256(repr((layer, tokens)).encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(h[:8], "little") & (2**62 - 1))
    return {"conv": torch.randn(3, 3, 4096, generator=g).to(torch.bfloat16),
            "recurrent": torch.randn(32, 128, 128, generator=g) * 0.05}


class WrongRead(AssertionError):
    """The fake model would have read a byte that is not what a recompute leaves there."""


@dataclass
class Rank:
    connector: object
    caches: dict
    views: dict
    tables: dict[str, list[list[int]]] = field(default_factory=dict)  # the worker's block tables
    state_idx: dict[str, int] = field(default_factory=dict)  # preprocess_mamba's mamba_state_idx


@dataclass
class Engine:
    cfg: object
    kv: object
    scheduler: object
    ranks: list[Rank]
    aggregator: object
    check: bool = True
    tokens: dict[str, list[int]] = field(default_factory=dict)  # req id -> all tokens
    blocks: dict[str, list[list[int]]] = field(default_factory=dict)  # req id -> rank 0's block table
    reads_checked: int = 0  # (request, forward step, rank) triples whose reads were checked
    forward_hook: object = None  # called as hook(engine, scheduler_output) before each forward
    _expect: dict = field(default_factory=dict)  # this step's expected bytes, shared by the ranks

    @property
    def block_size(self) -> int:
        return self.cfg.cache_config.block_size

    @property
    def mode(self) -> str:
        return self.cfg.cache_config.mamba_cache_mode

    def group_kinds(self) -> list[bool]:
        """Per KV-cache group: True for a state (Mamba-type) group."""
        return [type(g.kv_cache_spec).__name__ == "MambaSpec" for g in self.kv.kv_cache_groups]

    # ------------------------------------------------------------------ requests

    def add(self, req_id: str, prompt: list[int], *, anchor: str | None = None, max_tokens: int = 3,
            cache_salt: str | None = None):
        params = {"anchor": anchor} if anchor else None
        req = H.make_request(req_id, prompt, max_tokens=max_tokens, kv_transfer_params=params,
                             block_hasher=H.request_block_hasher(self.cfg, self.kv), cache_salt=cache_salt)
        self.tokens[req_id] = list(prompt)
        H.add_request(self.scheduler, req)
        return req

    def step(self):
        from vllm.v1.outputs import KVConnectorOutput

        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        outputs = []
        self._expect.clear()
        for rank in self.ranks:
            c = rank.connector
            c.handle_preemptions(meta)
            self._update_states(rank, out)
            if self.mode == "align":
                self._preprocess_mamba(rank, out)
            c.bind_connector_metadata(meta)
            if out.has_sync_kv_loads:
                c.start_load_kv(None)
            if self.forward_hook is not None:
                self.forward_hook(self, out)
            if self.check:
                self._check_reads(rank, out)
            self._fake_forward(rank, out)
            if not out.has_sync_kv_loads:
                c.start_load_kv(None)
            c.wait_for_save()
            res = c.get_transfer_results(out.finished_req_ids)
            c.clear_connector_metadata()
            kv_out = KVConnectorOutput(finished_sending=res.finished_sending or None,
                                       finished_recving=res.finished_recving or None,
                                       failed_recving=res.failed_recving)
            outputs.append(H.fake_model_runner_output(out, kv_connector_output=kv_out))
        if self.ranks:
            self.blocks.update({k: [list(g) for g in v] for k, v in self.ranks[0].tables.items()})
        merged = self.aggregator.aggregate(outputs) if outputs else H.fake_model_runner_output(out)
        for rid, idx in merged.req_id_to_index.items():
            if merged.sampled_token_ids[idx]:
                self.tokens[rid].extend(merged.sampled_token_ids[idx])
        self.scheduler.update_from_output(out, merged)
        return out

    def run(self, max_steps: int = 50, until=None) -> None:
        for _ in range(max_steps):
            out = self.step()
            if not out.total_num_scheduled_tokens:
                self.flush()  # only waiting for a load: let the background I/O finish
            if until is not None and until():
                return
            if until is None and not self.scheduler.requests:
                return
        raise AssertionError(f"engine did not settle in {max_steps} steps: {list(self.scheduler.requests)}")

    def flush(self) -> None:
        """Wait for every background save and load of every rank."""
        for rank in self.ranks:
            rank.connector.worker.flush()

    # ------------------------------------------------------------------ worker-side state

    def _update_states(self, rank: Rank, out) -> None:
        """`GPUModelRunner._update_states`: forget finished/preempted requests, zero freshly
        allocated attention blocks, add new requests, append (or, resumed: replace) blocks."""
        for rid in set(out.finished_req_ids) | set(out.preempted_req_ids or ()):
            rank.tables.pop(rid, None)
            rank.state_idx.pop(rid, None)
        if out.new_block_ids_to_zero:
            ids = torch.tensor(sorted(set(out.new_block_ids_to_zero)))
            for gi, is_state in enumerate(self.group_kinds()):
                if is_state:
                    continue
                for name in self.kv.kv_cache_groups[gi].layer_names:
                    if name in rank.views:
                        rank.views[name].tensor("latent")[ids] = 0
        for new in out.scheduled_new_reqs:
            rank.tables[new.req_id] = [list(b) for b in new.block_ids]
            rank.state_idx.pop(new.req_id, None)
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                rank.tables[rid] = [list(b) for b in new_ids]
                rank.state_idx.pop(rid, None)
            elif new_ids is not None:
                for g, ids in enumerate(new_ids):
                    rank.tables[rid][g].extend(ids)

    def _computed_ranges(self, out):
        for new in out.scheduled_new_reqs:
            yield new.req_id, new.num_computed_tokens, out.num_scheduled_tokens[new.req_id]
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            yield rid, cached.num_computed_tokens[i], out.num_scheduled_tokens[rid]

    def _preprocess_mamba(self, rank: Rank, out) -> None:
        """`mamba_utils.preprocess_mamba`: copy the state block of the last computed token to
        the block of the last scheduled token (the one the kernels read and write)."""
        bs = self.block_size
        for rid, start, n in self._computed_ranges(out):
            prev = rank.state_idx.get(rid)
            if prev is None:
                prev = (start - 1) // bs
            curr = -(-(start + n) // bs) - 1
            rank.state_idx[rid] = curr
            if prev == -1 or prev == curr:
                continue
            table = rank.tables[rid]
            for gi, is_state in enumerate(self.group_kinds()):
                if not is_state:
                    continue
                src, dst = table[gi][prev], table[gi][curr]
                for name in self.kv.kv_cache_groups[gi].layer_names:
                    if name in rank.views:
                        view = rank.views[name]
                        for f in view.page.fields:
                            t = view.tensor(f.name)
                            t[dst] = t[src]

    def _state_block(self, rank: Rank, rid: str, gi: int, start: int, n: int) -> int:
        """The state block the model reads (and then writes) for this step."""
        if self.mode == "none":
            return rank.tables[rid][gi][0]
        return rank.tables[rid][gi][-(-(start + n) // self.block_size) - 1]

    # ------------------------------------------------------------------ reads the model makes

    def _check_reads(self, rank: Rank, out) -> None:
        """Every byte the model reads this step: MLA rows [0, computed) as a recompute leaves
        them, no NaN (stale) row in the request's blocks from `computed` to the end of the block
        of its last scheduled token (where vLLM zeroes new blocks: `needs_kv_cache_zeroing`),
        and the state block holding the state after `computed`."""
        bs = self.block_size
        kinds = self.group_kinds()
        for rid, start, n in self._computed_ranges(out):
            toks = self.tokens[rid]
            table = rank.tables[rid]
            end_row = -(-(start + n) // bs) * bs
            for gi, is_state in enumerate(kinds):
                for name in self.kv.kv_cache_groups[gi].layer_names:
                    if name not in rank.views:
                        continue
                    view = rank.views[name]
                    layer = int(name.split(".")[2])
                    if is_state:
                        if start == 0:
                            continue  # a fresh request: the model ignores the initial state
                        block = self._state_block(rank, rid, gi, start, n)
                        key = ("state", rid, layer, start)
                        if key not in self._expect:
                            self._expect[key] = logical_state(layer, tuple(toks[:start]))
                        want = self._expect[key]
                        for fname, full in want.items():
                            got = view.tensor(fname)[block]
                            exp = full[view.page.field(fname).rank_slice()]
                            if not torch.equal(got, exp):
                                bad = int((got != exp).sum())
                                raise WrongRead(f"request {rid}, rank {rank.connector.worker.tp_rank}: "
                                                f"{name}.{fname} block {block} after {start} tokens: "
                                                f"{bad} of {exp.numel()} values wrong")
                        continue
                    lat = view.tensor("latent")
                    rows = torch.cat([lat[b] for b in table[gi][: end_row // bs]])
                    if start:
                        key = ("rows", rid, layer, start)
                        if key not in self._expect:
                            self._expect[key] = latent_rows(layer, torch.arange(start), torch.tensor(toks[:start]))
                        exp = self._expect[key]
                        got = rows[:start]
                        if not torch.equal(got, exp):
                            bad = int((got != exp).any(dim=1).sum())
                            raise WrongRead(f"request {rid}, rank {rank.connector.worker.tp_rank}: "
                                            f"{name} latent rows [0, {start}): {bad} rows wrong")
                    # where vLLM zeroes new blocks (a model with Mamba-type state, or mixed precision)
                    # a kernel may read a whole block; otherwise attention masks rows past the sequence
                    stale = int(rows[start:].isnan().any(dim=1).sum()) if self.kv.needs_kv_cache_zeroing else 0
                    if stale:
                        raise WrongRead(f"request {rid}: {name} holds {stale} stale (NaN) rows in "
                                        f"[{start}, {end_row}) that attention may read")
            self.reads_checked += 1

    # ------------------------------------------------------------------ fake model

    def _fake_forward(self, rank: Rank, out) -> None:
        groups = self.kv.kv_cache_groups
        kinds = self.group_kinds()
        for rid, start, n in self._computed_ranges(out):
            toks = self.tokens[rid]
            end = start + n
            table = rank.tables[rid]
            for gi, group in enumerate(groups):
                for name in group.layer_names:
                    if name not in rank.views:
                        continue
                    view = rank.views[name]
                    layer = int(name.split(".")[2])
                    if kinds[gi]:
                        for k, block in self._state_slots(rank, rid, gi, start, end):
                            self.write_state(view, layer, tuple(toks[:k]), block)
                    else:
                        pos = torch.arange(start, end)
                        rows = latent_rows(layer, pos, torch.tensor(toks[start:end]))
                        lat = view.tensor("latent")
                        bs = lat.shape[1]
                        for b in range(start // bs, -(-end // bs)):
                            lo, hi = max(start, b * bs), min(end, (b + 1) * bs)
                            lat[table[gi][b], lo - b * bs:hi - b * bs] = rows[lo - start:hi - start]

    def _state_slots(self, rank: Rank, rid: str, gi: int, start: int, end: int):
        """(tokens, block) of each state the model leaves behind after computing [start, end):
        none mode the request's slot; align mode the state at every block boundary inside the
        chunk (kernels write them into the block table) and the running state at the end."""
        table = rank.tables[rid][gi]
        if self.mode == "none":
            return [(end, table[0])]
        bs = self.block_size
        slots = {k // bs - 1: k for k in range(start + 1, end + 1) if k % bs == 0}
        slots[(end - 1) // bs] = end
        return [(k, table[i]) for i, k in sorted(slots.items()) if i < len(table) and table[i] != 0]

    @staticmethod
    def write_state(view, layer: int, tokens: tuple[int, ...], block: int) -> None:
        state = logical_state(layer, tokens)
        for fname, full in state.items():
            f = view.page.field(fname)
            view.tensor(fname)[block] = full[f.rank_slice()]


def make_engine(model_dir: str, store: str, *, mode: str = "none", tp: int = 1, num_blocks: int = 12,
                extra: dict | None = None, ranks: list[int] | None = None, monkeypatch=None,
                max_num_batched_tokens: int | None = None, max_num_seqs: int = 16,
                kernel_block: int | None = None, check: bool = True,
                reserve_full_isl: bool = True) -> Engine:
    """A scheduler plus `tp` worker connectors (ranks simulated in one process).

    `max_num_batched_tokens` small enough makes prefills chunk (it is set after the CPU
    platform's adjustment); `kernel_block` splits the MLA group's blocks into kernel blocks
    of that many tokens, as FlashMLA (64), FlashInfer-MLA (32, 64) or CUTLASS-MLA (128) do.
    `reserve_full_isl=False` admits a request before its whole prompt fits
    (`--scheduler-reserve-full-isl false`), so a prefill can be preempted midway.
    """
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    import anchorkv.connector.connector as conn_mod
    from anchorkv.connector import AnchorKVConnector, storage_zarr

    extra = {"store": store, **(extra or {})}
    cfg = H.make_vllm_config(model_dir, connector=CONNECTOR, connector_module_path=MODULE,
                             extra_config=extra, enable_prefix_caching=(mode == "align"),
                             mamba_cache_mode=mode, tp=tp, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens or 8192)
    cfg.scheduler_config.scheduler_reserve_full_isl = reserve_full_isl
    H.hybrid_block_size(cfg)
    kv = H.make_kv_cache_config(cfg, num_blocks)
    # each simulated engine is a process of its own: its connectors share a store (tp 1) with
    # each other only, never with an engine made before (a restart must start cold)
    storage_zarr._SHARED = {}
    scheduler = H.make_scheduler(cfg, kv)
    kernel_sizes = None
    if kernel_block is not None:
        kernel_sizes = [g.kv_cache_spec.block_size if type(g.kv_cache_spec).__name__ == "MambaSpec"
                        else kernel_block for g in kv.kv_cache_groups]
    out = []
    for r in ranks if ranks is not None else range(tp):
        if monkeypatch is not None:
            monkeypatch.setattr(conn_mod, "tp_rank", lambda r=r: r)
        c = AnchorKVConnector(cfg, KVConnectorRole.WORKER, kv)
        caches = H.allocate_kv_caches(kv, kernel_block_sizes=kernel_sizes)
        for t in {t.untyped_storage().data_ptr(): t for t in caches.values()}.values():
            torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).fill_(0xFF)  # NaN
        c.register_kv_caches(caches)
        out.append(Rank(c, caches, c.worker.views))
    H.handshake(scheduler, [r.connector for r in out])
    return Engine(cfg, kv, scheduler, out, KVOutputAggregator(max(len(out), 1)), check=check)
