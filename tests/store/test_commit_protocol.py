"""The commit protocol under kill -9 and concurrent writers, on both backends.

Each test runs real processes (`tests/store/crash_child.py`) against a real store: a local
directory, or a bucket on a moto S3 server on loopback. A writer is stopped at a named point
of the protocol and killed with SIGKILL, or killed after a delay, or two writers of the same
entry are released at the same instant. Afterwards a fresh `Store` (no caches) must see
either the previous entry or the new, complete one, never a readable partial entry; `verify`
is clean; `gc` removes what the dead writer left.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import zarr

from anchorkv.store import EntryNotFound
from anchorkv.store.paths import ENTRIES, STAGING
from anchorkv.store.store import Store
from tests.store.helpers import CODECS, all_packed, tiny_layout, tokens

ROOT = Path(__file__).resolve().parents[2]
ANCHOR = "crash-test"
PREV_N, NEW_N = 300, 600  # the previous complete entry and the one being written
TOKENS = tokens(700)
#: 8 shard files per entry of NEW_N tokens at tp=1 (one per layer and field): conv 3,
#: recurrent 3, latent 2 (50 inner chunks inside them)
POINTS = ["start", "chunk:1", "chunk:4", "chunk:8", "part", "arrays", "publish", "published"]


class Child:
    """A `crash_child` process and a reader of its stdout lines. Use it as a context manager:
    on exit the process is killed if it still runs and its pipes are closed."""

    def __init__(self, cfg: dict) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.store.crash_child", json.dumps(cfg)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill the process if it still runs, let the reader thread reach the end of stdout,
        then close both pipes."""
        try:
            self.kill()
            self._reader.join(timeout=30)
        finally:
            self.proc.stdout.close()
            self.proc.stderr.close()

    def printed(self) -> list[str]:
        """Every line the process printed so far (those `expect` read, then the rest)."""
        return [*self.seen, *list(self.lines.queue)]

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def expect(self, prefix: str, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    exited = self.proc.returncode
                    self.kill()
                    raise AssertionError(
                        f"expected the writer to print {prefix!r}; it printed {self.seen} and "
                        f"{'timed out' if exited is None else f'exited with {exited}'}"
                        f"; stderr: {self.proc.stderr.read()[-2000:]}"
                    ) from None
                continue
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def finish(self) -> tuple[str, float]:
        """(entry id, seconds the save took) as the writer printed them; it must exit cleanly."""
        line = self.expect("DONE")
        rc = self.proc.wait(timeout=60)
        assert rc == 0, f"writer exited with {rc}: {self.proc.stderr.read()[-2000:]}"
        _, entry_id, seconds = line.split()
        return entry_id, float(seconds)


def child_cfg(store_url, **kw) -> dict:
    url, options = store_url
    return {"url": url, "options": options, "anchor": ANCHOR, "n": NEW_N, "seed": 2, **kw}


def fp() -> str:
    return tiny_layout().fingerprint_hash()


def fresh(store: Store) -> Store:
    """A Store on the same backend with no cached manifests (what another process sees)."""
    return Store(store.backend)


def all_objects(store: Store, prefix: str) -> list[str]:
    """Every file / object under `prefix` (paths relative to the store root)."""
    backend = store.backend
    if backend.atomic_publish:
        base = backend.root / prefix
        return sorted(str(p.relative_to(backend.root)) for p in base.rglob("*") if p.is_file())
    import obstore

    return sorted(o["path"] for batch in obstore.list(backend.store, prefix + "/") for o in batch)


def assert_no_partial_entry(store: Store) -> list[str]:
    """Every entry-named node under the anchor's key is complete and verifies, or is invisible
    (to the store and to plain zarr); returns the committed entry ids."""
    s = fresh(store)
    key = s.key_for(fp(), anchor=ANCHOR)
    committed = []
    for name in s.backend.list_dir(f"{ENTRIES}/{key}"):
        if name == "zarr.json":
            continue
        entry_id = f"{key}/{name}"
        try:
            info = s.get(entry_id)
        except EntryNotFound:
            assert not s.backend.atomic_publish, f"local store: {entry_id} is in entries/ but not an entry"
            with pytest.raises(Exception, match=r"(?i)not found|no group|zarr.json"):
                zarr.open_group(s.backend.zarr_store(), path=f"{ENTRIES}/{entry_id}", mode="r")
            continue
        problems = s.verify(info)
        assert problems == [], f"committed entry {entry_id} does not verify: {problems}"
        committed.append(entry_id)
    return committed


def assert_garbage_collected(store: Store) -> None:
    s = fresh(store)
    committed = {e.path for e in s.list()}
    assert s.backend.list_dir(STAGING) == [], f"staging not empty after gc: {s.backend.list_dir(STAGING)}"
    stray = [p for p in all_objects(s, ENTRIES)
             if p.count("/") > 2 and "/".join(p.split("/")[:3]) not in committed]
    assert stray == [], f"objects outside committed entries after gc: {stray[:5]}"
    assert s.backend.list_dir(".trash") == []


def save_previous(store: Store):
    layout = tiny_layout()
    return store.save(layout, CODECS, TOKENS, all_packed(layout, CODECS, PREV_N, seed=1),
                      num_tokens=PREV_N, anchor=ANCHOR)


def entry_seed(store: Store, entry_id: str, n: int, seeds=(2, 3)) -> int:
    """Which writer's values the entry holds; every field must come from the same one."""
    layout = tiny_layout()
    refs = {seed: all_packed(layout, CODECS, n, seed) for seed in seeds}
    found = set()
    for (layer, field) in refs[seeds[0]]:
        got = store.load(entry_id, layout, layer, field)
        k = n * 72 if field == "latent" else got.payload.numel()
        match = {seed for seed, r in refs.items()
                 if torch.equal(got.payload[:k], r[(layer, field)].payload[:k])}
        assert match, f"{entry_id} {layer} {field}: payload matches no writer's values {seeds}"
        found |= match if len(match) == 1 else set()
    assert len(found) == 1, f"{entry_id} mixes the values of writers {sorted(found)}"
    return found.pop()


@pytest.mark.parametrize("point", POINTS)
def test_kill_9_at_each_point_of_a_save(store, store_url, point):
    prev = save_previous(store)
    with Child(child_cfg(store_url, stop=[point], action="hang")) as child:
        child.expect(f"AT {point}")
        child.kill()
    assert child.proc.returncode == -signal.SIGKILL

    published = point == "published"
    hit = fresh(store).lookup(fingerprint_hash=fp(), tokens=TOKENS, anchor=ANCHOR)
    assert hit is not None, "lookup lost the previous complete entry"
    expected_n = NEW_N if published else PREV_N
    assert hit.num_tokens == expected_n, (
        f"killed at {point!r}: lookup should return the {'new' if published else 'previous'} "
        f"entry of {expected_n} tokens, found {hit.num_tokens} tokens ({hit.id})"
    )
    committed = assert_no_partial_entry(store)
    assert len(committed) == (2 if published else 1) and prev.id in committed, committed
    if point != "start":
        assert fresh(store).backend.list_dir(STAGING), "the killed write left no staging data (test is vacuous)"
    # a young unfinished write may be alive: the default gc keeps it
    assert fresh(store).gc(stale_after=3600)["abandoned_writes"] == 0
    report = fresh(store).gc(stale_after=0)
    assert report["abandoned_writes"] == (0 if point == "start" else 1), report
    assert_garbage_collected(store)
    after = fresh(store)
    assert after.lookup(fingerprint_hash=fp(), tokens=TOKENS, anchor=ANCHOR).id == hit.id
    assert all(after.verify(e) == [] for e in after.list())


@pytest.mark.parametrize("fraction", [0.1, 0.3, 0.5, 0.7, 0.9])
def test_kill_9_after_a_delay(tmp_path, fraction):
    """Killed at an arbitrary instant (a fraction of a measured save), not at a hook."""
    url = str(tmp_path / "store")
    store = Store.open(url)
    save_previous(store)
    with Child(child_cfg((url, {}), anchor="calibration")) as calib:
        _, duration = calib.finish()
    with Child(child_cfg((url, {}))) as child:
        child.expect("READY")
        time.sleep(duration * fraction)
        child.kill()
    # captured, so a failure says where the kill landed
    print(f"killed {duration * fraction:.3f} s after READY (the calibration save took {duration:.3f} s): "
          f"exit status {child.proc.returncode}, the writer printed {child.printed()}")
    hit = fresh(store).lookup(fingerprint_hash=fp(), tokens=TOKENS, anchor=ANCHOR)
    assert hit is not None and hit.num_tokens in (PREV_N, NEW_N), hit
    committed = assert_no_partial_entry(store)
    assert hit.id in committed
    fresh(store).gc(stale_after=0)
    assert_garbage_collected(store)


@pytest.mark.parametrize("sync", ["start", "publish"])
def test_two_writers_of_one_entry(store, store_url, tmp_path, sync):
    """Two processes save the same entry (same anchor and prefix, different values), released
    at the same instant at `sync`: one complete entry remains, holding one writer's values."""
    go = tmp_path / "go"
    with contextlib.ExitStack() as stack:
        children = [stack.enter_context(Child(child_cfg(store_url, seed=seed, stop=[sync], action=f"wait:{go}")))
                    for seed in (2, 3)]
        for c in children:
            c.expect(f"AT {sync}")
        go.touch()
        ids = [c.finish()[0] for c in children]
    s = fresh(store)
    hit = s.lookup(fingerprint_hash=fp(), tokens=TOKENS, anchor=ANCHOR)
    assert hit is not None and hit.num_tokens == NEW_N and hit.id in ids, (hit, ids)
    if s.backend.atomic_publish:  # the second rename fails; its writer adopts the first's entry
        assert ids[0] == ids[1], f"both writers should report the one entry, found {ids}"
        assert s.backend.list_dir(STAGING) == []
    else:  # both puts succeed; lookup takes the oldest and gc drops the other
        s.gc(stale_after=3600)
    entries = fresh(store).list()
    assert [e.id for e in entries] == [hit.id], f"expected exactly the entry {hit.id}, found {[e.id for e in entries]}"
    assert fresh(store).verify(hit.id) == []
    entry_seed(fresh(store), hit.id, NEW_N)
    assert_garbage_collected(store)


def test_lease_spares_an_entry_read_by_another_process(store, store_url):
    """`Store.pin` in one process keeps another process's eviction off the entry; once the
    reader dies (kill -9) its lease is stale and the entry can go."""
    layout = tiny_layout()
    a = store.save(layout, CODECS, TOKENS, all_packed(layout, CODECS, PREV_N), num_tokens=PREV_N, anchor="a")
    b = store.save(layout, CODECS, TOKENS, all_packed(layout, CODECS, PREV_N), num_tokens=PREV_N, anchor="b")
    with Child({**child_cfg(store_url), "mode": "pin", "entry": a.id}) as reader:  # killed on exit
        reader.expect("AT pinned")
        evicted = fresh(store).evict(capacity_bytes=0)
        assert evicted == [b.id], f"eviction should skip the leased {a.id}, evicted {evicted}"
    if store.backend.atomic_publish:  # local: the lease names a dead pid, so it is stale now
        assert fresh(store).evict(capacity_bytes=0) == [a.id]
        assert fresh(store).gc(stale_after=3600)["stale_leases"] == 1
    else:  # object store: pids mean nothing across machines; the lease expires after LEASE_TTL
        assert fresh(store).evict(capacity_bytes=0) == []
