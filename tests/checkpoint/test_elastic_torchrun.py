"""Elastic torchrun (``torchrun --nnodes 1:2 ... -m ops_transformer train ... --resume``): two agents
on this machine, 2 ranks each, dp 2 × tp 2; one agent and its ranks are SIGKILLed mid-run (a node
lost); torchrun restarts the other agent's ranks as a world of 2, ``train`` rebalances to dp 1 × tp
2 with accumulation 2 from the last checkpoint, and the run ends with the losses of the
uninterrupted 4-rank run (≤ 1e-5 per step)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ops_transformer.cli.main import main

from helpers import alive

pytestmark = pytest.mark.slow

TRAIN = ["--tp", "2", "--steps", "6", "--batch", "8", "--seq", "16", "--save-every", "3",
         "--resume", "--no-progress"]

# sitecustomize of the agent that dies: on the first attempt its local rank 0, at its 5th optimizer
# step (after the step-3 checkpoint), SIGKILLs its agent, its sibling rank and itself — a node gone.
KILL_NODE = '''
import os
if os.environ.get("LOCAL_RANK") == "0" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    import signal
    import torch
    _step, _count = torch.optim.AdamW.step, [0]

    def _children(parent):
        for name in os.listdir("/proc"):
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == parent:
                        yield int(name)
            except (OSError, ValueError, IndexError):
                continue

    def step(self, *args, **kwargs):
        _count[0] += 1
        if _count[0] == 5:
            agent = os.getppid()
            with open(os.environ["KILLED_NODE_PIDS"], "w") as f:
                f.write(" ".join(map(str, [agent, *_children(agent)])))
            for pid in _children(agent):
                if pid != os.getpid():
                    os.kill(pid, signal.SIGKILL)
            os.kill(agent, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        return _step(self, *args, **kwargs)

    torch.optim.AdamW.step = step
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(tmp_path: Path, port: int, name: str, hook: bool) -> subprocess.Popen:
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m",
                                                           "torch.distributed.run"]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1",
           "KILLED_NODE_PIDS": str(tmp_path / "killed-pids")}
    if hook:
        hook_dir = tmp_path / "hook"
        hook_dir.mkdir()
        (hook_dir / "sitecustomize.py").write_text(KILL_NODE)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hook_dir), env.get("PYTHONPATH")]))
    cmd = launcher + ["--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "1",
                      "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                      "--rdzv-id", "elastic-test", "--rdzv-conf", "last_call_timeout=10",
                      "-m", "ops_transformer", "train", *TRAIN,
                      "--ckpt-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "run")]
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def test_a_lost_agent_and_the_other_finishes_the_run(tmp_path, capsys):
    ref_out = tmp_path / "ref"
    assert main(["train", "--nproc", "4", "--ranks-per-node", "2", *TRAIN, "--json",
                 "--ckpt-dir", str(tmp_path / "ref-ckpt"), "--out", str(ref_out)]) == 0
    capsys.readouterr()
    ref = json.loads((ref_out / "metrics.json").read_text())
    port = _free_port()
    survivor = _agent(tmp_path, port, "survivor", hook=False)  # hosts the rendezvous store
    time.sleep(2)
    lost = _agent(tmp_path, port, "lost", hook=True)
    try:
        code = survivor.wait(timeout=600)
        log = (tmp_path / "survivor.log").read_text()
        assert code == 0, log[-4000:]
        assert lost.wait(timeout=60) != 0  # SIGKILLed
    finally:
        for proc in (survivor, lost):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        pids = (tmp_path / "killed-pids")
        for pid in (map(int, pids.read_text().split()) if pids.exists() else []):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert (tmp_path / "killed-pids").exists(), "the node was never killed"
    assert "dp 2 × tp 2 → dp 1 × tp 2, accumulation 1 → 2" in log, log[-4000:]
    got = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert (got["dp"], got["tp"], got["grad_accum"], got["resumed_from"]) == (1, 2, 2, 3)
    assert ref["dp"] == 2 and len(got["losses"]) == len(ref["losses"]) == 6
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a} vs {b}"
