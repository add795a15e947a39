"""The `bf16` format in the Triton kernels (FMT 4): byte-identical to the reference, rounding
edges, non-finite values and canonical NaN included, from and into fp32, bf16 and fp16 fields."""

from __future__ import annotations

import pytest
import torch

from anchorkv.codec import CodecSpec
from anchorkv.kernels import PackItem, UnpackItem, reference
from anchorkv.kernels.strided import field_view
from anchorkv.kernels.triton_pack import pack_many
from anchorkv.kernels.triton_unpack import unpack_many
from tests.kernels.helpers import DEVICE, make_field, make_region, touched

pytestmark = pytest.mark.interpreter

BLOCKS = 4
#: fp32 bit patterns around bf16 rounding: ties to even both ways, carries into the exponent,
#: the largest finite values (which round to Inf), subnormals, signed zeros, Inf, NaNs.
EDGES = [0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F7FFFFF, 0x7F7FFFFF, 0x7F7F8000, 0xFF7FFFFF,
         0x00008000, 0x00018000, 0x80000000, 0x00000000, 0x7F800000, 0xFF800000, 0x7FC00000,
         0xFFC00001, 0x7F800001, 0x3F800001, 0xBF808000]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape,strides", [((4, 24), (24, 1)), ((3, 5, 16), (1, 3, 15)),
                                           ((2, 40), (40, 1))])
def test_bf16_pack_and_unpack_equal_the_reference(dtype, shape, strides):
    field = make_field(dtype, shape, strides, offset_elems=0 if strides[-1] == 1 else 3)
    src = make_region(field, BLOCKS, seed=11, scale=1e3)
    if dtype == torch.float32:  # plant the rounding edges in block 2
        view = field_view(src, field, BLOCKS)[2].reshape(-1)
        edges = torch.tensor(EDGES, dtype=torch.int64).to(torch.int32).view(torch.float32)
        view[: len(EDGES)] = edges.to(DEVICE)
    ids = [2, 0, 3]
    item = PackItem(src, field, ids, BLOCKS, CodecSpec("bf16"))
    (payload, scales), = pack_many([item])
    want_p, want_s = reference.pack(item)
    assert torch.equal(payload, want_p)
    assert scales.numel() == 0 and want_s.numel() == 0

    target = make_region(field, BLOCKS, seed=12)
    want = target.clone()
    reference.unpack(UnpackItem(want, field, [1, 3, 0], BLOCKS, item.spec, want_p, want_s))
    unpack_many([UnpackItem(target, field, [1, 3, 0], BLOCKS, item.spec, payload, scales)])
    assert torch.equal(target, want)
    outside = ~touched(target, field, BLOCKS, [1, 3, 0])
    assert torch.equal(target[outside], make_region(field, BLOCKS, seed=12)[outside])
