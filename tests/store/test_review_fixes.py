"""Findings of a review of the store and its CLI (its numbers in brackets), each pinned: CLI
commands that never make a store of a mistyped directory [2], scans that list an unreadable
entry instead of failing [4], commits that scan only near the capacity [3], a losing commit
whose winner was evicted [8], S3 last-use objects that resurrect a deleted entry [7], store
text printed without rich markup [9], ASCII write ids [10], ``python -m anchorkv.store.cli``
[11] and ``gc --verify`` [5]."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from anchorkv.cli import main
from anchorkv.store import eviction
from anchorkv.store.errors import CorruptEntry
from anchorkv.store.paths import STAGING
from anchorkv.store.store import Store
from tests.store.helpers import CODECS, all_packed, tiny_layout, tokens

ROOT = Path(__file__).resolve().parents[2]
LAYER = "model.layers.1.attn"


def save(store: Store, anchor: str, seed: int = 0, n: int = 300, **kwargs):
    layout = tiny_layout()
    return store.save(layout, CODECS, tokens(n), all_packed(layout, CODECS, n, seed), anchor=anchor, **kwargs)


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def tree(root: Path) -> list[tuple[str, bytes]]:
    return sorted((str(p.relative_to(root)), p.read_bytes() if p.is_file() else b"") for p in root.rglob("*"))


# ----------------------------------------------------------------------------- [10] write ids


@pytest.mark.parametrize("wid", ["é", "٣", "abcé", "A", "a-b", "a" * 65])
def test_write_ids_are_ascii_lowercase_letters_and_digits(tmp_path, wid):
    """'é' and '٣' passed str.isalnum/islower; on S3 their entries were never found again."""
    store = Store.open(tmp_path / "s")
    with pytest.raises(ValueError, match=r"write_id must be 1-64 (ASCII )?lowercase letters"):
        save(store, "alice", write_id=wid)
    assert store.backend.list_dir(STAGING) == []


def test_ascii_write_ids_are_taken(tmp_path):
    store = Store.open(tmp_path / "s")
    for wid in ("0123456789abcdefghijklmnopqrstuvwxyz", "7" * 64):
        store.delete(save(store, "alice", write_id=wid))
