"""Helpers that drive the real vLLM 0.33 scheduler and KV-cache allocator on CPU.

Not a test module: future connector tests import it. vLLM is imported lazily inside the
functions, so importing this module works without vLLM (tests skip via importorskip).
Install vLLM for CPU tests with ``scripts/install_vllm_cpu.sh PYTHON``.

The model is a local directory holding only the public Kimi-Linear-48B-A3B ``config.json``
(``anchorkv.testing.vllm_configs``; no weights, no tokenizer). Nothing touches the network (``HF_HUB_OFFLINE=1``).

Two CPU-platform quirks are handled here so the configs look like a GPU deployment's:

* ``CpuPlatform.check_and_update_config`` forces ``block_size=16`` and disables prefix
  caching and chunked prefill for every MLA model (vllm/platforms/cpu.py:291-298, 533-547).
  ``make_vllm_config`` restores the requested values after the platform hook runs.
* The hybrid block size (1920 at tp=1) is normally chosen by
  ``Platform._align_hybrid_block_size`` when the executor starts, after the model's layers
  exist. ``hybrid_block_size`` runs that real function with a stand-in for a GPU MLA backend
  (FlashMLA: kernel block 64).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from anchorkv.testing.vllm_configs import (
    KIMI_KDA_LAYERS,
    KIMI_LINEAR_48B_VLLM_CONFIG,
    KIMI_MLA_HEAD_SIZE,
    KIMI_NUM_LAYERS,
)

GPU_MLA_KERNEL_BLOCK = 64  # FlashMLABackend.get_supported_kernel_block_sizes() == [64]


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn"


def _set_env() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def write_kimi_linear_model_dir(path: str | os.PathLike, **overrides: Any) -> str:
    """Write a weight-less Kimi-Linear model directory (just config.json); return it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = json.loads(json.dumps(KIMI_LINEAR_48B_VLLM_CONFIG))
    cfg.update(overrides)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return str(path)


@contextlib.contextmanager
def _keep_requested_cache_settings(block_size, enable_prefix_caching, chunked_prefill,
                                   max_num_batched_tokens=None):
    """Undo the CPU platform's MLA overrides (block 16, no prefix caching/chunking, and
    ``max_num_batched_tokens`` raised to at least ``max_model_len``: without setting it back,
    prefills never chunk and requests are never preempted)."""
    from vllm.platforms import current_platform

    cls = type(current_platform)
    original = cls.__dict__.get("check_and_update_config")

    def patched(klass, vllm_config):
        original.__func__(klass, vllm_config)
        if vllm_config.model_config is None:
            return
        cache = vllm_config.cache_config
        sched = vllm_config.scheduler_config
        if block_size is not None:
            cache.block_size = block_size
        cache.enable_prefix_caching = enable_prefix_caching
        sched.enable_chunked_prefill = chunked_prefill
        if max_num_batched_tokens is not None:
            sched.max_num_batched_tokens = max_num_batched_tokens

    if original is None:  # not a CPU-style platform; nothing to undo
        yield
        return
    cls.check_and_update_config = classmethod(patched)
    try:
        yield
    finally:
        cls.check_and_update_config = original


def make_vllm_config(
    model_dir: str,
    *,
    connector: str | None = None,
    connector_module_path: str | None = None,
    extra_config: dict[str, Any] | None = None,
    kv_role: str = "kv_both",
    kv_load_failure_policy: str = "recompute",
    block_size: int | None = None,
    enable_prefix_caching: bool = False,
    mamba_cache_mode: str | None = None,
    tp: int = 1,
    max_model_len: int = 8192,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 16,
    kv_cache_layout: str = "LBNHC",
):
    """Build a real ``VllmConfig`` for the local Kimi-Linear directory.

    ``connector``/``connector_module_path``/``extra_config`` fill ``KVTransferConfig``
    (no kv-transfer config when ``connector`` is None). ``mamba_cache_mode`` defaults to
    vLLM's own choice ("align" with prefix caching, else "none"). ``block_size`` None keeps
    vLLM's default; call ``hybrid_block_size(cfg)`` afterwards for the GPU-realistic value.
    ``kv_cache_layout`` is a ``KVCacheLayout`` name (EngineCore resolves it at start-up).
    """
    _set_env()
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_config = ModelConfig(
        model=model_dir,
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        dtype="bfloat16",
    )
    cache_kwargs: dict[str, Any] = dict(enable_prefix_caching=enable_prefix_caching)
    if block_size is not None:
        cache_kwargs["block_size"] = block_size
    if mamba_cache_mode is not None:
        cache_kwargs["mamba_cache_mode"] = mamba_cache_mode
    kv_transfer_config = None
    if connector is not None:
        kv_transfer_config = KVTransferConfig(
            kv_connector=connector,
            kv_connector_module_path=connector_module_path,
            kv_role=kv_role,
            kv_connector_extra_config=dict(extra_config or {}),
            kv_load_failure_policy=kv_load_failure_policy,
        )
    with _keep_requested_cache_settings(block_size, enable_prefix_caching, True, max_num_batched_tokens):
        vllm_config = VllmConfig(
            model_config=model_config,
            cache_config=CacheConfig(**cache_kwargs),
            scheduler_config=SchedulerConfig(
                max_model_len=max_model_len,
                is_encoder_decoder=False,
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                enable_chunked_prefill=True,
            ),
            parallel_config=ParallelConfig(tensor_parallel_size=tp),
            device_config=DeviceConfig("cpu"),
            kv_transfer_config=kv_transfer_config,
        )
    # Normally resolved by EngineCore (resolve_kv_cache_layout); LBNHC is the default.
    vllm_config.cache_config.kv_cache_layout = kv_cache_layout
    return vllm_config


def hybrid_block_size(vllm_config, kernel_block: int = GPU_MLA_KERNEL_BLOCK) -> tuple[int, int]:
    """Run vLLM's real ``Platform._align_hybrid_block_size`` on a copy-free config.

    Mutates ``vllm_config.cache_config`` exactly as a GPU executor start would (block_size,
    mamba_page_size_padded, mamba_block_size in align mode) and returns
    ``(block_size, page_size_bytes)``. ``kernel_block`` stands in for the GPU MLA backend's
    smallest kernel block (FlashMLA: 64).
    """
    from vllm.platforms.interface import Platform

    class _GpuMlaBackendStandIn:
        @staticmethod
        def get_supported_kernel_block_sizes(*_a, **_k):
            return [kernel_block]

    Platform._align_hybrid_block_size.__func__(Platform, vllm_config, _GpuMlaBackendStandIn)
    cache = vllm_config.cache_config
    page = cache.block_size * KIMI_MLA_HEAD_SIZE * 2  # bf16 latent + rope
    return cache.block_size, page


def kimi_linear_layer_specs(vllm_config) -> dict:
    """Per-layer KV-cache specs as the Kimi-Linear layers report them (``get_kv_cache_spec``)."""
    import torch
    from vllm.models.kimi_k3 import KimiLinearForCausalLM
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec

    cache = vllm_config.cache_config
    shapes = tuple(KimiLinearForCausalLM.get_mamba_state_shape_from_config(vllm_config))
    dtypes = tuple(KimiLinearForCausalLM.get_mamba_state_dtype_from_config(vllm_config))
    mamba_block_size = cache.mamba_block_size
    if mamba_block_size is None:
        mamba_block_size = cache.block_size if cache.mamba_cache_mode == "align" else (
            vllm_config.model_config.max_model_len
        )
    # which layers are KDA comes from the model's config, as vLLM's model class decides it
    hf = vllm_config.model_config.hf_config
    lin = getattr(hf, "linear_attn_config", None) or {}
    kda_layers = {i - 1 for i in lin.get("kda_layers", [j + 1 for j in KIMI_KDA_LAYERS])}
    specs: dict = {}
    for i in range(KIMI_NUM_LAYERS):
        if i in kda_layers:
            specs[layer_name(i)] = MambaSpec(
                block_size=mamba_block_size,
                shapes=shapes,
                dtypes=dtypes,
                page_size_padded=cache.mamba_page_size_padded,
                mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
                mamba_cache_mode=cache.mamba_cache_mode,
            )
        else:
            specs[layer_name(i)] = MLAAttentionSpec(
                block_size=cache.block_size,
                num_kv_heads=1,
                head_size=KIMI_MLA_HEAD_SIZE,
                dtype=torch.bfloat16,
                cache_dtype_str=cache.cache_dtype,
            )
    return specs


def kimi_linear_kv_cache_groups(vllm_config) -> list:
    """The 4 groups vLLM forms for Kimi-Linear: 3 KDA groups (layers 0,4,..,24 / 1,5,..,25 /
    2,6,..,22) and 1 MLA group (3,7,..,23,26), built by hand so that any block size works
    (with no KDA layer in the config, the MLA group alone)."""
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MambaSpec

    specs = kimi_linear_layer_specs(vllm_config)
    kda = [i for i in range(KIMI_NUM_LAYERS) if isinstance(specs[layer_name(i)], MambaSpec)]
    mla = [i for i in range(KIMI_NUM_LAYERS) if i not in kda]
    groups = [KVCacheGroupSpec([layer_name(i) for i in kda[j::3]], specs[layer_name(kda[j])])
              for j in range(min(3, len(kda)))]  # none: every layer MLA (a model without state)
    groups.append(KVCacheGroupSpec([layer_name(i) for i in mla], specs[layer_name(mla[0])]))
    return groups


def make_kv_cache_config(vllm_config, num_blocks: int, *, use_vllm_grouping: bool = True):
    """Kimi-Linear ``KVCacheConfig`` with exactly ``num_blocks`` blocks.

    When the KDA state fits the MLA page (block size from ``hybrid_block_size``), the groups
    come from vLLM's own ``get_global_kv_cache_groups`` (or the hand-built ones with
    ``use_vllm_grouping=False``) and the tensors from vLLM's planner
    (``get_kv_cache_config_from_groups``), so ``allocate_kv_caches`` works on it. With a
    smaller block size (e.g. 64, to keep scheduler tests small) vLLM cannot unify the page
    sizes; the config then has the hand-built groups and no tensors: good for the
    scheduler, not for the allocator.
    """
    from vllm.v1.core.kv_cache_planning import (
        get_global_kv_cache_groups,
        get_kv_cache_config_from_groups,
    )
    from vllm.v1.kv_cache_interface import KVCacheConfig

    groups = kimi_linear_kv_cache_groups(vllm_config)
    pages = {g.kv_cache_spec.page_size_bytes for g in groups}
    if len(pages) != 1:
        return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    if use_vllm_grouping:
        groups = get_global_kv_cache_groups(vllm_config, [kimi_linear_layer_specs(vllm_config)])
    regions = max(len(g.layer_names) for g in groups)
    cfg = get_kv_cache_config_from_groups(vllm_config, groups, num_blocks * pages.pop() * regions)
    assert cfg.num_blocks == num_blocks, (cfg.num_blocks, num_blocks)
    return cfg


def block_sizes(kv_cache_config, vllm_config) -> tuple[int, int]:
    """(scheduler_block_size, hash_block_size) as EngineCore resolves them."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    return resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)


def make_scheduler(vllm_config, kv_cache_config):
    """Construct the real v1 ``Scheduler`` (it creates the SCHEDULER-role connector)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    sched_bs, hash_bs = block_sizes(kv_cache_config, vllm_config)
    # EngineCore sets this after profiling (vllm/v1/engine/core.py).
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=sched_bs,
        hash_block_size=hash_bs,
        log_stats=False,
    )


def handshake(scheduler, workers) -> None:
    """What EngineCore does once its scheduler exists (`_set_kv_connector_handshake_metadata`):
    each worker connector's handshake metadata, keyed by (pp rank, tp rank), to the scheduler's."""
    connector = scheduler.get_kv_connector()
    if connector is None:
        return
    content = {(0, r): md for r, w in enumerate(workers) if (md := w.get_handshake_metadata()) is not None}
    if content:
        connector.set_xfer_handshake_metadata_pp_aware(content)


def request_block_hasher(vllm_config, kv_cache_config):
    """The block hasher EngineCore attaches to requests (prefix caching or a connector)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    if not (vllm_config.cache_config.enable_prefix_caching or vllm_config.kv_transfer_config):
        return None
    fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(fn)
    _, hash_bs = block_sizes(kv_cache_config, vllm_config)
    return get_request_block_hasher(hash_bs, fn, vllm_config.num_hash_lookahead_tokens)


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    *,
    max_tokens: int = 4,
    kv_transfer_params: dict[str, Any] | None = None,
    block_hasher=None,
    cache_salt: str | None = None,
):
    """A v1 ``Request``; ``kv_transfer_params`` travels as the API does (extra_args);
    ``cache_salt`` as the OpenAI server passes the request's ``cache_salt`` field."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=params,
        pooling_params=None,
        block_hasher=block_hasher,
        cache_salt=cache_salt,
    )


def fake_model_runner_output(scheduler_output, *, token_id: int = 1, kv_connector_output=None):
    """A ``ModelRunnerOutput`` sampling ``token_id`` for every request that finished its
    prompt this step (partial prefills sample nothing)."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(scheduler_output.num_scheduled_tokens)
    # Requests still mid-prefill sample nothing.
    partial = _partial_prefill_ids(scheduler_output)
    sampled = [[] if rid in partial else [token_id] for rid in req_ids]
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=kv_connector_output,
    )


def _partial_prefill_ids(scheduler_output) -> set[str]:
    partial: set[str] = set()
    new = {r.req_id: r for r in scheduler_output.scheduled_new_reqs}
    for rid, n in scheduler_output.num_scheduled_tokens.items():
        if rid in new:
            r = new[rid]
            if r.num_computed_tokens + n < len(r.prompt_token_ids or []):
                partial.add(rid)
    cached = scheduler_output.scheduled_cached_reqs
    for i, rid in enumerate(cached.req_ids):
        n = scheduler_output.num_scheduled_tokens[rid]
        total = _cached_prompt_len.get(rid)
        if total is not None and cached.num_computed_tokens[i] + n < total:
            partial.add(rid)
    return partial


# Prompt lengths of requests added through ``add_request`` (cached requests in
# SchedulerOutput do not carry their prompt).
_cached_prompt_len: dict[str, int] = {}


def add_request(scheduler, request) -> None:
    _cached_prompt_len[request.request_id] = request.num_prompt_tokens
    scheduler.add_request(request)


def step(scheduler, *, kv_connector_output=None, token_id: int = 1):
    """One engine step: ``schedule()`` then ``update_from_output`` with a fake model output.

    Returns ``(scheduler_output, engine_core_outputs)``.
    """
    out = scheduler.schedule()
    mro = fake_model_runner_output(out, token_id=token_id, kv_connector_output=kv_connector_output)
    return out, scheduler.update_from_output(out, mro)


def allocate_kv_caches(kv_cache_config, layout: str = "LBNHC", kernel_block_sizes: list[int] | None = None) -> dict:
    """Per-layer CPU views from the real ``allocate_kv_cache`` (what ``register_kv_caches`` gets).

    ``kernel_block_sizes`` (one per KV-cache group, as ``prepare_kernel_block_sizes`` returns
    them) splits attention blocks into kernel blocks the way a GPU MLA backend asks for.
    """
    import torch
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    return allocate_kv_cache(kv_cache_config, torch.device("cpu"), KVCacheLayout[layout], kernel_block_sizes)


def kda_state_views(vllm_config, layer_view):
    """(conv, recurrent) tensors of one KDA layer, sliced by vLLM's own ``MambaBase.bind_kv_cache``."""
    from vllm.models.kimi_k3 import KimiLinearForCausalLM

    shapes = KimiLinearForCausalLM.get_mamba_state_shape_from_config(vllm_config)
    dtypes = KimiLinearForCausalLM.get_mamba_state_dtype_from_config(vllm_config)
    return bound_states(layer_view, shapes, dtypes)


def bound_states(view, shapes, dtypes):
    """The state tensors a Mamba-type layer reads from its page view, sliced by vLLM's own
    ``MambaBase.bind_kv_cache``."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    class _Layer:
        def get_state_shape(self):
            return shapes

        def get_state_dtype(self):
            return dtypes

    layer = _Layer()
    MambaBase.bind_kv_cache(layer, view)
    return layer.kv_cache


def byte_offset(t) -> int:
    """Byte offset of ``t``'s first element inside its storage."""
    return t.storage_offset() * t.element_size()
