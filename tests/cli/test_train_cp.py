"""``train --cp N --cp-strategy``: the reference GPT's sequences split over cp ranks give the
one-process losses; the strategy and its reason in the metrics; clear errors."""

from __future__ import annotations

import json

import pytest

from ops_transformer.cli.main import main

RUN = ["--steps", "3", "--batch", "2", "--seq", "32", "--no-progress"]


def test_train_cp2_has_the_one_process_losses(tmp_path, capsys):
    assert main(["train", *RUN, "--out", str(tmp_path / "one")]) == 0
    assert main(["train", "--nproc", "2", "--cp", "2", "--cp-strategy", "ring", *RUN,
                 "--out", str(tmp_path / "cp")]) == 0
    text = capsys.readouterr().out
    assert "dp=1 × cp=2 × tp=1" in text and "context parallel        ring (forced" in text
    one = json.loads((tmp_path / "one" / "metrics.json").read_text())
    cp = json.loads((tmp_path / "cp" / "metrics.json").read_text())
    assert (cp["cp"], cp["cp_strategy"]) == (2, "ring") and "forced" in cp["cp_reason"]
    for mine, theirs in zip(cp["losses"], one["losses"]):
        assert abs(mine - theirs) <= 1e-6 * abs(theirs)
    # per step: 2 layers × (1 forward + 3 backward exchanges) of ring steps
    assert cp["comm_per_step"]["send_recv"]["calls"] == 8
    assert one["cp"] == 1


@pytest.mark.parametrize("argv,needle", [
    (["train", "--nproc", "2", "--cp", "2", "--seq", "30"],
     "sequence length 30 is not divisible by 4 (cp=2)"),
    (["train", "--nproc", "4", "--cp", "2", "--tp", "4"],
     "world size 4 is not divisible by tp (4) × ep (1) × cp (2) = 8"),
    (["train", "--nproc", "8", "--cp", "2", "--tp", "4", "--seq", "20", "--sequence-parallel"],
     "--seq (20) must be divisible by cp × tp (8)"),
    (["train", "--nproc", "4", "--cp", "4", "--cp-strategy", "ulysses", "--preset", "llama-tiny"],
     "--cp-strategy ulysses --cp 4: context_parallel='ulysses' splits the heads over cp (4): cp "
     "must divide this rank's KV heads (2)"),
])
def test_train_cp_errors_are_one_line(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_train_cp2_clips_the_dense_norm(tmp_path):
    """The gradient norm counts each parameter once, not once per cp rank."""
    clip = ["--clip-grad", "0.05"]
    assert main(["train", *RUN, *clip, "--out", str(tmp_path / "one")]) == 0
    assert main(["train", "--nproc", "2", "--cp", "2", *RUN, *clip,
                 "--out", str(tmp_path / "cp")]) == 0
    one = json.loads((tmp_path / "one" / "metrics.json").read_text())["losses"]
    cp = json.loads((tmp_path / "cp" / "metrics.json").read_text())["losses"]
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(cp, one)), (cp, one)
