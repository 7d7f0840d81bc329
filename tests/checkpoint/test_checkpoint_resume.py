"""``train --resume`` that would do nothing or that meets a damaged checkpoint (issue #30 items 4
and 5): ``--steps`` at or below the saved step is one line (exit 2) naming both; a corrupted latest
checkpoint is skipped with a warning for the newest one that verifies (the run then equals one
that never stopped), and ``--resume strict`` keeps the refusal."""

from __future__ import annotations

import json
import shutil

import pytest

import ops_transformer as ot
from ops_transformer.checkpoint import store
from ops_transformer.training.checkpoints import resume
from ops_transformer.cli.main import main
from ops_transformer.training.loop import TrainConfig, data_position, setup_training

TRAIN = ["train", "--batch", "2", "--seq", "16", "--no-progress"]


def _one_line(err: str, *needles) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert all(n in lines[0] for n in needles), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """Checkpoints of steps 1 and 2 of a 2-step run (one process), made once."""
    base = tmp_path_factory.mktemp("saved")
    root = base / "ckpt"
    assert main(TRAIN + ["--steps", "2", "--save-every", "1", "--ckpt-dir", str(root),
                         "--out", str(base / "first")]) == 0
    return root


@pytest.fixture
def saved(original, tmp_path, capfd):
    """A copy of them, for one test."""
    root = tmp_path / "ckpt"
    shutil.copytree(original, root)
    capfd.readouterr()
    return root


@pytest.mark.parametrize("steps", ["2", "1"])
def test_resume_with_steps_at_or_below_the_saved_step_is_an_error(saved, tmp_path, capfd,
                                                                  steps):
    argv = TRAIN + ["--steps", steps, "--ckpt-dir", str(saved), "--resume", "--out",
                    str(tmp_path / "again")]
    assert main(argv) == 2
    _one_line(capfd.readouterr().err, "train: error", "at step 2", f"--steps is {steps}",
              "nothing to train")
    assert not (tmp_path / "again" / "metrics.json").exists()


def test_the_ranks_refuse_it_too(saved):
    """The check before any rank starts has a twin where the checkpoint is loaded (a fallback
    may load another step than the newest)."""
    cfg = TrainConfig(steps=2, batch=2, seq=16, ckpt_dir=str(saved), resume=True)
    ctx = ot.init_parallel()
    state = setup_training(cfg, ctx)
    with pytest.raises(ValueError, match="is at step 2 and --steps is 2: nothing to train"):
        resume(saved, state.model, state.opt, ctx, data_position(cfg), steps=2)


def _corrupt_latest(root) -> str:
    shard = root / store.step_dirname(2) / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return shard.name


def test_a_corrupted_latest_checkpoint_falls_back_to_the_newest_that_verifies(saved, tmp_path,
                                                                             capfd):
    assert main(TRAIN + ["--steps", "3", "--out", str(tmp_path / "plain"), "--json"]) == 0
    plain = json.loads(capfd.readouterr().out)
    name = _corrupt_latest(saved)
    argv = TRAIN + ["--steps", "3", "--ckpt-dir", str(saved), "--resume", "--out",
                    str(tmp_path / "resumed"), "--json"]
    assert main(argv) == 0
    captured = capfd.readouterr()
    metrics = json.loads(captured.out)
    assert metrics["resumed_from"] == 1
    assert metrics["losses"] == plain["losses"]  # as if it never stopped
    warnings = [line for line in captured.err.splitlines() if "warning" in line]
    warning = _one_line("\n".join(warnings), "train: warning", "skipped step 2", name,
                        "corrupted", "resuming from step 1")
    assert "--resume strict" in warning


def test_resume_strict_keeps_the_refusal(saved, tmp_path, capfd):
    name = _corrupt_latest(saved)
    argv = TRAIN + ["--steps", "3", "--ckpt-dir", str(saved), "--resume", "strict", "--out",
                    str(tmp_path / "resumed")]
    assert main(argv) == 2
    _one_line(capfd.readouterr().err, "train: error", name, "corrupted", "nothing was loaded")
