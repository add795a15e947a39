"""Reading an entry's values with anchorkv installed: `open_entry(path)["recurrent"][3]`.

Every array of an entry is a standard Zarr v3 array (see `anchorkv.store.format`): a plain
zarr-python or tensorstore script reads the values of raw fields and the codes and scales of
quantized ones. `open_entry` adds the dequantization, so a field reads as its logical values
(float32), exactly what a restore would write into the cache (in the source dtype).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from anchorkv.codec.spec import CodecSpec
from anchorkv.store.format import SCALES_SUFFIX
from anchorkv.store.manifest import ATTR

if TYPE_CHECKING:
    import torch
    import zarr

#: What indexes the leading axes of a field (as numpy and zarr take it).
Index = int | slice | tuple[int | slice, ...]


class FieldValues:
    """One field of an entry; indexing the leading axes (not the last) gives float32 values."""

    def __init__(self, group: zarr.Group, name: str) -> None:
        # the entry's members are arrays and their anchorkv attributes objects (the format's)
        self.codes = cast("zarr.Array", group[name])
        self.meta: dict[str, Any] = dict(cast("dict[str, Any]", self.codes.attrs[ATTR]))
        self.scales = cast("zarr.Array", group[name + SCALES_SUFFIX]) if "scales" in self.meta else None

    @property
    def shape(self) -> tuple[int, ...]:
        if "plugin" in self.meta:
            return (*self.codes.shape[:-1], int(self.meta["row"]["width"]))
        last = self.codes.shape[-1] * (2 if self.meta["codec"] == "int4" else 1)
        return (*self.codes.shape[:-1], last)

    @property
    def attrs(self) -> dict[str, Any]:
        return self.meta

    def __getitem__(self, index: Index) -> np.ndarray:
        import torch

        from anchorkv.codec.packed import dtype_from_name
        from anchorkv.kernels import reference

        index = index if isinstance(index, tuple) else (index,)
        if len(index) >= self.codes.ndim:
            raise IndexError(f"index the leading {self.codes.ndim - 1} axes of {self.meta['field']!r}; "
                             "the last axis is read whole (quantization groups lie along it)")
        codes = np.ascontiguousarray(self.codes[index])
        dtype = dtype_from_name(self.meta["source_dtype"])
        if "plugin" in self.meta:
            return self._plugin_values(index, codes, dtype)
        if self.meta["role"] == "values":
            t = torch.from_numpy(codes.view(np.uint8).copy()).view(dtype)
            return t.reshape(codes.shape).to(torch.float32).numpy()
        if self.scales is None:  # bf16 codes: elementwise, no scales
            out = reference.dequantize(torch.from_numpy(codes.view(np.uint8).reshape(-1).copy()),
                                       torch.empty(0, 0), CodecSpec(self.meta["codec"], None), codes.shape, dtype)
            return out.to(torch.float32).numpy()
        scales = np.ascontiguousarray(self.scales[index], dtype=np.float32)
        shape = (*codes.shape[:-1], self.shape[-1])
        out = reference.dequantize(torch.from_numpy(codes.view(np.uint8).reshape(-1).copy()),
                                   torch.from_numpy(scales.reshape(-1, scales.shape[-1]).copy()),
                                   CodecSpec(self.meta["codec"], self.meta["group"]), shape, dtype)
        return out.to(torch.float32).numpy()


    def _plugin_values(self, index: tuple[int | slice, ...], codes: np.ndarray, dtype: torch.dtype) -> np.ndarray:
        """Values of a field a codec plug-in encoded: decoded by that plug-in (`MissingCodec`,
        one line naming it, when it is not installed)."""
        import torch

        from anchorkv.codec.registry import get_codec
        from anchorkv.codec.spec import CodecSpec
        from anchorkv.store.plugin_format import MissingCodec

        name = self.meta["plugin"]
        try:
            codec = get_codec(name)
        except KeyError as e:
            raise MissingCodec(str(self.meta.get("field")), self.meta.get("field", "?"), name, str(e)) from None
        spec = CodecSpec(name, None, tuple(sorted(dict(self.meta.get("config") or {}).items())))
        shape = (*codes.shape[:-1], int(self.meta["row"]["width"]))
        scales = torch.empty(0, 0)
        if self.scales is not None:
            s = np.ascontiguousarray(self.scales[index], dtype=np.float32)
            scales = torch.from_numpy(s.reshape(-1, s.shape[-1]).copy())
        payload = torch.from_numpy(codes.view(np.uint8).reshape(-1).copy())
        return codec.decode(payload, scales, spec, shape, dtype).to(torch.float32).numpy()


class EntryValues:
    """An entry opened for reading values: ``entry["recurrent"][3]``, ``entry.manifest``."""

    def __init__(self, group: zarr.Group) -> None:
        self.group = group
        self.manifest: dict[str, Any] = dict(cast("dict[str, Any]", group.attrs[ATTR]))  # the manifest

    def fields(self) -> list[str]:
        return sorted(self.manifest["arrays"])

    def __getitem__(self, field: str) -> FieldValues:
        if field not in self.manifest["arrays"]:
            raise KeyError(f"the entry has no field {field!r}; it has {self.fields()}")
        return FieldValues(self.group, field)


def open_entry(path: str | os.PathLike) -> EntryValues:
    """Open `<store>/entries/<entry id>` (a local path) for reading values."""
    import zarr

    return EntryValues(zarr.open_group(os.fspath(path), mode="r"))
