"""Launching a compiled Triton kernel again without the JIT's per-call work.

`kernel[grid](**kwargs)` costs the host ~28 us a launch on an H100 (triton 3.6, stop 19's
profile), most of it in `JITFunction.run`: binding the arguments, computing each one's
specialization (dtype, 16-byte alignment, integer divisibility), hashing them into a cache
key, looking the compiled kernel up. A connector launches the same few configurations every
step, where only the item table, payload and scales pointers change. A `Launcher` holds one
such configuration (its grid and the arguments that never change) and launches it through the
JIT once per *specialization key* of the arguments that change (each tensor's dtype, device and
16-byte alignment, every other value itself), keeping the compiled kernel the JIT returns;
later calls with the same key go straight to that kernel's launcher (`CompiledKernel[grid]`:
the C launcher, binary and argument list the JIT would use), so they run the same code on the
same bytes.

What keeps it correct: every argument the JIT specializes on is either fixed in the launcher
or part of the key; a kernel runs on the device it was compiled and loaded for (another current
device goes through the JIT); the argument list follows the kernel's parameter order
(`JITFunction.arg_names`, constexprs included, as `JITFunction.run` passes them: checked in the
installed triton's sources, `triton_passes_every_argument`); an error from a direct call turns
direct launches off for the process and the call goes through the JIT. Off under the
interpreter (which returns no compiled kernel) and with `ANCHORKV_DIRECT_LAUNCH=0`.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

log = logging.getLogger(__name__)

#: Direct launches made and JIT launches made, since the process started (tests, profiles).
counts = {"direct": 0, "jit": 0}


def enabled() -> bool:
    """Whether launchers may launch compiled kernels directly (read at each first launch)."""
    if os.environ.get("ANCHORKV_DIRECT_LAUNCH", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if os.environ.get("TRITON_INTERPRET", "0").strip() not in ("", "0"):
        return False
    return triton_passes_every_argument()


@functools.cache
def triton_passes_every_argument() -> bool:
    """Whether the installed triton launches as `Launcher` assumes: `JITFunction.run` hands
    the compiled kernel's launcher every bound argument in parameter order (constexprs
    included; triton 3.6 and 3.9 do, some older ones passed only the others), and
    `CompiledKernel[grid]` forwards its arguments to the same launcher unchanged (it reads all three
    grid axes, so a `Launcher` keeps its grid padded to three). Read from
    the installed sources, so a triton that launches otherwise keeps every launch on the JIT."""
    try:
        from triton.compiler.compiler import CompiledKernel
        from triton.runtime.jit import JITFunction

        run = inspect.getsource(JITFunction.run)
        runner = inspect.getsource(CompiledKernel.__getitem__)
    except Exception:  # no sources, or the names moved
        return False
    return "*bound_args.values())" in run and "launch_exit_hook, *args)" in runner


@functools.cache
def runner_takes_stream() -> bool:
    """Whether `CompiledKernel[grid]`'s runner takes the stream to launch on (`stream=None`:
    triton 3.6 and 3.9; without it the runner asks torch for the current device and its
    current stream at every launch). Read from the installed sources, like
    `triton_passes_every_argument`."""
    try:
        from triton.compiler.compiler import CompiledKernel

        return "def runner(*args, stream=None)" in inspect.getsource(CompiledKernel.__getitem__)
    except Exception:
        return False


@functools.cache
def runner_only_forwards() -> bool:
    """Whether `CompiledKernel[grid]`'s runner only forwards to the driver's launcher: it asks
    `launch_metadata` (which reads nothing but the launch hooks' state for what a hook would
    see) and calls `self.run(grid[0], grid[1], grid[2], stream, self.function,
    self.packed_metadata, launch_metadata, <enter hook>, <exit hook>, *args)` (triton 3.6 and
    3.9), hooks read from `triton.knobs.runtime`. Then a direct launch with no launch hook set
    calls `run` itself with None for the metadata and both hooks (what the C launcher does with
    them: nothing), skipping the runner's and `launch_metadata`'s Python (triton 3.9 builds a
    metadata dict at every launch whether a hook is set or not: its hooks are chains, never
    None). Read from the installed sources like `triton_passes_every_argument`."""
    try:
        from triton.compiler.compiler import CompiledKernel

        runner = " ".join(inspect.getsource(CompiledKernel.__getitem__).split())
    except Exception:
        return False
    return ("self.run(grid[0], grid[1], grid[2], stream, self.function, self.packed_metadata, launch_metadata, "
            "knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *args)") in runner


def hooks_idle() -> bool:
    """Whether no launch hook is set (`triton.knobs.runtime`'s enter and exit hooks None, or
    chains of no hook: triton 3.9). Read at every direct launch: a profiler (proton) may set
    one at any time, and then the runner launches, hooks and all."""
    global _runtime
    if _runtime is None:
        from triton import knobs

        _runtime = knobs.runtime
    return _idle(_runtime.launch_enter_hook) and _idle(_runtime.launch_exit_hook)


_runtime: Any = None  # triton.knobs.runtime, once imported


def _idle(hook: Any) -> bool:
    return hook is None or (type(hook).__name__ == "HookChain" and not hook.calls)


def launch_site() -> tuple[int, int]:
    """(the current CUDA device, the raw handle of its current stream): what a direct launch
    would ask torch for, asked once for all the launches of a call (`launcher(kernel, _at=launch_site(), ...)`).
    The handle is the one triton's own runner takes (`torch._C._cuda_getCurrentRawStream`)."""
    device = torch.cuda.current_device()
    return device, torch._C._cuda_getCurrentRawStream(device)


#: Whether `on_stream` switches streams with torch's C calls (False: `torch.cuda.stream`, the
#: path before; benchmarks flip it to compare the two in one run).
LEAN_STREAMS = True


@functools.cache
def _stream_calls() -> tuple[Callable, Callable, Callable] | None:
    """torch's C calls behind `torch.cuda.current_device`, `current_stream` and `set_stream`
    (`_cuda_getDevice`, `_cuda_getCurrentStream`, `_cuda_setStream`: a CUDA build's), or None."""
    names = ("_cuda_getDevice", "_cuda_getCurrentStream", "_cuda_setStream")
    calls = tuple(getattr(torch._C, n, None) for n in names)
    return calls if all(calls) else None  # type: ignore[return-value]


class on_stream:
    """`with torch.cuda.stream(stream):` in four C calls: the current device, its current
    stream (kept), the switch, and the switch back on exit (also on an error). What
    `torch.cuda.stream` does for a stream on the current device, without its Python (a
    device lookup, a `Stream` object built for the current stream, two `device` comparisons;
    a save switches twice, on the step's thread). A stream on another device than the
    current one, a torch without the C calls, or `LEAN_STREAMS` off: `torch.cuda.stream`
    itself. One thread, not re-entered."""

    __slots__ = ("stream", "prev", "ctx")

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.prev: tuple[int, int, int] | None = None
        self.ctx: Any = None

    def __enter__(self) -> Any:
        s = self.stream
        calls = _stream_calls() if LEAN_STREAMS else None
        if calls is not None and calls[0]() == s.device_index:
            self.prev = calls[1](s.device_index)
            calls[2](stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)
        else:
            self.ctx = torch.cuda.stream(s)
            self.ctx.__enter__()
        return s

    def __exit__(self, *exc: Any) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(*exc)
            return
        prev, calls = self.prev, _stream_calls()
        assert prev is not None and calls is not None  # (set by __enter__)
        calls[2](stream_id=prev[0], device_index=prev[1], device_type=prev[2])


class Streams:
    """The current stream of a device as a `torch.cuda.Stream`, one object kept per (device,
    raw handle): `current(device)` asks torch for the handle (one C call, `launch_site`'s)
    instead of building a new `Stream` (`torch.cuda.current_stream`: ~4.5 us of an H200 host's
    time, `benchmarks.launch_variants`); `of(device, handle)` for a handle the caller has
    (a launch site's). On one device a handle names one CUDA stream whichever object stands
    for it; across devices it does not (every device's default stream is handle 0), hence the
    device in the key. An object is made for a handle while that handle's stream is current
    (one thread). `current` and `handle` stand for torch's calls in tests."""

    def __init__(self, current: Callable[[int], Any] | None = None,
                 handle: Callable[[int], int] | None = None) -> None:
        self.known: dict[tuple[int, int], Any] = {}
        self._current = current or torch.cuda.current_stream
        self._handle = handle or (lambda device: torch._C._cuda_getCurrentRawStream(device))

    def current(self, device: int) -> Any:
        return self.of(device, self._handle(device))

    def of(self, device: int, handle: int, make: Callable[[], Any] | None = None) -> Any:
        """The stream object kept for `handle` on `device`, the current stream there; a new
        one (`make()`, else the current stream's) the first time."""
        key = (device, handle)
        s = self.known.get(key)
        if s is None:
            s = self.known[key] = make() if make is not None else self._current(device)
        return s


_disabled = False  # set when a direct launch failed: the JIT takes every launch after it


class Launcher:
    """Launches of a kernel on `grid` with the keyword arguments `fixed` (launch options such as
    `num_warps` included) plus, per call, the ones that change.

    `launcher(kernel, **changing)` equals `kernel[grid](**fixed, **changing)`; `changing` must
    name the same arguments at every call (tensors and/or plain values). Only a real
    `triton.jit` function is launched directly: a stand-in (a test's counting wrapper, a
    benchmark's no-op) is called every time. `_at` (`launch_site()`, the same for a call's
    launches: the current device and its current stream) saves a direct launch asking for them.

    A direct launch passes each tensor as its address (`data_ptr()`, the fixed ones' taken
    once): the C launcher then neither calls `data_ptr()` nor asks the driver whether the
    pointer is a device's (`cuPointerGetAttribute`), a check the JIT's first launch of the same
    key (tensor, dtype, device and alignment) has made. `direct` launches with addresses the
    caller computed, under a key it kept (`key_of`): no tensor at all on the call's path.
    """

    __slots__ = ("grid", "fixed", "kernel", "compiled", "device", "template", "at", "address_key")

    def __init__(self, grid: tuple[int, ...], fixed: Mapping[str, Any]) -> None:
        if not 1 <= len(grid) <= 3:
            raise ValueError(f"a launch grid has 1 to 3 axes, found {grid!r}")
        # three axes, as `JITFunction.run` pads a grid before launching: `CompiledKernel[grid]`
        # reads grid[0], grid[1] and grid[2] as they are (a 2-axis grid raised IndexError there)
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.fixed = dict(fixed)
        self.kernel: Any = None  # the JIT function whose compiled kernels `compiled` holds
        #: specialization key -> its kernel's launch (`_direct_call`: (args, stream) -> None)
        self.compiled: dict[tuple, Callable[[list, int | None], None]] = {}
        self.device: int | None = None
        # the argument list in `kernel.arg_names` order with the fixed values in place (tensors
        # as their addresses), and the index of each changing argument in it (filled in at the
        # first kept kernel)
        self.template: list[Any] = []
        self.at: dict[str, int] = {}
        #: the key of the first `by_address` launch through the JIT (its later calls' key)
        self.address_key: tuple | None = None

    def __call__(self, kernel: Any, _at: tuple[int, int] | None = None, **changing: Any) -> None:
        key = None
        if kernel is self.kernel and not _disabled:  # (no key to compute for other kernels)
            key, values = _key_and_values(changing)
            launch = self.compiled.get(key)
            if launch is not None and self._launch(launch, _at, values):
                return
            if launch is not None:
                key = None  # another current device or other names: the JIT's launch, nothing kept
        compiled = kernel[self.grid](**self.fixed, **changing)
        counts["jit"] += 1
        if compiled is not None and not _disabled and (key is None or key not in self.compiled):
            self._keep(kernel, key, changing, compiled)

    def direct(self, kernel: Any, key: tuple, _at: tuple[int, int] | None = None, **values: Any) -> bool:
        """Launch `kernel` as kept under `key` (`key_of` of the tensors these `values` stand
        for: the same dtypes, devices and alignments) with `values` (tensors given as their
        addresses); False, launching nothing, when `kernel` is not the kept one (a stand-in), none
        is kept for the key, direct launches are off, or another device is current: then the
        caller launches through `__call__`."""
        return self._direct(kernel, key, _at, values)

    def _direct(self, kernel: Any, key: tuple, at: tuple[int, int] | None, values: Mapping[str, Any]) -> bool:
        if kernel is not self.kernel or _disabled:
            return False
        launch = self.compiled.get(key)
        return launch is not None and self._launch(launch, at, values)

    def by_address(self, kernel: Any, site: tuple[int, int] | None, tensors: Callable[[], dict[str, Any]],
                   **addresses: int) -> None:
        """Launch `kernel` with the changing arguments given as `addresses` (ints), under the key
        of this method's first launch through the JIT (`address_key`): no tensor, no key to
        compute on the call's path (what a set plan's calls do, the same arguments every call).
        The call goes through `__call__` with `tensors()` (the tensors those addresses stand
        for, made only then) at the first call, without a launch site, when an address is off
        16 bytes (the key holds each tensor's 16-byte alignment as at that launch), or when the
        direct launch is refused (`direct`)."""
        key = self.address_key
        if key is not None and site is not None:
            bits = 0
            for a in addresses.values():  # (a loop: cheaper than `any` over a generator here)
                bits |= a
            if not bits & 15 and self._direct(kernel, key, site, addresses):
                return
        changing = tensors()
        self(kernel, _at=site, **changing)
        if key is None and site is not None:
            self.address_key = key_of(changing)

    def _launch(self, launch: Callable[[list, int | None], None], at: tuple[int, int] | None,
                values: Mapping[str, Any]) -> bool:
        args = self._args(values)
        if args is None:
            return False
        site: tuple[int, int | None] = at if at is not None else (torch.cuda.current_device(), None)
        if site[0] != self.device:
            return False
        try:
            launch(args, site[1] if runner_takes_stream() else None)
        except Exception as e:  # never twice: the JIT launches from now on
            _turn_off(e)
            return False
        counts["direct"] += 1
        return True

    def _args(self, changing: Mapping[str, Any]) -> list | None:
        """The argument list of a direct launch: the template with `changing` in place; None if
        `changing` names other arguments than the first kept launch did."""
        if len(changing) != len(self.at):
            return None
        args = self.template.copy()
        at = self.at
        for name, value in changing.items():
            i = at.get(name)
            if i is None:
                return None
            args[i] = value
        return args

    def _keep(self, kernel: Any, key: tuple | None, changing: dict, compiled: Any) -> None:
        """Keep the kernel the JIT just compiled for these arguments, if it may be launched
        directly: a real JIT function, the launcher's first kernel and device."""
        if not _is_jit(kernel) or not enabled():
            return
        device = torch.cuda.current_device()
        if self.kernel is not None and (kernel is not self.kernel or device != self.device):
            return  # one kernel and one device per launcher: the first ones
        if hasattr(compiled, "result"):  # a future under asynchronous compilation
            compiled = compiled.result()
        names = tuple(kernel.arg_names)
        if any(n not in self.fixed and n not in changing for n in names) or any(n not in names for n in changing):
            return  # an argument left to its default, or not the kernel's: the JIT binds those
        if key is None:
            key = key_of(changing)
        if self.kernel is None:
            self.kernel, self.device = kernel, device
            self.template = [_address(self.fixed[n]) if n in self.fixed else None for n in names]
            self.at = {n: i for i, n in enumerate(names) if n not in self.fixed}
        self.compiled[key] = _direct_call(compiled, self.grid)


def key_of(changing: Mapping[str, Any]) -> tuple:
    """The specialization key of a launch's changing arguments (`Launcher`)."""
    return _key_and_values(changing)[0]


def _key_and_values(changing: Mapping[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """(the key: what the JIT specializes each changing argument on, a tensor's dtype, device
    and 16-byte alignment, a plain value itself; the values a direct launch passes, a tensor's
    address for the tensor)."""
    key: list[tuple] = []
    values = {}
    for name, value in changing.items():
        if isinstance(value, torch.Tensor):
            ptr = value.data_ptr()
            key.append((value.dtype, value.get_device(), ptr % 16 == 0))
            values[name] = ptr
        else:
            key.append((type(value), value))
            values[name] = value
    return tuple(key), values


def _address(value: Any) -> Any:
    """A fixed argument as a direct launch passes it: a tensor (or a tuple of them) as its
    address (the launcher's `fixed` holds the tensor, so the memory stays), else itself."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr()
    if isinstance(value, tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(v.data_ptr() for v in value)
    return value


def _direct_call(compiled: Any, grid: tuple[int, ...]) -> Callable[[list, int | None], None]:
    """(args, stream) -> None: one launch of `compiled` on `grid`. With the stream given, no
    launch hook set and a runner that only forwards (`runner_only_forwards`), the driver's
    launcher itself (`compiled.run`); else the runner `compiled[grid]` (which asks for the
    current stream when given none)."""
    runner = compiled[grid]  # (loads the kernel)

    def via_runner(args: list, stream: int | None) -> None:
        if stream is None:
            runner(*args)
        else:
            runner(*args, stream=stream)

    run, function, metadata = (getattr(compiled, n, None) for n in ("run", "function", "packed_metadata"))
    if run is None or function is None or not runner_only_forwards():
        return via_runner
    g0, g1, g2 = grid

    def launch(args: list, stream: int | None) -> None:
        if stream is None or not hooks_idle():
            via_runner(args, stream)
        else:
            run(g0, g1, g2, stream, function, metadata, None, None, None, *args)
    return launch


def _is_jit(kernel: Any) -> bool:
    from triton.runtime.jit import JITFunction

    return isinstance(kernel, JITFunction)


def _turn_off(error: Exception) -> None:
    global _disabled
    _disabled = True
    log.warning("anchorkv: a direct Triton launch failed (%s: %s); every launch goes through the "
                "JIT from now on (set ANCHORKV_DIRECT_LAUNCH=0 to skip the attempt)", type(error).__name__, error)
