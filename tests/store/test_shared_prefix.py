"""Shared prefixes: an entry of a model without recurrent state records the prefix hash after
each whole 256-token block (`boundary_hashes`), and `Store.match(shared=True)` finds the first
blocks a request shares with an entry of any length (a system prompt, the start of an edited
conversation); hybrids record none and are never matched that way."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from anchorkv.codec.models import custom_layout
from anchorkv.store import store as store_module
from anchorkv.store.errors import CorruptEntry
from anchorkv.store.keys import PrefixHasher
from anchorkv.store.manifest import check_manifest, manifest_checksum
from anchorkv.store.store import Store
from tests.store.helpers import CODECS, all_packed, record_reads, tiny_layout

RAW = {"latent": "raw"}


def mla_layout(block_size: int = 64):
    """The tiny model's paged layers alone: a model without recurrent state (MLA-only)."""
    full = tiny_layout(block_size=block_size)
    return custom_layout("TinyMLA", [(layer.name, "paged", layer.page) for layer in full.layers
                                     if layer.kind.value == "paged"], block_size=block_size)


def toks(n: int, seed: int) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) * 7919 + seed * 104729) % 151_000


def save(store: Store, tokens: np.ndarray, anchor: str | None = None, layout=None, codecs=RAW):
    layout = layout or mla_layout()
    return store.save(layout, codecs, tokens, all_packed(layout, codecs, len(tokens)), anchor=anchor)


def match(store: Store, tokens, layout=None, **kw):
    return store.match(fingerprint_hash=store._fingerprint(layout or mla_layout()), tokens=tokens, **kw)


BASE = toks(900, 1)
EDITED = np.concatenate([BASE[:600], toks(300, 2)])  # shares 600 tokens: two whole 256-token blocks


@pytest.fixture
def store(tmp_path):
    s = Store.open(tmp_path / "s")
    save(s, BASE)
    return s


def test_an_entry_records_its_boundary_hashes(store):
    (info,) = store.list()
    hasher = PrefixHasher(BASE, info.fingerprint_hash)
    assert info.manifest["boundary_hashes"] == [hasher.hash(256), hasher.hash(512), hasher.hash(768)]


def test_a_prompt_sharing_whole_blocks_matches_them(store):
    why: list[str] = []
    assert match(store, EDITED, why=why) is None and why == ["prefix_mismatch"]  # not without `shared`
    found = match(store, EDITED, shared=True)
    assert found.info.num_tokens == 900 and found.tokens == 512
    assert store.lookup(fingerprint_hash=found.info.fingerprint_hash, tokens=EDITED) is None


@pytest.mark.parametrize("tokens,kw,want", [
    (BASE[:700], {}, 512),  # a prefix of the entry: its whole blocks below 700
    (BASE[:700], {"max_tokens": 511}, 256),
    (EDITED, {"multiple_of": 384}, 384),  # 512 floored to what the engine restores
    (EDITED, {"multiple_of": 640}, None),
    (np.concatenate([BASE[:255], toks(600, 3)]), {}, None),  # the first block differs: another key
    (np.concatenate([BASE[:300], toks(600, 3)]), {}, 256),
])
def test_shared_tokens_are_whole_blocks_within_the_limits(store, tokens, kw, want):
    found = match(store, tokens, shared=True, **kw)
    assert (None if found is None else found.tokens) == want


def test_a_whole_match_wins_unless_the_shared_part_is_longer(tmp_path):
    store = Store.open(tmp_path / "s")
    save(store, BASE)
    short = save(store, EDITED[:300])  # a whole match of 300 tokens: less than the 512 shared
    found = match(store, EDITED, shared=True)
    assert (found.info.num_tokens, found.tokens) == (900, 512)
    whole = save(store, EDITED[:600])  # a whole match of 600: more
    found = match(store, EDITED, shared=True)
    assert found.info.id == whole.id and found.tokens == 600
    assert match(store, EDITED, shared=True, max_tokens=599).tokens == 512
    assert short.num_tokens == 300


def test_an_anchor_s_edited_conversation_shares_its_start(tmp_path):
    store = Store.open(tmp_path / "s")
    save(store, BASE, anchor="alice")
    found = match(store, EDITED, anchor="alice", shared=True)
    assert found.tokens == 512
    assert match(store, EDITED, anchor="bob", shared=True) is None


def test_a_hybrid_entry_records_none_and_never_matches_shared(tmp_path):
    store = Store.open(tmp_path / "s")
    layout = tiny_layout()
    info = save(store, BASE, layout=layout, codecs=CODECS)
    assert "boundary_hashes" not in info.manifest
    assert match(store, EDITED, layout=layout, shared=True) is None


def test_a_lookup_reads_a_bounded_number_of_new_manifests(tmp_path, monkeypatch):
    """Twelve entries under one key that share only the first block: a fresh store reads at most
    `SHARED_READS` manifests for a shared match (the longest first), and what it read stays cached."""
    store = Store.open(tmp_path / "s")
    for i in range(12):
        save(store, np.concatenate([BASE[:300], toks(400 + 10 * i, 10 + i)]))
    fresh = Store.open(tmp_path / "s", create=False)
    reads = record_reads(monkeypatch, fresh)
    prompt = np.concatenate([BASE[:300], toks(500, 99)])
    assert match(fresh, prompt, shared=True).tokens == 256
    manifests = [p for p in reads if p.endswith("zarr.json")]
    assert 1 <= len(manifests) <= store_module.SHARED_READS


def _tampered(info, path: Path, **changes) -> dict:
    doc = json.loads(path.read_text())
    m = doc["attributes"]["anchorkv"]
    m.update(changes)
    m["checksum"] = manifest_checksum(m)
    path.write_text(json.dumps(doc))
    return m


@pytest.mark.parametrize("change,problem", [
    (lambda h: h[:-1], "not the 3 prefix hashes"),
    (lambda h: [*h[:-1], "0" * 64], None),  # a wrong hash of the right form: never matches, not damaged
    (lambda h: [*h[:-1], "xyz"], "not the 3 prefix hashes"),
])
def test_boundary_hashes_are_checked(store, change, problem):
    (info,) = store.list()
    m = _tampered(info, Path(store.backend.root) / info.path / "zarr.json",
                  boundary_hashes=change(info.manifest["boundary_hashes"]))
    problems = check_manifest(info.id, m)
    if problem is None:
        assert problems == []
        fresh = Store.open(store.backend.root, create=False)
        assert match(fresh, EDITED, shared=True).tokens == 512  # the first two still match
        assert match(fresh, BASE[:800], shared=True).tokens == 512  # the third no longer does
    else:
        assert any(problem in p for p in problems), problems
        with pytest.raises(CorruptEntry):
            Store.open(store.backend.root, create=False).get(info.id)


def test_boundary_hashes_on_an_entry_with_recurrent_state_make_it_damaged(tmp_path):
    """A hybrid's state exists only after all its tokens: boundary hashes there would restore a
    state that does not belong to the shared prefix, so such a manifest is refused."""
    store = Store.open(tmp_path / "s")
    info = save(store, BASE, layout=tiny_layout(), codecs=CODECS)
    m = _tampered(info, Path(store.backend.root) / info.path / "zarr.json",
                  boundary_hashes=PrefixHasher(BASE, info.fingerprint_hash).boundaries(900))
    assert any("recurrent state" in p for p in check_manifest(info.id, m))
    fresh = Store.open(tmp_path / "s", create=False)
    assert match(fresh, EDITED, layout=tiny_layout(), shared=True) is None


def test_an_object_store_reads_the_new_manifests_at_once(tmp_path, monkeypatch):
    """Each manifest read from an object store is a round trip: a shared match issues its new
    ones together (here a local store standing in for one, each read held 200 ms)."""
    import threading
    import time

    store = Store.open(tmp_path / "s")
    for i in range(6):
        save(store, np.concatenate([BASE[:300], toks(400 + 10 * i, 10 + i)]))
    fresh = Store.open(tmp_path / "s", create=False)
    monkeypatch.setattr(fresh.backend, "write_concurrency", 8)  # as an object store's backend says
    lock, state = threading.Lock(), {"now": 0, "most": 0}

    def hold(path):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        time.sleep(0.2)
        with lock:
            state["now"] -= 1

    reads = record_reads(monkeypatch, fresh, before=hold)
    assert match(fresh, np.concatenate([BASE[:300], toks(500, 99)]), shared=True).tokens == 256
    assert len([p for p in reads if p.endswith("zarr.json")]) == 6 and state["most"] == 6


def test_excluded_entries_are_never_returned(tmp_path):
    store = Store.open(tmp_path / "s")
    long = save(store, BASE)
    short = save(store, EDITED[:300])
    assert match(store, EDITED, shared=True).info.id == long.id
    found = match(store, EDITED, shared=True, exclude={long.id})
    assert (found.info.id, found.tokens) == (short.id, 300)
    assert match(store, EDITED, shared=True, exclude={long.id, short.id}) is None


def test_a_store_error_reading_an_extra_manifest_keeps_the_whole_match(tmp_path, monkeypatch):
    """The shared search's extra reads are optional: one failing (an S3 timeout) passes that
    entry over; the whole 300-token match found first is still returned."""
    store = Store.open(tmp_path / "s")
    long = save(store, BASE)
    short = save(store, EDITED[:300])
    fresh = Store.open(tmp_path / "s", create=False)

    def failing(path):
        if long.id in path:
            raise OSError("connection reset by peer")

    record_reads(monkeypatch, fresh, before=failing)
    found = match(fresh, EDITED, shared=True)
    assert (found.info.id, found.tokens) == (short.id, 300)


def test_close_ends_the_manifest_threads(tmp_path, monkeypatch):
    store = Store.open(tmp_path / "s")
    for i in range(3):
        save(store, np.concatenate([BASE[:300], toks(400 + 10 * i, 10 + i)]))
    fresh = Store.open(tmp_path / "s", create=False)
    monkeypatch.setattr(fresh.backend, "write_concurrency", 8)
    assert match(fresh, np.concatenate([BASE[:300], toks(500, 99)]), shared=True).tokens == 256
    threads = list(fresh._pools["manifest"]._threads)
    assert threads
    fresh.close()
    assert "manifest" not in fresh._pools and not any(t.is_alive() for t in threads)
