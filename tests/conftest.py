"""Multi-rank test harness: run a test body on N forked local ranks.

``run_ranks(fn, nprocs, *args)`` runs ``fn`` on ``nprocs`` ranks through :func:`ops_transformer.launch`
(fork, one thread per rank, ~0.1 s to start), returns the per-rank results, re-raises the first
failing rank's exception with its rank and traceback, and never hangs the suite: a job is ended after
``RANK_TIMEOUT_S`` seconds with the stacks of the ranks still running.
"""

from __future__ import annotations

import os

import pytest

from ops_transformer import launch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The command line passes the machine's calibrated profile to the cost-model choices when one exists
# (the library itself never looks for it); the commands run by the tests use the built-in one, so
# that they do not depend on what `ops-transformer calibrate` left behind.
os.environ["OPS_TRANSFORMER_PROFILE"] = os.path.join(os.path.dirname(__file__), "no-profile.json")
RANK_TIMEOUT_S = 120.0


def _run_ranks(fn, nprocs, *args, timeout=RANK_TIMEOUT_S, **kwargs):
    return launch(fn, nprocs, *args, timeout=timeout, **kwargs)


@pytest.fixture
def run_ranks():
    return _run_ranks
