"""The fidelity study: how wrong each codec makes each field, and what the model computes next,
across the conditions where codecs break.

Conditions (every one run for every seed in `StudyConfig.seeds`):
  * linear-attention layers (`conv`, `recurrent` fields): layer kind (KDA: per-channel decay;
    Gated DeltaNet: one decay per head) x decay regime (`DECAYS`: the median forget-gate value
    over the prefix, slow 0.99 / medium 0.93 / fast 0.54) x input model (`data.LAYER_INPUTS`);
    `recurrent` also x the state's layout (`ORIENTATIONS`: groups along V or along K);
  * MLA latent (`latent`): input model (`data.LATENT_INPUTS`, two of them without outlier
    channels) x attention sharpness (`LOGIT_STDS`: logit standard deviation 1 / 3 / 6) x query
    model (`mla.QUERY_MODELS`: isotropic, and the equalized stress model).

Per (field, codec, condition, seed): stored size, SQNR and max relative error of the round trip,
and the continuation error: restore the round-tripped field, continue `steps` tokens, and
compare the outputs with the exact continuation (relative L2 error per step): first step, mean,
worst step. The continuation of every codec runs at once (the batch axis of fla's recurrence).
The named presets shipped in `anchorkv.connector.config.PRESETS` are also restored together
(conv + recurrent) in every condition. `presets.choose_presets` then applies the rule.
"""

from __future__ import annotations

import multiprocessing
import time
import zlib
from dataclasses import asdict, dataclass

import torch

from anchorkv.codec import CodecSpec, get_codec
from anchorkv.testing.metrics import sqnr_db

from . import data, fla_ref, layers, mla
from .metrics import max_rel_err, rel_err_per_step

#: Median forget-gate value a = exp(g) over the prefix, per decay regime.
DECAYS = {"slow": 0.99, "medium": 0.93, "fast": 0.54}
#: Standard deviation of a query's attention logits over the prefix (sharpness).
LOGIT_STDS = (1.0, 3.0, 6.0)
#: The recurrent state `[H, K, V]` stored as is (groups along V, fla's layout) and transposed
#: `[H, V, K]` (groups along K, vLLM's gated-delta-net state layout).
ORIENTATIONS = ("KV", "VK")
_Q = ("fp8", "int8", "int4")


def _codecs(groups: tuple[str, ...], extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    return ("raw",) + extra + tuple(f"{q}:{g}" for q in _Q for g in groups)


#: Codecs tried per field: the group sizes the store accepts for the field at every tp (a group
#: must divide the chunk's last axis). conv is sharded along its channels, so a chunk holds
#: 4096 / 8 = 512 of them ("whole" would mean a different group at each tp: 512 stands for the
#: largest group). recurrent `[H, 128, 128]` is sharded on heads: its last axis 128 is whole;
#: it is fp32, so `bf16` is a candidate too. latent: 576 = 512 + 64, not a multiple of 128.
CODECS = {
    "conv": _codecs(("32", "64", "128", "512")),
    "recurrent": _codecs(("32", "64", "128"), ("bf16",)),
    "latent": _codecs(("32", "64", "192", "whole")),
}


@dataclass(frozen=True)
class StudyConfig:
    heads: int = 4
    head_dim: int = 128
    prefix: int = 1024
    steps: int = 64
    mla_prefix: int = 2048
    mla_heads: int = 8
    mla_queries: int = 64
    seeds: tuple[int, ...] = (0, 1, 2)
    kinds: tuple[str, ...] = layers.KINDS
    jobs: int = 2

    @classmethod
    def quick(cls) -> StudyConfig:
        """CI's smoke run: every condition, one seed, small sizes (tens of seconds)."""
        return cls(heads=2, prefix=256, steps=32, mla_prefix=512, mla_heads=4, mla_queries=32, seeds=(0,))

    @classmethod
    def tiny(cls) -> StudyConfig:
        """For tests: seconds."""
        return cls(heads=1, head_dim=32, prefix=24, steps=6, mla_prefix=40, mla_heads=1,
                   mla_queries=6, seeds=(0,), jobs=1)


def round_trip(x: torch.Tensor, codec: str) -> tuple[torch.Tensor, int]:
    """`x` through `codec`'s encode and decode (the bytes `anchorkv.codec.pack` stores) and the
    stored byte count (payload + scales)."""
    spec = CodecSpec.parse(codec)
    impl = get_codec(spec.id)
    payload, scales = impl.encode(x.contiguous(), spec)
    y = impl.decode(payload, scales, spec, tuple(x.shape), x.dtype)
    return y, payload.numel() + scales.numel() * 4


def _groups_ok(codec: str, last: int) -> bool:
    spec = CodecSpec.parse(codec)
    return spec.id in ("raw", "bf16") or spec.group is None or last % spec.group == 0


def _size(x: torch.Tensor, y: torch.Tensor, nbytes: int) -> dict:
    return {"bits_per_value": 8.0 * nbytes / x.numel(), "size_ratio": nbytes / (x.numel() * x.element_size()),
            "sqnr_db": sqnr_db(x, y), "max_rel_err": max_rel_err(x, y)}


def _cont(ref: torch.Tensor, out: torch.Tensor) -> dict:
    e = rel_err_per_step(ref, out)
    return {"cont_err_first": e[0].item(), "cont_err_mean": e.mean().item(), "cont_err_max": e.max().item()}


def _generator(*key) -> torch.Generator:
    """A generator per condition, seeded from its name: conditions are independent and each one
    reproduces alone (also in a worker process, in any order)."""
    return torch.Generator().manual_seed(zlib.crc32("/".join(map(str, key)).encode()))


# ----------------------------------------------------------------------------- linear attention


def layer_condition(cfg: StudyConfig, kind: str, decay: str, inputs: str, seed: int,
                    presets: dict[str, dict[str, str]]) -> dict:
    """One (layer kind, decay regime, input model, seed): every codec's continuation error.

    The data and weights depend on (kind, inputs, seed) only; the decay regime rescales A_log
    (`LayerParams.calibrate`), so the regimes differ in forgetting alone.
    """
    torch.set_num_threads(1)  # many small sequential ops: threads only contend (see the README)
    H, D = cfg.heads, cfg.head_dim
    g = _generator(kind, inputs, seed)
    params = layers.LayerParams.random(kind, H, D, g)
    inp = data.layer_inputs(inputs, cfg.prefix + cfg.steps, H, D, kind, g)
    params = params.calibrate(inp["gate_in"][: cfg.prefix], DECAYS[decay])
    pre = {k: v[: cfg.prefix] for k, v in inp.items()}
    cont = {k: v[cfg.prefix:] for k, v in inp.items()}
    has_conv = "x" in inp
    _, state = layers.run(params, pre, layers.empty_state(H, D, conv=has_conv))
    conv, rec = (state.conv[0] if has_conv else None), state.recurrent[0]

    variants = [("exact", None, None, conv, rec, None)]  # (field, codec, orientation, conv, rec, size)
    if has_conv:
        for codec in CODECS["conv"]:
            if _groups_ok(codec, conv.shape[-1]):
                y, nbytes = round_trip(conv, codec)
                variants.append(("conv", codec, None, y, rec, _size(conv, y, nbytes)))
    for codec in CODECS["recurrent"]:
        if not _groups_ok(codec, rec.shape[-1]):
            continue
        elementwise = CodecSpec.parse(codec).id in ("raw", "bf16")
        for orient in ORIENTATIONS[:1] if elementwise else ORIENTATIONS:
            xo = rec if orient == "KV" else rec.transpose(-1, -2).contiguous()
            yo, nbytes = round_trip(xo, codec)
            y = yo if orient == "KV" else yo.transpose(-1, -2).contiguous()
            variants.append(("recurrent", codec, orient, conv, y, _size(rec, y, nbytes)))
    for name, codecs in presets.items():
        c = round_trip(conv, codecs["conv"])[0] if has_conv and _groups_ok(codecs["conv"], conv.shape[-1]) else conv
        r = round_trip(rec, codecs["recurrent"])[0] if _groups_ok(codecs["recurrent"], rec.shape[-1]) else rec
        variants.append(("preset", name, None, c, r, None))

    batch = layers.LayerState(
        torch.stack([v[3] for v in variants]) if has_conv else None, torch.stack([v[4] for v in variants]))
    out, _ = layers.run(params, cont, batch)
    out = layers.head_rms_norm(out)
    cond = {"kind": kind, "decay": decay, "inputs": inputs, "seed": seed}
    rows = []
    for i, (fname, codec, orient, *_rest, size) in enumerate(variants[1:], start=1):
        rows.append({**cond, "field": fname, "codec": codec, "orientation": orient, **(size or {}),
                     **_cont(out[0], out[i])})
    a = layers.gate(inp["gate_in"][: cfg.prefix], params).exp()
    stats = {**cond, "median_decay": a.median().item(), "decay_p10": a.quantile(0.1).item(),
             "decay_p90": a.quantile(0.9).item(), "state_rms": rec.pow(2).mean().sqrt().item(),
             "state_absmax": rec.abs().max().item(),
             "bf16_output_noise": rel_err_per_step(out[0], out[0].to(torch.bfloat16)).mean().item()}
    return {"rows": rows, "stats": stats}


# ----------------------------------------------------------------------------- MLA


def latent_condition(cfg: StudyConfig, inputs: str, seed: int) -> dict:
    """One (input model, seed) of the MLA latent: every codec x logit std x query model."""
    torch.set_num_threads(1)
    g = _generator("mla", inputs, seed)
    total = cfg.mla_prefix + cfg.mla_queries
    cache, gamma = data.mla_latent(total, g, model=inputs)
    prefix = cache[: cfg.mla_prefix]
    queries = {(std, qm): mla.make_queries(cache, gamma, cfg.mla_queries, cfg.mla_heads, g,
                                           logit_std=std, equalize=qm == "equalized")
               for std in LOGIT_STDS for qm in mla.QUERY_MODELS}
    refs = {key: mla.attend(cache, q, cfg.mla_prefix) for key, q in queries.items()}
    rows = []
    for codec in CODECS["latent"]:
        if not _groups_ok(codec, prefix.shape[-1]):
            continue
        y, nbytes = round_trip(prefix, codec)
        size = _size(prefix, y, nbytes)
        restored = torch.cat([y, cache[cfg.mla_prefix:]])
        for (std, qm), q in queries.items():
            rows.append({"kind": "mla", "inputs": inputs, "logit_std": std, "queries": qm, "seed": seed,
                         "field": "latent", "codec": codec, "orientation": None, **size,
                         **_cont(refs[(std, qm)], mla.attend(restored, q, cfg.mla_prefix))})
    return {"rows": rows, "stats": {"kind": "mla", "inputs": inputs, "seed": seed,
                                    "latent_rms": prefix[:, :512].float().pow(2).mean().sqrt().item(),
                                    "latent_absmax": prefix[:, :512].float().abs().max().item(),
                                    "bf16_output_noise": rel_err_per_step(
                                        refs[(3.0, "isotropic")],
                                        refs[(3.0, "isotropic")].to(torch.bfloat16)).mean().item()}}


# ----------------------------------------------------------------------------- driver


def _run_one(job):
    fn, args = job
    return fn(*args)


def _jobs(cfg: StudyConfig, presets: dict) -> list:
    jobs = [(latent_condition, (cfg, inputs, seed)) for inputs in data.LATENT_INPUTS for seed in cfg.seeds]
    jobs += [(layer_condition, (cfg, kind, decay, inputs, seed, presets))
             for kind in cfg.kinds for decay in DECAYS for inputs in data.LAYER_INPUTS for seed in cfg.seeds]
    return jobs


def shipped_presets() -> dict[str, dict[str, str]]:
    """The lossy presets of `anchorkv.connector.config.PRESETS`."""
    from anchorkv.connector.config import KIMI_FIELD_ROLES, PRESETS, field_codecs

    presets = {name: field_codecs(p, KIMI_FIELD_ROLES) for name, p in PRESETS.items()}  # roles -> fields
    return {name: p for name, p in presets.items() if any(v != "raw" for v in p.values())}


def preset_groups(presets: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """Presets with the same codecs under one label (``compact = smallest``): each distinct
    setting is restored once per condition."""
    out: dict[str, dict[str, str]] = {}
    for name, codecs in presets.items():
        same = next((label for label, c in out.items() if c == codecs), None)
        if same is None:
            out[name] = dict(codecs)
        else:
            out[f"{same} = {name}"] = out.pop(same)
    return out


def run_study(cfg: StudyConfig | None = None) -> dict:
    """The whole study as a JSON-serializable dict (see the module docstring)."""
    from . import presets as presets_mod
    from . import report

    cfg = cfg or StudyConfig()
    t0 = time.perf_counter()
    shipped = shipped_presets()
    groups = preset_groups(shipped)
    jobs = _jobs(cfg, groups)
    if cfg.jobs > 1:
        with multiprocessing.get_context("spawn").Pool(cfg.jobs) as pool:
            results = pool.map(_run_one, jobs, chunksize=1)
    else:
        threads = torch.get_num_threads()
        results = [_run_one(j) for j in jobs]
        torch.set_num_threads(threads)
    rows = [r for res in results for r in res["rows"]]
    stats = [res["stats"] for res in results]
    res = {
        "config": asdict(cfg),
        "fla_core": fla_ref.version(),
        "decays": DECAYS, "logit_stds": list(LOGIT_STDS), "orientations": list(ORIENTATIONS),
        "layer_inputs": list(data.LAYER_INPUTS), "latent_inputs": list(data.LATENT_INPUTS),
        "query_models": list(mla.QUERY_MODELS),
        "rows": rows, "stats": stats, "shipped_presets": shipped, "preset_groups": groups,
    }
    res.update(presets_mod.analyse(res))
    res["runtime_s"] = time.perf_counter() - t0
    res["markdown"] = report.render(res)
    return res
