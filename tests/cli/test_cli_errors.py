"""First-run defects of the command line: output locations checked before any work, one line per
user error (exit code 2, no traceback unless ``--debug``), flags that conflict or make no sense
refused, ``--version``, ``--launch-timeout``, and the launcher's thread policy for a single-process
``train``."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from ops_transformer.cli import calibrate as cli_calibrate
from ops_transformer.cli import demo as cli_demo
from ops_transformer.cli import train as cli_train
from ops_transformer.cli.main import main


def one_error_line(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def no_work(monkeypatch):
    """Training, launching and calibrating fail the test: errors must come before any work."""
    def work(*args, **kwargs):
        raise AssertionError("work started before the arguments were checked")

    for module, names in ((cli_train, ("launch", "train_worker")),
                          (cli_demo, ("launch", "train_worker")),
                          (cli_calibrate, ("calibrate",))):
        for name in names:
            monkeypatch.setattr(module, name, work)


# --- output locations, checked first -----------------------------------------------------------

@pytest.mark.parametrize("command", [["train", "--nproc", "2", "--tp", "2"], ["demo"]])
def test_out_naming_an_existing_file(tmp_path, capsys, no_work, command):
    existing = tmp_path / "metrics"
    existing.write_text("keep me")
    assert main(command + ["--out", str(existing)]) == 2
    one_error_line(capsys, "--out", str(existing), "is an existing file")
    assert existing.read_text() == "keep me"


@pytest.mark.parametrize("command", [["train"], ["demo"]])
def test_out_in_a_place_that_cannot_be_created(tmp_path, capsys, no_work, command):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(command + ["--out", str(blocker / "run")]) == 2
    one_error_line(capsys, "--out", "cannot be created")


def test_calibrate_out_naming_a_directory(tmp_path, capsys, no_work):
    assert main(["calibrate", "--quick", "--out", str(tmp_path)]) == 2
    one_error_line(capsys, "--out", "is a directory")
    assert list(tmp_path.iterdir()) == []  # no DIR.tmp or anything else


def test_calibrate_out_under_a_file(tmp_path, capsys, no_work):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["calibrate", "--quick", "--out", str(blocker / "profile.json")]) == 2
    one_error_line(capsys, "--out", "cannot be created")


def test_plan_out_under_a_file(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["plan", "--model", "gpt3-175b", "--out", str(blocker / "plan.json")]) == 2
    one_error_line(capsys, "--out", "cannot be created")


# --- flags -------------------------------------------------------------------------------------

def test_plan_conflicting_with_explicit_layout_flags(tmp_path, capsys, no_work):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"best": {"tp": 2, "dp": 1, "ep": 1, "attention": "heads"}}))
    assert main(["train", "--plan", str(plan), "--tp", "1", "--attention", "kv_split"]) == 2
    one_error_line(capsys, "--plan", "--tp 1 (the plan has 2)",
                   "--attention kv_split (the plan has heads)")


def test_plan_with_agreeing_flags_is_accepted(tmp_path, monkeypatch):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"best": {"tp": 2, "dp": 1, "ep": 1, "attention": "heads"}}))
    seen = {}
    monkeypatch.setattr(cli_train, "run_training",
                        lambda cfg, nproc, timeout: seen.update(cfg=cfg, nproc=nproc))
    assert main(["train", "--plan", str(plan), "--tp", "2"]) == 0
    assert (seen["cfg"].tp, seen["cfg"].attention, seen["nproc"]) == (2, "heads", 2)


def test_negative_temperature(capsys):
    assert main(["generate", "--model", "unused", "--prompt", "x", "--temperature", "-0.5"]) == 2
    one_error_line(capsys, "--temperature", "-0.5")


def test_version(capsys):
    from ops_transformer import __version__

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip().startswith(f"ops-transformer {__version__}")


def test_launch_timeout_reaches_the_launcher(monkeypatch, tmp_path):
    seen = {}

    def launch(fn, nprocs, *args, timeout):
        seen.update(nprocs=nprocs, timeout=timeout)
        return [None] * nprocs

    monkeypatch.setattr(cli_train, "launch", launch)
    assert main(["train", "--nproc", "2", "--tp", "2", "--launch-timeout", "42",
                 "--out", str(tmp_path)]) == 0
    assert seen == {"nprocs": 2, "timeout": 42.0}


def test_nonpositive_launch_timeout(capsys, no_work):
    assert main(["train", "--nproc", "2", "--launch-timeout", "0"]) == 2
    one_error_line(capsys, "--launch-timeout", "positive")


def test_single_process_train_uses_the_launchers_thread_policy(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(cli_train, "train_worker", lambda cfg: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert main(["train", "--steps", "1", "--out", str(tmp_path)]) == 0
        assert seen == [1]  # one intra-op thread, as each launched rank has
        assert torch.get_num_threads() == 2  # restored afterwards
    finally:
        torch.set_num_threads(before)


def test_debug_shows_the_traceback(capsys):
    with pytest.raises(ValueError, match="--steps must be at least 1"):
        main(["train", "--steps", "0", "--debug"])
    with pytest.raises(ValueError, match="--steps must be at least 1"):
        main(["--debug", "train", "--steps", "0"])


# --- Hugging Face model directories ------------------------------------------------------------

def _saved(tmp_path, capsys, family="llama"):
    tr = pytest.importorskip("transformers")
    torch.manual_seed(0)
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=2, max_position_embeddings=32, vocab_size=300)
    model = (tr.BertModel(tr.BertConfig(**small)) if family == "bert"
             else tr.LlamaForCausalLM(tr.LlamaConfig(**small)))
    model.save_pretrained(tmp_path)
    capsys.readouterr()  # its progress bar
    return tmp_path


def test_corrupt_config_json(tmp_path, capsys):
    model = _saved(tmp_path, capsys)
    (model / "config.json").write_text('{"model_type": "llama", ')
    assert main(["generate", "--model", str(model), "--prompt", "x"]) == 2
    one_error_line(capsys, str(model / "config.json"), "not a readable JSON config")


def test_config_of_an_unknown_model(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "no-such-model"}')
    assert main(["embed", "--model", str(tmp_path), "--text", "x"]) == 2
    one_error_line(capsys, str(tmp_path / "config.json"), "not a valid model config")


def test_missing_weights(tmp_path, capsys):
    model = _saved(tmp_path, capsys)
    (model / "model.safetensors").unlink()
    assert main(["generate", "--model", str(model), "--prompt", "x"]) == 2
    one_error_line(capsys, "has no weights", "model.safetensors")


def test_truncated_weights(tmp_path, capsys):
    model = _saved(tmp_path, capsys)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    assert main(["generate", "--model", str(model), "--prompt", "x"]) == 2
    one_error_line(capsys, str(weights), "is truncated")


def test_empty_prompt(tmp_path, capsys):
    model = _saved(tmp_path, capsys)
    assert main(["generate", "--model", str(model), "--prompt", ""]) == 2
    one_error_line(capsys, "--prompt is empty")


def test_transformers_not_installed(tmp_path, capsys, monkeypatch):
    model = _saved(tmp_path, capsys)
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now fails
    assert main(["generate", "--model", str(model), "--prompt", "x"]) == 2
    one_error_line(capsys, "transformers", "install the `hf` extra", "ops-transformer[hf]")


def test_generate_refuses_an_encoder(tmp_path, capsys):
    model = _saved(tmp_path, capsys, "bert")
    assert main(["generate", "--model", str(model), "--prompt", "x"]) == 2
    one_error_line(capsys, "BertModel", "not a causal language model", "embed")


# --- one result per job ------------------------------------------------------------------------

@pytest.mark.parametrize("rank", ["0", "1"])
def test_only_rank_0_of_a_torchrun_job_prints(monkeypatch, capsys, rank):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["plan", "--model", "gpt3-175b", "--gpu", "a100-80gb", "--gpus", "8", "--top",
                 "2", "--json"]) == 0
    out = capsys.readouterr().out
    if rank == "0":
        assert json.loads(out)["candidates"]  # exactly one document
    else:
        assert out == ""


# --- a failed rank (issue #30 item 8) ------------------------------------------------------------

def _rank1_fails_at_step(monkeypatch, how):
    import os

    original = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        if os.environ.get("RANK") == "1":
            how()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)


TRAIN2 = ["train", "--nproc", "2", "--tp", "2", "--steps", "2", "--batch", "2", "--seq", "16",
          "--no-progress"]


def test_a_killed_rank_is_its_cause_in_one_line(tmp_path, monkeypatch, capsys):
    import os
    import signal

    _rank1_fails_at_step(monkeypatch, lambda: os.kill(os.getpid(), signal.SIGKILL))
    assert main(TRAIN2 + ["--out", str(tmp_path / "run")]) == 1
    one_error_line(capsys, "train: error", "rank 1 exited", "SIGKILL")


def test_a_crashed_rank_is_its_cause_in_one_line_and_debug_shows_the_traceback(tmp_path,
                                                                              monkeypatch, capsys):
    from ops_transformer import RankError

    def crash():
        raise RuntimeError("disk controller on fire")

    _rank1_fails_at_step(monkeypatch, crash)
    assert main(TRAIN2 + ["--out", str(tmp_path / "run")]) == 1
    one_error_line(capsys, "train: error", "[rank 1/2]", "disk controller on fire", "--debug")
    with pytest.raises(RankError, match="disk controller on fire"):
        main(["--debug"] + TRAIN2 + ["--out", str(tmp_path / "run2")])
