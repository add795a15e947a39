"""The `bf16` codec in the store: an fp32 field saved as bfloat16 bits (a standard `uint16`
Zarr v3 array, no scales), loaded back byte for byte, read as values by `open_entry` and by
plain zarr-python following only the array attributes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from anchorkv.codec import CodecSpec
from anchorkv.kernels import reference
from anchorkv.store.store import Store
from tests.store.helpers import all_packed, tiny_layout, tokens

BF16_CODECS = {"conv": "raw", "recurrent": "bf16", "latent": "raw"}


@pytest.fixture
def saved(tmp_path):
    layout = tiny_layout()
    n = 100
    store = Store.open(tmp_path / "s")
    packed = all_packed(layout, BF16_CODECS, n)
    info = store.save(layout, BF16_CODECS, tokens(n), packed, anchor="a")
    return store, layout, info, packed


def test_bf16_entry_loads_the_same_bytes_at_any_tp(saved):
    store, layout, info, packed = saved
    assert info.arrays()["recurrent"].codec.format.value == "bf16"
    for (layer, field), p in packed.items():
        if field != "recurrent":
            continue
        got = store.load(info, layout, layer, field)
        assert got.codec.id == "bf16" and got.scales.numel() == 0
        assert torch.equal(got.payload, p.payload)
        x = reference.dequantize(got.payload, got.scales, CodecSpec("bf16", None), got.shape, got.dtype)
        want = reference.dequantize(p.payload, p.scales, CodecSpec("bf16", None), p.shape, p.dtype)
        assert torch.equal(x, want)
    for tp in (2, 4):  # another rank count reads its slice of the same bits
        half = tiny_layout(tp, 1)
        layer = next(lay.name for lay in half.layers if lay.kind.value == "state")
        got = store.load(info, half, layer, "recurrent")
        logical = half.layer(layer).page.field("recurrent").logical_shape
        full = packed[(layer, "recurrent")].payload.view(torch.int16).reshape(-1, *logical)
        heads = half.layer(layer).page.field("recurrent").shape[0]
        assert torch.equal(got.payload.view(torch.int16).reshape(-1), full[0, heads: 2 * heads].reshape(-1))


def test_bf16_entry_reads_as_values(saved):
    import zarr

    from anchorkv.store import open_entry

    store, layout, info, packed = saved
    path = store.backend.root / info.path
    e = open_entry(path)
    layers = info.arrays()["recurrent"].layers
    for i, layer in enumerate(layers):
        p = packed[(layer, "recurrent")]
        want = reference.dequantize(p.payload, p.scales, CodecSpec("bf16", None), p.shape, p.dtype)[0].numpy()
        np.testing.assert_array_equal(e["recurrent"][i], want)
    plain = zarr.open_group(str(path), mode="r")["recurrent"]
    assert plain.dtype == np.dtype("uint16")
    attrs = dict(plain.attrs["anchorkv"])
    assert attrs["codec"] == "bf16" and "bfloat16" in attrs["dequantize"]
    bits = np.asarray(plain[0]).astype(np.uint32) << 16  # what the attribute says to do
    first = packed[(layers[0], "recurrent")]
    want = reference.dequantize(first.payload, first.scales, CodecSpec("bf16", None), first.shape, first.dtype)[0]
    np.testing.assert_array_equal(bits.view(np.float32), want.numpy())
