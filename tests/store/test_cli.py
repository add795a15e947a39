"""`anchorkv ls | inspect | verify | rm | gc` on a real local store."""

from __future__ import annotations

import json
import os
from pathlib import Path
import subprocess
import sys

import pytest

from anchorkv.cli import main
from anchorkv.store.cli import human_age, human_bytes
from anchorkv.store.store import Store
from anchorkv.store.writer import STAGING
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
    for info, codecs in ((a, "conv=int8:8 latent=fp8:72 recurrent=int8:16"), (b, "conv=raw latent=raw recurrent=raw")):
        line = next((l for l in out.splitlines() if info.key[:12] in l), None)
        assert line is not None, f"ls does not show {info.id}:\n{out}"
        for want in (info.anchor, f"{info.num_tokens:,}", human_bytes(info.stored_bytes), codecs, "0s"):
            assert want in line, f"expected {want!r} in the ls row of {info.anchor}, found: {line}"
    assert "2 entries" in out
    code, out, _ = run(capsys, "ls", "--store", path, "--json")
    rows = json.loads(out)
    assert {r["id"] for r in rows} == {a.id, b.id}
    assert {r["tokens"] for r in rows} == {700, 300} and {r["tp"] for r in rows} == {1}


def test_inspect_by_short_id_and_by_anchor(filled, capsys):
    path, a, _ = filled
    short = f"{a.key[:12]}/{a.id.split('/')[1]}"
    code, out, _ = run(capsys, "inspect", short, "--store", path)
    assert code == 0
    for want in (a.id, "alice-software-tokyo", "700 tokens", "TinyHybrid", "tp=1", "recurrent", "[3, 8, 16, 16]",
                 "int8:16", "bfloat16", human_bytes(a.stored_bytes)):
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
    assert f"entry {a.id}: shard latent/c.1.0.0 fails its check" in out and "1 of 2 entries ok" in out, out
    assert "damaged chunks: latent/c.1.0.0" in " ".join(out.split()), out
    code, out, _ = run(capsys, "verify", "bob", "--store", path)
    assert code == 0 and "1 of 1 entries ok" in out


def test_rm_deletes(filled, capsys):
    path, a, b = filled
    code, out, _ = run(capsys, "rm", "bob", "--store", path)
    assert code == 0 and f"deleted {b.id}" in out
    assert [e.id for e in Store.open(path).list()] == [a.id]
    code, _, err = run(capsys, "rm", "bob", "--store", path)
    assert code == 2 and "no entry matches" in err


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
    code, out, err = run(capsys, "gc", "--store", path, "--stale-after", "0", "--capacity", str(capacity))
    assert code == 0 and "abandoned_writes=1" in out and "evicted=1" in out, out
    assert store.backend.list_dir(STAGING) == []
    assert [e.id for e in Store.open(path).list()] == [b.id]


def test_missing_store_is_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit, match="no store at"):
        main(["ls", "--store", str(tmp_path / "nope")])


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
    assert a.key[:12] in res.stdout and "alice-software-tokyo" in res.stdout
