"""The load path of one Kimi-Linear request: store -> host arena -> GPU -> unpack into the cache.

The request of `bench_save_path.py` (tp=1, 105.3 MB raw at 7680 tokens; `--quick`: 4 layers,
1920 tokens) is saved once through the worker into a local store, then restored the way the
connector restores it, into the same blocks (zeroed before the checked round).

Providers, per codec set (`raw`, `quant` as in `bench_save_path.py`):
    h2d-packed    one copy of the packed bytes from page-locked host memory into one device
                  buffer (the baseline: what the PCIe link gives)
    unpack        `anchorkv.codec.unpack_many` of the parts already on the device (the kernels)
    stage+unpack  the same from the parts in a page-locked `codec.HostArena`, as the worker reads
                  them: one copy of the arena's span, then the kernels (the GPU side of a restore)
    restore       a synchronous `WorkerSide.start_load` from the local store (page cache): the
                  worker's reads (each part into its span of the restore's batch), checks, the
                  one copy and one `codec.Unpacker` call (the whole path)

`extra_info`: `bytes` (packed bytes), `gbps` = bytes / median, `state_gbps` = raw state bytes /
median, and `ratio_vs_h2d_packed` = h2d-packed median / this median, measured in the same
process. After the timed rounds of `restore`, the request's blocks are zeroed and restored once
more, and every byte of them is compared with the saved state (exact for raw; for quant, with
what `unpack` of the same packed parts writes).

On a machine without CUDA the same code runs the torch reference and the "h2d" copy is a
host-to-host copy; `--quick` runs one round of each at the quick size.

    .venv/bin/python -m pytest benchmarks/bench_load_path.py --benchmark-only
"""

from __future__ import annotations

import pytest
import torch

from anchorkv.codec import HostArena, Packed, unpack_many
from anchorkv.connector.plan import LoadSpec, Metadata
from benchmarks.bench_save_path import (
    CODEC_SETS,
    DEVICE,
    QUICK_TOKENS,
    ROUNDS,
    TOKENS,
    Request,
    _sync,
    median_time,
    request_layout,
)
from benchmarks.machine import machine_name

PROVIDERS = ["h2d-packed", "unpack", "stage+unpack", "restore"]


class Restore:
    """A saved request and what each provider restores from."""

    def __init__(self, req: Request) -> None:
        self.req = req
        self.fields = [(name, f.name, list(req.blocks[grp.index])) for grp in req.groups for name in grp.layers
                       for f in req.views[name].page.fields]
        self.source = {(name, f): req.views[name].tensor(f)[ids].clone() for name, f, ids in self.fields}
        spec = req.spec()
        req.worker.save(Metadata(saves=[spec]))
        req.worker.flush()
        [entry] = req.entries.store.list()
        self.load = LoadSpec("bench-restore", entry.id, 0, spec.num_tokens, spec.blocks, sync=True)
        self.device_parts = req.pack()  # pack_many's order: self.fields
        self.arena = HostArena(pin=DEVICE.type == "cuda", hint=HostArena.size_for(  # one slab, as the worker's
            t.nbytes for p in self.device_parts for t in (p.payload, p.scales)))  # from its 2nd restore on
        self.host_parts = [self._in_arena(p) for p in self.device_parts]
        assert len(self.arena.slabs) == 1
        self.packed_bytes = sum(p.nbytes for p in self.device_parts)
        pinned = DEVICE.type == "cuda"
        self.h2d = (torch.empty(self.packed_bytes, dtype=torch.uint8, pin_memory=pinned),
                    torch.empty(self.packed_bytes, dtype=torch.uint8, device=DEVICE))

    def _in_arena(self, p: Packed) -> Packed:
        payload = self.arena(p.payload.nbytes)
        payload.copy_(p.payload)
        scales = self.arena(p.scales.nbytes).view(torch.float32).view(p.scales.shape)
        scales.copy_(p.scales)
        return Packed(p.codec, p.shape, p.dtype, payload, scales)

    def work(self, parts: list[Packed]) -> list:
        return [(p, self.req.views[name], f, ids) for p, (name, f, ids) in zip(parts, self.fields, strict=True)]

    def copy(self) -> None:
        host, dev = self.h2d
        dev.copy_(host, non_blocking=True)
        _sync()

    def restore(self) -> None:
        """A synchronous load: `start_load` returns once it is written, and raises if it failed."""
        self.req.worker.start_load(Metadata(loads=[self.load]))

    def zero(self) -> None:
        for name, f, ids in self.fields:
            self.req.views[name].tensor(f)[ids] = 0
        _sync()

    def check(self, codecs: str) -> None:
        """Every byte of the request's blocks is what the save held (raw), or what `unpack` of
        the same packed parts writes (quant)."""
        want = self.source
        if codecs != "raw":
            self.zero()
            unpack_many(self.work(self.device_parts))
            _sync()
            want = {(name, f): self.req.views[name].tensor(f)[ids].clone() for name, f, ids in self.fields}
        self.zero()
        self.restore()
        _sync()
        for name, f, ids in self.fields:
            got = self.req.views[name].tensor(f)[ids]
            assert torch.equal(got.view(torch.uint8), want[(name, f)].view(torch.uint8)), f"{name}.{f}"


_restores: dict[str, Restore] = {}
_requests: list[Request] = []
_medians: dict[str, float] = {}


@pytest.fixture(scope="module")
def make_restore(quick, tmp_path_factory):
    def make(codecs: str) -> Restore:
        if codecs not in _restores:
            root = tmp_path_factory.mktemp(f"load-{codecs}")
            req = Request(request_layout(quick), QUICK_TOKENS if quick else TOKENS, codecs, root)
            _requests.append(req)
            _restores[codecs] = Restore(req)
        return _restores[codecs]

    yield make
    for req in _requests:
        req.close()
    _requests.clear()
    _restores.clear()


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("codecs", list(CODEC_SETS))
def test_load_path(benchmark, codecs, provider, quick, make_restore):
    r = make_restore(codecs)
    rounds = 1 if quick else ROUNDS
    if provider == "h2d-packed":
        fn = r.copy
    elif provider == "unpack":
        work = r.work(r.device_parts)
        fn = lambda: (unpack_many(work), _sync())  # noqa: E731
    elif provider == "stage+unpack":
        work = r.work(r.host_parts)
        fn = lambda: (unpack_many(work), _sync())  # noqa: E731
    else:
        fn = lambda: (r.restore(), _sync())  # noqa: E731
    benchmark.group = f"kimi-linear load path tp=1 {r.req.tokens} tokens {codecs}"
    benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=1)
    median = benchmark.stats.stats.median
    if provider == "h2d-packed":
        _medians[codecs] = median
    if provider == "restore":
        r.check(codecs)
    if codecs not in _medians:  # h2d-packed deselected: measure it here
        _medians[codecs] = median_time(r.copy, rounds)
    h2d = _medians[codecs]
    info = {  # the ratio first: `anchorkv bench`'s generic table shows the first ~200 characters
        "provider": provider, "codecs": codecs,
        "ratio_vs_h2d_packed": h2d / median,
        "gbps": r.packed_bytes / median / 1e9, "state_gbps": r.req.source_bytes / median / 1e9,
        "tokens": r.req.tokens, "tp": 1, "bytes": r.packed_bytes, "source_bytes": r.req.source_bytes,
        "packed_bytes": r.packed_bytes, "median_s": median, "codec_set": CODEC_SETS[codecs],
        "device": machine_name(),
    }
    benchmark.extra_info.update(info)
