"""``training.dry_run`` / ``train --dry-run``: a run's ranks built on ``meta`` (issue 34): the
counts a real set-up has, the communication a real run expects, no parameter storage, train's
errors, nothing written."""

from __future__ import annotations

import json

import pytest
import torch

import ops_transformer
from ops_transformer import training
from ops_transformer.cli.main import main as cli_main
from ops_transformer.training.config import RunConfig
from ops_transformer.training.loop import TrainConfig, join, setup_training, train_worker

CFG = TrainConfig(preset="tiny", tp=2, batch=4, seq=32, steps=1, progress=False,
                  sample_tokens=1)


def _real_counts(cfg):
    torch.set_num_threads(1)
    with join(cfg) as ctx:
        state = setup_training(cfg, ctx)
        return sum(p.numel() for p in state.model.parameters())


def test_dry_run_at_tp2_matches_a_real_set_up_and_run(run_ranks):
    report = training.dry_run(CFG, nproc=2)
    json.dumps(report)  # plain data
    assert report["world_size"] == 2 and report["layout"]["tp"] == 2
    real = run_ranks(_real_counts, 2, CFG)
    assert [r["params"] for r in report["ranks"]] == real
    assert all(r["all_meta"] for r in report["ranks"])  # no parameter storage on any rank
    metrics = run_ranks(train_worker, 2, CFG)[0]  # one real step
    assert report["expected_tp_comm_per_step"] == metrics["expected_tp_comm_per_step"]
    assert report["expected_tp_comm_per_step"]  # tp 2 communicates
    assert report["attention"] == metrics["attention"] and report["vocab"] == metrics["vocab"]
    assert [role["ranks"] for role in report["roles"]] == [[0, 1]]


def test_dry_run_takes_a_run_config_and_shards_zero3():
    run = TrainConfig(preset="tiny", tp=2, dp=2, zero=3, batch=8, seq=32).run_config()
    assert isinstance(run, RunConfig)
    zero3 = ops_transformer.dry_run(run, nproc=4)
    plain = ops_transformer.dry_run(TrainConfig(preset="tiny", tp=2, dp=2, batch=8, seq=32),
                                    nproc=4)
    assert zero3["layout"]["zero"] == 3
    assert all(r["all_meta"] for r in zero3["ranks"])
    # ZeRO-3 keeps a dp shard of each parameter: half of the tp shard's elements
    assert sum(r["params"] for r in zero3["ranks"]) * 2 == sum(r["params"]
                                                               for r in plain["ranks"])


def test_bad_config_is_trains_one_line_error():
    with pytest.raises(ValueError, match=r"d_ff \(256\) is not divisible by tp \(3\)"):
        training.dry_run(TrainConfig(preset="tiny", tp=3), nproc=3)


def test_cli_dry_run_prints_a_table_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    assert cli_main(["train", "--dry-run", "--preset", "tiny", "--tp", "2", "--batch", "4",
                     "--seq", "32", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "dry run on meta: 2 rank(s)" in text and "all_reduce" in text
    assert max(len(line) for line in text.splitlines()) <= 100
    assert list(tmp_path.iterdir()) == []  # no --out, no runs/
    assert cli_main(["train", "--dry-run", "--json", "--preset", "tiny", "--tp", "2",
                     "--batch", "4", "--seq", "32"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["tp_rank"] for r in report["ranks"]] == [0, 1]
    assert cli_main(["train", "--dry-run", "--preset", "tiny", "--tp", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ops-transformer train: error: d_ff (256) is not divisible by tp (3)"]


def test_a_model_dry_run_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"a --model dry run is not done yet"):
        training.dry_run(TrainConfig(model=str(tmp_path), tp=2), nproc=2)
