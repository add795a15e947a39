"""A shard written from whole layer blocks (`writer._gathers`): one buffer per layer and part,
the bytes of the chunk-by-chunk path.

Without a compressor, where a layer's whole chunks in a shard tile a box of its block from the
origin (at most one edge chunk of leading rows after them: a paged field's last), the writer
hands the file one buffer per layer (a view where the chunks lie in the block in shard order,
else one reshape-and-transpose copy; the edge chunk's rows and zero rows after it) and
checksums each chunk as a slice of it, instead of building a buffer, a slot and a checksum call
chain per inner chunk in Python (752 inner chunks in a quantized Kimi-Linear request). Here
both paths write the same entries and every file must be byte for byte the same.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from anchorkv.store import writer as writer_module
from anchorkv.store.format import SHARD_TOKEN_CHUNKS, TOKEN_CHUNK, shard_order
from anchorkv.store.writer import _gather, _gather_recipe
from tests.store.helpers import CODECS, RAW_CODECS
from tests.store.test_format import CODEC_SETS, _save_at_tp


def _chunk_by_chunk(src: np.ndarray, cuts) -> bytes:
    return b"".join(np.ascontiguousarray(src[cut]).tobytes() for cut in cuts)


def _cuts(counts, ext, order, lead=()):
    """The slices of the chunks (grid position in `order`), `lead` axes of extent 1 in front."""
    return [(*(slice(0, 1) for _ in lead), *(slice(a * e, (a + 1) * e) for a, e in zip(at, ext, strict=True)))
            for at in order]


@pytest.mark.parametrize("counts,ext,extra", [
    ((8,), (4,), (0,)),  # one grid axis: the block's own order, a view
    ((2, 4), (3, 5), (0, 0)),  # chunks cut along two axes: one copy
    ((2, 2, 2), (1, 3, 4), (1, 0, 2)),  # a box short of the block on two axes
    ((1, 1, 8), (3, 3, 8), (0, 0, 0)),  # conv-like: chunks along the last axis only
    ((3, 1), (960, 9), (17, 0)),  # latent-like: whole chunks of rows, rows past them left out
])
@pytest.mark.parametrize("how", ["c", "morton", "shuffled"])
@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
def test_gather_is_the_chunks_one_after_another(counts, ext, extra, how, dtype):
    rng = np.random.default_rng(sum(counts) + len(how))
    shape = (1, *(c * e + x for c, e, x in zip(counts, ext, extra, strict=True)))
    src = rng.integers(0, 255, size=shape).astype(dtype)
    grid = list(itertools.product(*map(range, counts)))
    order = {"c": grid, "morton": list(shard_order(counts)),
             "shuffled": [grid[i] for i in rng.permutation(len(grid))]}[how]
    cuts = _cuts(counts, ext, order, lead=(0,))
    recipe = _gather_recipe(shape, cuts)
    assert recipe is not None
    assert bytes(_gather(src, recipe)) == _chunk_by_chunk(src, cuts)
    strided = np.stack([src, src], axis=-1)[..., 0]  # (a source that is not contiguous)
    assert not strided.flags.c_contiguous
    assert bytes(_gather(strided, recipe)) == _chunk_by_chunk(strided, cuts)
    if how == "c" and len(counts) == 1:
        assert recipe[3] is None and _gather(src, recipe).obj.base is not None  # a view: no copy


def test_gather_refuses_cuts_that_do_not_tile_a_box():
    shape = (1, 8, 6)
    tiles = _cuts((2, 3), (4, 2), list(itertools.product(range(2), range(3))), lead=(0,))
    assert _gather_recipe(shape, tiles) is not None
    assert _gather_recipe(shape, tiles[:-1]) is None  # a chunk of the box missing
    assert _gather_recipe(shape, [*tiles[:-1], tiles[0]]) is None  # one twice
    assert _gather_recipe(shape, [*tiles[:-1], (slice(0, 1), slice(4, 8), slice(4, 5))]) is None  # narrower
    assert _gather_recipe(shape, [(slice(0, 1), slice(2, 6), slice(0, 6))]) is None  # not on the chunk grid
    assert _gather_recipe((1, 8, 4), tiles) is None  # past the block
    assert _gather_recipe(shape, []) is None
    # a box from further on: the chunks of rows 4..8 (a later shard of a paged layer), in C
    # order and shuffled, gathered as the chunk-by-chunk bytes; off the grid or past the block: None
    rng = np.random.default_rng(3)
    src = rng.integers(0, 255, size=(1, 12, 6)).astype(np.uint8)
    later = _cuts((2, 3), (2, 2), [(a + 2, b) for a, b in itertools.product(range(2), range(3))], lead=(0,))
    for cuts in (later, [later[i] for i in rng.permutation(len(later))]):
        recipe = _gather_recipe(src.shape, cuts)
        assert recipe is not None and recipe[0] == (slice(0, 1), slice(4, 8), slice(0, 6))
        assert bytes(_gather(src, recipe)) == _chunk_by_chunk(src, cuts)
    assert _gather_recipe((1, 7, 6), later) is None  # past the block
    assert _gather_recipe(src.shape, [*later[:-1], (slice(0, 1), slice(9, 11), slice(4, 6))]) is None


def _files(root: Path) -> dict[str, bytes]:
    """Every file of a store: shard files' bytes; JSON files parsed (a manifest records times)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            rel = str(p.relative_to(root))
            out[rel] = json.loads(p.read_bytes()) if p.name.endswith(".json") else p.read_bytes()
    return out


def _without_times(doc):
    """A parsed JSON file without its times and the manifest's checksum, which covers them."""
    if isinstance(doc, dict):
        return {k: _without_times(v) for k, v in doc.items()
                if "time" not in k and "created" not in k and not (k == "checksum" and "blake3" in str(v))}
    if isinstance(doc, list):
        return [_without_times(v) for v in doc]
    return doc


CASES = [  # (codecs, tp, tokens)
    (CODECS, 1, 700),
    (RAW_CODECS, 1, 2 * TOKEN_CHUNK),  # whole token chunks: the latent's shards from its blocks too
    (CODECS, 2, 3 * TOKEN_CHUNK),
    (CODEC_SETS["int4"], 4, TOKEN_CHUNK + 100),
    ({"conv": "bf16", "recurrent": "fp8:16", "latent": "raw"}, 8, 700),
    # past 8192 tokens a layer's latent is several shards: the second's chunks tile a box of
    # the layer block from row 8192 (then an edge chunk in the third)
    (CODECS, 1, 2 * SHARD_TOKEN_CHUNKS * TOKEN_CHUNK + 300),
    (RAW_CODECS, 2, 2 * SHARD_TOKEN_CHUNKS * TOKEN_CHUNK),
]


@pytest.mark.parametrize("codecs,tp,n", CASES, ids=["quant", "raw-whole-chunks", "quant-tp2", "int4-tp4", "mixed-tp8",
                                                   "quant-3-shards", "raw-2-shards-tp2"])
@pytest.mark.parametrize("spans", ["layer-span", "one-layer"])
def test_shards_from_blocks_are_the_chunk_by_chunk_bytes(tmp_path, monkeypatch, codecs, tp, n, spans):
    if spans == "one-layer":
        from anchorkv.store import format as F

        monkeypatch.setattr(F, "LAYER_SHARD_BYTES", 0)
    gathered: list[int] = []
    real = writer_module._gather

    def counted(src, recipe):
        gathered.append(1)
        return real(src, recipe)

    plans: list[tuple[str, bool]] = []
    real_plans = writer_module._gathers

    def recorded(array, *a):
        plans.append((array.kind, real_plans(array, *a) is not None))
        return real_plans(array, *a)

    monkeypatch.setattr(writer_module, "_gather", counted)
    monkeypatch.setattr(writer_module, "_gathers", recorded)
    _, fast = _save_at_tp(tmp_path / "fast", codecs, n, tp)
    assert gathered, "no shard was written from whole layer blocks"
    # every field of these layouts takes the path: state fields, and paged ones with an edge chunk
    assert {kind for kind, _ in plans} == {"state", "paged"} and all(ok for _, ok in plans), plans
    monkeypatch.setattr(writer_module, "_gathers", lambda *a: None)  # every shard chunk by chunk
    gathered.clear()
    _, slow = _save_at_tp(tmp_path / "slow", codecs, n, tp)
    assert not gathered
    a, b = _files(tmp_path / "fast"), _files(tmp_path / "slow")
    assert sorted(a) == sorted(b)
    assert sum(1 for k in a if "/c." in k) > 3
    for key in a:
        assert _without_times(a[key]) == _without_times(b[key]), key
