"""`anchorkv ls | inspect | verify | rm | gc`: look after a store from the shell.

    anchorkv ls [--store PATH_OR_URL] [--json]
    anchorkv inspect ENTRY [--json]
    anchorkv verify [ENTRY ...]          # every entry when none is named; exit 1 on a problem
    anchorkv rm ENTRY [ENTRY ...]
    anchorkv gc [--stale-after SECONDS] [--capacity SIZE]

`--store` defaults to the connector's default store (``~/.cache/anchorkv``); an object store
is ``s3://bucket/prefix?endpoint=http://host:9000&region=us-east-1`` (credentials from the
usual AWS environment variables). ENTRY is an entry id as `ls` shows it (``<key
prefix>/<name>``, a unique prefix of the full id is enough) or an anchor with one entry.
"""

from __future__ import annotations

import argparse
from datetime import datetime, timezone
import json
import os
import sys
import time

from anchorkv.store.errors import EntryNotFound, StoreError
from anchorkv.store.keys import normalize_anchor
from anchorkv.store.manifest import EntryInfo

SHORT_KEY = 12


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, as du -h)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_age(seconds: float) -> str:
    """Age as one unit: 42s, 7m, 5h, 3d."""
    s = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{int(s // size)}{unit}"
    return f"{int(s)}s"


def short_id(info: EntryInfo) -> str:
    return f"{info.key[:SHORT_KEY]}/{info.id.split('/', 1)[1]}"


def codecs_text(info: EntryInfo) -> str:
    """``conv=raw latent=fp8:64 recurrent=int8:128`` (raw has no group)."""
    arrays = info.arrays()
    return " ".join(f"{f}={a.codec.spec if a.codec.group else a.codec.format.value}" for f, a in sorted(arrays.items()))


def _default_store() -> str:
    from anchorkv.store.settings import DEFAULT_STORE

    return DEFAULT_STORE


def _open(args):
    from anchorkv.store.store import Store

    url = args.store or _default_store()
    if "://" not in url and not os.path.isdir(os.path.expanduser(url)):
        raise SystemExit(f"anchorkv: no store at {url} (a directory is created by the first save); "
                         "pass --store PATH_OR_URL")
    return Store.open(url)


def resolve(store, text: str, entries: list[EntryInfo] | None = None) -> EntryInfo:
    """The entry named by `text`: a full id, `<key prefix>/<name>` (as `ls` shows it), an
    anchor with exactly one entry, or a unique prefix (>= 8 characters) of an id."""
    entries = store.list() if entries is None else entries
    key_part, _, name_part = text.partition("/")
    found = [e for e in entries if e.id == text
             or (name_part and e.key.startswith(key_part) and e.id.split("/", 1)[1] == name_part)]
    if not found:
        try:
            anchor = normalize_anchor(text)
        except StoreError:
            anchor = None
        found = [e for e in entries if anchor is not None and e.anchor == anchor]
    if not found and len(text) >= 8:
        found = [e for e in entries if e.id.startswith(text)]
    if len(found) == 1:
        return found[0]
    if not found:
        raise EntryNotFound(f"no entry matches {text!r} in {store.url}; `anchorkv ls` lists them")
    raise EntryNotFound(
        f"{text!r} matches {len(found)} entries ({', '.join(short_id(e) for e in found[:4])}); "
        "give an entry id from `anchorkv ls`"
    )


def _console(stderr: bool = False):
    from rich.console import Console

    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal:  # piped: never truncate ids or codecs to 80 columns
        console = Console(stderr=stderr, highlight=False, width=max(console.width, 240))
    return console


def _progress():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=_console(stderr=True), transient=False)


def _summary(info: EntryInfo, t: float) -> dict:
    return {"id": info.id, "anchor": info.anchor, "tokens": info.num_tokens, "stored_bytes": info.stored_bytes,
            "logical_bytes": info.logical_bytes, "codecs": info.codecs, "tp": info.tp_size,
            "created": info.created, "age_s": round(t - info.created, 3)}


# ----------------------------------------------------------------------------- commands


def cmd_ls(args) -> int:
    store = _open(args)
    entries, t = store.list(), time.time()
    if args.json:
        print(json.dumps([_summary(e, t) for e in entries], indent=1))
        return 0
    from rich.table import Table

    table = Table(title=f"{store.url}: {len(entries)} entries, {human_bytes(sum(e.stored_bytes for e in entries))}")
    for col, just in (("entry", "left"), ("anchor", "left"), ("tokens", "right"), ("size", "right"),
                      ("state", "right"), ("ratio", "right"), ("codecs", "left"), ("tp", "right"), ("age", "right")):
        table.add_column(col, justify=just, no_wrap=col != "codecs")
    for e in entries:
        table.add_row(short_id(e), e.anchor or "-", f"{e.num_tokens:,}", human_bytes(e.stored_bytes),
                      human_bytes(e.logical_bytes), f"{e.stored_bytes / max(1, e.logical_bytes):.2f}",
                      codecs_text(e), str(e.tp_size), human_age(t - e.created))
    _console().print(table)
    return 0


def cmd_inspect(args) -> int:
    store = _open(args)
    info = resolve(store, args.entry)
    if args.json:
        print(json.dumps({"id": info.id, "manifest": info.manifest}, indent=1))
        return 0
    m, t = info.manifest, time.time()
    last = store.backend.last_use(info.path)
    created = datetime.fromtimestamp(info.created, timezone.utc).isoformat(timespec="seconds")
    rows = [
        ("entry", info.id), ("store", store.url), ("anchor", info.anchor or "- (token-keyed)"),
        ("prefix", f"{info.num_tokens:,} tokens, hash {info.prefix_hash[:16]}"),
        ("model", f"{m['model_fingerprint'].get('architecture', '?')}, fingerprint {info.fingerprint_hash[:16]}"),
        ("tp", f"written at tp={info.tp_size}"),
        ("size", f"{human_bytes(info.stored_bytes)} stored, {human_bytes(info.logical_bytes)} of state "
                 f"({info.stored_bytes / max(1, info.logical_bytes):.3f}x)"),
        ("codecs", codecs_text(info) + (f" + {m['compressor']['id']}" if m.get("compressor") else "")),
        ("created", f"{created} ({human_age(t - info.created)} ago)"),
        ("last use", "-" if last is None else f"{human_age(t - last)} ago"),
        ("format", f"version {m['format_version']}, {len(m['shards'])} shards of {len(m['checksums'])} chunks "
                   "(crc32c per shard and per chunk)"),
    ]
    console = _console()
    for k, v in rows:
        console.print(f"[bold]{k:>9}[/bold]  {v}")
    from rich.table import Table

    table = Table()
    for col in ("array", "kind", "layers", "shape", "chunks", "shards", "codec", "source", "stored"):
        table.add_column(col)
    for name, a in info.arrays().items():
        stored = sum(v[1] for k, v in m["shards"].items() if k.startswith(f"{name}/"))
        codec = str(a.codec.spec) if a.codec.group else a.codec.format.value
        table.add_row(name, a.kind, str(len(a.layers)), str(list(a.shape)), str(list(a.chunks)),
                      str(list(a.shards)), codec,
                      a.codec.source_dtype, human_bytes(stored))
    console.print(table)
    return 0


def cmd_verify(args) -> int:
    store = _open(args)
    entries = store.list()
    chosen = [resolve(store, e, entries) for e in args.entry] if args.entry else entries
    problems: list[str] = []
    with _progress() as bar:
        total = sum(len(a.all_shards()) for e in chosen for a in e.arrays().values())
        task = bar.add_task(f"verify {len(chosen)} entries", total=total)
        for e in chosen:
            problems += store.verify(e, progress=lambda n: bar.advance(task, n))
    console = _console()
    for p in problems:
        console.print(f"[red]FAIL[/red] {p}")
    bad = len({p.split(":", 1)[0] for p in problems})
    console.print(f"{len(chosen) - bad} of {len(chosen)} entries ok" + (f", {bad} damaged: delete them "
                  "(anchorkv rm ENTRY); the next request recomputes" if bad else ""))
    return 1 if problems else 0


def cmd_rm(args) -> int:
    store = _open(args)
    entries = store.list()
    chosen = [resolve(store, e, entries) for e in args.entry]
    for e in chosen:
        store.delete(e)
        print(f"deleted {e.id} ({e.anchor or 'token-keyed'}, {e.num_tokens:,} tokens, {human_bytes(e.stored_bytes)})")
    return 0


def cmd_gc(args) -> int:
    store = _open(args)
    if args.capacity is not None:
        from anchorkv.store.settings import parse_size

        store.capacity_bytes = parse_size(args.capacity, "--capacity")
    with _progress() as bar:
        task = bar.add_task("gc: abandoned writes", total=None)
        report = store.gc(stale_after=args.stale_after, progress=lambda step, n: bar.advance(task, n))
        bar.update(task, total=bar.tasks[0].completed, description="gc")
    print(" ".join(f"{k}={v}" for k, v in report.items()))
    return 0


def _run(fn):
    def run(args) -> int:
        try:
            return fn(args)
        except StoreError as e:
            print(f"anchorkv {args.command}: {e}", file=sys.stderr)
            return 2

    return run


def register(sub: argparse._SubParsersAction) -> None:
    def add(name: str, fn, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.add_argument("--store", metavar="PATH_OR_URL", default=None,
                       help="local directory or s3://bucket/prefix (default: ~/.cache/anchorkv)")
        p.set_defaults(func=_run(fn))
        return p

    p = add("ls", cmd_ls, "list the entries of a store (size, anchor, tokens, codecs, tp, age)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = add("inspect", cmd_inspect, "show one entry's manifest and arrays")
    p.add_argument("entry", metavar="ENTRY", help="entry id (as `ls` shows it) or anchor")
    p.add_argument("--json", action="store_true", help="print the whole manifest as JSON")
    p = add("verify", cmd_verify, "read every shard and check its crc32c (exit 1 on a problem)")
    p.add_argument("entry", metavar="ENTRY", nargs="*", help="entries to check (default: all)")
    p = add("rm", cmd_rm, "delete entries")
    p.add_argument("entry", metavar="ENTRY", nargs="+")
    p = add("gc", cmd_gc, "remove abandoned writes, stale leases, duplicates; evict to --capacity")
    p.add_argument("--stale-after", type=float, default=3600.0, metavar="SECONDS",
                   help="unfinished writes older than this are abandoned (default 3600)")
    p.add_argument("--capacity", default=None, metavar="SIZE", help="evict LRU entries down to SIZE (e.g. 200GB)")
