"""What the model's weights are, by content: the part of an entry's fingerprint that keeps a
fine-tune, a re-uploaded checkpoint or weights overwritten at the same path from restoring
another checkpoint's state (the layers' shapes alone cannot tell them apart).

`weights_digest` names the weight files vLLM loads by their SHA-256, taken where it is already
known and computed (once per file version, cached) where it is not:

- a Hugging Face hub cache: each snapshot file links to ``blobs/<sha256 of its content>``;
- a ``hf download --local-dir`` folder: ``.cache/huggingface/download/<file>.metadata`` holds
  the file's SHA-256 (its etag), valid while the file is not newer than the download;
- any other file: hashed, the result kept under `cache_dir()` keyed by the file's device,
  inode, size and mtime, so a restart reads nothing (a first start hashes at disk speed,
  several files at once; every rank of one engine waits for one hash).

Equal content gives equal digests whatever the path, node or commit name, so engines that load
one checkpoint from different places share entries without configuration. `config_digest`
names what else changes the computed state: the model's config as vLLM uses it (overrides
included, paths left out), the dtype and the quantization.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

log = logging.getLogger("anchorkv.connector")

#: load formats that read the checkpoint's own files from the model's folder
FILE_FORMATS = ("auto", "hf", "safetensors", "fastsafetensors", "instanttensor", "mistral", "pt",
                "npcache", "bitsandbytes")
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: training files next to the weights that vLLM does not load
NOT_WEIGHTS = ("training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt")
#: a file modified less than this many seconds before it is hashed: its hash is not cached
RACY_S = 2.0
#: bytes read per call while hashing
_READ = 16 << 20
#: config keys that name where the config came from, not what the model computes
_VOLATILE = frozenset({"_name_or_path", "_commit_hash", "transformers_version", "_attn_implementation",
                       "_attn_implementation_autoset", "_attn_implementation_internal", "name_or_path",
                       "max_model_len"})  # (MiniMax-M2's model sets --max-model-len into its config)


def cache_dir() -> Path:
    """Where computed file hashes are kept: ``$ANCHORKV_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/anchorkv``, else ``~/.cache/anchorkv``."""
    env = os.environ.get("ANCHORKV_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "anchorkv"


def weight_files(folder: str | os.PathLike[str], load_format: str = "auto") -> list[Path]:
    """The weight files vLLM's default loader reads from `folder` for `load_format` (sorted):
    ``consolidated*.safetensors`` for the Mistral format (`auto` picks it where they exist);
    else the ``*.safetensors`` its index names (all of them without an index), else ``*.bin``,
    else ``*.pt``. Empty when there are none (a config-only folder)."""
    folder = Path(folder)
    consolidated = sorted(folder.glob("consolidated*.safetensors"))
    if load_format == "mistral" or (load_format == "auto" and consolidated):
        return _indexed(folder, consolidated, "consolidated.safetensors.index.json")
    patterns = {"safetensors": ["*.safetensors"], "fastsafetensors": ["*.safetensors"],
                "instanttensor": ["*.safetensors"], "pt": ["*.pt"], "npcache": ["*.bin"]}
    for pattern in patterns.get(load_format, ["*.safetensors", "*.bin", "*.pt"]):
        files = sorted(Path(p) for p in glob.glob(str(folder / pattern)))
        if pattern != "*.safetensors":  # what vLLM leaves out (`filter_files_not_needed_for_inference`)
            files = [f for f in files if not f.name.endswith(NOT_WEIGHTS)]
        if files:
            if pattern == "*.safetensors":
                return _indexed(folder, files, "model.safetensors.index.json")
            return files
    return []


def _indexed(folder: Path, files: list[Path], index: str) -> list[Path]:
    """`files` less those the index file does not name (vLLM skips them too)."""
    try:
        weight_map = json.loads((folder / index).read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError):
        return files
    named = set(weight_map.values())
    return [f for f in files if f.name in named] or files


def known_sha256(path: Path) -> str | None:
    """The SHA-256 of `path`'s content where something already recorded it (see the module's
    text), without reading the file; None otherwise."""
    if path.is_symlink():  # a hub cache snapshot: .../snapshots/<commit>/<file> -> ../../blobs/<sha256>
        target = Path(os.path.realpath(path))
        if target.parent.name == "blobs" and _SHA256.fullmatch(target.name):
            return target.name
    meta = path.parent / ".cache" / "huggingface" / "download" / f"{path.name}.metadata"
    try:
        lines = meta.read_text().splitlines()
        etag, timestamp = lines[1].strip().strip('"'), float(lines[2])
        if _SHA256.fullmatch(etag) and _changed(path.stat()) <= timestamp + 1:
            return etag  # unchanged since `hf download --local-dir` wrote it (the ctime too: a
            # copy that keeps the mtime, `cp -p` / `rsync -a`, cannot keep it)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _changed(st: os.stat_result) -> float:
    """When a file's content or inode last changed (mtime can be set back, ctime cannot)."""
    return max(st.st_mtime, st.st_ctime)


def file_sha256(path: Path) -> str:
    """The SHA-256 of `path`'s content (read in full)."""
    h = hashlib.sha256()
    buf = bytearray(_READ)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])  # hashlib releases the GIL for large updates: files hash in parallel
    return h.hexdigest()


def _stat_key(path: Path, st: os.stat_result) -> str:
    ident = (f"{os.path.realpath(path)}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}"
             f"\0{st.st_ctime_ns}")  # (ctime: an archive unpacked over the files keeps size and mtime)
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_ino, a.st_size, a.st_mtime_ns, a.st_ctime_ns) == (b.st_ino, b.st_size, b.st_mtime_ns, b.st_ctime_ns)


class WeightsChanged(RuntimeError):
    """A weight file changed after this process began (it may have loaded the old content, or
    a mix), or while it was hashed."""


def process_started() -> float | None:
    """When this process began (wall clock, Linux); None where it cannot be told."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # starttime: clock ticks after boot (field 22 of proc(5))
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


_warned_cache: set[str] = set()


def _writable(cache: Path) -> Path | None:
    """`cache`, or a per-user folder under the temporary directory where it cannot be written
    (a read-only home in a container: without a cache every start hashes the checkpoint again,
    on every rank); None where neither can."""
    import tempfile

    for where in (cache, Path(tempfile.gettempdir()) / f"anchorkv-{os.getuid()}" / "sha256"):
        try:
            where.mkdir(parents=True, exist_ok=True)
            probe = where / f".probe.{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            if str(where) not in _warned_cache:
                _warned_cache.add(str(where))
                log.warning("anchorkv: cannot keep weight file hashes in %s (%s)", where, e)
            continue
        return where
    return None


@contextlib.contextmanager
def _locked(lock: Path | None) -> Iterator[None]:
    """Holds an exclusive lock on `lock` (the ranks of one engine start together: one hashes,
    the others wait and read its result)."""
    if lock is None:
        yield
        return
    fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _cached(key: str, cache: Path | None) -> str | None:
    if cache is None:
        return None
    try:
        value = (cache / f"{key}.sha256").read_text().strip()
    except OSError:
        return None
    return value if _SHA256.fullmatch(value) else None


def _remember(key: str, value: str, cache: Path | None, st: os.stat_result, stat_time: float) -> None:
    """Keeps `value` unless the file had changed less than `RACY_S` before it was looked at: a
    file rewritten within its filesystem's timestamp granularity could keep its key (git's
    "racy" files); such a file is hashed again next time."""
    if cache is None or stat_time - _changed(st) < RACY_S:
        return
    try:
        tmp = cache / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(value)
        os.replace(tmp, cache / f"{key}.sha256")
    except OSError as e:
        log.debug("anchorkv: cannot cache a weight file's hash in %s: %s", cache, e)


def files_sha256(files: list[Path], cache: Path | None = None, threads: int = 8, *,
                 since: float | None = None, hash_missing: bool = True) -> list[str] | None:
    """Each file's SHA-256: recorded ones as they are, the others from the cache or hashed (in
    parallel) and cached. `since`: raise `WeightsChanged` for a file hashed here that changed
    after that time (this process's start: it may have loaded other content) or while it was
    hashed. `hash_missing` False: None where a file would have to be read."""
    out: list[str | None] = [known_sha256(f) for f in files]
    todo = [i for i, v in enumerate(out) if v is None]
    if not todo:
        return [v for v in out if v is not None]
    stat_time = time.time()
    stats = {i: files[i].stat() for i in todo}
    late = [files[i] for i in todo if since is not None and _changed(stats[i]) > since]
    if late:
        raise WeightsChanged(f"{late[0]} changed after this process began")
    keys = {i: _stat_key(files[i], stats[i]) for i in todo}
    cache = _writable(cache_dir() / "sha256" if cache is None else cache)
    folder = hashlib.sha256(os.path.realpath(files[todo[0]].parent).encode()).hexdigest()[:16]
    with _locked(None if cache is None else cache / f".lock-{folder}"):  # per checkpoint folder
        for i in todo:
            out[i] = _cached(keys[i], cache)
        todo = [i for i in todo if out[i] is None]
        if todo and not hash_missing:
            return None
        if todo:
            size = sum(stats[i].st_size for i in todo)
            log.info("anchorkv: hashing %d weight file(s), %.1f GB, to key entries to the weights' content "
                     "(%s)", len(todo), size / 1e9, f"once: kept in {cache}" if cache else "not kept: no cache")
            t0 = time.perf_counter()
            with ThreadPoolExecutor(max(1, min(threads, len(todo)))) as pool:
                for i, value in zip(todo, pool.map(lambda i: file_sha256(files[i]), todo), strict=True):
                    if not _same(stats[i], files[i].stat()):
                        raise WeightsChanged(f"{files[i]} changed while it was hashed")
                    out[i] = value
                    _remember(keys[i], value, cache, stats[i], stat_time)
            log.info("anchorkv: weights hashed in %.1f s", time.perf_counter() - t0)
    return [v for v in out if v is not None]


def weights_folder(vllm_config: Any) -> str | None:
    """The local folder (or file) vLLM's loader read the weights from: the model's path, or its
    hub cache snapshot for the revision (found without the network); None where they are not
    on this node's disk or come from another source (object storage, a loader plug-in)."""
    model_config = vllm_config.model_config
    name = str(getattr(model_config, "model", "") or "")
    remote = getattr(model_config, "model_weights", None)
    if remote and remote != name:  # streamed from object storage: `model` is a local config copy
        return None
    if os.path.isdir(name) or (os.path.isfile(name) and name.endswith(".gguf")):
        return name
    load_config = getattr(vllm_config, "load_config", None)
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(name, revision=getattr(model_config, "revision", None),
                                     cache_dir=getattr(load_config, "download_dir", None), local_files_only=True))
    except Exception:  # not in this node's hub cache, not a hub id, no huggingface_hub
        return None


def weights_digest(vllm_config: Any, cache: Path | None = None, *, hash_missing: bool = True,
                   since: float | None = None) -> str | None:
    """``sha256:<hex>`` of the weight files' SHA-256s (sorted: names and paths left out),
    ``dummy`` for vLLM's random weights, None where the weights cannot be read here (see
    `weights_folder`; the entries are then keyed to the model's name only) or, without
    `hash_missing`, where a file would have to be read.

    A weight file hashed here that changed after `since` (this process's start: vLLM may have
    loaded the old content or a mix), or that cannot be read, gives ``unstable:<random>``: this
    process's entries are then its own, never restored by another engine nor it by theirs."""
    load_format = str(getattr(getattr(vllm_config, "load_config", None), "load_format", "auto") or "auto")
    load_format = load_format.rsplit(".", 1)[-1].lower()  # an enum's str on older versions
    if load_format == "dummy":
        return "dummy"
    if load_format not in FILE_FORMATS and load_format != "gguf":
        return None
    where = weights_folder(vllm_config)
    if where is None:
        return None
    files = [Path(where)] if os.path.isfile(where) else weight_files(where, load_format)
    if not files:
        return None
    try:
        hashes = files_sha256(files, cache, since=since, hash_missing=hash_missing)
    except (OSError, WeightsChanged) as e:
        log.error("anchorkv: the weights in %s cannot be named by their content (%s): this engine's entries "
                  "are its own (not shared, not restored after a restart); restart vLLM once the checkpoint "
                  "is complete", where, e)
        return f"unstable:{uuid.uuid4().hex}"
    if hashes is None:
        return None
    return "sha256:" + hashlib.sha256("\n".join(sorted(hashes)).encode()).hexdigest()[:32]


def _clean(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items() if k not in _VOLATILE}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    text = str(obj)  # a dtype, an enum; an object whose text names its address: its type
    return type(obj).__qualname__ if " at 0x" in text else text


def config_digest(vllm_config: Any, hf_config: dict) -> str:
    """A digest of what besides the weights decides the state a prompt leaves: the model's
    config as vLLM runs it (`hf_config`, overrides applied; where it was read from left out),
    the compute dtype and the quantization."""
    model_config = vllm_config.model_config
    what = {"config": _clean(hf_config), "dtype": str(getattr(model_config, "dtype", None)),
            "quantization": str(getattr(model_config, "quantization", None))}
    text = json.dumps(what, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]
