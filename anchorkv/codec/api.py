"""pack / unpack: a field of some blocks of a cache view to a `Packed`, and back.

`pack_many` / `unpack_many` do the same for all the (layer, field) pairs of one request at
once: the built-in codecs then share a few kernel launches (`anchorkv.kernels.pack_many`), so a
Kimi-Linear request (47 pairs) is not 47 launches.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from anchorkv import kernels
from anchorkv.codec.layout import CacheView
from anchorkv.codec.packed import Packed
from anchorkv.codec.registry import QuantCodec, get_codec
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
    strided = f.strided(view.region.block_stride)
    ids = _ids(block_ids, view.region.device)
    n = view.region.num_blocks
    if isinstance(impl, QuantCodec):  # the fused kernels: one pass over the cache
        payload, scales = kernels.pack(kernels.PackItem(view.region.buffer, strided, ids, n, spec))
    else:
        payload, scales = impl.encode(reference.gather(view.region.buffer, strided, ids, n), spec)
    return Packed(spec, (ids.numel(), *f.shape), f.dtype, payload, scales)


def _check_unpack(packed: Packed, view: CacheView, field: str, ids: torch.Tensor):
    f = view.page.field(field)
    expected = (ids.numel(), *f.shape)
    if tuple(packed.shape) != expected or packed.dtype != f.dtype:
        raise ValueError(
            f"cannot unpack into field {field!r}: it expects {f.dtype} {list(expected)} for "
            f"{ids.numel()} blocks, the packed data is {packed.dtype} {list(packed.shape)}"
        )
    return f


def unpack(packed: Packed, view: CacheView, field: str, block_ids) -> None:
    """Decode `packed` into field `field` of blocks `block_ids` of `view`, in place.

    The block ids may differ from the ones it was packed from; no other byte of the region
    changes. The shape and dtype must match the field exactly.
    """
    ids = _ids(block_ids, view.region.device)
    f = _check_unpack(packed, view, field, ids)
    expected = (ids.numel(), *f.shape)
    impl = get_codec(packed.codec.id)
    strided = f.strided(view.region.block_stride)
    n = view.region.num_blocks
    device = view.region.device
    payload, scales = packed.payload.to(device), packed.scales.to(device)
    if isinstance(impl, QuantCodec):
        kernels.unpack(kernels.UnpackItem(view.region.buffer, strided, ids, n, packed.codec, payload, scales))
    else:
        values = impl.decode(payload, scales, packed.codec, expected, f.dtype)
        reference.scatter(view.region.buffer, strided, ids, n, values)


def pack_many(requests: Sequence[tuple[CacheView, str, object, CodecSpec | str]]) -> list[Packed]:
    """`pack(view, field, block_ids, codec)` of every request, in order, in few launches.

    Built-in codecs go through the batched kernels together; custom codecs one by one.
    """
    out: list[Packed | None] = [None] * len(requests)
    items, where = [], []
    for i, (view, field, block_ids, codec) in enumerate(requests):
        spec = CodecSpec.parse(codec)
        impl = get_codec(spec.id)
        if not isinstance(impl, QuantCodec):
            out[i] = pack(view, field, block_ids, spec)
            continue
        f = view.page.field(field)
        # host ids as they came (a list or tuple is checked by the kernels without a torch op;
        # one ids object shared by many fields is checked once): no device sync
        ids = block_ids if isinstance(block_ids, (list, tuple)) else torch.as_tensor(
            block_ids, dtype=torch.int64)
        items.append(kernels.PackItem(view.region.buffer, f.strided(view.region.block_stride), ids,
                                      view.region.num_blocks, spec))
        where.append((i, spec, (len(ids), *f.shape), f.dtype))
    for (i, spec, shape, dtype), (payload, scales) in zip(where, kernels.pack_many(items), strict=True):
        out[i] = Packed(spec, shape, dtype, payload, scales)
    return out  # type: ignore[return-value]


def unpack_many(requests: Sequence[tuple[Packed, CacheView, str, object]]) -> None:
    """`unpack(packed, view, field, block_ids)` of every request, in few launches.

    Every request is checked before anything is written; targets must not overlap.
    """
    items, custom = [], []
    for packed, view, field, block_ids in requests:
        ids = torch.as_tensor(block_ids, dtype=torch.int64)
        f = _check_unpack(packed, view, field, ids)
        impl = get_codec(packed.codec.id)
        if not isinstance(impl, QuantCodec):
            custom.append((packed, view, field, ids))
            continue
        device = view.region.device
        items.append(kernels.UnpackItem(
            view.region.buffer, f.strided(view.region.block_stride), ids, view.region.num_blocks,
            packed.codec, packed.payload.to(device, non_blocking=True),
            packed.scales.to(device, non_blocking=True)))
    kernels.unpack_many(items)
    for packed, view, field, ids in custom:
        unpack(packed, view, field, ids)
