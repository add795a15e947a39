"""`Store.save`'s single-process commit (its part from memory, `commit_parts`) against the
marker path (`finish_rank`, then `commit_staged` reading the part back): the same files, byte
for byte, and the same manifest; and a rank of a multi-rank write still puts its marker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from anchorkv.store import IncompleteEntry
from anchorkv.store.paths import STAGING
from anchorkv.store.store import Store
from tests.store.helpers import CODECS, RAW_CODECS, all_packed, tiny_layout, tokens

N = 300
WRITE_ID = "samewrite0"


def _files(root: Path) -> dict[str, bytes]:
    """Every file under the entries of a store, by path (the entry's files and key groups)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted((root / "entries").rglob("*")) if p.is_file()}


def _spy(store: Store) -> list[str]:
    paths: list[str] = []
    real = store.backend.write

    def write(path, buffers, **kw):
        paths.append(path)
        return real(path, buffers, **kw)

    store.backend.write = write  # type: ignore[method-assign]
    return paths


@pytest.mark.parametrize("codecs,compressor",
                         [(RAW_CODECS, None), (CODECS, None), (CODECS, {"id": "zstd", "level": 1})],
                         ids=["raw", "quant", "quant-zstd"])
def test_in_process_commit_matches_marker_commit(tmp_path, monkeypatch, codecs, compressor):
    monkeypatch.setattr("anchorkv.store.commit.now", lambda: 1700000000.0)
    monkeypatch.setattr("anchorkv.store.store.now", lambda: 1700000000.0)
    layout = tiny_layout()
    packed = all_packed(layout, codecs, N)
    toks = tokens(N)
    kw = {"anchor": "same", "write_id": WRITE_ID, "compressor": compressor}

    mem = Store.open(tmp_path / "mem")
    mem_writes = _spy(mem)
    info_mem = mem.save(layout, codecs, toks, packed, **kw)

    marker = Store.open(tmp_path / "marker")
    marker_writes = _spy(marker)
    writer = marker.begin_entry(layout, codecs, toks, **kw)
    for (layer, field), p in packed.items():
        writer.write_layer(layer, field, p)
    writer.finish_rank()
    info_marker = marker.commit_staged(WRITE_ID)

    assert not [p for p in mem_writes if "/parts/" in p], "the single-process save put a part marker"
    assert [p for p in marker_writes if "/parts/" in p], "the marker path put no part marker"
    assert info_mem.id == info_marker.id
    assert info_mem.manifest == info_marker.manifest
    files_mem, files_marker = _files(tmp_path / "mem"), _files(tmp_path / "marker")
    assert files_mem.keys() == files_marker.keys()
    for path, data in files_mem.items():
        assert data == files_marker[path], path
    # the manifest handed to the store's cache is the one a reader parses (lists, not tuples)
    on_disk = json.loads(files_mem[f"entries/{info_mem.id}/zarr.json"])["attributes"]["anchorkv"]
    assert info_mem.manifest == on_disk
    for root in (tmp_path / "mem", tmp_path / "marker"):
        assert not list((root / STAGING).iterdir())
    # and each loads back the same values, from a fresh store (no cached manifest)
    a, b = Store.open(tmp_path / "mem"), Store.open(tmp_path / "marker")
    for layer, field in packed:
        assert torch.equal(a.load(info_mem.id, layout, layer, field).payload,
                           b.load(info_marker.id, layout, layer, field).payload)


def test_rank_of_multi_rank_write_commits_from_markers(tmp_path):
    """At tp_size 2 `EntryWriter.commit` puts its own marker and waits for the other rank's."""
    store = Store.open(tmp_path)
    toks = tokens(N)
    writers = [store.begin_entry(tiny_layout(2, r), RAW_CODECS, toks, anchor="tp", write_id="tpwrite0")
               for r in range(2)]
    for w in writers:
        for (layer, field), p in all_packed(w.layout, RAW_CODECS, N).items():
            w.write_layer(layer, field, p)
    with pytest.raises(IncompleteEntry):
        writers[0].commit()
    assert sorted(n for n in store.backend.list_dir(f"{STAGING}/tpwrite0/parts")) == ["rank-000-of-002.json"]
    writers[1].finish_rank()
    info = writers[0].commit()
    assert store.lookup(fingerprint_hash=info.manifest["fingerprint_hash"], anchor="tp", tokens=toks).id == info.id


def test_local_publish_makes_a_missing_key_directory(tmp_path):
    """`LocalBackend.publish` renames first and makes the key's directory only when it is
    missing (a delete removed it meanwhile); a staged directory that is gone still raises, and
    an entry already there wins."""
    from anchorkv.store.backends import LocalBackend

    b = LocalBackend(tmp_path)
    for name in ("a", "b", "c"):
        b.write(f".staging/{name}/data/zarr.json", [name.encode()])
    assert b.publish(".staging/a/data", "entries/key/e")  # entries/key does not exist
    assert (tmp_path / "entries/key/e/zarr.json").read_bytes() == b"a"
    assert not b.publish(".staging/b/data", "entries/key/e")  # taken: the first write stays
    assert (tmp_path / "entries/key/e/zarr.json").read_bytes() == b"a"
    with pytest.raises(FileNotFoundError):
        b.publish(".staging/gone/data", "entries/other/e")
    assert b.publish(".staging/c/data", "entries/key/f")



def test_single_rank_commit_asks_the_store_nothing_about_markers(tmp_path):
    """At tp_size 1 `Store.save` neither writes nor looks for a part marker (on an object store
    a look is a round trip); a writer that did put its marker (`finish_rank`) commits from it."""
    store = Store.open(tmp_path)
    asked: list[str] = []
    real = store.backend.exists

    def exists(path):
        asked.append(path)
        return real(path)

    store.backend.exists = exists  # type: ignore[method-assign]
    writes = _spy(store)
    layout = tiny_layout()
    info = store.save(layout, RAW_CODECS, tokens(N), all_packed(layout, RAW_CODECS, N), anchor="m")
    assert info.num_tokens == N
    assert not [p for p in asked + writes if "/parts" in p], asked + writes
    writer = store.begin_entry(layout, RAW_CODECS, tokens(N + 256), anchor="m")
    for (layer, field), p in all_packed(layout, RAW_CODECS, N + 256).items():
        writer.write_layer(layer, field, p)
    writer.finish_rank()
    assert writer.commit().num_tokens == N + 256
    assert [p for p in writes if "/parts/" in p] and not list((tmp_path / STAGING).iterdir())


@pytest.mark.parametrize("tp", [1, 2])
def test_a_layer_written_again_after_finish_rank_is_what_the_commit_publishes(tmp_path, tp):
    """A rank that put its part marker and then writes a layer again (a retry) takes its marker
    back: no commit but its own goes by it (another rank's, the scheduler's `commit_staged`:
    IncompleteEntry), and its own commits the retry's checksums, at tp_size 1 from memory, with
    more ranks by putting its marker again (found by review, twice: the commit went by the stale
    marker and published its checksums over the retry's bytes, an entry that fails `verify` and
    every load of that layer)."""
    store = Store.open(tmp_path)
    writers = [store.begin_entry(tiny_layout(tp, r), CODECS, tokens(N), anchor="r", write_id=f"again{tp}")
               for r in range(tp)]
    for w in writers:
        for (layer, field), p in all_packed(w.layout, CODECS, N).items():
            w.write_layer(layer, field, p)
    for w in writers[1:]:
        w.finish_rank()
    w = writers[0]
    w.finish_rank()
    layer = next(name for name, field in all_packed(w.layout, CODECS, N) if field == "latent")
    again = all_packed(w.layout, CODECS, N, seed=1)[(layer, "latent")]
    w.write_layer(layer, "latent", again)
    with pytest.raises(IncompleteEntry, match="rank" if tp > 1 else "no rank has finished"):
        writers[-1].commit() if tp > 1 else store.commit_staged(f"again{tp}")
    info = w.commit()
    assert store.verify(info) == []
    got = store.load(info, w.layout, layer, "latent")
    rows = got.shape[0] * got.shape[1]
    for a, b in ((got.payload, again.payload), (got.scales, again.scales)):  # the stored tokens' rows
        assert torch.equal(a.reshape(rows, -1)[:N], b.reshape(rows, -1)[:N])


def test_an_interrupt_after_the_publish_leaves_the_entry(store_url):
    """A KeyboardInterrupt in what follows a commit's publish (here its `on_commit`) reaches
    `Store.save`, whose clean-up (`EntryWriter.abort`) drops the write's staging but never the
    entry it published: on an object store that entry's data lies under the write's own prefix
    (found by review: the clean-up deleted it, leaving a manifest without data)."""
    url, options = store_url
    with Store.open(url, **options) as store:
        def interrupted(info):
            raise KeyboardInterrupt

        store._after_commit = interrupted  # type: ignore[method-assign]
        layout = tiny_layout()
        with pytest.raises(KeyboardInterrupt):
            store.save(layout, CODECS, tokens(N), all_packed(layout, CODECS, N), anchor="k")
    with Store.open(url, **options) as fresh:
        (info,) = fresh.list()
        assert info.num_tokens == N and fresh.verify(info) == []
