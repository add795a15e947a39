"""anchorkv: save and restore the cache state of hybrid LLMs, compressed, by anchor.

Subpackages: `kernels` (Triton kernels and their torch references), `codec` (layout model,
pack/unpack API, codec registry), `store` (Zarr v3 entries), `connector` (the vLLM connector,
which needs vLLM installed). Importing `anchorkv` needs neither vLLM nor a GPU.
"""

__version__ = "0.1.0"
