"""flash-linear-attention's own torch references of the recurrences, pinned (fla-core 0.6.0).

The study runs the KDA and Gated DeltaNet recurrences with fla's `naive_recurrent_kda` and
`naive_recurrent_gated_delta_rule` and their gates `naive_kda_gate` / `naive_gdn_gate` (plain
torch, CPU), not with hand-written copies, so its state and outputs are the ones the model's
authors test their kernels against.

Why load the two `naive.py` files by path instead of ``import fla.ops.kda.naive``: importing any
`fla.ops` module first imports the whole `fla.ops` package, i.e. every Triton kernel of the
library (13 s on the 2-core CI machine, and a warning that Triton has no CPU driver). The two
files import only torch and einops. Install: ``pip install -e .[bench]`` (or ``[test]``).
"""

from __future__ import annotations

from functools import cache
from importlib import metadata, util
from pathlib import Path
from types import ModuleType

#: The fla-core release the study is pinned to (pyproject.toml's `bench` and `test` extras).
FLA_VERSION = "0.6.0"

_FILES = {"kda": "ops/kda/naive.py", "gdn": "ops/gated_delta_rule/naive.py"}
#: fla's torch reference of each layer's forget gate, and the file it lives in.
_GATES = {"kda": ("ops/kda/gate.py", "naive_kda_gate"), "gdn": ("ops/gated_delta_rule/gate.py", "naive_gdn_gate")}


def version() -> str:
    try:
        return metadata.version("fla-core")
    except metadata.PackageNotFoundError:
        return "not installed"


def _root() -> Path:
    spec = util.find_spec("fla")  # locates the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"the fidelity study needs fla-core=={FLA_VERSION} (flash-linear-attention's torch "
            "references of KDA and Gated DeltaNet); install it with `pip install -e .[bench]` "
            f"or `pip install fla-core=={FLA_VERSION}`"
        )
    if version() != FLA_VERSION:
        raise ImportError(f"the fidelity study is pinned to fla-core=={FLA_VERSION}, found {version()}; "
                          f"`pip install fla-core=={FLA_VERSION}`")
    return Path(list(spec.submodule_search_locations)[0])


@cache
def _module(kind: str) -> ModuleType:
    path = _root() / _FILES[kind]
    mod_spec = util.spec_from_file_location(f"_anchorkv_fla_naive_{kind}", path)
    module = util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


def naive_recurrent_kda(*args, **kwargs):
    """fla's `fla.ops.kda.naive.naive_recurrent_kda` (q, k, v, g, beta, scale, initial_state,
    output_final_state): shapes `[B, T, H, K]`, g `[B, T, H, K]`, beta `[B, T, H]`, state
    `[B, H, K, V]`."""
    return _module("kda").naive_recurrent_kda(*args, **kwargs)


def naive_recurrent_gated_delta_rule(*args, **kwargs):
    """fla's `fla.ops.gated_delta_rule.naive.naive_recurrent_gated_delta_rule` (q, k, v, beta,
    g, scale, initial_state, output_final_state): g `[B, T, H]` (one decay per head)."""
    return _module("gdn").naive_recurrent_gated_delta_rule(*args, **kwargs)


@cache
def naive_gate(kind: str):
    """fla's torch reference of the forget gate: `naive_kda_gate(g [..., H, K], A_log [H],
    dt_bias [H*K])` or `naive_gdn_gate(g [..., H], A_log [H], dt_bias [H])`, both
    ``-exp(A_log) * softplus(g + dt_bias)``.

    Why compiled from its source: it sits in `gate.py` beside Triton kernels whose imports pull
    in all of fla (see the module docstring); the function itself needs only torch and
    `torch.nn.functional`, so its definition is taken verbatim and run with those.
    """
    import ast

    import torch
    import torch.nn.functional as F

    rel, name = _GATES[kind]
    path = _root() / rel
    tree = ast.parse(path.read_text(), str(path))
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace = {"torch": torch, "F": F}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), namespace)
    return namespace[name]
