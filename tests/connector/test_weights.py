"""`connector.weights`: the weight files vLLM loads, named by their content (recorded SHA-256s
read without reading the files, computed ones cached by file version), and the config digest."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from anchorkv.connector import weights as W


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def old(path: Path) -> Path:
    """`path`'s mtime a minute ago (its ctime stays now: tests that cache set `RACY_S` to 0)."""
    t = time.time() - 60
    os.utime(path, (t, t))
    return path


@pytest.fixture
def no_racy(monkeypatch):
    monkeypatch.setattr(W, "RACY_S", 0.0)


def vllm_config(model: str, load_format: str = "auto", **model_kw):
    model_config = SimpleNamespace(model=model, revision=None, model_weights="", dtype="torch.bfloat16",
                                   quantization=None, **model_kw)
    return SimpleNamespace(model_config=model_config,
                           load_config=SimpleNamespace(load_format=load_format, download_dir=None))


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ANCHORKV_CACHE_DIR", str(tmp_path / "cache"))


# ------------------------------------------------------------------------------ which files


def test_weight_files_follow_vllms_choice(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    assert W.weight_files(d) == []
    (d / "training_args.bin").write_bytes(b"x")  # vLLM leaves out what a trainer saves
    (d / "optimizer.pt").write_bytes(b"x")
    (d / "pytorch_model.bin").write_bytes(b"x")
    (d / "extra.pt").write_bytes(b"x")
    assert W.weight_files(d) == [d / "pytorch_model.bin"]  # *.bin before *.pt, as vLLM globs
    assert W.weight_files(d, "pt") == [d / "extra.pt"]
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "stray.safetensors"):
        (d / name).write_bytes(b"x")
    assert [f.name for f in W.weight_files(d)] == ["model-00001-of-00002.safetensors",
                                                    "model-00002-of-00002.safetensors", "stray.safetensors"]
    # the index names the shards vLLM loads; a file it does not name is not a weight file
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert [f.name for f in W.weight_files(d)] == ["model-00001-of-00002.safetensors",
                                                    "model-00002-of-00002.safetensors"]
    (d / "consolidated.safetensors").write_bytes(b"x")  # Mistral's format: `auto` loads it
    assert [f.name for f in W.weight_files(d)] == ["consolidated.safetensors"]
    assert [f.name for f in W.weight_files(d, "hf")] == ["model-00001-of-00002.safetensors",
                                                          "model-00002-of-00002.safetensors"]


# ------------------------------------------------------------------------------ known hashes


def hub_cache(root: Path, repo: str, files: dict[str, bytes], commit: str = "c" * 40) -> Path:
    """A Hugging Face hub cache as huggingface_hub lays it out: blobs named by their SHA-256,
    snapshot files linking to them, refs/main naming the commit."""
    base = root / f"models--{repo.replace('/', '--')}"
    (base / "blobs").mkdir(parents=True)
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(commit)
    for name, data in files.items():
        blob = base / "blobs" / sha(data)
        blob.write_bytes(data)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    return snap


def test_a_hub_cache_names_each_file_by_its_blob_without_reading_it(tmp_path, monkeypatch):
    snap = hub_cache(tmp_path / "hub", "acme/m", {"config.json": b"{}", "model.safetensors": b"weights-1"})
    f = snap / "model.safetensors"
    assert W.known_sha256(f) == sha(b"weights-1")
    monkeypatch.setattr(W, "file_sha256", lambda p: pytest.fail(f"read {p}"))
    assert W.files_sha256([f]) == [sha(b"weights-1")]


def test_a_hub_model_resolves_to_its_snapshot_offline(tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    hub_cache(hub, "acme/m", {"config.json": b"{}", "model.safetensors": b"weights-1"})
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as C

    monkeypatch.setattr(C, "HF_HUB_CACHE", str(hub))
    cfg = vllm_config("acme/m")
    cfg.load_config.download_dir = str(hub)
    one = W.weights_digest(cfg)
    assert one is not None and one.startswith("sha256:")
    assert W.weights_digest(vllm_config("acme/absent")) is None  # not on this node: unread


def test_a_local_dir_download_names_unchanged_files_by_their_etag(tmp_path):
    d = tmp_path / "m"
    meta = d / ".cache" / "huggingface" / "download"
    meta.mkdir(parents=True)
    f = d / "model.safetensors"
    f.write_bytes(b"weights-1")
    etag = "e" * 64  # what the hub said; huggingface_hub records it with the download time
    (meta / "model.safetensors.metadata").write_text(f"{'c' * 40}\n{etag}\n{time.time() + 5}\n")
    assert W.known_sha256(f) == etag
    (meta / "model.safetensors.metadata").write_text(f"{'c' * 40}\n{etag}\n{time.time() - 60}\n")
    assert W.known_sha256(f) is None  # modified after the download: the etag no longer holds


# ------------------------------------------------------------------------------ computed, cached


def test_computed_hashes_are_cached_per_file_version(tmp_path, monkeypatch, no_racy):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"a" * 1000)
    old(f)
    assert W.files_sha256([f]) == [sha(b"a" * 1000)]
    real = W.file_sha256
    monkeypatch.setattr(W, "file_sha256", lambda p: pytest.fail(f"read {p} again"))
    assert W.files_sha256([f]) == [sha(b"a" * 1000)]  # the cache: nothing read
    f.write_bytes(b"b" * 1000)  # the same size, another mtime: another version
    os.utime(f, (time.time() - 30, time.time() - 30))
    monkeypatch.setattr(W, "file_sha256", real)
    assert W.files_sha256([f]) == [sha(b"b" * 1000)]


def test_a_copy_keeping_the_mtime_does_not_keep_the_etag(tmp_path):
    """`cp -p` / `rsync -a` of another checkpoint over a `--local-dir` download keeps the mtime
    the download recorded, never the ctime: the etag no longer names the content."""
    d = tmp_path / "m"
    meta = d / ".cache" / "huggingface" / "download"
    meta.mkdir(parents=True)
    f = d / "model.safetensors"
    f.write_bytes(b"weights-2")
    t = time.time() - 3600
    os.utime(f, (t, t))  # the mtime of the download, as `cp -p` keeps it
    (meta / "model.safetensors.metadata").write_text(f"{'c' * 40}\n{'e' * 64}\n{t + 0.5}\n")
    assert W.known_sha256(f) is None
    assert W.files_sha256([f]) == [sha(b"weights-2")]


def test_content_replaced_with_the_same_size_and_mtime_is_hashed_again(tmp_path, no_racy):
    """An archive unpacked over the weights (fixed mtimes, same sizes, the same inode) changes
    the ctime only: the cache is keyed to it."""
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"a" * 1000)
    os.utime(f, (0, 0))
    assert W.files_sha256([f]) == [sha(b"a" * 1000)]
    time.sleep(0.01)
    with open(f, "r+b") as fh:
        fh.write(b"b" * 1000)
    os.utime(f, (0, 0))
    assert W.files_sha256([f]) == [sha(b"b" * 1000)]


def test_racy_is_judged_when_the_file_is_looked_at(tmp_path, monkeypatch):
    """A file hashed for longer than `RACY_S` that had changed just before it was looked at is
    not cached (judged after the hash, every real shard looked old enough)."""
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"a" * 1000)
    real = W.file_sha256
    clock = [time.time()]
    monkeypatch.setattr(W.time, "time", lambda: clock[0])

    def slow(p):
        clock[0] += 10  # the hash takes 10 s
        return real(p)

    monkeypatch.setattr(W, "file_sha256", slow)
    W.files_sha256([f])
    assert not list((tmp_path / "cache" / "sha256").glob("*.sha256"))


def test_a_file_changed_after_the_process_began_or_while_hashed_is_refused(tmp_path, monkeypatch):
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"a" * 1000)
    with pytest.raises(W.WeightsChanged, match="changed after this process began"):
        W.files_sha256([f], since=time.time() - 60)
    real = W.file_sha256

    def rewrite(p):
        out = real(p)
        p.write_bytes(b"b" * 1000)
        return out

    monkeypatch.setattr(W, "file_sha256", rewrite)
    with pytest.raises(W.WeightsChanged, match="changed while it was hashed"):
        W.files_sha256([f])
    monkeypatch.setattr(W, "file_sha256", real)
    d = tmp_path / "m"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"x")
    digest = W.weights_digest(vllm_config(str(d)), since=time.time() - 60)
    assert digest.startswith("unstable:") and digest != W.weights_digest(vllm_config(str(d)), since=time.time() - 60)
    assert W.weights_digest(vllm_config(str(d)), since=time.time() + 60).startswith("sha256:")
    assert W.process_started() is None or W.process_started() <= time.time()


def test_without_hash_missing_nothing_is_read(tmp_path, monkeypatch, no_racy):
    d = tmp_path / "m"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"x" * 100)
    monkeypatch.setattr(W, "file_sha256", lambda p: pytest.fail(f"read {p}"))
    assert W.weights_digest(vllm_config(str(d)), hash_missing=False) is None
    monkeypatch.undo()
    monkeypatch.setenv("ANCHORKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(W, "RACY_S", 0.0)
    hashed = W.weights_digest(vllm_config(str(d)))
    monkeypatch.setattr(W, "file_sha256", lambda p: pytest.fail(f"read {p}"))
    assert W.weights_digest(vllm_config(str(d)), hash_missing=False) == hashed


def test_a_file_changed_just_before_hashing_is_not_cached(tmp_path, monkeypatch):
    """A file rewritten within the filesystem's timestamp granularity may keep its stat key:
    its hash is not cached while it is that young (git's racy files)."""
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"a" * 1000)
    assert W.files_sha256([f]) == [sha(b"a" * 1000)]
    reads = []
    monkeypatch.setattr(W, "file_sha256", lambda p: reads.append(p) or sha(p.read_bytes()))
    assert W.files_sha256([f]) == [sha(b"a" * 1000)]
    assert reads == [f]


def test_hashing_works_without_a_writable_cache(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("ANCHORKV_CACHE_DIR", str(blocker / "cache"))
    import tempfile

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(blocker))  # the fallback cannot be written either
    monkeypatch.setattr(W, "_warned_cache", set())
    f = tmp_path / "w.bin"
    f.write_bytes(b"z" * 100)
    with caplog.at_level("WARNING", logger="anchorkv.connector"):
        assert W.files_sha256([f]) == [sha(b"z" * 100)]
    assert caplog.text.count("cannot keep weight file hashes") == 2


def test_a_read_only_cache_falls_back_to_the_temporary_directory(tmp_path, monkeypatch, caplog, no_racy):
    """A read-only home (a container): hashes are kept under the temporary directory, with a
    warning, so a restart and the other ranks do not hash the checkpoint again."""
    import tempfile

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("ANCHORKV_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    monkeypatch.setattr(W, "_warned_cache", set())
    f = tmp_path / "w.bin"
    f.write_bytes(b"z" * 100)
    with caplog.at_level("WARNING", logger="anchorkv.connector"):
        assert W.files_sha256([f]) == [sha(b"z" * 100)]
    assert "cannot keep weight file hashes" in caplog.text
    monkeypatch.setattr(W, "file_sha256", lambda p: pytest.fail(f"read {p} again"))
    assert W.files_sha256([f]) == [sha(b"z" * 100)]
    assert list((tmp_path / "tmp").rglob("*.sha256"))


def test_big_files_hash_like_hashlib(tmp_path, monkeypatch):
    monkeypatch.setattr(W, "_READ", 1000)  # several reads, a short last one
    data = os.urandom(4321)
    f = tmp_path / "w.safetensors"
    f.write_bytes(data)
    assert W.file_sha256(f) == sha(data)


# ------------------------------------------------------------------------------ the digest


def test_the_digest_is_the_contents_wherever_they_lie(tmp_path):
    def folder(name: str, shards: list[bytes]) -> str:
        d = tmp_path / name
        d.mkdir()
        for i, data in enumerate(shards):
            (d / f"model-{i:05d}.safetensors").write_bytes(data)
        return str(d)

    a = W.weights_digest(vllm_config(folder("a", [b"one", b"two"])))
    assert a is not None and a.startswith("sha256:")
    assert W.weights_digest(vllm_config(folder("b", [b"one", b"two"]))) == a  # another path
    assert W.weights_digest(vllm_config(folder("c", [b"one", b"twO"]))) != a  # one byte
    assert W.weights_digest(vllm_config(folder("d", [b"one"]))) != a  # a shard fewer
    assert W.weights_digest(vllm_config(str(tmp_path / "a"), "dummy")) == "dummy"
    assert W.weights_digest(vllm_config(str(tmp_path / "a"), "runai_streamer")) is None
    assert W.weights_digest(vllm_config(str(tmp_path / "empty-absent"))) is None
    streamed = vllm_config(str(tmp_path / "a"))
    streamed.model_config.model_weights = "s3://bucket/model"  # `model` is a local config copy
    assert W.weights_digest(streamed) is None


def test_a_gguf_file_is_its_own_weights(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF....")
    assert W.weights_digest(vllm_config(str(f), "gguf")) == W.weights_digest(vllm_config(str(f), "auto"))
    assert W.weights_digest(vllm_config(str(f), "gguf")) is not None


def test_the_config_digest_ignores_where_the_config_came_from():
    base = {"model_type": "llama", "rope_theta": 10000.0, "_name_or_path": "/a", "transformers_version": "4.57",
            "text_config": {"_name_or_path": "/a", "hidden_size": 8}}
    cfg = vllm_config("/a")
    d = W.config_digest(cfg, base)
    moved = {**base, "_name_or_path": "/b", "text_config": {"_name_or_path": "/b", "hidden_size": 8},
             "max_model_len": 4096}  # (set by a model's init in the worker: not what it computes)
    assert W.config_digest(vllm_config("/b"), moved) == d
    assert W.config_digest(cfg, {**base, "rope_theta": 500000.0}) != d  # --hf-overrides, a new config.json
    quantized = vllm_config("/a")
    quantized.model_config.quantization = "fp8"
    assert W.config_digest(quantized, base) != d
    half = vllm_config("/a")
    half.model_config.dtype = "torch.float16"
    assert W.config_digest(half, base) != d

    class Opaque:  # an object whose text names its address: the same digest in every process
        pass

    assert W.config_digest(cfg, {**base, "x": Opaque()}) == W.config_digest(cfg, {**base, "x": Opaque()})
