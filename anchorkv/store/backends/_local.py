"""`LocalBackend`: a store in a local directory (the default).

Chunks go to a staging directory that `publish` renames into place: atomic, and the loser of
two concurrent publishes of one entry gets False. Deletes rename a directory into `.trash`
first, so an entry vanishes at once.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from anchorkv.store.backends._protocol import Buffers, RangeCheck
from anchorkv.store.errors import StoreUnavailable
from anchorkv.store.paths import TRASH, local_data_prefix

if TYPE_CHECKING:
    from zarr.storage import LocalStore


class LocalBackend:
    """A directory. Chunk writes are one `os.open` + `os.writev` each (no temp file: the whole
    staging directory is invisible until `publish` renames it)."""

    atomic_publish = True
    write_concurrency = 1

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = self.resolve(root)
        self.url = str(self.root)
        self._prefix = os.path.join(self.url, "")  # hot paths join strings, not `Path`s

    @staticmethod
    def resolve(root: str | os.PathLike) -> Path:
        """The directory a store at `root` is (`~` expanded, relative to the working directory)."""
        return Path(root).expanduser().resolve()

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
            try:  # stores one level down (`anchorkv demo --store D` makes D/demo-raw, ...)
                inner = sorted(p.name for p in self.root.iterdir() if (p / "zarr.json").is_file())
            except OSError:
                inner = []
            hint = f" (stores inside it: {', '.join(inner[:3])}{', ...' if len(inner) > 3 else ''})" if inner else ""
            raise StoreUnavailable(f"{self.url} is not an anchorkv store (expected a zarr.json there, found none"
                                   f"{hint}); pass the store's directory (--store)")

    def read(self, path: str) -> bytes:
        with open(self._s(path), "rb") as f:
            return f.read()

    def read_ranges_into(self, path: str, ranges: list[tuple[int, list[memoryview]]],
                         check: RangeCheck | None = None) -> tuple[int, list[int]]:
        """Read byte ranges of a file into buffers: each range `(offset, buffers)` fills its
        buffers in order from `offset`. Without `check`, adjacent ranges are read by one
        `preadv`; with it, each range by its own, `check(file size, i, bytes read)` called
        right after range `i` is read (its bytes still in the CPU's cache), before the next.
        Returns (the file size, bytes read per range: less than asked where the file ends early)."""
        fd = os.open(self._s(path), os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            got = []
            if check is not None:
                for i, (offset, bufs) in enumerate(ranges):
                    want = bufs[0].nbytes if len(bufs) == 1 else sum(v.nbytes for v in bufs)
                    n = _preadv_all(fd, bufs, offset, min(want, size - offset))
                    got.append(n)
                    check(size, i, n)
                return size, got
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

    def stamp(self, path: str) -> object:
        try:
            st = os.stat(self._s(path))
        except FileNotFoundError:
            return ()
        return (st.st_ino, st.st_mtime_ns, st.st_size)

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
            _remove(src)
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
        _remove(trash)

    def remove_if(self, prefix: str, still: Callable[[bytes | None], bool]) -> bool:
        """Delete the entry directory `prefix` only if `still(its zarr.json, None if absent)`
        holds for what is deleted: it is renamed aside first (atomic), judged there, and put
        back if it fails the test (another write replaced what the caller judged meanwhile).
        True if deleted."""
        src = self._p(prefix)
        aside = self.root / TRASH / uuid.uuid4().hex
        aside.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(src, aside)
        except FileNotFoundError:
            return False
        try:
            manifest: bytes | None = (aside / "zarr.json").read_bytes()
        except FileNotFoundError:
            manifest = None
        if still(manifest):
            _remove(aside)
            return True
        try:
            os.rename(aside, src)
        except OSError as e:  # the name holds another write by now: the one moved aside is not needed
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            _remove(aside)
        return False

    def purge_trash(self) -> int:
        """Remove what deletes left in `.trash` (their process died); returns how many."""
        names = self.list_dir(TRASH)
        for name in names:
            _remove(self._p(f"{TRASH}/{name}"))
        return len(names)

    def trash(self) -> list[str]:
        """The directories under `.trash` (deletes whose process died before removing them)."""
        return [f"{TRASH}/{name}" for name in self.list_dir(TRASH)]

    def data_prefix(self, final: str, write_id: str) -> str:
        return local_data_prefix(write_id)

    def publish(self, staged: str, final: str) -> bool:
        """Rename the staged directory to `final`; False if another write published it first."""
        source, target = self._s(staged), self._s(final)
        for attempt in range(4):  # (the key's directory exists: the commit wrote its zarr.json)
            try:
                os.rename(source, target)
                return True
            except FileNotFoundError:
                # the key's directory went away meanwhile (a delete removed it as empty): again,
                # after making it (at most 3 times)
                if attempt == 3 or not os.path.exists(source):
                    raise
                os.makedirs(os.path.dirname(target), exist_ok=True)
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

    def newest_mtime(self, prefix: str) -> float | None:
        """The newest modification time of the files under `prefix` (None: no file)."""
        times = []
        for dirpath, _, files in os.walk(self._p(prefix)):
            for name in files:
                try:
                    times.append(os.lstat(os.path.join(dirpath, name)).st_mtime)
                except FileNotFoundError:
                    pass
        return max(times, default=None)

    def tree_size(self, prefix: str) -> int:
        """Bytes of every file under `prefix` (0 if there is none), or of the file `prefix` (a
        damaged store may hold a file where an entry's directory belongs)."""
        if os.path.isfile(self._p(prefix)):
            return os.lstat(self._p(prefix)).st_size
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

    def zarr_store(self, read_only: bool = True) -> LocalStore:
        from zarr.storage import LocalStore

        return LocalStore(self.root, read_only=read_only)


def _remove(path: Path) -> None:
    """Remove a directory tree, or a file (where a damaged store holds one in an entry's place),
    ignoring errors as `shutil.rmtree(ignore_errors=True)`."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


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
