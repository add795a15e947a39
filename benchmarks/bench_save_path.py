"""The save path of one Kimi-Linear request: cache on the GPU -> pack -> pinned host -> store.

The request (tp=1; 20 KDA layers x conv `[3, 3, 4096]` bf16 + recurrent `[32, 128, 128]` fp32,
one state block each, and 7 MLA layers x 7680 x 576 bf16: 105.3 MB; `--quick`: the first 3 KDA
layers and the first MLA layer, 1920 tokens: 8.7 MB) sits in the regions vLLM's hybrid allocator
gives it (`anchorkv.testing.regions.hma_regions`: layer j of every group shares region j) on the
benchmark's device, and is saved the way the
connector saves it: `WorkerSide.save` (`anchorkv.codec.pack_many` -> `anchorkv.kernels.pack_many`
on a side stream, then an asynchronous copy of the packed bytes to pinned host memory) and, on
its writer thread, `ZarrEntryStore.save_part` into a local store. Each round saves new token
ids, so every round writes and commits a new entry.

Providers, per codec set (`raw`; `quant` = conv int8:128, recurrent int8:128, latent fp8:64, as
`bench_kernels.py`):
    d2h-raw     one copy of the request's raw bytes from one device buffer to pinned host memory
    d2h-packed  the same for the packed bytes (the baseline of the target: save >= 0.8 of it)
    pack        `anchorkv.codec.pack_many` of every (layer, field), synchronized
    pack+d2h    `WorkerSide.save` + `flush` with a store that keeps nothing: pack, pinned copy,
                the writer thread's checks (what the GPU and PCIe do for a save), the copies on
                the side stream after the pack (`worker.SAVE_COPY_STREAM` off)
    stream      the same, `STREAM` saves of new tokens issued back to back (several requests
                finishing in one step) and one `flush`: the time per save (the save path's
                sustained rate; the kernels' `stream` rows are its analogue)
    pack+d2h+cs, stream+cs
                the two above with `worker.SAVE_COPY_STREAM` (the copies on a stream of their
                own, so a save's pack does not queue behind the last save's copy; CUDA only; the
                worker's default since the H200 run of stop 41)
    set+d2h     the worker's `PackSet.pack`, then one copy of the batch into a reused pinned
                buffer: the GPU and PCIe part of a save alone, pack then copy (CUDA only)
    chunks+d2h  the same set's `pack_chunks` (`CHUNKS` launches), each chunk's bytes copied on a
                second stream after its launch: the copy overlapping the pack (CUDA only; what
                a save could do, not what it does yet)
    save        `WorkerSide.save` + `flush` into a `ZarrEntryStore` on local disk (the whole path)
    write-packed
                the packed bytes, already in host memory, written as plain files (one per
                layer and field, payload then scales) into the store's filesystem: the disk
                side's baseline (the DESIGN's target for `save`: >= 0.8 of the slower of this
                and `d2h-packed`)

`extra_info`: `bytes` (what the provider delivers to the host: packed bytes, or the raw bytes for
`d2h-raw`), `gbps` = bytes / median, `state_gbps` = raw state bytes / median, and the time
ratios `ratio_vs_d2h_packed` = d2h-packed median / this median and `ratio_vs_d2h_raw`, both
measured in the same process; for `save` also `ratio_vs_slower` = the slower of the
`d2h-packed` and `write-packed` medians / its median. For `pack+d2h` and `save`, `launch_s` is the median time until
`WorkerSide.save` returned (what the forward pass waits for). Before each save round (untimed)
`os.sync()` flushes earlier rounds' dirty pages; nothing calls fsync, so the store's writes end
in the page cache (as in `bench_store.py`).

On a machine without CUDA the same code runs the torch reference (the library's CPU path) and
the "d2h" copies are host-to-host copies into ordinary memory; `--quick` (`anchorkv bench
--quick`, CI) runs one round of each at the quick size.

    .venv/bin/python -m pytest benchmarks/bench_save_path.py --benchmark-only
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from anchorkv.codec import (
    KIMI_LINEAR_48B_CONFIG,
    LayerKind,
    ModelLayout,
    Packed,
    custom_layout,
    kimi_linear_layout,
    pack_many,
)
from anchorkv.connector.config import ConnectorConfig
from anchorkv.connector.plan import GroupInfo, GroupKind, Metadata, SaveSpec
from anchorkv.connector.storage_zarr import ZarrEntryStore
from anchorkv.connector.worker import WorkerSide
from anchorkv.testing.regions import hma_regions
from benchmarks.machine import machine_name

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CODEC_SETS = {
    "raw": {"conv": "raw", "recurrent": "raw", "latent": "raw"},
    "quant": {"conv": "int8:128", "recurrent": "int8:128", "latent": "fp8:64"},
}
TOKENS, QUICK_TOKENS = 7680, 1920
ROUNDS = 10 if DEVICE.type == "cuda" else 3
PROVIDERS = ["d2h-raw", "d2h-packed", "pack", "pack+d2h", "stream", "pack+d2h+cs", "stream+cs", "set+d2h",
             "chunks+d2h", "write-packed", "save"]
CHUNKS = 4  # `chunks+d2h`'s launches
#: saves a `stream` round issues back to back: at most the worker's `HostPool` keeps free, so
#: after the warm-up round every save reuses a page-locked buffer
STREAM = 4


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


class _Discard:
    """An `EntryStore` whose `save_part` keeps nothing: the worker's path without the store."""

    def __init__(self) -> None:
        self.saved: list[int] = []

    def save_part(self, spec, parts, *, tp_size: int, tp_rank: int) -> int:
        self.saved.append(sum(p.nbytes for p in parts.values()))
        return self.saved[-1]


def request_layout(quick: bool) -> ModelLayout:
    """Kimi-Linear at tp=1; quick: its first 3 KDA layers (one per KDA group) and first MLA layer."""
    layout = kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=1)
    if not quick:
        return layout
    keep = layout.of_kind(LayerKind.STATE)[:3] + layout.of_kind(LayerKind.PAGED)[:1]
    return custom_layout("KimiLinear-quick", [(layer.name, layer.kind, layer.page) for layer in keep],
                         block_size=layout.block_size)


class Request:
    """One request's blocks in hma regions on DEVICE, a store and two workers (store, discard)."""

    def __init__(self, layout: ModelLayout, tokens: int, codecs: str, root: Path) -> None:
        self.layout, self.root = layout, root
        bs = self.layout.block_size
        assert tokens % bs == 0, "whole MLA blocks: every provider moves the same bytes"
        self.tokens, paged_blocks = tokens, tokens // bs
        state = [layer.name for layer in self.layout.of_kind(LayerKind.STATE)]
        paged = [layer.name for layer in self.layout.of_kind(LayerKind.PAGED)]
        self.groups = [GroupInfo(g, GroupKind.STATE, bs, tuple(state[g::3])) for g in range(3)]
        self.groups.append(GroupInfo(3, GroupKind.PAGED, bs, tuple(paged)))
        # block 0 stays unused (vLLM's null block); KDA groups 1..3; the MLA group after them
        self.blocks = ((1,), (2,), (3,), tuple(range(4, 4 + paged_blocks)))
        self.views = hma_regions(self.layout, 4 + paged_blocks, device=str(DEVICE))
        g = torch.Generator().manual_seed(0)
        self.source_bytes = 0
        for grp in self.groups:
            ids = list(self.blocks[grp.index])
            for name in grp.layers:
                for f in self.views[name].page.fields:
                    t = self.views[name].tensor(f.name)
                    x = torch.randn((len(ids), *f.shape), generator=g) * 0.1
                    t[ids] = x.to(f.dtype).to(DEVICE)
                    self.source_bytes += x.numel() * t.element_size()
        config = ConnectorConfig.from_extra_config({"store": str(root / "store"), "codec": CODEC_SETS[codecs]})
        self.entries = ZarrEntryStore(config, self.layout)
        self.worker = WorkerSide(self.entries.config, self.groups, "none", self.entries, 1, 0)
        self.worker.register(self.layout, self.views)
        self.discard = _Discard()
        self.discard_worker = WorkerSide(self.entries.config, self.groups, "none", self.discard, 1, 0)
        self.discard_worker.register(self.layout, self.views)
        self.packed_bytes = sum(p.nbytes for p in self.pack())
        self.saves = 0
        pinned = DEVICE.type == "cuda"
        self._set_host: torch.Tensor | None = None
        self._host_parts: list[list[memoryview]] | None = None  # (`write_packed`)
        self.copy_stream = torch.cuda.Stream() if pinned else None
        self.copies = {}
        for name, n in (("d2h-raw", self.source_bytes), ("d2h-packed", self.packed_bytes)):
            self.copies[name] = (torch.empty(n, dtype=torch.uint8, device=DEVICE),
                                 torch.empty(n, dtype=torch.uint8, pin_memory=pinned))

    def pack(self) -> list[Packed]:
        """Every (layer, field) of the request packed with the worker's (resolved) codecs."""
        cfg = self.entries.config
        return pack_many([(self.views[name], f.name, list(self.blocks[grp.index]), cfg.codec_for(f.name))
                          for grp in self.groups for name in grp.layers
                          for f in self.views[name].page.fields])

    def set_then_copy(self, chunks: int) -> None:
        """The worker's `PackSet` packing the request and its bytes copied to a reused pinned
        buffer: one copy after the pack (`chunks` 0), or each of `pack_chunks(chunks)`'s ranges
        copied on `copy_stream` after its chunk's launch; synchronized."""
        pack_set = self.discard_worker._packer()[0]._set
        assert pack_set is not None and self.copy_stream is not None  # (CUDA only)
        if chunks == 0:
            packed = pack_set.pack(self.blocks)
            packed.copy_into(self.set_host(packed.host_bytes))
        else:
            def copy(whole: torch.Tensor, ranges: tuple[tuple[int, int], ...]) -> None:
                host = self.set_host(whole.numel())
                done = torch.cuda.Event()
                done.record()
                self.copy_stream.wait_event(done)
                with torch.cuda.stream(self.copy_stream):
                    for start, n in ranges:
                        host[start:start + n].copy_(whole[start:start + n], non_blocking=True)
                whole.record_stream(self.copy_stream)

            pack_set.pack_chunks(self.blocks, chunks, copy)
            self.copy_stream.synchronize()
        _sync()

    def set_host(self, nbytes: int) -> torch.Tensor:
        """A reused pinned buffer of at least `nbytes` (`set_then_copy`)."""
        if self._set_host is None or self._set_host.numel() < nbytes:
            self._set_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self._set_host[:nbytes]

    def spec(self) -> SaveSpec:
        """A save of new tokens (a new entry each time)."""
        self.saves += 1
        tokens = tuple((np.arange(self.tokens) + 1_000_003 * self.saves).tolist())
        return SaveSpec(f"bench-{self.saves}", None, tokens, self.tokens, self.blocks)

    def write_packed(self) -> None:
        """The packed bytes (host copies made once) written as plain files, one per (layer,
        field): payload then scales, into the directory `before_write` left empty."""
        if self._host_parts is None:
            self._host_parts = [[memoryview(t.contiguous().cpu().numpy()).cast("B") for t in (p.payload, p.scales)
                                 if t.numel()] for p in self.pack()]
        for k, bufs in enumerate(self._host_parts):
            with open(self.root / "write-packed" / f"part{k}.bin", "wb") as f:
                os.writev(f.fileno(), bufs)

    def before_write(self) -> None:
        """Untimed, before each `write_packed`: an empty directory beside the store's, and
        earlier rounds' dirty pages flushed."""
        out = self.root / "write-packed"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        os.sync()

    def copy(self, name: str) -> None:
        dev, host = self.copies[name]
        host.copy_(dev, non_blocking=True)
        _sync()

    def close(self) -> None:
        self.worker.shutdown()
        self.discard_worker.shutdown()
        self.entries.close()
        shutil.rmtree(self.root, ignore_errors=True)  # the stores, the plain files


_requests: dict[str, Request] = {}
_medians: dict[tuple[str, str], float] = {}


@pytest.fixture(scope="module")
def make_request(quick, tmp_path_factory):
    def make(codecs: str) -> Request:
        if codecs not in _requests:
            root = tmp_path_factory.mktemp(f"save-{codecs}")
            _requests[codecs] = Request(request_layout(quick), QUICK_TOKENS if quick else TOKENS, codecs, root)
        return _requests[codecs]

    yield make
    for req in _requests.values():
        req.close()
    _requests.clear()


def median_time(fn, rounds: int, setup=None) -> float:
    """The median seconds of `fn()` over max(rounds, 3) calls after one warm-up call, `setup()`
    untimed before each."""
    times = []
    for _ in range(max(rounds, 3) + 1):
        if setup is not None:
            setup()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def _copy_median(req: Request, name: str, codecs: str, rounds: int) -> float:
    """The median of a d2h baseline: its own row of this run, or measured here if deselected."""
    key = (codecs, name)
    if key not in _medians:
        _medians[key] = median_time(lambda: req.copy(name), rounds)
    return _medians[key]


def _write_median(req: Request, codecs: str, rounds: int) -> float:
    """The `write-packed` median: its row of this run, or measured here if deselected."""
    key = (codecs, "write-packed")
    if key not in _medians:
        _medians[key] = median_time(req.write_packed, rounds, setup=req.before_write)
    return _medians[key]


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("codecs", list(CODEC_SETS))
def test_save_path(benchmark, codecs, provider, quick, make_request, monkeypatch):
    req = make_request(codecs)
    rounds = 1 if quick else ROUNDS
    per_round = STREAM if provider.startswith("stream") else 1  # saves a round issues
    launch: list[float] = []
    if provider in ("set+d2h", "chunks+d2h") and DEVICE.type != "cuda":
        pytest.skip("the set pack and its copy to pinned memory, one after the other or overlapped on two "
                    "streams: CUDA only (on a CPU the batch is on the host already)")
    if provider.endswith("+cs") and DEVICE.type != "cuda":
        pytest.skip("the copies on a stream of their own: CUDA only (a CPU save has no streams)")
    if provider in ("pack+d2h", "stream", "pack+d2h+cs", "stream+cs"):  # (`save` keeps the default)
        from anchorkv.connector import worker as worker_module

        monkeypatch.setattr(worker_module, "SAVE_COPY_STREAM", provider.endswith("+cs"))
    if provider.startswith("d2h"):
        fn, setup = (lambda: req.copy(provider)), None
    elif provider == "write-packed":
        fn, setup = req.write_packed, req.before_write
    elif provider in ("set+d2h", "chunks+d2h"):
        chunks = CHUNKS if provider == "chunks+d2h" else 0
        fn, setup = (lambda: req.set_then_copy(chunks)), None
    elif provider == "pack":
        fn, setup = (lambda: (req.pack(), _sync())), None
    else:
        worker = req.worker if provider == "save" else req.discard_worker
        specs: list[SaveSpec] = []

        def setup():
            if provider == "save":  # untimed: the last round's entry, checked, then deleted (below)
                _drop_entries(req, specs)
            os.sync()  # untimed: earlier rounds' dirty pages must not throttle this one
            specs.extend(req.spec() for _ in range(per_round))

        def fn():
            t = time.perf_counter()
            for spec in specs[-per_round:]:
                worker.save(Metadata(saves=[spec]))
            launch.append((time.perf_counter() - t) / per_round)
            worker.flush()

    benchmark.group = f"kimi-linear save path tp=1 {req.tokens} tokens {codecs}"
    benchmark.pedantic(fn, setup=setup, rounds=rounds, iterations=1, warmup_rounds=1)
    median = benchmark.stats.stats.median / per_round  # (per save)
    if provider.startswith("d2h") or provider == "write-packed":
        _medians[(codecs, provider)] = median
    if provider == "save":  # every round committed its entry (the worker logs failures, never raises)
        _drop_entries(req, specs)
    if provider.removesuffix("+cs") in ("pack+d2h", "stream"):  # (the worker whose store keeps nothing)
        assert req.discard.saved[-len(specs):] == [req.packed_bytes] * len(specs), req.discard.saved
    moved = req.source_bytes if provider == "d2h-raw" else req.packed_bytes
    info = {  # the ratios first: `anchorkv bench`'s generic table shows the first ~200 characters
        "provider": provider, "codecs": codecs,
        "ratio_vs_d2h_packed": _copy_median(req, "d2h-packed", codecs, rounds) / median,
        "ratio_vs_d2h_raw": _copy_median(req, "d2h-raw", codecs, rounds) / median,
        "gbps": moved / median / 1e9, "state_gbps": req.source_bytes / median / 1e9,
    }
    if provider == "save":  # the DESIGN's: the slower of the PCIe copy and the disk write
        info["ratio_vs_slower"] = max(_copy_median(req, "d2h-packed", codecs, rounds),
                                      _write_median(req, codecs, rounds)) / median
    if launch:
        info["launch_s"] = statistics.median(launch[1:] or launch)
    info.update({
        "tokens": req.tokens, "tp": 1, "bytes": moved, "source_bytes": req.source_bytes,
        "packed_bytes": req.packed_bytes, "median_s": median, "codec_set": CODEC_SETS[codecs],
        "device": machine_name(),
    })
    benchmark.extra_info.update(info)


def _drop_entries(req: Request, specs: list[SaveSpec]) -> None:
    """After a `save` round: its entry was committed and holds the request's bytes; then it is
    deleted, so the next round writes into a page cache as free as `write-packed`'s (here,
    writes slowed ~10x once ~1 GB of a run's earlier entries stayed cached)."""
    if not specs:
        return
    entries = req.entries.store.list()
    assert len(entries) == 1, f"a save round committed {len(entries)} entries, expected 1"
    _check_stored(req, specs[-1])
    req.entries.store.delete(entries[0])


def _check_stored(req: Request, spec: SaveSpec) -> None:
    """The last entry holds exactly the packed bytes of the request (one state and one paged
    field, read back through the connector's store): a save that wrote wrong bytes fails here."""
    ref = req.entries.lookup(anchor=None, token_ids=list(spec.token_ids), max_tokens=req.tokens,
                             multiple_of=1, mode="exact")
    assert ref is not None and ref.num_tokens == req.tokens, ref
    expect = dict(zip([(name, f.name) for grp in req.groups for name in grp.layers
                       for f in req.views[name].page.fields], req.pack(), strict=True))  # pack's order
    state, paged = req.groups[0].layers[0], req.groups[3].layers[0]
    for layer, fname, rows in ((state, "recurrent", None), (paged, "latent", (0, req.tokens))):
        got = req.entries.load(ref.entry_id, layer, fname, tp_size=1, tp_rank=0, rows=rows)
        want = expect[(layer, fname)].to("cpu")
        if rows is not None:
            want = want.reshape(req.tokens, *want.shape[2:])
        assert torch.equal(got.payload, want.payload) and torch.equal(got.scales, want.scales), \
            f"{layer}.{fname}: the stored bytes differ from pack_many's"
