"""A process that saves one entry and can stop at a named point of the commit protocol.

Run by the commit-protocol tests as ``python -m tests.store.crash_child '<json>'``; the test
kills it with SIGKILL while it is stopped (or after a random delay), or releases it. The hooks
wrap the backend object of this process only; the library has no crash hook of its own.

Points, in protocol order (``K`` counts shard-file writes, from 1)::

    start        before begin_entry
    chunk:K      after the K-th shard file is written (staging area / write-unique prefix)
    part         after this rank's part marker is written
    arrays       after the arrays' zarr.json are written (the manifest is not)
    publish      just before publication (local: the rename; object store: the manifest put)
    published    after publication, before the staging area is cleaned up

At a point listed in ``stop`` the child prints ``AT <point>`` and then, per ``action``: ``hang``
(sleep until killed) or ``wait:<file>`` (continue once the file exists). It prints ``READY``
once its inputs are built and ``DONE <entry id> <seconds since READY>`` at the end.

Input JSON: url, options, anchor, n (tokens), seed (values), write_id, stop (list), action.
With ``"mode": "pin"`` and ``entry``, it holds `Store.pin(entry)` instead (prints
``AT pinned``) until killed: a reader in another process.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

from anchorkv.store.store import Store
from tests.store.helpers import CODECS, all_packed, tiny_layout, tokens

_CHUNK = re.compile(r"/c\.[0-9.]+$")


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


class Hooks:
    def __init__(self, stop: list[str], action: str) -> None:
        self.stop = set(stop)
        self.action = action
        self.chunks = 0

    def at(self, point: str) -> None:
        if point not in self.stop:
            return
        _say(f"AT {point}")
        if self.action == "hang":
            while True:
                time.sleep(60)
        path = self.action.removeprefix("wait:")
        while not os.path.exists(path):
            time.sleep(0.005)


def hold_lease(store: Store, entry: str) -> None:
    """Hold `Store.pin` on `entry` (an in-process pin and a lease file) until killed."""
    with store.pin(entry):
        _say("AT pinned")
        while True:
            time.sleep(60)


def main(cfg: dict) -> None:
    store = Store.open(cfg["url"], **cfg.get("options", {}))
    if cfg.get("mode") == "pin":
        hold_lease(store, cfg["entry"])
    hooks = Hooks(cfg.get("stop", []), cfg.get("action", "hang"))
    backend = store.backend
    real_write, real_publish = backend.write, backend.publish
    manifest_path: list[str] = []

    def write(path, buffers, **kw):
        is_manifest = bool(manifest_path) and path == manifest_path[0]
        if is_manifest:
            hooks.at("arrays")
            if not backend.atomic_publish:  # object store: the manifest put is the publication
                hooks.at("publish")
        real_write(path, buffers, **kw)
        if _CHUNK.search(path):
            hooks.chunks += 1
            hooks.at(f"chunk:{hooks.chunks}")
        elif "/parts/rank-" in path:
            hooks.at("part")
        elif is_manifest and not backend.atomic_publish:
            hooks.at("published")

    def publish(staged, final):  # local: the rename is the publication
        if not backend.atomic_publish:
            return real_publish(staged, final)
        hooks.at("publish")
        ok = real_publish(staged, final)
        hooks.at("published")
        return ok

    backend.write, backend.publish = write, publish
    layout = tiny_layout()
    n, seed = cfg["n"], cfg["seed"]
    packed = all_packed(layout, CODECS, n, seed)
    toks = tokens(max(n, 700))
    _say("READY")
    t0 = time.perf_counter()
    hooks.at("start")
    writer = store.begin_entry(layout, CODECS, toks, num_tokens=n, anchor=cfg["anchor"],
                               write_id=cfg.get("write_id"))
    manifest_path.append(f"{writer.data}/zarr.json")
    for (layer, field), p in packed.items():
        writer.write_layer(layer, field, p)
    writer.finish_rank()
    info = writer.commit()
    _say(f"DONE {info.id} {time.perf_counter() - t0:.6f}")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
