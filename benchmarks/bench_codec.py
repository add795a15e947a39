"""Codec pack/unpack throughput at Kimi-Linear-48B-A3B sizes, and scaling with context length.

Run: `pytest benchmarks/bench_codec.py [--quick] --benchmark-json=out.json` (or `anchorkv bench`).

* `test_field`: one layer's field of one request (conv: one state block; recurrent: one state
  block; latent: the 7680-token request's blocks) with each codec, at tp=1 and tp=4, through
  `anchorkv.codec.pack` / `unpack` (Triton on a GPU, the torch reference on CPU).
* `test_scaling`: a whole request (20 KDA layers' conv + recurrent, 7 MLA layers' latent) with
  the default codecs, from 1920 to 122,880 tokens of latent; the KDA part is constant.

Each records in `extra_info`: bytes read and written, GB/s = (read + written) / median time,
and `copy_gbs` / `ratio_to_copy`: a plain contiguous copy of the same raw bytes (read + write)
timed in the same run, on the same device.
"""

from __future__ import annotations

import functools
import statistics
import time

import pytest
import torch

from anchorkv.codec import KIMI_LINEAR_48B_CONFIG, LayerKind, kimi_linear_layout, pack, unpack
from anchorkv.connector.config import DEFAULT_CODECS, KIMI_FIELD_ROLES, field_codecs
from anchorkv.testing.regions import fill_realistic, hma_regions

REQUEST_TOKENS = 7680
SCALING_TOKENS = (1920, 3840, 7680, 15360, 30720, 61440, 122880)
QUICK_SCALING_TOKENS = (1920, 3840, 7680)
#: The codecs a field is benchmarked with (the group sizes the fidelity study considers).
FIELD_CODECS = {
    "conv": ("raw", "fp8:128", "int8:128", "int4:128"),
    "recurrent": ("raw", "fp8:128", "int8:128", "int4:128"),
    "latent": ("raw", "fp8:64", "fp8:whole", "int8:64", "int4:64"),
}
#: Codecs of the scaling run: the shipped defaults (which the fidelity study's rule chose).
SCALING_CODECS = field_codecs(DEFAULT_CODECS, KIMI_FIELD_ROLES)


def _median_seconds(fn, sync, rounds: int) -> float:
    fn()
    sync()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_gbs(nbytes: int, device, sync, rounds: int) -> float:
    """GB/s (read + written) of a plain copy of `nbytes` contiguous bytes on `device`."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_seconds(lambda: dst.copy_(src), sync, rounds) / 1e9


class Request:
    """The cache views of one request on one rank: which blocks each layer's state lives in."""

    def __init__(self, tp: int, tokens: int, device) -> None:
        self.layout = kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=tp)
        bs = self.layout.block_size
        self.paged_blocks = list(range(1, -(-tokens // bs) + 1))
        self.views = hma_regions(self.layout, num_blocks=len(self.paged_blocks) + 2, device=str(device))
        g = torch.Generator().manual_seed(0)
        self.ids = {}
        for layer in self.layout.layers:
            self.ids[layer.name] = [1] if layer.kind is LayerKind.STATE else self.paged_blocks
        for layer in self.layout.layers:  # one fill per region is enough for timing
            view = self.views[layer.name]
            if layer.kind is LayerKind.PAGED or layer is self.layout.of_kind(LayerKind.STATE)[0]:
                fill_realistic_on(view, self.ids[layer.name], g)

    def items(self, field: str):
        for layer in self.layout.layers:
            if field in layer.page.names:
                yield self.views[layer.name], self.ids[layer.name]


@functools.lru_cache(maxsize=4)
def cached_request(tp: int, tokens: int, device) -> Request:
    """Requests are reused across benchmarks (building one fills every region: ~0.3 s on CPU)."""
    return Request(tp, tokens, device)


def fill_realistic_on(view, ids, g) -> None:
    """`anchorkv.testing.regions.fill_realistic` for a view on any device (it draws on the CPU)."""
    if view.region.device.type == "cpu":
        fill_realistic(view, ids, g)
        return
    for f in view.page.fields:
        x = torch.randn((len(ids), *f.shape), generator=g).to(f.dtype)
        view.tensor(f.name)[ids] = x.to(view.region.device)


def _record(benchmark, nbytes_raw: int, nbytes_packed: int, copy: float, **info) -> None:
    seconds = benchmark.stats.stats.median
    moved = nbytes_raw + nbytes_packed
    gbs = moved / seconds / 1e9
    benchmark.extra_info.update({
        **info, "bytes_raw": nbytes_raw, "bytes_packed": nbytes_packed,
        "bytes_moved": moved, "gbs": gbs, "copy_gbs": copy, "ratio_to_copy": gbs / copy,
        "size_ratio": nbytes_packed / nbytes_raw,
    })


_FIELD_CASES = [(f, c) for f, codecs in FIELD_CODECS.items() for c in codecs]


@pytest.mark.parametrize("op", ["pack", "unpack"])
@pytest.mark.parametrize("field,codec", _FIELD_CASES, ids=[f"{f}-{c}" for f, c in _FIELD_CASES])
@pytest.mark.parametrize("tp", [1, 4])
def test_field(benchmark, tp, field, codec, op, quick, device, sync, rounds):
    tokens = 1920 if quick else REQUEST_TOKENS
    req = cached_request(tp, tokens, device)
    view, ids = next(req.items(field))
    packed = pack(view, field, ids, codec)
    dst = [i + 1 for i in ids] if field != "latent" else ids  # state: into another block
    if op == "pack":
        fn = lambda: pack(view, field, ids, codec)  # noqa: E731
    else:
        fn = lambda: unpack(packed, view, field, dst)  # noqa: E731

    def run():
        fn()
        sync()

    benchmark.group = f"codec-{field}-tp{tp}"
    benchmark.pedantic(run, rounds=rounds * 2, iterations=1, warmup_rounds=1)
    copy = copy_gbs(packed.source_nbytes, device, sync, rounds * 2)
    _record(benchmark, packed.source_nbytes, packed.nbytes, copy, field=field, codec=codec,
            op=op, tp=tp, tokens=tokens if field == "latent" else None, device=str(device))


def _scaling_ids():
    return [f"{t}" for t in SCALING_TOKENS]


@pytest.mark.parametrize("op", ["pack", "unpack"])
@pytest.mark.parametrize("tokens", SCALING_TOKENS, ids=_scaling_ids())
def test_scaling(benchmark, tokens, op, quick, device, sync, rounds):
    if quick and tokens not in QUICK_SCALING_TOKENS:
        pytest.skip("quick mode: small sizes only")
    cached_request.cache_clear()  # the large requests are built once each, then freed
    req = Request(1, tokens, device)
    work = [(field, view, ids) for field in SCALING_CODECS for view, ids in req.items(field)]

    def do_pack():
        return [pack(view, field, ids, SCALING_CODECS[field]) for field, view, ids in work]

    packed = do_pack()

    def do_unpack():
        for p, (field, view, ids) in zip(packed, work, strict=True):
            unpack(p, view, field, ids)

    def run():
        (do_pack if op == "pack" else do_unpack)()
        sync()

    benchmark.group = "scaling-request-tp1"
    # Above 15k tokens a round takes seconds on a CPU: fewer rounds keep the full run short.
    n = rounds if tokens <= 15360 or device.type == "cuda" else max(1, rounds // 2)
    benchmark.pedantic(run, rounds=n, iterations=1, warmup_rounds=1)
    raw = sum(p.source_nbytes for p in packed)
    copy = copy_gbs(raw, device, sync, max(n, 3))
    latent = sum(p.source_nbytes for p, (f, _, _) in zip(packed, work, strict=True) if f == "latent")
    _record(benchmark, raw, sum(p.nbytes for p in packed), copy, op=op, tokens=tokens,
            latent_bytes=latent, kda_bytes=raw - latent, codecs=dict(SCALING_CODECS),
            device=str(device))
