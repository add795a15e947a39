"""`anchorkv stats [STORE] [--capacity SIZE] [--json]`: a store's totals, on a real local store."""

from __future__ import annotations

import json
import re

import pytest

from anchorkv.cli import build_parser, main
from anchorkv.store.cli import human_bytes
from anchorkv.store.store import Store
from tests.store.helpers import CODECS, RAW_CODECS, all_packed, tiny_layout, tokens


@pytest.fixture
def filled(tmp_path):
    """Three entries: 'alice' (quantized, 700 tokens), token-keyed raw (300), and one damaged."""
    path = tmp_path / "store"
    layout = tiny_layout()
    with Store.open(path) as store:
        a = store.save(layout, CODECS, tokens(700), all_packed(layout, CODECS, 700), anchor="alice")
        b = store.save(layout, RAW_CODECS, tokens(300), all_packed(layout, RAW_CODECS, 300))
        c = store.save(layout, RAW_CODECS, tokens(400, seed=3), all_packed(layout, RAW_CODECS, 400), anchor="carol")
    (path / "entries" / c.id / "zarr.json").write_text("{not json")  # damaged: listed, not loadable
    return str(path), a, b, c


def stats(capsys, *argv) -> tuple[int, str, str]:
    """Run `anchorkv stats ARGV` through the parser `anchorkv` builds for every command."""
    args = build_parser("*").parse_args(["stats", *argv])
    code = args.func(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_stats_json_totals(filled, capsys):
    path, a, b, c = filled
    code, out, err = stats(capsys, path, "--json")
    assert code == 0 and err == ""
    t = json.loads(out)
    damaged = next(e for e in Store.open(path, create=False).scan() if e.id == c.id)
    assert t["entries"] == 3 and t["states"] == {"ok": 2, "damaged": 1}
    assert t["anchored"] == 1 and t["token_keyed"] == 1
    assert t["tokens"] == 1000
    assert t["stored_bytes"] == a.stored_bytes + b.stored_bytes + damaged.stored_bytes
    assert t["unloadable_bytes"] == damaged.stored_bytes > 0
    assert t["logical_bytes"] == a.logical_bytes + b.logical_bytes
    assert t["tp_sizes"] == [1]
    by = {(r["field"], r["codec"]): (r["entries"], r["stored_bytes"]) for r in t["by_field"]}
    assert set(by) == {("conv", "int8:8"), ("latent", "fp8:whole"), ("recurrent", "int8:whole"),
                       ("conv", "raw"), ("latent", "raw"), ("recurrent", "raw")}
    assert all(n == 1 for n, _ in by.values())
    assert sum(b_ for _, b_ in by.values()) == a.stored_bytes + b.stored_bytes  # every shard byte, once
    assert sum(b_ for (f, codec), (_, b_) in by.items() if codec == "raw") == b.stored_bytes
    assert t["oldest"] == a.created and t["newest"] == damaged.created > b.created  # (its file's mtime)
    assert t["capacity_bytes"] is None and "capacity_used" not in t


def test_stats_capacity_usage(filled, capsys):
    path, *_ = filled
    _, out, _ = stats(capsys, "--store", path, "--capacity", "100KiB", "--json")
    t = json.loads(out)
    assert t["capacity_bytes"] == 100 * 1024
    assert t["capacity_used"] == round(t["stored_bytes"] / (100 * 1024), 4) > 1
    _, out, _ = stats(capsys, path, "--capacity", "100KiB")
    assert "100.0 KiB" in out and "% used (over: the next save evicts" in out


def test_stats_table(filled, capsys):
    path, a, b, c = filled
    code, out, _ = stats(capsys, path)
    assert code == 0
    lines = {m.group(1): line for line in out.splitlines() if (m := re.match(r"^ *([a-z]+)  ", line))}
    assert "3 (1 damaged, 2 ok; 1 anchored, 1 token-keyed)" in lines["entries"]
    assert "1,000" in lines["tokens"]
    assert "`anchorkv gc` removes them" in lines["stored"]
    assert "not given" in lines["capacity"]
    row = next(line for line in out.splitlines() if "latent" in line and "fp8:whole" in line)
    latent = sum(v[1] for k, v in a.manifest["shards"].items() if k.split("/")[0] in ("latent", "latent_scales"))
    assert human_bytes(latent) in row


def test_stats_empty_and_missing_store(tmp_path, capsys):
    Store.open(tmp_path / "empty").close()
    code, out, _ = stats(capsys, str(tmp_path / "empty"), "--json")
    t = json.loads(out)
    assert code == 0 and t["entries"] == 0 and t["oldest"] is None and t["by_field"] == []
    code, out, err = stats(capsys, str(tmp_path / "nowhere"))
    assert code == 2 and out == "" and err.startswith("anchorkv stats: ") and len(err.strip().splitlines()) <= 2
    assert not (tmp_path / "nowhere").exists()  # read-only: creates nothing
    code, _, err = stats(capsys, str(tmp_path / "empty"), "--store", str(tmp_path / "other"))
    assert code == 2 and "two stores given" in err


def test_stats_is_an_anchorkv_command(filled, capsys):
    """`anchorkv stats` itself (anchorkv/cli.py lists the command)."""
    path, *_ = filled
    assert main(["stats", path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["entries"] == 3
