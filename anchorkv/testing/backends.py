"""`BackendTests`: the conformance suite of `anchorkv.store.backends.Backend`.

Every store backend runs it (as every zarr store runs `zarr.testing.store.StoreTests`): a
subclass overrides the `backend` fixture to give an empty backend at a fresh root, and pytest
collects the test methods below against it::

    class TestLocalBackend(BackendTests):
        @pytest.fixture
        def backend(self, tmp_path):
            return LocalBackend(tmp_path / "store")

The tests pin the contract the store relies on, whatever the medium: bytes written come back
byte for byte, byte-range reads stop where an object ends, listings are one level and sorted,
deletes of what is not there are no-ops, a prefix deleted vanishes with nothing of its
neighbours, and a published entry is readable where the backend says it lives.
"""

from __future__ import annotations

import json
import time
from array import array

import pytest

from anchorkv.store.backends import Backend
from anchorkv.store.errors import StoreUnavailable

#: How far the clocks of the test and of a backend's server may disagree (seconds).
CLOCK_SLACK = 120.0


def _payload(n: int, seed: int = 0) -> bytes:
    return bytes((i * 131 + seed * 7 + 3) % 256 for i in range(n))


class BackendTests:
    """The tests every `Backend` passes; subclasses provide the `backend` fixture."""

    @pytest.fixture
    def backend(self) -> Backend:
        """An empty backend at a fresh root (the store's directory or prefix need not exist)."""
        raise NotImplementedError("a subclass of BackendTests overrides the `backend` fixture")

    # ------------------------------------------------------------------ the store itself
    def test_is_a_backend(self, backend: Backend) -> None:
        assert isinstance(backend, Backend)
        assert isinstance(backend.url, str) and backend.url
        assert isinstance(backend.atomic_publish, bool)
        assert isinstance(backend.write_concurrency, int) and backend.write_concurrency >= 1

    def test_check_store_needs_a_root_group(self, backend: Backend) -> None:
        backend.ensure_root()
        with pytest.raises(StoreUnavailable):
            backend.check_store()
        backend.write("zarr.json", [b'{"zarr_format": 3, "node_type": "group", "attributes": {}}'], atomic=True)
        backend.check_store()

    def test_zarr_store_reads_what_the_backend_wrote(self, backend: Backend) -> None:
        import zarr

        backend.ensure_root()
        doc = {"zarr_format": 3, "node_type": "group", "attributes": {"anchorkv": {"n": 7}}}
        backend.write("g/zarr.json", [json.dumps(doc).encode()], atomic=True)
        group = zarr.open_group(backend.zarr_store(), path="g", mode="r")
        assert dict(group.attrs) == {"anchorkv": {"n": 7}}

    # ------------------------------------------------------------------ objects
    @pytest.mark.parametrize("atomic", [False, True])
    def test_write_then_read_gives_the_bytes_back(self, backend: Backend, atomic: bool) -> None:
        backend.ensure_root()
        words = array("I", [1, 2, 0xDEADBEEF])  # a buffer of 4-byte items: written as its bytes
        buffers: list[bytes | bytearray | memoryview] = [
            b"head", bytearray(_payload(1000)), memoryview(_payload(7, 1)), memoryview(words), b""]
        backend.write("a/b/c.bin", buffers, atomic=atomic)
        assert backend.read("a/b/c.bin") == b"head" + _payload(1000) + _payload(7, 1) + words.tobytes()

    def test_a_stamp_changes_when_the_object_is_replaced(self, backend: Backend) -> None:
        """`stamp` tells a cached manifest from the one now stored: on a backend whose paths are
        reused (a local directory: the same entry id written again after a delete) it changes
        with every replace and removal; elsewhere it is None (ids unique per write)."""
        backend.ensure_root()
        backend.write("e/zarr.json", [b"one"], atomic=True)
        first = backend.stamp("e/zarr.json")
        if first is None:
            assert not backend.atomic_publish and backend.stamp("gone/zarr.json") is None
            return
        assert backend.stamp("e/zarr.json") == first
        backend.write("e/zarr.json", [b"two"], atomic=True)  # the same size: the file changed
        second = backend.stamp("e/zarr.json")
        assert second != first
        backend.delete("e/zarr.json")
        assert backend.stamp("e/zarr.json") not in (first, second)

    @pytest.mark.parametrize("atomic", [False, True])
    def test_write_replaces_the_whole_object(self, backend: Backend, atomic: bool) -> None:
        backend.ensure_root()
        backend.write("x", [_payload(300)], atomic=atomic)
        backend.write("x", [b"short"], atomic=atomic)
        assert backend.read("x") == b"short"
        backend.write("empty", [], atomic=atomic)
        assert backend.read("empty") == b""

    def test_read_of_a_missing_object_raises_file_not_found(self, backend: Backend) -> None:
        backend.ensure_root()
        with pytest.raises(FileNotFoundError):
            backend.read("no/such/object")
        with pytest.raises(FileNotFoundError):
            backend.read_ranges_into("no/such/object", [(0, [memoryview(bytearray(4))])])

    def test_read_ranges_into_fills_each_range(self, backend: Backend) -> None:
        backend.ensure_root()
        data = _payload(4096, 2)
        backend.write("shard", [data])
        a, b, c, d = bytearray(5), bytearray(3), bytearray(16), bytearray(100)
        ranges = [(10, [memoryview(a), memoryview(b)]), (18, [memoryview(c)]), (2000, [memoryview(d)])]
        size, got = backend.read_ranges_into("shard", ranges)
        assert size == 4096 and got == [8, 16, 100]
        assert (bytes(a), bytes(b), bytes(c), bytes(d)) == (data[10:15], data[15:18], data[18:34], data[2000:2100])

    def test_read_ranges_into_stops_where_the_object_ends(self, backend: Backend) -> None:
        backend.ensure_root()
        data = _payload(100, 3)
        backend.write("short", [data])
        head, tail = bytearray(10), bytearray(10)
        size, got = backend.read_ranges_into("short", [(0, [memoryview(head)]), (95, [memoryview(tail)])])
        assert size == 100 and got == [10, 5]
        assert bytes(head) == data[:10] and bytes(tail[:5]) == data[95:]

    def test_read_ranges_into_checks_each_range_in_order(self, backend: Backend) -> None:
        """`check(size, i, bytes read)` once per range, in order, after its bytes are in; what
        it raises stops the read and reaches the caller."""
        backend.ensure_root()
        data = _payload(300, 4)
        backend.write("checked", [data])
        seen = []
        a, b, c = bytearray(10), bytearray(20), bytearray(50)

        def check(size: int, i: int, n: int) -> None:
            seen.append((size, i, n, bytes((a, b, c)[i][:n])))

        size, got = backend.read_ranges_into("checked", [(0, [memoryview(a)]), (10, [memoryview(b)]),
                                                         (280, [memoryview(c)])], check=check)
        assert size == 300 and got == [10, 20, 20]
        assert seen == [(300, 0, 10, data[:10]), (300, 1, 20, data[10:30]), (300, 2, 20, data[280:])]

        class Stop(Exception):
            pass

        def refuse(size: int, i: int, n: int) -> None:
            raise Stop(i)

        with pytest.raises(Stop, match="0"):
            backend.read_ranges_into("checked", [(0, [memoryview(a)]), (10, [memoryview(b)])], check=refuse)

    def test_exists(self, backend: Backend) -> None:
        backend.ensure_root()
        assert not backend.exists("k/zarr.json")
        backend.write("k/zarr.json", [b"{}"])
        assert backend.exists("k/zarr.json")

    def test_delete_removes_one_object_and_ignores_missing_ones(self, backend: Backend) -> None:
        backend.ensure_root()
        backend.write("d/one", [b"1"])
        backend.write("d/two", [b"2"])
        backend.delete("d/one")
        backend.delete("d/one")
        backend.delete("never/written")
        assert not backend.exists("d/one") and backend.read("d/two") == b"2"

    def test_mtime(self, backend: Backend) -> None:
        backend.ensure_root()
        assert backend.mtime("m/obj") is None
        backend.write("m/obj", [b"x"])
        mtime = backend.mtime("m/obj")
        assert mtime is not None and abs(mtime - time.time()) < CLOCK_SLACK

    # ------------------------------------------------------------------ prefixes
    def test_list_dir_is_one_level_and_sorted(self, backend: Backend) -> None:
        backend.ensure_root()
        for path in ("p/b/deep/x", "p/c", "p/a/y", "p/a/z", "p2/other", "pp"):
            backend.write(path, [b"."])
        assert backend.list_dir("p") == ["a", "b", "c"]
        assert backend.list_dir("p/a") == ["y", "z"]
        assert backend.list_dir("missing") == []
        assert backend.list_dir("p/c") == []  # an object, not a prefix

    def test_delete_tree_removes_the_prefix_and_nothing_else(self, backend: Backend) -> None:
        backend.ensure_root()
        for path in ("t/zarr.json", "t/f/c.0", "t/f/g/c.1", "tt/keep", "t2/keep"):
            backend.write(path, [b"data"])
        backend.delete_tree("t")
        assert backend.list_dir("t") == [] and not backend.exists("t/zarr.json") and not backend.exists("t/f/c.0")
        assert backend.read("tt/keep") == b"data" and backend.read("t2/keep") == b"data"
        backend.delete_tree("t")  # again: nothing there, nothing happens
        backend.delete_tree("never/written")
        assert backend.trash() == []  # a delete that finished leaves nothing behind

    def test_tree_size_and_newest_mtime(self, backend: Backend) -> None:
        backend.ensure_root()
        assert backend.tree_size("s") == 0 and backend.newest_mtime("s") is None
        backend.write("s/a", [_payload(10)])
        backend.write("s/b/c", [_payload(25), _payload(5)])
        backend.write("s2/not-counted", [_payload(1000)])
        assert backend.tree_size("s") == 40
        newest = backend.newest_mtime("s")
        assert newest is not None and abs(newest - time.time()) < CLOCK_SLACK

    def test_remove_empty_dir_keeps_a_key_that_holds_entries(self, backend: Backend) -> None:
        backend.ensure_root()
        backend.write("entries/k1/zarr.json", [b"{}"])
        backend.write("entries/k2/zarr.json", [b"{}"])
        backend.write("entries/k2/t1/zarr.json", [b"{}"])
        assert backend.remove_empty_dir("entries/k1") is True
        assert not backend.exists("entries/k1/zarr.json") and backend.list_dir("entries/k1") == []
        assert backend.remove_empty_dir("entries/k2") is False
        assert backend.exists("entries/k2/zarr.json") and backend.exists("entries/k2/t1/zarr.json")
        assert backend.remove_empty_dir("entries/never") is False

    def test_a_fresh_backend_has_no_trash(self, backend: Backend) -> None:
        backend.ensure_root()
        assert backend.trash() == []

    # ------------------------------------------------------------------ commit protocol
    def _stage(self, backend: Backend, final: str, write_id: str, body: bytes) -> str:
        data = backend.data_prefix(final, write_id)
        backend.write(f"{data}/f/c.0", [body])
        backend.write(f"{data}/zarr.json", [b'{"write": "' + write_id.encode() + b'"}'], atomic=True)
        return data

    def test_publish_makes_the_entry_readable_where_it_lives(self, backend: Backend) -> None:
        backend.ensure_root()
        final = "entries/k/t00000001-0123456789abcdef"
        assert backend.data_prefix(final, "w1") != backend.data_prefix(final, "w2")
        data = self._stage(backend, final, "w1", b"chunk")
        assert backend.publish(data, final) is True
        lives = final if backend.atomic_publish else data
        assert backend.read(f"{lives}/f/c.0") == b"chunk"
        assert json.loads(backend.read(f"{lives}/zarr.json")) == {"write": "w1"}
        if backend.atomic_publish:  # the staged data moved, as a whole
            assert not backend.exists(f"{data}/zarr.json")

    def test_a_second_publish_of_one_entry(self, backend: Backend) -> None:
        """Atomic: the second publish gets False and the first's entry stays. Otherwise both
        writes' entries stay, each under its own prefix (lookup takes the oldest, gc removes
        the other)."""
        backend.ensure_root()
        final = "entries/k/t00000001-0123456789abcdef"
        first = self._stage(backend, final, "w1", b"first")
        second = self._stage(backend, final, "w2", b"second")
        assert backend.publish(first, final) is True
        won = backend.publish(second, final)
        if backend.atomic_publish:
            assert won is False and backend.read(f"{final}/f/c.0") == b"first"
        else:
            assert won is True
            assert backend.read(f"{first}/f/c.0") == b"first" and backend.read(f"{second}/f/c.0") == b"second"

    # ------------------------------------------------------------------ last use
    def test_touch_entry_records_a_use(self, backend: Backend) -> None:
        backend.ensure_root()
        entry = "entries/k/t00000001-0123456789abcdef"
        backend.write(f"{entry}/zarr.json", [b"{}"])
        before = backend.last_use(entry)
        backend.touch_entry(entry)
        used = backend.last_use(entry)
        assert used is not None and abs(used - time.time()) < CLOCK_SLACK
        assert before is None or used >= before
