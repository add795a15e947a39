"""Tenant isolation in the store (issue 15): scopes (a digest of vLLM's `cache_salt`) folded into
keys and prefix hashes, and per-tenant prefixes of one S3 bucket for fleets where tenants must
not read each other's objects at all.
"""

from __future__ import annotations

import numpy as np
import pytest

from anchorkv.store import anchor_key, prefix_hash, token_key
from anchorkv.store.keys import TOKEN_BLOCK
from anchorkv.store.store import Store
from tests.store.conftest import S3_OPTIONS, make_s3_bucket
from tests.store.helpers import CODECS, all_packed, tiny_layout, tokens

FP = "f" * 64
N = 300


def save(store: Store, anchor: str | None, scope: str | None = None):
    layout = tiny_layout()
    return store.save(layout, CODECS, tokens(N), all_packed(layout, CODECS, N), anchor=anchor, scope=scope)


def test_scope_changes_every_key_and_prefix_hash_and_none_changes_nothing():
    t = np.arange(TOKEN_BLOCK + 10)
    for f in (lambda s: anchor_key("a", FP, s), lambda s: token_key(t, FP, s),
              lambda s: prefix_hash(t, TOKEN_BLOCK + 5, FP, s)):
        assert f(None) == f("")  # unscoped: the hashes entries had before scopes existed
        assert len({f(None), f("x"), f("y")}) == 3
    assert anchor_key("a", FP) == anchor_key("a", FP, None)


@pytest.mark.parametrize(("anchor", "mode"), [("alice", "exact"), ("alice", "semantic"), (None, "exact")])
def test_lookup_sees_only_its_own_scope(store, anchor, mode):
    info = save(store, anchor, scope="tenant-a")
    fp = info.fingerprint_hash
    look = lambda scope: store.lookup(fingerprint_hash=fp, tokens=tokens(N), anchor=anchor, mode=mode,  # noqa: E731
                                      scope=scope)
    assert look("tenant-a").id == info.id
    assert look("tenant-b") is None and look(None) is None
    plain = save(store, anchor)
    assert plain.id.split("/")[0] != info.id.split("/")[0]  # another key: another directory
    assert look(None).id == plain.id and look("tenant-a").id == info.id and look("tenant-b") is None


def test_per_tenant_prefixes_on_one_bucket(s3_endpoint):
    """Two tenants, one bucket, a prefix each (``s3://bucket/tenant-a``, ``.../tenant-b``):
    every object a tenant's store writes lies under its prefix; the other tenant's store lists,
    looks up, garbage-collects and evicts without seeing or touching any of them. (With per-tenant
    credentials restricted to the prefix, see the README, the object store enforces the same.)"""
    import boto3

    bucket = make_s3_bucket(s3_endpoint)
    options = {**S3_OPTIONS, "endpoint": s3_endpoint}
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1", aws_access_key_id="testing",
                          aws_secret_access_key="testing")

    def keys(prefix: str = "") -> list[str]:
        out = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            out += [o["Key"] for o in page.get("Contents", [])]
        return out

    with Store.open(f"s3://{bucket}/tenant-a", **options) as a, \
            Store.open(f"s3://{bucket}/tenant-b", capacity_bytes=1, **options) as b:
        opened = set(keys())  # each store's root group, under its own prefix
        assert opened and {k.split("/")[0] for k in opened} == {"tenant-a", "tenant-b"}
        ea = save(a, "alice")
        en = save(a, None)
        a_objects = keys("tenant-a/")
        assert len(a_objects) > 1 and set(keys()) - opened <= set(a_objects)
        fp = ea.fingerprint_hash
        assert b.list() == []
        assert b.lookup(fingerprint_hash=fp, tokens=tokens(N), anchor="alice") is None
        assert b.lookup(fingerprint_hash=fp, tokens=tokens(N), anchor="alice", mode="semantic") is None
        assert b.lookup(fingerprint_hash=fp, tokens=tokens(N)) is None
        b.gc(stale_after=0)
        b.evict()
        assert sorted(keys("tenant-a/")) == sorted(a_objects)  # nothing of A's removed
        eb = save(b, "alice")
        assert [k for k in set(keys()) - set(a_objects) if not k.startswith("tenant-b/")] == []
        assert sorted(keys("tenant-a/")) == sorted(a_objects)
        assert {e.id for e in a.list()} == {ea.id, en.id}
        assert a.lookup(fingerprint_hash=fp, tokens=tokens(N), anchor="alice").id == ea.id
        assert [e.id for e in b.list()] == [eb.id]
