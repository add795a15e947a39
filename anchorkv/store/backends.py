"""Where entry bytes live: a local directory (default) or an S3-compatible object store.

The store only needs a few operations, so a backend is small: whole-object reads and writes,
byte-range reads (`read_ranges_into`: an inner chunk of a shard),
listing one level of a prefix, deleting a prefix, and `publish`, the step that makes an entry
visible. Paths are '/'-separated, relative to the store root, and built by the store from hex
keys and fixed names only.

Local: chunks go to a staging directory that `publish` renames into place (atomic; the loser of
two concurrent publishes of one entry gets False). Object store: objects cannot be renamed,
so chunks go straight under a prefix unique to the write, and the entry's group ``zarr.json``
(its manifest) is put last; without it the prefix is invisible garbage that `gc` removes.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
import shutil
import time
from typing import Sequence
from urllib.parse import parse_qs, urlparse
import uuid

from anchorkv.store.errors import StoreUnavailable, explain

Buffers = Sequence[bytes | bytearray | memoryview]
#: Where a local store moves directories it deletes (then removes them).
TRASH = ".trash"


class LocalBackend:
    """A directory. Chunk writes are one `os.open` + `os.writev` each (no temp file: the whole
    staging directory is invisible until `publish` renames it)."""

    atomic_publish = True

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root).expanduser().resolve()
        self.url = str(self.root)
        self._prefix = os.path.join(self.url, "")  # hot paths join strings, not `Path`s

    def _p(self, path: str) -> Path:
        return self.root / path

    def _s(self, path: str) -> str:
        return self._prefix + path

    def ensure_root(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise StoreUnavailable(f"{self.url} is a file, not a store directory; pass a directory (--store / 'store')")
        self.root.mkdir(parents=True, exist_ok=True)

    def check_store(self) -> None:
        """`StoreUnavailable` unless an anchorkv store is here (reads only)."""
        if not self.root.exists():
            raise StoreUnavailable(f"no store at {self.url}: the directory does not exist (the first save creates "
                                   "it); pass --store PATH_OR_URL")
        if not self.root.is_dir():
            raise StoreUnavailable(f"{self.url} is a file, not a store directory; pass the store's directory (--store)")
        if not (self.root / "zarr.json").is_file():
            raise StoreUnavailable(f"{self.url} is not an anchorkv store (expected a zarr.json there, found none); "
                                   "pass the store's directory (--store)")

    def read(self, path: str) -> bytes:
        with open(self._s(path), "rb") as f:
            return f.read()

    def read_ranges_into(self, path: str, ranges: list[tuple[int, list[memoryview]]]) -> tuple[int, list[int]]:
        """Read byte ranges of a file into buffers: each range `(offset, buffers)` fills its
        buffers in order from `offset`; adjacent ranges are read by one `preadv`. Returns (the
        file size, bytes read per range: less than asked where the file ends early)."""
        fd = os.open(self._s(path), os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            got = []
            i = 0
            while i < len(ranges):  # a run of ranges that follow each other in the file
                start = end = ranges[i][0]
                views: list[memoryview] = []
                j = i
                while j < len(ranges) and ranges[j][0] == end:
                    views += ranges[j][1]
                    end += sum(v.nbytes for v in ranges[j][1])
                    j += 1
                n = _preadv_all(fd, views, start, min(end, size) - start)
                for k in range(i, j):
                    want = sum(v.nbytes for v in ranges[k][1])
                    got.append(max(0, min(want, n - (ranges[k][0] - start))))
                i = j
            return size, got
        finally:
            os.close(fd)

    def write(self, path: str, buffers: Buffers, *, atomic: bool = False) -> None:
        """Write a file from `buffers`; `atomic`: via a temp file and `os.replace` (metadata)."""
        target = self._s(path)
        if atomic:
            head, name = os.path.split(target)
            dest = os.path.join(head, f".{name}.{uuid.uuid4().hex[:8]}.tmp")
        else:
            dest = target
        try:
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except FileNotFoundError:  # the first file of its directory (one mkdir per array)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            views = [memoryview(b).cast("B") for b in buffers]
            total = sum(v.nbytes for v in views)
            done = os.writev(fd, views) if len(views) > 1 else os.write(fd, views[0]) if views else 0
            while done < total:  # short writes are legal; resume after what was written
                done += os.writev(fd, _advance(views, done))
        finally:
            os.close(fd)
        if atomic:
            os.replace(dest, target)

    def exists(self, path: str) -> bool:
        return os.path.exists(self._s(path))

    def list_dir(self, prefix: str) -> list[str]:
        try:
            return sorted(os.listdir(self._p(prefix)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete(self, path: str) -> None:
        try:
            os.unlink(self._p(path))
        except FileNotFoundError:
            pass

    def delete_tree(self, prefix: str) -> None:
        """Remove a directory: renamed into `.trash` first, so it vanishes atomically.

        A kill -9 between the rename and the removal leaves the directory under `.trash`, which
        `purge_trash` (called by `Store.gc`) removes. Paths inside `.trash` are removed in place.
        """
        src = self._p(prefix)
        if prefix.strip("/").split("/", 1)[0] == TRASH:
            shutil.rmtree(src, ignore_errors=True)
            return
        trash = self.root / TRASH / uuid.uuid4().hex
        for _ in range(3):  # a concurrent purge_trash never removes `.trash` itself, but be safe
            trash.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(src, trash)
                break
            except FileNotFoundError:
                if not src.exists():
                    return
        else:
            raise OSError(f"could not move {src} into {trash.parent} to delete it")
        shutil.rmtree(trash, ignore_errors=True)

    def purge_trash(self) -> int:
        """Remove what deletes left in `.trash` (their process died); returns how many."""
        names = self.list_dir(TRASH)
        for name in names:
            shutil.rmtree(self._p(f"{TRASH}/{name}"), ignore_errors=True)
        return len(names)

    def data_prefix(self, final: str, write_id: str) -> str:
        return f".staging/{write_id}/data"

    def publish(self, staged: str, final: str) -> bool:
        """Rename the staged directory to `final`; False if another write published it first."""
        target = self._p(final)
        for attempt in range(3):
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(self._p(staged), target)
                return True
            except FileNotFoundError:
                # the key's directory went away meanwhile (a delete removed it as empty): again
                if attempt == 2 or not self._p(staged).exists():
                    raise
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    return False
                raise
        raise AssertionError("unreachable")

    def mtime(self, path: str) -> float | None:
        try:
            return self._p(path).stat().st_mtime
        except FileNotFoundError:
            return None

    def tree_size(self, prefix: str) -> int:
        """Bytes of every file under `prefix` (0 if there is none)."""
        total = 0
        for dirpath, _, files in os.walk(self._p(prefix)):
            for name in files:
                try:
                    total += os.lstat(os.path.join(dirpath, name)).st_size
                except FileNotFoundError:
                    pass
        return total

    def remove_empty_dir(self, prefix: str) -> bool:
        """Remove the directory `prefix` if it is empty or holds only its group ``zarr.json``
        (a key whose entries are all gone); True if removed."""
        d = self._p(prefix)
        try:
            names = os.listdir(d)
        except (FileNotFoundError, NotADirectoryError):
            return False
        if any(n != "zarr.json" for n in names):
            return False
        try:
            if names:
                os.unlink(d / "zarr.json")
            os.rmdir(d)
        except OSError:  # something arrived meanwhile: keep it
            return False
        return True

    def touch_entry(self, entry: str) -> None:
        """Record a use of `entry`: its directory's mtime (one `utime`, no data written)."""
        try:
            os.utime(self._p(entry))
        except FileNotFoundError:
            pass

    def last_use(self, entry: str) -> float | None:
        return self.mtime(entry)

    def zarr_store(self, read_only: bool = True):
        from zarr.storage import LocalStore

        return LocalStore(self.root, read_only=read_only)


def _preadv_all(fd: int, views: list[memoryview], offset: int, limit: int) -> int:
    """`preadv` at `offset` until `limit` bytes (or end of file) are read; returns bytes read."""
    if limit <= 0 or not views:
        return 0
    got = os.preadv(fd, views, offset)
    while got < limit:  # short reads are legal; finish them
        n = os.preadv(fd, _advance(views, got), offset + got)
        if n <= 0:
            break
        got += n
    return got


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """`views` with their first `n` bytes dropped (to resume a short `writev`/`preadv`)."""
    out = []
    for v in views:
        if n >= v.nbytes:
            n -= v.nbytes
            continue
        out.append(v[n:])
        n = 0
    return out


class ObjectBackend:
    """An S3-compatible bucket through obstore (the library behind zarr's `ObjectStore`).

    URL: ``s3://bucket/prefix``; options (endpoint, region, credentials, allow_http, ...) go to
    `obstore.store.S3Store`; query parameters of the URL become options too
    (``s3://bucket/p?endpoint=http://127.0.0.1:9000``). Credentials otherwise come from the
    usual AWS environment variables.
    """

    atomic_publish = False

    def __init__(self, url: str, **options) -> None:
        parsed = urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise StoreUnavailable(f"an object-store URL looks like s3://bucket/prefix, found {url!r}")
        try:
            from obstore.store import S3Store
        except ModuleNotFoundError as e:
            raise StoreUnavailable(explain(e, url)) from None
        opts = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
        opts.update(options)
        if str(opts.get("endpoint", "")).startswith("http://"):
            opts.setdefault("allow_http", True)
        for k in ("allow_http", "virtual_hosted_style_request"):
            if isinstance(opts.get(k), str):
                opts[k] = opts[k].lower() in ("1", "true", "yes")
        client = {k: opts.pop(k) for k in ("allow_http", "timeout", "connect_timeout") if k in opts}
        if "timeout" not in client:
            client["timeout"] = "30s"
        if "connect_timeout" not in client:
            client["connect_timeout"] = "5s"
        self.prefix = parsed.path.strip("/")
        self.url = f"s3://{parsed.netloc}/{self.prefix}".rstrip("/")
        self.store = S3Store(parsed.netloc, prefix=self.prefix or None, client_options=client, **opts)

    def ensure_root(self) -> None:
        pass

    def check_store(self) -> None:
        """`StoreUnavailable` unless an anchorkv store is at the prefix (reads only): says
        whether the bucket is missing or the prefix holds no store."""
        import obstore

        if self.exists("zarr.json"):
            return
        try:
            obstore.list_with_delimiter(self.store, None)
        except Exception as e:
            raise StoreUnavailable(explain(e, self.url)) from None
        raise StoreUnavailable(f"no store at {self.url}: expected a zarr.json under the prefix, found none "
                               "(is the prefix mistyped?); the first save creates it")

    def read(self, path: str) -> bytes:
        import obstore

        try:
            return obstore.get(self.store, path).bytes().to_bytes()
        except FileNotFoundError:
            raise
        except Exception as e:  # obstore raises its own NotFoundError (a FileNotFoundError subclass in 0.12)
            if "not found" in str(e).lower():
                raise FileNotFoundError(path) from e
            raise

    def read_ranges_into(self, path: str, ranges: list[tuple[int, list[memoryview]]]) -> tuple[int, list[int]]:
        """As `LocalBackend.read_ranges_into`: one ranged GET from the first range's start to
        the last one's end (a rank's chunks lie together in a shard), copied into the buffers."""
        import obstore

        if not ranges:
            return self.size(path), []
        start = min(r[0] for r in ranges)
        end = max(r[0] + sum(v.nbytes for v in r[1]) for r in ranges)
        try:
            res = obstore.get(self.store, path, options={"range": (start, end)})
            data, size = memoryview(res.bytes()), int(res.meta["size"])
        except FileNotFoundError:
            raise
        except Exception as e:
            if "not found" in str(e).lower():
                raise FileNotFoundError(path) from e
            size = self.size(path)  # e.g. the range starts past the end of a truncated object
            if size >= end:
                raise
            data = memoryview(b"")
        got = []
        for offset, views in ranges:
            pos, n = offset - start, 0
            for v in views:
                k = max(0, min(v.nbytes, len(data) - pos))
                v[:k] = data[pos : pos + k]
                n += k
                pos += v.nbytes
                if k < v.nbytes:
                    break
            got.append(n)
        return size, got

    def size(self, path: str) -> int:
        import obstore

        try:
            return int(obstore.head(self.store, path)["size"])
        except FileNotFoundError:
            raise
        except Exception as e:
            if "not found" in str(e).lower():
                raise FileNotFoundError(path) from e
            raise

    def write(self, path: str, buffers: Buffers, *, atomic: bool = False) -> None:
        import obstore

        obstore.put(self.store, path, b"".join(bytes(memoryview(b).cast("B")) for b in buffers))

    def exists(self, path: str) -> bool:
        import obstore

        try:
            obstore.head(self.store, path)
            return True
        except FileNotFoundError:
            return False

    def list_dir(self, prefix: str) -> list[str]:
        import obstore

        res = obstore.list_with_delimiter(self.store, prefix.rstrip("/") + "/")
        names = {p.rstrip("/").rsplit("/", 1)[-1] for p in res["common_prefixes"]}
        names |= {o["path"].rsplit("/", 1)[-1] for o in res["objects"]}
        return sorted(names)

    def delete(self, path: str) -> None:
        import obstore

        try:
            obstore.delete(self.store, path)
        except FileNotFoundError:
            pass

    def delete_tree(self, prefix: str) -> None:
        """Delete the group ``zarr.json`` first (the entry vanishes at once), then the rest."""
        import obstore

        self.delete(f"{prefix}/zarr.json")
        paths = [o["path"] for batch in obstore.list(self.store, prefix.rstrip("/") + "/") for o in batch]
        if paths:
            obstore.delete(self.store, paths)

    def data_prefix(self, final: str, write_id: str) -> str:
        return f"{final}.{write_id}"

    def publish(self, staged: str, final: str) -> bool:
        return True  # the manifest put by the caller is the publication

    def mtime(self, path: str) -> float | None:
        import obstore

        try:
            return obstore.head(self.store, path)["last_modified"].timestamp()
        except FileNotFoundError:
            return None

    def newest_mtime(self, prefix: str) -> float | None:
        """The newest modification time of the objects under `prefix` (None: no object)."""
        import obstore

        times = [o["last_modified"].timestamp() for batch in obstore.list(self.store, prefix.rstrip("/") + "/")
                 for o in batch]
        return max(times, default=None)

    def tree_size(self, prefix: str) -> int:
        import obstore

        return sum(o["size"] for batch in obstore.list(self.store, prefix.rstrip("/") + "/") for o in batch)

    def remove_empty_dir(self, prefix: str) -> bool:
        """Delete a key's group ``zarr.json`` if nothing else is under the key; True if deleted."""
        import obstore

        res = obstore.list_with_delimiter(self.store, prefix.rstrip("/") + "/")
        names = {o["path"].rsplit("/", 1)[-1] for o in res["objects"]}
        if res["common_prefixes"] or names - {"zarr.json"}:
            return False
        if names:
            self.delete(f"{prefix}/zarr.json")
        return bool(names)

    def touch_entry(self, entry: str) -> None:
        """Record a use of `entry`: a tiny ``.last_use`` object (the store throttles this)."""
        self.write(f"{entry}/.last_use", [str(time.time()).encode()])

    def last_use(self, entry: str) -> float | None:
        """The time stored in ``.last_use`` (object mtimes have only 1 s resolution); None if
        the entry was never used (eviction then takes its creation time)."""
        try:
            return float(self.read(f"{entry}/.last_use"))
        except (FileNotFoundError, ValueError):
            return None

    def zarr_store(self, read_only: bool = True):
        from zarr.storage import ObjectStore

        return ObjectStore(self.store, read_only=read_only)


def open_backend(url: str | os.PathLike, **options):
    """A backend for a path (local) or an ``s3://`` URL."""
    text = os.fspath(url)
    if text.startswith("s3://"):
        return ObjectBackend(text, **options)
    if "://" in text and not text.startswith("file://"):
        scheme = text.split("://", 1)[0]
        raise StoreUnavailable(f"unsupported store URL {text!r}: expected a local path or s3://bucket/prefix, found "
                               f"scheme {scheme}:// (for Google Cloud Storage use its S3-compatible endpoint: "
                               "s3://bucket/prefix?endpoint=https://storage.googleapis.com with HMAC keys)")
    if options:
        raise StoreUnavailable(f"a local store takes no storage_options, found {sorted(options)}; they are for s3:// stores")
    return LocalBackend(text.removeprefix("file://"))
