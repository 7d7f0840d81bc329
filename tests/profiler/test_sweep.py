"""Sweeps, profile/diagnose/bench commands: lists of values, every combination, a failing
configuration reported in its row while the others complete."""

from __future__ import annotations

import json

import pytest

from ops_transformer import launch
from ops_transformer.cli.main import main
from ops_transformer.profiler.sweep import (combinations, label, parse_values, run_sweep,
                                            split_axes)
from ops_transformer.training.loop import TrainConfig


def test_axes_parse_and_combine():
    assert parse_values("tp", "1, 2") == [1, 2]
    assert parse_values("sequence-parallel", "off,on") == [False, True]
    with pytest.raises(ValueError, match="--tp takes integers, got 'x'"):
        parse_values("tp", "1,x")
    with pytest.raises(ValueError, match="--sequence-parallel takes on/off values"):
        parse_values("sequence-parallel", "maybe")
    available, missing = split_axes({"tp": [1, 2], "no_such_feature": [1]})
    assert available == {"tp": [1, 2]} and missing == {"no_such_feature": [1]}
    cfgs = combinations(TrainConfig(), {"tp": [1, 2], "attention": ["heads", "kv_split"]})
    assert [label(c, {"tp": 0, "attention": 0}) for c in cfgs] == [
        "tp=1 attention=heads", "tp=1 attention=kv_split", "tp=2 attention=heads",
        "tp=2 attention=kv_split"]


def test_sweep_reports_an_impossible_configuration_and_completes_the_others():
    base = TrainConfig(tp=2, steps=1, batch=4, seq=33, progress=False, sample_tokens=0, layers=1)
    result = run_sweep(base, {"attention": ["heads", "kv_split"], "no_such_feature": [1, 2]},
                       nproc=2, warmup=0, launch=launch)
    rows = {r["config"]: r for r in result["rows"]}
    assert set(rows) == {"attention=heads", "attention=kv_split"}
    bad = rows["attention=kv_split"]
    assert bad["status"] == "invalid" and "sequence length (33) is not divisible" in bad["error"]
    ok = rows["attention=heads"]
    assert ok["status"] == "ok" and ok["step_s"] > 0 and ok["comm_bytes_per_step"] > 0
    assert ok["tokens_per_s"] == pytest.approx(4 * 33 / ok["step_s"])
    assert result["unavailable"] == {"no_such_feature": [1, 2]}


@pytest.mark.slow
def test_commands_write_their_outputs(tmp_path, capsys):
    assert main(["profile", "--nproc", "2", "--tp", "2", "--steps", "2", "--warmup", "1",
                 "--out", str(tmp_path / "p"), "--no-progress", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    for name in ("profile.json", "breakdown.png", "timeline.png", "trace_rank0.json",
                 "trace_rank1.json"):
        assert (tmp_path / "p" / name).stat().st_size > 0
    assert summary["tp"] == 2 and "all_reduce" in summary["collectives"]
    assert main(["diagnose", "--nproc", "2", "--tp", "2", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)["diagnostics"]
    assert {d["code"] for d in found} <= {"exposed_comm", "load_imbalance"}
    assert main(["diagnose", "--tp", "3", "--static"]) == 1  # 4 heads, FFN 256 over 3 ranks
    assert "not_divisible" in capsys.readouterr().out
    assert main(["sweep", "--tp", "1,2", "--steps", "1", "--warmup", "0", "--batch", "4",
                 "--out", str(tmp_path / "s"), "--no-progress"]) == 0
    assert (tmp_path / "s" / "sweep.png").stat().st_size > 0
    capsys.readouterr()
    assert main(["bench", "--rounds", "1", "--steps", "1", "--warmup", "0", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["row"]
    assert set(row["ms"]) == {"ours", "ours-proj", "dtensor", "plain", "tp1"}
    assert max(max(d) for d in row["loss_rel_diff"].values()) < 1e-4


def test_train_logs_tensorboard_scalars(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = tmp_path / "tb"
    assert main(["train", "--steps", "3", "--batch", "2", "--seq", "16", "--out",
                 str(tmp_path / "run"), "--no-progress", "--tensorboard", str(board)]) == 0
    events = EventAccumulator(str(board))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "tokens_per_s", "comm_bytes_per_step", "comm_calls_per_step"} <= tags
    assert [e.step for e in events.Scalars("loss")] == [0, 1, 2]
    (tmp_path / "file").write_text("")
    assert main(["train", "--steps", "1", "--tensorboard", str(tmp_path / "file")]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["profile", "diagnose"])
def test_measuring_commands_refuse_training_only_flags(command, tmp_path, capsys):
    assert main([command, "--tensorboard", str(tmp_path / "tb")]) == 2
    err = capsys.readouterr().err
    assert f"{command} measures train's step" in err and "drop --tensorboard" in err
    assert not (tmp_path / "tb").exists()
