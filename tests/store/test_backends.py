"""Every store backend runs the conformance suite `anchorkv.testing.backends.BackendTests`:
a local directory, and an S3-compatible bucket on a moto server on loopback."""

from __future__ import annotations

import pytest

from anchorkv.store.backends import LocalBackend, ObjectBackend
from anchorkv.store.paths import TRASH
from anchorkv.testing.backends import BackendTests
from tests.store.conftest import S3_OPTIONS, make_s3_bucket


class TestLocalBackend(BackendTests):
    @pytest.fixture
    def backend(self, tmp_path) -> LocalBackend:
        return LocalBackend(tmp_path / "store")

    def test_trash_lists_what_a_killed_delete_left(self, backend: LocalBackend) -> None:
        backend.ensure_root()
        (backend.root / TRASH / "0123abcd" / "f").mkdir(parents=True)
        assert backend.trash() == [f"{TRASH}/0123abcd"]
        backend.delete_tree(backend.trash()[0])
        assert backend.trash() == []


@pytest.mark.s3
class TestObjectBackend(BackendTests):
    @pytest.fixture
    def backend(self, s3_endpoint) -> ObjectBackend:
        return ObjectBackend(f"s3://{make_s3_bucket(s3_endpoint)}/cache", **{**S3_OPTIONS, "endpoint": s3_endpoint})
