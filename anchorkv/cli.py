"""The `anchorkv` command (also `python -m anchorkv`): one subcommand per module.

Each module listed in `_COMMAND_MODULES` has `register(subparsers)`, which adds its
subcommands with `set_defaults(func=...)`; `func(args)` returns the exit status.
"""

from __future__ import annotations

import argparse
import importlib
import sys

_COMMAND_MODULES = (
    "anchorkv.demo",
    "anchorkv.bench",
    "anchorkv.store.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="anchorkv", description="Save and restore hybrid-LLM cache state, compressed."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
