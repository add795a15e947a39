"""The connector's settings, read from `kv_connector_extra_config` and checked at start-up.

    {"store": "/var/cache/anchorkv",            # path or s3://bucket/prefix
     "codec": {"recurrent": "bf16"},            # or a preset: "exact" (default), "compact", "smallest"
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

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from anchorkv.codec.spec import CodecSpec
from anchorkv.store.settings import DEFAULT_STORE, parse_size

#: Default codec per field kind: `raw` for every field, so a restore is bit-exact and a cache
#: users turn on never changes their model's answers unless they ask for a lossy codec (the
#: fidelity study, `python -m benchmarks.fidelity`, shows where each lossy codec breaks).
#: A field kind not listed here is `raw` too (`ConnectorConfig.codec_for`).
#: Keys are roles (`anchorkv.codec.models.Role`) or field names.
DEFAULT_CODECS: dict[str, str] = {"conv_state": "raw", "ssm_state": "raw", "k": "raw", "v": "raw", "latent": "raw"}

#: Named codec presets, accepted as ``"codec": "<name>"``. Chosen by the rule in
#: `benchmarks.fidelity.presets` over the fidelity study, judged on the worst case across all of
#: its conditions (KDA and Gated DeltaNet layers, slow / medium / fast decay, three input models,
#: both state layouts; MLA latents with and without outlier channels, logit std 1 / 3 / 6, two
#: query models; seeds 0-2; `benchmarks/results/fidelity.md`):
#:   exact    - raw everywhere (the default);
#:   compact  - per field, the fewest bytes whose worst condition keeps the continuation error
#:              under 2e-3 on average and 1e-2 at every step: recurrent bf16 (worst 1.3e-3 /
#:              5.0e-3; 0.73x of a 4096-token Kimi-Linear request);
#:   smallest - the same under 1e-2 / 5e-2: today equal to `compact`, since no 8-bit codec meets
#:              it in the worst case (recurrent fp8/int8 fail with slow forgetting, conv fp8 on
#:              the first steps with outlier inputs, latent fp8 without outlier channels).
#: `tests/test_bench.py` checks these equal the rule's choice on the recorded study.
PRESETS: dict[str, dict[str, str]] = {
    "exact": dict(DEFAULT_CODECS),
    "compact": {**DEFAULT_CODECS, "ssm_state": "bf16"},
    "smallest": {**DEFAULT_CODECS, "ssm_state": "bf16"},
}

#: Kimi-Linear's fields and their roles (what the fidelity study and the benchmarks key by).
KIMI_FIELD_ROLES: dict[str, str] = {"conv": "conv_state", "recurrent": "ssm_state", "latent": "latent"}


def field_codecs(codecs: Mapping[str, Any], field_roles: Mapping[str, str | None],
                 default: Any = "raw") -> dict[str, Any]:
    """`codecs` (keyed by role, field name, or the old names ``conv`` / ``recurrent``) applied
    to fields ``{name: role}``: a field's own name wins, then an old name, then its role;
    `default` otherwise. A key that names a role keys the role even where a field has that
    name too (``k`` sets the full layers' `k` and the sliding layers' `k_window` of a Gemma 3;
    ``k_window`` sets the latter alone). The one rule the store (`storage_zarr.wanted_codecs`)
    and the benchmarks share."""
    from anchorkv.codec.models import ROLE_ALIASES, Role

    roles = {r.value for r in Role}
    by_role = {k: v for k, v in codecs.items() if (k not in field_roles or k in roles) and k not in ROLE_ALIASES}
    # an alias is only ever written by a user (the defaults and presets use roles): it wins
    by_role.update({ROLE_ALIASES[k].value: v for k, v in codecs.items() if k in ROLE_ALIASES and k not in field_roles})
    out = {}
    for name, role in field_roles.items():
        if name in codecs:
            out[name] = codecs[name]
        elif role in by_role:
            out[name] = by_role[role]
        else:
            out[name] = default
    return out


SAVE_POINTS = ("prefill", "finish")
DEFAULT_SAVE_BACKLOG = 4 << 30  # 4 GiB: four 100k-token Kimi-Linear saves (raw) waiting for the store
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
    #: host memory (bytes) that saves queued for the store may hold, per worker rank: a save
    #: that finds the queued ones holding this much is dropped (`save_dropped`), so a store
    #: slower than the engine's saves cannot use up (page-locked) host memory; one always goes
    save_backlog: int = DEFAULT_SAVE_BACKLOG
    #: a name for the model's weights, keyed with their content (`connector.weights`): entries
    #: restore only under the same name. None: no name where the weight files can be read (the
    #: content names them), else vLLM's `model` as given and its `revision`
    #: (`connector.model_id_of`): set it where weights are streamed or generated.
    model_id: str | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        if extra is not None and not isinstance(extra, Mapping):
            raise ValueError(f"anchorkv: kv_connector_extra_config must be an object of keys (e.g. "
                             f"{{\"store\": \"/var/cache/anchorkv\"}}), found {type(extra).__name__} {extra!r}")
        extra = dict(extra or {})
        known = set(cls.__dataclass_fields__)
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
            if not isinstance(points, (list, tuple)) or [p for p in points if p not in SAVE_POINTS]:
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
            if isinstance(t, bool) or not isinstance(t, (int, float)) or math.isnan(t) or t <= 0:
                raise ValueError(f"anchorkv: 'load_timeout_s' must be a positive number of seconds (Infinity: "
                                 f"never), found {t!r}")
            kwargs["load_timeout_s"] = float(t)
        if "save_backlog" in extra:
            kwargs["save_backlog"] = parse_size(extra["save_backlog"], "anchorkv: 'save_backlog'")
        if "model_id" in extra:
            if not isinstance(extra["model_id"], str) or not extra["model_id"].strip():
                raise ValueError(f"anchorkv: 'model_id' must be a non-empty string naming the model's weights "
                                 f"(e.g. \"Kimi-Linear-48B-A3B-Instruct@v1\"), found {extra['model_id']!r}")
            kwargs["model_id"] = extra["model_id"].strip()
        if "storage_options" in extra:
            if not isinstance(extra["storage_options"], dict):
                raise ValueError("anchorkv: 'storage_options' must be an object of S3 options (e.g. "
                                 f"{{\"endpoint\": \"http://127.0.0.1:9000\"}}), found {extra['storage_options']!r}")
            kwargs["storage_options"] = dict(extra["storage_options"])
        return cls(**kwargs)

    def codec_for(self, field_name: str) -> CodecSpec:
        """The codec of a field kind; raw (exact) for kinds the config does not name."""
        return self.codec.get(field_name, _EXACT)


#: The codec of field kinds a config does not name (one object: the save path asks per field
#: every step, and a spec checks its options when it is built).
_EXACT = CodecSpec("raw", None)


def _parse_codecs(value: Any) -> dict[str, CodecSpec]:
    """A preset name, or a map of field kinds to codecs over the exact (raw) defaults.

    A codec is a string (``"int8:64"``, a plug-in's ``"lowrank:projection_file=/p.npy"``) or
    a dict (``{"id": "lowrank", "projection_file": "/p.npy"}``: every key but ``id`` and
    ``group`` is a plug-in option). Whether a plug-in is installed and accepts its options is
    checked when the store resolves the codecs (`storage_zarr.resolve_codecs`), at start-up.
    """
    if isinstance(value, str) and value.strip() in PRESETS:
        return {k: CodecSpec.parse(v) for k, v in PRESETS[value.strip()].items()}
    if not isinstance(value, dict):
        raise ValueError(
            f"anchorkv: 'codec' must be a preset name ({', '.join(repr(p) for p in PRESETS)}) or map "
            f"field kinds to codecs, e.g. {{\"recurrent\": \"bf16\"}} or, for a codec plug-in, "
            f"{{\"latent\": {{\"id\": \"lowrank\", \"projection_file\": \"/p.npy\"}}}}; found {value!r}"
        )
    out = {k: CodecSpec.parse(v) for k, v in DEFAULT_CODECS.items()}
    for kind, spec in value.items():
        try:
            out[kind] = CodecSpec.parse(spec)
        except (ValueError, TypeError) as e:
            raise ValueError(f"anchorkv: codec for field {kind!r}: {e}") from None
    return out


def lossy_codecs(codecs: Mapping[str, CodecSpec]) -> dict[str, str]:
    """The fields whose codec is not bit-exact, as ``{field: "fp8:128"}``.

    Only `raw` is known to be exact; every other codec (bf16, the quantizers, any plug-in that
    does not say ``lossless = True``) counts as lossy.
    """
    from anchorkv.codec import get_codec

    out = {}
    for name, spec in codecs.items():
        if spec.id == "raw":
            continue
        try:
            lossless = bool(getattr(get_codec(spec.id), "lossless", False))
        except KeyError:
            lossless = False
        if not lossless:
            out[name] = _show(spec)
    return out


def _show(spec: CodecSpec) -> str:
    """A spec as users write it: elementwise formats (raw, bf16) have no group to show."""
    return spec.id if spec.id in ("raw", "bf16") else str(spec)


def codec_banner(codecs: Mapping[str, CodecSpec]) -> tuple[int, str]:
    """(logging level, message) announcing the codecs in effect: INFO when every field is
    restored exactly, WARNING naming the lossy fields otherwise."""
    import logging

    shown = {k: _show(v) for k, v in codecs.items()}
    lossy = lossy_codecs(codecs)
    if not lossy:
        return logging.INFO, f"anchorkv: codecs {shown}: every field is restored bit-exact"
    return logging.WARNING, (
        f"anchorkv: LOSSY codecs in effect for {sorted(lossy)} ({lossy}): restored state is "
        f"approximate and may change the model's outputs after a restore; codecs {shown}. "
        "Use \"codec\": \"exact\" (the default) for bit-exact restores; see the README's fidelity "
        "table for where each lossy preset fails")
