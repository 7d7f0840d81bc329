"""The command line: demo and train run end to end; user errors exit with code 2, one clear line,
no traceback and no process left behind."""

from __future__ import annotations

import json

import pytest

from ops_transformer.cli.main import main

DEMO_KEYS = {"tp", "dp", "steps", "loss_first", "loss_last", "tokens_per_s",
             "max_rel_loss_diff_vs_tp1", "comm_per_step", "expected_allreduce_per_step"}


def test_demo_is_exact_and_communicates_the_minimum(tmp_path, capsys):
    assert main(["demo", "--steps", "12", "--out", str(tmp_path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)  # stdout is one JSON document; status: stderr
    assert DEMO_KEYS <= set(result)
    assert result["tp"] == 2 and result["dp"] == 1 and result["steps"] == 12
    assert result["max_rel_loss_diff_vs_tp1"] <= 1e-5
    assert result["comm_per_step"] == result["tp_comm_per_step"]
    measured = {k: {"calls": v["calls"], "elements": v["elements"]}
                for k, v in result["comm_per_step"].items()}
    assert measured == result["expected_tp_comm_per_step"]
    assert result["comm_per_step"]["all_reduce"]["calls"] == result["expected_allreduce_per_step"]
    assert json.loads((tmp_path / "metrics.json").read_text())["steps"] == 12
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_hybrid_dp_tp(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--nproc", "4", "--tp", "2", "--dp", "2", "--steps", "3", "--batch",
                 "4", "--seq", "32", "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "dp=2 × tp=2" in text and "sample:" in text
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["dp"] == 2 and len(metrics["losses"]) == 3
    # rank 0 also took part in the data-parallel gradient all-reduce (one bucket) and in the
    # step's one coalesced all-reduce of small values (here the loss, averaged over dp)
    assert metrics["comm_per_step"]["all_reduce"]["calls"] == \
        metrics["expected_tp_comm_per_step"]["all_reduce"]["calls"] + 2


@pytest.mark.parametrize("argv,needle", [
    (["train", "--nproc", "2", "--tp", "4"], "--tp (4) is larger than the number of processes (2)"),
    (["train", "--nproc", "4", "--tp", "4", "--preset", "huge"], "unknown preset 'huge'"),
    (["train", "--nproc", "8", "--tp", "8", "--attention", "heads"],
     "n_heads (4) is not divisible by tp (8)"),
    (["train", "--nproc", "2", "--tp", "2", "--attention", "kv_split", "--seq", "33"],
     "the sequence length (33) is not divisible by tp (2)"),
    (["train", "--nproc", "4", "--tp", "2", "--batch", "3"], "--batch (3) must be divisible by dp (2)"),
    (["train", "--nproc", "3", "--tp", "2"], "world size 3 is not divisible by tp (2)"),
    (["train", "--steps", "0"], "--steps must be at least 1, got 0"),
    (["train", "--nproc", "2", "--tp", "2", "--chunks", "0"],
     "--chunks must be an integer >= 1, got 0"),
])
def test_user_errors_exit_2_with_one_clear_line(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_corpus_too_small_for_the_sequence(tmp_path, capsys):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("print('hello')\n")
    assert main(["train", "--data", str(corpus), "--seq", "64", "--steps", "1"]) == 2
    assert "corpus has 15 bytes" in capsys.readouterr().err


def test_train_with_every_memory_technique(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--nproc", "4", "--tp", "2", "--steps", "2", "--batch", "4", "--seq",
                 "32", "--sequence-parallel", "--recompute", "selective", "--activation-cache",
                 "int8", "--zero", "2", "--out", str(out), "--no-progress", "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["config"]["sequence_parallel"] and metrics["config"]["zero"] == 2
    measured = {k: {"calls": v["calls"], "elements": v["elements"]}
                for k, v in metrics["tp_comm_per_step"].items()}
    assert measured == metrics["expected_tp_comm_per_step"]  # SP's collectives, as modelled
    assert measured["reduce_scatter"]["calls"] == 4 * 2  # 2 layers: 2 forward + 2 backward each
    assert (out / "metrics.json").exists()


def test_train_overlap_chunked_counts_its_chunks(tmp_path, capsys):
    assert main(["train", "--nproc", "2", "--tp", "2", "--steps", "2", "--batch", "4", "--seq",
                 "32", "--sequence-parallel", "--overlap", "chunked", "--chunks", "3",
                 "--out", str(tmp_path / "run"), "--no-progress", "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    measured = {k: {"calls": v["calls"], "elements": v["elements"]}
                for k, v in metrics["tp_comm_per_step"].items()}
    assert measured == metrics["expected_tp_comm_per_step"]  # the chunks, as modelled
    assert measured["reduce_scatter"]["calls"] == 3 * 4 * 2  # 3 chunks of 2 fwd + 2 bwd, 2 layers
    decided = [d for ds in metrics["overlap"].values() for d in ds]
    assert decided and all(d["chunks"] == 3 for d in decided)
    assert metrics["overlap_reason"].startswith(f"{len(decided)} of {len(decided)} region sizes")


@pytest.mark.slow
def test_train_runs_the_plans_memory_options(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"best": {"tp": 2, "dp": 2, "ep": 1, "attention": "heads",
                                         "sequence_parallel": True, "recompute": "full",
                                         "zero_stage": 1}}))
    assert main(["train", "--plan", str(plan), "--steps", "2", "--seq", "32", "--batch", "4",
                 "--no-progress", "--out", str(tmp_path / "run"), "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    config = metrics["config"]
    assert (config["sequence_parallel"], config["recompute"], config["zero"]) == (True, "full", 1)
    measured = {k: {"calls": v["calls"], "elements": v["elements"]}
                for k, v in metrics["tp_comm_per_step"].items()}
    assert measured == metrics["expected_tp_comm_per_step"]  # with the recompute replays


def test_memory_flags_that_contradict_the_plan_are_an_error(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"best": {"tp": 2, "dp": 2, "ep": 1, "attention": "heads",
                                         "sequence_parallel": True, "recompute": "full",
                                         "zero_stage": 1}}))
    assert main(["train", "--plan", str(plan), "--recompute", "none", "--zero", "2",
                 "--sequence-parallel", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "--recompute none (the plan has full)" in err and "--zero 2 (the plan has 1)" in err
    assert "--sequence-parallel" not in err.split("but also")[1]  # it agrees with the plan


@pytest.mark.parametrize("argv,needle", [
    (["train", "--nproc", "2", "--tp", "2", "--sequence-parallel", "--seq", "33"],
     "the sequence length s (33) must be divisible by tp (2)"),
    (["train", "--nproc", "2", "--tp", "2", "--zero", "1"], "--zero 1 shards the optimizer over "
     "data-parallel ranks, but dp is 1"),
    (["train", "--sequence-parallel"], "but tp is 1"),
    (["train", "--nproc", "2", "--tp", "2", "--sequence-parallel", "--attention", "kv_split"],
     "--sequence-parallel needs --attention heads"),
    (["memory", "--tp", "2", "--seq", "33", "--preset", "tiny"],
     "the sequence length s (33) must be divisible by tp (2)"),
    (["memory", "--preset", "huge"], "unknown preset 'huge'"),
])
def test_memory_flag_errors(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_memory_command_prints_the_trade_off_table(capsys):
    assert main(["memory", "--preset", "tiny", "--tp", "2", "--seq", "32", "--batch", "2",
                 "--layers", "1", "--steps", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    by_name = {r["name"]: r for r in rows}
    assert by_name["plain"]["step_ratio"] == 1.0
    assert by_name["SP + full"]["bytes_per_layer"] == by_name["SP + full"][
        "formula_bytes_per_layer"]  # the layer input's share: 2sbh/t (fp32)
    assert by_name["sequence parallel"]["activation_bytes"] < by_name["plain"]["activation_bytes"]
