"""A restore reads its parts `worker.READ_THREADS` at a time from a local directory (CPU work under
the GIL: more threads only wait for each other) and `worker.REMOTE_READ_THREADS` at a time from an
object store (each read a round trip), on a real S3-compatible server on loopback."""

from __future__ import annotations

from anchorkv.codec import KIMI_LINEAR_48B_CONFIG, kimi_linear_layout
from anchorkv.connector import worker as worker_module
from anchorkv.connector.config import ConnectorConfig
from anchorkv.connector.storage_zarr import ZarrEntryStore
from anchorkv.connector.worker import WorkerSide
from tests.store.conftest import s3_endpoint, store_url  # noqa: F401 (fixtures)


def test_a_restore_reads_as_many_parts_at_once_as_its_store_wants(store_url, monkeypatch):  # noqa: F811
    url, options = store_url
    monkeypatch.setattr(worker_module, "READ_THREADS", 2)
    monkeypatch.setattr(worker_module, "REMOTE_READ_THREADS", 5)
    entries = ZarrEntryStore(ConnectorConfig.from_extra_config({"store": url, "storage_options": options}),
                             kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=1))
    try:
        remote = url.startswith("s3://")
        assert entries.remote is remote
        worker = WorkerSide(entries.config, [], "none", entries, 1, 0)
        assert worker.read_threads == worker._read_pool._max_workers == (5 if remote else 2)
        worker.shutdown()
    finally:
        entries.close()
