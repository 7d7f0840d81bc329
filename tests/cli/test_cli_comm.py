"""The communication engine on the command line. The calibrated profile: located by the CLI
($OPS_TRANSFORMER_PROFILE, else ~/.cache/ops-transformer/profile.json) and passed down; a corrupt or
unreadable one is a one-line error naming the file and how to regenerate it (exit 2) when an
automatic choice needs it, and only a warning when every choice was made explicitly
(``--attention``). ``--ranks-per-node``: simulated nodes."""

from __future__ import annotations

import json

import pytest

from ops_transformer.cli.main import main

TRAIN = ["train", "--steps", "1", "--batch", "2", "--seq", "16", "--no-progress", "--json"]


@pytest.fixture
def profile_file(tmp_path, monkeypatch):
    path = tmp_path / "profile.json"
    monkeypatch.setenv("OPS_TRANSFORMER_PROFILE", str(path))
    return path


@pytest.mark.parametrize("content", ["{\"name\": \"cut off", "[]", "\x00\xff binary"])
def test_corrupt_profile_is_one_line_exit_2(profile_file, tmp_path, capsys, content):
    profile_file.write_bytes(content.encode("latin-1"))
    assert main(TRAIN + ["--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err
    assert str(profile_file) in lines[0] and "ops-transformer calibrate" in lines[0]
    assert "--attention auto" in lines[0]
    assert not (tmp_path / "run").exists()  # failed before any work


def test_unreadable_profile_is_one_line_exit_2(profile_file, tmp_path, capsys):
    profile_file.mkdir()  # exists, cannot be read as a file
    assert main(["plan", "--gpu", "local", "--gpus", "2", "--model", "gpt2-124m"]) == 2
    err = capsys.readouterr().err
    assert str(profile_file) in err and "ops-transformer calibrate" in err
    assert len(err.strip().splitlines()) == 1


def test_explicit_attention_does_not_need_the_profile(profile_file, tmp_path, capsys):
    profile_file.write_text("{not json")
    assert main(TRAIN + ["--attention", "heads", "--out", str(tmp_path / "run")]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["attention"] == "heads"
    assert "warning" in captured.err and str(profile_file) in captured.err


def test_calibrated_profile_reaches_the_ranks(profile_file, tmp_path, capsys):
    profile_file.write_text(json.dumps({
        "name": "calibrated here", "matmul_flops_best": 1e11,
        "collectives": {"2": {"all_reduce": {"alpha_s": 3e-4, "bandwidth": 1e9}}}}))
    assert main(TRAIN + ["--nproc", "2", "--tp", "2", "--out", str(tmp_path / "run")]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert "calibrated here" in metrics["attention_reason"]


def test_train_on_simulated_nodes(tmp_path, capsys):
    assert main(TRAIN + ["--nproc", "4", "--tp", "2", "--dp", "2", "--ranks-per-node", "2",
                         "--out", str(tmp_path / "run")]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["ranks_per_node"] == 2 and metrics["config"]["ranks_per_node"] == 2
    assert set(metrics["comm_by_level"]) == {"intra", "inter"}  # TP in a node, DP across
    assert set(metrics["comm_by_level"]["inter"]) == {"all_reduce"}


def test_ranks_per_node_must_divide_the_processes(capsys):
    assert main(TRAIN + ["--nproc", "4", "--tp", "2", "--ranks-per-node", "3"]) == 2
    err = capsys.readouterr().err
    assert "ranks_per_node (3) must divide the world size (4)" in err and "Traceback" not in err
