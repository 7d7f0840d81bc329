"""``torchrun --max-restarts 1 -m ops_transformer train --resume``: a rank SIGKILLed mid-run, the
job restarted by torchrun from its last checkpoint, and final weights bit-identical to an
uninterrupted torchrun job's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ops_transformer.checkpoint import export as ex

pytestmark = pytest.mark.slow

# Put in front of sys.path as sitecustomize: runs at the start of every Python process of the job;
# on the first attempt (torchrun's restart count 0) rank 1 dies by SIGKILL at its 5th optimizer step.
KILL_HOOK = '''
import os
if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    import signal
    import torch
    _step, _count = torch.optim.AdamW.step, [0]

    def step(self, *args, **kwargs):
        _count[0] += 1
        if _count[0] == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        return _step(self, *args, **kwargs)

    torch.optim.AdamW.step = step
'''


def _torchrun(tmp_path: Path, name: str, hook: bool) -> subprocess.CompletedProcess:
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m",
                                                           "torch.distributed.run"]
    env = {**{k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"},
           "OMP_NUM_THREADS": "1"}  # the plain command: no TORCH_DISABLE_SHARE_RDZV_TCP_STORE
    if hook:
        hook_dir = tmp_path / "hook"
        hook_dir.mkdir()
        (hook_dir / "sitecustomize.py").write_text(KILL_HOOK)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hook_dir),
                                                          env.get("PYTHONPATH")]))
    cmd = launcher + ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                      "-m", "ops_transformer", "train", "--tp", "2", "--steps", "8",
                      "--batch", "4", "--seq", "32", "--ckpt-dir", str(tmp_path / name),
                      "--save-every", "3", "--resume", "--no-progress",
                      "--out", str(tmp_path / f"{name}-run")]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)


def test_torchrun_restarts_a_killed_rank_and_finishes_bit_identical(tmp_path):
    plain = _torchrun(tmp_path, "plain", hook=False)
    assert plain.returncode == 0, plain.stderr[-3000:]
    killed = _torchrun(tmp_path, "killed", hook=True)
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "exitcode: -9" in killed.stderr, killed.stderr[-3000:]  # torchrun saw the kill
    ours = json.loads((tmp_path / "killed-run" / "metrics.json").read_text())
    ref = json.loads((tmp_path / "plain-run" / "metrics.json").read_text())
    assert ours["resumed_from"] == 3 and ref["resumed_from"] == 0
    assert ours["losses"] == ref["losses"]
    a, _ = ex.dense_state_dict(tmp_path / "killed")
    b, _ = ex.dense_state_dict(tmp_path / "plain")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_python_dash_m_runs_the_command_line():
    out = subprocess.run([sys.executable, "-m", "ops_transformer", "checkpoint", "--help"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "inspect" in out.stdout
