"""`--json` on the commands outside the store group: `demo` and `bench` print one JSON object
on stdout (their tables and progress go to stderr)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_demo_json_is_one_object_on_stdout(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "anchorkv", "demo", "--json", "--store",
                           str(tmp_path / "s")], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["ok"] is True
    assert out["fields"] and all(r["ok"] for r in out["fields"])
    assert out["store_cycle"] and all(r["ok"] for r in out["store_cycle"])
    assert "verified" in proc.stderr  # the human-readable lines moved to stderr


def test_bench_json_summary(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "anchorkv", "bench", "--tiny", "--json",
                           "--suite", "codec", "--no-fidelity", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    out = json.loads(proc.stdout)
    assert set(out["report"]) == {"json", "md", "png"}
    assert all(Path(p).exists() for p in out["report"].values())
    assert out["suites"]["codec"] in ("ok", "passed", "failed", "missing")
    assert out["ok"] is (proc.returncode == 0)
