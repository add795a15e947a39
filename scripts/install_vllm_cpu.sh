#!/usr/bin/env bash
# Install vLLM 0.33.0 for CPU-only tests next to an already installed CPU torch 2.13.0.
#
# Usage: scripts/install_vllm_cpu.sh PYTHON        (e.g. .venv/bin/python)
#
# `pip install vllm==0.33.0` would resolve torch==2.14.0 plus GBs of CUDA wheels, so the vLLM
# wheel goes in with --no-deps, followed by only the pure-Python packages that importing
# vllm.config, vllm.v1.core.sched.scheduler, vllm.v1.worker.utils and
# vllm.distributed.kv_transfer.kv_connector.v1.base and the Kimi-Linear model class (which
# ModelConfig inspects) need, found by trial. Versions are pinned inside vLLM 0.33.0's own
# declared ranges where it declares one. torch is held at 2.13.0 with a constraints file;
# xgrammar (depends on torch and triton, ~1 GB, not needed on CPU) and compressed-tensors
# (depends on torch) go in with --no-deps. pip's resolver then lists vLLM's uninstalled CUDA
# dependencies as conflicts; that is expected and filtered from the output.
# Idempotent: does nothing if vllm 0.33.0 already imports.
set -euo pipefail

PY="${1:?usage: $0 PYTHON}"
VLLM_VERSION=0.33.0
TORCH_VERSION=2.13.0

export VLLM_TARGET_DEVICE="${VLLM_TARGET_DEVICE:-cpu}"

check_torch() {
    "$PY" - "$TORCH_VERSION" <<'PYEOF'
import sys
try:
    import torch
except ImportError:
    sys.exit(f"torch is not installed in {sys.executable}; install torch=={sys.argv[1]} first")
if torch.__version__.split("+")[0] != sys.argv[1]:
    sys.exit(f"expected torch {sys.argv[1]}, found {torch.__version__}")
PYEOF
}

vllm_ready() {
    "$PY" - "$VLLM_VERSION" >/dev/null 2>&1 <<'PYEOF'
import sys
import vllm
assert vllm.__version__ == sys.argv[1], vllm.__version__
import vllm.config  # noqa: F401
import vllm.v1.core.sched.scheduler  # noqa: F401
import vllm.v1.worker.utils  # noqa: F401
import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401
import vllm.models.kimi_k3  # noqa: F401  (ModelConfig inspects KimiLinearForCausalLM)
PYEOF
}

check_torch
if vllm_ready; then
    echo "vllm ${VLLM_VERSION} already importable in ${PY}; nothing to do"
    exit 0
fi

constraints="$(mktemp)"
echo "torch==${TORCH_VERSION}" >"$constraints"

log="$(mktemp)"
trap 'rm -f "$constraints" "$log"' EXIT
pip_install() {
    if ! "$PY" -m pip install --disable-pip-version-check -q -c "$constraints" "$@" >"$log" 2>&1; then
        cat "$log" >&2
        return 1
    fi
    # Drop the resolver's report about vLLM's (deliberately) missing CUDA dependencies.
    grep -v -e "requires" -e "dependency resolver" -e "^WARNING: Location" "$log" || true
}

# vLLM itself and the three packages whose declared dependencies would pull torch/triton.
pip_install --no-deps "vllm==${VLLM_VERSION}" "xgrammar==0.2.8" "compressed-tensors==0.17.0"
# Pure-Python (or self-contained binary) packages the imports above need; their own
# dependencies come along (none of them depends on torch).
pip_install \
    "packaging==26.3" \
    "pydantic==2.14.3" \
    "regex==2026.11.15" \
    "psutil==7.2.2" \
    "cbor2==6.2.1" \
    "pyzmq==27.3.0" \
    "urllib3==2.8.0" \
    "transformers==5.20.2" \
    "aiohttp==3.14.5" \
    "requests==2.34.2" \
    "openai-harmony==0.0.8" \
    "openai==3.54.0" \
    "pillow==13.0.0" \
    "pybase64==1.5.1" \
    "cachetools==8.0.1" \
    "msgspec==0.22.0" \
    "cloudpickle==3.1.2" \
    "uvloop==0.23.0" \
    "py-cpuinfo==9.0.0" \
    "prometheus_client==0.26.0" \
    "apache-tvm-ffi==0.1.11" \
    "fastapi==0.136.3" \
    "partial-json-parser==0.2.1.1.post7" \
    "llguidance==1.7.6" \
    "einops==0.8.2" \
    "loguru==0.7.3"

check_torch
if ! vllm_ready; then
    echo "vllm ${VLLM_VERSION} still does not import; run: VLLM_TARGET_DEVICE=cpu $PY -c 'import vllm.v1.core.sched.scheduler'" >&2
    exit 1
fi
echo "vllm ${VLLM_VERSION} installed for CPU tests in ${PY}"
