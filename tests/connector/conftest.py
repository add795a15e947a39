"""Fixtures of the connector tests: a weight-less Kimi-Linear model directory, engines."""

from __future__ import annotations

import pytest

from tests.connector.vllm_harness import _set_env

# vLLM picks its platform once, when something first imports it: a test module that imports vLLM
# (through anchorkv.connector.metrics) before the harness set its environment got no platform,
# and with it the hybrid KV cache manager off (test_metrics.py failed when run on its own, 16 of 19)
_set_env()


@pytest.fixture(autouse=True)
def _anchorkv_logs_reach_the_root(monkeypatch):
    """AnchorKVConnector sends the anchorkv logger to vLLM's handler (propagation off) unless
    VLLM_CONFIGURE_LOGGING=0; caplog listens on the root logger."""
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")


@pytest.fixture
def parses(monkeypatch) -> list[str]:
    """The entry ids whose manifest a `Store` parses from now on."""
    seen: list[str] = []
    import anchorkv.store.store as store_module

    real = store_module.parse_group

    def counted(entry, data):
        seen.append(entry)
        return real(entry, data)

    monkeypatch.setattr(store_module, "parse_group", counted)
    return seen


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    from tests.connector import vllm_harness as H

    return H.write_kimi_linear_model_dir(tmp_path_factory.mktemp("kimi_linear"))


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory):
    """Kimi-Linear with layers 3 and 4 (1-based) swapped between KDA and MLA: the same group
    shapes for vLLM, another model fingerprint for anchorkv."""
    from tests.connector import vllm_harness as H

    lin = dict(H.KIMI_LINEAR_48B_VLLM_CONFIG["linear_attn_config"])
    lin["kda_layers"] = sorted({*lin["kda_layers"]} - {3} | {4})
    lin["full_attn_layers"] = sorted({*lin["full_attn_layers"]} - {4} | {3})
    return H.write_kimi_linear_model_dir(tmp_path_factory.mktemp("kimi_other"), linear_attn_config=lin)
