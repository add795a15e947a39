"""Pack / unpack of one Kimi-Linear request at real sizes: our kernels against baselines.

One request = 20 KDA layers x (conv `[3, 3, 4096/tp]` bf16 + recurrent `[32/tp, 128, 128]` fp32,
one state block each) + 7 MLA layers x 4 blocks x `[block_size, 576]` bf16, laid out by
`anchorkv.codec.kimi_linear_layout` (each MLA layer aliases the region of a KDA layer, as in
vLLM's hybrid allocator). Codecs: conv int8, recurrent int8, latent fp8, group 128 (64 for the
latent).

Providers:
    ours     `anchorkv.kernels.pack_many` / `unpack_many` (Triton on CUDA; on a CPU the auto
             backend is the torch reference, so this row measures the reference)
    set      `anchorkv.kernels.PackSet.pack` of the same items as fixed targets (what the
             connector saves with: no per-item keys, plan lookup by the slots' lengths, one
             payload and one scales allocation, no per-item views); for unpack,
             `UnpackSet.unpack` of that batch into the same targets (no per-part checks: the
             batch is checked as two tensors against the plan's layout)
    stream   `set`, ten calls issued back to back and one synchronization, the time per call
             (how a connector issues them, a save per step: whichever of the host's launch
             path and the GPU's kernels is slower bounds it; CUDA only)
    copy     one device-to-device copy of the same source bytes (the ceiling)
    eager    the torch reference, item by item, on the same device
    compile  `torch.compile` of the reference (CUDA only)

Each result records GB/s (bytes read + bytes written) and the ratio to `copy` measured in the
same process, and all results go to `benchmarks/results/<device>-kernels.json`.

    .venv/bin/python -m pytest benchmarks/bench_kernels.py --benchmark-only

`--quick` (or `anchorkv bench --quick`): one timed round each, and the JSON is not rewritten.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from anchorkv import kernels
from anchorkv.codec import KIMI_LINEAR_48B_CONFIG, CodecSpec, kimi_linear_layout
from anchorkv.kernels import PackItem, UnpackItem, reference
from anchorkv.kernels.dispatch import backend_for
from anchorkv.kernels.strided import field_view
from benchmarks.machine import device_info, machine_name, results_path

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
RESULTS = Path(__file__).resolve().parent / "results"
CODECS = {"conv": CodecSpec("int8", 128), "recurrent": CodecSpec("int8", 128), "latent": CodecSpec("fp8", 64)}
MLA_BLOCKS = 4
ROUNDS = 10 if DEVICE.type == "cuda" else 3
STREAM = 10  # calls per round of the `stream` providers
_rows: list[dict] = []


def device_name() -> str:
    """What the results name as the device: the GPU, or the processor and its cores."""
    info = device_info()
    return info.get("gpu") if DEVICE.type == "cuda" else f"cpu {info['processor']} {info['cores']} cores"


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


class Request:
    """The regions and the pack/unpack items of one Kimi-Linear request at `tp`."""

    def __init__(self, tp: int) -> None:
        layout = kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=tp)
        kda = layout.of_kind("state")
        mla = layout.of_kind("paged")
        page = kda[0].page.page_bytes
        blocks = 1 + MLA_BLOCKS + 1
        g = torch.Generator().manual_seed(tp)
        self.regions = []
        self.items: list[PackItem] = []
        # one ids object per KV-cache group, shared by its layers' items (as the connector
        # passes them; the launchers check a shared object once)
        state_ids = (0,)
        mla_ids = tuple(range(1 + MLA_BLOCKS, 0, -1))[:MLA_BLOCKS]
        for layer in kda:
            buf = torch.empty(blocks * page, dtype=torch.uint8, device=DEVICE)
            for f in layer.page.fields:
                view = field_view(buf, f.strided(page), blocks)
                view.copy_(torch.randn(view.shape, generator=g).to(f.dtype))
            self.regions.append(buf)
            for f in layer.page.fields:
                self.items.append(PackItem(buf, f.strided(page), state_ids, blocks, CODECS[f.name]))
        for i, layer in enumerate(mla):
            buf = self.regions[i]  # the MLA layer shares the bytes of a KDA layer's region
            f = layer.page.fields[0]
            view = field_view(buf, f.strided(page), blocks)[1 : 1 + MLA_BLOCKS]
            view.copy_(torch.randn(view.shape, generator=g).to(f.dtype))
            self.items.append(PackItem(buf, f.strided(page), mla_ids, blocks, CODECS[f.name]))
        self.source_bytes = sum(
            len(it.block_ids) * it.field.numel * it.field.itemsize for it in self.items
        )
        self.pack_set = kernels.PackSet(
            [kernels.PackTarget(it.buffer, it.field, it.num_blocks, it.spec) for it in self.items],
            [0 if it.block_ids is state_ids else 1 for it in self.items])
        self.slot_ids = (state_ids, mla_ids)
        self.unpack_set = kernels.UnpackSet(self.pack_set.targets, self.pack_set.slots)
        self.packed_batch = self.pack_set.pack(self.slot_ids)
        packed = kernels.pack_many(self.items)
        self.packed_bytes = sum(p.numel() + s.numel() * 4 for p, s in packed)
        self.unpack_items = [
            UnpackItem(it.buffer, it.field, it.block_ids, it.num_blocks, it.spec, p, s)
            for it, (p, s) in zip(self.items, packed, strict=True)
        ]
        self.copy_src = torch.empty(self.source_bytes, dtype=torch.uint8, device=DEVICE)
        self.copy_dst = torch.empty_like(self.copy_src)

    def copy_time(self, rounds: int = ROUNDS) -> float:
        """Median seconds of one copy of `source_bytes` (measured here, for the ratios)."""
        times = []
        for _ in range(rounds + 1):
            _sync()
            t = time.perf_counter()
            self.copy_dst.copy_(self.copy_src)
            _sync()
            times.append(time.perf_counter() - t)
        return sorted(times[1:])[len(times[1:]) // 2]


_requests: dict[int, Request] = {}


def request(tp: int) -> Request:
    if tp not in _requests:
        _requests[tp] = Request(tp)
    return _requests[tp]


def _eager_pack(req: Request):
    return [reference.pack(i) for i in req.items]


def _eager_unpack(req: Request):
    for i in req.unpack_items:
        reference.unpack(i)


_compiled: dict[str, object] = {}


def _compiled_fn(name):
    if name not in _compiled:
        _compiled[name] = torch.compile(getattr(reference, name), dynamic=False)
    return _compiled[name]


def _compile_pack(req: Request):
    fn = _compiled_fn("pack")
    return [fn(i) for i in req.items]


def _compile_unpack(req: Request):
    fn = _compiled_fn("unpack")
    for i in req.unpack_items:
        fn(i)


PROVIDERS = {
    ("pack", "ours"): lambda req: kernels.pack_many(req.items),
    ("pack", "set"): lambda req: req.pack_set.pack(req.slot_ids),
    ("unpack", "ours"): lambda req: kernels.unpack_many(req.unpack_items),
    ("unpack", "set"): lambda req: req.unpack_set.unpack(req.packed_batch, req.slot_ids),
    ("pack", "eager"): _eager_pack,
    ("unpack", "eager"): _eager_unpack,
    ("pack", "compile"): _compile_pack,
    ("unpack", "compile"): _compile_unpack,
    ("pack", "stream"): lambda req: [req.pack_set.pack(req.slot_ids) for _ in range(STREAM)],
    ("unpack", "stream"): lambda req: [req.unpack_set.unpack(req.packed_batch, req.slot_ids) for _ in range(STREAM)],
    ("pack", "copy"): lambda req: req.copy_dst.copy_(req.copy_src),
    ("unpack", "copy"): lambda req: req.copy_dst.copy_(req.copy_src),
}


@pytest.fixture(scope="module", autouse=True)
def _write_results(quick, request):
    yield
    if not _rows or quick:  # quick numbers (1 round) must not replace the recorded ones
        return
    RESULTS.mkdir(exist_ok=True)
    path = results_path(request, RESULTS, f"{machine_name()}-kernels")
    path.write_text(json.dumps({
        "device": device_name(),
        "torch": torch.__version__,
        "command": "python -m pytest benchmarks/bench_kernels.py --benchmark-only",
        "results": _rows,
    }, indent=1) + "\n")


def _table_fallbacks(the_set) -> int:
    """Calls of `the_set`'s newest plan (the request's) that staged their item table through
    torch's allocators because its `TableRing` slot was still in use (`batch.TableRing`): the
    slower host path, which calls issued back to back can meet; 0 without a ring."""
    plan = the_set._plans.newest()
    ring = getattr(getattr(plan, "tables", None), "ring", None)
    return 0 if ring is None else ring.fallbacks


# torch.compile (torch 2.11) goes through torch.jit.script_method, which warns it is deprecated
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("tp", [1, 4])
@pytest.mark.parametrize("op,provider", sorted(PROVIDERS))
def test_kimi_request(benchmark, op, provider, tp, quick):
    if provider == "compile" and DEVICE.type != "cuda":
        pytest.skip("torch.compile baseline is measured on CUDA only (on a CPU it would time "
                    "the C++ inductor backend, not the GPU comparison it stands for)")
    if provider == "stream" and DEVICE.type != "cuda":
        pytest.skip("calls issued back to back overlap the host with the GPU: CUDA only (on a CPU "
                    "each call is the reference, and ten of them only multiply the `set` row)")
    req = request(tp)
    fn = PROVIDERS[(op, provider)]
    if provider == "compile":
        fn(req)  # compile outside the timing

    def run():
        fn(req)
        _sync()

    benchmark.group = f"kimi-linear tp={tp} {op}"
    rounds = 1 if quick else ROUNDS
    the_set = req.pack_set if op == "pack" else req.unpack_set
    fell_back = _table_fallbacks(the_set)
    benchmark.pedantic(run, rounds=rounds, iterations=1, warmup_rounds=1)
    fell_back = _table_fallbacks(the_set) - fell_back
    seconds = benchmark.stats.stats.median / (STREAM if provider == "stream" else 1)
    if provider == "copy":
        moved = 2 * req.source_bytes
    else:
        moved = req.source_bytes + req.packed_bytes
    copy_seconds = req.copy_time(max(rounds, 3))
    info = {
        "op": op,
        "provider": provider,
        "tp": tp,
        "device": device_name(),
        "backend": backend_for(DEVICE) if provider in ("ours", "set", "stream") else provider,
        "source_bytes": req.source_bytes,
        "packed_bytes": req.packed_bytes,
        "median_s": seconds,
        "gbps": moved / seconds / 1e9,
        "copy_gbps": 2 * req.source_bytes / copy_seconds / 1e9,
        "items": len(req.items),
    }
    info["ratio_vs_copy"] = info["gbps"] / info["copy_gbps"]
    if provider in ("set", "stream"):  # calls whose item table found its ring slot still busy
        info["table_fallbacks"] = fell_back
    benchmark.extra_info.update(info)
    _rows.append(info)
