"""Shared options and fixtures of the benchmark suites (`pytest benchmarks/ ...`).

`--quick` (or `ANCHORKV_BENCH_QUICK=1`) shrinks every suite to small sizes and few rounds, so CI
can run all of them as a smoke test in under a minute. Fixtures:

* `quick`: True in quick mode;
* `device`: `cuda` when a GPU is present (the Triton kernels run), else `cpu` (torch reference);
* `sync`: a function that waits for the device (call it inside timed code);
* `rounds`: how many timed rounds a benchmark should take (small in quick mode).
"""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks.machine import COLLECTED, FINISHED


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true", default=False,
                     help="anchorkv benchmarks: small sizes, few rounds (CI smoke test)")


def is_quick(config) -> bool:
    return bool(config.getoption("--quick")) or os.environ.get("ANCHORKV_BENCH_QUICK", "") == "1"


@pytest.fixture(scope="session")
def quick(request) -> bool:
    return is_quick(request.config)


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def sync(device):
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


@pytest.fixture(scope="session")
def rounds(quick) -> int:
    return 1 if quick else 5



def pytest_configure(config):
    COLLECTED.clear()
    FINISHED.clear()


def pytest_itemcollected(item):
    """Every benchmark a run collects (before `-k` / `-m` deselect any) and those that end
    (`pytest_runtest_logreport`): a module records its rows apart unless it ran them all
    (`benchmarks.machine.results_path`)."""
    COLLECTED.setdefault(str(item.path), []).append(item.nodeid)


def pytest_runtest_logreport(report):
    if (report.when == "call" and report.passed) or report.skipped:
        FINISHED.add(report.nodeid)
