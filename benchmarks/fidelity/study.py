"""The fidelity study: how wrong each codec makes each field, and what the model computes next.

For each field kind (`conv`, `recurrent`, `latent`) and codec, on realistic data:
  * size: bits per value and the ratio to the raw field (scales included);
  * SQNR (dB) and max relative error (`metrics.max_rel_err`) of the round trip;
  * continuation error: restore the round-tripped field, continue for `steps` tokens, and
    compare the outputs with the unquantized continuation (relative L2 error per step, mean and
    max over the steps). KDA fields go through `kda.kda_layer`; the latent through `mla.attend`.
Then `RULE` picks the default codec per field kind.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
import math
import time

import torch

from anchorkv.bench import finite  # noqa: F401  (re-exported: the study's JSON)
from anchorkv.codec import CodecSpec, get_codec

from . import data, kda, mla
from .metrics import max_rel_err, rel_err_per_step, sqnr_db

#: Bounds on the continuation error (relative L2 of the outputs per step after a restore) that
#: a default codec must meet: its mean over the steps, and its worst step (usually the first
#: token after the restore, or for attention the one query whose top logit moves most).
THRESHOLD = 1e-2
MAX_THRESHOLD = 5e-2
RULE = (
    "default = the codec with the fewest stored bytes (scales included) whose continuation "
    f"error after the restore averages under {THRESHOLD:g} over the steps and stays under "
    f"{MAX_THRESHOLD:g} at every step; ties go to the lower error. Only group sizes the store "
    "can hold at every tp are candidates (conv: divisors of its chunk's 512 channels; "
    "recurrent: divisors of 128, judged on the worse of the two state orientations; latent: "
    "divisors of 576)"
)
#: DESIGN.md's size targets (stored bytes / raw bytes) for the default codec.
SIZE_TARGETS = {"latent": 0.52, "recurrent": 0.27}

_Q = ("fp8", "int8", "int4")


def _codecs(groups: tuple[str, ...]) -> tuple[str, ...]:
    return ("raw",) + tuple(f"{q}:{g}" for q in _Q for g in groups)


#: Codecs tried per field: the group sizes the store accepts for the field at every tp
#: (`anchorkv.store.format`: a group must divide the chunk's last axis). conv is sharded along
#: its channels, so a chunk holds 4096 / MAX_TP = 512 of them and "whole" would mean a
#: different group at each tp: 512 stands for the largest group instead. recurrent
#: `[32, 128, 128]` is sharded on heads: its last axis 128 is whole. latent: 576 = 512 + 64,
#: not a multiple of 128.
CODECS = {
    "conv": _codecs(("32", "64", "128", "512")),
    "recurrent": _codecs(("32", "64", "128")),
    "latent": _codecs(("32", "64", "192", "whole")),
}
#: The recurrent state `[H, K, V]` (fla's layout, groups along V) is also studied stored as
#: `[H, V, K]` (groups along K, as vLLM's transposed gated-delta-net state layout holds it);
#: a row reports the worse of the two, so the default holds for either layout.
ORIENTATIONS = ("KV", "VK")
@dataclass(frozen=True)
class StudyConfig:
    kda_heads: int = 32
    head_dim: int = 128
    kda_prefix: int = 4096
    steps: int = 256
    mla_prefix: int = 4096
    mla_heads: int = 16
    synthetic_rows: int = 128
    synthetic_cols: int = 4096
    seed: int = 0

    @classmethod
    def quick(cls) -> "StudyConfig":
        return cls(kda_heads=4, kda_prefix=512, steps=64, mla_prefix=512, mla_heads=4,
                   synthetic_rows=16)

    @classmethod
    def tiny(cls) -> "StudyConfig":
        """For tests: seconds, not minutes."""
        return cls(kda_heads=2, head_dim=32, kda_prefix=64, steps=16, mla_prefix=128,
                   mla_heads=2, synthetic_rows=4, synthetic_cols=576)


def round_trip(x: torch.Tensor, codec: str) -> tuple[torch.Tensor, int]:
    """`x` through `codec`'s encode and decode (the bytes `anchorkv.codec.pack` stores) and the
    stored byte count (payload + scales)."""
    spec = CodecSpec.parse(codec)
    impl = get_codec(spec.id)
    payload, scales = impl.encode(x.contiguous(), spec)
    y = impl.decode(payload, scales, spec, tuple(x.shape), x.dtype)
    return y, payload.numel() + scales.numel() * 4


def _size_row(x: torch.Tensor, y: torch.Tensor, nbytes: int, codec: str) -> dict:
    raw = x.numel() * x.element_size()
    return {
        "codec": codec,
        "bits_per_value": 8.0 * nbytes / x.numel(),
        "size_ratio": nbytes / raw,
        "sqnr_db": sqnr_db(x, y),
        "max_rel_err": max_rel_err(x, y),
    }


def _cont(ref: torch.Tensor, out: torch.Tensor) -> dict:
    e = rel_err_per_step(ref, out)
    return {"cont_err_mean": e.mean().item(), "cont_err_max": e.max().item(),
            "cont_err_first": e[0].item(), "cont_err_last": e[-1].item()}


def _groups_ok(codec: str, last: int) -> bool:
    spec = CodecSpec.parse(codec)
    return spec.id == "raw" or spec.group is None or last % spec.group == 0


# ----------------------------------------------------------------------------- KDA


def study_kda(cfg: StudyConfig, g: torch.Generator) -> dict:
    """Run the prefix, snapshot, round-trip conv or recurrent, continue `cfg.steps` tokens."""
    H, D = cfg.kda_heads, cfg.head_dim
    params = kda.KDAParams.random(H, D, g)
    inp = data.kda_projections(cfg.kda_prefix + cfg.steps, H, D, g)
    pre = {k: v[: cfg.kda_prefix] for k, v in inp.items()}
    cont = {k: v[cfg.kda_prefix:] for k, v in inp.items()}
    _, state = kda.kda_layer(pre["x"], pre["gate_in"], pre["beta_in"], params, kda.empty_state(H, D))

    def continue_from(s: kda.KDAState) -> torch.Tensor:
        """The outputs as the layer's o_proj reads them (per-head RMS-normalized)."""
        out, _ = kda.kda_layer(cont["x"], cont["gate_in"], cont["beta_in"], params, s)
        return kda.head_rms_norm(out)

    raw_out, _ = kda.kda_layer(cont["x"], cont["gate_in"], cont["beta_in"], params, state)
    ref = kda.head_rms_norm(raw_out)

    fields = {}
    for name, x in (("conv", state.conv), ("recurrent", state.recurrent)):
        rows = []
        for codec in CODECS[name]:
            if not _groups_ok(codec, x.shape[-1]):
                continue
            if name == "conv":
                y, nbytes = round_trip(x, codec)
                rows.append({**_size_row(x, y, nbytes, codec),
                             **_cont(ref, continue_from(kda.KDAState(y, state.recurrent)))})
                continue
            per = {}
            for orient in ORIENTATIONS:
                xo = x if orient == "KV" else x.transpose(-1, -2).contiguous()
                yo, nbytes = round_trip(xo, codec)
                y = yo if orient == "KV" else yo.transpose(-1, -2).contiguous()
                per[orient] = {**_size_row(x, y, nbytes, codec),
                               **_cont(ref, continue_from(kda.KDAState(state.conv, y)))}
            worst = max(per.values(), key=lambda r: (r["cont_err_mean"], r["cont_err_max"]))
            rows.append({**worst, "cont_err_max": max(r["cont_err_max"] for r in per.values()),
                         "orientations": {o: {k: v for k, v in r.items() if k != "codec"}
                                          for o, r in per.items()}})
        fields[name] = {"dtype": str(x.dtype).removeprefix("torch."), "shape": list(x.shape),
                        "rows": rows}
    stats = {"state_rms": state.recurrent.pow(2).mean().sqrt().item(),
             "state_absmax": state.recurrent.abs().max().item(),
             "output_rms": raw_out.pow(2).mean().sqrt().item(),
             "gate_min": kda.kda_gate(inp["gate_in"], params).exp().min().item(),
             "gate_max": kda.kda_gate(inp["gate_in"], params).exp().max().item()}
    return {"fields": fields, "stats": stats, "continue_from": continue_from, "state": state,
            "ref": ref}


# ----------------------------------------------------------------------------- MLA


def study_mla(cfg: StudyConfig, g: torch.Generator) -> dict:
    total = cfg.mla_prefix + cfg.steps
    cache, gamma = data.mla_latent(total, g)
    models = {eq: mla.make_queries(cache, gamma, cfg.steps, cfg.mla_heads, g, equalize=eq)
              for eq in (False, True)}
    refs = {eq: mla.attend(cache, q, cfg.mla_prefix) for eq, q in models.items()}
    prefix = cache[: cfg.mla_prefix]
    rows = []
    for codec in CODECS["latent"]:
        y, nbytes = round_trip(prefix, codec)
        restored = torch.cat([y, cache[cfg.mla_prefix:]])
        out = {eq: mla.attend(restored, q, cfg.mla_prefix) for eq, q in models.items()}
        stress = _cont(refs[True], out[True])
        rows.append({**_size_row(prefix, y, nbytes, codec), **_cont(refs[False], out[False]),
                     "stress_cont_err_mean": stress["cont_err_mean"],
                     "stress_cont_err_max": stress["cont_err_max"]})
    return {"fields": {"latent": {"dtype": "bfloat16", "shape": list(prefix.shape), "rows": rows}}}


# ----------------------------------------------------------------------------- rule


def choose_default(rows: list[dict], threshold: float = THRESHOLD,
                   max_threshold: float = MAX_THRESHOLD) -> dict | None:
    """Apply `RULE` to one field's rows: the passing row with the fewest stored bits per value."""
    ok = [r for r in rows if r["cont_err_mean"] <= threshold and r["cont_err_max"] <= max_threshold]
    if not ok:
        return None
    return min(ok, key=lambda r: (round(r["bits_per_value"], 9), r["cont_err_mean"]))


def synthetic_table(cfg: StudyConfig, g: torch.Generator) -> list[dict]:
    """SQNR of every codec on synthetic bf16 data `[rows, cols]` per distribution."""
    out = []
    groups = ("32", "64", "128", "whole")
    for dist, make in data.SYNTHETIC.items():
        x = make((cfg.synthetic_rows, cfg.synthetic_cols), g).to(torch.bfloat16)
        for codec in _codecs(groups):
            if not _groups_ok(codec, x.shape[-1]):
                continue
            y, nbytes = round_trip(x, codec)
            out.append({"distribution": dist, **_size_row(x, y, nbytes, codec)})
    return out


def run_study(cfg: StudyConfig | None = None) -> dict:
    """The whole study as a JSON-serializable dict (see the module docstring)."""
    cfg = cfg or StudyConfig()
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(cfg.seed)
    k = study_kda(cfg, g)
    m = study_mla(cfg, g)
    fields = {**k["fields"], **m["fields"]}
    defaults, targets = {}, {}
    for name, f in fields.items():
        best = choose_default(f["rows"])
        f["default"] = best["codec"] if best else None
        defaults[name] = f["default"]
        if name in SIZE_TARGETS:
            targets[name] = {
                "target": SIZE_TARGETS[name],
                "default_ratio": best["size_ratio"] if best else None,
                "ok": bool(best) and best["size_ratio"] <= SIZE_TARGETS[name],
            }
    combined = None
    if defaults.get("conv") and defaults.get("recurrent"):
        conv, _ = round_trip(k["state"].conv, defaults["conv"])
        rec, _ = round_trip(k["state"].recurrent, defaults["recurrent"])
        combined = {"codecs": {"conv": defaults["conv"], "recurrent": defaults["recurrent"]},
                    **_cont(k["ref"], k["continue_from"](kda.KDAState(conv, rec)))}
    return {
        "config": asdict(cfg),
        "threshold": THRESHOLD,
        "max_threshold": MAX_THRESHOLD,
        "rule": RULE,
        "fields": fields,
        "defaults": defaults,
        "size_targets": targets,
        "kda_defaults_together": combined,
        "kda_stats": k["stats"],
        "synthetic": synthetic_table(cfg, g),
        "runtime_s": time.perf_counter() - t0,
    }
