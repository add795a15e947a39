"""Compile every kernel specialization the library launches for sm_90, on a CPU, and scan its PTX.

    python -m tests.kernels.sm90 [--json OUT] [--jobs 2] [--limit N]

Why a separate process: the kernel tests run the kernels in the Triton interpreter
(`TRITON_INTERPRET=1`, read when a kernel is decorated), and an interpreted kernel cannot be
compiled. Here the real launch path (`triton_pack.pack_many` / `triton_unpack.unpack_many`) runs on CPU
tensors laid out like vLLM's cache for each shipped model layout, tp size, codec, group size and
dtype; the launch itself is replaced by a recorder, and each distinct specialization (Triton's
own binder decides what is distinct) is compiled for `GPUTarget("cuda", 90, 32)` with the ptxas
inside the triton wheel. The result per specialization: the global loads and stores of its
PTX, by width.

The check (see `check`): where the host could prove 16-byte alignment of a contiguous last
axis (ALIGN == 16 bytes / itemsize), the bulk data path uses 16-byte vector accesses: every
global load of the source (pack) or payload (unpack) and every store of the payload (pack) or
target (unpack) is 16 bytes wide; only item-table (b64) and scale (b32) accesses may be narrow.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter
from concurrent.futures import ProcessPoolExecutor

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

from anchorkv.codec import KIMI_LINEAR_48B_CONFIG, CodecSpec, kimi_linear_layout  # noqa: E402
from anchorkv.kernels import PackItem, UnpackItem  # noqa: E402
from anchorkv.kernels.batch import field_cut  # noqa: E402
from anchorkv.kernels.quant import Quant, payload_nbytes  # noqa: E402

TP_SIZES = (1, 2, 4, 8)
#: Group sizes the store holds per field (conv: divisors of the 512-channel chunk; latent: of 576).
GROUPS = {"conv": (32, 64, 128, 512), "recurrent": (32, 64, 128), "latent": (32, 64, 192, None)}
FORMATS = (Quant.FP8, Quant.INT8, Quant.INT4)
_MEM = re.compile(r"\b(ld|st)\.global((?:\.[A-Za-z0-9_:]+)*?)(?:\.v(\d))?\.([bfsu])(\d+)\b")
#: PTX instructions counted per specialization (`ops`): 64-bit integer division and remainder (a
#: called routine of dozens of instructions on a GPU, which has no integer divider) and the
#: hardware converts the kernels use on sm_89+ (fp8 encode and decode, fp32 -> bf16), fp32
#: divisions (one per row and scale, not per value: `bits.quotient`), and what a quantizing
#: pack no longer does per value: float-to-integer converts (`bits.rne_bits`), float absolute
#: values and compares (`bits.magnitude_bits`, the quotient's signed zero), counted as
#: `setp.f32` whatever the comparison.
_OPS = re.compile(r"\b(?:(?:div|rem)\.[su]64|cvt\.rn\.satfinite\.e4m3x2\.f32|cvt\.rn\.f16x2\.e4m3x2"
                  r"|cvt\.rn\.bf16(?:x2)?\.f32|div\.rn\.f32|cvt\.rzi\.s32\.f32|abs\.f32|setp\.[a-z]+\.f32)\b")


def _layouts():
    for tp in TP_SIZES:
        for conv_layout in ("SD", "DS"):
            for dtype in (torch.bfloat16, torch.float16):
                for state_dtype in (torch.float32, torch.bfloat16):
                    yield (f"kimi-linear tp={tp} conv={conv_layout} {str(dtype)[6:]}/"
                           f"{str(state_dtype)[6:]}",
                           kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=tp,
                                              conv_layout=conv_layout, dtype=dtype,
                                              state_dtype=state_dtype))


def _items():
    """(label, PackItem, UnpackItem) for every field x codec of every shipped layout."""
    for name, layout in _layouts():
        fields = {}
        for layer in layout.layers:
            for f in layer.page.fields:
                fields.setdefault(f.name, (layer.kind, f, layer.page.page_bytes))
        for fname, (kind, f, page) in fields.items():
            strided = f.strided(page)
            blocks = 8
            buf = torch.empty(blocks * page, dtype=torch.uint8)
            ids = [3] if str(kind) == "state" else [5, 1, 6, 2]
            codecs = [(Quant.RAW, None), (Quant.BF16, None)] + [(q, g) for q in FORMATS for g in GROUPS[fname]
                                           if g is None or f.shape[-1] % g == 0]
            for fmt, group in codecs:
                if fmt is Quant.INT4 and group is not None and group % 2:
                    continue
                label = f"{name} {fname} {fmt}:{group or 'whole'}"
                spec = CodecSpec(fmt.value, group)
                pack = PackItem(buf, strided, ids, blocks, spec)
                g = field_cut(strided, spec)
                payload = torch.empty(len(ids) * payload_nbytes(fmt, g.numel, g.itemsize),
                                      dtype=torch.uint8)
                scales = torch.empty(len(ids) * g.groups, g.columns, dtype=torch.float32)
                unpack = UnpackItem(buf, strided, ids, blocks, spec, payload, scales)
                yield label, pack, unpack


class _Recorder:
    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda **kwargs: self.calls.append(kwargs)


class _Specializer:
    """Triton's own binder for `kernels` ({op: JIT function}) at sm_90: what the JIT would
    compile for a recorded launch's keyword arguments, one entry per distinct specialization."""

    def __init__(self, kernels: dict) -> None:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature

        self.kernels = kernels
        self.backend = make_backend(GPUTarget("cuda", 90, 32))
        self.binders = {k: create_function_from_signature(fn.signature, fn.params, self.backend)
                        for k, fn in kernels.items()}
        self.found: dict[str, dict] = {}

    def entry(self, op: str, kwargs: dict, label: str, **new) -> dict:
        """The entry of `op`'s specialization for `kwargs` (made with `new` the first time),
        `label` added; its compile arguments and `launcher_args` set."""
        bound, spec, options = self.binders[op](**kwargs)
        opts, signature, constexprs, attrs = self.kernels[op]._pack_args(self.backend, kwargs, bound, spec, options)
        key = repr((op, sorted(signature.items()), sorted(constexprs.items()), sorted(attrs.items()),
                    sorted(opts.__dict__.items())))
        entry = self.found.setdefault(key, {"op": op, "labels": [], "key": key,
                                            "constexprs": {str(k): v for k, v in constexprs.items()}, **new})
        entry["labels"].append(label)
        entry["_compile"] = (signature, constexprs, attrs, opts.__dict__)
        entry["launcher_args"] = launcher_args(self.kernels[op], bound, kwargs)
        return entry

    def entries(self) -> list[dict]:
        return list(self.found.values())


def specializations(items=None) -> list[dict]:
    """Every distinct (kernel, specialization) the launch path produces, with its labels."""
    from anchorkv.kernels import batch, triton_pack, triton_unpack

    kernels = {"pack": triton_pack._pack_kernel, "unpack": triton_unpack._unpack_kernel}
    seen = _Specializer(kernels)
    for label, pack, unpack in (_items() if items is None else items):
        for op, module, plan_args in (("pack", triton_pack, [pack]),
                                      ("unpack", triton_unpack, [unpack])):
            rec = _Recorder()
            setattr(module, f"_{op}_kernel", rec)
            # the launch path on CPU tensors, as it runs for a GPU of the target's capability
            hardware_fp8, batch.hardware_fp8 = batch.hardware_fp8, lambda device: True
            try:  # the public launch path, end to end, with the recorder as the kernel
                getattr(module, f"{op}_many")(plan_args)
            finally:
                setattr(module, f"_{op}_kernel", kernels[op])
                batch.hardware_fp8 = hardware_fp8
            (kwargs,) = rec.calls
            entry = seen.entry(op, kwargs, label)
            entry["align"] = kwargs.get("ALIGN", 1)
            entry["itemsize"] = torch.tensor([], dtype=pack.field.dtype).element_size()
            entry["fmt"] = pack.spec.id
            entry["dtype"] = str(pack.field.dtype).removeprefix("torch.")
            entry["flat"] = bool(kwargs["FLAT"])
            entry["contig"] = bool(kwargs["CONTIG"])
            entry["in_align"] = kwargs.get("IN_ALIGN")
            entry["values_per_thread"] = kwargs["BLOCK_R"] * kwargs["BLOCK_G"] // (32 * kwargs["num_warps"])
    return seen.entries()


def launcher_args(kernel, bound, kwargs: dict) -> dict:
    """What a `kernels.launch.Launcher` passes the compiled kernel (every parameter by name, in
    `arg_names` order) against what `JITFunction.run` passes (the binder's list `bound`)."""
    names = kernel.arg_names
    return {"binder_order": list(bound) == list(names),
            "same_values": all(bound[n] is kwargs[n] for n in names if n in kwargs),
            "unnamed": [n for n in names if n not in kwargs],
            "options": sorted(set(kwargs) - set(names))}


def _request_region():
    """(layout, blocks, region, {field name: (layer kind, strided field)}) of the tp=1
    Kimi-Linear requests of `request_stream` and `request_sets`: 80 blocks of one region."""
    layout = kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=1)
    page = layout.layers[0].page.page_bytes
    blocks = 80
    fields = {}
    for layer in layout.layers:
        for f in layer.page.fields:
            fields.setdefault(f.name, (str(layer.kind), f.strided(page)))
    return layout, blocks, torch.empty(blocks * page, dtype=torch.uint8), fields


def request_stream(count: int = 60, seed: int = 0):
    """(label, PackItem, UnpackItem) of `count` realistic requests at tp=1: prompts of 1 to
    131072 tokens (1 to 69 MLA blocks of 1920 tokens), random block ids, the exact default
    (raw) and one lossy codec per field."""
    import random

    rng = random.Random(seed)
    layout, blocks, buf, fields = _request_region()
    for r in range(count):
        tokens = rng.randint(1, 131072)
        n = -(-tokens // layout.block_size)
        for fname, (kind, field) in fields.items():
            ids = [rng.randrange(blocks)] if kind == "state" else rng.sample(range(blocks), n)
            for fmt, group in ((Quant.RAW, None), (Quant.FP8, 64 if fname == "latent" else 128)):
                spec = CodecSpec(fmt.value, group)
                g = field_cut(field, spec)
                payload = torch.empty(len(ids) * payload_nbytes(fmt, g.numel, g.itemsize),
                                      dtype=torch.uint8)
                scales = torch.empty(len(ids) * g.groups, g.columns, dtype=torch.float32)
                yield (f"request {r} ({tokens} tokens) {fname} {fmt}",
                       PackItem(buf, field, ids, blocks, spec),
                       UnpackItem(buf, field, ids, blocks, spec, payload, scales))


#: Per field, the group a set's codec takes in `set_cases` (the connector's defaults).
SET_GROUPS = {"conv": 128, "recurrent": 128, "latent": 64}


def set_cases():
    """(label, targets, slots, ids) of a `PackSet` / `UnpackSet` of one target per field of
    every shipped layout (state fields in slot 0, the latent in slot 1, as the connector's
    KV-cache groups), for each codec a connector applies to every field (raw, bf16, fp8, int8,
    int4) and its default lossy set (latent fp8:64, recurrent and conv int8:128); at tp=1 also a
    set of two codecs a field (6 launches in one set kernel)."""
    from anchorkv.kernels import PackTarget

    for name, layout in _layouts():
        fields = {}
        for layer in layout.layers:
            for f in layer.page.fields:
                fields.setdefault(f.name, (str(layer.kind), f, layer.page.page_bytes))
        combos = {q: {f: f"{q}:{SET_GROUPS[f]}" if q in ("fp8", "int8", "int4") else q for f in fields}
                  for q in ("raw", "bf16", "fp8", "int8", "int4")}
        combos["default"] = {"latent": "fp8:64", "recurrent": "int8:128", "conv": "int8:128"}
        if "tp=1 " in name:  # two codecs a field (layers configured apart): 6 launches in one kernel
            combos["mixed"] = {"latent": ("fp8:64", "int4:64"), "recurrent": ("int8:128", "raw"),
                               "conv": ("bf16", "int8:128")}
        for combo, codecs in combos.items():
            targets, slots = [], []
            for fname, (kind, f, page) in fields.items():
                buf = torch.empty(8 * page, dtype=torch.uint8)
                for codec in (codecs[fname],) if isinstance(codecs[fname], str) else codecs[fname]:
                    targets.append(PackTarget(buf, f.strided(page), 8, CodecSpec.parse(codec)))
                    slots.append(0 if kind == "state" else 1)
            yield f"{name} set {combo}", targets, slots, [[3], [5, 1, 6, 2]]


def set_specializations(cases=None) -> list[dict]:
    """Every distinct specialization of the set kernels (`_pack_set_kernel`,
    `_unpack_set_kernel`) that `PackSet.pack` / `UnpackSet.unpack` launch for `cases`
    (default `set_cases`), with its labels and its launches' formats and alignment claims."""
    from anchorkv.kernels import PackedBatch, PackSet, UnpackSet, batch, packset, triton_pack, triton_unpack

    kernels = {"pack_set": triton_pack._pack_set_kernel, "unpack_set": triton_unpack._unpack_set_kernel}
    seen = _Specializer(kernels)
    # the launch path on CPU tensors, as it runs for a GPU of the target's capability (a set
    # picks its backend when made: Triton's, which on a CPU would need the interpreter)
    hardware_fp8, batch.hardware_fp8 = batch.hardware_fp8, lambda device: True
    backend_for, packset.backend_for = packset.backend_for, lambda device: "triton"
    try:
        for label, targets, slots, ids in (set_cases() if cases is None else cases):
            for op, module in (("pack_set", triton_pack), ("unpack_set", triton_unpack)):
                rec = _Recorder()
                setattr(module, f"_{op}_kernel", rec)
                try:
                    if op == "pack_set":
                        PackSet(targets, slots).pack(ids)
                    else:
                        us = UnpackSet(targets, slots)
                        layout = us.layout([len(i) for i in ids])
                        us.unpack(PackedBatch(torch.empty(layout.payload_bytes, dtype=torch.uint8),
                                              torch.empty(layout.scale_values, dtype=torch.float32),
                                              layout.spans, layout.scale_runs), ids)
                finally:
                    setattr(module, f"_{op}_kernel", kernels[op])
                (kwargs,) = rec.calls
                entry = seen.entry(op, kwargs, label, fmt="set")
                anchors = kwargs["srcs" if op == "pack_set" else "dsts"]
                entry["parts"] = [{"fmt": next(k for k, v in batch.FMT_CODE.items() if v == cfg[10]).value,
                                   "align": cfg[16], "itemsize": t.element_size(), "contig": bool(cfg[15])}
                                  for cfg, t in zip(kwargs["CFG"], anchors, strict=True)]
    finally:
        batch.hardware_fp8 = hardware_fp8
        packset.backend_for = backend_for
    return seen.entries()


def request_sets(count: int = 60, seed: int = 0):
    """(label, targets, slots, ids) of `count` realistic requests at tp=1 (as `request_stream`:
    1 to 69 MLA blocks, random ids), one set of the three fields per request, raw and the
    default lossy set."""
    import random

    from anchorkv.kernels import PackTarget

    rng = random.Random(seed)
    layout, blocks, buf, fields = _request_region()
    for r in range(count):
        n = -(-rng.randint(1, 131072) // layout.block_size)
        ids = [[rng.randrange(blocks)], rng.sample(range(blocks), n)]
        for combo in ("raw", "default"):
            targets = [PackTarget(buf, field, blocks, CodecSpec.parse(
                "raw" if combo == "raw" else {"latent": "fp8:64"}.get(fname, "int8:128")))
                for fname, (_, field) in fields.items()]
            yield (f"request {r} set {combo}", targets, [0 if k == "state" else 1 for k, _ in fields.values()],
                   ids)


def _ptx_only(src, options: dict) -> str:
    """Triton's pipeline for sm_90 up to PTX, without ptxas (the PTX is what is scanned; this
    halves the time of a CI run). Mirrors `triton.compile`'s stage loop."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.compiler.compiler import Language

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    opts = backend.parse_options(dict(options))
    stages: dict = {}
    backend.add_stages(stages, opts, Language.TRITON)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(target, opts, backend.get_codegen_implementation(opts),
                         backend.get_module_map(), context)
    metadata = {"hash": src.hash(), "target": target, **opts.__dict__}
    names = list(stages)
    for ext in names[names.index("ttir"):]:  # make_ir gives ttir; its stage runs the passes
        module = stages[ext](module, metadata)
        if ext == "ptx":
            return module
    raise RuntimeError("no ptx stage")


def _compile(args) -> dict:
    op, signature, constexprs, attrs, options = args
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from anchorkv.kernels import triton_pack, triton_unpack

    fn = {"pack": triton_pack._pack_kernel, "unpack": triton_unpack._unpack_kernel,
          "pack_set": triton_pack._pack_set_kernel, "unpack_set": triton_unpack._unpack_set_kernel}[op]
    src = ASTSource(fn, signature, constexprs, attrs)
    options = {k: v for k, v in options.items() if k not in ("extern_libs",)}
    try:
        ptx = _ptx_only(src, options)
    except Exception:  # an internal API moved: the full compile gives the same PTX, slower
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    accesses = Counter()
    for m in _MEM.finditer(ptx):
        kind, _, vec, _, bits = m.groups()
        accesses[f"{kind}.v{vec}.b{bits}" if vec else f"{kind}.b{bits}"] += 1
    ops = Counter(re.sub(r"^setp\.[a-z]+", "setp", m.group(0)) for m in _OPS.finditer(ptx))
    return dict(accesses), dict(ops)


def check_set(entry: dict) -> str | None:
    """`check` for a set kernel, whose PTX holds every launch's body: where every launch's
    source is contiguous and claims 16-byte rows, the cache side has 16-byte accesses and the
    payload side vector ones, and every narrow access is one some launch may make (its item
    table, its scales, int4's 8-byte payload accesses)."""
    acc = entry["accesses"]
    parts = entry["parts"]
    if not all(p["contig"] and p["align"] * p["itemsize"] >= 16 for p in parts):
        return None
    wide = {"ld.v4.b32", "st.v4.b32", "ld.v2.b64", "st.v2.b64"}
    cache, payload = ("ld", "st") if entry["op"] == "pack_set" else ("st", "ld")
    allowed = set(wide) | {"ld.b64"}
    for p in parts:
        if p["fmt"] == "int4":
            allowed.add(f"{payload}.v2.b32")
        if p["fmt"] not in ("raw", "bf16"):
            allowed.add("ld.b32" if entry["op"] == "unpack_set" else "st.b32")
    problems = []
    if not any(k in wide for k in acc if k.startswith(cache)):
        problems.append(f"no 16-byte {cache} on the cache side")
    if not any(k in allowed - {"ld.b64", "ld.b32", "st.b32"} for k in acc if k.startswith(payload)):
        problems.append(f"no vector {payload} on the payload side")
    bad = {k: v for k, v in acc.items() if k not in allowed}
    if bad:
        problems.append(f"narrow data accesses {bad}")
    return f"{'; '.join(problems)} (all: {acc})" if problems else None


def check(entry: dict) -> str | None:
    """None if the PTX meets the rule of the module docstring, else why not.

    The cache side (pack: loads of the source; unpack: stores of the target) must be 16 bytes
    wide; so must the payload side, except int4, whose codes are a quarter (bf16/fp16) or an
    eighth (fp32) of the source bytes: 8-byte payload accesses there. Narrow accesses allowed:
    the item table (`ld.b64`) and the per-group scales (`b32`).
    """
    acc = entry["accesses"]
    if not entry["contig"] or entry["align"] * entry["itemsize"] < 16:
        return None  # no alignment claim: scalar accesses are expected
    wide = {"ld.v4.b32", "st.v4.b32", "ld.v2.b64", "st.v2.b64"}
    cache, payload = ("ld", "st") if entry["op"] == "pack" else ("st", "ld")
    payload_ok = set(wide)
    if entry["fmt"] == "int4":
        payload_ok |= {f"{payload}.v2.b32"}
    allowed = {"ld.b64"}  # the item table
    if entry["fmt"] not in ("raw", "bf16"):  # scales: loaded (unpack) or stored (pack) once per group
        allowed.add("ld.b32" if entry["op"] == "unpack" else "st.b32")
    problems = []
    if not any(k in wide for k in acc if k.startswith(cache)):
        problems.append(f"no 16-byte {cache} on the cache side")
    if not any(k in payload_ok for k in acc if k.startswith(payload)):
        problems.append(f"no vector {payload} on the payload side")
    bad = {k: v for k, v in acc.items() if k not in wide | payload_ok | allowed}
    if bad:
        problems.append(f"narrow data accesses {bad}")
    return f"{'; '.join(problems)} (all: {acc})" if problems else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--limit", type=int, default=0, help="compile only the first N (debugging)")
    ap.add_argument("--match", default="", help="only specializations whose label contains this")
    ap.add_argument("--no-sets", action="store_true", help="skip the set kernels")
    ap.add_argument("--variants", action="store_true",
                    help="only count the distinct specializations over a stream of requests")
    args = ap.parse_args(argv)
    if args.variants:
        stream = specializations(request_stream())
        one = specializations(request_stream(count=1))
        sets = set_specializations(request_sets())
        one_set = set_specializations(request_sets(count=1))
        print(json.dumps({"stream": len(stream), "one_request": len(one), "set_stream": len(sets),
                          "set_one_request": len(one_set)}))
        return 0
    specs = specializations(x for x in _items() if args.match in x[0])
    if not args.no_sets:
        specs += set_specializations(x for x in set_cases() if args.match in x[0])
    if args.limit:
        specs = specs[: args.limit]
    work = [(s["op"], *s.pop("_compile")) for s in specs]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for s, (acc, ops) in zip(specs, pool.map(_compile, work), strict=True):
            s["accesses"], s["ops"] = acc, ops
            s["problem"] = check_set(s) if s["op"].endswith("_set") else check(s)
    failed = [s for s in specs if s["problem"]]
    for s in specs:
        align = s.get("align", [p["align"] for p in s.get("parts", ())])
        print(f"{'FAIL' if s['problem'] else 'ok  '} {s['op']:6} {s['labels'][0]} "
              f"(+{len(s['labels']) - 1}) align={align} {s['accesses']}"
              + (f"\n     {s['problem']}" if s["problem"] else ""))
    print(f"{len(specs)} specializations compiled for sm_90, {len(failed)} failed the vector check")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in s.items() if k != "key"} for s in specs], f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
