"""The public pack/unpack API, the layout model, codec specs and the codec registry."""

from anchorkv.codec.api import HostArena, HostPool, PackedParts, Packer, Unpacker, pack, pack_many, unpack, unpack_many
from anchorkv.codec.layout import CacheView, Field, PageLayout, Region, dense_strides
from anchorkv.codec.models import (
    KIMI_LINEAR_48B_CONFIG,
    ConvLayout,
    LayerKind,
    LayerLayout,
    ModelLayout,
    custom_layout,
    kimi_linear_layout,
)
from anchorkv.codec.packed import Packed
from anchorkv.codec.registry import Codec, EncodedRow, available_codecs, get_codec, register_codec
from anchorkv.codec.spec import CodecSpec
from anchorkv.kernels.quant import Quant

__all__ = [
    "CacheView", "Codec", "CodecSpec", "ConvLayout", "EncodedRow", "Field", "HostArena", "HostPool",
    "KIMI_LINEAR_48B_CONFIG",
    "LayerKind", "LayerLayout", "ModelLayout", "Packed", "PackedParts", "Packer", "PageLayout", "Quant", "Region",
    "Unpacker", "available_codecs", "custom_layout", "dense_strides", "get_codec", "kimi_linear_layout",
    "pack", "pack_many", "register_codec", "unpack", "unpack_many",
]
