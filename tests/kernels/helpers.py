"""Regions, fields and byte comparisons shared by the kernel tests."""

from __future__ import annotations

import torch

from anchorkv.kernels import PackItem, UnpackItem
from anchorkv.kernels.strided import StridedField, field_view

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CODECS = ("raw", "fp8", "int8", "int4")
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}



_CFG_NAMES = ("TILES", "GROUPS", "GPR", "S1", "S2", "T0", "T1", "T2", "TD", "NUMEL", "FMT", "KIND", "G",
              "BLOCK_R", "BLOCK_G", "CONTIG", "ALIGN", "FLAT", "IO_ALIGN", "PAY_W")


def split_set_launch(grid, kwargs: dict, op: str) -> list[tuple[tuple[int, int, int], dict]]:
    """The launches a set kernel's call (`_pack_set_kernel` / `_unpack_set_kernel`: its grid and
    keyword arguments, recorded, with per-launch values `START_k`, `N_k`, ...) runs, each as
    (grid, keyword arguments) of the per-signature kernel (`_pack_kernel` / `_unpack_kernel`)
    that would run it alone: its table cut from the whole one, its payload viewed as its
    elements. Checks that the launches' programs tile the set kernel's grid in order."""
    out = []
    at = 0
    launches = kwargs["K"]
    for k, cfg in enumerate(kwargs["CFG"]):
        start, n, rcp, tab0 = (kwargs[f"{name}_{k}"] for name in ("START", "N", "RCP", "TAB"))
        end = kwargs[f"START_{k + 1}"] if k + 1 < launches else grid[0]
        tab_w = (2 if op == "pack" else 4) + n
        extra = (kwargs[f"PAY_{k}"], kwargs[f"SC_{k}"]) if op == "pack" else ()
        c = dict(zip(_CFG_NAMES, cfg, strict=True))
        assert start == at and (end - start) % (c["TILES"] * n) == 0, (at, start, end, n)
        assert rcp == float(torch.tensor(1.0) / torch.tensor(float(n))), (n, rcp)  # RN(1/n) in fp32
        count = (end - start) // (c["TILES"] * n)
        at = end
        kw = {k: c[k] for k in _CFG_NAMES[1:] if k not in ("KIND", "IO_ALIGN", "PAY_W", "TILES")}
        kw.update(N=n, TAB_W=tab_w, tab=kwargs["tab"][tab0:tab0 + count * tab_w], scales=kwargs["scales"],
                  payload=kwargs["payload"].view(_INT_OF_SIZE[c["PAY_W"]]), HW_FP8=kwargs["HW_FP8"])
        if op == "pack":
            kw.update(src=kwargs["srcs"][len(out)], SRC=c["KIND"], OUT_ALIGN=c["IO_ALIGN"], PAY0=extra[0],
                      SC0=extra[1], RECIP=kwargs["RECIP"])
        else:
            kw.update(dst=kwargs["dsts"][len(out)], DST=c["KIND"], IN_ALIGN=c["IO_ALIGN"])
        out.append(((c["TILES"], n, count), kw))
    assert (at,) == tuple(grid[:1]) and all(g == 1 for g in grid[1:]), (at, grid)
    assert launches == len(out) == len(kwargs["srcs" if op == "pack" else "dsts"])
    return out


def triton_pack(item: PackItem) -> tuple[torch.Tensor, torch.Tensor]:
    """One item through the Triton backend whatever the device (the interpreter on CPU)."""
    from anchorkv.kernels.triton_pack import pack_many

    return pack_many([item])[0]


def triton_unpack(item: UnpackItem) -> None:
    from anchorkv.kernels.triton_unpack import unpack_many

    unpack_many([item])


def make_field(dtype, shape, strides, *, offset_elems=3, pad_bytes=40) -> StridedField:
    """A field at an odd element offset in a page padded by `pad_bytes` (kept 8-aligned)."""
    size = dtype.itemsize
    extent = (sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1) * size
    offset = offset_elems * size
    block_stride = offset + extent + pad_bytes
    block_stride += (-block_stride) % 8
    return StridedField(dtype, tuple(shape), tuple(strides), offset, block_stride)


def make_region(field: StridedField, num_blocks: int, *, seed: int = 0, scale: float = 3.0,
                tail: int = 24) -> torch.Tensor:
    """Random canary bytes with finite random values written into every block's field.

    The region starts 8 bytes into its storage, so storage offsets are exercised too.
    """
    g = torch.Generator().manual_seed(seed)
    storage = torch.randint(0, 256, (8 + num_blocks * field.block_stride + tail,),
                            dtype=torch.uint8, generator=g)
    buffer = storage[8:]
    view = field_view(buffer, field, num_blocks)
    view.copy_((torch.randn(view.shape, generator=g) * scale).to(field.dtype))
    return storage.to(DEVICE)[8:]


def touched(buffer: torch.Tensor, field: StridedField, num_blocks: int, ids) -> torch.Tensor:
    """Bool mask over `buffer`'s bytes: those of `field` in blocks `ids`."""
    marker = torch.zeros_like(buffer)
    as_int = StridedField(_INT_OF_SIZE[field.itemsize], field.shape, field.strides, field.offset,
                          field.block_stride)
    field_view(marker, as_int, num_blocks)[torch.as_tensor(ids, device=buffer.device)] = -1 \
        if field.itemsize > 1 else 255
    return marker != 0


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and bytes (NaNs compare by their bits)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ai = a.contiguous().reshape(-1).view(torch.uint8)
    bi = b.contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(ai.cpu(), bi.cpu())
