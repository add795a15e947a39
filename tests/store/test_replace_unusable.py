"""A save replaces an entry of the same tokens that nothing can restore (a damaged manifest, an
older format's entry): keeping it refused every save of those tokens until `anchorkv gc`. A
newer anchorkv's entry is kept (its readers use it)."""

from __future__ import annotations

import json

import pytest

from anchorkv.store.errors import CorruptEntry, OtherFormat
from anchorkv.store.manifest import manifest_checksum
from anchorkv.store.store import Store
from tests.store.helpers import CODECS, all_packed, tiny_layout, tokens


def _save(store: Store, seed: int = 0):
    layout = tiny_layout()
    return store.save(layout, CODECS, tokens(300), all_packed(layout, CODECS, 300, seed=seed), anchor="x")


def _restamp(path, version: int) -> None:
    doc = json.loads(path.read_bytes())
    m = doc["attributes"]["anchorkv"]
    m["format_version"] = version
    m["checksum"] = manifest_checksum(m)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("damage", ["zeros", "empty", "truncated", "missing", "older-format"])
def test_a_save_replaces_an_entry_nothing_restores(tmp_path, damage, caplog):
    store = Store.open(tmp_path / "s")
    old = _save(store)
    manifest = tmp_path / "s" / "entries" / old.id / "zarr.json"
    size = manifest.stat().st_size
    if damage == "zeros":  # what a crash before the manifest reached the disk can leave
        manifest.write_bytes(b"\0" * size)
    elif damage == "empty":
        manifest.write_bytes(b"")
    elif damage == "truncated":
        manifest.write_bytes(manifest.read_bytes()[: size // 2])
    elif damage == "missing":
        manifest.unlink()
    else:
        _restamp(manifest, 1)  # a format this anchorkv no longer reads
    again = Store.open(tmp_path / "s")
    if damage != "missing":  # (a directory without a manifest is not listed as an entry)
        [listing] = again.scan()
        assert listing.state == ("old-format" if damage == "older-format" else "damaged")
        assert len(listing.problem) < 200, listing.problem  # one short line, not the file's bytes
    with caplog.at_level("WARNING", logger="anchorkv.store"):
        new = _save(again, seed=1)
    assert f"entry {old.id} is replaced by a new write of its tokens" in caplog.text
    assert new.id == old.id and new.version != old.version
    fresh = Store.open(tmp_path / "s")
    assert [(e.id, e.state) for e in fresh.scan() if e.state != "damaged" or damage != "missing"] == [(old.id, "ok")]
    layout = tiny_layout()
    want = all_packed(layout, CODECS, 300, seed=1)
    layer, field = next(iter(want))
    got = fresh.load(old.id, layout, layer, field)
    assert got.shape == want[(layer, field)].shape  # the new write's bytes are what loads
    assert fresh.verify(old.id) == []


def test_a_newer_formats_entry_is_kept(tmp_path):
    store = Store.open(tmp_path / "s")
    old = _save(store)
    manifest = tmp_path / "s" / "entries" / old.id / "zarr.json"
    _restamp(manifest, 99)
    before = manifest.read_bytes()
    with pytest.raises(OtherFormat, match="newer than"):
        _save(Store.open(tmp_path / "s"), seed=1)
    assert manifest.read_bytes() == before
    assert not list((tmp_path / "s" / ".staging").iterdir())  # this write's data is gone


def _staged(store: Store, write_id: str, seed: int = 1):
    layout = tiny_layout()
    w = store.begin_entry(layout, CODECS, tokens(300), anchor="x", write_id=write_id)
    for (layer, field), p in all_packed(layout, CODECS, 300, seed=seed).items():
        w.write_layer(layer, field, p)
    w.finish_rank()


def test_an_intact_manifest_this_release_cannot_parse_is_kept(tmp_path):
    """A manifest whose checksum holds was written whole: a newer release's entry (say a codec
    this one does not know) is kept, not deleted as damage (a review: it was)."""
    store = Store.open(tmp_path / "s")
    old = _save(store)
    path = tmp_path / "s" / "entries" / old.id / "zarr.json"
    doc = json.loads(path.read_bytes())
    m = doc["attributes"]["anchorkv"]
    m["codecs"]["conv"]["format"] = "nf4"
    m["checksum"] = manifest_checksum(m)
    path.write_text(json.dumps(doc))
    before = path.read_bytes()
    with pytest.raises(CorruptEntry):
        _save(Store.open(tmp_path / "s"), seed=1)
    assert path.read_bytes() == before


def test_two_committers_of_one_write_over_a_damaged_entry_keep_it(tmp_path, monkeypatch):
    """Ranks that finish together may both commit one write. One judges the damaged entry,
    the other replaces it and publishes meanwhile: the first must not delete that publish (a
    review: it did, and the store kept no entry)."""
    import threading

    import anchorkv.store.commit as commit

    store = Store.open(tmp_path / "s")
    old = _save(store)
    manifest = tmp_path / "s" / "entries" / old.id / "zarr.json"
    manifest.write_bytes(b"\0" * manifest.stat().st_size)
    _staged(Store.open(tmp_path / "s"), "samewrite")
    a_done = threading.Event()
    judge = commit.unusable

    def parked(manifest):  # B has read the damaged bytes; A commits the whole write now
        if threading.current_thread().name == "B":
            a_done.wait(10)
        return judge(manifest)

    monkeypatch.setattr(commit, "unusable", parked)
    out = {}

    def run(name):
        try:
            out[name] = Store.open(tmp_path / "s").commit_staged("samewrite").version
        except Exception as e:  # noqa: BLE001 (reported below)
            out[name] = e
        if name == "A":
            a_done.set()

    b = threading.Thread(target=run, args=("B",), name="B")
    b.start()
    __import__("time").sleep(0.2)
    a = threading.Thread(target=run, args=("A",), name="A")
    a.start()
    a.join()
    b.join()
    published = Store.open(tmp_path / "s").get(old.id)
    assert out["A"] == published.version and out["B"] == published.version, out
    assert Store.open(tmp_path / "s").verify(old.id) == []


def test_replace_names_the_damaged_write(tmp_path):
    """The recomputed tokens' save publishes over the entry a load found damaged (its manifest
    readable, its data not): `replace` names that write; any other write is kept."""
    store = Store.open(tmp_path / "s")
    old = _save(store)
    _staged(store, "otherversion")
    kept = store.commit_staged("otherversion", replace="blake3:" + "0" * 64)
    assert kept.version == old.version  # not the named write: the winner is kept
    _staged(store, "replacing")
    new = Store.open(tmp_path / "s").commit_staged("replacing", replace=old.version)
    assert new.id == old.id and new.version != old.version
    assert Store.open(tmp_path / "s").get(old.id).version == new.version


def test_a_repair_never_deletes_the_write_that_replaced_the_damaged_one(tmp_path):
    """Two repairers of one damaged write (two ranks or engines whose loads failed) and the
    recomputed tokens' save: the first deletes it, the save publishes a good write, and the
    second, whose check passed before, must not delete that (a review: it did)."""
    from anchorkv.connector.storage_zarr import ZarrEntryStore

    layout = tiny_layout()
    v1 = _save(Store.open(tmp_path / "s"))
    shard = next(p for p in (tmp_path / "s" / "entries" / v1.id).rglob("c.*") if p.is_file())
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))

    def repairer() -> ZarrEntryStore:  # (only its store: what discard_damaged uses)
        z = object.__new__(ZarrEntryStore)
        z.store = Store.open(tmp_path / "s")
        return z

    first, second = repairer(), repairer()
    remove_if = second.store.backend.remove_if
    saved = {}

    def meanwhile(prefix, still):  # the second passed its checks; the others act now
        assert first.discard_damaged(v1.id, v1.version)
        saved["v2"] = Store.open(tmp_path / "s").save(layout, CODECS, tokens(300),
                                                       all_packed(layout, CODECS, 300, seed=1), anchor="x")
        return remove_if(prefix, still)

    second.store.backend.remove_if = meanwhile  # type: ignore[method-assign]
    assert second.discard_damaged(v1.id, v1.version) is False
    now = Store.open(tmp_path / "s").get(v1.id)
    assert now.version == saved["v2"].version and Store.open(tmp_path / "s").verify(v1.id) == []
