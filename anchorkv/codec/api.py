"""pack / unpack: a field of some blocks of a cache view to a `Packed`, and back.

`pack_many` / `unpack_many` do the same for all the (layer, field) pairs of one request at
once: the built-in codecs then share a few kernel launches (`anchorkv.kernels.pack_many`), so a
Kimi-Linear request (47 pairs) is not 47 launches. A `Packer` packs the same pairs call after
call (a connector's saves), only the blocks changing: the per-call host work is the launches.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from anchorkv import kernels
from anchorkv.codec.layout import CacheView
from anchorkv.codec.packed import Packed
from anchorkv.codec.registry import QuantCodec, get_codec
from anchorkv.codec.spec import CodecSpec
from anchorkv.kernels import reference
from anchorkv.kernels.packset import host_copy, may_hold_nan


def _ids(block_ids, device: torch.device) -> torch.Tensor:
    ids = block_ids if isinstance(block_ids, torch.Tensor) else torch.as_tensor(block_ids)
    if ids.numel() and (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool):
        # (an int64 conversion made [1.5] block 1)
        shown = block_ids if not isinstance(block_ids, torch.Tensor) else f"a {ids.dtype} tensor"
        raise ValueError(f"block ids must be whole numbers (Python ints or an integer tensor), found {shown}")
    return ids.to(device=device, dtype=torch.int64)


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

    Every request is checked before anything is written; targets must not overlap. Host parts
    of built-in codecs bound for a GPU cross together (`stage_to_device`): one page-locked
    staging buffer and one asynchronous copy per device, no host synchronization.
    """
    items: list[kernels.UnpackItem] = []
    custom, moves = [], []
    for packed, view, field, block_ids in requests:
        ids = torch.as_tensor(block_ids, dtype=torch.int64)
        f = _check_unpack(packed, view, field, ids)
        impl = get_codec(packed.codec.id)
        if not isinstance(impl, QuantCodec):
            custom.append((packed, view, field, ids))
            continue
        device = view.region.device
        payload, scales = packed.payload, packed.scales
        if device.type == "cuda" and payload.device.type == "cpu" and scales.device.type == "cpu":
            moves.append(len(items))  # staged below, with the others
        else:
            payload, scales = payload.to(device, non_blocking=True), scales.to(device, non_blocking=True)
        items.append(kernels.UnpackItem(
            view.region.buffer, f.strided(view.region.block_stride), ids, view.region.num_blocks,
            packed.codec, payload, scales))
    if moves:  # host parts for CUDA targets: one staging buffer, one copy per device
        by_device: dict[torch.device, list[int]] = {}
        for i in moves:
            by_device.setdefault(items[i].buffer.device, []).append(i)
        for device, members in by_device.items():
            moved = stage_to_device([t for i in members for t in (items[i].payload, items[i].scales)], device)
            for k, i in enumerate(members):
                items[i] = dataclasses.replace(items[i], payload=moved[2 * k], scales=moved[2 * k + 1])
    kernels.unpack_many(items)
    for packed, view, field, ids in custom:
        unpack(packed, view, field, ids)


@dataclass(frozen=True)
class _PartMeta:
    spec: CodecSpec
    shape: tuple[int, ...]  # the field's shape (without the block axis)
    dtype: torch.dtype
    slot: int
    quant: int | None  # index in the Packer's kernel set; None: a custom codec


class Packer:
    """`pack_many` of the same (view, field, codec) parts, call after call; each call names the
    block ids of each *slot* and part i packs the blocks of slot `slot_i` (a connector: one slot
    per KV-cache group).

    Everything that does not depend on the blocks is resolved once: codec specs, fields, the
    kernels' `PackSet` of the built-in codecs' parts. `pack` returns `PackedParts`, whose
    `Packed` views are made when asked for (`packed()`), so a caller can move the bytes to the
    host first and cut them into parts on another thread. Parts with custom codecs are encoded
    one by one at each call.
    """

    def __init__(self, parts: Sequence[tuple[CacheView, str, CodecSpec | str, int]]) -> None:
        metas: list[_PartMeta] = []
        targets: list[kernels.PackTarget] = []
        slots: list[int] = []
        self._custom: list[tuple[int, CacheView, str, CodecSpec, int]] = []
        for view, field, codec, slot in parts:
            spec = CodecSpec.parse(codec)
            f = view.page.field(field)
            quant = None
            if isinstance(get_codec(spec.id), QuantCodec):
                quant = len(targets)
                targets.append(kernels.PackTarget(view.region.buffer, f.strided(view.region.block_stride),
                                                  view.region.num_blocks, spec))
                slots.append(slot)
            else:
                self._custom.append((len(metas), view, field, spec, slot))
            metas.append(_PartMeta(spec, tuple(f.shape), f.dtype, slot, quant))
        self.metas: tuple[_PartMeta, ...] = tuple(metas)
        self._set = kernels.PackSet(targets, slots) if targets else None

    def __len__(self) -> int:
        return len(self.metas)

    def pack(self, ids_by_slot: Sequence) -> PackedParts:
        """Pack every part's blocks `ids_by_slot[slot]` (lists or tuples of ints: no device
        synchronization)."""
        quant = self._set.pack(ids_by_slot) if self._set is not None else None
        custom = {i: pack(view, field, ids_by_slot[slot], spec) for i, view, field, spec, slot in self._custom}
        lens = tuple(len(ids) for ids in ids_by_slot)
        return PackedParts(self.metas, lens, quant, custom)


class Unpacker:
    """The mirror of `Packer` for restores: unpacks into the same (view, field, codec) parts
    call after call, each call naming the block ids of each slot (part i writes the blocks of
    slot `slot_i`). Built-in codecs only (a custom codec decodes part by part: `unpack_many`).

    A call takes the parts as one `kernels.PackedBatch` laid out as `layout(lens)` says (each
    part at its span of one payload and one scales tensor): a restore reads every part into its
    span of one host buffer, which then crosses to the GPU in one copy, and the kernels'
    `UnpackSet` writes it with no per-part work on the host.
    """

    def __init__(self, parts: Sequence[tuple[CacheView, str, CodecSpec | str, int]]) -> None:
        targets: list[kernels.PackTarget] = []
        specs: list[CodecSpec] = []
        for view, field, codec, _ in parts:
            spec = CodecSpec.parse(codec)
            if not self.takes(spec):
                raise ValueError(f"an Unpacker decodes the built-in codecs, found {spec} for field {field!r}; "
                                 "unpack custom codecs with codec.unpack_many")
            f = view.page.field(field)
            targets.append(kernels.PackTarget(view.region.buffer, f.strided(view.region.block_stride),
                                              view.region.num_blocks, spec))
            specs.append(spec)
        self.specs: tuple[CodecSpec, ...] = tuple(specs)
        self._set = kernels.UnpackSet(targets, [slot for *_, slot in parts])

    def __len__(self) -> int:
        return len(self.specs)

    @staticmethod
    def takes(codec: CodecSpec | str) -> bool:
        """Whether an `Unpacker` decodes `codec` (a built-in one)."""
        return isinstance(get_codec(CodecSpec.parse(codec).id), QuantCodec)

    @property
    def device(self) -> torch.device:
        return self._set.device

    def layout(self, lens_by_slot: Sequence[int]) -> kernels.BatchLayout:
        """Where each part lies in a batch for slots of `lens_by_slot` blocks."""
        return self._set.layout(lens_by_slot)

    def unpack(self, batch: kernels.PackedBatch, ids_by_slot: Sequence) -> None:
        """Write every part of `batch` (on the parts' device, laid out as `layout` says) into
        its blocks `ids_by_slot[slot]`; everything is checked before a byte is written."""
        self._set.unpack(batch, ids_by_slot)


@dataclass(frozen=True)
class PackedParts:
    """The result of one `Packer.pack`: the built-in codecs' parts in one `kernels.PackedBatch`
    (one allocation), the custom codecs' as `Packed`; `packed()` lists every part in order."""

    metas: tuple[_PartMeta, ...]
    slot_lens: tuple[int, ...]  # blocks packed, per slot
    quant: kernels.PackedBatch | None
    custom: dict[int, Packed]

    @property
    def host_bytes(self) -> int:
        """The bytes of the `host` buffer `to_host` may be given (the built-in codecs' parts)."""
        return self.quant.host_bytes if self.quant is not None else 0

    def to_host(self, *, pin: bool = True, host: torch.Tensor | None = None) -> PackedParts:
        """The parts in host memory, copied asynchronously on the current stream (into
        page-locked memory with `pin`): one copy for all the built-in codecs' parts, two per
        custom part. Itself when everything is on the host already. With `host` (a uint8
        buffer of at least `host_bytes`, page-locked: see `HostPool`) the built-in codecs'
        parts are copied into it (`kernels.PackedBatch.copy_into`) instead of new tensors."""
        quant = self.quant.to_host(pin=pin, host=host) if self.quant is not None else None
        custom = {i: p if p.payload.device.type == "cpu" else _host_copy(p, pin)
                  for i, p in self.custom.items()}
        return PackedParts(self.metas, self.slot_lens, quant, custom)

    def record_stream(self, stream) -> None:
        """`Tensor.record_stream(stream)` of every device tensor of the parts (a GPU batch copied
        to the host on another stream than the one that packed it: its memory is not reused
        before the copy has read it)."""
        if self.quant is not None:
            self.quant.record_stream(stream)
        for p in self.custom.values():
            for t in (p.payload, p.scales):
                if t.device.type != "cpu":
                    t.record_stream(stream)

    def may_hold_nan(self) -> bool:
        """False only when no part has a poisoned group (`Packed.poisoned_groups` would be 0
        for each): a reduction per launch's scales instead of a count per part. True may be a
        false alarm; count the parts then."""
        if self.quant is not None and self.quant.may_hold_nan():
            return True
        return any(may_hold_nan(p.scales) for p in self.custom.values())

    def packed(self) -> list[Packed]:
        out = []
        parts = self.quant.parts() if self.quant is not None else []
        for i, meta in enumerate(self.metas):
            if meta.quant is None:
                out.append(self.custom[i])
                continue
            payload, scales = parts[meta.quant]
            out.append(Packed(meta.spec, (self.slot_lens[meta.slot], *meta.shape), meta.dtype, payload, scales))
        return out


def stage_to_device(tensors: Sequence[torch.Tensor], device: torch.device | str, *,
                    pin: bool = True) -> list[torch.Tensor]:
    """Host tensors on `device`, moved together in one `non_blocking` copy per host buffer, on
    the current stream; returns views of the device copies with each tensor's dtype and shape.

    Contiguous tensors that are views of one page-locked allocation (a `HostArena`'s slab; any
    shared allocation when `pin` is False) cross as they lie: the span they cover is copied, no
    byte is copied on the CPU. The others are first copied (on the CPU) into one staging buffer,
    page-locked with `pin`, each at a 16-byte aligned offset. (A `non_blocking` copy from
    pageable memory blocks the CPU; one per part of a restore would be 94 of them for a
    Kimi-Linear request.)"""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    sources = list(tensors)  # what crosses: the tensor itself, or its copy in the staging arena
    shared: dict[int, list[int]] = {}  # storage address -> its contiguous tensors
    staged: list[int] = []
    for i, t in enumerate(tensors):
        if not t.numel():
            out[i] = torch.empty(t.shape, dtype=t.dtype, device=device)
        elif t.is_contiguous():
            shared.setdefault(t.untyped_storage().data_ptr(), []).append(i)
        else:
            staged.append(i)
    groups = []
    for members in shared.values():
        first = tensors[members[0]]
        if first.is_pinned() if pin else len(members) > 1:
            groups.append(members)  # as they lie: a page-locked buffer (pin False: one several share)
        else:
            staged.extend(members)
    if staged:  # copied into one staging buffer (an arena of exactly their size: one slab)
        arena = HostArena(pin=pin, hint=HostArena.size_for(tensors[i].nbytes for i in staged))
        for i in staged:
            sources[i] = _view_as(arena(tensors[i].nbytes), tensors[i]).copy_(tensors[i])
        groups.append(staged)
    for members in groups:  # one copy of the span each group's tensors cover
        base = torch.empty(0, dtype=torch.uint8).set_(sources[members[0]].untyped_storage())
        spans = [(sources[i].storage_offset() * sources[i].element_size(), sources[i].nbytes) for i in members]
        lo = min(a for a, _ in spans)
        moved = base.narrow(0, lo, max(a + n for a, n in spans) - lo).to(device, non_blocking=True)
        for i, (a, n) in zip(members, spans, strict=True):
            out[i] = _view_as(moved.narrow(0, a - lo, n), tensors[i])
    return out  # type: ignore[return-value]


def _aligned(n: int, to: int) -> int:
    return -(-n // to) * to


def _block(nbytes: int, pin: bool) -> int:
    """The bytes a host tensor of `nbytes` holds: page-locked, the power of two at or above
    (torch's caching host allocator hands out page-locked memory in such blocks, `PowerOf2Ceil`
    in ATen's CachingHostAllocator by default, and keeps the whole block while the tensor lives:
    asking for all of it costs no memory); pageable, `nbytes`."""
    return 1 << (nbytes - 1).bit_length() if pin and nbytes > 1 else nbytes


def _view_as(raw: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The uint8 bytes `raw` as a contiguous tensor of `t`'s dtype and shape."""
    return raw.view(t.dtype).view(t.shape)


class HostArena:
    """Host memory for the parts of a restore: `arena(nbytes)` is a uint8 tensor of `nbytes` at
    a 16-byte aligned offset of a slab, page-locked with `pin`. A store reads the parts into it
    (`Store.load(..., host=arena)`), and `stage_to_device` then sends each slab's used span to
    the GPU in one copy, with no staging copy on the CPU.

    `reset()` hands the same memory out again for the next restore, so a worker reads every
    restore into warm memory (a fresh buffer of 100 MB costs as much in page faults as the read
    itself). The first slab holds max(`hint`, the first request) bytes, later ones at least
    twice the last; page-locked, a slab is all of its power-of-two block (`_block`), so a
    restore a little larger than the last still fits in it. `used` is what one slab holding
    every request since the last reset needs (alignment included), and a reset after a round
    that took several slabs replaces them with one of that size. The arena keeps its largest
    round's memory until it is dropped. Parts may be asked for from several threads at once (a
    restore's reads run in parallel); `reset` must not run while anything else does.
    """

    ALIGN = 16

    def __init__(self, *, pin: bool, hint: int = 0) -> None:
        self.pin = pin
        self.hint = hint
        self.slabs: list[torch.Tensor] = []
        self.used = 0
        self._at = 0  # bytes used in the last slab
        self._lock = threading.Lock()

    @classmethod
    def size_for(cls, sizes) -> int:
        """The bytes one slab needs for requests of `sizes` bytes, in order (`used` after them):
        the `hint` that makes them one slab."""
        total = 0
        for n in sizes:
            if n:
                total = _aligned(total, cls.ALIGN) + n
        return total

    def reset(self) -> None:
        """Start again at the first slab's first byte: nothing handed out before may be in use
        any more (its copies to the GPU complete)."""
        if len(self.slabs) > 1:
            self.hint = max(self.hint, self.used)
            self.slabs = []
        self.used = self._at = 0

    def __call__(self, nbytes: int) -> torch.Tensor:
        if nbytes < 0:
            raise ValueError(f"HostArena: {nbytes} bytes asked for, expected >= 0")
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        with self._lock:
            return self._take(nbytes)

    def _take(self, nbytes: int) -> torch.Tensor:
        self.used = _aligned(self.used, self.ALIGN) + nbytes
        at = _aligned(self._at, self.ALIGN)
        if not self.slabs or at + nbytes > self.slabs[-1].numel():
            size = _block(max(nbytes, 2 * self.slabs[-1].numel() if self.slabs else self.hint), self.pin)
            self.slabs.append(torch.empty(size, dtype=torch.uint8, pin_memory=self.pin))
            at = 0
        self._at = at + nbytes
        return self.slabs[-1].narrow(0, at, nbytes)


class HostPool:
    """Reused host buffers for copies from the GPU that outlive the step that makes them (a
    save's packed bytes, which the writer thread holds until the store has them), so a save
    does not allocate page-locked memory: `take(nbytes)` hands out the smallest free buffer of
    at least `nbytes`, or a new one (`size_for(nbytes)` bytes: page-locked with `pin`);
    `give(buffer)` returns it once nothing reads or writes it any more (its copies complete).
    At most `keep` free buffers are kept (the largest); as many are in use as saves are in
    flight. Thread-safe: a step takes, the writer gives back."""

    GRANULE = 1 << 20

    def __init__(self, *, pin: bool, keep: int = 4) -> None:
        self.pin, self.keep = pin, keep
        self.free: list[torch.Tensor] = []
        self.made = 0  # buffers allocated (tests, benchmarks)
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        if nbytes < 0:
            raise ValueError(f"HostPool: {nbytes} bytes asked for, expected >= 0")
        with self._lock:
            fits = [k for k, b in enumerate(self.free) if b.numel() >= nbytes]
            if fits:
                return self.free.pop(min(fits, key=lambda k: self.free[k].numel()))
            self.made += 1
        return torch.empty(self.size_for(nbytes), dtype=torch.uint8, pin_memory=self.pin)

    def size_for(self, nbytes: int) -> int:
        """The size of a new buffer for `nbytes`: whole `GRANULE`s, page-locked all of its
        block (`_block`): a buffer of the granule size could not take a save a little larger
        that its block would hold (a conversation saved turn after turn, each save a little
        larger than the last, allocated a new block each time until `keep` buffers were held)."""
        return _block(_aligned(max(nbytes, 1), self.GRANULE), self.pin)

    def give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self.free.append(buffer)
            if len(self.free) > self.keep:
                self.free.pop(min(range(len(self.free)), key=lambda k: self.free[k].numel()))


def _host_copy(p: Packed, pin: bool) -> Packed:
    return Packed(p.codec, p.shape, p.dtype, host_copy(p.payload, pin=pin), host_copy(p.scales, pin=pin))
