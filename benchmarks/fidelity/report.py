"""The study as markdown: every row the study computed is in it (the JSON adds nothing but
machine-readable copies and per-condition statistics, which are here too)."""

from __future__ import annotations

import math
from collections import defaultdict

from benchmarks.reporting import table

from .presets import FIELDS, LEVELS, condition

_LEVEL_TEXT = {
    "exact": "exact",
    "compact": "near-exact (within 2e-3 / 1e-2)",
    "smallest": "within the rule's 1e-2 / 5e-2, not near-exact",
    "fails": "**FAILS** (over 1e-2 mean or 5e-2 step)",
}


def _num(x, spec: str = ".2e") -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return "exact" if x == "inf" else x
    if isinstance(x, float) and math.isinf(x):
        return "exact" if x > 0 else "-inf"
    return format(x, spec)


def _seeds(values) -> str:
    return " / ".join(_num(v) for v in values)


def render(res: dict) -> list[str]:
    c = res["config"]
    seeds = ", ".join(map(str, c["seeds"]))
    lines = [
        "## Fidelity", "",
        f"Study: `python -m benchmarks.fidelity` ({res.get('runtime_s', 0):.0f} s), seeds {seeds}; "
        f"fla-core {res['fla_core']} (`naive_recurrent_kda`, `naive_recurrent_gated_delta_rule`) as "
        f"the recurrence. Linear-attention layers: {c['heads']} heads x {c['head_dim']} x "
        f"{c['head_dim']}, {c['prefix']}-token prefix, {c['steps']} steps continued, outputs per-head "
        f"RMS-normalized (what o_proj reads); MLA: {c['mla_heads']} heads, {c['mla_prefix']}-token "
        f"prefix, {c['mla_queries']} queries. Continuation error = relative L2 error per step of "
        "the outputs after restoring the round-tripped field vs the exact continuation: first "
        "step, mean over the steps, worst step.", "",
        "Conditions: layer kinds " + ", ".join(c["kinds"]) + "; decay regimes "
        + ", ".join(f"{k} (median decay {v:g})" for k, v in res["decays"].items())
        + "; layer input models " + ", ".join(res["layer_inputs"])
        + " (gaussian: q/k/v straight into the recurrence, so no conv state); recurrent state "
        "layouts " + ", ".join(res["orientations"]) + " (groups along V / along K); latent input "
        "models " + ", ".join(res["latent_inputs"]) + " (only `outliers` has outlier channels); "
        "logit std " + ", ".join(f"{s:g}" for s in res["logit_stds"]) + "; query models "
        + ", ".join(res["query_models"]) + " (equalized: every latent channel weighs alike once "
        "the norm weight is undone, the stress case).", "",
        f"**Rule:** {res['rule']}.", "",
        "### Presets", "",
    ]
    summary = res["summary"]
    size = {f: {r["codec"]: r for r in summary[f]} for f in FIELDS}
    rows = []
    for name, p in res["presets"].items():
        cells = [f"`{name}`"]
        for f in FIELDS:
            r = size[f].get(p[f])
            cells.append(f"{p[f]} ({_num(r['size_ratio'], '.3f')}x; {_num(r['cont_err_mean'])} / "
                         f"{_num(r['cont_err_max'])})" if r and p[f] != "raw" else "raw (exact)")
        rows.append(cells)
    lines += table(["preset", "conv: codec (size vs raw; worst mean / worst step)", "recurrent", "latent"], rows)
    shipped = res.get("shipped_presets") or {}
    lines += ["", ("The shipped presets (`anchorkv.connector.config.PRESETS`) are these."
                   if res.get("presets_match_shipped") else
                   "**The shipped presets differ from the rule's choice in this run**: shipped "
                   + ", ".join(f"`{n}` = {p}" for n, p in shipped.items())
                   + " (a quick run's smaller sizes can disagree with the full run that set them)."), ""]

    lines += ["### Each lossy preset in each condition", "",
              "Shipped presets; linear-attention layers with conv and recurrent restored together, "
              "the latent alone. Values per seed (" + seeds + "). Verdict from the worst seed: "
              + "; ".join(f"{_LEVEL_TEXT[k]}" for k in ("compact", "smallest", "fails")) + ".", ""]
    rows = [[f"`{e['preset']}`", e["fields"], e["condition"], _seeds(e["cont_err_mean"]),
             _seeds(e["cont_err_max"]), _seeds(e["cont_err_first"]), _LEVEL_TEXT[e["level"]]]
            for e in res["preset_eval"]]
    lines += table(["preset", "fields", "condition", "mean", "worst step", "first step", "verdict"], rows)
    fails = defaultdict(list)
    for e in res["preset_eval"]:
        if e["level"] not in ("exact", "compact"):
            fails[e["preset"]].append(e)
    lines.append("")
    for name in res.get("preset_groups") or shipped:
        bad = fails.get(name, [])
        if not bad:
            lines.append(f"- `{name}`: near-exact (mean <= 2e-3, every step <= 1e-2) in every condition.")
        else:
            worst = max(bad, key=lambda e: max(e["cont_err_max"]))
            lines.append(f"- `{name}`: not near-exact in {len(bad)} of "
                         f"{sum(e['preset'] == name for e in res['preset_eval'])} conditions; worst: "
                         f"{worst['condition']} ({worst['fields']}), mean {_num(max(worst['cont_err_mean']))}, "
                         f"worst step {_num(max(worst['cont_err_max']))}; "
                         + ("it FAILS the rule there." if any(e["level"] == "fails" for e in bad)
                            else "within the rule's bounds everywhere."))
    lines.append("")

    lines += ["### Worst case per field and codec (over every condition and seed)", ""]
    rows = []
    for f in FIELDS:
        for r in summary[f]:
            chosen = [n for n, p in res["presets"].items() if p[f] == r["codec"] and n != "exact"]
            codec = f"**{r['codec']}**" if chosen else r["codec"]
            rows.append([f, codec + (f" ({', '.join(chosen)})" if chosen else ""), _num(r["bits_per_value"], ".2f"),
                         _num(r["size_ratio"], ".4f"), _num(r["sqnr_db"], ".1f"), _num(r["max_rel_err"]),
                         _num(r["cont_err_first"]), _num(r["cont_err_mean"]), _num(r["cont_err_max"]),
                         r["where_max"] if r["cont_err_max"] else "-", _LEVEL_TEXT[r["level"]]])
    lines += table(["field", "codec", "bits/value", "size vs raw", "min SQNR dB", "max rel err",
                     "worst first step", "worst mean", "worst step", "worst step at", "level"], rows)
    lines += ["", "(`bf16` for conv and latent would be `raw`: those fields are bf16 already.)", ""]

    lines += ["### Every row: field, codec, condition (values per seed " + seeds + ")", ""]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in res["rows"]:
        if r["field"] in FIELDS:
            groups[(r["field"], r["codec"], condition(r))].append(r)
    order = {f: {cd: i for i, cd in enumerate(dict.fromkeys(r["codec"] for r in res["rows"] if r["field"] == f))}
             for f in FIELDS}

    def by_field_codec_condition(kv):
        (field, codec, cond), _ = kv
        return FIELDS.index(field), order[field][codec], cond

    rows = []
    for (f, codec, cond), rs in sorted(groups.items(), key=by_field_codec_condition):
        rs = sorted(rs, key=lambda r: r["seed"])
        rows.append([f, codec, cond, " / ".join(_num(r["sqnr_db"], ".1f") for r in rs),
                     _seeds([r["max_rel_err"] for r in rs]),
                     _seeds([r["cont_err_first"] for r in rs]), _seeds([r["cont_err_mean"] for r in rs]),
                     _seeds([r["cont_err_max"] for r in rs])])
    lines += table(["field", "codec", "condition", "SQNR dB", "max rel err", "first step", "mean", "worst step"], rows)

    lines += ["", "### Conditions: forget gates and state sizes", ""]
    rows = []
    for s in sorted(res["stats"], key=lambda s: (s["kind"], s.get("decay", ""), s["inputs"], s["seed"])):
        if s["kind"] == "mla":
            rows.append([s["kind"], s["inputs"], s["seed"], "-", "-", _num(s["latent_rms"], ".3g"),
                         _num(s["latent_absmax"], ".3g"), _num(s["bf16_output_noise"])])
        else:
            rows.append([s["kind"], f"{s['decay']}, {s['inputs']}", s["seed"],
                         f"{s['median_decay']:.3f}", f"{s['decay_p10']:.3f} - {s['decay_p90']:.3f}",
                         _num(s["state_rms"], ".3g"), _num(s["state_absmax"], ".3g"), _num(s["bf16_output_noise"])])
    lines += table(["layer", "condition", "seed", "median decay", "decay p10 - p90", "state / latent rms",
                     "abs max", "bf16 output noise"], rows)
    lines += ["", "bf16 output noise: relative L2 error of the exact continuation's outputs rounded to "
              "bf16 (mean over the steps; MLA: logit std 3, isotropic queries), the rounding the model "
              "applies to them anyway: the scale of `compact`'s near-exact bounds."]
    return lines + [""]


__all__ = ["LEVELS", "render"]
