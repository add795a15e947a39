"""`anchorkv ls | inspect | verify | rm | gc` on a real local store: output, ids as printed,
--json everywhere, user errors as one or two lines (never a traceback), read-only commands
that write nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from anchorkv.cli import main
from anchorkv.store.cli import human_age, human_bytes
from anchorkv.store.paths import STAGING
from anchorkv.store.store import Store
from tests.store.helpers import CODECS, RAW_CODECS, all_packed, tiny_layout, tokens

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def filled(tmp_path):
    """A store with two entries: anchor 'alice-software-tokyo' (quantized) and 'bob' (raw)."""
    path = tmp_path / "store"
    layout = tiny_layout()
    with Store.open(path) as store:
        a = store.save(layout, CODECS, tokens(700), all_packed(layout, CODECS, 700), anchor="alice-software-tokyo")
        b = store.save(layout, RAW_CODECS, tokens(300), all_packed(layout, RAW_CODECS, 300), anchor="bob")
    return str(path), a, b


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_human_units():
    assert [human_bytes(n) for n in (0, 1023, 1536, 105 * 2**20, 3 * 2**40)] == [
        "0 B", "1023 B", "1.5 KiB", "105.0 MiB", "3.0 TiB"]
    assert [human_age(s) for s in (3, 125, 7200, 3 * 86400 + 5)] == ["3s", "2m", "2h", "3d"]


def test_ls_shows_entries(filled, capsys):
    path, a, b = filled
    code, out, _ = run(capsys, "ls", "--store", path)
    assert code == 0
    header = next(line for line in out.splitlines() if "entry" in line and "state" in line)
    assert [c.strip() for c in header.strip("┃│ ").split("┃")] == [
        "entry", "state", "anchor", "tokens", "stored", "logical", "ratio", "codecs", "tp", "age"]
    for info, codecs in ((a, "conv=int8:8 latent=fp8:whole recurrent=int8:whole"),
                         (b, "conv=raw latent=raw recurrent=raw")):
        line = next((row for row in out.splitlines() if info.id in row), None)  # the full id, as `inspect` takes it
        assert line is not None, f"ls does not show {info.id} whole:\n{out}"
        for want in (" ok ", info.anchor, f"{info.num_tokens:,}", human_bytes(info.stored_bytes),
                     human_bytes(info.logical_bytes), codecs, "0s"):
            assert want in line, f"expected {want!r} in the ls row of {info.anchor}, found: {line}"
    assert "2 entries" in out
    code, out, _ = run(capsys, "ls", "--store", path, "--json")
    rows = json.loads(out)["entries"]
    assert {r["id"] for r in rows} == {a.id, b.id} and {r["state"] for r in rows} == {"ok"}
    assert {r["tokens"] for r in rows} == {700, 300} and {r["tp"] for r in rows} == {1}
    assert {r["stored_bytes"] for r in rows} == {a.stored_bytes, b.stored_bytes}


def test_inspect_by_printed_id_short_id_and_anchor(filled, capsys):
    path, a, _ = filled
    code, out, _ = run(capsys, "ls", "--store", path)
    printed = next(w for line in out.splitlines() for w in line.split() if w.startswith(a.key))
    assert printed == a.id
    short = f"{a.key[:12]}/{a.id.split('/')[1]}"
    for ref in (printed, short, a.id[:10]):
        code, out, _ = run(capsys, "inspect", ref, "--store", path)
        assert code == 0 and a.id in out, (ref, out)
    for want in (a.id, "alice-software-tokyo", "700 tokens", "TinyHybrid", "tp=1", "recurrent", "[3, 8, 16, 16]",
                 "recurrent_scales", "int8:whole", "bfloat16", human_bytes(a.stored_bytes)):
        assert want in out, f"expected {want!r} in inspect output:\n{out}"
    code, out, _ = run(capsys, "inspect", "<Alice-Software-Tokyo/>", "--store", path, "--json")
    assert code == 0 and json.loads(out)["manifest"]["num_tokens"] == 700
    code, _, err = run(capsys, "inspect", "nobody", "--store", path)
    assert code == 2 and "no entry matches 'nobody'" in err


def test_verify_reports_corruption_and_exits_1(filled, capsys):
    path, a, b = filled
    code, out, err = run(capsys, "verify", "--store", path)
    assert code == 0 and "2 of 2 entries ok" in out, out
    assert "verify 2 entries" in err  # the progress bar
    chunk = Path(path) / a.path / "latent" / "c.1.0.0"
    data = bytearray(chunk.read_bytes())
    data[10] ^= 0xFF
    chunk.write_bytes(bytes(data))
    code, out, _ = run(capsys, "verify", "--store", path)
    assert code == 1
    assert f"FAIL {a.id}" in out and "shard latent/c.1.0.0 fails its check" in out and "1 of 2 entries ok" in out, out
    assert "damaged chunks: latent/c.1.0.0" in " ".join(out.split()), out
    code, out, _ = run(capsys, "verify", "bob", "--store", path)
    assert code == 0 and "1 of 1 entries ok" in out
    code, out, _ = run(capsys, "verify", "--store", path, "--json")
    report = json.loads(out)
    assert code == 1 and not report["ok"]
    assert {e["id"]: e["state"] for e in report["entries"]} == {a.id: "damaged", b.id: "ok"}


def test_rm_deletes(filled, capsys):
    path, a, b = filled
    code, out, _ = run(capsys, "rm", "bob", "--store", path)
    assert code == 0 and f"deleted {b.id}" in out
    assert [e.id for e in Store.open(path).list()] == [a.id]
    code, _, err = run(capsys, "rm", "bob", "--store", path)
    assert code == 2 and "no entry matches" in err
    code, out, _ = run(capsys, "rm", a.id, "--store", path, "--json")
    assert code == 0 and json.loads(out) == {"deleted": [{"id": a.id, "state": "ok", "bytes": a.stored_bytes}],
                                             "freed_bytes": a.stored_bytes}
    assert os.listdir(Path(path) / "entries") == ["zarr.json"], "rm leaves no empty key directory"


def test_gc_removes_abandoned_writes_and_evicts(filled, capsys):
    path, a, b = filled
    store = Store.open(path)
    layout = tiny_layout()
    w = store.begin_entry(layout, CODECS, tokens(700), anchor="abandoned")
    w.write_layer("model.layers.0.attn", "conv", all_packed(layout, CODECS, 700)[("model.layers.0.attn", "conv")])
    assert store.backend.list_dir(STAGING), "the abandoned write staged nothing"
    code, out, _ = run(capsys, "gc", "--store", path)  # young: presumed alive
    assert code == 0 and "abandoned_writes=0" in out
    capacity = a.stored_bytes + b.stored_bytes - 1  # one must go: a, the least recently used
    before = sorted(p for p in Path(path).rglob("*"))
    code, out, err = run(capsys, "gc", "--store", path, "--stale-after", "0", "--capacity", str(capacity), "--dry-run")
    assert code == 0 and "would remove abandoned_writes" in out and f"would remove evicted: entry {a.id}" in out, out
    assert sorted(p for p in Path(path).rglob("*")) == before, "--dry-run changed the store"
    code, out, err = run(capsys, "gc", "--store", path, "--stale-after", "0", "--capacity", str(capacity))
    assert code == 0 and "abandoned_writes=1" in out and "evicted=1" in out, out
    assert f"removed evicted: entry {a.id}" in out
    assert "gc: removed 2 items, freed" in out, out
    assert store.backend.list_dir(STAGING) == []
    assert [e.id for e in Store.open(path).list()] == [b.id]
    code, out, _ = run(capsys, "gc", "--store", path, "--capacity", "0", "--json")
    report = json.loads(out)
    assert code == 0 and report["evicted"] == 1 and report["freed_bytes"] == b.stored_bytes
    assert Store.open(path).list() == [] and os.listdir(Path(path) / "entries") == ["zarr.json"]


def test_damaged_and_other_format_entries_are_listed_counted_and_collected(filled, capsys):
    """An unreadable manifest, a flipped digit and an old format version: all listed with their
    state, counted in usage, removable by id, collected by gc (with their empty directories)."""
    path, a, b = filled
    store = Store.open(path)
    layout = tiny_layout()
    c = store.save(layout, CODECS, tokens(500), all_packed(layout, CODECS, 500), anchor="carol")
    total = a.stored_bytes + b.stored_bytes + c.stored_bytes
    meta_a, meta_b, meta_c = (Path(path) / e.path / "zarr.json" for e in (a, b, c))
    meta_a.write_text(meta_a.read_text().replace('"fp8"', '"fr8"'))
    for meta, old, new in ((meta_b, '"num_tokens":300', '"num_tokens":320'),  # (compact JSON)
                           (meta_c, f'"format_version":{c.manifest["format_version"]}', '"format_version":2')):
        assert old in meta.read_text()
        meta.write_text(meta.read_text().replace(old, new))
    code, out, _ = run(capsys, "ls", "--store", path, "--json")
    rows = {r["id"]: r for r in json.loads(out)["entries"]}
    assert {k: r["state"] for k, r in rows.items()} == {a.id: "damaged", b.id: "damaged", c.id: "old-format"}
    assert "fr8" in rows[a.id]["problem"] and "num_tokens is 320, the entry name says 300" in rows[b.id]["problem"]
    assert Store.open(path).usage() >= total
    code, out, _ = run(capsys, "verify", "--store", path)
    assert code == 1 and all(f"FAIL {e.id}" in out for e in (a, b, c)) and "0 of 3 entries ok" in out, out
    code, out, _ = run(capsys, "rm", b.id, "--store", path)
    assert code == 0 and f"deleted {b.id} (damaged" in out
    code, out, _ = run(capsys, "gc", "--store", path)
    assert code == 0 and "damaged=1" in out and "old_format=1" in out and "empty_dirs=" in out, out
    assert Store.open(path).scan() == [] and os.listdir(Path(path) / "entries") == ["zarr.json"]


def _no_traceback(res) -> None:
    lines = res.stderr.strip().splitlines()
    assert "Traceback" not in res.stderr and 1 <= len(lines) <= 2, res.stderr
    assert res.returncode == 2, (res.returncode, res.stderr)


@pytest.mark.parametrize("argv,expect", [
    (["gc", "--capacity", "10XB"], "--capacity must be a size like 200GB"),
    (["ls", "--store", "{tmp}/nope"], "no store at"),
    (["ls", "--store", "{tmp}/afile"], "is a file, not a store directory"),
    (["inspect", "x", "--store", "gs://bucket/p"], "found scheme gs://"),
    (["verify", "--store", "{tmp}/notastore"], "is not an anchorkv store"),
    (["rm", "nobody", "--store", "{store}"], "no entry matches 'nobody'"),
])
def test_user_errors_are_one_or_two_lines(filled, tmp_path, argv, expect):
    path, _, _ = filled
    (tmp_path / "afile").write_text("x")
    (tmp_path / "notastore").mkdir()
    argv = [a.format(tmp=tmp_path, store=path) for a in argv]
    if "--store" not in argv:
        argv += ["--store", path]
    before = sorted(tmp_path.rglob("*"))
    res = subprocess.run([sys.executable, "-m", "anchorkv", *argv], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    _no_traceback(res)
    assert expect in res.stderr, res.stderr
    assert sorted(tmp_path.rglob("*")) == before, "a failed command wrote something"


@pytest.mark.parametrize("command", ["rm", "gc --capacity 0", "gc"])
def test_read_only_store(filled, capsys, monkeypatch, command):
    """Writes failing (a read-only file system): gc and rm fail with the reason, Store.open for
    a writer fails at once (the connector's start-up), ls still lists."""
    import errno

    from anchorkv.store.backends import LocalBackend
    from anchorkv.store.errors import StoreUnavailable

    path, a, _ = filled

    def refuse(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(args[1]) if len(args) > 1 else path)

    for name in ("write", "delete_tree", "delete", "remove_empty_dir", "publish"):
        monkeypatch.setattr(LocalBackend, name, refuse)
    with pytest.raises(StoreUnavailable, match="file system is read-only"):
        Store.open(path)
    argv = [*command.split(), a.id] if command == "rm" else command.split()
    code, out, err = run(capsys, *argv, "--store", path)
    assert code == 2 and "read-only" in err and "Traceback" not in err, err
    code, out, _ = run(capsys, "ls", "--store", path)
    assert code == 0 and a.id in out


def test_help_does_not_import_torch():
    code = ("import sys\nfrom anchorkv.cli import main\n"
            "for argv in (['--help'], ['ls', '--help'], ['gc', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('torch' in sys.modules, 'zarr' in sys.modules)\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "False False", res.stdout


def test_default_store_is_the_connectors(monkeypatch, capsys):
    from anchorkv.connector.config import DEFAULT_STORE
    from anchorkv.store import cli

    assert cli._default_store() == DEFAULT_STORE
    parser_args = __import__("anchorkv.cli", fromlist=["build_parser"]).build_parser().parse_args(["ls"])
    assert parser_args.store is None  # resolved to DEFAULT_STORE when run


def test_installed_command_runs(filled):
    path, a, _ = filled
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    res = subprocess.run([sys.executable, "-m", "anchorkv", "ls", "--store", path], cwd=ROOT,
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert a.id in res.stdout and "alice-software-tokyo" in res.stdout


@pytest.mark.s3
def test_cli_on_an_s3_store(s3_endpoint, capsys, monkeypatch):
    """ls / inspect / verify / rm / gc through an s3:// URL (endpoint in the query, credentials
    from the environment); ids as printed, entries with a write id suffix included."""
    from tests.store.conftest import S3_OPTIONS, make_s3_bucket

    bucket = make_s3_bucket(s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    url = f"s3://{bucket}/cache?endpoint={s3_endpoint}&region=us-east-1"
    layout = tiny_layout()
    with Store.open(f"s3://{bucket}/cache", **{**S3_OPTIONS, "endpoint": s3_endpoint}) as store:
        a = store.save(layout, CODECS, tokens(700), all_packed(layout, CODECS, 700), anchor="alice")
    code, out, _ = run(capsys, "ls", "--store", url, "--json")
    assert code == 0 and [e["id"] for e in json.loads(out)["entries"]] == [a.id] and "." in a.id.split("/")[1]
    code, out, _ = run(capsys, "inspect", a.id, "--store", url, "--json")
    assert code == 0 and json.loads(out)["manifest"]["num_tokens"] == 700
    code, out, _ = run(capsys, "verify", "--store", url)
    assert code == 0 and "1 of 1 entries ok" in out
    code, out, _ = run(capsys, "gc", "--store", url, "--capacity", "0", "--dry-run", "--json")
    assert code == 0 and json.loads(out)["evicted"] == 1
    code, out, _ = run(capsys, "rm", a.id, "--store", url)
    assert code == 0 and f"deleted {a.id}" in out
    code, out, _ = run(capsys, "ls", "--store", url, "--json")
    assert json.loads(out)["entries"] == []
