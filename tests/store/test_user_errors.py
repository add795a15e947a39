"""A review of what users can get wrong (stop 48), each pinned: values that deleted live data
or were taken silently (a gc's `stale_after` of NaN or below 0, a fractional capacity), a
mistyped store path made a store (``""``, ``s3:/bucket``, a directory of other files, another
Zarr hierarchy), S3 options obstore panics on, an entry named twice to ``rm``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from anchorkv.cli import main
from anchorkv.store.errors import StoreUnavailable
from anchorkv.store.paths import STAGING
from anchorkv.store.store import Store
from tests.store.helpers import CODECS, all_packed, tiny_layout, tokens


def save(store: Store, anchor: str, seed: int = 0):
    layout = tiny_layout()
    return store.save(layout, CODECS, tokens(300), all_packed(layout, CODECS, 300, seed), anchor=anchor)


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _write_in_progress(root: Path) -> Path:
    """A staged write that has just begun (a save in flight in another process)."""
    marker = root / STAGING / "w123" / "begun-000.json"
    marker.parent.mkdir(parents=True)
    marker.write_text('{"data": "x"}')
    return marker


@pytest.mark.parametrize("stale_after", [math.nan, -5.0, "3600", True])
def test_gc_refuses_a_stale_after_that_is_not_a_time(tmp_path, stale_after):
    """NaN compared as never younger and -5 as always older: gc removed every write in
    progress, as only 0 is documented to."""
    store = Store.open(tmp_path / "s")
    marker = _write_in_progress(tmp_path / "s")
    with pytest.raises(ValueError, match="stale_after must be a number of seconds >= 0"):
        store.gc(stale_after=stale_after)
    assert marker.exists()
    assert store.gc(stale_after=3600)["abandoned_writes"] == 0 and marker.exists()
    assert store.gc(stale_after=0)["abandoned_writes"] == 1 and not marker.exists()


@pytest.mark.parametrize("value", ["nan", "-5", "soon"])
def test_gc_cli_refuses_a_stale_after_that_is_not_a_time(tmp_path, capsys, value):
    Store.open(tmp_path / "s")
    marker = _write_in_progress(tmp_path / "s")
    with pytest.raises(SystemExit) as e:
        main(["gc", "--store", str(tmp_path / "s"), f"--stale-after={value}"])
    assert e.value.code == 2 and "expected a number of seconds >= 0" in capsys.readouterr().err
    assert marker.exists()


@pytest.mark.parametrize("url,msg", [
    ("", "found an empty path"),
    ("s3:/bucket/prefix", "looks like s3://bucket/prefix, found 's3:/bucket/prefix'"),
    ("s3:bucket/prefix", "looks like s3://bucket/prefix"),
])
def test_a_mistyped_store_url_is_refused_and_makes_nothing(tmp_path, monkeypatch, url, msg):
    monkeypatch.chdir(tmp_path)  # ("" was the current directory; s3:/b/p a local ./s3:/b/p)
    with pytest.raises(StoreUnavailable, match=msg):
        Store.open(url)
    assert list(tmp_path.iterdir()) == []


def test_a_directory_of_other_files_is_not_made_a_store(tmp_path):
    home = tmp_path / "home"
    (home / ".trash").mkdir(parents=True)
    (home / ".trash" / "keep.txt").write_text("mine")
    (home / "notes.txt").write_text("mine")
    with pytest.raises(StoreUnavailable, match=r"is not an anchorkv store and holds other files \(notes.txt\); "
                                               "pass an empty or new directory"):
        Store.open(home)
    assert sorted(p.name for p in home.iterdir()) == [".trash", "notes.txt"]
    for ok in (tmp_path / "new", tmp_path / "empty", tmp_path / "volume"):  # a new one, an empty one, a disk's root
        ok.mkdir(exist_ok=True)
        if ok.name == "volume":
            (ok / "lost+found").mkdir()
        save(Store.open(ok), "alice")
        assert len(Store.open(ok).list()) == 1


def test_another_zarr_hierarchy_is_not_an_anchorkv_store(tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    for create in (True, False):
        with pytest.raises(StoreUnavailable, match="is a Zarr store but not an anchorkv one"):
            Store.open(other, create=create)
    code, _, err = run(capsys, "ls", "--store", str(other))
    assert code == 2 and "not an anchorkv one" in err
    (other / "zarr.json").write_text("{cut")  # a damaged root of a store is tolerated
    Store.open(other, create=False)


def test_ls_names_the_stores_inside_a_directory(tmp_path, capsys):
    save(Store.open(tmp_path / "d" / "demo-raw"), "alice")
    code, _, err = run(capsys, "ls", "--store", str(tmp_path / "d"))
    assert code == 2 and "(stores inside it: demo-raw)" in err, err


@pytest.mark.parametrize("kwargs,msg", [
    ({"capacity_bytes": "200GB"}, "capacity_bytes must be a whole number of bytes >= 0 or None"),
    ({"capacity_bytes": -1}, "capacity_bytes must be"),
    ({"capacity_bytes": 1.5}, "capacity_bytes must be"),
    ({"io_threads": 0}, "io_threads must be a whole number >= 1"),
])
def test_store_arguments_are_checked_when_opened(tmp_path, kwargs, msg):
    """They failed later: a TypeError at the first eviction, every entry evicted, no I/O thread."""
    with pytest.raises(ValueError, match=msg):
        Store.open(tmp_path / "s", **kwargs)


@pytest.mark.parametrize("url,options,msg", [
    ("s3://b/p?endpoint=notaurl", {}, "'endpoint' must be an http\\(s\\) URL such as http://127.0.0.1:9000, "
                                      "found 'notaurl'"),
    ("s3://b b/p?endpoint=http://127.0.0.1:1", {}, "expected a bucket name of letters, digits"),
    ("s3://b/p", {"endpoint": 5}, "'endpoint' must be an http\\(s\\) URL"),
    ("s3://b/p", {"endpoint": ["http://x"]}, "storage option 'endpoint' must be text, a number or true/false"),
    ("s3://b/p?timeout=abc", {}, "'timeout' must be a duration such as '30s'"),
    ("s3://b/p?endpoint=http://127.0.0.1:1&allow_http=nope", {}, "'allow_http' must be true or false, found 'nope'"),
])
def test_s3_options_obstore_cannot_take_are_refused(url, options, msg, monkeypatch):
    """An endpoint that is not a URL, or a bucket name with a space, reached a panic in obstore's
    request builder: a Rust backtrace and a PanicException no `except Exception` catches."""
    pytest.importorskip("obstore")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    for create in (True, False):
        with pytest.raises(StoreUnavailable, match=msg):
            Store.open(url, create=create, **options)


def test_rm_of_an_entry_named_twice_deletes_it_once(tmp_path, capsys):
    store = Store.open(tmp_path / "s")
    entry = save(store, "alice")
    code, out, err = run(capsys, "rm", "--store", str(tmp_path / "s"), "--json", "alice", entry.id[:8])
    assert code == 0, err
    assert [d["id"] for d in json.loads(out)["deleted"]] == [entry.id]
    assert Store.open(tmp_path / "s").list() == []


@pytest.mark.parametrize("capacity,left", [("1e9", 1), ("0", 0)])
def test_gc_capacity_takes_a_number_of_bytes(tmp_path, capsys, capacity, left):
    save(Store.open(tmp_path / "s"), "alice")
    code, _, err = run(capsys, "gc", "--store", str(tmp_path / "s"), "--capacity", capacity)
    assert code == 0, err
    assert len(Store.open(tmp_path / "s").list()) == left


def test_gc_capacity_says_zero_is_allowed_alone(tmp_path, capsys):
    Store.open(tmp_path / "s")
    code, _, err = run(capsys, "gc", "--store", str(tmp_path / "s"), "--capacity", "0GB")
    assert code == 2 and "must be positive" in err and "(or 0: evict every entry not in use)" in err



def test_a_load_of_no_blocks_from_inside_a_chunk_is_empty(tmp_path):
    """start_token 5, num_blocks 0: the plan named chunk 0 for an empty token range and failed an
    assertion (a review's finding; start_token 0 gave the empty load)."""
    layout = tiny_layout()
    store = Store.open(tmp_path / "s")
    entry = save(store, "alice")
    for start in (0, 5, 299):
        p = store.load(entry, layout, "model.layers.4.attn", "latent", start_token=start, num_blocks=0)
        assert p.shape[0] == 0 and p.payload.numel() == 0


@pytest.mark.parametrize("kwargs", [{"num_blocks": -1}, {"num_blocks": 1.5}, {"start_token": -3},
                                    {"start_token": True}])
def test_load_arguments_are_whole_numbers(tmp_path, kwargs):
    layout = tiny_layout()
    store = Store.open(tmp_path / "s")
    entry = save(store, "alice")
    with pytest.raises(ValueError, match=f"{next(iter(kwargs))} must be a whole number >= 0"):
        store.load(entry, layout, "model.layers.4.attn", "latent", **kwargs)


def test_a_store_another_process_is_creating_opens(tmp_path):
    """Two processes opening a new store at once: one finds the other's zarr.json being written
    (its temporary file), its probe, its entries group; none of them is another file."""
    root = tmp_path / "s"
    root.mkdir()
    (root / ".zarr.json.1a2b3c4d.tmp").write_text("{}")
    (root / ".write-probe-0123").write_text("anchorkv write probe")
    (root / "entries").mkdir()
    save(Store.open(root), "alice")
    assert len(Store.open(root, create=False).list()) == 1


def test_the_default_store_opens_beside_the_weight_hash_cache(tmp_path, monkeypatch):
    """The default store (~/.cache/anchorkv) is also where the connector keeps its weight hashes
    (sha256/, written before it opens the store): the store opened there (a second review)."""
    from anchorkv.connector.weights import cache_dir, files_sha256

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("ANCHORKV_CACHE_DIR", raising=False)
    ckpt = tmp_path / "model.safetensors"
    ckpt.write_bytes(b"x" * 1000)
    files_sha256([ckpt])
    assert (cache_dir() / "sha256").is_dir() and cache_dir() == tmp_path / "home" / ".cache" / "anchorkv"
    save(Store.open(cache_dir()), "alice")


def test_a_store_created_between_the_read_and_the_listing_opens(tmp_path, monkeypatch):
    """Another process renamed its zarr.json into place after this one found none, before it
    listed the directory (8 processes opening a new store 300 times: 2 refused)."""
    from anchorkv.store.backends import LocalBackend

    Store.open(tmp_path / "s")
    real = LocalBackend.read

    def late(self, path, *args, **kwargs):
        if path == "zarr.json":
            raise FileNotFoundError(path)
        return real(self, path, *args, **kwargs)

    monkeypatch.setattr(LocalBackend, "read", late)
    Store.open(tmp_path / "s")


def test_obstores_structured_options_pass(monkeypatch):
    """retry_config (a dict), credential_provider (a callable), durations as a timedelta or with
    decimals: valid obstore options the first check refused."""
    pytest.importorskip("obstore")
    from datetime import timedelta

    from anchorkv.store.backends import ObjectBackend

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    ObjectBackend("s3://b/p?endpoint=http://127.0.0.1:1&timeout=1.5s",
                  retry_config={"max_retries": 1, "retry_timeout": timedelta(seconds=2)})
    ObjectBackend("s3://b/p", endpoint="http://127.0.0.1:1", connect_timeout=timedelta(seconds=3))
    ObjectBackend("s3://b/p", endpoint="http://127.0.0.1:1",
                  credential_provider=lambda: {"access_key_id": "x", "secret_access_key": "y", "expires_at": None})


def test_stats_counts_only_what_gc_removes_as_unloadable(tmp_path, capsys, monkeypatch):
    """stats said an unreadable entry's bytes were ones `anchorkv gc` removes; gc keeps it."""
    import errno

    from anchorkv.store.backends import LocalBackend

    store = Store.open(tmp_path / "s")
    save(store, "alice")
    bad = save(store, "bob", seed=1)
    real = LocalBackend.read

    def denied(self, path, *args, **kwargs):
        if path.startswith(bad.path):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real(self, path, *args, **kwargs)

    monkeypatch.setattr(LocalBackend, "read", denied)
    code, out, err = run(capsys, "stats", "--store", str(tmp_path / "s"), "--json")
    totals = json.loads(out)
    assert code == 0 and totals["states"] == {"ok": 1, "unreadable": 1} and totals["unloadable_bytes"] == 0, totals
    code, out, _ = run(capsys, "stats", "--store", str(tmp_path / "s"))
    assert code == 0 and "gc` removes them" not in out, out
