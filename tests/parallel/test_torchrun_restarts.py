"""``torchrun --max-restarts`` over gloo works as a plain command (issue #30 item 12): without
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, torchrun shares its rendezvous store with the ranks and
its keys outlive a failed attempt; a restarted rank that read a dead peer's gloo address failed
(``connectFullMesh … Connection refused``, 2 of 3 restarts here). The ranks now meet under a prefix
of the attempt. A start-up delay of rank 0 on the restarted attempt makes the race certain."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from ops_transformer.launch.rendezvous import job_store

JOB = '''
import os, signal
import torch
import ops_transformer as ot
from ops_transformer.comm import collectives as C

attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
ctx = ot.init_parallel(tp=2)
t = torch.ones(4)
C.all_reduce(t, ctx.tp_group)
if attempt == "0" and ctx.rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
C.all_reduce(t, ctx.tp_group)
# one write(2) per line: two ranks' print() pieces can interleave on torchrun's shared stdout
os.write(1, f"attempt {attempt} rank {ctx.rank} sum {float(t[0])}\\n".encode())
ctx.close()
'''
DELAY_HOOK = '''
import os, time
if os.environ.get("RANK") == "0" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "1":
    time.sleep(3)  # the restarted rank 1 looks up rank 0's address before rank 0 wrote it
'''


@pytest.mark.slow
def test_torchrun_max_restarts_over_gloo_needs_no_environment_variable(tmp_path):
    (tmp_path / "job.py").write_text(JOB)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(DELAY_HOOK)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env.update(OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(hook), env.get("PYTHONPATH")])))
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m",
                                                           "torch.distributed.run"]
    done = subprocess.run(launcher + ["--standalone", "--nproc-per-node", "2", "--max-restarts",
                                      "1", str(tmp_path / "job.py")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exitcode: -9" in done.stderr  # attempt 0 lost rank 1
    assert sorted(line for line in done.stdout.splitlines() if line.startswith("attempt")) == [
        "attempt 1 rank 0 sum 4.0", "attempt 1 rank 1 sum 4.0"]


def test_several_nodes_with_restarts_over_gloo_say_what_to_set():
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "GROUP_WORLD_SIZE": "2",
           "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    with pytest.raises(ValueError, match="set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's "
                                         "environment on every node"):
        job_store(env, "gloo", 4, timedelta(seconds=1))
    # torchrun's own fresh store per attempt, or no torchrun: nothing to namespace
    assert job_store({**env, "TORCHELASTIC_USE_AGENT_STORE": "False"}, "gloo", 4,
                     timedelta(seconds=1)) is None
