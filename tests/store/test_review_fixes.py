"""Findings of a review of the store and its CLI (its numbers in brackets), each pinned: CLI
commands that never make a store of a mistyped directory [2], scans that list an unreadable
entry instead of failing [4], commits that scan only near the capacity [3], a losing commit
whose winner was evicted [8], S3 last-use objects that resurrect a deleted entry [7], store
text printed without rich markup [9], ASCII write ids [10], ``python -m anchorkv.store.cli``
[11] and ``gc --verify`` [5]."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from anchorkv.cli import main
from anchorkv.store import eviction
from anchorkv.store.paths import STAGING
from anchorkv.store.store import Store
from tests.store.helpers import CODECS, all_packed, tiny_layout, tokens

ROOT = Path(__file__).resolve().parents[2]
LAYER = "model.layers.1.attn"


def save(store: Store, anchor: str, seed: int = 0, n: int = 300, **kwargs):
    layout = tiny_layout()
    return store.save(layout, CODECS, tokens(n), all_packed(layout, CODECS, n, seed), anchor=anchor, **kwargs)


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def tree(root: Path) -> list[tuple[str, bytes]]:
    return sorted((str(p.relative_to(root)), p.read_bytes() if p.is_file() else b"") for p in root.rglob("*"))


# ----------------------------------------------------------------------------- [2] no store made by the CLI


@pytest.mark.parametrize("argv", [["gc"], ["gc", "--stale-after", "0"], ["gc", "--dry-run"], ["rm", "x" * 10],
                                  ["stats"], ["ls"], ["verify"]])
def test_commands_refuse_a_directory_that_is_not_a_store(tmp_path, capsys, argv):
    """A mistyped --store: every command says there is no store there and changes nothing (gc
    made it a store and removed its own old `.staging/*` and `.trash/*`)."""
    d = tmp_path / "project"
    (d / ".staging" / "release-1.2").mkdir(parents=True)
    (d / ".staging" / "release-1.2" / "notes.txt").write_text("important")
    (d / ".trash" / "keep-me").mkdir(parents=True)
    (d / ".trash" / "keep-me" / "file").write_text("x")
    old = time.time() - 7200
    for p in (d / ".staging" / "release-1.2", d / ".staging" / "release-1.2" / "notes.txt"):
        os.utime(p, (old, old))
    before = tree(d)
    code, out, err = run(capsys, *argv, "--store", str(d))
    assert code == 2 and "is not an anchorkv store" in err and len(err.strip().splitlines()) <= 2, (code, out, err)
    assert tree(d) == before, f"`anchorkv {' '.join(argv)}` changed a directory that is not a store"


@pytest.mark.parametrize("command", ["gc", "rm"])
def test_commands_never_create_a_missing_store(tmp_path, capsys, command):
    missing = tmp_path / "typo"
    argv = [command, "--store", str(missing)] + (["someentry"] if command == "rm" else [])
    code, _, err = run(capsys, *argv)
    assert code == 2 and "no store at" in err, err
    assert not missing.exists(), f"`anchorkv {command}` created {missing}"


# ----------------------------------------------------------------------------- [4] unreadable entries


def _break_dir(store: Store, info) -> None:  # its zarr.json a directory
    p = Path(store.url) / info.path / "zarr.json"
    p.unlink()
    p.mkdir()


def _break_file(store: Store, info) -> None:  # a file where the entry's directory belongs
    p = Path(store.url) / info.path
    store.backend.delete_tree(info.path)
    p.write_bytes(b"x" * 100)


def _deny(monkeypatch, store: Store, method: str, denied) -> None:
    """The backend's `method` raises PermissionError for the paths `denied(path)` names: another
    user's files (the tests may run as root, whom permissions do not stop)."""
    real = getattr(type(store.backend), method)

    def guarded(self, path, *args, **kwargs):
        if denied(path):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real(self, path, *args, **kwargs)

    monkeypatch.setattr(type(store.backend), method, guarded)


def _break_permission(store: Store, info, monkeypatch) -> None:  # another user's entry
    _deny(monkeypatch, store, "read", lambda path: path.startswith(info.path))


@pytest.mark.parametrize("how", ["zarr.json is a directory", "a file with an entry's name", "permission denied",
                                 "I/O error"])
def test_an_unreadable_entry_is_listed_and_kept_unless_damaged(tmp_path, capsys, monkeypatch, how):
    """ls, verify, gc and a save with a capacity went on raising the entry's OSError. An entry
    that is no anchorkv write (its zarr.json a directory, its name a file) is damaged, and gc
    removes it; one whose manifest this process cannot read (another user's, an I/O error) is
    listed as unreadable and kept: gc deleted such an intact entry as damaged (a second review)."""
    store = Store.open(tmp_path / "s")
    good, bad = save(store, "alice"), save(store, "bob", seed=1)
    if how == "I/O error":
        _deny(monkeypatch, store, "read", lambda path: path.startswith(bad.path))
        real = type(store.backend).read

        def eio(self, path, *args, **kwargs):
            try:
                return real(self, path, *args, **kwargs)
            except PermissionError:
                raise OSError(errno.EIO, "Input/output error", path) from None

        monkeypatch.setattr(type(store.backend), "read", eio)
    else:
        {"zarr.json is a directory": _break_dir, "a file with an entry's name": _break_file}.get(
            how, lambda s, i: _break_permission(s, i, monkeypatch))(store, bad)
    kept = how in ("permission denied", "I/O error")
    state = "unreadable" if kept else "damaged"
    fresh = Store.open(tmp_path / "s")
    states = {e.id: (e.state, e.problem) for e in fresh.scan()}
    assert states[good.id] == ("ok", None)
    assert states[bad.id][0] == state and "cannot be read" in states[bad.id][1], states
    code, out, _ = run(capsys, "ls", "--store", str(tmp_path / "s"), "--json")
    assert code == 0 and {r["id"]: r["state"] for r in json.loads(out)["entries"]} == {good.id: "ok", bad.id: state}
    code, out, _ = run(capsys, "verify", "--store", str(tmp_path / "s"))
    assert code == 1 and f"FAIL {bad.id}" in out and "1 of 2 entries ok" in out, out
    assert ("not checked" in out and "delete them" not in out) if kept else "delete them" in out, out
    capped = Store.open(tmp_path / "s", capacity_bytes=10**9)
    carol = save(capped, "carol", seed=2)  # raised after its commit
    assert carol.id in {e.id for e in capped.scan()}
    code, out, err = run(capsys, "gc", "--store", str(tmp_path / "s"))
    assert code == 0 and f"damaged={0 if kept else 1}" in out, (out, err)
    left = {e.id: e.state for e in Store.open(tmp_path / "s").scan()}
    assert left == ({good.id: "ok", carol.id: "ok", bad.id: "unreadable"} if kept else {good.id: "ok", carol.id: "ok"})
    if kept:  # readable again: whole
        monkeypatch.undo()
        assert not Store.open(tmp_path / "s").verify(Store.open(tmp_path / "s").get(bad.id))
    assert not (Path(tmp_path / "s") / ".trash").exists() or not os.listdir(Path(tmp_path / "s") / ".trash")


def test_a_key_that_cannot_be_listed_leaves_the_others_listed(tmp_path, monkeypatch, caplog):
    store = Store.open(tmp_path / "s")
    good, bad = save(store, "alice"), save(store, "bob", seed=1)
    _deny(monkeypatch, store, "list_dir", lambda prefix: prefix.endswith(bad.key))
    assert [e.id for e in Store.open(tmp_path / "s").scan()] == [good.id]
    assert f"cannot list the entries of key {bad.key}" in caplog.text


# ----------------------------------------------------------------------------- [3] commits scan near capacity only


def _count_lists(monkeypatch, store: Store) -> list[str]:
    calls: list[str] = []
    real = store.backend.list_dir

    def list_dir(prefix):
        calls.append(prefix)
        return real(prefix)

    monkeypatch.setattr(store.backend, "list_dir", list_dir)
    return calls


def test_saves_far_below_the_capacity_list_no_more_than_without_one(store_url, monkeypatch):
    """With a capacity every commit scanned the store (a LIST of entries/ and one per key: 2.4 s
    a save on S3 with 300 anchors); now only the first does, then one when the estimate nears the
    capacity or the last scan is `RESCAN_AFTER` old."""
    url, options = store_url
    capped, plain = Store.open(url, capacity_bytes=1 << 40, **options), Store.open(url, **options)
    for i in range(3):
        save(plain, f"before-{i}", seed=i)
    save(capped, "first")  # scans: it knows nothing of the store yet
    lists = {"capped": _count_lists(monkeypatch, capped), "plain": _count_lists(monkeypatch, plain)}
    for i in range(4):
        save(capped, f"capped-{i}", seed=i)
        save(plain, f"plain-{i}", seed=i)
    assert len(lists["capped"]) == len(lists["plain"]), lists
    monkeypatch.setattr(eviction, "RESCAN_AFTER", 0.0)
    lists["capped"].clear()
    save(capped, "late")  # its last scan is too old: scans
    assert "entries" in lists["capped"], lists["capped"]


def test_other_processes_saves_count_once_the_scan_is_old(tmp_path, monkeypatch):
    """The estimate knows only this process's saves; after `RESCAN_AFTER` a commit scans and
    evicts what other processes' saves put over the capacity."""
    probe = save(Store.open(tmp_path / "probe"), "p")
    size = probe.stored_bytes
    mine = Store.open(tmp_path / "s", capacity_bytes=3 * size + size // 2)
    other = Store.open(tmp_path / "s")
    first = save(mine, "first", seed=1)
    for i in range(3):
        save(other, f"other-{i}", seed=i)
    monkeypatch.setattr(eviction, "RESCAN_AFTER", 0.0)
    last = save(mine, "last", seed=5)
    left = {e.id for e in mine.scan()}
    assert last.id in left and first.id not in left and len(left) == 3, left
    assert mine.usage() <= mine.capacity_bytes


def test_own_saves_over_the_capacity_still_evict_at_once(tmp_path):
    probe = save(Store.open(tmp_path / "probe"), "p")
    store = Store.open(tmp_path / "s", capacity_bytes=2 * probe.stored_bytes + probe.stored_bytes // 2)
    infos = [save(store, f"a{i}", seed=i) for i in range(5)]
    assert {e.id for e in store.scan()} == {infos[3].id, infos[4].id}


# ----------------------------------------------------------------------------- [8] the losing commit


def test_a_losing_commit_whose_winner_is_evicted_publishes_its_own(tmp_path, monkeypatch):
    """Two processes publish one entry; the winner is evicted between the loser's publish and its
    read of the winner's manifest: the loser publishes its own (it deleted its data and raised a
    bare FileNotFoundError)."""
    a, b = Store.open(tmp_path / "s"), Store.open(tmp_path / "s")
    winner = save(a, "alice", seed=0)
    real = b.backend.publish
    tries = []

    def publish(staged, final):
        ok = real(staged, final)
        tries.append(ok)
        if len(tries) == 1:
            assert not ok, "the first publish must lose to the winner"
            a.delete(winner.id)  # another process evicts the winner right now
        return ok

    monkeypatch.setattr(b.backend, "publish", publish)
    mine = save(b, "alice", seed=1)
    assert tries == [False, True] and mine.id == winner.id
    layout = tiny_layout()
    got = Store.open(tmp_path / "s", create=False).load(mine.id, layout, LAYER, "recurrent")
    want = all_packed(layout, CODECS, 300, seed=1)[(LAYER, "recurrent")]
    assert torch.equal(got.payload, want.payload) and torch.equal(got.scales, want.scales)
    assert b.backend.list_dir(STAGING) == []


def test_a_commit_whose_name_is_held_without_a_manifest_replaces_it(tmp_path):
    """A directory without its manifest (a crash before it reached the disk: a local publish
    renames a complete directory) restores nothing: the next save of its tokens replaces it
    (it failed as a store error before, and kept failing until `anchorkv gc`)."""
    store = Store.open(tmp_path / "s")
    held = save(store, "alice")
    (Path(store.url) / held.path / "zarr.json").unlink()  # a damaged entry holds the name
    again = save(store, "alice", seed=1)
    assert again.id == held.id and store.verify(again.id) == []
    assert store.backend.list_dir(STAGING) == []


# ----------------------------------------------------------------------------- [7] S3 zombie prefixes


@pytest.mark.s3
def test_a_use_recorded_as_another_process_deletes_the_entry_leaves_nothing(s3_endpoint):
    """S3: A's touch of an entry B deleted put `.last_use` under its prefix, which A's lookups
    (the manifest cached) then found forever."""
    from tests.store.conftest import S3_OPTIONS, make_s3_bucket

    url = f"s3://{make_s3_bucket(s3_endpoint)}/cache"
    a, b = (Store.open(url, endpoint=s3_endpoint, **S3_OPTIONS) for _ in range(2))
    info = save(a, "alice")
    fp = tiny_layout().fingerprint_hash()
    assert a.lookup(fingerprint_hash=fp, tokens=tokens(300), anchor="alice").id == info.id
    b.delete(info.id)
    with a.pin(info.id):  # A restores from its earlier lookup
        pass
    assert a.backend.list_dir(info.path) == []
    assert a.lookup(fingerprint_hash=fp, tokens=tokens(300), anchor="alice") is None


@pytest.mark.s3
def test_gc_removes_a_prefix_holding_only_a_last_use_at_once(s3_endpoint):
    """What an older anchorkv left (a deleted entry's `.last_use`): an orphan gc removes whatever
    its age (a write in progress never puts `.last_use` first)."""
    from tests.store.conftest import S3_OPTIONS, make_s3_bucket

    url = f"s3://{make_s3_bucket(s3_endpoint)}/cache"
    store = Store.open(url, endpoint=s3_endpoint, **S3_OPTIONS)
    info = save(store, "alice")
    store.delete(info.id)
    store.backend.write(f"{info.path}/.last_use", [b"1700000000.0"])
    report = store.gc(dry_run=True)
    assert report["orphans"] == 1 and store.backend.list_dir(info.path) == [".last_use"], report
    report = store.gc()
    assert report["orphans"] == 1 and store.backend.list_dir(info.path) == [], report


# ----------------------------------------------------------------------------- [9] no markup in store text


@pytest.mark.parametrize("value", ["oops", "[/x]"])
def test_verify_prints_problems_as_they_are(tmp_path, capsys, value):
    """rich markup ate '[crc32c, nbytes, offset]', and a manifest holding '[/x]' crashed verify."""
    store = Store.open(tmp_path / "s")
    info = save(store, "alice")
    p = Path(store.url) / info.path / "zarr.json"
    doc = json.loads(p.read_text())
    checksums = doc["attributes"]["anchorkv"]["checksums"]
    checksums[sorted(checksums)[0]] = value
    p.write_text(json.dumps(doc))
    code, out, err = run(capsys, "verify", "--store", str(tmp_path / "s"))
    assert code == 1, (out, err)
    flat = " ".join(out.split())
    assert f"is {value!r}, expected [crc32c, nbytes, offset]" in flat, out


def test_a_store_path_with_brackets_is_printed_as_it_is(tmp_path, capsys):
    path = tmp_path / "cache[bold]x[/bold]"
    info = save(Store.open(path), "alice")
    for argv in (["ls"], ["stats"], ["inspect", info.id]):
        code, out, err = run(capsys, *argv, "--store", str(path))
        assert code == 0 and str(path) in " ".join(out.split()), (argv, out, err)


# ----------------------------------------------------------------------------- [10] write ids


@pytest.mark.parametrize("wid", ["é", "٣", "abcé", "A", "a-b", "a" * 65])
def test_write_ids_are_ascii_lowercase_letters_and_digits(tmp_path, wid):
    """'é' and '٣' passed str.isalnum/islower; on S3 their entries were never found again."""
    store = Store.open(tmp_path / "s")
    with pytest.raises(ValueError, match=r"write_id must be 1-64 (ASCII )?lowercase letters"):
        save(store, "alice", write_id=wid)
    assert store.backend.list_dir(STAGING) == []


def test_ascii_write_ids_are_taken(tmp_path):
    store = Store.open(tmp_path / "s")
    for wid in ("0123456789abcdefghijklmnopqrstuvwxyz", "7" * 64):
        store.delete(save(store, "alice", write_id=wid))


# ----------------------------------------------------------------------------- [11] python -m anchorkv.store.cli


def test_the_cli_module_runs_as_the_anchorkv_command(tmp_path):
    info = save(Store.open(tmp_path / "s"), "alice")
    res = subprocess.run([sys.executable, "-m", "anchorkv.store.cli", "ls", "--store", str(tmp_path / "s"), "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert [e["id"] for e in json.loads(res.stdout)["entries"]] == [info.id]


# ----------------------------------------------------------------------------- [5] gc --verify


def test_gc_verify_removes_entries_whose_shards_fail(tmp_path, capsys):
    """verify told users that gc removes what it finds; gc only removed damaged manifests."""
    store = Store.open(tmp_path / "s")
    good, bad = save(store, "alice"), save(store, "bob", seed=1)
    shard = Path(store.url) / bad.path / "recurrent" / "c.0.0.0.0"
    data = bytearray(shard.read_bytes())
    data[5] ^= 0xFF
    shard.write_bytes(bytes(data))
    path = str(tmp_path / "s")
    code, out, _ = run(capsys, "gc", "--store", path)
    assert code == 0 and "damaged=0" in out
    before = tree(tmp_path / "s")
    code, out, _ = run(capsys, "gc", "--verify", "--dry-run", "--store", path)
    assert code == 0 and f"would remove damaged: entry {bad.id} (shard recurrent/c.0.0.0.0 fails its check" in out, out
    assert tree(tmp_path / "s") == before, "--dry-run changed the store"
    code, out, _ = run(capsys, "gc", "--verify", "--store", path, "--json")
    report = json.loads(out)
    assert code == 0 and report["damaged"] == 1 and report["freed_bytes"] == bad.stored_bytes, report
    assert [e.id for e in Store.open(path).scan()] == [good.id]
    code, out, _ = run(capsys, "verify", "--store", path)
    assert code == 0 and "1 of 1 entries ok" in out


def test_a_load_for_other_weights_says_so(tmp_path):
    """An entry saved for one model's weights (`ModelLayout.model`, the connector's
    `model_id`) is refused for another's with the reason: the weights, not the shapes."""
    import dataclasses

    from anchorkv.store.errors import FingerprintMismatch

    base = tiny_layout()
    mine, theirs = dataclasses.replace(base, model="acme/a@1"), dataclasses.replace(base, model="acme/a@2")
    store = Store.open(tmp_path / "s")
    info = store.save(mine, CODECS, tokens(300), all_packed(mine, CODECS, 300), anchor="x")
    assert store.load(info.id, mine, "model.layers.1.attn", "recurrent").shape
    with pytest.raises(FingerprintMismatch, match=r"model 'acme/a@1'.*model 'acme/a@2'.*weights differ \(model_id\)"):
        store.load(info.id, theirs, "model.layers.1.attn", "recurrent")
    with pytest.raises(FingerprintMismatch, match="layers, field shapes or dtypes differ"):
        store.load(info.id, dataclasses.replace(tiny_layout(tp_size=1), model="acme/a@1", architecture="Other"),
                   "model.layers.1.attn", "recurrent")
    # keyed by content (`weights`) and by config (`model_config`): each refusal names its reason
    w1 = dataclasses.replace(base, weights="sha256:" + "1" * 32, model_config="c" * 32)
    info = store.save(w1, CODECS, tokens(300), all_packed(w1, CODECS, 300), anchor="y")
    assert store.load(info.id, w1, "model.layers.1.attn", "recurrent").shape
    with pytest.raises(FingerprintMismatch, match=r"weights differ \(content 'sha256:1+' vs 'sha256:2+'\)"):
        store.load(info.id, dataclasses.replace(w1, weights="sha256:" + "2" * 32), "model.layers.1.attn", "recurrent")
    with pytest.raises(FingerprintMismatch, match="config, dtype or quantization differ"):
        store.load(info.id, dataclasses.replace(w1, model_config="d" * 32), "model.layers.1.attn", "recurrent")


@pytest.mark.parametrize("meanwhile", ["evicted", "written again"])
def test_gc_verify_leaves_what_a_serving_process_changes_meanwhile(tmp_path, monkeypatch, meanwhile):
    """`gc --verify` reads the whole store with the manifests of its scan. An entry a serving
    process evicts meanwhile is not an error, and one it saves again under the same id is not
    judged by the old manifest and deleted (review: gc raised EntryNotFound, or removed the
    healthy new write as damaged)."""
    layout = tiny_layout()

    def save(store, anchor, seed):
        return store.save(layout, CODECS, tokens(300), all_packed(layout, CODECS, 300, seed=seed), anchor=anchor)

    first = Store.open(tmp_path / "s")
    ids = {save(first, a, i).id: a for i, a in enumerate(("alice", "bob"))}
    gc_store, serving = Store.open(tmp_path / "s", create=False), Store.open(tmp_path / "s")
    real, done = Store.verify, set()

    def verify(self, entry, progress=None):
        if entry.id not in done:
            done.add(entry.id)
            serving.delete(entry.id)  # capacity eviction in the serving process
            if meanwhile == "written again":
                save(serving, ids[entry.id], 5)
        return real(self, entry, progress)

    monkeypatch.setattr(Store, "verify", verify)
    report = gc_store.gc(verify=True)
    monkeypatch.setattr(Store, "verify", real)
    assert report["damaged"] == 0, report["removed"]
    left = Store.open(tmp_path / "s", create=False)
    want = set(ids) if meanwhile == "written again" else set()
    assert {e.id for e in left.scan()} == want
    assert all(left.verify(entry_id) == [] for entry_id in want)
