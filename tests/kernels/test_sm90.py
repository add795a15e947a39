"""The kernels compiled for Hopper (sm_90) on a CPU: vector widths of their PTX, and how many
variants a stream of requests compiles. Runs `python -m tests.kernels.sm90` in a subprocess
(an interpreted kernel cannot be compiled; see that module)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "tests.kernels.sm90", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> tuple[subprocess.CompletedProcess, list[dict]]:
    out = tmp_path_factory.mktemp("sm90") / "sm90.json"
    proc = _run("--json", str(out), timeout=1500)
    if not out.exists():
        pytest.fail(f"sm_90 compile run failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}"
                    f"\n{proc.stderr[-3000:]}")
    return proc, json.loads(out.read_text())


def test_every_specialization_compiles_for_sm90(compiled):
    proc, specs = compiled
    assert {s["op"] for s in specs} == {"pack", "unpack", "pack_set", "unpack_set"}
    # every codec of every field reached the compiler at least once, alone and in a set kernel
    fmts = {(s["op"], s["fmt"]) for s in specs if not s["op"].endswith("_set")}
    assert fmts == {(op, f) for op in ("pack", "unpack") for f in ("raw", "bf16", "fp8", "int8", "int4")}
    in_sets = {(s["op"], p["fmt"]) for s in specs if s["op"].endswith("_set") for p in s["parts"]}
    assert in_sets == {(op, f) for op in ("pack_set", "unpack_set") for f in ("raw", "bf16", "fp8", "int8", "int4")}


def test_set_kernels_find_their_launch_without_an_integer_division(compiled):
    """A set kernel (`triton_pack._pack_set_kernel`, `triton_unpack._unpack_set_kernel`: a
    `PackSet` / `UnpackSet` call in one launch) finds a program's launch by compares, its tile
    by a constant's division, and its item by one fp32 product (`set_program`): one float-to-int
    convert a launch, no 64-bit division; every shipped layout's three fields in one kernel."""
    _, specs = compiled
    sets = [s for s in specs if s["op"].endswith("_set")]
    assert len(sets) >= 2 * 32 * 3, len(sets)  # (32 layouts, each with several codec sets)
    assert {len(s["parts"]) for s in sets} == {3, 6}  # (6: the "mixed" sets, two codecs a field)
    for s in sets:
        label, ops = s["labels"][0], s["ops"]
        assert ops.get("cvt.rzi.s32.f32", 0) <= len(s["parts"]), (label, ops)
        assert not any(k.startswith(("div.", "rem.")) and k.endswith("64") for k in ops), (label, ops)


def test_bulk_path_uses_16_byte_vector_accesses(compiled):
    proc, specs = compiled
    failed = [f"{s['op']} {s['labels'][0]}: {s['problem']}" for s in specs if s["problem"]]
    assert not failed, "\n".join(failed)
    assert proc.returncode == 0, proc.stdout[-2000:]
    # the check did apply: the contiguous, aligned fields of the shipped layouts claim 16 bytes
    alone = [s for s in specs if not s["op"].endswith("_set")]
    claimed = [s for s in alone if s["contig"] and s["align"] * s["itemsize"] >= 16]
    assert len(claimed) >= len(alone) // 2, [(s["labels"][0], s["align"]) for s in alone]
    sets = [s for s in specs if s["op"].endswith("_set")]
    claimed = [s for s in sets if all(p["contig"] and p["align"] * p["itemsize"] >= 16 for p in s["parts"])]
    assert len(claimed) >= len(sets) // 4, [(s["labels"][0], s["parts"]) for s in sets]


def test_no_64_bit_division_and_the_hardware_converts(compiled):
    """The kernels are issue-bound on an H200 (ncu: SM throughput 77%, DRAM 22%, before these
    changes), so what each element costs in instructions matters: no specialization divides in
    64 bits (the row unravelling did, six times a row: a called routine each), and on sm_89+ the
    fp8 codes, their decode and the rounding to bf16 are the hardware's converts."""
    _, specs = compiled
    div64 = [(s["op"], s["labels"][0], s["ops"]) for s in specs
             if any(k.startswith(("div.", "rem.")) and k.endswith("64") for k in s["ops"])]
    assert not div64, div64
    alone = [s for s in specs if not s["op"].endswith("_set")]
    assert any(s["flat"] for s in alone) and not all(s["flat"] for s in alone)
    for s in specs:
        ops, label = s["ops"], (s["op"], s["labels"][0])
        if s["op"] == "pack" and s["fmt"] == "fp8":
            assert ops.get("cvt.rn.satfinite.e4m3x2.f32"), label
        if s["op"] == "unpack" and s["fmt"] == "fp8":
            assert ops.get("cvt.rn.f16x2.e4m3x2"), label
        if s["op"] == "unpack" and s["fmt"] != "raw" and s["dtype"] == "bfloat16":
            assert ops.get("cvt.rn.bf16x2.f32") or ops.get("cvt.rn.bf16.f32"), label


def test_quantizing_packs_divide_once_a_row_not_once_a_value(compiled):
    """A pack divides each value by its group's scale as a multiply by the row's reciprocal and
    an fma correction (`bits.quotient`: the same bits as a division). A division is ~20
    instructions on a GPU, once for each of a thread's 16 values before; now each row has
    two (its scale, its reciprocal). Where the last axis is contiguous a thread's values share
    a few rows; a strided last axis (the DS conv layout) can give a thread a value of each of
    16 rows, and then a row's two divisions are per value as before."""
    _, specs = compiled
    quant = [s for s in specs if s["op"] == "pack" and s["fmt"] in ("fp8", "int8", "int4")]
    assert quant
    for s in quant:
        divs, values = s["ops"].get("div.rn.f32", 0), s["values_per_thread"]
        assert divs >= 2, (s["labels"][0], s["ops"])  # (the count is read: the scale is a division)
        if s["contig"]:
            assert divs <= values // 2, (s["labels"][0], divs, values)
        else:
            assert divs <= 2 * values, (s["labels"][0], divs, values)


def test_quantizing_packs_test_and_convert_rows_not_values(compiled):
    """What a quantizing pack does per value, besides its arithmetic, is gone: a group's
    largest magnitude and whether it is finite come from an integer max of the values'
    magnitude bits (`bits.magnitude_bits`: no float abs, no compare against inf per value),
    int8 and int4 codes are the low bits of the rounding add (`bits.rne_bits`: no
    float-to-integer convert), and the quotient keeps a zero's sign without a test. So no
    `abs.f32` nor `cvt.rzi.s32.f32`, and float compares per row: at most one a value (fp8 and
    int8: 3 for 16 values), int4's at most four for each of a thread's rows, which a strided last
    axis (the DS conv layout) makes one a value. Before: 2.25 compares a value (fp8), 4.25
    (int8), 6.5 to 12 (int4)."""
    _, specs = compiled
    quant = [s for s in specs if s["op"] == "pack" and s["fmt"] in ("fp8", "int8", "int4")]
    for s in quant:
        ops, label, values = s["ops"], s["labels"][0], s["values_per_thread"]
        assert not ops.get("abs.f32") and not ops.get("cvt.rzi.s32.f32"), (label, ops)
        bound = 4 * values if s["fmt"] == "int4" and not s["contig"] else values
        assert ops.get("setp.f32", 0) <= bound, (label, ops.get("setp.f32"), values)


def test_direct_launches_pass_the_jit_argument_list(compiled):
    """For every specialization, a `kernels.launch.Launcher` names every kernel parameter, and
    its list (`arg_names` order) is the one triton's binder makes for `JITFunction.run`; only
    launch options are left out of it."""
    _, specs = compiled
    for s in specs:
        want = {"binder_order": True, "same_values": True, "unnamed": [],
                "options": ["enable_fp_fusion", "num_warps"]}
        assert s["launcher_args"] == want, (s["labels"][0], s["launcher_args"])


def test_compiled_variants_do_not_grow_with_requests():
    """60 requests of 1 to 131072 tokens (1 to 69 MLA blocks, random block ids) compile no more
    variants than one request: block counts and table widths are not specialized, nor a set
    kernel's per-plan values (its per-launch START_k, N_k, RCP_k, TAB_k, PAY_k, SC_k)."""
    proc = _run("--variants", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["stream"] == counts["one_request"], counts
    assert counts["one_request"] <= 12, counts  # 3 fields x 2 codecs x (pack, unpack)
    assert counts["set_stream"] == counts["set_one_request"], counts
    assert counts["set_one_request"] <= 4, counts  # 2 codec sets x (pack, unpack)
