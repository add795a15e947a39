"""`batch.FieldCut.flat` and the kernels' FLAT path: a block's groups found end to end without
unravelling the rows, only where that is where they lie; the general path for everything else;
both give the reference's bytes; blocks past the kernels' 32-bit group arithmetic are refused."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from anchorkv.codec import CodecSpec
from anchorkv.kernels import PackItem, UnpackItem, reference
from anchorkv.kernels.batch import field_cut
from anchorkv.kernels.strided import StridedField
from anchorkv.kernels.triton_pack import pack_many
from anchorkv.kernels.triton_unpack import unpack_many
from tests.kernels.helpers import make_field, make_region

pytestmark = pytest.mark.interpreter

pack_module = importlib.import_module("anchorkv.kernels.triton_pack")
unpack_module = importlib.import_module("anchorkv.kernels.triton_unpack")

# (shape, strides): contiguous, one row, size-1 axes, padded rows, permuted, strided last axis
FIELDS = [
    ((6, 64), (64, 1)),
    ((2, 3, 64), (192, 64, 1)),
    ((1, 64), (64, 1)),
    ((64,), (1,)),
    ((4, 1, 64), (64, 64, 1)),
    ((6, 64), (80, 1)),  # rows padded to 80 elements
    ((2, 3, 64), (256, 64, 1)),  # the outer axis padded
    ((3, 2, 64), (64, 192, 1)),  # leading axes permuted
    ((6, 64), (1, 6)),  # the last axis strided (the conv "DS" layout)
]


def _group_starts(shape, strides, g: int) -> np.ndarray:
    """Element offset of the first element of each group, groups in row-major order of the
    field's indices, by brute force over every element."""
    idx = np.indices(shape).reshape(len(shape), -1)
    offsets = (idx * np.array(strides)[:, None]).sum(axis=0)
    return offsets[::g]


@pytest.mark.parametrize("shape, strides", FIELDS)
@pytest.mark.parametrize("codec, group", [("int8", 32), ("fp8", 64), ("raw", None)])
def test_flat_exactly_when_group_k_starts_at_element_k_times_g(shape, strides, codec, group):
    field = StridedField(torch.bfloat16, shape, strides, 0, 4096)
    cut = field_cut(field, CodecSpec(codec, group))
    starts = _group_starts(shape, strides, cut.g)
    assert cut.flat == bool(np.array_equal(starts, np.arange(len(starts)) * cut.g)), (shape, strides)


def test_the_fields_here_take_both_paths():
    flags = {field_cut(StridedField(torch.bfloat16, s, t, 0, 4096), CodecSpec("int8", 32)).flat
             for s, t in FIELDS}
    assert flags == {True, False}


class _Recorder:
    """Records a kernel's launch arguments and launches the real kernel."""

    def __init__(self, real):
        self.real, self.flat = real, []

    def __getitem__(self, grid):
        def launch(**kwargs):
            self.flat.append(kwargs["FLAT"])
            return self.real[grid](**kwargs)
        return launch


@pytest.mark.parametrize("shape, strides", FIELDS)
@pytest.mark.parametrize("codec, group", [("int8", 32), ("fp8", 64), ("int4", 32), ("raw", None)])
def test_both_paths_give_the_reference_bytes(monkeypatch, shape, strides, codec, group):
    field = make_field(torch.bfloat16, shape, strides)
    spec = CodecSpec(codec, group)
    buffer = make_region(field, 4, seed=len(shape) + sum(strides))
    rec_p, rec_u = _Recorder(pack_module._pack_kernel), _Recorder(unpack_module._unpack_kernel)
    monkeypatch.setattr(pack_module, "_pack_kernel", rec_p)
    monkeypatch.setattr(unpack_module, "_unpack_kernel", rec_u)
    item = PackItem(buffer, field, [3, 1], 4, spec)
    ((payload, scales),) = pack_many([item])
    want_p, want_s = reference.pack(item)
    assert torch.equal(payload, want_p) and torch.equal(scales.view(torch.int32), want_s.view(torch.int32))
    target, expect = buffer.clone(), buffer.clone()
    unpack_many([UnpackItem(target, field, [0, 2], 4, spec, payload, scales)])
    reference.unpack(UnpackItem(expect, field, [0, 2], 4, spec, want_p, want_s))
    assert torch.equal(target, expect)
    flat = field_cut(field, spec).flat
    assert rec_p.flat == [flat] and rec_u.flat == [flat]


def test_blocks_past_32_bit_group_arithmetic_are_refused():
    big = StridedField(torch.bfloat16, (2**16, 2**15), (2**15, 1), 0, 2**32)
    with pytest.raises(ValueError, match=r"fewer than 2\*\*31 - 2\*\*16 elements per block, found 2147483648"):
        field_cut(big, CodecSpec("int8", 128))
    ok = StridedField(torch.bfloat16, (2**15, 2**15), (2**15, 1), 0, 2**31)
    assert field_cut(ok, CodecSpec("int8", 128)).groups == 2**30 // 128
