"""Nothing a load relies on goes unverified: manifest flips, consistent rewrites, wrong sizes.

A flip that keeps the JSON valid is caught by the manifest checksum; a manifest rewritten with
a matching checksum is caught by the cross-checks against the entry name, the model
fingerprint and the format rules (or, for a chunk crc, by the read and by `verify`). Either
way no load returns a byte and lookup skips the entry.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from anchorkv.store import CorruptEntry, StoreError
from anchorkv.store.format import READABLE_VERSIONS
from anchorkv.store.manifest import (
    check_manifest,
    manifest_checksum,
    parse_group,
    signed_bytes_hold,
    signed_group_json,
)
from anchorkv.store.store import Store
from tests.store.helpers import CODECS, all_packed, tiny_layout, tokens

N = 1100  # two token chunks of the latent


@pytest.fixture
def saved(tmp_path):
    layout = tiny_layout()
    store = Store.open(tmp_path / "s")
    info = store.save(layout, CODECS, tokens(N), all_packed(layout, CODECS, N), anchor="a", write_id="w1")
    meta = Path(store.backend.root) / info.path / "zarr.json"
    return tmp_path / "s", info, meta, meta.read_text()


def _every_read_refuses(root, info) -> None:
    """A fresh store (no cache) refuses the entry on every path: get, load, lookup, verify."""
    store = Store.open(root, create=False)
    layout = tiny_layout()
    with pytest.raises(CorruptEntry, match=re.escape(info.id)):
        store.get(info.id)
    with pytest.raises(CorruptEntry):
        store.load(info.id, layout, "model.layers.1.attn", "recurrent")
    assert store.lookup(fingerprint_hash=layout.fingerprint_hash(), tokens=tokens(N), anchor="a") is None
    assert store.verify(info.id) != []
    assert [e.state for e in store.scan()] == ["damaged"]


def test_digit_flips_anywhere_in_the_manifest_are_refused(saved):
    """Every 7th digit of the group's zarr.json (all kinds of fields) and its last one, flipped:
    JSON still valid."""
    root, info, meta, text = saved
    digits = [m.start() for m in re.finditer(r"\d", text)]
    positions = digits[::7] + digits[-1:]
    assert len(positions) > 100
    missed = []
    for pos in positions:
        meta.write_text(text[:pos] + str((int(text[pos]) + 1) % 10) + text[pos + 1 :])
        try:
            Store.open(root, create=False).get(info.id)
            missed.append(text[max(0, pos - 40) : pos + 3])
        except CorruptEntry:
            pass
    assert missed == []


@pytest.mark.parametrize("what", ["num_tokens", "shard_axis", "layers", "offset", "chunk_size", "tp_size",
                                  "prefix_hash"])
def test_consistent_rewrites_are_refused(saved, what):
    """The manifest rewritten with a valid checksum: the cross-checks refuse it."""
    root, info, meta, text = saved
    doc = json.loads(text)
    m = doc["attributes"]["anchorkv"]
    if what == "num_tokens":
        m["num_tokens"] = 1200
    elif what == "shard_axis":  # the case: a payload 20x what its shape implies
        m["arrays"]["recurrent"]["shard_axis"] = None
    elif what == "layers":
        layers = m["arrays"]["recurrent"]["layers"]
        layers[0], layers[1] = layers[1], layers[0]
    elif what == "offset":
        m["checksums"]["recurrent/c.1.3.0.0"][2] += 256
    elif what == "chunk_size":
        m["checksums"]["latent/c.0.1.0"][1] -= 72
    elif what == "tp_size":
        m["tp_size"] = 2
    else:
        m["prefix_hash"] = "0" * 64
    m["checksum"] = manifest_checksum(m)
    assert check_manifest(info.id, m) != []
    meta.write_text(json.dumps(doc))
    _every_read_refuses(root, info)


def test_the_group_json_is_the_signed_manifests_canonical_json(saved):
    """`signed_group_json` (one encoding of the manifest, in two halves around ``checksum``)
    gives exactly ``json.dumps`` of the group with sorted keys and no spaces, and the checksum
    `manifest_checksum` computes; for manifests with keys on one side of ``checksum`` only,
    none, a stale checksum, and non-ASCII text (escaped). The committed entry's file is it."""
    root, info, meta, text = saved
    written = json.loads(text)["attributes"]["anchorkv"]
    cases = [dict(written), {k: v for k, v in written.items() if k < "checksum"},
             {k: v for k, v in written.items() if k > "checksum"}, {}, {"checksum": "blake3:stale", "é": [1.5, "ü"]}]
    for m in cases:
        m = dict(m)
        group = signed_group_json(m)
        assert group == json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {"anchorkv": m}},
                                   sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()
        assert m["checksum"] == manifest_checksum(m) == manifest_checksum(json.loads(group)["attributes"]["anchorkv"])
    assert text.encode() == signed_group_json({k: v for k, v in written.items() if k != "checksum"})


def test_the_signed_bytes_show_the_checksum_holds_and_nothing_else_does(saved, monkeypatch):
    """`signed_bytes_hold` (a read's check of the manifest checksum over the file's own bytes)
    is True for what `signed_group_json` writes, with the checksum first, in the middle or
    last; False for the same manifest as spaced JSON (older writes), for any byte of it
    changed, and for a checksum entry elsewhere than the manifest's top level. Parsing never
    needs it: with it forced False every committed entry still reads (the encoding compare)."""
    root, info, meta, text = saved
    data = text.encode()
    m = json.loads(data)["attributes"]["anchorkv"]
    assert signed_bytes_hold(data, m["checksum"])
    for case in ({"a": 1}, {"z": [1.5, "é"]}, {"a": {"checksum": "x"}, "z": 2}, {}):
        sub = dict(case)
        group = signed_group_json(sub)
        assert signed_bytes_hold(group, sub["checksum"]), case
    spaced = json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {"anchorkv": m}},
                        sort_keys=True).encode()
    assert json.loads(spaced)["attributes"]["anchorkv"] == m and not signed_bytes_hold(spaced, m["checksum"])
    assert not signed_bytes_hold(data, "blake3:" + "0" * 64) and not signed_bytes_hold(data, None)
    for at in range(0, len(data), max(1, len(data) // 97)):  # one byte changed anywhere
        flipped = bytearray(data)
        flipped[at] = ord("7") if flipped[at] != ord("7") else ord("8")
        assert not signed_bytes_hold(bytes(flipped), m["checksum"]), at
    # the checksum's entry moved from the top level into a nested object, after a comma (the
    # bytes less it are still the signed text): the manifest read has no checksum, and is refused
    entry = b',"checksum":' + json.dumps(m["checksum"]).encode()
    stripped = data.replace(entry, b"")
    codecs = stripped.index(b'"codecs":{') + len(b'"codecs":{')
    end = stripped.index(b"}", codecs)  # (the end of the first field's codec config)
    forged = stripped[:end] + entry + stripped[end:]
    assert json.loads(forged)["attributes"]["anchorkv"].get("checksum") is None
    with pytest.raises(CorruptEntry, match="no checksum"):
        parse_group(info.id, forged)
    monkeypatch.setattr("anchorkv.store.manifest.signed_bytes_hold", lambda data, checksum: False)
    assert [e.id for e in Store.open(root, create=False).list()] == [info.id]


def test_a_manifest_in_the_older_spaced_json_still_reads(saved):
    """Entries written before the compact group file (04021a4: `json.dumps(doc, sort_keys=True)`,
    spaces after separators) are read through the encoding compare: listed ok, verified, loaded
    to the same bytes; one digit changed in one is still refused."""
    root, info, meta, text = saved
    doc = json.loads(text)
    spaced = json.dumps(doc, sort_keys=True).encode()
    assert b'": ' in spaced and spaced != text.encode()
    layout = tiny_layout()
    fresh = Store.open(root, create=False)
    before = {k: fresh.load(info.id, layout, *k).payload for k in all_packed(layout, CODECS, N)}
    meta.write_bytes(spaced)
    store = Store.open(root, create=False)
    assert store.get(info.id).manifest == doc["attributes"]["anchorkv"] and store.verify(info.id) == []
    for k, payload in before.items():
        assert np.array_equal(store.load(info.id, layout, *k).payload.numpy(), payload.numpy()), k
    meta.write_bytes(spaced.replace(b'"num_tokens": %d' % N, b'"num_tokens": %d' % (N + 1)))
    with pytest.raises(CorruptEntry, match="checksum"):
        Store.open(root, create=False).get(info.id)


def _resigned(body: bytes) -> bytes:
    """A group zarr.json of manifest text `body` (without braces) signed over its own bytes, as
    a writer that signs non-canonical text would leave it."""
    import blake3

    c = "blake3:" + blake3.blake3(b"{" + body + b"}").hexdigest()
    head = b'{"attributes":{"anchorkv":{"checksum":' + json.dumps(c).encode() + b","
    return head + body + b'}},"node_type":"group","zarr_format":3}'


@pytest.mark.parametrize("edit", [
    lambda t: re.sub(rb'"created":[0-9.e+]+', b'"created":NaN', t),
    lambda t: re.sub(rb'"created":[0-9.e+]+', b'"created":1e999', t),
    lambda t: re.sub(rb'"created":[0-9.e+]+', b'"created":-Infinity', t),
    lambda t: re.sub(rb'("created":[0-9.e+]+)', rb'"created":1.0,\1', t),  # a key twice
    lambda t: t,  # (the control: the writer's own text, signed so)
], ids=["nan", "overflow", "infinity", "duplicate-key", "control"])
def test_a_self_signed_manifest_that_is_not_json_or_names_a_key_twice_is_refused(saved, edit):
    """Signed over its own bytes (the check a read makes without encoding the manifest again),
    a manifest with a non-finite number or a key named twice is refused by reads, and called
    unusable by a commit that meets it (both judge a file alike), as the encoding compare
    refused them (found by review: accepted with `created` NaN or inf, or its first value of a
    key named twice, while `unusable` called the same bytes damaged)."""
    from anchorkv.store.commit import unusable

    root, info, meta, text = saved
    m = json.loads(text)["attributes"]["anchorkv"]
    m.pop("checksum")
    canonical = json.dumps(m, sort_keys=True, separators=(",", ":")).encode()[1:-1]
    body = edit(canonical)
    data = _resigned(body)
    meta.write_bytes(data)
    store = Store.open(root, create=False)
    if body == canonical:  # (the control)
        assert store.get(info.id).manifest["created"] == m["created"] and unusable(data) is None
        return
    with pytest.raises(CorruptEntry, match=re.escape(info.id)):
        store.get(info.id)
    assert unusable(data) is not None


def test_a_self_signed_manifest_spelled_otherwise_reads_as_it_parses(saved):
    """A manifest signed over its own bytes that spells a key otherwise (`\\u0061nchor`, the
    same JSON as `anchor`) holds its checksum (every byte but its entry is signed) and reads as
    it parses, by reads and by a commit's `unusable` alike; one byte of it changed does not."""
    from anchorkv.store.commit import unusable

    root, info, meta, text = saved
    m = json.loads(text)["attributes"]["anchorkv"]
    m.pop("checksum")
    canonical = json.dumps(m, sort_keys=True, separators=(",", ":")).encode()[1:-1]
    assert canonical.count(b'"anchor":') == 1
    data = _resigned(canonical.replace(b'"anchor":', b'"\\u0061nchor":'))
    meta.write_bytes(data)
    store = Store.open(root, create=False)
    assert store.get(info.id).manifest == {**m, "checksum": json.loads(data)["attributes"]["anchorkv"]["checksum"]}
    assert unusable(data) is None
    meta.write_bytes(data.replace(b"u0061nchor", b"u0062nchor"))
    with pytest.raises(CorruptEntry, match=re.escape(info.id)):
        Store.open(root, create=False).get(info.id)


@pytest.mark.parametrize("layer, field, chunk", [
    ("model.layers.1.attn", "recurrent", "recurrent_scales/c.1.3.0.0.0"),  # a run of a shard spanning layers
    ("model.layers.2.attn", "latent", "latent/c.0.1.0"),  # a shard the load reads whole
])
def test_a_wrong_chunk_crc_fails_the_read_and_verify(saved, layer, field, chunk):
    """A chunk crc rewritten (checksum recomputed): the manifest is self-consistent, so only the
    data can tell; the load of that chunk and `verify` both refuse, naming the chunk; also where
    the load reads the chunk's shard whole, whose own crc32c still holds (found by review: a
    check by the shard's crc32c alone returned the entry's bytes)."""
    root, info, meta, text = saved
    doc = json.loads(text)
    m = doc["attributes"]["anchorkv"]
    m["checksums"][chunk][0] ^= 1
    m["checksum"] = manifest_checksum(m)
    meta.write_text(json.dumps(doc))
    store = Store.open(root, create=False)
    with pytest.raises(CorruptEntry, match=re.escape(chunk) + " fails its check"):
        store.load(info.id, tiny_layout(), layer, field)
    problems = store.verify(info.id)
    assert len(problems) == 1 and f"damaged chunks: {chunk}" in problems[0], problems


def test_a_manifest_that_is_not_json_is_listed_damaged(saved):
    root, info, meta, text = saved
    meta.write_text(text[: len(text) // 2])
    store = Store.open(root, create=False)
    [entry] = store.scan()
    assert entry.state == "damaged" and "no anchorkv manifest" in entry.problem
    assert entry.stored_bytes > 0 and store.usage() == entry.stored_bytes


def test_load_refuses_a_layout_that_disagrees(saved):
    """Same fingerprint hash is necessary but not enough: a reader layout whose field is split
    along another axis (or has other layers) gets an error, never bytes of another slice."""
    root, info, meta, text = saved
    store = Store.open(root, create=False)
    layout = tiny_layout()
    store._fingerprint = lambda _layout: info.fingerprint_hash  # pretend the fingerprints agree
    other = tiny_layout(architecture="Other")
    f = other.layer("model.layers.1.attn").page.field("recurrent")
    object.__setattr__(f, "shard_axis", 1)
    with pytest.raises(CorruptEntry, match="split along axis 1, the reader along 2"):
        store.load(info.id, other, "model.layers.1.attn", "recurrent")
    got = store.load(info.id, layout, "model.layers.1.attn", "recurrent")  # the real layout still loads
    assert got.payload.numel() == sum(info.arrays()["recurrent"].codec.nbytes((1, 8, 16, 16))[:1])


@pytest.mark.parametrize("version,state", [
    (2, "old-format"),
    (max(READABLE_VERSIONS) + 1, "newer-format"),  # 4 and 5 are readable (plug-ins, sized token chunks)
])
def test_other_format_versions(saved, version, state):
    """An older version is never loaded and gc removes it; a newer one is listed, left alone."""
    root, info, meta, text = saved
    written = info.manifest["format_version"]
    assert f'"format_version":{written}' in text  # (the manifest's compact JSON)
    meta.write_text(text.replace(f'"format_version":{written}', f'"format_version":{version}'))
    store = Store.open(root, create=False)
    [entry] = store.scan()
    assert entry.state == state, entry
    with pytest.raises(StoreError, match=f"format version {version}"):
        store.load(info.id, tiny_layout(), "model.layers.1.attn", "recurrent")
    report = Store.open(root).gc(dry_run=True)
    assert report["old_format"] == (1 if version == 2 else 0)
    assert np.array_equal(np.frombuffer(meta.read_bytes()[:1], np.uint8), np.frombuffer(b"{", np.uint8))


def test_verify_checks_the_arrays_zarr_json(saved):
    """What other Zarr readers rely on (an array's shape, data type, codecs) must agree with
    the manifest: a changed digit in an array's zarr.json is named by `verify`."""
    root, info, meta, text = saved
    path = meta.parent / "latent" / "zarr.json"
    doc = json.loads(path.read_text())
    doc["shape"][1] += 1
    path.write_text(json.dumps(doc))
    problems = Store.open(root, create=False).verify(info.id)
    assert problems == [f"entry {info.id}: array 'latent': its zarr.json disagrees with the manifest in ['shape'] "
                        "(other Zarr readers would misread it)"], problems


@pytest.mark.parametrize("t", [1795563986.8385925, 1700000000.0000002, 1999999999.9999998, 4102444800.1234567])
def test_every_digit_of_a_recorded_time_is_significant(monkeypatch, t):
    """A manifest's `created` changed in any one digit is another value (so the checksum sees
    it): the digits past float64's precision that `time.time()` can carry are not written."""
    from anchorkv.store import manifest

    monkeypatch.setattr(manifest.time, "time", lambda: t)
    text = json.dumps(manifest.now())
    for pos in (m.start() for m in re.finditer(r"\d", text)):
        flipped = text[:pos] + str((int(text[pos]) + 1) % 10) + text[pos + 1:]
        assert json.loads(flipped) != json.loads(text), (text, flipped)


@pytest.mark.parametrize("value,problem", [
    (lambda c: [c[0], c[1], float(c[2])], "expected [crc32c, nbytes, offset]"),  # 2048.0 == 2048
    (lambda c: [c[0], True, c[2]] if c[1] == 1 else [c[0], float(c[1]), c[2]], "expected [crc32c, nbytes, offset]"),
    (lambda c: [-1, c[1], c[2]], "expected [crc32c, nbytes, offset]"),
    (lambda c: [str(c[0]), c[1], c[2]], "expected [crc32c, nbytes, offset]"),
    (lambda c: c[:2], "expected [crc32c, nbytes, offset]"),
    (lambda c: {"crc": c[0]}, "expected [crc32c, nbytes, offset]"),
    (lambda c: [c[0], c[1], c[2] + 1], "at offset"),
    (lambda c: [c[0], c[1] + 2, c[2]], "its shape and dtype make"),
])
def test_every_malformed_chunk_checksum_is_named(saved, value, problem):
    """Each chunk's `[crc32c, nbytes, offset]` is checked for its types (a float or bool equal to
    the right integer too) and its place, whichever of a shard's chunks it is (the check takes
    a shard's well-formed chunks in one pass and goes chunk by chunk where any is not)."""
    root, info, meta, text = saved
    for key in ("recurrent/c.1.0.0.0", "latent/c.0.1.0"):  # a shard's first chunk; a later one
        doc = json.loads(text)
        m = doc["attributes"]["anchorkv"]
        assert key in m["checksums"], sorted(m["checksums"])[:8]
        m["checksums"][key] = value(m["checksums"][key])
        m["checksum"] = manifest_checksum(m)
        problems = check_manifest(info.id, m)
        assert any(key in p and problem in p for p in problems), (key, problems)
