"""Store fixtures: a local directory and a real S3-compatible server (moto) on loopback.

The S3 tests are not optional: without moto they fail and say how to install it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest

from anchorkv.store.store import Store

S3_OPTIONS = {"region": "us-east-1", "access_key_id": "testing", "secret_access_key": "testing"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto() -> tuple[subprocess.Popen, str]:
    """A moto S3 server on a free loopback port: (process, endpoint URL). Raises RuntimeError
    if it does not answer within 30 s."""
    port = _free_port()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return proc, url
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(
                    f"moto server did not start on {url} within 30 s (exit code {proc.poll()})") from None
            time.sleep(0.1)


@pytest.fixture(scope="session")
def s3_endpoint():
    try:
        import boto3  # noqa: F401
        import moto.server  # noqa: F401
    except ImportError:
        pytest.fail("the S3 store tests need moto's server: pip install -e '.[test]' (moto[server])")
    try:
        proc, url = start_moto()
    except RuntimeError as e:
        pytest.fail(str(e))
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def make_s3_bucket(endpoint: str) -> str:
    import boto3

    name = f"anchorkv-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket=name)
    return name


@pytest.fixture(params=["local", "s3"])
def store_url(request, tmp_path):
    """(url, options) of an empty store on each backend."""
    if request.param == "local":
        return str(tmp_path / "store"), {}
    endpoint = request.getfixturevalue("s3_endpoint")
    return f"s3://{make_s3_bucket(endpoint)}/cache", {**S3_OPTIONS, "endpoint": endpoint}


@pytest.fixture
def store(store_url):
    url, options = store_url
    with Store.open(url, **options) as s:
        yield s


@pytest.fixture
def one_layer_shards(monkeypatch):
    """Entries cut as before format version 7, every shard one layer (`format.layer_span` 1): for
    tests of what such shards do (their bytes as zarr-python writes them, reads of a whole shard,
    keys by layer, versions 3-6). `tests/store/test_layer_span.py` tests shards spanning layers."""
    from anchorkv.store import format as F

    monkeypatch.setattr(F, "LAYER_SHARD_BYTES", 0)
