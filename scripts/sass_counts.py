"""SASS instruction counts of the pack and unpack kernels for sm_90, compiled on this machine.

    env -u TRITON_INTERPRET .venv/bin/python scripts/sass_counts.py [field:codec[:group] ...]
    env -u TRITON_INTERPRET .venv/bin/python scripts/sass_counts.py sets [default raw ...]

For each Kimi-Linear tp=1 field and codec given (default: the connector's default lossy set,
latent:fp8:64 recurrent:int8:128 conv:int8:128, and latent:int4:64), the launch path's own
specialization (`tests.kernels.sm90.specializations`) is compiled with the ptxas inside the
triton wheel and disassembled with its `cuobjdump -sass`. Printed per kernel: every instruction,
the main body (up to the last EXIT, before the division's slow-path routine) and the values a
thread handles. Kernels this short are issue-bound on an H200 (ncu, stop 26), so the count is
the figure to compare between trees on a machine without a GPU (run it in a worktree of each).
`sets`: the set kernels (`_pack_set_kernel`, `_unpack_set_kernel`) of the Kimi-Linear tp=1
connector sets named (`tests.kernels.sm90.set_cases`' codec sets), all their launches' bodies
in one kernel: the instruction count and where each body's EXIT falls. Both print the
registers a thread (`cuobjdump -res-usage`) and the warps.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from anchorkv.codec import KIMI_LINEAR_48B_CONFIG, CodecSpec, kimi_linear_layout  # noqa: E402
from anchorkv.kernels import PackItem, UnpackItem, triton_pack, triton_unpack  # noqa: E402
from anchorkv.kernels.batch import field_cut  # noqa: E402
from anchorkv.kernels.quant import Quant, payload_nbytes  # noqa: E402
from tests.kernels import sm90  # noqa: E402

DEFAULT = ("latent:fp8:64", "recurrent:int8:128", "conv:int8:128", "latent:int4:64")
_INSTR = re.compile(r"/\*[0-9a-f]{4}\*/\s+((?:@!?U?P\w+\s+)?[A-Z][A-Z0-9_.]+[^;]*);")


def items(want: str):
    """(label, PackItem, UnpackItem) of the tp=1 field and codec `want` (field:codec[:group])."""
    name, codec, *group = want.split(":")
    layout = kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=1)
    page = layout.layers[0].page.page_bytes
    buf = torch.empty(8 * page, dtype=torch.uint8)
    for layer in layout.layers:
        for f in layer.page.fields:
            if f.name != name:
                continue
            field, spec = f.strided(page), CodecSpec(codec, int(group[0]) if group else None)
            ids = [3] if str(layer.kind) == "state" else [5, 1, 6, 2]
            cut = field_cut(field, spec)
            payload = torch.empty(len(ids) * payload_nbytes(Quant(codec), cut.numel, cut.itemsize), dtype=torch.uint8)
            scales = torch.empty(len(ids) * cut.groups, cut.columns, dtype=torch.float32)
            return [(want, PackItem(buf, field, ids, 8, spec), UnpackItem(buf, field, ids, 8, spec, payload, scales))]
    raise SystemExit(f"no field {name!r} in Kimi-Linear's layout")


def sass(op: str, entry: dict) -> tuple[str, int]:
    """(the SASS of `entry`'s compile for sm_90, its registers a thread: `cuobjdump -res-usage`)."""
    signature, constexprs, attrs, options = entry["_compile"]
    fn = {"pack": triton_pack._pack_kernel, "unpack": triton_unpack._unpack_kernel,
          "pack_set": triton_pack._pack_set_kernel, "unpack_set": triton_unpack._unpack_set_kernel}[op]
    options = {k: v for k, v in options.items() if k != "extern_libs"}
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                            options=options)
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        text, usage = (subprocess.run([str(tool), flag, str(cubin)], capture_output=True, text=True, check=True).stdout
                       for flag in ("-sass", "-res-usage"))
    return text, int(re.search(r"REG:(\d+)", usage).group(1))


def main(argv: list[str]) -> None:
    if argv[:1] == ["sets"]:  # the set kernels of Kimi-Linear tp=1's connector sets
        for combo in argv[1:] or ("default", "raw"):
            label = f"kimi-linear tp=1 conv=SD bfloat16/float32 set {combo}"
            for entry in sm90.set_specializations(c for c in sm90.set_cases() if c[0] == label):
                code, regs = sass(entry["op"], entry)
                text = _INSTR.findall(code)
                exits = [i + 1 for i, t in enumerate(text) if "EXIT" in t]
                print(f"{entry['op']:10} {combo:8} instructions {len(text):5}  EXITs after {exits}  "
                      f"registers {regs}  warps {entry['_compile'][3]['num_warps']}")
        return
    for want in argv or DEFAULT:
        for entry in sm90.specializations(items(want)):
            code, regs = sass(entry["op"], entry)
            text = _INSTR.findall(code)
            body = max(i for i, t in enumerate(text) if "EXIT" in t) + 1
            print(f"{entry['op']:6} {want:20} instructions {len(text):5}  main body {body:5}  "
                  f"values a thread {entry['values_per_thread']}  registers {regs}  "
                  f"warps {entry['_compile'][3]['num_warps']}")


if __name__ == "__main__":
    main(sys.argv[1:])
