"""The connector's settings, read from `kv_connector_extra_config` and checked at start-up.

    {"store": "/var/cache/anchorkv",            # path or s3://bucket/prefix
     "codec": {"latent": "fp8:64", "recurrent": "int8", "conv": "raw"},
     "lookup": "exact",                          # or "semantic" (opt-in, lossy by nature)
     "save_points": ["prefill", "finish"],
     "capacity": "200GB",                        # LRU-evicted bound; null = unbounded
     "async_load": true,
     "load_timeout_s": 30,
     "storage_options": {...}}                   # passed to the S3 backend

Unknown keys and bad values are refused with a message naming the key, what was expected
and what was found, before vLLM allocates anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import os
from typing import Any, Mapping

from anchorkv.codec.spec import CodecSpec
from anchorkv.store.settings import DEFAULT_STORE, parse_size

#: Default codec per field kind, chosen by the fidelity study's rule (`benchmarks/fidelity`,
#: `python -m benchmarks.fidelity`, seed 0): the fewest stored bytes whose continuation error
#: after a restore (relative L2 of the next 256 outputs vs the unquantized run) averages under
#: 1e-2 and stays under 5e-2 at every step. Measured: conv fp8:512 mean 1.5e-3 / worst 4.0e-2
#: (0.504x of bf16); recurrent fp8:128 4.0e-3 / 3.3e-2 (0.258x of fp32); latent fp8:whole
#: 6.3e-3 / 2.0e-2 (0.504x of bf16). conv is sharded along its channels, so its group must
#: divide the store chunk's 512 channels ("whole" would change with tp); 576 = latent width.
DEFAULT_CODECS: dict[str, str] = {"conv": "fp8:512", "recurrent": "fp8:128", "latent": "fp8:whole"}

SAVE_POINTS = ("prefill", "finish")
LOOKUP_MODES = ("exact", "semantic")


@dataclass(frozen=True)
class ConnectorConfig:
    store: str = DEFAULT_STORE
    codec: Mapping[str, CodecSpec] = field(default_factory=lambda: {
        k: CodecSpec.parse(v) for k, v in DEFAULT_CODECS.items()})
    lookup: str = "exact"
    save_points: tuple[str, ...] = SAVE_POINTS
    capacity: int | None = None
    async_load: bool = True
    load_timeout_s: float = 30.0
    storage_options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> "ConnectorConfig":
        extra = dict(extra or {})
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"anchorkv: unknown kv_connector_extra_config key(s) {unknown}; "
                f"known keys are {sorted(known)}"
            )
        kwargs: dict[str, Any] = {}
        if "store" in extra:
            if not isinstance(extra["store"], str) or not extra["store"].strip():
                raise ValueError(f"anchorkv: 'store' must be a path or s3:// URL, found {extra['store']!r}")
            kwargs["store"] = os.path.expanduser(extra["store"].strip())
        if "codec" in extra:
            kwargs["codec"] = _parse_codecs(extra["codec"])
        if "lookup" in extra:
            if extra["lookup"] not in LOOKUP_MODES:
                raise ValueError(f"anchorkv: 'lookup' must be one of {LOOKUP_MODES}, found {extra['lookup']!r}")
            kwargs["lookup"] = extra["lookup"]
        if "save_points" in extra:
            points = extra["save_points"]
            if isinstance(points, str):
                points = [points]
            bad = [p for p in points if p not in SAVE_POINTS]
            if bad or not isinstance(points, (list, tuple)):
                raise ValueError(
                    f"anchorkv: 'save_points' must be a list drawn from {SAVE_POINTS}, found {extra['save_points']!r}"
                )
            kwargs["save_points"] = tuple(points)
        if "capacity" in extra:
            kwargs["capacity"] = parse_size(extra["capacity"], "anchorkv: 'capacity'")
        if "async_load" in extra:
            if not isinstance(extra["async_load"], bool):
                raise ValueError(f"anchorkv: 'async_load' must be true or false, found {extra['async_load']!r}")
            kwargs["async_load"] = extra["async_load"]
        if "load_timeout_s" in extra:
            t = extra["load_timeout_s"]
            if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
                raise ValueError(f"anchorkv: 'load_timeout_s' must be a positive number, found {t!r}")
            kwargs["load_timeout_s"] = float(t)
        if "storage_options" in extra:
            if not isinstance(extra["storage_options"], dict):
                raise ValueError("anchorkv: 'storage_options' must be an object")
            kwargs["storage_options"] = dict(extra["storage_options"])
        return cls(**kwargs)

    def codec_for(self, field_name: str) -> CodecSpec:
        return self.codec.get(field_name, CodecSpec("raw", None))


def _parse_codecs(value: Any) -> dict[str, CodecSpec]:
    if not isinstance(value, dict):
        raise ValueError(
            f"anchorkv: 'codec' must map field kinds to codecs, e.g. {{\"latent\": \"fp8:64\"}}, found {value!r}"
        )
    out = {k: CodecSpec.parse(v) for k, v in DEFAULT_CODECS.items()}
    for kind, spec in value.items():
        try:
            out[kind] = CodecSpec.parse(spec)
        except (ValueError, TypeError) as e:
            raise ValueError(f"anchorkv: codec for field {kind!r}: {e}") from None
    return out
