"""Save / load of one Kimi-Linear request to the local store, against plain files and safetensors.

One request at tp=1, 7680 tokens, laid out by `anchorkv.codec.kimi_linear_layout` and packed
with `anchorkv.codec.pack`: 20 KDA layers x (conv `[3, 3, 4096]` bf16 + recurrent
`[32, 128, 128]` fp32) + 7 MLA layers x 7680 x 576 bf16 = 105.4 MB of raw state.

Providers (all in the same process, on the same filesystem, none calls fsync):
    store-raw     `Store.save` / `Store.load` with the raw codec: the same bytes as `plain`,
                  as 18 zarr shard files (format version 7: the state fields' shards span
                  layers, conv 20 and recurrent 2 a file; 376 inner chunks, each with its
                  crc32c, and a shard index), manifest, staged commit and rename
    store-quant   the same with conv int8:128, recurrent int8:128, latent fp8:64 (the packing
                  is done before timing: the kernels have their own benchmark); each
                  quantized field is two arrays (codes, scales): 24 shard files (conv 20
                  layers a file, recurrent 5; the 47 per-layer shards of format 6 made 94)
    store-<codecs>:crc-thread, :crc-inline, :help, :help+crc-thread, :put-2, :put-4 (saves only)
                  the same save with the saving thread writing each shard, its crc32c
                  computed on a chunk thread while the shard is written or by the writing
                  thread before it (`anchorkv.store.store.LOCAL_PUT_THREADS` 1,
                  `CHUNK_THREADS` 2 or 1, `HELP_WRITES` off), the same with the help thread
                  writing shards of `writer.HELP_BYTES` or more while the saving thread goes on
                  (`:help`: checksums on the saving thread; `:help+crc-thread`: on a chunk
                  thread), or with 2 or 4 put threads writing shards at once, each computing
                  its shard's checksums first (`LOCAL_PUT_THREADS` 2 or 4; the plain `store-*`
                  rows use the defaults: `CHUNK_THREADS` and `HELP_WRITES` chosen by the
                  machine's cores and crc32c library, `LOCAL_PUT_THREADS` by its cores (4 from
                  8 on, else 1), all recorded in
                  the results): which one a machine should use
    plain         the same raw bytes as one file per (layer, field): open, write, close /
                  open, read (the baseline of the 0.8x target)
    files-raw, files-quant (saves only)
                  the files a `store-raw` / `store-quant` save writes (one such save made
                  beforehand, untimed), written as plain files: the same paths, directories
                  (made in the round) and bytes, each file open, write, close. Against its
                  `store-*` row: what the store's own work costs (checksums, staging, commit,
                  JSON, Python) apart from its files; against `plain`: what its number of
                  files costs (a quantized entry: 34 files with its zarr.json and manifest,
                  where `plain` writes 47; 104 in format 6)
    safetensors   one safetensors file per layer (`save_file` / `load_file`), as vLLM's
                  ExampleConnector stores KV caches

The load rows above read into fresh memory each round (a new tensor / bytearray per file: page
faults are a large, noisy part of them) on one thread. The warm load rows (`test_kimi_warm_load`,
their own group) read as the connector's worker restores: into memory reused round after round,
on `worker.READ_THREADS` threads (the parts of the request submitted to a pool of that many, as
`WorkerSide._read` does; 2 on 2 cores), `WARM_ROUNDS` rounds:
    plain:warm    `readinto` of each plain file into its span of a reused `HostArena` (pageable)
    store-<codecs>:warm       `Store.load(..., host=arena)` of every part into a reused
                  `HostArena`, a fresh `Store` each round (the entry's manifest read and its read
                  plans made inside the timing: a worker's first restore of that entry, after
                  restores of others of the same model and length: the plans' geometry, module
                  wide, is warm)
    store-<codecs>:warm-kept  the same on one `Store` kept across rounds (manifest and read plans
                  cached: the entry restored again by the same worker)
    store-<codecs>:warm-first on one `Store` kept across rounds, another entry each round (the
                  request's state saved under other token ids before the rounds): a serving
                  worker's first restore of an entry (its manifest read and its plans made in
                  the timing; the `Store` open, as the connector's is, unlike `:warm`'s)

`extra_info`: `state_GBps` (raw state bytes / time, the same numerator for every provider, so
compression makes it exceed what the disk moves), `io_GBps` (stored bytes / time), stored
bytes (on disk), and `ratio_vs_plain` = plain time / this time measured in the same
run (>= 0.8 is the target). Reads are served from the OS page cache (nothing is dropped),
and writes end in the page cache (no fsync): these are software-path numbers, not disk ones.
Before each save round (untimed) the target directory is emptied and `os.sync()` flushes the
dirty pages left by earlier rounds, so no round is throttled by the kernel's writeback of
another round's (or provider's) data.

A second table scales the MLA latent alone (7 layers) from 1920 to 122,880 tokens (quick mode:
the two smallest), store-raw against plain; a third holds short entries of the latent alone
(280 to 2100 tokens, one block each; quick mode: the smallest), where `size_vs_raw` shows the
zero-padded edge chunk (format 5 sizes the token chunks to the entry: 1.15x for 280 tokens,
3.66x with format 3's 1024-token chunks). Results: `benchmarks/results/<machine>-store.json`
(`benchmarks.machine`; the recorded run: `cpu-x86-64-2c-store.json`).

    .venv/bin/python -m pytest benchmarks/bench_store.py --benchmark-only --benchmark-json=/tmp/store.json
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from anchorkv.codec import KIMI_LINEAR_48B_CONFIG, CacheView, LayerKind, Region, kimi_linear_layout, pack
from anchorkv.codec.layout import Field, PageLayout, dense_strides
from anchorkv.codec.models import custom_layout
from anchorkv.store import store as store_module
from anchorkv.store.paths import entry_path
from anchorkv.store.store import Store
from benchmarks.machine import machine_name, results_path

RESULTS = Path(__file__).resolve().parent / "results"
TOKENS = 7680
BLOCK = 1920  # vLLM's MLA block size for Kimi-Linear at tp=1
CODEC_SETS = {
    "raw": {"conv": "raw", "recurrent": "raw", "latent": "raw"},
    "quant": {"conv": "int8:128", "recurrent": "int8:128", "latent": "fp8:64"},
}
SCALE_TOKENS = [1920, 7680, 30720, 122880]
SHORT_TOKENS = [280, 600, 1100, 2100]
COMMAND = "python -m pytest benchmarks/bench_store.py --benchmark-only --benchmark-json=/tmp/store.json"
_rows: list[dict] = []
_plain: dict[tuple, float] = {}


class Request:
    """The packed fields of one request (per codec set) and its raw bytes per (layer, field)."""

    def __init__(self, tokens: int, kinds: tuple[str, ...] = ("state", "paged"), block: int = BLOCK) -> None:
        self.tokens = tokens
        self.layout = kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=1, block_size=BLOCK)
        if kinds != ("state", "paged"):  # an entry holds every layer of its layout: keep only these
            self.layout = custom_layout("KimiLinear-" + "+".join(kinds), [
                (layer.name, layer.kind.value, layer.page if block == BLOCK else _latent_page(layer.page, block))
                for layer in self.layout.layers if layer.kind.value in kinds
            ], block_size=block, tp_size=1, tp_rank=0)
        page = self.layout.layers[0].page.page_bytes
        blocks = -(-tokens // block)
        g = torch.Generator().manual_seed(0)
        self.views: dict[str, tuple[CacheView, list[int]]] = {}
        for layer in self.layout.layers:
            if layer.kind.value not in kinds:
                continue
            n = 1 if layer.kind is LayerKind.STATE else blocks
            buf = torch.empty(n * page, dtype=torch.uint8)
            view = CacheView(Region(buf, n, page), layer.page, layer.name)
            for f in layer.page.fields:
                t = view.tensor(f.name)
                t.copy_((torch.randn(t.shape, generator=g) * 0.1).to(f.dtype))
            self.views[layer.name] = (view, list(range(n)))
        self.packed = {name: self._pack(codecs) for name, codecs in CODEC_SETS.items()}
        self.raw = {k: p.payload.numpy() for k, p in self.packed["raw"].items()}
        # bytes of state the request holds (a multiple of the block: no padding rows)
        assert tokens % block == 0, "sizes are whole MLA blocks, so every provider moves the same bytes"
        self.raw_bytes = sum(a.nbytes for a in self.raw.values())
        self.token_ids = np.arange(tokens, dtype=np.int64)

    def _paged(self, layer: str) -> bool:
        return self.layout.layer(layer).kind is LayerKind.PAGED

    def _pack(self, codecs):
        return {(name, f.name): pack(view, f.name, ids, codecs[f.name])
                for name, (view, ids) in self.views.items() for f in view.page.fields}

    def codecs(self, kind: str) -> dict[str, str]:
        fields = {f for (_, f) in self.raw}
        return {f: c for f, c in CODEC_SETS[kind].items() if f in fields}


def _latent_page(page: PageLayout, rows: int) -> PageLayout:
    """An MLA page of `rows` tokens (a latent-only layout is free of the KDA state's minimum block)."""
    (f,) = page.fields
    shape = (rows, *f.shape[1:])
    return PageLayout((Field(f.name, f.dtype, shape, dense_strides(shape), 0, role=f.role),),
                      rows * math.prod(f.shape[1:]) * f.dtype.itemsize)


_requests: dict[tuple, Request] = {}


def request(tokens: int, kinds=("state", "paged"), block: int = BLOCK) -> Request:
    key = (tokens, kinds, block)
    if key not in _requests:
        _requests[key] = Request(tokens, kinds, block)
    return _requests[key]


def tree_bytes(path: Path) -> tuple[int, int]:
    """(sum of file sizes, bytes allocated on disk) under `path`."""
    size = alloc = 0
    for p in path.rglob("*"):
        if p.is_file():
            st = p.stat()
            size += st.st_size
            alloc += st.st_blocks * 512
    return size, alloc


# ----------------------------------------------------------------------------- providers


def _layer_file(root: Path, layer: str, field: str | None = None) -> Path:
    return root / (f"{layer}.{field}.bin" if field else f"{layer}.safetensors")


def plain_save(req: Request, root: Path) -> None:
    for (layer, field), a in req.raw.items():
        with open(_layer_file(root, layer, field), "wb") as f:
            f.write(memoryview(a))


def plain_load(req: Request, root: Path) -> list[torch.Tensor]:
    out = []
    for layer, field in req.raw:
        with open(_layer_file(root, layer, field), "rb") as f:
            out.append(torch.frombuffer(bytearray(f.read()), dtype=torch.uint8))
    return out


def safetensors_save(req: Request, root: Path) -> None:
    from safetensors.torch import save_file

    by_layer: dict[str, dict[str, torch.Tensor]] = {}
    for (layer, field), p in req.packed["raw"].items():
        by_layer.setdefault(layer, {})[field] = p.payload.view(p.dtype).reshape(p.shape)
    for layer, tensors in by_layer.items():
        save_file(tensors, str(_layer_file(root, layer)))


def safetensors_load(req: Request, root: Path) -> list[dict]:
    from safetensors.torch import load_file

    return [load_file(str(_layer_file(root, layer))) for layer in {k[0] for k in req.raw}]


def store_save(req: Request, root: Path, kind: str, token_ids: np.ndarray | None = None):
    """`Store.save` of the request packed with `kind` ("raw", "quant"; a `SAVE_THREADS` key
    after a colon: its threads for the call), under `token_ids` (default: the request's; others
    make another entry of the same state)."""
    kind, _, how = kind.partition(":")
    default = store_module.CHUNK_THREADS, store_module.LOCAL_PUT_THREADS, store_module.HELP_WRITES
    store_module.CHUNK_THREADS, store_module.LOCAL_PUT_THREADS, store_module.HELP_WRITES = (
        save_threads(how) if how else default)
    try:
        with Store.open(root) as store:
            return store.save(req.layout, req.codecs(kind), req.token_ids if token_ids is None else token_ids,
                              req.packed[kind], anchor="bench")
    finally:
        store_module.CHUNK_THREADS, store_module.LOCAL_PUT_THREADS, store_module.HELP_WRITES = default


#: (CHUNK_THREADS, LOCAL_PUT_THREADS, HELP_WRITES) of the save variants (with put threads the
#: chunk threads and the help thread are not used: each put thread computes its shard's
#: checksums)
SAVE_THREADS = {"crc-thread": (2, 1, False), "crc-inline": (1, 1, False), "help": (1, 1, True),
                "help+crc-thread": (2, 1, True), "put-2": (1, 2, False), "put-4": (1, 4, False)}


def save_threads(how: str) -> tuple[int, int, bool]:
    """A `SAVE_THREADS` key's threads, or `put-N`'s: N put threads (`store_save_threads` tries
    any N)."""
    if how in SAVE_THREADS:
        return SAVE_THREADS[how]
    n = how.removeprefix("put-")
    if how.startswith("put-") and n.isdigit() and int(n) >= 1:
        return 1, int(n), False
    raise ValueError(f"a save variant is one of {', '.join(SAVE_THREADS)} or put-N, found {how!r}")


def _read_files(root: Path, entry: str) -> str:
    """Read every file of an entry once (untimed: its pages as recently used as the plain
    files the rows compare with, which are read every round); its id back."""
    for p in (root / entry_path(entry)).rglob("*"):
        if p.is_file():
            p.read_bytes()
    return entry


def store_files(req: Request, root: Path, kind: str) -> list[tuple[Path, bytes]]:
    """(path relative to `root`, bytes) of every file one `store_save(req, root, kind)` leaves,
    in path order (`files_save` writes them again)."""
    store_save(req, root, kind)
    paths = sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())
    return [(p, (root / p).read_bytes()) for p in paths]


def files_save(files: list[tuple[Path, bytes]], root: Path) -> None:
    """`store_files`' files written into `root` as plain files: their directories made, then
    each file opened, written and closed."""
    for d in sorted({p.parent for p, _ in files}):
        (root / d).mkdir(parents=True, exist_ok=True)
    for p, data in files:
        with open(root / p, "wb") as f:
            f.write(data)


def store_load(req: Request, root: Path, entry: str):
    store = Store.open(root)  # a fresh Store: the manifest is read inside the timing
    return [store.load(entry, req.layout, layer, field) for layer, field in req.raw]


class WarmReads:
    """The warm load rows' reader: the request's parts read on `READ_THREADS` threads (a pool
    the parts are all submitted to, as the connector's worker reads a restore) into one reused
    `HostArena` (pageable), reset before each round."""

    def __init__(self, req: Request) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from anchorkv.codec.api import HostArena
        from anchorkv.connector.worker import READ_THREADS

        self.req, self.threads = req, READ_THREADS
        self.pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="bench-read")
        self.arena = HostArena(pin=False)

    def _all(self, read) -> list:
        self.arena.reset()
        futures = [self.pool.submit(read, layer, field) for layer, field in self.req.raw]
        return [f.result() for f in futures]

    def plain(self, root: Path) -> list[torch.Tensor]:
        def read(layer: str, field: str) -> torch.Tensor:
            buf = self.arena(self.req.raw[(layer, field)].nbytes)
            with open(_layer_file(root, layer, field), "rb", buffering=0) as f:
                n = f.readinto(memoryview(buf.numpy()))
            assert n == buf.numel()
            return buf
        return self._all(read)

    def store(self, root: Path, entry: str, store: Store | None = None) -> list:
        # fresh: the manifest is read in the timing (opened read-only: no write probe); its read
        # and the read plans on this thread, then the reads on the pool (as `WorkerSide._read`)
        s = store if store is not None else Store.open(root, create=False)
        s.prepare(entry, self.req.layout, [(layer, field, 0, None) for layer, field in self.req.raw])
        return self._all(lambda layer, field: s.load(entry, self.req.layout, layer, field, host=self.arena))

    def close(self) -> None:
        self.pool.shutdown()


# ----------------------------------------------------------------------------- harness


@pytest.fixture(scope="module", autouse=True)
def _write_results(quick, request):
    yield
    if not _rows or quick:  # quick numbers (1 round) must not replace the recorded ones
        return
    RESULTS.mkdir(exist_ok=True)
    fs = subprocess.run(["df", "-T", str(RESULTS)], capture_output=True, text=True).stdout.split("\n")[1:2]
    machine = machine_name()
    results_path(request, RESULTS, f"{machine}-store").write_text(json.dumps({
        "device": machine, "cpus": os.cpu_count(), "torch": torch.__version__,
        "crc32c": store_module.CRC32C_LIB, "chunk_threads": store_module.CHUNK_THREADS,
        "local_put_threads": store_module.LOCAL_PUT_THREADS, "help_writes": store_module.HELP_WRITES,
        "filesystem": fs[0].split()[1] if fs and fs[0] else "?",
        "command": ".venv/bin/" + COMMAND,
        "notes": "no fsync; reads hit the OS page cache (not dropped); ratio_vs_plain = plain median / "
                 "provider median, measured in the same process",
        "results": _rows,
    }, indent=1) + "\n")


def _time(fn, setup, rounds: int) -> float:
    """Median seconds of `fn()` with `setup()` untimed before each round (one warm-up)."""
    times = []
    for _ in range(rounds + 1):
        setup()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def _fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def _plain_median(op: str, req: Request, root: Path, rounds: int) -> float:
    """The plain-file median for this request and op: the `plain` row of the same run (it runs
    first in each group), or measured here if that row was deselected."""
    key = (op, req.tokens, tuple(sorted(req.raw)))
    if key not in _plain:
        d = root / "plain-ref"
        if op == "save":
            _plain[key] = _time(lambda: plain_save(req, d), lambda: (_fresh(d), os.sync()), rounds)
        else:
            _fresh(d)
            plain_save(req, d)
            _plain[key] = _time(lambda: plain_load(req, d), lambda: None, rounds)
    return _plain[key]


def _run(benchmark, op: str, provider: str, req: Request, root: Path, rounds: int, group: str) -> None:
    d = root / provider
    kind = provider.removeprefix("store-")
    if op == "save" and provider.startswith("files-"):
        files = store_files(req, _fresh(root / f"{provider}-source"), provider.removeprefix("files-"))
        fn = lambda: files_save(files, d)  # noqa: E731
        setup = lambda: (_fresh(d), os.sync(), None)[-1]  # noqa: E731  (untimed; see the docstring)
    elif op == "save":
        fn = {"plain": lambda: plain_save(req, d), "safetensors": lambda: safetensors_save(req, d)}.get(
            provider, lambda: store_save(req, d, kind))
        setup = lambda: (_fresh(d), os.sync(), None)[-1]  # noqa: E731  (untimed; see the docstring)
    else:
        _fresh(d)
        if provider.startswith("store"):
            entry = store_save(req, d, kind).id
            fn = lambda: store_load(req, d, entry)  # noqa: E731
        else:
            (plain_save if provider == "plain" else safetensors_save)(req, d)
            fn = {"plain": lambda: plain_load(req, d), "safetensors": lambda: safetensors_load(req, d)}[provider]
        setup = lambda: None  # noqa: E731
    benchmark.group = group
    benchmark.pedantic(fn, setup=setup, rounds=rounds, iterations=1, warmup_rounds=1)
    if provider == "plain":  # the reference of the other providers of this group
        _plain[(op, req.tokens, tuple(sorted(req.raw)))] = benchmark.stats.stats.median
    plain = _plain_median(op, req, root, rounds)
    if op == "save":  # leave the last save on disk to measure it
        _fresh(d)
        fn()
    median = benchmark.stats.stats.median
    size, alloc = tree_bytes(d)
    info = {
        "op": op, "provider": provider, "tokens": req.tokens, "raw_bytes": req.raw_bytes,
        "median_s": round(median, 6),
        "state_GBps": round(req.raw_bytes / median / 1e9, 3),  # logical (raw) state bytes per second
        "io_GBps": round(size / median / 1e9, 3),  # bytes actually written / read per second
        "stored_bytes": size, "allocated_bytes": alloc,
        "size_vs_raw": round(size / req.raw_bytes, 4),
        "plain_median_s": round(plain, 6), "ratio_vs_plain": round(plain / median, 3),
    }
    benchmark.extra_info.update(info)
    _rows.append({"group": group, **info})


PROVIDERS = ["plain", "store-raw", "store-quant", "safetensors"]
WARM_PROVIDERS = ["plain:warm", "store-raw:warm", "store-quant:warm", "store-raw:warm-kept", "store-quant:warm-kept",
                  "store-raw:warm-first", "store-quant:warm-first"]
#: rounds of the warm load rows (each ~5-20 ms here; the 5 of the others left medians 30% apart)
WARM_ROUNDS = 25


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("op", ["save", "load"])
def test_kimi_request(benchmark, op, provider, quick, rounds, tmp_path_factory):
    """One Kimi-Linear request (tp=1, 7680 tokens, 105 MB of state)."""
    req = request(TOKENS)
    _run(benchmark, op, provider, req, tmp_path_factory.mktemp("req"), rounds,
         f"kimi-linear request tp=1 {TOKENS} tokens {op}")


@pytest.mark.parametrize("provider", [f"store-{codecs}:{how}" for codecs in ("raw", "quant") for how in SAVE_THREADS])
def test_kimi_save_checksums(benchmark, provider, quick, rounds, tmp_path_factory):
    """The request's save with its checksums on a chunk thread or on the writing thread, or its
    shards written by put threads (loads compute no checksums there), in the save group:
    against plain files of the same run."""
    req = request(TOKENS)
    _run(benchmark, "save", provider, req, tmp_path_factory.mktemp("crc"), rounds,
         f"kimi-linear request tp=1 {TOKENS} tokens save")


@pytest.mark.parametrize("provider", ["files-raw", "files-quant"])
def test_kimi_save_files(benchmark, provider, quick, rounds, tmp_path_factory):
    """The files of the request's store saves written as plain files (the same paths and
    bytes), in the save group: against plain files and the `store-*` rows of the same run."""
    req = request(TOKENS)
    _run(benchmark, "save", provider, req, tmp_path_factory.mktemp("files"), rounds,
         f"kimi-linear request tp=1 {TOKENS} tokens save")


@pytest.mark.parametrize("provider", ["plain", "store-raw"])
@pytest.mark.parametrize("tokens", SCALE_TOKENS)
@pytest.mark.parametrize("op", ["save", "load"])
def test_latent_scaling(benchmark, op, tokens, provider, quick, rounds, tmp_path_factory):
    """The MLA latent alone (7 layers x tokens x 576 bf16), from 1920 to 122,880 tokens."""
    if quick and tokens > SCALE_TOKENS[1]:
        pytest.skip("quick mode: the two smallest sizes only")
    req = request(tokens, ("paged",))
    _run(benchmark, op, provider, req, tmp_path_factory.mktemp("lat"), rounds,
         f"mla latent x7 {tokens} tokens {op}")


@pytest.mark.parametrize("provider", ["plain", "store-raw"])
@pytest.mark.parametrize("tokens", SHORT_TOKENS)
@pytest.mark.parametrize("op", ["save", "load"])
def test_short_entries(benchmark, op, tokens, provider, quick, rounds, tmp_path_factory):
    """The MLA latent alone (7 layers x tokens x 576 bf16) of short prompts, one block of `tokens`:
    the padded edge chunk in `size_vs_raw` (format 5 sizes the token chunks to the entry)."""
    if quick and tokens != SHORT_TOKENS[0]:
        pytest.skip("quick mode: the smallest size only")
    req = request(tokens, ("paged",), block=tokens)
    _run(benchmark, op, provider, req, tmp_path_factory.mktemp("short"), rounds,
         f"mla latent x7 {tokens} tokens (short) {op}")


@pytest.mark.parametrize("provider", WARM_PROVIDERS)
def test_kimi_warm_load(benchmark, provider, quick, rounds, tmp_path_factory):
    """The request's load as the connector's worker reads a restore: into reused memory, on
    `READ_THREADS` threads (`WarmReads`), against plain files read the same way (`plain:warm`,
    the first row of its group); `WARM_ROUNDS` rounds."""
    req = request(TOKENS)
    root = tmp_path_factory.mktemp("warm")
    n = rounds if quick else max(rounds, WARM_ROUNDS)
    reads = WarmReads(req)
    kind, _, how = provider.partition(":")
    setup, others = None, 0
    try:
        if kind == "plain":
            plain_save(req, root)
            fn = lambda: reads.plain(root)  # noqa: E731
        elif how == "warm-first":  # an entry of its own each round and warm-up
            codecs = kind.removeprefix("store-")
            ids = [store_save(req, root, codecs, req.token_ids + (i + 1) * req.tokens).id for i in range(n + 2)]
            others = sum(tree_bytes(root / entry_path(e))[0] for e in ids[1:])  # (the row's size: one entry's)
            # (cycled: `--benchmark-cprofile` runs one round more, an entry already restored)
            entries = itertools.cycle(ids)
            kept = Store.open(root, create=False)
            setup = lambda: ((_read_files(root, next(entries)),), {})  # noqa: E731
            fn = lambda entry: reads.store(root, entry, kept)  # noqa: E731
        else:
            entry = store_save(req, root, kind.removeprefix("store-")).id
            kept = Store.open(root) if how == "warm-kept" else None
            fn = lambda: reads.store(root, entry, kept)  # noqa: E731
        os.sync()  # no writeback of what was just written (or of earlier rows) during the rounds
        benchmark.group = (f"kimi-linear request tp=1 {TOKENS} tokens load (warm: reused memory, "
                           f"{reads.threads} threads)")
        # two warm-ups: the first sizes the arena (several slabs), the second makes it one slab
        benchmark.pedantic(fn, setup=setup, rounds=n, iterations=1, warmup_rounds=2)
        median = benchmark.stats.stats.median
        key = ("load-warm", req.tokens, tuple(sorted(req.raw)))
        if kind == "plain":
            _plain[key] = median
        elif key not in _plain:  # the plain row was deselected: measure it here
            d = tmp_path_factory.mktemp("warm-plain")
            plain_save(req, d)
            _plain[key] = _time(lambda: reads.plain(d), lambda: None, n)
    finally:
        reads.close()
    plain = _plain[key]
    size, alloc = tree_bytes(root)
    if others:  # the entries but one, as allocated alike
        alloc, size = alloc * (size - others) // size, size - others
    info = {
        "op": "load", "provider": provider, "tokens": req.tokens, "raw_bytes": req.raw_bytes,
        "median_s": round(median, 6), "rounds": n, "threads": reads.threads,
        "state_GBps": round(req.raw_bytes / median / 1e9, 3), "io_GBps": round(size / median / 1e9, 3),
        "stored_bytes": size, "allocated_bytes": alloc, "size_vs_raw": round(size / req.raw_bytes, 4),
        "plain_median_s": round(plain, 6), "ratio_vs_plain": round(plain / median, 3),
    }
    benchmark.extra_info.update(info)
    _rows.append({"group": benchmark.group, **info})
