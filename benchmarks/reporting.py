"""What the reports of `benchmarks.run` (`anchorkv bench`), `benchmarks.gpu_validate` and the
fidelity study share: markdown cells and tables, strict-JSON values, and the fields of
pytest-benchmark's JSON that a report keeps."""

from __future__ import annotations

import math
from typing import Any


def condense(bench_json: dict) -> list[dict]:
    """The fields of pytest-benchmark's JSON the reports use."""
    out = []
    for b in bench_json.get("benchmarks", []):
        s = b["stats"]
        out.append({"name": b["name"], "group": b.get("group"), "params": b.get("params"),
                    "median_s": s["median"], "mean_s": s["mean"], "stddev_s": s["stddev"],
                    "min_s": s["min"], "rounds": s["rounds"], "extra_info": b.get("extra_info", {})})
    return out


def num(x: Any, spec: str = ".3g") -> str:
    """A table cell: `-` for None, `exact` for an infinite value (a raw codec's SQNR)."""
    if x is None:
        return "-"
    if isinstance(x, str):
        return "exact" if x == "inf" else x
    if isinstance(x, float) and math.isinf(x):
        return "exact"
    return format(x, spec)


def table(header: list[str], rows: list[list]) -> list[str]:
    """The lines of a markdown table."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out


def finite(obj: Any) -> Any:
    """`obj` with +-inf and NaN floats as strings, so strict JSON parsers accept it
    (a raw codec's SQNR is inf; a timing can be too)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj
