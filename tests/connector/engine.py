"""A miniature vLLM engine on CPU: the real scheduler, the real allocator's views on every
simulated tensor-parallel rank, the real output aggregator, and a fake model that writes
deterministic cache contents, so a restored cache can be compared with what a recompute
would have written.

The fake model: the MLA latent row of token position p is a smooth function of (layer, p,
token); the KDA state after n tokens is pseudo-random, seeded by (layer, tokens[:n]), drawn
over the *logical* (TP-independent) shape and sliced to the rank, so ranks at any tp agree.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass, field

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import vllm_harness as H  # noqa: E402

# The platform is chosen when vLLM is first imported: select the CPU one before anything here
# (or the connector module) imports vLLM, or the hybrid allocator turns itself off.
H._set_env()

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


@dataclass
class Rank:
    connector: object
    caches: dict
    views: dict


@dataclass
class Engine:
    cfg: object
    kv: object
    scheduler: object
    ranks: list[Rank]
    aggregator: object
    tokens: dict[str, list[int]] = field(default_factory=dict)  # req id -> all tokens
    blocks: dict[str, list[list[int]]] = field(default_factory=dict)  # req id -> block table

    @property
    def block_size(self) -> int:
        return self.cfg.cache_config.block_size

    @property
    def mode(self) -> str:
        return self.cfg.cache_config.mamba_cache_mode

    # ------------------------------------------------------------------ requests

    def add(self, req_id: str, prompt: list[int], *, anchor: str | None = None, max_tokens: int = 3):
        params = {"anchor": anchor} if anchor else None
        req = H.make_request(req_id, prompt, max_tokens=max_tokens, kv_transfer_params=params,
                             block_hasher=H.request_block_hasher(self.cfg, self.kv))
        self.tokens[req_id] = list(prompt)
        H.add_request(self.scheduler, req)
        return req

    def step(self):
        out = self.scheduler.schedule()
        self._track_blocks(out)
        outputs = []
        for rank in self.ranks:
            c = rank.connector
            c.bind_connector_metadata(out.kv_connector_metadata)
            c.start_load_kv(None)
            self._fake_forward(rank, out)
            c.wait_for_save()
            res = c.get_transfer_results(out.finished_req_ids)
            c.clear_connector_metadata()
            from vllm.v1.outputs import KVConnectorOutput

            kv_out = KVConnectorOutput(finished_sending=res.finished_sending or None,
                                       finished_recving=res.finished_recving or None,
                                       failed_recving=res.failed_recving)
            outputs.append(H.fake_model_runner_output(out, kv_connector_output=kv_out))
        merged = self.aggregator.aggregate(outputs)
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

    # ------------------------------------------------------------------ fake model

    def _track_blocks(self, out) -> None:
        for new in out.scheduled_new_reqs:
            self.blocks[new.req_id] = [list(b) for b in new.block_ids]
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if cached.new_block_ids[i] is not None:
                for g, ids in enumerate(cached.new_block_ids[i]):
                    self.blocks[rid][g].extend(ids)

    def _computed_ranges(self, out):
        for new in out.scheduled_new_reqs:
            yield new.req_id, new.num_computed_tokens, out.num_scheduled_tokens[new.req_id]
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            yield rid, cached.num_computed_tokens[i], out.num_scheduled_tokens[rid]

    def _fake_forward(self, rank: Rank, out) -> None:
        groups = self.kv.kv_cache_groups
        for rid, start, n in self._computed_ranges(out):
            toks = self.tokens[rid]
            end = start + n
            table = self.blocks[rid]
            for gi, group in enumerate(groups):
                is_state = type(group.kv_cache_spec).__name__ == "MambaSpec"
                for name in group.layer_names:
                    if name not in rank.views:
                        continue
                    view = rank.views[name]
                    layer = int(name.split(".")[2])
                    if is_state:
                        for k, idx in self._state_slots(start, end, len(table[gi])):
                            if table[gi][idx] != 0:
                                self.write_state(view, layer, tuple(toks[:k]), table[gi][idx])
                    else:
                        pos = torch.arange(start, end)
                        rows = latent_rows(layer, pos, torch.tensor(toks[start:end]))
                        lat = view.tensor("latent")
                        for p, row in zip(pos.tolist(), rows):
                            lat[table[gi][p // self.block_size], p % self.block_size] = row

    def _state_slots(self, start: int, end: int, nblocks: int):
        """(tokens, block index) of each state the model leaves behind after computing [start, end)."""
        if self.mode == "none":
            return [(end, 0)]
        bs = self.block_size
        slots = [(k, k // bs - 1) for k in range(start + 1, end + 1) if k % bs == 0]
        slots.append((end, (end - 1) // bs))
        return [(k, i) for k, i in slots if i < nblocks]

    @staticmethod
    def write_state(view, layer: int, tokens: tuple[int, ...], block: int) -> None:
        state = logical_state(layer, tokens)
        for fname, full in state.items():
            f = view.page.field(fname)
            view.tensor(fname)[block] = full[f.rank_slice()]


def make_engine(model_dir: str, store: str, *, mode: str = "none", tp: int = 1, num_blocks: int = 12,
                extra: dict | None = None, ranks: list[int] | None = None, monkeypatch=None) -> Engine:
    """A scheduler plus `tp` worker connectors (ranks simulated in one process)."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    import anchorkv.connector.connector as conn_mod
    from anchorkv.connector import AnchorKVConnector

    extra = {"store": store, **(extra or {})}
    cfg = H.make_vllm_config(model_dir, connector=CONNECTOR, connector_module_path=MODULE,
                             extra_config=extra, enable_prefix_caching=(mode == "align"),
                             mamba_cache_mode=mode, tp=tp)
    H.hybrid_block_size(cfg)
    kv = H.make_kv_cache_config(cfg, num_blocks)
    scheduler = H.make_scheduler(cfg, kv)
    out = []
    for r in ranks if ranks is not None else range(tp):
        if monkeypatch is not None:
            monkeypatch.setattr(conn_mod, "tp_rank", lambda r=r: r)
        c = AnchorKVConnector(cfg, KVConnectorRole.WORKER, kv)
        caches = H.allocate_kv_caches(kv)
        c.register_kv_caches(caches)
        out.append(Rank(c, caches, c.worker.views))
    return Engine(cfg, kv, scheduler, out, KVOutputAggregator(len(out)))
