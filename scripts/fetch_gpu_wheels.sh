#!/usr/bin/env bash
# Download the wheels the offline GPU machine needs into .whl/ (git-ignored), on a machine with
# network. scripts/gpu_validate.sh installs them there (python 3.12, x86_64, no network; torch,
# triton, numpy, pytest, pytest-benchmark and matplotlib preinstalled).
#
# Usage: scripts/fetch_gpu_wheels.sh [DEST]          (default DEST: .whl at the repository root)
#
# What and why:
#   zarr, numcodecs, google-crc32c, blake3           the store's imports (anchorkv.store)
#   fastcrc                                          the store's crc32c (a main dependency; without it
#                                                     the store falls back to crc32c, then google-crc32c)
#   crc32c                                           that fallback (the fast-crc extra), whose path the
#                                                     tests also run
#   donfig, pyyaml                                    zarr's imports (donfig reads its config with yaml)
#   hypothesis, sortedcontainers                      tests/kernels/test_properties.py (collection
#                                                     fails without them, and then no kernel test runs)
#   msgspec                                           brought along as before (not imported by anchorkv)
# packaging and typing_extensions come with pytest and torch there; numpy is never shadowed.
#
# Versions: the ones installed in .venv (what CI tests), or the fallback pins below where .venv
# lacks one; each is checked against pyproject.toml's range when pyproject names the package.
# Old wheels of these packages in DEST are removed, so `pip install DEST/*.whl` sees one version.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="${1:-$ROOT/.whl}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3

# name==fallback version (used only where the .venv does not have the package)
FALLBACK="zarr==3.1.6 numcodecs==0.16.6 google-crc32c==1.9.0 fastcrc==0.5.0 crc32c==2.9.post0 blake3==1.0.11
donfig==0.8.1.post1 pyyaml==6.0.3 hypothesis==6.170.15 sortedcontainers==2.4.0 msgspec==0.22.0"

mapfile -t PINS < <("$PY" - "$ROOT/pyproject.toml" $FALLBACK <<'PYEOF'
import importlib.metadata as md
import re
import sys

try:
    import tomllib
except ImportError:  # python < 3.11
    tomllib = None
from packaging.requirements import Requirement

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

declared = {}
if tomllib is not None:
    with open(sys.argv[1], "rb") as f:
        project = tomllib.load(f)["project"]
    reqs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        reqs += extra
    for r in map(Requirement, reqs):
        declared.setdefault(norm(r.name), r.specifier)
bad = []
for pin in sys.argv[2:]:
    name, fallback = pin.split("==")
    try:
        version = md.version(name)
    except md.PackageNotFoundError:
        version = fallback
    spec = declared.get(norm(name))
    if spec is not None and not spec.contains(version, prereleases=True):
        bad.append(f"{name}=={version} is outside pyproject.toml's {name}{spec}")
    print(f"{name}=={version}")
if bad:
    sys.exit("fetch_gpu_wheels: " + "; ".join(bad) + " (install an accepted version in .venv "
             "or change the fallback pin)")
PYEOF
)
[ "${#PINS[@]}" -gt 0 ] || { echo "fetch_gpu_wheels: no pins (see the error above)" >&2; exit 1; }

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$TMP" "${PINS[@]}"

mkdir -p "$DEST"
for pin in "${PINS[@]}"; do  # wheel file names spell the project name with underscores
    stem="$(echo "${pin%%==*}" | tr '[:upper:]-.' '[:lower:]__')"
    find "$DEST" -maxdepth 1 -iname "${stem}-*.whl" -delete
done
mv "$TMP"/*.whl "$DEST"/
echo "fetch_gpu_wheels: ${#PINS[@]} wheels in $DEST:"
ls -1 "$DEST"
