"""pack / unpack: a field of some blocks of a cache view to a `Packed`, and back."""

from __future__ import annotations

import torch

from anchorkv.codec.layout import CacheView
from anchorkv.codec.packed import Packed
from anchorkv.codec.registry import get_codec
from anchorkv.codec.spec import CodecSpec
from anchorkv.kernels import reference


def _ids(block_ids, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(block_ids, dtype=torch.int64)
    return ids.to(device)


def pack(view: CacheView, field: str, block_ids, codec: CodecSpec | str = "raw") -> Packed:
    """Encode field `field` of blocks `block_ids` of `view`: a `Packed` `[N, *shape]`.

    The source is read, never written. `codec` is a `CodecSpec` or a string like ``"int8:64"``.
    """
    spec = CodecSpec.parse(codec)
    impl = get_codec(spec.id)
    f = view.page.field(field)
    geom = f.geometry(view.region.block_stride)
    ids = _ids(block_ids, view.region.device)
    n = view.region.num_blocks
    if hasattr(impl, "pack"):
        payload, scales = impl.pack(view.region.buffer, geom, ids, n, spec)
    else:
        payload, scales = impl.encode(reference.gather(view.region.buffer, geom, ids, n), spec)
    return Packed(spec, (ids.numel(), *f.shape), f.dtype, payload, scales)


def unpack(packed: Packed, view: CacheView, field: str, block_ids) -> None:
    """Decode `packed` into field `field` of blocks `block_ids` of `view`, in place.

    The block ids may differ from the ones it was packed from; no other byte of the region
    changes. The shape and dtype must match the field exactly.
    """
    f = view.page.field(field)
    ids = _ids(block_ids, view.region.device)
    expected = (ids.numel(), *f.shape)
    if tuple(packed.shape) != expected or packed.dtype != f.dtype:
        raise ValueError(
            f"cannot unpack into field {field!r}: it expects {f.dtype} {list(expected)} for "
            f"{ids.numel()} blocks, the packed data is {packed.dtype} {list(packed.shape)}"
        )
    impl = get_codec(packed.codec.id)
    geom = f.geometry(view.region.block_stride)
    n = view.region.num_blocks
    device = view.region.device
    payload, scales = packed.payload.to(device), packed.scales.to(device)
    if hasattr(impl, "unpack"):
        impl.unpack(view.region.buffer, geom, ids, n, payload, scales, packed.codec)
    else:
        values = impl.decode(payload, scales, packed.codec, expected, f.dtype)
        reference.scatter(view.region.buffer, geom, ids, n, values)
