"""`python -m benchmarks.fidelity [--quick] [--json PATH] [--md PATH]`: run the study, print the
presets and the worst case per field and codec."""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks.reporting import finite

from .study import StudyConfig, run_study


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fidelity", description=__doc__)
    p.add_argument("--quick", action="store_true", help="every condition, one seed, small sizes")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seeds", help="comma-separated seeds (default: 0,1,2; quick: 0)")
    p.add_argument("--jobs", type=int, help="worker processes (default 2)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--md", help="write the markdown report here")
    p.add_argument("--render", metavar="JSON", help="only re-render the markdown of a results JSON (to --md)")
    args = p.parse_args(argv)
    if args.render:
        from .report import render

        with open(args.render) as fh:
            res = json.load(fh)
        text = "\n".join(render(res)) + "\n"
        if args.md:
            with open(args.md, "w") as fh:
                fh.write(text)
        else:
            print(text)
        return 0
    cfg = StudyConfig.tiny() if args.tiny else StudyConfig.quick() if args.quick else StudyConfig()
    over = {}
    if args.seeds:
        over["seeds"] = tuple(int(s) for s in args.seeds.split(","))
    if args.jobs:
        over["jobs"] = args.jobs
    cfg = StudyConfig(**{**cfg.__dict__, **over})
    res = run_study(cfg)
    for name, rows in res["summary"].items():
        print(f"\n{name}: worst case over {rows[0]['conditions'] if rows else 0} conditions x seeds")
        print(f"  {'codec':<11}{'bits':>7}{'ratio':>8}{'first':>10}{'mean':>10}{'step':>10}  level")
        for r in rows:
            print(f"  {r['codec']:<11}{r['bits_per_value']:>7.2f}{r['size_ratio']:>8.4f}"
                  f"{r['cont_err_first']:>10.2e}{r['cont_err_mean']:>10.2e}{r['cont_err_max']:>10.2e}  {r['level']}")
    print(f"\nrule: {res['rule']}")
    for name, p_ in res["presets"].items():
        print(f"preset {name}: {p_}")
    print(f"shipped presets {'match' if res['presets_match_shipped'] else 'DIFFER'}; {res['runtime_s']:.1f} s")
    if args.json:
        with open(args.json, "w") as fh:  # the markdown goes to --md, not here
            json.dump(finite({k: v for k, v in res.items() if k != "markdown"}), fh)
            fh.write("\n")
    if args.md:
        with open(args.md, "w") as fh:
            fh.write("\n".join(res["markdown"]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
