"""`anchorkv bench`: run the benchmarks of a source checkout (`python -m benchmarks.run` there).

The suites, the fidelity study and the report live with the benchmarks (`benchmarks/run.py`),
which are not installed with the package. This command finds the checkout (the current
directory, else the one the package is installed from in editable mode) and runs
`benchmarks.run` there in a new Python process, under the name `anchorkv bench`, with the
arguments it was given (`anchorkv bench --help` lists them).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HELP = "run the benchmarks and the fidelity study; write the report (needs a source checkout)"
#: What the new process runs: `benchmarks.run.main` under this command's name.
_RUN = "import sys; from benchmarks.run import main; sys.exit(main(sys.argv[1:], prog='anchorkv bench'))"


def find_checkout(start: Path | None = None) -> Path:
    """The repository root holding `benchmarks/` (the current directory or the package's parent)."""
    here = Path(__file__).resolve().parent.parent
    for root in ([start] if start else []) + [Path.cwd(), here]:
        if (root / "benchmarks" / "run.py").is_file() and (root / "benchmarks" / "fidelity").is_dir():
            return root
    raise SystemExit(
        "anchorkv bench needs a source checkout: benchmarks/ (the pytest-benchmark suites and "
        "benchmarks/fidelity) is not installed with the package. Clone the repository, "
        "`pip install -e .` it, and run `anchorkv bench` from its root."
    )


def main(args: argparse.Namespace) -> int:
    root = find_checkout()
    return subprocess.call([sys.executable, "-c", _RUN, *args.passthrough], cwd=root)


def register(sub: argparse._SubParsersAction) -> None:
    # The options are benchmarks.run's: they pass through (its parser prints `--help`).
    p = sub.add_parser("bench", help=HELP, add_help=False)
    p.set_defaults(func=main, passthrough=[])
