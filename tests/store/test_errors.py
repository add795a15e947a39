"""Opening a store: every failure is one `StoreUnavailable` line that says what to do, read-only
tools never write, a writer fails at open (the connector's start-up) when it cannot write.

S3 cases run against a real S3-compatible server (moto) on loopback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from anchorkv.store.errors import StoreUnavailable
from anchorkv.store.store import Store
from tests.store.conftest import S3_OPTIONS, make_s3_bucket

ROOT = Path(__file__).resolve().parents[2]
NO_AWS = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}


def test_a_writer_checks_it_can_write(tmp_path, monkeypatch):
    import errno

    from anchorkv.store.backends import LocalBackend

    Store.open(tmp_path / "s")  # creates it
    assert sorted(os.listdir(tmp_path / "s")) == ["entries", "zarr.json"], "the write probe was not removed"

    def refuse(self, path, buffers, atomic=False):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(LocalBackend, "write", refuse)
    with pytest.raises(StoreUnavailable, match="cannot write to the store: .*permission denied.*cannot read or write"):
        Store.open(tmp_path / "s")
    assert Store.open(tmp_path / "s", create=False).list() == []  # reading still works


def test_a_file_is_not_a_store(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(StoreUnavailable, match="is a file, not a store directory"):
        Store.open(tmp_path / "f")


@pytest.mark.s3
def test_s3_typo_prefix_is_reported_and_nothing_is_written(s3_endpoint):
    import boto3

    bucket = make_s3_bucket(s3_endpoint)
    options = {**S3_OPTIONS, "endpoint": s3_endpoint}
    Store.open(f"s3://{bucket}/store", **options)
    with pytest.raises(StoreUnavailable, match="no store at s3://.*/stroe: expected a zarr.json under the prefix"):
        Store.open(f"s3://{bucket}/stroe", create=False, **options)
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1", aws_access_key_id="testing",
                          aws_secret_access_key="testing")
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert not [k for k in keys if k.startswith("stroe")], keys


@pytest.mark.s3
@pytest.mark.parametrize("create", [False, True])
def test_s3_missing_bucket(s3_endpoint, create):
    options = {**S3_OPTIONS, "endpoint": s3_endpoint}
    with pytest.raises(StoreUnavailable, match="the bucket does not exist; create it"):
        Store.open("s3://no-such-bucket-here/p", create=create, **options)


@pytest.mark.s3
@pytest.mark.parametrize("bucket,query,expect", [
    ("new", "region=us-east-1", "storage_options"),  # no credentials
    ("no-such-bucket-here", "region=us-east-1", None),  # credentials, no bucket
    ("new", "acess_key_id=x", "is not valid for store 'S3'; expected S3 storage_options such as endpoint"),
], ids=["no-credentials", "missing-bucket", "misspelt-option"])
def test_s3_cli_errors_are_one_or_two_lines(s3_endpoint, bucket, query, expect):
    """No credentials (the CLI, AWS variables unset), a missing bucket and a misspelt option: a
    line naming the fix, no traceback, nothing of obstore's debug dump."""
    bucket = make_s3_bucket(s3_endpoint) if bucket == "new" else bucket
    url = f"s3://{bucket}/p?endpoint={s3_endpoint}&{query}"
    env = NO_AWS if expect else {**NO_AWS, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    res = subprocess.run([sys.executable, "-m", "anchorkv", "ls", "--store", url], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=180)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and 1 <= len(lines) <= 2 and "Traceback" not in res.stderr, res.stderr
    assert (expect or "the bucket does not exist") in res.stderr, res.stderr


def test_s3_without_the_extra(tmp_path):
    """An s3:// store where obstore is not installed names the extra to install."""
    code = ("import sys\nsys.modules['obstore'] = None\nsys.modules['obstore.store'] = None\n"
            "from anchorkv.cli import main\nsys.exit(main(['ls', '--store', 's3://bucket/prefix']))\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "pip install 'anchorkv[s3]'" in res.stderr, res.stderr


def test_a_failed_cleanup_keeps_the_original_error(tmp_path, monkeypatch):
    from anchorkv.store.writer import EntryWriter
    from tests.store.helpers import CODECS, all_packed, tiny_layout, tokens

    store = Store.open(tmp_path / "s")
    layout = tiny_layout()
    packed = all_packed(layout, CODECS, 300)

    def broken_write(self, layer, field, p):
        raise RuntimeError("disk on fire")

    def broken_abort(self):
        raise OSError("cleanup failed")

    monkeypatch.setattr(EntryWriter, "write_layer", broken_write)
    monkeypatch.setattr(EntryWriter, "abort", broken_abort)
    with pytest.raises(RuntimeError, match="disk on fire"):
        store.save(layout, CODECS, tokens(300), packed, anchor="x")


def test_the_connector_fails_at_start_up_on_an_unwritable_store(tmp_path, monkeypatch):
    """`ZarrEntryStore` (built when the connector starts) opens its store for writing, so an
    unwritable store fails there, once, saying why."""
    import errno

    from anchorkv.connector.config import ConnectorConfig
    from anchorkv.connector.storage_zarr import ZarrEntryStore
    from anchorkv.store.backends import LocalBackend
    from tests.store.helpers import tiny_layout

    def refuse(self, path, buffers, atomic=False):
        raise OSError(errno.EROFS, "Read-only file system", path)

    monkeypatch.setattr(LocalBackend, "write", refuse)
    config = ConnectorConfig.from_extra_config({"store": str(tmp_path / "store"), "codec": {
        "conv": "raw", "recurrent": "raw", "latent": "raw"}})
    with pytest.raises(ValueError, match="cannot open the store .*file system is read-only"):
        ZarrEntryStore(config, tiny_layout())


def test_packaging_extras():
    """triton only in the [gpu] extra (and [test]: the interpreter tests); google-crc32c (zarr's,
    Apache-2.0) and fastcrc (MIT, the store's default crc32c) required, the `crc32c` package
    (LGPL-2.1-or-later, the fallback without the GIL) only in the [fast-crc] extra and [test]
    (every library's path tested); a [bench] extra that runs `anchorkv bench`, tensorstore tested."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = lambda reqs: {r.split(">")[0].split("=")[0].split("[")[0].strip().lower() for r in reqs}  # noqa: E731
    base, extras = names(project["dependencies"]), {k: names(v) for k, v in project["optional-dependencies"].items()}
    assert "triton" not in base and "triton" in extras["gpu"]
    assert {"google-crc32c", "fastcrc"} <= base and "crc32c" not in base
    assert {k for k, v in extras.items() if "crc32c" in v} == {"fast-crc", "test"}
    assert {"pytest", "pytest-benchmark", "matplotlib", "safetensors"} <= extras["bench"]
    assert "tensorstore" in extras["test"]


def test_cpu_use_never_imports_triton():
    code = ("import sys\nsys.modules['triton'] = None\nsys.modules['triton.language'] = None\n"
            "import torch\nimport anchorkv.codec, anchorkv.store.store, anchorkv.connector\n"
            "from anchorkv.codec import CodecSpec\nfrom anchorkv.kernels import reference\n"
            "p, s = reference.quantize(torch.ones(4, 8), CodecSpec('int8', 8))\nprint(p.numel(), s.numel())\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0 and res.stdout.split() == ["32", "4"], res.stderr[-2000:]
