"""`kernels.launch.Launcher`: after the JIT's first launch of a specialization, later launches go
straight to the compiled kernel with the argument list the JIT would pass; anything that could
change the specialization, the device or the kernel goes through the JIT again.

The direct path needs a GPU to run; here a stand-in compiled kernel records what it is given.
The real kernels' argument lists are checked against triton's own binder for every
specialization in `test_sm90.py::test_direct_launches_pass_the_jit_argument_list`; byte
equality through the direct path on a GPU in
`test_launch_path.py::test_direct_launches_give_the_jit_bytes`.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from anchorkv.kernels import launch

pack_module = importlib.import_module("anchorkv.kernels.triton_pack")


class FakeCompiled:
    """Stands for a `CompiledKernel`: `compiled[grid](*args)` records the positional args. Like
    triton's (3.6 and 3.9), its runner reads grid[0], grid[1] and grid[2] as they are: the JIT
    pads a grid to three axes before launching, a direct launch must too."""

    def __init__(self, log, fail=False, streams=None):
        self.log, self.fail = log, fail
        self.streams = [] if streams is None else streams  # the stream each direct launch was given

    def __getitem__(self, grid):
        def runner(*args, stream=None):
            if self.fail:
                raise TypeError("function takes exactly 9 arguments (7 given)")
            self.log.append(("direct", (grid[0], grid[1], grid[2]), args))
            self.streams.append(stream)
        return runner


class FakeJIT:
    """Stands for a `JITFunction` with parameters a, tab, b, BLOCK (BLOCK a constexpr)."""

    arg_names = ["a", "tab", "b", "BLOCK"]

    def __init__(self, fail=False):
        self.log: list = []
        self.streams: list = []
        self.fail = fail

    def __getitem__(self, grid):
        def jit(**kwargs):
            self.log.append(("jit", grid, kwargs))
            return FakeCompiled(self.log, self.fail, self.streams)
        return jit


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("ANCHORKV_DIRECT_LAUNCH", raising=False)
    monkeypatch.setattr(launch, "_is_jit", lambda kernel: isinstance(kernel, FakeJIT))
    monkeypatch.setattr(launch, "_disabled", False)
    device = {"index": 0}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device["index"])
    return FakeJIT(), device


def _tab(offset=0):
    return torch.zeros(8, dtype=torch.int64)[offset:]


def test_second_launch_goes_direct_with_the_jit_argument_order(fake):
    kernel, _ = fake
    launcher = launch.Launcher((3, 2), {"a": 1, "b": 2.5, "BLOCK": 64, "num_warps": 4})
    t1, t2 = _tab(), _tab(2)  # 16 bytes in: the same alignment
    launcher(kernel, tab=t1)
    launcher(kernel, tab=t2)
    (kind1, grid1, kwargs), (kind2, grid2, args) = kernel.log
    assert (kind1, grid1, kind2, grid2) == ("jit", (3, 2, 1), "direct", (3, 2, 1))
    assert kwargs == {"a": 1, "b": 2.5, "BLOCK": 64, "num_warps": 4, "tab": t1}
    # (a tensor as its address: the JIT's launch of the same key has checked the pointer)
    assert args[0] == 1 and args[1] == t2.data_ptr() and args[2] == 2.5 and args[3] == 64 and len(args) == 4


class FakeJIT2(FakeJIT):
    """A `FakeJIT` with one more parameter, BLOCK2."""

    arg_names = ["a", "tab", "b", "BLOCK", "BLOCK2"]


@pytest.mark.parametrize("change", ["alignment", "value", "dtype", "device", "kernel"])
def test_anything_that_could_respecialize_goes_through_the_jit(fake, change):
    _, device = fake
    kernel = FakeJIT2()
    launcher = launch.Launcher((1,), {"a": 0, "b": 0, "BLOCK": 8})
    launcher(kernel, tab=_tab(), BLOCK2=1)
    other = kernel
    tab, value = _tab(2), 1
    if change == "alignment":
        tab = _tab(1)  # 8 bytes in
    elif change == "value":
        value = 2
    elif change == "dtype":
        tab = torch.zeros(4, dtype=torch.int32)
    elif change == "device":
        device["index"] = 1
    else:
        other = FakeJIT2()
    launcher(other, tab=tab, BLOCK2=value)
    assert [k for k, *_ in other.log][-1] == "jit"
    if change in ("device", "kernel"):  # one device and one kernel per launcher: always the JIT
        launcher(other, tab=tab, BLOCK2=value)
        assert [k for k, *_ in other.log][-1] == "jit"
    else:  # a new specialization is kept under its own key
        launcher(other, tab=tab, BLOCK2=value)
        assert [k for k, *_ in other.log][-1] == "direct"


def test_arguments_the_first_launch_did_not_name_go_through_the_jit(fake):
    """Direct launches pass the kernel's parameters only: a changing launch option (not a
    parameter), a parameter left to its default, or other names than the first launch's make
    every launch the JIT's."""
    kernel, _ = fake
    option = launch.Launcher((1,), {"a": 0, "b": 0, "BLOCK": 8})
    for _ in range(2):
        option(kernel, tab=_tab(), num_warps=4)  # an option the JIT takes, the runner does not
    defaulted = launch.Launcher((1,), {"a": 0, "b": 0})  # BLOCK left to the kernel's default
    for _ in range(2):
        defaulted(kernel, tab=_tab())
    assert [k for k, *_ in kernel.log] == ["jit"] * 4
    two = FakeJIT2()
    renamed = launch.Launcher((1,), {"a": 0, "b": 0})
    renamed(two, tab=_tab(), BLOCK=8, BLOCK2=1)
    renamed(two, tab=_tab(), BLOCK=8, BLOCK2=1)
    renamed(two, tab=_tab(), BLOCK=8, num_warps=1)  # the same values' key, other names
    assert [k for k, *_ in two.log] == ["jit", "direct", "jit"]


def test_a_failing_direct_launch_turns_them_off_and_the_jit_launches(fake, caplog):
    _, _ = fake
    kernel = FakeJIT(fail=True)
    launcher = launch.Launcher((1,), {"a": 0, "b": 0, "BLOCK": 8})
    launcher(kernel, tab=_tab())
    launcher(kernel, tab=_tab())
    assert [k for k, *_ in kernel.log] == ["jit", "jit"]
    assert "every launch goes through the JIT" in caplog.text
    other = launch.Launcher((1,), {"a": 0, "b": 0, "BLOCK": 8})
    other(kernel, tab=_tab())
    other(kernel, tab=_tab())
    assert [k for k, *_ in kernel.log] == ["jit"] * 4  # for every launcher, from then on


@pytest.mark.parametrize("env", [("ANCHORKV_DIRECT_LAUNCH", "0"), ("TRITON_INTERPRET", "1")])
def test_switched_off_or_interpreted_every_launch_is_the_jit(fake, monkeypatch, env):
    kernel, _ = fake
    monkeypatch.setenv(*env)
    launcher = launch.Launcher((1,), {"a": 0, "b": 0, "BLOCK": 8})
    for _ in range(3):
        launcher(kernel, tab=_tab())
    assert [k for k, *_ in kernel.log] == ["jit"] * 3


def test_stand_ins_are_called_every_time(monkeypatch):
    """A kernel that is not a real `triton.jit` function (a test's counting wrapper) is never
    bypassed, even when it returns what looks like a compiled kernel."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(launch, "_disabled", False)
    kernel = FakeJIT()
    launcher = launch.Launcher((1,), {"a": 0, "b": 0, "BLOCK": 8})
    for _ in range(3):
        launcher(kernel, tab=_tab())
    assert [k for k, *_ in kernel.log] == ["jit"] * 3


def test_installed_triton_passes_every_argument():
    """The installed triton (CI's) launches the way `Launcher` assumes (else direct launches
    stay off: this names the change)."""
    assert launch.triton_passes_every_argument(), (
        "JITFunction.run no longer passes *bound_args.values() to the launcher, or "
        "CompiledKernel.__getitem__ changed: re-check kernels/launch.py against this triton")


@pytest.mark.parametrize("takes_stream", [True, False])
def test_a_calls_launch_site_is_asked_once_not_per_launch(fake, monkeypatch, takes_stream):
    """`_at` (`launch.launch_site()`: the current device and its stream's handle, asked once for
    a call's launches): a direct launch asks torch for neither and hands the runner that stream
    where the installed triton's runner takes one; another device than the launcher's goes
    through the JIT, as a current device would."""
    kernel, device = fake
    monkeypatch.setattr(launch, "runner_takes_stream", lambda: takes_stream)
    launcher = launch.Launcher((1,), {"a": 0, "b": 0, "BLOCK": 8})
    launcher(kernel, tab=_tab())  # the JIT's (asks for the device itself)
    asked = torch.cuda.current_device
    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("asked for the device"))
    launcher(kernel, _at=(0, 0xABC), tab=_tab(2))
    monkeypatch.setattr(torch.cuda, "current_device", asked)
    launcher(kernel, _at=(1, 0xDEF), tab=_tab(2))  # another device: the JIT
    assert [k for k, *_ in kernel.log] == ["jit", "direct", "jit"]
    assert "_at" not in kernel.log[2][2]  # (never handed to the kernel)
    assert kernel.streams == [0xABC if takes_stream else None]


def test_the_installed_triton_takes_the_stream_and_launch_site_names_it():
    """The installed triton's runner takes `stream` (else every direct launch asks torch for it,
    as before); `launch_site` without CUDA is never called by the launch path (CPU plans pass
    no site), so only its source is checked here: the raw handle triton's own runner asks for."""
    import inspect

    assert launch.runner_takes_stream()
    assert "_cuda_getCurrentRawStream" in inspect.getsource(launch.launch_site)


def test_fixed_tensors_pass_as_addresses_and_direct_takes_a_kept_key(fake):
    """A fixed tensor argument (and a tuple of them) reaches a direct launch as its address,
    taken once; `direct` launches with addresses under a key kept by an earlier launch
    (`key_of`), and launches nothing (False) for a key never kept."""
    kernel, _ = fake
    a = torch.zeros(4, dtype=torch.int32)
    launcher = launch.Launcher((2,), {"a": a, "b": (a, a[2:]), "BLOCK": 8})
    tab = _tab()
    launcher(kernel, tab=tab)
    key = launch.key_of({"tab": tab})
    other = _tab(2)
    assert launcher.direct(kernel, key, tab=other.data_ptr())
    kind, grid, args = kernel.log[-1]
    assert (kind, grid) == ("direct", (2, 1, 1))
    assert list(args) == [a.data_ptr(), other.data_ptr(), (a.data_ptr(), a[2:].data_ptr()), 8]
    assert not launcher.direct(kernel, launch.key_of({"tab": _tab(1)}), tab=0)  # (8 bytes in: never kept)
    assert not launcher.direct(kernel, key, tab=0, extra=1)  # other names
    assert not launcher.direct(FakeJIT(), key, tab=0)  # another kernel (a stand-in for the kept one)
    assert len(kernel.log) == 2


class RunCompiled(FakeCompiled):
    """A `FakeCompiled` with the driver launcher's attributes (`run`, `function`,
    `packed_metadata`), as triton's `CompiledKernel` has them."""

    function, packed_metadata = 0xF00, ("md",)

    def run(self, *args):
        self.log.append(("run", args[:9], list(args[9:])))


class RunJIT(FakeJIT):
    def __getitem__(self, grid):
        def jit(**kwargs):
            self.log.append(("jit", grid, kwargs))
            return RunCompiled(self.log, self.fail, self.streams)
        return jit


@pytest.mark.parametrize("hook", [None, "enter", "exit"])
def test_no_launch_hook_calls_the_driver_launcher_itself(fake, monkeypatch, hook):
    """With the stream known and no launch hook set, a direct launch calls the compiled
    kernel's driver launcher (`run`) as its runner would, with None for the launch metadata
    and the hooks; a hook set (a profiler's) sends every launch through the runner again."""
    from triton import knobs

    _, _ = fake
    monkeypatch.setattr(launch, "runner_only_forwards", lambda: True)
    monkeypatch.setattr(launch, "runner_takes_stream", lambda: True)
    kernel = RunJIT()
    launcher = launch.Launcher((3, 2), {"a": 1, "b": 2.5, "BLOCK": 64})
    launcher(kernel, tab=_tab())
    tab = _tab(2)
    if hook is not None:
        chain = getattr(knobs.runtime, f"launch_{hook}_hook")
        if hasattr(chain, "add"):  # triton 3.9: a chain of hooks (restored after the test)
            monkeypatch.setattr(chain, "calls", [print])
        else:
            monkeypatch.setattr(knobs.runtime, f"launch_{hook}_hook", print)
    launcher(kernel, _at=(0, 0xABC), tab=tab)
    launcher(kernel, tab=tab)  # (no site: the runner asks for the stream)
    kinds = [k for k, *_ in kernel.log]
    if hook is None:
        assert kinds == ["jit", "run", "direct"]
        assert kernel.log[1][1] == (3, 2, 1, 0xABC, 0xF00, ("md",), None, None, None)
        assert kernel.log[1][2] == [1, tab.data_ptr(), 2.5, 64]
        assert kernel.streams == [None]
    else:
        assert kinds == ["jit", "direct", "direct"]
        assert kernel.streams == [0xABC, None]


def test_installed_triton_runner_only_forwards():
    """The installed triton's runner (CI's) only forwards to the driver's launcher, so a launch
    with no hook set skips it (else every direct launch goes through the runner: this names
    the change)."""
    assert launch.runner_only_forwards(), (
        "CompiledKernel.__getitem__'s runner changed: re-check launch._direct_call against this triton")
