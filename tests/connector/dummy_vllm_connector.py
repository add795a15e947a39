"""A do-nothing out-of-tree vLLM connector for the harness smoke test.

Loaded by vLLM through ``kv_connector_module_path="tests.connector.dummy_vllm_connector"``
(pytest puts the repository root on ``sys.path``). Records every scheduler-side call
in the class-level ``CALLS`` list so tests can see that vLLM reached it.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)


class DummyMetadata(KVConnectorMetadata):
    def __init__(self, new_block_ids: dict[str, tuple[list[int], ...]]):
        self.new_block_ids = new_block_ids


class DummyConnector(KVConnectorBase_V1, SupportsHMA):
    CALLS: list[tuple] = []
    INSTANCES: list[DummyConnector] = []

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        self.extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config)
        DummyConnector.INSTANCES.append(self)
        DummyConnector.CALLS.append(("__init__", role))

    # scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        DummyConnector.CALLS.append(
            ("get_num_new_matched_tokens", request.request_id, num_computed_tokens,
             len(request.prompt_token_ids), request.kv_transfer_params,
             len(request.block_hashes))
        )
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        DummyConnector.CALLS.append(
            ("update_state_after_alloc", request.request_id, blocks.get_block_ids(),
             num_external_tokens)
        )

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        new = {r.req_id: r.block_ids for r in scheduler_output.scheduled_new_reqs}
        DummyConnector.CALLS.append(("build_connector_meta", new))
        return DummyMetadata(new)

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]):
        DummyConnector.CALLS.append(("request_finished_all_groups", request.request_id, block_ids))
        return False, None

    # worker side (never reached in scheduler-only tests)
    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass
