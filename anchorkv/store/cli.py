"""`anchorkv ls | inspect | verify | rm | gc | stats`: look after a store from the shell.

    anchorkv ls [--store PATH_OR_URL] [--json]
    anchorkv inspect ENTRY [--json]
    anchorkv verify [ENTRY ...] [--json]   # every entry when none is named; exit 1 on a problem
    anchorkv rm ENTRY [ENTRY ...] [--json]
    anchorkv gc [--stale-after SECONDS] [--capacity SIZE] [--verify] [--dry-run] [--json]
    anchorkv stats [STORE] [--capacity SIZE] [--json]   # totals: entries, tokens, bytes by field/codec

`--store` defaults to the connector's default store (``~/.cache/anchorkv``); an object store
is ``s3://bucket/prefix?endpoint=http://host:9000&region=us-east-1`` (credentials from the
usual AWS environment variables). ENTRY is an entry id exactly as `ls` prints it, a unique
prefix of one (8 characters or more), ``<key prefix>/<name>``, or an anchor with one entry.

`ls`, `inspect` and `verify` only read: they never create or change anything in the store.
No command creates a store: one given a directory or prefix that holds none (a typo) says so
and touches nothing there.
Sizes are binary units (KiB, MiB, GiB) everywhere. Errors are one or two lines (what was
expected, what was found, what to do), never a traceback; the exit status is 2 (1: `verify`
found damage).

This module imports nothing heavy at import time (`anchorkv --help` does not import torch).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from anchorkv.store.errors import EntryNotFound, StoreError

if TYPE_CHECKING:
    from rich.console import JustifyMethod

    from anchorkv.store.format import ArrayLayout
    from anchorkv.store.manifest import EntryInfo, Listing
    from anchorkv.store.store import Store


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


def codec_text(array: ArrayLayout) -> str:
    """``raw``, ``int8:16``, ``fp8:whole`` (a group of the whole last axis); a plug-in's id marked
    ``lowrank(plug-in)``, or ``lowrank(plug-in MISSING)`` when it is not installed here."""
    c = array.codec
    if c.plugin:
        return f"{c.id}(plug-in{'' if c.installed else ' MISSING'})"
    if c.group is None:
        return c.format.value
    return f"{c.format.value}:{'whole' if c.group == array.shape[-1] else c.group}"


def codecs_text(info: EntryInfo) -> str:
    """``conv=int8:8 latent=fp8:whole recurrent=int8:16``."""
    return " ".join(f"{f}={codec_text(a)}" for f, a in sorted(info.arrays().items()))


def _escape(text: str) -> str:
    """`text` with rich markup escaped (a plug-in's options may hold brackets)."""
    from rich.markup import escape

    return escape(text)


def missing_plugins(info: EntryInfo) -> list[str]:
    """The codec plug-ins an entry needs that are not installed here (sorted ids)."""
    return sorted({a.codec.id for a in info.arrays().values() if a.codec.plugin and not a.codec.installed})


def _default_store() -> str:
    from anchorkv.store.settings import DEFAULT_STORE

    return DEFAULT_STORE


def _open(args: argparse.Namespace, *, write: bool = False) -> Store:
    """The store of `--store`, which must exist: no command makes one, so `gc` or `rm` given a
    mistyped directory refuses it rather than making it a store and collecting its own
    ``.staging`` and ``.trash`` (found by review). `write`: check that it is writable first
    (a probe object), so a read-only store fails before any work."""
    from anchorkv.store.store import Store

    url = args.store or _default_store()
    store = Store.open(url, create=False)
    if write:
        store.check_writable()
    return store


def resolve(store: Store, text: str, entries: list[Listing] | None = None) -> Listing:
    """The `Listing` named by `text`: a full id (as `ls` prints it), ``<key prefix>/<name>``,
    an anchor with exactly one entry, or a unique prefix (>= 8 characters) of an id."""
    entries = store.scan() if entries is None else entries
    text = text.strip()
    key_part, _, name_part = text.partition("/")
    found = [e for e in entries if e.id == text]
    if not found and name_part:
        found = [e for e in entries if e.key.startswith(key_part) and e.id.split("/", 1)[1] == name_part]
    if not found:
        from anchorkv.store.keys import normalize_anchor

        try:
            anchor = normalize_anchor(text)
        except StoreError:
            anchor = None
        found = [e for e in entries if anchor is not None and e.info is not None and e.info.anchor == anchor]
    if not found and len(text) >= 8:
        found = [e for e in entries if e.id.startswith(text)]
    if len(found) == 1:
        return found[0]
    if not found:
        raise EntryNotFound(f"no entry matches {text!r} in {store.url} (expected an entry id, a unique prefix of "
                            "8+ characters or an anchor); `anchorkv ls` lists them")
    raise EntryNotFound(
        f"{text!r} matches {len(found)} entries ({', '.join(e.id for e in found[:3])}); "
        "give a full entry id from `anchorkv ls`"
    )


def _console(stderr: bool = False):
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:  # (rich's exits 1, which for verify means "damaged found")
            self.quiet = True
            raise BrokenPipeError  # the top-level CLI ends quietly with 141, as `ls --json | head` does

    console = _Console(stderr=stderr, highlight=False)
    if not console.is_terminal:  # piped: never truncate ids or codecs to 80 columns
        console = _Console(stderr=stderr, highlight=False, width=max(console.width, 320))
    return console


def _progress(enabled: bool = True):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=_console(stderr=True), transient=False, disable=not enabled)


def _summary(e: Listing, t: float) -> dict:
    """One entry as `ls --json` gives it (sizes in bytes, times in seconds)."""
    out = {"id": e.id, "state": e.state, "stored_bytes": e.stored_bytes, "created": e.created,
           "age_s": round(t - e.created, 3)}
    if e.info is None:
        return {**out, "problem": e.problem}
    i = e.info
    return {**out, "anchor": i.anchor, "tokens": i.num_tokens, "logical_bytes": i.logical_bytes,
            "codecs": {f: codec_text(a) for f, a in sorted(i.arrays().items())}, "tp": i.tp_size,
            "missing_plugins": missing_plugins(i)}


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=1))


# ----------------------------------------------------------------------------- commands


def cmd_ls(args: argparse.Namespace) -> int:
    store = _open(args)
    entries, t = store.scan(), time.time()
    if args.json:
        _print_json({"store": store.url, "entries": [_summary(e, t) for e in entries],
                     "stored_bytes": sum(e.stored_bytes for e in entries)})
        return 0
    from rich.table import Table

    unreadable = sum(e.state == "unreadable" for e in entries)
    bad = sum(e.state not in ("ok", "unreadable") for e in entries)
    missing = {e.id: missing_plugins(e.info) for e in entries if e.info is not None}
    needy = {m for ids in missing.values() for m in ids}
    title = (f"{_escape(store.url)}: {len(entries)} entries, {human_bytes(sum(e.stored_bytes for e in entries))} stored"
             + (f" ({bad} not loadable: `anchorkv gc` removes damaged and old-format ones)" if bad else "")
             + (f" ({unreadable} unreadable by this user or disk: kept; check their permissions)" if unreadable else "")
             + (f" ({sum(bool(v) for v in missing.values())} need codec plug-ins not installed here: "
                f"{_escape(', '.join(sorted(needy)))}; their loads fail until installed)" if needy else ""))
    table = Table(title=title)
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("entry", "left"), ("state", "left"), ("anchor", "left"), ("tokens", "right"), ("stored", "right"),
        ("logical", "right"), ("ratio", "right"), ("codecs", "left"), ("tp", "right"), ("age", "right"))
    for col, just in columns:
        table.add_column(col, justify=just, no_wrap=col not in ("codecs",), overflow="fold")
    for e in entries:
        if e.info is None:
            table.add_row(_escape(e.id), e.state, "-", "-", human_bytes(e.stored_bytes), "-", "-", "-", "-",
                          human_age(t - e.created))
            continue
        i = e.info
        table.add_row(_escape(e.id), e.state + (" (plug-in missing)" if missing[e.id] else ""), i.anchor or "-",
                      f"{i.num_tokens:,}", human_bytes(i.stored_bytes),
                      human_bytes(i.logical_bytes), f"{i.stored_bytes / max(1, i.logical_bytes):.2f}",
                      _escape(codecs_text(i)), str(i.tp_size), human_age(t - i.created))
    _console().print(table)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    store = _open(args)
    e = resolve(store, args.entry)
    if e.info is None:
        if args.json:
            _print_json({"id": e.id, "state": e.state, "problem": e.problem, "stored_bytes": e.stored_bytes})
        else:
            print(f"entry {e.id}\nstate    {e.state}: {e.problem}\nstored   {human_bytes(e.stored_bytes)} "
                  "on disk; `anchorkv rm` or `anchorkv gc` removes it")
        return 0
    info = e.info
    if args.json:
        _print_json({"id": info.id, "state": e.state, "missing_plugins": missing_plugins(info),
                     "manifest": info.manifest})
        return 0
    m, t = info.manifest, time.time()
    last = store.backend.last_use(info.path)
    created = datetime.fromtimestamp(info.created, timezone.utc).isoformat(timespec="seconds")
    rows = [
        ("entry", info.id), ("store", store.url), ("anchor", info.anchor or "- (token-keyed)"),
        ("prefix", f"{info.num_tokens:,} tokens, hash {info.prefix_hash[:16]}"),
        ("model", f"{m['model_fingerprint'].get('architecture', '?')}, fingerprint {info.fingerprint_hash[:16]}"),
        ("tp", f"written at tp={info.tp_size}"),
        ("size", f"{human_bytes(info.stored_bytes)} stored, {human_bytes(info.logical_bytes)} logical (the state "
                 f"uncompressed; ratio {info.stored_bytes / max(1, info.logical_bytes):.3f})"),
        ("codecs", codecs_text(info) + (f" + {m['compressor']['id']}" if m.get("compressor") else "")),
        *[("plug-in", f"{f}: {a.codec.spec} "
                      + ("(installed)" if a.codec.installed else "NOT INSTALLED here: loading this entry fails (vLLM "
                         "recomputes) until the package providing it is installed (entry-point group anchorkv.codecs)"))
          for f, a in sorted(info.arrays().items()) if a.codec.plugin],
        ("created", f"{created} ({human_age(t - info.created)} ago)"),
        ("last use", "-" if last is None else f"{human_age(t - last)} ago"),
        ("format", f"version {m['format_version']}, {len(m['shards'])} shards of {len(m['checksums'])} chunks "
                   "(crc32c per shard and per chunk; manifest checksum)"),
    ]
    console = _console()
    for k, v in rows:  # the values hold the store's text (a path, a manifest's strings): no markup in them
        console.print(f"[bold]{k:>9}[/bold]  {_escape(v)}")
    from rich.table import Table

    table = Table()
    for col in ("array", "role", "dtype", "kind", "layers", "shape", "chunks", "shards", "codec", "source", "stored"):
        table.add_column(col)
    for a in info.arrays().values():
        for p in a.parts:
            stored = sum(v[1] for k, v in m["shards"].items() if k.startswith(f"{p.name}/"))
            table.add_row(*map(_escape, (p.name, p.role, p.dtype, a.kind, str(len(a.layers)), str(list(p.shape)),
                                         str(list(p.chunks)), str(list(p.shards)), codec_text(a),
                                         a.codec.source_dtype, human_bytes(stored))))
    console.print(table)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    store = _open(args)
    entries = store.scan()
    chosen = [resolve(store, e, entries) for e in args.entry] if args.entry else entries
    results: list[tuple] = []
    ok_infos = [e.info for e in chosen if e.info is not None]
    with _progress(enabled=not args.json) as bar:
        total = sum(len(a.all_shards()) * len(a.parts) for i in ok_infos for a in i.arrays().values())
        task = bar.add_task(f"verify {len(chosen)} entries", total=total)
        for e in chosen:
            if e.info is None:
                results.append((e, [f"{e.state}: {e.problem}"]))
            else:
                found = store.verify(e.info, progress=lambda n: bar.advance(task, n))
                results.append((e, [p.removeprefix(f"entry {e.id}: ") for p in found]))
    bad = [(e, p) for e, p in results if p]
    if args.json:
        _print_json({"store": store.url, "ok": not bad, "checked": len(results),
                     "entries": [{"id": e.id, "state": "ok" if not p else ("damaged" if e.state == "ok" else e.state),
                                  "problems": p} for e, p in results]})
        return 1 if bad else 0
    console = _console()
    for e, problems in bad:  # problems quote the store's text ('[crc32c, nbytes, offset]', a manifest's): no markup
        console.print(f"[red]FAIL[/red] {_escape(e.id)}")
        for p in problems:
            console.print(f"  {p}", soft_wrap=True, markup=False)
    unread = sum(e.state == "unreadable" for e, _ in bad)
    judged = len(bad) - unread
    console.print(f"{len(results) - len(bad)} of {len(results)} entries ok" + (
        f", {judged} damaged or unloadable: delete them (anchorkv rm ENTRY, or anchorkv gc --verify: it checks "
        "every entry as verify does and removes those that fail); the next request recomputes" if judged else "") + (
        f", {unread} not checked: their manifest cannot be read by this user or disk (fix the permissions, or "
        "run as the user who wrote them; nothing is deleted)" if unread else ""),
        markup=False)
    return 1 if bad else 0


def cmd_rm(args: argparse.Namespace) -> int:
    store = _open(args, write=True)
    entries = store.scan()
    chosen = list({e.id: e for e in (resolve(store, e, entries) for e in args.entry)}.values())  # (named twice: once)
    done = []
    for e in chosen:
        store.delete(e.id)
        done.append(e)
        if not args.json:
            what = f"{e.info.anchor or 'token-keyed'}, {e.info.num_tokens:,} tokens" if e.info else e.state
            print(f"deleted {e.id} ({what}, {human_bytes(e.stored_bytes)})")
    if args.json:
        _print_json({"deleted": [{"id": e.id, "state": e.state, "bytes": e.stored_bytes} for e in done],
                     "freed_bytes": sum(e.stored_bytes for e in done)})
    return 0


def _capacity(text: str) -> int:
    from anchorkv.store.settings import parse_size

    try:
        number = float(text)  # a number of bytes (1e9 too)
    except ValueError:
        number = None
    if number == 0:
        return 0  # evict every entry not in use
    try:
        return parse_size(text if number is None else number, "--capacity")
    except ValueError as e:
        raise ValueError(f"{e} (or 0: evict every entry not in use)") from None


def cmd_gc(args: argparse.Namespace) -> int:
    capacity = None if args.capacity is None else _capacity(args.capacity)
    store = _open(args, write=not args.dry_run)
    if capacity is not None:
        store.capacity_bytes = capacity
    with _progress(enabled=not args.json) as bar:
        task = bar.add_task("gc", total=None)
        report = store.gc(stale_after=args.stale_after, dry_run=args.dry_run, verify=args.verify,
                          progress=lambda step, n: bar.advance(task, n))
        bar.update(task, total=bar.tasks[0].completed)
    if args.json:
        _print_json(report)
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for r in report["removed"]:
        print(f"{verb} {r['kind']}: {r['what']}" + (f" ({human_bytes(r['bytes'])})" if r["bytes"] else ""))
    counts = " ".join(f"{k}={v}" for k, v in report.items() if isinstance(v, int) and not isinstance(v, bool)
                      and k != "freed_bytes")
    print(f"gc{' (dry run)' if args.dry_run else ''}: {verb} {len(report['removed'])} items, "
          f"{'would free' if args.dry_run else 'freed'} {human_bytes(report['freed_bytes'])}; {counts}")
    return 0


def store_totals(store: Store, capacity: int | None = None) -> dict:
    """The totals of a store as `stats --json` gives them (sizes in bytes, times in seconds
    since the epoch): entries by state, tokens, stored and logical bytes, stored bytes per
    field and codec, the oldest and newest entry, and the usage of `capacity` if given."""
    entries = store.scan()
    ok = [e.info for e in entries if e.info is not None]
    states: dict[str, int] = {}
    for e in entries:
        states[e.state] = states.get(e.state, 0) + 1
    fields: dict[tuple[str, str], dict] = {}
    for i in ok:
        shards = i.manifest["shards"]
        for name, a in i.arrays().items():
            row = fields.setdefault((name, codec_text(a)), {"field": name, "codec": codec_text(a), "entries": 0,
                                                            "stored_bytes": 0})
            row["entries"] += 1
            row["stored_bytes"] += sum(v[1] for k, v in shards.items() for p in a.parts if k.startswith(f"{p.name}/"))
    stored = sum(e.stored_bytes for e in entries)
    out = {
        "store": store.url, "entries": len(entries), "states": states,
        "anchored": sum(i.anchor is not None for i in ok), "token_keyed": sum(i.anchor is None for i in ok),
        "tokens": sum(i.num_tokens for i in ok), "stored_bytes": stored,
        # what gc removes (damaged, old-format; not newer-format or unreadable entries, which it keeps)
        "unloadable_bytes": sum(e.stored_bytes for e in entries if e.state in ("damaged", "old-format")),
        "logical_bytes": sum(i.logical_bytes for i in ok),
        "by_field": sorted(fields.values(), key=lambda r: (r["field"], -r["stored_bytes"])),
        "tp_sizes": sorted({i.tp_size for i in ok}),
        "oldest": min((e.created for e in entries), default=None),
        "newest": max((e.created for e in entries), default=None),
        "capacity_bytes": capacity,
    }
    if capacity is not None:
        out["capacity_used"] = round(stored / capacity, 4) if capacity else None
    return out


def cmd_stats(args: argparse.Namespace) -> int:
    if args.store_arg and args.store and args.store_arg != args.store:
        raise ValueError(f"two stores given ({args.store_arg!r} and --store {args.store!r}); give one")
    args.store = args.store or args.store_arg
    capacity = None if args.capacity is None else _capacity(args.capacity)
    store = _open(args)
    totals = store_totals(store, capacity)
    if args.json:
        _print_json(totals)
        return 0
    t, n = time.time(), totals["entries"]
    console = _console()
    states = ", ".join(f"{v} {k}" for k, v in sorted(totals["states"].items()))
    logical = totals["logical_bytes"]
    rows = [
        ("store", store.url),
        ("entries", f"{n:,}" + (f" ({states}; {totals['anchored']:,} anchored, {totals['token_keyed']:,} token-keyed)"
                                if n else "")),
        ("tokens", f"{totals['tokens']:,}"),
        ("stored", human_bytes(totals["stored_bytes"]) + (
            f" ({human_bytes(totals['unloadable_bytes'])} in damaged and old-format entries: `anchorkv gc` "
            "removes them)"
            if totals["unloadable_bytes"] else "")),
        ("logical", f"{human_bytes(logical)} (ratio {totals['stored_bytes'] / logical:.3f})" if logical else "-"),
        ("tp", ", ".join(map(str, totals["tp_sizes"])) or "-"),
        ("oldest", "-" if totals["oldest"] is None else f"{human_age(t - totals['oldest'])} ago"),
        ("newest", "-" if totals["newest"] is None else f"{human_age(t - totals['newest'])} ago"),
    ]
    if capacity is None:
        rows.append(("capacity", "not given (--capacity SIZE: the connector's 'capacity' setting)"))
    else:
        used = totals["capacity_used"]
        rows.append(("capacity", f"{human_bytes(capacity)}, "
                                 + (f"{100 * used:.1f}% used" if used is not None else "0: every entry is evictable")
                                 + (" (over: the next save evicts, or `anchorkv gc --capacity`)"
                                    if used is not None and used > 1 else "")))
    for k, v in rows:
        console.print(f"[bold]{k:>9}[/bold]  {_escape(v)}", soft_wrap=True)
    if totals["by_field"]:
        from rich.table import Table

        table = Table(title="stored bytes by field and codec")
        columns: tuple[tuple[str, JustifyMethod], ...] = (
            ("field", "left"), ("codec", "left"), ("entries", "right"), ("stored", "right"), ("share", "right"))
        for col, just in columns:
            table.add_column(col, justify=just)
        for r in totals["by_field"]:
            table.add_row(_escape(r["field"]), _escape(r["codec"]), f"{r['entries']:,}", human_bytes(r["stored_bytes"]),
                          f"{100 * r['stored_bytes'] / max(1, totals['stored_bytes']):.1f}%")
        console.print(table)
    return 0


def report_error(command: str, e: BaseException, url: str | None) -> int:
    """Print a user error as one or two lines on stderr; the exit status."""
    from anchorkv.store.errors import explain

    msg = str(e) if isinstance(e, (StoreError, ValueError)) else explain(e, url or "the store")
    print(f"anchorkv {command}: {msg}", file=sys.stderr)
    return 2


def _run(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except BrokenPipeError:  # (stdout closed by its reader, e.g. `| head`: the top-level CLI ends quietly)
            raise
        except (StoreError, ValueError, OSError, ImportError) as e:
            return report_error(args.command, e, args.store or _default_store())

    return run


def _seconds(text: str) -> float:
    """`--stale-after`'s value: a number of seconds >= 0 (inf: never stale)."""
    from anchorkv.store.eviction import check_stale_after

    try:
        return check_stale_after(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0 (e.g. 3600; 0: every unfinished "
                                         f"write, alive or not), found {text!r}") from None


def register(sub: argparse._SubParsersAction) -> None:
    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("--store", metavar="PATH_OR_URL", default=None,
                       help="local directory or s3://bucket/prefix (default: ~/.cache/anchorkv)")
        p.add_argument("--json", action="store_true", help="machine-readable output (sizes in bytes)")
        p.set_defaults(func=_run(fn))
        return p

    add("ls", cmd_ls, "list every entry of a store: state, anchor, tokens, stored and logical size, codecs, tp, age")
    p = add("inspect", cmd_inspect, "show one entry's manifest and arrays")
    p.add_argument("entry", metavar="ENTRY", help="entry id (as `ls` prints it), a unique prefix, or an anchor")
    p = add("verify", cmd_verify, "re-read every shard and check the manifest, every chunk's crc32c and the "
            "shard indexes (exit 1 naming each damaged entry)")
    p.add_argument("entry", metavar="ENTRY", nargs="*", help="entries to check (default: all)")
    p = add("rm", cmd_rm, "delete entries (damaged and other-format ones too)")
    p.add_argument("entry", metavar="ENTRY", nargs="+")
    p = add("gc", cmd_gc, "remove abandoned writes, stale leases, duplicates, damaged and old-format entries, "
            "empty directories; evict LRU entries down to --capacity")
    p.add_argument("--stale-after", type=_seconds, default=3600.0, metavar="SECONDS",
                   help="unfinished writes older than this are abandoned (default 3600)")
    p.add_argument("--capacity", default=None, metavar="SIZE",
                   help="evict LRU entries down to SIZE (e.g. 200GiB, 500MB; 0: every entry not in use)")
    p.add_argument("--verify", action="store_true",
                   help="also read every entry as `verify` does and remove those that fail (a damaged shard)")
    p.add_argument("--dry-run", action="store_true", help="remove nothing; print what would be removed")
    p = add("stats", cmd_stats, "the store's totals: entries, tokens, stored and logical bytes, bytes by field "
            "and codec, oldest and newest entry, usage of --capacity")
    p.add_argument("store_arg", metavar="STORE", nargs="?", default=None, help="the store (as --store)")
    p.add_argument("--capacity", default=None, metavar="SIZE",
                   help="the capacity to compare the usage with (the connector's 'capacity', e.g. 200GiB)")


#: (name, help) of the commands `register` adds, for `anchorkv --help` without importing this module's users.
COMMANDS = (
    ("ls", "list the entries of a store"),
    ("inspect", "show one entry's manifest and arrays"),
    ("verify", "check entries (exit 1 on damage)"),
    ("rm", "delete entries"),
    ("gc", "remove garbage; evict to --capacity"),
    ("stats", "a store's totals"),
)


def main(argv: list[str] | None = None) -> int:
    """The store's commands alone (`python -m anchorkv.store.cli ls`), as the `anchorkv` command
    runs them (`anchorkv.cli` imports this module, so this one does not import it back)."""
    parser = argparse.ArgumentParser(prog="anchorkv", description="The store's commands of anchorkv.")
    register(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (StoreError, ValueError, OSError) as e:
        return report_error(args.command, e, getattr(args, "store", None))


if __name__ == "__main__":
    sys.exit(main())
