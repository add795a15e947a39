"""`ObjectBackend`: a store in an S3-compatible bucket, through obstore.

Objects cannot be renamed, so a write's chunks go straight under a prefix unique to the write,
and the entry's group ``zarr.json`` (its manifest) is put last: that put is the publication.
Without it the prefix is invisible garbage that `Store.gc` removes. obstore is imported on
first use (the S3 extra), so a local store never needs it.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlparse

from anchorkv.store.backends._protocol import Buffers, RangeCheck
from anchorkv.store.errors import StoreUnavailable, explain
from anchorkv.store.paths import LAST_USE

if TYPE_CHECKING:
    from obstore.store import ClientConfig
    from zarr.storage import ObjectStore


#: a bucket name an S3-compatible server may hold: letters, digits, dots, hyphens, underscores
_BUCKET = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
#: options that obstore takes as durations (text such as '30s', or a timedelta)
_DURATIONS = ("timeout", "connect_timeout")
#: S3Store keyword arguments that are not configuration text: passed as they are
_OBJECTS = ("retry_config", "credential_provider")


def _check_options(url: str, bucket: str, opts: dict[str, Any]) -> None:
    """`StoreUnavailable` for a bucket name or option obstore cannot take: an endpoint that is
    not an http(s) URL or a bucket name with other characters reached a panic in its request
    builder (a Rust backtrace and a `PanicException`, which no `except Exception` catches);
    an option that is not text, a number or a flag, a TypeError naming no key."""
    if not _BUCKET.fullmatch(bucket):
        raise StoreUnavailable(f"{url}: expected a bucket name of letters, digits, '.', '-' and '_' after s3://, "
                               f"found {bucket!r}; fix the bucket name in the URL")
    for key, value in opts.items():
        if key in _OBJECTS:  # obstore's own structured options (a dict, a callable)
            continue
        if not isinstance(value, (str, int, float, bool)) and not (key in _DURATIONS and isinstance(value, timedelta)):
            raise StoreUnavailable(f"{url}: storage option {key!r} must be text, a number or true/false, found "
                                   f"{type(value).__name__} {value!r}")
    endpoint = opts.get("endpoint")
    if endpoint is not None:
        e = urlparse(str(endpoint)) if isinstance(endpoint, str) else None
        if e is None or e.scheme not in ("http", "https") or not e.netloc or any(c.isspace() for c in endpoint):
            raise StoreUnavailable(f"{url}: storage option 'endpoint' must be an http(s) URL such as "
                                   f"http://127.0.0.1:9000, found {endpoint!r}")
    for key in _DURATIONS:
        value = opts.get(key)
        if value is not None and not isinstance(value, timedelta) and not (
                isinstance(value, str) and re.fullmatch(r"\s*(\d+(\.\d+)?\s*[a-zA-Z]+\s*)+", value)):
            raise StoreUnavailable(f"{url}: storage option {key!r} must be a duration such as '30s', '500ms' or "
                                   f"'2m', found {value!r}")


def _flag(url: str, key: str, value: str) -> bool:
    """A flag option given as text (a URL's query): true/false, yes/no, 1/0, on/off."""
    low = value.strip().lower()
    if low not in _TRUE + _FALSE:
        raise StoreUnavailable(f"{url}: storage option {key!r} must be true or false, found {value!r}")
    return low in _TRUE


class ObjectBackend:
    """An S3-compatible bucket through obstore (the library behind zarr's `ObjectStore`).

    URL: ``s3://bucket/prefix``; options (endpoint, region, credentials, allow_http, ...) go to
    `obstore.store.S3Store`; query parameters of the URL become options too
    (``s3://bucket/p?endpoint=http://127.0.0.1:9000``). Credentials otherwise come from the
    usual AWS environment variables.
    """

    atomic_publish = False
    #: a save's shard puts in flight at once: each is a round trip, so one after the other a
    #: Kimi-Linear save (47 shards) waited 47 of them
    write_concurrency = 8

    def __init__(self, url: str, **options: Any) -> None:
        parsed = urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise StoreUnavailable(f"an object-store URL looks like s3://bucket/prefix, found {url!r}")
        try:
            from obstore.store import S3Store
        except ModuleNotFoundError as e:
            raise StoreUnavailable(explain(e, url)) from None
        opts: dict[str, Any] = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
        opts.update(options)
        _check_options(url, parsed.netloc, opts)  # (obstore panics, past Python's reach, on a bad URI)
        if str(opts.get("endpoint", "")).startswith("http://"):
            opts.setdefault("allow_http", True)
        for k in ("allow_http", "virtual_hosted_style_request"):
            if isinstance(opts.get(k), str):
                opts[k] = _flag(url, k, opts[k])
        client: ClientConfig = {"timeout": opts.pop("timeout", "30s"),
                                "connect_timeout": opts.pop("connect_timeout", "5s")}
        if "allow_http" in opts:
            client["allow_http"] = opts.pop("allow_http")
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

    def read_ranges_into(self, path: str, ranges: list[tuple[int, list[memoryview]]],
                         check: RangeCheck | None = None) -> tuple[int, list[int]]:
        """As `LocalBackend.read_ranges_into`: one ranged GET from the first range's start to
        the last one's end (a rank's chunks lie together in a shard), copied into the buffers;
        `check(object size, i, bytes read)` after range `i` is copied."""
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
            if check is not None:
                check(size, len(got) - 1, n)
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

        obstore.put(self.store, path, b"".join(memoryview(b).cast("B") for b in buffers))  # (one copy)

    def stamp(self, path: str) -> object:
        return None  # entry names hold their write id: nothing under one path is replaced

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

    def remove_if(self, prefix: str, still: Callable[[bytes | None], bool]) -> bool:
        """Delete the entry at `prefix` if `still(its zarr.json, None if absent)`. (An object
        store's entry name holds its write id: no other write takes it over meanwhile.)"""
        try:
            manifest: bytes | None = self.read(f"{prefix}/zarr.json")
        except FileNotFoundError:
            manifest = None
        if not still(manifest):
            return False
        self.delete_tree(prefix)
        return True

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

    def trash(self) -> list[str]:
        """None: an object store deletes in place (`delete_tree` removes the manifest first)."""
        return []

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
        """Record a use of `entry`: a tiny ``.last_use`` object (the store throttles this).

        An entry another process deleted meanwhile must not come back as a prefix holding only
        ``.last_use`` (found by review: a process with its manifest cached then kept finding it
        listed, and the connector never saved it again). So the manifest is checked after the
        put, and the object deleted if the manifest is gone: a delete lists the prefix after
        deleting the manifest, so either its listing saw this object or this check sees no
        manifest. (`Store.gc` removes such prefixes left by older versions.)"""
        path = f"{entry}/{LAST_USE}"
        self.write(path, [str(time.time()).encode()])
        if not self.exists(f"{entry}/zarr.json"):
            self.delete(path)

    def last_use(self, entry: str) -> float | None:
        """The time stored in ``.last_use`` (object mtimes have only 1 s resolution); None if
        the entry was never used (eviction then takes its creation time)."""
        try:
            return float(self.read(f"{entry}/{LAST_USE}"))
        except (FileNotFoundError, ValueError):
            return None

    def zarr_store(self, read_only: bool = True) -> ObjectStore:
        from zarr.storage import ObjectStore

        return ObjectStore(self.store, read_only=read_only)
