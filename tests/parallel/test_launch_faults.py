"""launch() under faults: the launcher stopped by a signal, a rank killed, an exception that cannot
be rebuilt, and a launch inside a job that already has its ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from helpers import alive
from ops_transformer import RankError, launch

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "GROUP_RANK")


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update(extra)
    return env


# --- the launcher stopped: SIGTERM, SIGHUP, SIGKILL --------------------------------------------

LAUNCHER = textwrap.dedent("""
    import os, sys, time
    import ops_transformer as ot

    def rank(piddir):
        with open(os.path.join(piddir, os.environ["RANK"]), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)

    if __name__ == "__main__":
        ot.launch(rank, 2, sys.argv[1], timeout=900)
""")


def _stop_launcher(tmp_path, sig) -> None:
    tmp, piddir = tmp_path / "tmp", tmp_path / "pids"
    tmp.mkdir()
    piddir.mkdir()
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    proc = subprocess.Popen([sys.executable, str(script), str(piddir)],
                            env=clean_env(TMPDIR=str(tmp)))
    pids = []
    try:
        deadline = time.monotonic() + 120
        while len(list(piddir.iterdir())) < 2 or any(p.stat().st_size == 0
                                                     for p in piddir.iterdir()):
            assert proc.poll() is None, "the launcher ended before its ranks started"
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.1)
        pids = [int(p.read_text()) for p in sorted(piddir.iterdir())]
        proc.send_signal(sig)
        assert proc.wait(60) == -sig  # it ends as the signal would have ended it
        deadline = time.monotonic() + 30
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p for p in pids if alive(p)] == [], f"ranks outlived the launcher ({sig.name})"
        assert sorted(os.listdir(tmp)) == [], "the launcher left files in the temporary directory"
    finally:
        proc.kill()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_sigterm_to_the_launcher_reaps_its_ranks(tmp_path):
    _stop_launcher(tmp_path, signal.SIGTERM)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGKILL], ids=["SIGHUP", "SIGKILL"])
def test_launcher_stopped_by_a_signal_leaves_no_rank(tmp_path, sig):
    _stop_launcher(tmp_path, sig)


# --- the rank that died is the cause -----------------------------------------------------------

def _close_sockets() -> None:
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                os.close(int(fd))
        except OSError:
            pass


def _rank0_killed(hold_pipes: bool):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        # A process rank 0 started (a data-loader worker, say) keeps its pipes to the launcher
        # open, so only its exit status tells that rank 0 is gone.
        if hold_pipes and os.fork() == 0:
            _close_sockets()
            time.sleep(5)
            os._exit(0)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(2))  # rank 1: the peer is gone
    return "unreachable"


@pytest.mark.parametrize("hold_pipes", [False, True], ids=["plain", "pipes-held-open"])
def test_the_killed_rank_is_named_not_the_peer_it_disconnected(hold_pipes):
    with pytest.raises(RankError) as info:
        launch(_rank0_killed, 2, hold_pipes, timeout=60)
    err = info.value
    assert err.rank == 0, f"blamed rank {err.rank}: {err}"
    assert "[rank 0/2]" in str(err) and "killed by signal 9" in str(err)


# --- an exception the caller cannot rebuild ----------------------------------------------------

class NeedsTwoArguments(Exception):
    def __init__(self, code, detail):
        super().__init__(f"code {code}: {detail}")
        self.code = code


def _raise_custom():
    if os.environ["RANK"] == "1":
        raise NeedsTwoArguments(7, "the custom failure")
    return "fine"


def test_exception_that_cannot_be_unpickled_keeps_rank_and_message():
    with pytest.raises(RankError) as info:
        launch(_raise_custom, 2, timeout=60)
    err = info.value
    assert err.rank == 1 and "[rank 1/2]" in str(err)
    assert "NeedsTwoArguments: code 7: the custom failure" in str(err)
    assert err.type_name.endswith("NeedsTwoArguments")
    assert "_raise_custom" in err.remote_traceback


# --- inside a job that already has its ranks ---------------------------------------------------

def _whoami(x):
    return os.getpid(), x


def test_inside_torchrun_runs_on_the_current_rank(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert launch(_whoami, 2, "a") == [None, (os.getpid(), "a")]  # no process started
    with pytest.raises(ValueError, match=r"launch\(fn, 4\).*2 ranks.*--nproc-per-node 4"):
        launch(_whoami, 4, "a")


def test_nonpositive_timeout_is_refused():
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        launch(_whoami, 1, "a", timeout=0)
