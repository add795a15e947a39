"""`anchorkv demo`: the command, its tables and its `--json` object."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from anchorkv.demo.fields import run

if TYPE_CHECKING:
    from rich.table import Table


def _table(title: str, columns: tuple[str, ...], left: tuple[str, ...]) -> Table:
    """A rich table with these columns, right-aligned but for those in `left`."""
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="left" if col in left else "right")
    return table


def _show(table: Table) -> None:
    from rich.console import Console

    Console(width=max(Console().width, 120)).print(table)


def _size(n: float) -> str:
    """Binary units, as `anchorkv ls` shows sizes."""
    from anchorkv.store.cli import human_bytes

    return human_bytes(n)


def _db(sqnr: float) -> str:
    return "exact" if math.isinf(sqnr) else f"{sqnr:.1f}"


def _print(rows: list[dict], tp_size: int) -> None:
    table = _table(f"Kimi-Linear-48B-A3B, one request, tp={tp_size} (rank 0), CPU reference path",
                   ("field", "codec", "layers", "before", "after", "ratio", "worst SQNR dB",
                    "pack GB/s", "unpack GB/s", "verified"), left=("field", "codec"))
    for r in rows:
        table.add_row(
            r["field"], r["codec"], str(r["layers"]), _size(r["bytes_before"]), _size(r["bytes_after"]),
            f"{r['ratio']:.3f}", _db(r["sqnr_db"]),
            f"{r['pack_gbs']:.2f}", f"{r['unpack_gbs']:.2f}", "yes" if r["ok"] else "NO",
        )
    _show(table)


def _print_cycle(rows: list[dict], store: str | None) -> None:
    where = (f"stores {os.path.join(store, 'demo-<codecs>')}" if store else "temporary stores, removed after")
    table = _table("save -> new process -> restore (ZarrEntryStore + WorkerSide, tp=1, "
                   f"3000 tokens; {where})",
                   ("codecs", "logical", "stored", "ratio", "save s", "restore s", "worst SQNR dB", "verified"),
                   left=("codecs",))
    for r in rows:
        if "error" in r:
            table.add_row(r["name"], "", "", "", "", "", "", f"NO: {r['error'][:60]}")
            continue
        table.add_row(", ".join(f"{k} {v}" for k, v in r["codecs"].items()), _size(r["logical_bytes"]),
                      _size(r["stored_bytes"]), f"{r['stored_bytes'] / r['logical_bytes']:.3f}",
                      f"{r['save_s']:.2f}", f"{r['restore_s']:.2f}",
                      _db(min(r["sqnr_db"].values())), "yes" if r["ok"] else "NO")
    _show(table)
    for r in rows:
        if r.get("store"):
            print(f"wrote the {r['name']} entry to {r['store']} (see it: anchorkv ls --store {r['store']})")


def _verdict(rows: list[dict], failed: Callable[[list[dict]], str], passed: str) -> bool:
    """Print whether every row verified (`failed` says what of the rows that did not); True if so."""
    bad = [r for r in rows if not r["ok"]]
    print(f"FAILED: {failed(bad)}" if bad else passed)
    return not bad


def main(args: argparse.Namespace) -> int:
    from anchorkv.cli import with_json

    return with_json(_main, args)


def _main(args: argparse.Namespace, result: dict) -> int:
    rows = run(tp_size=args.tp, seed=args.seed)
    result["fields"] = rows
    _print(rows, args.tp)
    if not _verdict(rows, lambda bad: f"{len(bad)} field/codec pairs did not verify",
                    "all fields restored into other blocks and verified; no other byte changed"):
        return 1
    from anchorkv.demo.cycle import store_cycle  # the connector's worker path and the store

    cycle_rows = store_cycle(args.store, args.seed)
    result["store_cycle"] = cycle_rows
    _print_cycle(cycle_rows, args.store)
    if not _verdict(cycle_rows, lambda bad: f"{len(bad)} store cycles did not verify: "
                    f"{[r.get('error', r['name']) for r in bad]}",
                    "saved, restored in a new process into other blocks, verified; no other byte changed"):
        return 1
    return 0


#: `--seed`'s range: torch's generator takes 64 bits, and the demo also seeds with `seed + 1`.
MAX_SEED = 2**63 - 1


def _seed(value: str) -> int:
    """`--seed`: an integer from 0 to MAX_SEED (argparse names the option in its error)."""
    try:
        seed = int(value)
    except ValueError:
        seed = -1
    if not 0 <= seed <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to {MAX_SEED} (2**63-1), found {value!r}")
    return seed


def _store(value: str) -> str:
    """`--store`: a directory, or a path that does not exist yet (checked before the demo runs)."""
    from anchorkv.cli import output_dir_problem

    if "://" not in value and (problem := output_dir_problem(value)):
        raise argparse.ArgumentTypeError(problem)
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="pack/unpack one Kimi-Linear request with every codec and verify")
    p.add_argument("--tp", type=int, default=1, choices=(1, 2, 4, 8), help="tensor-parallel size")
    p.add_argument("--seed", type=_seed, default=0, metavar="N", help=f"random seed, 0 to {MAX_SEED} (default 0)")
    p.add_argument("--store", type=_store, default=None, metavar="DIR",
                   help="store directory for the save/restore cycle (default: a temporary one)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (every row, ok) on stdout; tables go to stderr")
    p.set_defaults(func=main)
