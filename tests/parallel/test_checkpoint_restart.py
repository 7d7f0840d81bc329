"""``launch_with_restarts``: the local launcher's ``--max-restarts`` — a failed attempt is started
again, a user error is not."""

from __future__ import annotations

import os
import signal

import pytest

import ops_transformer as ot
from ops_transformer.checkpoint import launch_with_restarts


def _dies_once(marker):
    if int(os.environ["RANK"]) == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return int(os.environ["RANK"])


def test_a_killed_rank_restarts_the_job(tmp_path, caplog):
    marker = str(tmp_path / "died")
    assert launch_with_restarts(_dies_once, 2, marker, max_restarts=1) == [0, 1]
    assert "rank 1 exited with code -9" in caplog.text and "restart 1 of 1" in caplog.text


def test_restarts_run_out(tmp_path):
    with pytest.raises(ot.RankError, match="rank 1 exited"):
        launch_with_restarts(_dies_once, 2, str(tmp_path / "died"), max_restarts=0)


def _user_error(counter):
    with open(counter, "a") as f:
        f.write("x")
    raise ValueError("--lr must be positive")


def test_user_errors_are_not_retried(tmp_path):
    counter = tmp_path / "attempts"
    with pytest.raises(ValueError, match="--lr must be positive"):
        launch_with_restarts(_user_error, 1, str(counter), max_restarts=3)
    assert counter.read_text() == "x"


def test_max_restarts_is_validated():
    with pytest.raises(ValueError, match="max_restarts must be a non-negative integer, got -1"):
        launch_with_restarts(_user_error, 1, "x", max_restarts=-1)
