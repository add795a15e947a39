#!/usr/bin/env bash
# The full GPU validation in one command (benchmarks/gpu_validate.py; see benchmarks/README.md):
# kernel tests, kernel and save-path benchmarks, host-vs-kernel profile, report under --out.
#
# Usage (from anywhere; it runs in the repository root):
#   scripts/gpu_validate.sh [--out DIR] [--quick] [--skip-tests] [--tests-k EXPR] [--with-sm90] [-k EXPR] [--budget S]
#
# Python: $PYTHON, else .venv/bin/python if there is one, else python3. When the store's and the
# kernel tests' dependencies do not import there and .whl/ holds wheels (scripts/fetch_gpu_wheels.sh
# puts them there on a machine with network), they are installed into $ANCHORKV_SITE
# (default /tmp/anchorkv-site) first, offline, and put on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
DEPS="import zarr, numcodecs, blake3, google_crc32c, fastcrc, yaml, hypothesis"
if ! "$PY" -c "$DEPS" 2>/dev/null; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        SITE="${ANCHORKV_SITE:-/tmp/anchorkv-site}"
        echo "gpu_validate: installing $(ls .whl/*.whl | wc -l) wheels from .whl/ into $SITE"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" .whl/*.whl
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "gpu_validate: '$DEPS' fails in $PY and there is no .whl/ (run" \
             "scripts/fetch_gpu_wheels.sh on a machine with network); going on, the report names" \
             "what is missing" >&2
    fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m benchmarks.gpu_validate "$@"
