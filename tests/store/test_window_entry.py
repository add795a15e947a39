"""Sliding-window fields in the store (format version 6): an entry keeps only the rows its next
query attends to, loads them into blocks that may start before them (those rows zero), refuses
a prefix read, and reads as a standard Zarr array of its kept rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from anchorkv.codec.layout import Field, PageLayout, dense_strides
from anchorkv.codec.models import LayerKind, LayerLayout, ModelLayout, window_start
from anchorkv.codec.packed import Packed
from anchorkv.codec.spec import CodecSpec
from anchorkv.kernels import reference
from anchorkv.store.format import WINDOW_FORMAT_VERSION, window_first
from anchorkv.store.store import Store
from tests.store.helpers import tokens

ROW, BS, WINDOW = 48, 16, 40


def layout(block_size: int = BS, window: int = WINDOW) -> ModelLayout:
    full = Field("kv", torch.bfloat16, (block_size, ROW), dense_strides((block_size, ROW)), 0)
    win = Field("kv_window", torch.bfloat16, (block_size, ROW), dense_strides((block_size, ROW)), 0)
    pages = {"full": PageLayout((full,), full.extent), "win": PageLayout((win,), win.extent)}
    layers = [LayerLayout(f"model.layers.{i}.self_attn", i, LayerKind.PAGED, pages[k], window if k == "win" else None)
              for i, k in enumerate(["win", "full", "win", "full"])]
    return ModelLayout("TinySlidingWindow", tuple(layers), block_size, model="tiny")


def values(layer: int, n: int) -> torch.Tensor:
    i = torch.arange(n * ROW, dtype=torch.float64)
    return (torch.sin(i * (0.3 + 0.01 * layer)) * (2 + layer)).reshape(n, ROW).to(torch.bfloat16)


def packed_rows(x: torch.Tensor, first: int, stop: int, codec: str, keep: tuple[int, int] | None = None) -> Packed:
    """Blocks of rows [first, stop) of `x` (`first`, `stop` multiples of BS): what a save
    passes (rows past `x` junk, 7.0), or with `keep` what a load must give: the rows in `keep`,
    the others the encoding of zeros (zero bytes: zero codes, zero scales)."""
    rows = torch.full((stop - first, ROW), 7.0, dtype=torch.bfloat16)
    lo, hi = keep if keep is not None else (first, len(x))
    rows[lo - first: hi - first] = x[lo:hi]
    spec = CodecSpec.parse(codec)
    blocks = rows.reshape(-1, BS, ROW)
    payload, scales = reference.quantize(blocks.contiguous(), spec)
    if keep is not None:
        outside = torch.ones(stop - first, dtype=torch.bool)
        outside[lo - first: hi - first] = False
        payload = payload.reshape(stop - first, -1).masked_fill(outside[:, None], 0).reshape(-1)
        if scales.numel():
            scales = scales.reshape(stop - first, -1).masked_fill(outside[:, None], 0).reshape(scales.shape)
    return Packed(spec, tuple(blocks.shape), blocks.dtype, payload, scales)


def save(store: Store, lay: ModelLayout, n: int, codec: str, *, from_window: bool):
    """Save `n` tokens: every field from token 0 (`Store.save`), or (`from_window`) the window
    fields only from the block of their first kept token, as the connector's worker does."""
    codecs = {"kv": codec, "kv_window": codec}
    writer = store.begin_entry(lay, codecs, tokens(n), anchor=f"a{n}")
    stop = -(-n // BS) * BS
    for layer in lay.layers:
        f = layer.page.fields[0].name
        start = window_start(n, layer.window, BS) if (from_window and layer.window) else 0
        writer.write_layer(layer.name, f, packed_rows(values(layer.index, n), start, stop, codec), first_token=start)
    return writer.commit()


@pytest.mark.parametrize("codec", ["raw", "fp8:whole"])
@pytest.mark.parametrize("n", [100, 37, 256])
@pytest.mark.parametrize("from_window", [False, True])
def test_window_field_keeps_the_last_rows_and_loads_them_into_blocks(tmp_path, codec, n, from_window):
    store = Store.open(tmp_path / "s")
    lay = layout()
    info = save(store, lay, n, codec, from_window=from_window)
    first = window_first(n, WINDOW)
    arrays = info.arrays()
    assert info.manifest["format_version"] == WINDOW_FORMAT_VERSION
    assert (arrays["kv_window"].window, arrays["kv_window"].first) == (WINDOW, first)
    assert arrays["kv_window"].shape[:2] == (2, n - first) and arrays["kv"].shape[:2] == (2, n)
    assert "boundary_hashes" not in info.manifest  # its first rows are not the state after them
    stop = -(-n // BS) * BS
    for start in sorted({window_start(n, WINDOW, BS), first // BS * BS + BS if first // BS * BS + BS < n else 0}):
        for layer in (lay.layers[0], lay.layers[2]):
            got = store.load(info, lay, layer.name, "kv_window", start_token=start)
            want = packed_rows(values(layer.index, n), start, stop, codec, keep=(max(start, first), n))
            assert got.shape == want.shape
            assert torch.equal(got.payload, want.payload) and torch.equal(got.scales, want.scales)
    full = store.load(info, lay, lay.layers[1].name, "kv")  # the full layers keep every row
    assert torch.equal(full.payload, packed_rows(values(1, n), 0, stop, codec, keep=(0, n)).payload)


def test_window_field_restores_only_with_the_whole_entry(tmp_path):
    store = Store.open(tmp_path / "s")
    lay = layout()
    info = save(store, lay, 100, "raw", from_window=True)
    with pytest.raises(ValueError, match="restores only with the whole entry"):
        store.load(info, lay, lay.layers[0].name, "kv_window", start_token=64, num_blocks=1)


def test_window_is_part_of_the_fingerprint():
    assert layout().fingerprint_hash() != layout(window=WINDOW + 1).fingerprint_hash()
    assert layout().fingerprint()["layers"][0]["window"] == WINDOW
    assert "window" not in layout().fingerprint()["layers"][1]


def test_a_save_from_a_later_token_than_the_window_keeps_is_refused(tmp_path):
    store = Store.open(tmp_path / "s")
    lay = layout()
    writer = store.begin_entry(lay, {"kv": "raw", "kv_window": "raw"}, tokens(100), anchor="a")
    try:
        with pytest.raises(Exception, match="keeps tokens from 61"):  # (n - window + 1)
            writer.write_layer(lay.layers[0].name, "kv_window", packed_rows(values(0, 100), 64, 112, "raw"),
                               first_token=64)
    finally:
        writer.abort()


def test_window_field_reads_as_a_standard_zarr_array(tmp_path):
    import zarr

    store = Store.open(tmp_path / "s")
    lay = layout()
    info = save(store, lay, 100, "raw", from_window=True)
    first = window_first(100, WINDOW)
    arr = zarr.open_array(str(store.backend.root / info.path / "kv_window"), mode="r")
    attrs = dict(arr.attrs["anchorkv"])
    assert arr.shape == (2, 100 - first, ROW)
    got = torch.from_numpy(np.ascontiguousarray(arr[1]).view(np.int16)).view(torch.bfloat16)
    assert torch.equal(got, values(2, 100)[first:])
    manifest_attrs = info.manifest["arrays"]["kv_window"]
    assert (manifest_attrs["window"], manifest_attrs["first_token"]) == (WINDOW, first)
    assert (attrs["window"], attrs["first_token"]) == (WINDOW, first)  # what a plain reader goes by


def test_verify_finds_a_first_token_past_the_window(tmp_path):
    from anchorkv.store.manifest import _check_manifest, manifest_checksum

    store = Store.open(tmp_path / "s")
    info = save(store, layout(), 100, "raw", from_window=True)
    m = dict(info.manifest)
    m["arrays"] = {**m["arrays"], "kv_window": {**m["arrays"]["kv_window"], "first_token": 62}}
    m["checksum"] = manifest_checksum(m)
    assert any("first_token 62" in p for p in _check_manifest(info.id, m))
    assert _check_manifest(info.id, dict(info.manifest)) == []


def test_whole_blocks_of_the_window_where_rows_are_not_tokens(tmp_path):
    """`window_align`: an engine whose in-block token order is opaque (vLLM's CPU attention)
    keeps whole blocks: rows from the block of the first attended token, restored as they were
    (no row zeroed: a row there is not one token's)."""
    store = Store.open(tmp_path / "s")
    lay = layout()
    n, start = 100, window_start(100, WINDOW, BS)
    writer = store.begin_entry(lay, {"kv": "raw", "kv_window": "raw"}, tokens(n), anchor="a", window_align=BS)
    blocks = {}
    for layer in lay.layers:
        f = layer.page.fields[0].name
        first = start if layer.window else 0
        blocks[layer.name] = packed_rows(values(layer.index, n), first, 112, "raw")  # (rows past n: junk)
        writer.write_layer(layer.name, f, blocks[layer.name], first_token=first)
    info = writer.commit()
    assert info.arrays()["kv_window"].first == start == 48 and _check_manifest_ok(info)
    got = store.load(info, lay, lay.layers[0].name, "kv_window", start_token=start)
    want = packed_rows(values(0, n), start, 112, "raw", keep=(start, n))  # rows [48, 61) kept too
    assert torch.equal(got.payload, want.payload)


def _check_manifest_ok(info) -> bool:
    from anchorkv.store.manifest import _check_manifest

    return _check_manifest(info.id, dict(info.manifest)) == []
