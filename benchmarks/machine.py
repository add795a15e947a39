"""One name for the machine a benchmark ran on, for every benchmark's result files.

`machine_name()` is the first CUDA GPU's name when torch sees one (`nvidia-h100-80gb-hbm3`),
else `cpu-<processor>-<cores>c` (`cpu-x86-64-2c`): lower case, every run of characters other
than a-z, 0-9 and "." turned into one "-". Result files are `<machine>.json` or
`<machine>-<what>.json`. `device_info()` describes the device for the report; `session_env()`
is the environment of a benchmark run started as a pytest process of its own.
"""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path
from typing import Any


def device_info() -> dict:
    """Platform, processor, cores, Python, torch and (when CUDA is available) the GPU's name."""
    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "python": platform.python_version()}
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return info
    info["torch"] = torch.__version__
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def machine_name(info: dict | None = None) -> str:
    """The file-name-safe machine id (of `info`, by default this machine's `device_info()`)."""
    info = device_info() if info is None else info
    raw = info.get("gpu") or f"cpu-{info['processor']}-{info['cores']}c"
    return re.sub(r"[^a-z0-9.]+", "-", raw.lower()).strip("-")


def session_env(**extra: str) -> dict[str, str]:
    """This process's environment, plus `extra`, for a benchmark run in a pytest process of its
    own: without pytest-xdist's worker variables (`PYTEST_XDIST_WORKER`, ...), which a run
    started from inside an xdist worker (the test suite under `-n`) inherits, and with which
    pytest-benchmark disables every benchmark of the new run ("xdist plugin is active")."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}
    env.update(extra)
    return env


#: this run's benchmarks, as the benchmarks' conftest sees them: the node ids collected by
#: module (deselected ones too: `-k`, `-m`), and those that ended without failing (passed, or
#: skipped)
COLLECTED: dict[str, list[str]] = {}
FINISHED: set[str] = set()


def results_path(request: Any, results: Path, name: str) -> Path:
    """Where a pytest benchmark module records its rows (`request`: a module-scoped fixture's):
    `results/<name>.json` when the run took every benchmark of the module and each ended
    without failing, else `results/<name>.partial.json` (git ignores it): a run of some rows
    (`-k`, a node id), or one cut short (interrupted, `-x`, a failure: `gpu_validate` interrupts
    a step that runs out of time) never replaces the whole recorded run that
    benchmarks/README.md quotes."""
    module = request.path.resolve()
    named = any("::" in a and (request.config.invocation_params.dir / a.split("::")[0]).resolve() == module
                for a in request.config.args)  # (a node id collects only what it names)
    if not named and all(n in FINISHED for n in COLLECTED.get(str(request.path), ())):
        return results / f"{name}.json"
    path = results / f"{name}.partial.json"
    print(f"\n{module.name}: a run of some of its benchmarks, or cut short; its rows go to {path}, not {name}.json")
    return path


if __name__ == "__main__":  # python -m benchmarks.machine
    print(machine_name())
