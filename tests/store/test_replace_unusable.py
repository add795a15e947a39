"""A save replaces an entry of the same tokens that nothing can restore (a damaged manifest, an
older format's entry): keeping it refused every save of those tokens until `anchorkv gc`. A
newer anchorkv's entry is kept (its readers use it)."""

from __future__ import annotations

import json

import pytest

from anchorkv.store.errors import OtherFormat
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


@pytest.mark.parametrize("damage", ["zeros", "empty", "truncated", "older-format"])
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
    else:
        _restamp(manifest, 1)  # a format this anchorkv no longer reads
    again = Store.open(tmp_path / "s")
    [listing] = again.scan()
    assert listing.state == ("old-format" if damage == "older-format" else "damaged")
    assert len(listing.problem) < 200, listing.problem  # one short line, not the file's bytes
    with caplog.at_level("WARNING", logger="anchorkv.store"):
        new = _save(again, seed=1)
    assert f"entry {old.id} is replaced by a new write of its tokens" in caplog.text
    assert new.id == old.id and new.version != old.version
    fresh = Store.open(tmp_path / "s")
    assert [(e.id, e.state) for e in fresh.scan()] == [(old.id, "ok")]
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
