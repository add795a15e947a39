"""`AnchorKVConnector`: vLLM (0.32, 0.33) loads it by module path, with no fork.

    --kv-transfer-config '{"kv_connector": "AnchorKVConnector",
        "kv_connector_module_path": "anchorkv.connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": "/var/cache/anchorkv"}}'

Scheduler side (process of the engine core):
    get_num_new_matched_tokens  look the request's entry up (exact prefix or anchor), report
                                tokens beyond the local hit, at a valid KDA boundary, async
    update_state_after_alloc    plan the load into the request's freshly allocated blocks
    get_loaded_kv_cache_group_ids  the state groups only: vLLM zeroes the paged blocks it
                                allocates for a load, so no stale row reaches attention
    update_connector_output     loads the workers finished or failed (a failed one is not retried)
    build_connector_meta        hand planned loads and saves to the workers; saves read the
                                blocks vLLM names in this step (block state, boundary offers)
    request_finished_all_groups plan the save of prompt + output; hold the blocks until read

Worker side (one per tensor-parallel rank):
    register_kv_caches          build the layout model from the registered views (kernel
                                blocks regrouped into scheduler blocks), vLLM's KV-cache
                                specs and the model's description (anchorkv.architectures)
    handle_preemptions          no load writes / save reads blocks of preempted requests later
    start_load_kv               restore sync loads now (before the forward), async ones on a
                                background thread
    wait_for_save               pack planned saves (GPU, side stream), write them in the background
    get_transfer_results        finished / failed async loads and released blocks

`save_kv_layer` and `wait_for_layer_load` are no-ops: saves and loads work on whole requests
(`wait_for_save`, `start_load_kv`), which vLLM calls for every model.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from anchorkv.connector.config import ConnectorConfig, codec_banner
from anchorkv.connector.metrics import StatsMixin
from anchorkv.connector.plan import Metadata
from anchorkv.connector.scheduler import SchedulerSide
from anchorkv.connector.storage_zarr import ZarrEntryStore
from anchorkv.connector.vllm_layout import (
    attention_backends,
    build_views,
    config_dict,
    groups_of,
    model_layout,
    no_prefill_after_restore,
    opaque_kv_layout,
)
from anchorkv.connector.weights import config_digest, process_started, weights_digest
from anchorkv.connector.worker import WorkerSide

log = logging.getLogger("anchorkv.connector")

#: `get_transfer_results` calls a finished request with no blocks awaiting release is kept for
#: (its finish save is planned in the step vLLM reports it finished; a margin, not a need)
FINISHED_ID_CALLS = 64


def model_id_of(vllm_config: Any) -> str:
    """The model's name where its weights cannot be read (see `model_identity`): vLLM's `model`
    as given (a Hugging Face id, or a path; the object-storage URL of streamed weights), with
    its `revision` when one is set. Only what every process of the engine is given alike: not
    what a process finds on its disk, such as the commit a hub cache resolves a revision to (a
    review: a node with `config.json` cached and one with only the weights named one model two
    ways)."""
    model_config = vllm_config.model_config
    name = str(getattr(model_config, "model_weights", None) or getattr(model_config, "model", None) or "unknown")
    revision = getattr(model_config, "revision", None)
    return f"{name}@{revision}" if revision else name


@dataclasses.dataclass(frozen=True)
class ModelIdentity:
    """What names the model in an entry's fingerprint (`ModelLayout.model`, `.weights`,
    `.model_config`): see `model_identity`."""

    model: str | None
    weights: str | None
    model_config: str


def model_identity(vllm_config: Any, hf_config: dict, model_id: str | None, *,
                   hash_missing: bool = True) -> ModelIdentity:
    """The weights by their content where this process can read them (`weights.weights_digest`:
    equal files share entries wherever they are loaded from, and weights rewritten at one path
    never restore the old ones' state); the model's name as well where they cannot (vLLM's
    random `dummy` weights, streamed or plug-in loaders, a node without the files) or where
    `model_id` names them; and the config, dtype and quantization the state is computed with.
    `hash_missing` False (a scheduler that gets its workers' identity at start-up): no weight
    file is read, only hashes known or cached."""
    digest = weights_digest(vllm_config, hash_missing=hash_missing, since=process_started())
    name = model_id or (model_id_of(vllm_config) if digest is None or digest == "dummy" else None)
    return ModelIdentity(name, digest, config_digest(vllm_config, hf_config))


def multi_connector_of(vllm_config: Any) -> str | None:
    """vLLM's connector name where anchorkv runs inside a MultiConnector; None otherwise."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    name = getattr(transfer, "kv_connector", None)
    return name if name and name != "AnchorKVConnector" and "Multi" in name else None


def refuse_unsupported(vllm_config: Any) -> None:
    """Configurations whose restores anchorkv cannot make right, refused at start-up (a
    `ValueError`: vLLM reports it and does not start)."""
    pp = getattr(getattr(vllm_config, "parallel_config", None), "pipeline_parallel_size", 1) or 1
    if pp > 1:
        raise ValueError(f"anchorkv: pipeline parallelism is not supported (found pipeline_parallel_size={pp}): "
                         "each stage holds part of the layers, an entry holds them all; serve with "
                         "--pipeline-parallel-size 1 (tensor parallelism of any size is supported)")
    if getattr(vllm_config, "weight_transfer_config", None) is not None:
        raise ValueError("anchorkv: weights updated while serving (weight_transfer_config is set) would make "
                         "saved state another model's: remove the weight transfer configuration, or anchorkv")


class AnchorKVHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells the scheduler once at start-up (vLLM's connector handshake): the
    model identity it keys its saves to, which the scheduler's lookups must use too."""

    def __init__(self, identity: ModelIdentity) -> None:
        self.identity = identity


class AnchorKVMetadata(KVConnectorMetadata):
    def __init__(self, plan: Metadata) -> None:
        self.plan = plan


def tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:  # not initialized (CPU tests, a single process)
        return 0


def raw_entry_size(layout: Any) -> tuple[int, int]:
    """(fixed bytes, bytes per token) of one raw entry of `layout`'s model (every rank's part):
    the state layers' logical states and the sliding-window layers' window of rows (at most
    that many), and the other paged layers' logical rows."""
    from anchorkv.codec import LayerKind

    fixed = per_token = 0
    for layer in layout.layers:
        for f in layer.page.fields:
            n = f.itemsize
            for d in (f.logical_shape if layer.kind is LayerKind.STATE else f.logical_shape[1:]):
                n *= d
            if layer.kind is LayerKind.STATE:
                fixed += n
            elif layer.window is not None:
                fixed += n * layer.window
            else:
                per_token += n
    return fixed, per_token


def capacity_warning(config: ConnectorConfig, layout: Any = None) -> str | None:
    """The start-up warning for a store without a capacity bound (None when one is set)."""
    if config.capacity is not None:
        return None
    size = ""
    if layout is not None:
        fixed, per_token = raw_entry_size(layout)
        size = (f"; a raw entry of this model is about {fixed / 2**20:.1f} MiB + {per_token / 1024:.1f} KiB "
                "per token, saved up to 3 times per request, see the README's sizing")
    return (f"anchorkv: NO CAPACITY SET: the store {config.store} grows without bound (nothing is "
            f"evicted{size}); set kv_connector_extra_config 'capacity' "
            "(e.g. \"200GB\") or run `anchorkv gc --capacity SIZE` periodically")


class AnchorKVConnector(StatsMixin, KVConnectorBase_V1, SupportsHMA):
    """The connector; `StatsMixin` reports its counters through vLLM's KV-connector stats
    (log line and Prometheus) and sends its logs to vLLM's handler."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = ConnectorConfig.from_extra_config(
            vllm_config.kv_transfer_config.kv_connector_extra_config)
        hf_config = config_dict(vllm_config.model_config.hf_config)
        self._kv_config = kv_cache_config
        self._vllm_config_ = vllm_config
        self.groups = groups_of(kv_cache_config)
        self.mode = getattr(vllm_config.cache_config, "mamba_cache_mode", None) or "none"
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        # the model at this tp, from vLLM's KV-cache specs and the model's description (its
        # fingerprint, what entries must agree with, is TP-independent for described models)
        # (rank 0's: the store and the fingerprint need only shapes, which every rank shares)
        # and the weights' name: two checkpoints of one architecture never share entries
        refuse_unsupported(vllm_config)
        #: vLLM's connector handshake brings the workers' identity to the scheduler before it
        #: schedules (not through a MultiConnector: it hands every sub-connector one
        #: connector's metadata, which another connector would refuse)
        self._handshake = multi_connector_of(vllm_config) is None
        self.identity = model_identity(vllm_config, hf_config, self.config.model_id,
                                       hash_missing=role != KVConnectorRole.SCHEDULER or not self._handshake)
        self.model_layout = dataclasses.replace(
            model_layout(kv_cache_config, hf_config, tp_size=self.tp_size, tp_rank=0),
            **dataclasses.asdict(self.identity))
        # at tp 1 the engine core builds this role's connector and the other's in one process:
        # they share one Store (a manifest the lookup read is not read again by the restore)
        self.store = ZarrEntryStore(self.config, self.model_layout, share=self.tp_size == 1)
        self.config = self.store.config  # codec groups resolved as the entries store them
        self._hf_config = hf_config
        #: requests vLLM said finished -> calls of `get_transfer_results` since, while their
        #: blocks may still await release (see there)
        self._finished_ids: dict[str, int] = {}
        # attention pages whose in-block token order anchorkv cannot read: whole blocks only
        opaque = opaque_kv_layout(kv_cache_config)
        granularity = self.model_layout.block_size if opaque else 1
        self.store.window_align = granularity  # (a sliding window's rows too: whole blocks)
        # an engine that cannot prefill after restored tokens: restore only what leaves one token
        no_prefill = no_prefill_after_restore(vllm_config)
        # one side per process: the other stays None (see `_scheduler_side`, `_worker_side`)
        self.scheduler: SchedulerSide | None
        self.worker: WorkerSide | None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(self.config, self.groups, self.mode, self.store,
                                           granularity=granularity, decode_only=no_prefill is not None)
            self.worker = None
        else:
            self.scheduler = None
            self.worker = WorkerSide(self.config, self.groups, self.mode, self.store,
                                     self.tp_size, tp_rank(), granularity=granularity)
        if opaque and role == KVConnectorRole.SCHEDULER:
            log.info("anchorkv: K/V pages in %s token order: whole %d-token blocks are saved and "
                     "restored (entries restore on engines with the same layout only)", opaque, granularity)
        if no_prefill is not None and role == KVConnectorRole.SCHEDULER:
            log.warning("anchorkv: %s: a request is restored only when the entry leaves its last token "
                        "to compute, otherwise computed in full (counted as miss 'needs_prefill'); saves "
                        "are unaffected", no_prefill)
        log.info("anchorkv: %s side, store %s, model %s (weights %s), codecs %s, lookup %s, mamba cache mode %s",
                 role.name.lower(), self.config.store, self.model_layout.model, self.identity.weights or "unread",
                 {k: str(v) for k, v in self.config.codec.items()}, self.config.lookup, self.mode)
        log.log(*codec_banner(self.config.codec))  # a WARNING when any field's codec is lossy
        if role == KVConnectorRole.SCHEDULER:  # once per engine, not per rank
            fixed, per_token = raw_entry_size(self.model_layout)
            log.info("anchorkv: %s: a raw entry of this model is %.1f MiB + %.1f KiB per token (all "
                     "ranks), up to 3 entries per request", self.model_layout.architecture, fixed / 2**20,
                     per_token / 1024)
            warning = capacity_warning(self.config, self.model_layout)
            if warning:
                log.warning(warning)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a future cache miss, nothing more

    @property
    def _scheduler_side(self) -> SchedulerSide:
        """The scheduler side, which vLLM calls only on the connector it made for its scheduler."""
        if self.scheduler is None:
            raise RuntimeError("anchorkv: a scheduler-side method was called on a worker's connector")
        return self.scheduler

    @property
    def _worker_side(self) -> WorkerSide:
        """The worker side, which vLLM calls only on the connectors it made for its workers."""
        if self.worker is None:
            raise RuntimeError("anchorkv: a worker-side method was called on the scheduler's connector")
        return self.worker

    def _plan(self, meta: KVConnectorMetadata) -> Metadata:
        """The plan inside the metadata `build_connector_meta` made (always an `AnchorKVMetadata`)."""
        return cast(AnchorKVMetadata, meta).plan

    # ================================================================ scheduler side

    def on_new_request(self, request: Any) -> None:
        self._scheduler_side.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        return self._scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler_side.update_state_after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return AnchorKVMetadata(self._scheduler_side.build_meta(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler_side.loads_finished(set(connector_output.finished_recving or ()),
                                      set(connector_output.failed_recving or ()))

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        return self._scheduler_side.get_loaded_group_ids()

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]):
        return self._scheduler_side.request_finished(request, block_ids)

    def request_finished(self, request: Any, block_ids: list[int]):
        return self._scheduler_side.request_finished(request, (block_ids,))

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """The workers' model identity, once at start-up: lookups must find what the workers save.
        Where rank 0 keys entries otherwise than this process (its weights read where this node
        has none, a config the model's loading changed), the scheduler takes rank 0's."""
        ours = {rank: m.identity for rank, m in metadata.items()
                if isinstance(m, AnchorKVHandshake)}  # (a MultiConnector may hand another's)
        if not ours or self.scheduler is None:
            return
        if len(set(ours.values())) > 1:
            log.error("anchorkv: the tensor-parallel ranks key entries to different models %s: their "
                      "weight files differ; a rank's part of an entry restores only where the weights agree",
                      {r: i.weights for r, i in sorted(ours.items())})
        first = ours[min(ours)]
        if first != self.identity:
            log.info("anchorkv: the workers key entries to model %s, weights %s (this process: %s, %s); "
                     "lookups use the workers'", first.model, first.weights or "unread",
                     self.identity.model, self.identity.weights or "unread")
            self.identity = first
            self.model_layout = dataclasses.replace(self.model_layout, **dataclasses.asdict(first))
            self.store.set_model_layout(self.model_layout)

    # ================================================================ worker side

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return AnchorKVHandshake(self.identity) if self._handshake else None

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        # block ids count the scheduler's blocks, whatever kernel block the backend views
        backends = attention_backends(self._vllm_config_, kv_caches)
        log.info("anchorkv: attention backends %s", sorted(set(backends.values())) or "not found")
        worker = self._worker_side
        layout, views = build_views(kv_caches, self._kv_config, self._hf_config, tp_size=self.tp_size,
                                    tp_rank=worker.tp_rank, backends=backends)
        layout = dataclasses.replace(layout, **dataclasses.asdict(self.identity))
        if layout.fingerprint_hash() != self.model_layout.fingerprint_hash():
            raise RuntimeError("anchorkv: the registered caches do not match vLLM's KV-cache specs "
                               f"({layout.fingerprint()} vs {self.model_layout.fingerprint()}); this is a bug")
        worker.register(layout, views)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before vLLM reuses the blocks of requests preempted in this step: no load of ours
        writes into them afterwards, no pending save reads them afterwards."""
        self._worker_side.handle_preemptions(self._plan(kv_connector_metadata))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker_side.start_load(self._plan(self._get_connector_metadata()))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        self._worker_side.save(self._plan(self._get_connector_metadata()))

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        for req_id in finished_req_ids:
            self._finished_ids.setdefault(req_id, 0)
        worker = self._worker_side
        sending, recving, failed = worker.transfer_results(set(self._finished_ids))
        # A finished request is remembered until its blocks are released (its finish save
        # read them), or for FINISHED_ID_CALLS calls if it holds none (no finish save: most
        # requests), so the set stays as small as the saves in flight (review: it kept every
        # request ever finished).
        held = worker.awaiting_release()
        for req_id in list(self._finished_ids):
            if req_id in sending:
                del self._finished_ids[req_id]
            elif req_id not in held:
                self._finished_ids[req_id] += 1
                if self._finished_ids[req_id] > FINISHED_ID_CALLS:
                    del self._finished_ids[req_id]
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]):
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()  # failures go through failed_recving (vLLM raises on block ids with HMA)

    def shutdown(self) -> None:
        """vLLM's engine shutdown (the scheduler's and each worker's): the worker's saves in
        flight end first, then the store closes (one shared by both roles at tp 1 when the
        second closes)."""
        if self.worker is not None:
            self.worker.shutdown()
        self.store.close()
