"""``profile`` and ``diagnose`` of a pipelined run: the bubble per rank next to the formula, and
``pp_unbalanced`` for a split whose last stage (the LM head) has more work than the others."""

from __future__ import annotations

import json

from ops_transformer.cli.main import main
from ops_transformer.models.gpt import PRESETS
from ops_transformer.planner.pipeline import stage_flops_per_token
from ops_transformer.planner.specs import ModelSpec
from ops_transformer.profiler.pipeline import measured_balance, predicted_balance
from ops_transformer.profiler.run import profile_worker
from ops_transformer.training.loop import TrainConfig

TINY = ModelSpec.from_gpt_config(PRESETS["tiny"], seq=32)


def test_stage_flops_put_the_head_on_the_last_stage():
    first, last = stage_flops_per_token(TINY, 2)
    assert last - first == 6 * TINY.vocab * TINY.hidden  # 6·V·h per token
    assert first + last == TINY.flops_per_token()


def test_predicted_imbalance_names_the_last_stage():
    found = predicted_balance(TINY, 2, "1f1b", 1)  # 1 layer a stage, a 256-token head: 23%
    assert [(d["code"], d["where"], d["severity"]) for d in found] == [
        ("pp_unbalanced", "pp rank 1", "warning")]
    assert "23% apart" in found[0]["message"]
    assert predicted_balance(TINY.with_(layers=8), 2, "1f1b", 1) == []  # 4 layers dilute it
    # the V schedule puts the first and the last stage on rank 0: it holds the head
    found = predicted_balance(TINY.with_(layers=4), 2, "zbv", 2)
    assert [d["where"] for d in found] == ["pp rank 0"]


def test_measured_imbalance_takes_each_stage_s_slowest_rank():
    ranks = [{"rank": r, "pp_rank": r // 2, "busy_s": b, "stages": []}
             for r, b in enumerate([1.0, 1.1, 1.6, 1.2])]
    (found,) = measured_balance(ranks)
    assert found["where"] == "pp rank 1" and "1.1e+03, 1.6e+03" in found["message"]
    assert abs(found["estimated_saving_s"] - 0.25) < 1e-12
    assert measured_balance([{**r, "busy_s": 1.0} for r in ranks]) == []


def test_profile_shows_the_bubble_per_rank(run_ranks, tmp_path):
    cfg = TrainConfig(pp=2, microbatches=4, batch=8, seq=32, progress=False, out=str(tmp_path))
    summary = run_ranks(profile_worker, 2, cfg, 2, 1)[0]
    piped = summary["pipeline"]
    assert (piped["pp"], piped["schedule"], piped["microbatches"]) == (2, "1f1b", 4)
    assert piped["bubble_formula"] == 0.25  # (p − 1) / m
    assert [(r["rank"], r["pp_rank"], r["stages"]) for r in piped["per_rank"]] == [
        (0, 0, ["0-0"]), (1, 1, ["1-1+head"])]
    for r in piped["per_rank"]:
        assert 0 < r["busy_s"] <= r["schedule_s"]
        assert r["bubble"] > 0  # the median over the steps of (schedule − busy) / busy
    written = json.loads((tmp_path / "profile.json").read_text())
    assert written["pipeline"]["per_rank"] == piped["per_rank"]


def test_diagnose_static_names_an_unbalanced_split(capsys):
    assert main(["diagnose", "--static", "--pp", "2", "--microbatches", "2", "--batch", "4",
                 "--seq", "32", "--nproc", "2", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)["diagnostics"]
    assert [(d["code"], d["where"]) for d in found if d["code"] == "pp_unbalanced"] == [
        ("pp_unbalanced", "pp rank 1")]
