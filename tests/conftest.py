"""Multi-rank test harness: run a test body on N forked local ranks; the device of the test run.

``run_ranks(fn, nprocs, *args)`` runs ``fn`` on ``nprocs`` ranks through :func:`ops_transformer.launch`
(fork, one thread per rank, ~0.1 s to start), returns the per-rank results, re-raises the first
failing rank's exception with its rank and traceback, and never hangs the suite: a job is ended after
``RANK_TIMEOUT_S`` seconds with the stacks of the ranks still running.

The device: ``OT_TEST_DEVICE=cpu`` (the default) or ``cuda``, or ``pytest --ot-device cuda``. On
``cuda`` the single-process tests run with CUDA as the default device (``torch.device("cuda")``
around each test) and ``run_ranks`` runs its ranks on NCCL, one per GPU, with ``cuda:LOCAL_RANK``
as each rank's default device; a multi-rank test that needs more GPUs than are visible is skipped
with the reason. On ``cpu`` the GPUs are hidden (``CUDA_VISIBLE_DEVICES=""``), so the ranks use
gloo and CPU tensors whatever the machine. Tests that take the ``ot_device`` fixture run once per
device, ``cpu`` and ``cuda``; the ``cuda`` variant runs only on a CUDA run with a GPU, and is
otherwise reported as skipped with the reason (``-ra`` lists them), never left out.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from ops_transformer import launch
from ops_transformer.testing.devices import cuda_skip_reason, on_device

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The command line passes the machine's calibrated profile to the cost-model choices when one exists
# (the library itself never looks for it); the commands run by the tests use the built-in one, so
# that they do not depend on what `ops-transformer calibrate` left behind.
os.environ["OPS_TRANSFORMER_PROFILE"] = os.path.join(os.path.dirname(__file__), "no-profile.json")
RANK_TIMEOUT_S = 120.0
DEVICES = ("cpu", "cuda")
# NVML-based (does not initialise CUDA, so forking ranks stays safe), honours CUDA_VISIBLE_DEVICES.
VISIBLE_GPUS = torch.cuda.device_count()
_MODE = {"device": "cpu"}


def pytest_addoption(parser):
    parser.addoption("--ot-device", choices=DEVICES, default=None,
                     help="device of the test run: cpu (default) or cuda (single-process tests "
                          "on CUDA, multi-rank ones on NCCL); default $OT_TEST_DEVICE or cpu")


def pytest_configure(config):
    mode = config.getoption("--ot-device") or os.environ.get("OT_TEST_DEVICE") or "cpu"
    if mode not in DEVICES:
        raise pytest.UsageError(f"OT_TEST_DEVICE={mode!r}: use one of {', '.join(DEVICES)}")
    _MODE["device"] = mode
    if mode == "cpu" or VISIBLE_GPUS == 0:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # ranks choose gloo and CPU tensors
    config.addinivalue_line("markers", "cuda: a CUDA variant (runs on OT_TEST_DEVICE=cuda with "
                                       "a GPU, skipped with the reason otherwise)")


def pytest_report_header(config):
    mode = _MODE["device"]
    line = f"ops-transformer test device: {mode} ({VISIBLE_GPUS} GPU(s) visible)"
    if mode == "cuda" and VISIBLE_GPUS == 0:
        line += ("; OT_TEST_DEVICE=cuda but no CUDA device is visible: the CUDA variants are "
                 "skipped with the reason, everything else runs on the CPU")
    return line


def cuda_mode() -> bool:
    """Whether this test run is on CUDA (``OT_TEST_DEVICE=cuda`` and a GPU visible)."""
    return _MODE["device"] == "cuda" and VISIBLE_GPUS > 0


def pytest_generate_tests(metafunc):
    if "ot_device" in metafunc.fixturenames:
        reason = cuda_skip_reason(_MODE["device"], VISIBLE_GPUS)
        cuda = pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda] + (
            [pytest.mark.skip(reason=reason)] if reason else []))
        metafunc.parametrize("ot_device", ["cpu", cuda])


@pytest.fixture(autouse=True)
def _test_device(request):
    """On a CUDA run, CUDA is the default device of every single-process test (``ot_device``
    tests choose their own)."""
    if not cuda_mode() or "ot_device" in request.fixturenames:
        yield
        return
    with torch.device("cuda"):
        yield


def _run_ranks(fn, nprocs, *args, timeout=RANK_TIMEOUT_S, **kwargs):
    if cuda_mode():
        reason = cuda_skip_reason("cuda", VISIBLE_GPUS, max(nprocs, 2))
        if reason:
            pytest.skip(f"{reason} for {nprocs} ranks")
        fn = functools.partial(on_device, fn, "cuda")
    return launch(fn, nprocs, *args, timeout=timeout, **kwargs)


@pytest.fixture
def run_ranks():
    return _run_ranks
