"""The `anchorkv` command (also `python -m anchorkv`): one subcommand per module.

Each module listed in `_COMMANDS` has `register(subparsers)`, which adds its subcommands with
`set_defaults(func=...)`; `func(args)` returns the exit status. A command that sets
`passthrough` (`bench`) gets the arguments its parser does not know in `args.passthrough`. Modules are imported only for
the command being run (so `anchorkv --help` and the store commands never import torch); the
other commands appear in `--help` by name.

Errors a user can cause (a bad path, URL, size, a missing extra) end as one or two lines on
stderr and exit status 2, never a traceback; an unexpected internal error prints one line too
(``ANCHORKV_DEBUG=1`` shows its traceback). A reader that closes stdout early (``anchorkv ls |
head -1``) ends the command quietly, exit status 141 (as if killed by SIGPIPE).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
from pathlib import Path

#: command -> (module that registers it, one-line help for the top-level --help)
_COMMANDS = {
    "demo": ("anchorkv.demo.cli", "save and restore one request with every codec; print what it wrote"),
    "bench": ("anchorkv.bench", "run the benchmarks and the fidelity study (report in a temporary dir unless --out)"),
    "ls": ("anchorkv.store.cli", "list the entries of a store"),
    "inspect": ("anchorkv.store.cli", "show one entry's manifest and arrays"),
    "verify": ("anchorkv.store.cli", "check entries, exit 1 naming each damaged one"),
    "rm": ("anchorkv.store.cli", "delete entries"),
    "gc": ("anchorkv.store.cli", "remove garbage and damaged entries; evict to --capacity (--dry-run)"),
    "stats": ("anchorkv.store.cli", "a store's totals: entries, tokens, bytes by field and codec, capacity use"),
}


def with_json(run, args: argparse.Namespace) -> int:
    """`run(args, result)` -> exit status; with `--json`, its tables and progress go to stderr
    and `{"ok": ..., **result}` is printed as one JSON object on stdout (for `demo`, `bench`)."""
    if not getattr(args, "json", False):
        return run(args, {})
    result: dict = {}
    with contextlib.redirect_stdout(sys.stderr):
        status = run(args, result)
    print(json.dumps({"ok": status == 0, **result}, indent=1, default=str))
    return status


def output_dir_problem(path: str) -> str | None:
    """Why `path` cannot be an output directory, as "expected ..., found ..."; None if it can
    (it is a directory, or it does not exist yet and its nearest existing parent is a directory).
    For checking an option like `--out` before any work is done."""
    p = Path(path)
    try:
        for at in (p, *p.parents):
            if at.is_dir():
                return None
            if at.exists() or at.is_symlink():  # a file, a broken symlink, a device...
                what = "a file" if at.is_file() else "a broken symlink" if not at.exists() else "not a directory"
                where = f"{str(at)!r}" + ("" if at == p else f" (a parent of {path!r})")
                return (f"expected a directory or a path that does not exist yet, found {what}: {where}; "
                        "name another path")
    except OSError as e:  # (a parent this user cannot search, a name too long: a traceback at parsing)
        return f"cannot use {path!r}: {e.strerror or e}; name another path"
    return None


def _stdout_closed() -> int:
    """Point stdout at /dev/null (so that the flush at exit does not fail again); 141."""
    with contextlib.suppress(OSError, ValueError, AttributeError):  # in-process callers' captures: no fd
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return 141


def build_parser(command: str | None = "*") -> argparse.ArgumentParser:
    """The parser; the module of `command` registers its real subcommands, the others are
    listed by name ("*": every module registers; None: none, for `anchorkv --help`)."""
    parser = argparse.ArgumentParser(
        prog="anchorkv", description="Save and restore hybrid-LLM cache state, compressed."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    if command == "*":
        modules = {m for m, _ in _COMMANDS.values()}
    else:
        modules = set() if command is None else {_COMMANDS[command][0]}
    registered: set[str] = set()
    for name in dict.fromkeys(m for m, _ in _COMMANDS.values()):
        if name in modules:
            before = set(sub.choices)
            importlib.import_module(name).register(sub)
            registered |= set(sub.choices) - before
    for name, (_, help) in _COMMANDS.items():
        if name not in registered:
            sub.add_parser(name, help=help, add_help=False)
    return parser


def _command(argv: list[str]) -> str | None:
    for a in argv:
        if a in _COMMANDS:
            return a
        if not a.startswith("-"):
            return None
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_command(argv))
    args, rest = parser.parse_known_args(argv)
    if rest and not hasattr(args, "passthrough"):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if rest:  # a command that hands its arguments on (`bench`: to benchmarks.run)
        args.passthrough = rest
    if args.command == "bench":  # its new process runs in the checkout: a relative --out is ours
        with contextlib.suppress(OSError):
            args.passthrough = ["--caller-cwd", os.getcwd(), *args.passthrough]
    try:
        status = int(args.func(args) or 0)
        if sys.stdout is not None:
            sys.stdout.flush()  # a closed pipe shows here, not at exit
        return status
    except BrokenPipeError:  # stdout's reader is gone (the store commands' error handling lets it through)
        return _stdout_closed()
    except KeyboardInterrupt:
        print(f"anchorkv {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a user error the command did not catch itself, or a bug: one line
        if os.environ.get("ANCHORKV_DEBUG"):
            raise
        from anchorkv.store.cli import report_error

        if isinstance(e, (ValueError, OSError, ImportError)) or type(e).__module__.startswith("anchorkv"):
            return report_error(args.command, e, getattr(args, "store", None))
        print(f"anchorkv {args.command}: internal error: {type(e).__name__}: {str(e)[:300]} "
              "(ANCHORKV_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
