"""`python -m benchmarks.fidelity [--quick] [--json PATH]`: run the study, print the table."""

from __future__ import annotations

import argparse
import json
import math
import sys

from .study import StudyConfig, finite, run_study


def _fmt(x: float, spec: str) -> str:
    return "exact" if isinstance(x, float) and math.isinf(x) else format(x, spec)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fidelity", description=__doc__)
    p.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    cfg = StudyConfig.tiny() if args.tiny else StudyConfig.quick() if args.quick else StudyConfig()
    cfg = StudyConfig(**{**cfg.__dict__, "seed": args.seed})
    res = run_study(cfg)
    for name, f in res["fields"].items():
        print(f"\n{name} {f['dtype']} {f['shape']}  default: {f['default']}")
        print(f"  {'codec':<11}{'bits':>7}{'ratio':>8}{'SQNR dB':>9}{'maxrel':>9}{'cont mean':>11}{'cont max':>10}")
        for r in f["rows"]:
            print(f"  {r['codec']:<11}{r['bits_per_value']:>7.2f}{r['size_ratio']:>8.4f}"
                  f"{_fmt(r['sqnr_db'], '9.1f'):>9}{r['max_rel_err']:>9.2e}"
                  f"{r['cont_err_mean']:>11.2e}{r['cont_err_max']:>10.2e}")
    print(f"\nrule: {res['rule']}\ndefaults: {res['defaults']}  ({res['runtime_s']:.1f} s)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(finite(res), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
