"""Run the benchmark suites and the fidelity study, write the report (`anchorkv bench`).

    python -m benchmarks.run [--quick] [--out DIR] [--suite NAME] [-k EXPR] [--no-fidelity] [--json]

Run from the checkout root (`anchorkv bench` runs this module there). Each suite
(`benchmarks/bench_*.py`, pytest-benchmark) runs in a subprocess of this Python (`pytest
--benchmark-json`), then the study (`python -m benchmarks.fidelity`); the results go to
`<out>/<machine>.json`, a markdown table `<out>/<machine>.md` and a plot `<out>/<machine>.png`
(throughput vs size, error vs bits). `<machine>` is `benchmarks.machine.machine_name()`: the
GPU's name, or `cpu-<processor>-<cores>c`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from anchorkv.connector.config import DEFAULT_CODECS, KIMI_FIELD_ROLES, field_codecs
from benchmarks.machine import device_info, machine_name, session_env
from benchmarks.reporting import condense, finite, num, table

#: The checkout holding these benchmarks.
ROOT = Path(__file__).resolve().parent.parent
#: Suites `anchorkv bench` runs when their file exists, in this order.
SUITES = ("codec", "kernels", "store", "save_path", "load_path")


def _run(cmd: list[str], root: Path, env: dict) -> tuple[int, float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    return proc.returncode, time.perf_counter() - t0, (proc.stdout + proc.stderr)[-4000:]


def run_suites(root: Path, quick: bool, k: str | None, suites: tuple[str, ...]) -> dict:
    """Run each suite's file under pytest; a suite whose file is absent is reported `missing`.

    Each entry has `status`: `ok`, `failed` (pytest's exit code is neither 0 nor 5, or it wrote
    no results; the log tail is kept), `missing` (no `benchmarks/bench_<name>.py`) or `empty`
    (nothing collected, e.g. `-k` matched nothing).
    """
    env = session_env(ANCHORKV_BENCH_QUICK="1" if quick else "0", PYTHONPATH=str(root))
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in suites:
            path = root / "benchmarks" / f"bench_{name}.py"
            if not path.exists():
                out[name] = {"status": "missing", "returncode": None, "seconds": 0.0,
                             "file": str(path.relative_to(root))}
                print(f"  suite {name}: MISSING ({path.relative_to(root)} does not exist)")
                continue
            js = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, "-m", "pytest", str(path), "-q", "-p", "no:cacheprovider",
                   f"--rootdir={root}", f"--benchmark-json={js}", "--benchmark-disable-gc"]
            cmd += ["--quick"] if quick else []
            cmd += ["-k", k] if k else []
            rc, secs, tail = _run(cmd, root, env)
            entry: dict[str, Any] = {"returncode": rc, "seconds": secs, "command": " ".join(cmd[1:])}
            if js.exists():
                data = json.loads(js.read_text())
                entry["benchmarks"] = condense(data)
                entry["machine_info"] = data.get("machine_info", {}).get("cpu", {})
            if rc == 5:
                entry["status"] = "empty"
            elif rc == 0 and entry.get("benchmarks"):
                entry["status"] = "ok"
            else:
                entry["status"] = "failed"
                entry["log_tail"] = tail
            out[name] = entry
            print(f"  suite {name}: {entry['status'].upper()} (rc={rc}) in {secs:.0f} s, "
                  f"{len(entry.get('benchmarks', []))} results")
    return out


def run_fidelity(root: Path, quick: bool, tiny: bool = False) -> dict:
    env = session_env(PYTHONPATH=str(root))
    with tempfile.TemporaryDirectory() as tmp:
        js, md = Path(tmp) / "fidelity.json", Path(tmp) / "fidelity.md"
        cmd = [sys.executable, "-m", "benchmarks.fidelity", "--json", str(js), "--md", str(md)]
        cmd += ["--tiny"] if tiny else ["--quick"] if quick else []
        rc, secs, tail = _run(cmd, root, env)
        if rc != 0 or not js.exists() or not md.exists():
            return {"returncode": rc or 1, "seconds": secs, "log_tail": tail}
        res = json.loads(js.read_text())
        res.update({"returncode": rc, "seconds": secs, "markdown": md.read_text().splitlines()})
        print(f"  fidelity: {secs:.0f} s, presets {res.get('presets')}")
        return res


# ----------------------------------------------------------------------------- report


def _status(suite: dict) -> str:
    st = suite.get("status", "ok" if suite.get("returncode") == 0 else "failed")
    return st if st in ("ok", "empty") else f"**{st.upper()}**"


def render_markdown(res: dict) -> str:
    lines = [f"# anchorkv benchmarks: {res['machine']}", "",
             f"{res['created']}, mode {res['mode']}, device {res['device'].get('gpu') or 'CPU (torch reference path)'}"
             f", {res['device'].get('cores')} cores, torch {res['device'].get('torch')}; "
             f"command `{res['command']}` ({res['seconds']:.0f} s).", ""]
    suites = res.get("suites") or {}
    if suites:
        rows = [[f"`{n}`", _status(s), len(s.get("benchmarks", [])), num(s.get("seconds"), ".0f")]
                for n, s in suites.items()]
        lines += table(["suite", "status", "results", "seconds"], rows) + [""]
    fid = res.get("fidelity") or {}
    if fid and not fid.get("fields"):
        lines += [f"**Fidelity study FAILED (rc {fid.get('returncode')}); log tail in the JSON.**", ""]
    if fid.get("markdown"):  # the study renders its own section (every row it computed)
        lines += list(fid["markdown"])
        lines += ["Reproduce: `python -m benchmarks.fidelity"
                  + {"full": "", "quick": " --quick", "tiny": " --tiny"}.get(res["mode"], "") + "`.", ""]
    codec = (res.get("suites") or {}).get("codec", {})
    benches = codec.get("benchmarks", [])
    fields = [b for b in benches if b["name"].startswith("test_field")]
    if fields:
        lines += ["## Codec throughput (one layer's field, one request)", ""]
        rows = [[e["field"], e["tp"], e["codec"], e["op"], num(e["bytes_raw"] / 1e6, ".2f"),
                 num(b["median_s"] * 1e3, ".2f"), num(e["gbs"], ".2f"), num(e["ratio_to_copy"], ".2f")]
                for b in fields for e in [b["extra_info"]]]
        lines += table(["field", "tp", "codec", "op", "raw MB", "median ms", "GB/s", "vs copy"], rows) + [""]
    scaling = [b for b in benches if b["name"].startswith("test_scaling")]
    if scaling:
        lines += ["## Scaling: one request, tp=1, latent tokens vary (KDA state constant)", ""]
        rows = [[e["tokens"], e["op"], num(e["bytes_raw"] / 1e6, ".1f"), num(b["median_s"], ".3f"),
                 num(e["gbs"], ".2f"), num(e["ratio_to_copy"], ".2f")]
                for b in sorted(scaling, key=lambda b: (b["extra_info"]["op"], b["extra_info"]["tokens"]))
                for e in [b["extra_info"]]]
        lines += table(["tokens", "op", "raw MB", "median s", "GB/s", "vs copy"], rows) + [""]
        for op, fit in (res.get("scaling_fit") or {}).items():
            lines.append(f"- {op}: t = {fit['fixed_s']:.3g} s + {fit['per_token_us']:.3g} us x tokens "
                         f"(least squares); knee ~ {fit['knee_tokens']:.0f} tokens (where the per-token "
                         f"part equals the fixed part); worst deviation from linear above the knee "
                         f"{fit['max_dev_pct']:.0f}%")
        lines.append("")
    kern = [b for b in suites.get("kernels", {}).get("benchmarks", []) if "provider" in b["extra_info"]]
    if kern:
        lines += ["## Kernels: pack / unpack of one whole Kimi-Linear request (47 items)", ""]
        rows = [[e["op"], e["tp"], e["provider"] + (f" ({e['backend']})" if e["provider"] == "ours" else ""),
                 num(e["source_bytes"] / 1e6, ".1f"), num(b["median_s"] * 1e3, ".1f"),
                 num(e["gbps"], ".2f"), num(e["copy_gbps"], ".1f"), num(e["ratio_vs_copy"], ".3f")]
                for b in sorted(kern, key=lambda b: (b["extra_info"]["op"], b["extra_info"]["tp"]))
                for e in [b["extra_info"]]]
        lines += table(["op", "tp", "provider", "source MB", "median ms", "GB/s", "copy GB/s",
                         "vs copy"], rows) + [""]
    for name, suite in suites.items():
        if name in ("codec", "kernels") or not suite.get("benchmarks"):
            continue
        lines += [f"## Suite `{name}`", ""]
        rows = [[b["name"], num(b["median_s"] * 1e3, ".3f"),
                 num(b["extra_info"].get("gbs", b["extra_info"].get("gbps")), ".2f"),
                 ", ".join(f"{k}={num(v) if isinstance(v, float) else v}" for k, v in b["extra_info"].items()
                           if k not in ("gbs", "gbps"))[:200]] for b in suite["benchmarks"]]
        lines += table(["benchmark", "median ms", "GB/s", "extra"], rows) + [""]
    for name, suite in suites.items():
        if suite.get("status") == "failed":
            lines += [f"**Suite `{name}` FAILED (rc {suite['returncode']}); log tail in the JSON.**", ""]
        elif suite.get("status") == "missing":
            lines += [f"**Suite `{name}` MISSING: `{suite.get('file')}` does not exist in this checkout.**", ""]
    return "\n".join(lines)


def scaling_fit(benches: list[dict]) -> dict:
    """Fit t = a + b * tokens per op over the scaling runs; knee = a / b tokens."""
    out = {}
    for op in ("pack", "unpack"):
        pts = sorted((b["extra_info"]["tokens"], b["median_s"]) for b in benches
                     if b["name"].startswith("test_scaling") and b["extra_info"].get("op") == op)
        if len(pts) < 2:
            continue
        n = len(pts)
        mx = sum(p[0] for p in pts) / n
        my = sum(p[1] for p in pts) / n
        sxx = sum((p[0] - mx) ** 2 for p in pts)
        b = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx
        a = my - b * mx
        knee = a / b if b > 0 else float("inf")
        dev = [abs(t - (a + b * x)) / t * 100 for x, t in pts if x >= knee]
        out[op] = {"fixed_s": a, "per_token_us": b * 1e6, "knee_tokens": knee,
                   "max_dev_pct": max(dev) if dev else 0.0}
    return out


def render_plot(res: dict, path: Path) -> None:
    """Four panels: throughput vs request size (log-log, with the plain copy of the same bytes),
    then SQNR, mean and worst-step continuation error vs stored bits per value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, axes = plt.subplots(2, 2, figsize=(14, 10))
    ax = axes[0, 0]
    benches = (res.get("suites") or {}).get("codec", {}).get("benchmarks", [])
    for op, marker in (("pack", "o"), ("unpack", "s")):
        pts = sorted((b["extra_info"]["tokens"], b["extra_info"]["gbs"], b["extra_info"]["copy_gbs"])
                     for b in benches if b["name"].startswith("test_scaling") and b["extra_info"]["op"] == op)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=f"{op} (default codecs)")
            if op == "pack":
                ax.plot([p[0] for p in pts], [p[2] for p in pts], "k--", label="plain copy, same bytes")
    codecs = next((b["extra_info"].get("codecs") for b in benches if b["name"].startswith("test_scaling")), None)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("latent tokens in the request (tp=1; KDA state constant)")
    ax.set_ylabel("GB/s (bytes read + written)")
    ax.set_title("Throughput vs request size" + (f"\n{codecs}" if codecs else ""), fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no scaling results", ha="center", transform=ax.transAxes)
    fid = res.get("fidelity") or {}
    colors = {"raw": "k", "bf16": "C4", "fp8": "C0", "int8": "C1", "int4": "C2"}
    markers = {"conv": "^", "recurrent": "o", "latent": "s"}
    panels = ((axes[0, 1], "sqnr_db", "Round-trip SQNR (dB), lowest over conditions", None),
              (axes[1, 0], "cont_err_mean", "Continuation error, mean over steps (worst condition)",
               fid.get("threshold")),
              (axes[1, 1], "cont_err_max", "Continuation error, worst step (worst condition)",
               fid.get("max_threshold")))
    for ax, key, title, bound in panels:
        for name, f in (fid.get("fields") or {}).items():
            for r in f["rows"]:
                val = r[key]
                if isinstance(val, str) or val is None or math.isinf(val) or (key != "sqnr_db" and val <= 0):
                    continue
                default = r["codec"] == f.get("default")
                ax.scatter(r["bits_per_value"], val, c=colors.get(r["codec"].split(":")[0], "C3"),
                           marker=markers.get(name, "x"), s=90 if default else 30,
                           edgecolors="r" if default else "none", linewidths=2)
        ax.set_xlabel("stored bits per value (scales included)")
        ax.set_ylabel(title)
        ax.set_title(title + " vs size", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        if key != "sqnr_db":
            ax.set_yscale("log")
        if bound:
            ax.axhline(bound, color="r", ls="--", lw=1)
            ax.text(ax.get_xlim()[0], bound, f" bound {bound:g}", color="r", va="bottom", fontsize=8)
    handles = [Line2D([], [], color=c, marker="o", ls="", label=k) for k, c in colors.items() if k != "raw"]
    handles += [Line2D([], [], color="gray", marker=m, ls="", label=k) for k, m in markers.items()]
    handles += [Line2D([], [], color="w", marker="o", markeredgecolor="r", markeredgewidth=2, ls="",
                       label="`smallest` preset")]
    axes[0, 1].legend(handles=handles, fontsize=8, loc="lower right")
    fig.suptitle(f"anchorkv, {res['machine']} ({res['mode']} mode)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(res: dict, out: Path) -> dict[str, Path]:
    """Write `<machine>.json`, `.md` and `.png` under `out`; return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    benches = (res.get("suites") or {}).get("codec", {}).get("benchmarks", [])
    res["scaling_fit"] = scaling_fit(benches)
    paths = {ext: out / f"{res['machine']}.{ext}" for ext in ("json", "md", "png")}
    paths["json"].write_text(json.dumps(finite(res), indent=1, allow_nan=False, default=str) + "\n")
    paths["md"].write_text(render_markdown(res) + "\n")
    render_plot(res, paths["png"])
    return paths


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks.run") -> int:
    """The command; `anchorkv bench` runs it with `prog="anchorkv bench"` (its name in the
    output, the report's `command` and `--help`)."""
    from anchorkv.cli import with_json

    args = build_parser(prog).parse_args(argv)
    args.prog = prog
    args.out = out_dir(args.out, args.caller_cwd)
    if args.out is not None:  # checked before anything runs, not after the whole run
        from anchorkv.cli import output_dir_problem

        if problem := output_dir_problem(args.out):
            print(f"{prog}: --out: {problem}", file=sys.stderr)
            return 2
    return with_json(_main, args)


def out_dir(out: str | None, caller_cwd: str | None = None) -> str | None:
    """`--out` as an absolute path: a relative one is relative to the caller's directory
    (`caller_cwd`, which `anchorkv bench` passes, since it runs this in the checkout; else
    this process's current directory)."""
    if out is None:
        return None
    return os.path.join(caller_cwd or os.getcwd(), os.path.expanduser(out))


def _main(args: argparse.Namespace, summary: dict) -> int:
    root = ROOT
    device = device_info()
    machine = machine_name(device)
    t0 = time.perf_counter()
    mode = "tiny" if args.tiny else "quick" if args.quick else "full"
    print(f"{args.prog} ({mode}) on {machine}, checkout {root}")
    suites = run_suites(root, args.quick or args.tiny, args.k, tuple(args.suite or SUITES))
    fidelity = None if args.no_fidelity else run_fidelity(root, args.quick, tiny=args.tiny)
    res = {
        "machine": machine, "device": device, "mode": mode,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": args.prog + (" --quick" if args.quick else "") + (f" -k {args.k!r}" if args.k else ""),
        "suites": suites, "fidelity": fidelity, "defaults": (fidelity or {}).get("defaults"),
        "shipped_defaults": field_codecs(DEFAULT_CODECS, KIMI_FIELD_ROLES),
        "seconds": time.perf_counter() - t0,
    }
    if args.out is None and mode != "full":  # a smoke run never overwrites the committed report
        out = Path(tempfile.mkdtemp(prefix="anchorkv-bench-"))
    else:
        out = Path(args.out) if args.out else root / "benchmarks" / "results"  # out_dir made it absolute
    paths = write_report(res, out)
    for p in paths.values():
        print(f"  wrote {p}")
    summary.update(machine=machine, mode=mode, report={k: str(v) for k, v in paths.items()},
                   suites={n: s["status"] for n, s in suites.items()},
                   fidelity=None if fidelity is None else
                   ("failed" if fidelity.get("returncode") else "ok"))
    missing = [n for n, s in suites.items() if s["status"] == "missing"]
    failed = [n for n, s in suites.items() if s["status"] == "failed"]
    if fidelity is not None and fidelity.get("returncode"):
        failed.append("fidelity")
    if missing:
        print(f"MISSING suites (reported, not run): {', '.join(missing)}")
    if failed:
        print(f"FAILED: {', '.join(failed)} (see the log tails in {paths['json']})")
        return 1
    return 0


def build_parser(prog: str = "python -m benchmarks.run") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke test, about a minute)")
    p.add_argument("--out", default=None, help="report directory (default: benchmarks/results for a full run, "
                   "a new temporary directory for --quick)")
    p.add_argument("--suite", action="append", choices=SUITES, help="only these suites (repeatable)")
    p.add_argument("-k", help="pytest -k expression selecting benchmarks")
    p.add_argument("--no-fidelity", action="store_true", help="skip the fidelity study")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tests: seconds
    p.add_argument("--json", action="store_true",
                   help="print one JSON summary (report paths, suite status) on stdout")
    # `anchorkv bench` runs this in the checkout: the directory a relative --out is relative to
    p.add_argument("--caller-cwd", default=None, help=argparse.SUPPRESS)
    return p


if __name__ == "__main__":
    sys.exit(main())
