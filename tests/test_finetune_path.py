"""Issue 35: the fine-tune → interrupt → resume → export path as a new user walks it. Each test
names the defect it guards against; every one is CLI-level."""

from __future__ import annotations

import json

import pytest
import torch

import hf_tiny
from ops_transformer.cli.main import main

tr = pytest.importorskip("transformers")
tr.logging.set_verbosity_error()

STEPS = ["--steps", "4", "--batch", "4", "--seq", "32", "--lr", "1e-3", "--no-progress", "--json"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"{hf_tiny.TEXT} #{i}"}) for i in range(12)))
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return hf_tiny.checkpoint(tmp_path_factory, "llama", tokenizer=True)


def _train(model, data, root, *flags) -> dict:
    argv = ["train", "--model", str(model), "--data", str(data), *STEPS,
            "--ckpt-dir", str(root / "ckpt"), "--out", str(root / "run"), *flags]
    assert main(argv) == 0
    return json.loads((root / "run" / "metrics.json").read_text())


@pytest.fixture(scope="module")
def zero3(tmp_path_factory, llama, data):
    """A ``--zero 3`` fine-tune on dp 2 and the same run at ``--zero 0``."""
    roots = {}
    for stage in ("3", "0"):
        roots[stage] = tmp_path_factory.mktemp(f"zero{stage}")
        _train(llama, data, roots[stage], "--nproc", "2", "--dp", "2", "--zero", stage)
    return roots


# 1 — ZeRO-3 recorded FSDP2's wrapper class (FSDPLlamaForCausalLM): its export crashed
def test_zero3_checkpoint_exports_as_the_zero0_run(zero3, capsys):
    metrics = json.loads((zero3["3"] / "run" / "metrics.json").read_text())
    assert metrics["model_class"] == "LlamaForCausalLM"
    assert main(["checkpoint", "inspect", str(zero3["3"] / "ckpt")]) == 0
    assert "FSDP" not in capsys.readouterr().out
    for stage, root in zero3.items():
        assert main(["checkpoint", "export", str(root / "ckpt"), "--out", str(root / "hf")]) == 0
    ours = tr.AutoModelForCausalLM.from_pretrained(zero3["3"] / "hf").state_dict()
    theirs = tr.AutoModelForCausalLM.from_pretrained(zero3["0"] / "hf").state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.allclose(ours[name], theirs[name], rtol=0, atol=1e-6), name


def _files(root) -> dict:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


# 2 — an export over a base model deleted its shards and left a stale index: refused, or
# replaced whole with --overwrite; a failure midway leaves the old directory as it was
def test_export_never_destroys_what_is_at_out(zero3, tmp_path_factory, tmp_path, capsys,
                                              monkeypatch):
    import shutil

    from ops_transformer.checkpoint import export as ex

    base = tmp_path / "base"  # a base model in several files with an index
    shutil.copytree(hf_tiny.checkpoint(tmp_path_factory, "llama_sharded"), base)
    before = _files(base)
    assert "model.safetensors.index.json" in before
    ckpt = str(zero3["0"] / "ckpt")
    capsys.readouterr()
    assert main(["checkpoint", "export", ckpt, "--out", str(base)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--overwrite" in err and "not empty" in err, err
    assert _files(base) == before

    def broken(state, manifest, out):  # writes part of the directory, then fails
        (out / "config.json").write_text("{}")
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(ex, "export_huggingface", broken)
        with pytest.raises(OSError):
            main(["checkpoint", "export", ckpt, "--out", str(base), "--overwrite"])
    assert _files(base) == before and sorted(p.name for p in tmp_path.iterdir()) == ["base"]

    assert main(["checkpoint", "export", ckpt, "--out", str(base), "--overwrite"]) == 0
    assert "model.safetensors.index.json" not in _files(base)  # nothing stale, nothing mixed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]
    tr.AutoModelForCausalLM.from_pretrained(base)  # loads
    single = tmp_path / "m.safetensors"  # a file: refused too, then replaced atomically
    single.write_bytes(b"keep")
    assert main(["checkpoint", "export", ckpt, "--out", str(single)]) == 2
    assert single.read_bytes() == b"keep"
    assert main(["checkpoint", "export", ckpt, "--out", str(single), "--overwrite"]) == 0
    assert single.stat().st_size > 1000


# 3 — a mistyped --ckpt-dir with --resume started over silently
def test_resume_that_finds_nothing_says_so_and_strict_refuses(tmp_path, capsys):
    missing = tmp_path / "chekpoints"  # a typo: nothing there
    argv = ["train", "--steps", "1", "--batch", "2", "--seq", "16", "--no-progress",
            "--ckpt-dir", str(missing), "--out", str(tmp_path / "run"), "--resume"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"no checkpoint in {missing}: starting from step 0" in err, err
    assert (missing / "latest").exists()  # the run's own checkpoint
    other = tmp_path / "ckpt-typo"
    argv[argv.index(str(missing))] = str(other)
    assert main([*argv, "strict", "--out", str(tmp_path / "strict")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--resume strict" in err and str(other) in err, err
    assert not (tmp_path / "strict").exists() and not other.exists()


# 4 — SIGTERM of the launcher ended with -15 and no word; Ctrl-C with "interrupted" glued to the
# progress bar; neither kept the metrics
TINY = ["--batch", "2", "--seq", "16", "--no-progress"]


def test_sigterm_of_the_launcher_keeps_the_metrics_and_says_how_to_resume(tmp_path):
    import os
    import shlex
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent / "src")}
    argv = ["train", "--nproc", "2", "--tp", "2", "--steps", "100000", *TINY,
            "--ckpt-dir", "ckpt", "--save-every", "2", "--out", "run"]
    job = subprocess.Popen([sys.executable, "-m", "ops_transformer", *argv], cwd=tmp_path,
                           env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "ckpt" / "step-00000004").is_dir() and time.monotonic() < deadline:
        time.sleep(0.1)
    job.send_signal(signal.SIGTERM)
    err = job.communicate(timeout=60)[1]
    assert job.returncode == 143, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["interrupted"] == "SIGTERM" and len(metrics["losses"]) >= 4
    assert (tmp_path / "run" / "loss.png").stat().st_size > 0
    last = metrics["last_checkpoint"]
    assert last in err and (tmp_path / last / "checkpoint.json").is_file()
    command = err.split("resume with: ")[1].strip()
    assert command == metrics["resume_command"] and command.endswith("--resume")
    saved = int(last.rsplit("-", 1)[1])
    resumed = shlex.split(command)[1:] + ["--steps", str(saved + 1), "--json", "--nproc", "1"]
    done = subprocess.run([sys.executable, "-m", "ops_transformer", *resumed], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout[done.stdout.index("{"):])["resumed_from"] == saved


def test_ctrl_c_writes_what_ran_and_exits_130(tmp_path, monkeypatch, capsys):
    from ops_transformer.training.loop import TrainState

    step = TrainState.step

    def interrupted_at_the_fourth(self, x, y):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 4:
            raise KeyboardInterrupt
        return step(self, x, y)

    monkeypatch.setattr(TrainState, "step", interrupted_at_the_fourth)
    argv = ["train", "--steps", "50", *TINY, "--ckpt-dir", str(tmp_path / "ckpt"),
            "--save-every", "2", "--out", str(tmp_path / "run")]
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "interrupted (SIGINT) after step 3 of 50" in err, err
    assert f"last checkpoint {tmp_path / 'ckpt' / 'step-00000002'}" in err
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert len(metrics["losses"]) == 3 and metrics["steps_done"] == 3


def test_an_interrupt_before_the_first_step_leaves_no_empty_out(tmp_path, monkeypatch, capsys):
    import os
    import signal
    import time

    import ops_transformer.training.loop as train

    def terminated(cfg, ctx):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises in here

    monkeypatch.setattr(train, "setup_training", terminated)
    argv = ["train", "--steps", "5", *TINY, "--ckpt-dir", str(tmp_path / "ckpt"),
            "--out", str(tmp_path / "run")]
    assert main(argv) == 143
    err = capsys.readouterr().err
    assert "interrupted (SIGTERM) after step 0 of 5" in err and "no checkpoint" in err, err
    assert sorted(os.listdir(tmp_path)) == []


# 5 — a resume without --batch silently changed the global batch 4 → 8 (and said both "kept"
# and "changed"); the checkpoint's batch, sequence, schedule and LoRA settings are the run's
def test_resume_keeps_the_runs_settings_unless_overridden(tmp_path, capsys):
    first = ["train", "--steps", "3", "--batch", "4", "--seq", "24", "--lr", "2e-3",
             "--lr-schedule", "cosine", "--warmup", "1", "--lora-rank", "4", "--no-progress",
             "--ckpt-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "a")]
    assert main(first) == 0
    capsys.readouterr()
    again = ["train", "--steps", "5", "--no-progress", "--json", "--resume",
             "--ckpt-dir", str(tmp_path / "ckpt")]
    assert main([*again, "--out", str(tmp_path / "b")]) == 0
    captured = capsys.readouterr()
    metrics = json.loads(captured.out[captured.out.index("{"):])
    config = metrics["config"]
    assert (config["batch"], config["seq"], config["lr"], config["lr_schedule"],
            config["warmup"], config["lora_rank"]) == (4, 24, 2e-3, "cosine", 1, 4)
    assert metrics["resumed_from"] == 3
    said = [line for line in captured.err.splitlines() if "--resume from step 3" in line]
    assert len(said) == 1 and "batch 4" in said[0] and "seq 24" in said[0], captured.err
    assert "data stream" not in captured.err and "→" not in captured.err, captured.err
    assert main([*again, "--steps", "6", "--seq", "16", "--out", str(tmp_path / "c")]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out[captured.out.index("{"):])["config"]["seq"] == 16
    assert "as given: --seq 16 (the checkpoint's: 24)" in captured.err, captured.err


# 8 — the end-of-run summary was ~500 columns wide ("overlap (auto)" alone ~480) and said "MB"
# for 2^20 bytes
def test_the_end_of_run_summary_fits_100_columns(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # short paths: a path the user gives is printed whole
    argv = ["train", "--nproc", "2", "--tp", "2", "--steps", "2", *TINY, "--overlap", "auto",
            "--ckpt-dir", "ckpt", "--out", "run"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(map(len, lines)) <= 100, max(lines, key=len)
    for label in ("checkpoints", "trainable parameters", "wall time"):
        assert any(line.startswith(label) for line in lines), (label, out)
    assert "checkpoints             ckpt" in out and " MiB" in out and " MB" not in out
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert len(metrics["overlap_reason"]) > 100  # the long reason kept whole
    assert metrics["wall_s"] > 0 and metrics["trainable_params"] == metrics["params"]


# 9 — --seq beyond max_position_embeddings trained with no word; a LoRA rank other than the
# checkpoint's was found only after the ranks had loaded the model
def test_checks_that_need_no_rank_come_before_the_ranks(llama, data, tmp_path, capsys,
                                                        monkeypatch):
    import ops_transformer.cli.train as cli_train

    monkeypatch.setattr(cli_train, "launch", lambda *a, **k: pytest.fail("ranks started"))
    long = ["train", "--model", str(llama), "--data", str(data), "--nproc", "2", "--seq", "512",
            "--out", str(tmp_path / "run")]
    assert main(long) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--seq 512" in err and "128 positions" in err, err
    assert not (tmp_path / "run").exists()
    lora = ["train", "--steps", "2", *TINY, "--lora-rank", "4", "--ckpt-dir",
            str(tmp_path / "ckpt"), "--out", str(tmp_path / "a")]
    monkeypatch.undo()
    assert main(lora) == 0
    monkeypatch.setattr(cli_train, "launch", lambda *a, **k: pytest.fail("ranks started"))
    capsys.readouterr()
    again = [*lora, "--steps", "4", "--resume", "--lora-rank", "8", "--nproc", "2"]
    assert main(again) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--lora-rank 8" in err and "rank 4" in err, err


# 11 — the smaller items: the loss plot of a rebalanced resume named one layout for both parts;
# embed's table lost its alignment on negative similarities
def test_loss_plot_of_a_rebalanced_resume_names_both_layouts(tmp_path, capsys):
    from ops_transformer.training.loop import loss_series

    base = ["train", *TINY, "--ckpt-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "run")]
    assert main([*base, "--steps", "2", "--nproc", "2", "--tp", "2"]) == 0
    assert main([*base, "--steps", "4", "--nproc", "1", "--resume"]) == 0
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    series = loss_series(metrics)
    assert list(series) == ["steps 0-1: tp=2 dp=1", "steps 2-3: tp=1 dp=1 (rebalanced)"]
    assert series["steps 0-1: tp=2 dp=1"] == metrics["losses"][:2]
    assert (tmp_path / "run" / "loss.png").stat().st_size > 0


def test_embed_table_aligns_negative_similarities(monkeypatch, capsys):
    import ops_transformer.cli.embed as embed

    result = {"tp": 1, "texts": ["a", "b"], "dim": 4,
              "similarity": [[1.0, -0.0123], [-0.0123, 1.0]], "embeddings": []}
    monkeypatch.setattr(embed, "check_model_dir", lambda path, command: (path, None))
    monkeypatch.setattr(embed, "check_split", lambda *a: None)
    monkeypatch.setattr(embed, "run_on_ranks", lambda *a, **k: result)
    assert main(["embed", "--model", "m", "--text", "a", "--text", "b"]) == 0
    import re

    rows = capsys.readouterr().out.splitlines()[1:]
    ends = [[m.end() for m in re.finditer(r"-?\d\.\d{4}", row)] for row in rows]
    assert len(ends[0]) == 2 and ends[0] == ends[1], rows  # each column ends in one place


def test_finetuning_docs_list_every_zero_stage_train_takes():
    from pathlib import Path

    from ops_transformer.training.optimizer import ZERO_STAGES

    docs = (Path(__file__).resolve().parent.parent / "docs" / "finetuning.md").read_text()
    stages = ",".join(str(s) for s in ZERO_STAGES if s)
    assert f"`--zero {{{stages}}}`" in docs, stages


# 6 — profile, diagnose and sweep took --model as an alias of --preset ("unknown preset" for a
# directory); check took it already
def test_measuring_commands_take_a_model_directory(llama, data, tmp_path, capsys):
    model = ["--model", str(llama), "--data", str(data), "--batch", "2", "--seq", "16"]
    assert main(["profile", *model, "--nproc", "2", "--tp", "2", "--steps", "1", "--warmup", "0",
                 "--json", "--out", str(tmp_path / "p")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["config"]["model"] == str(llama) and summary["tp"] == 2
    assert main(["diagnose", *model, "--tp", "2", "--static", "--json"]) in (0, 1)
    assert "diagnostics" in json.loads(capsys.readouterr().out)
    assert main(["sweep", *model, "--tp", "2", "--steps", "1", "--warmup", "0", "--json",
                 "--no-progress", "--out", str(tmp_path / "s")]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["status"] for r in rows] == ["ok"], rows
    assert main(["check", "--model", str(llama), "--tp", "2", "--json"]) == 0
    capsys.readouterr()
    assert main(["profile", "--model", "tiny", "--nproc", "1", "--steps", "1", "--warmup", "0",
                 "--batch", "2", "--seq", "16", "--json", "--out", str(tmp_path / "t")]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["preset"] == "tiny"  # the old alias



# 6 — bench had no --model (the last of the measuring commands without it)
def test_bench_takes_a_model_directory(llama, capsys):
    assert main(["bench", "--model", str(llama), "--batch", "2", "--seq", "16", "--rounds", "1",
                 "--steps", "1", "--warmup", "0", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["row"]
    assert set(row["ms"]) == {"ours", "ours-proj", "dtensor", "plain", "tp1"}
    assert row["config"]["model_type"] == "llama" and row["size"]["model"] == str(llama)
    assert max(max(d) for d in row["loss_rel_diff"].values()) < 1e-4  # every method: the model's
    assert main(["bench", "--model", str(llama), "--preset", "tiny"]) == 2
    assert "both name the model" in capsys.readouterr().err
    assert main(["bench", "--model", str(llama), "--seq", "4096"]) == 2
    assert "max_position_embeddings (128)" in capsys.readouterr().err

# 10 — first contact: `make demo` on a fresh clone took ~4.5 min (3.5 installing), the README said
# "~30 s", and the install printed nothing for minutes
def test_readme_states_install_and_demo_time_and_the_install_shows_progress():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    intro = (root / "README.md").read_text().split("## Install")[0]
    assert re.search(r"install.{0,200}?about \*\*[\d.]+ minutes\*\*", intro, re.S), intro
    assert re.search(r"demo .{0,200}?about \*\*[\d.]+ minutes?\*\*", intro, re.S), intro
    assert "~30 s" not in intro
    make = (root / "Makefile").read_text()
    recipe = make[make.index("$(STAMP):"):make.index("install: $(STAMP)")]
    installs = [line for line in recipe.splitlines() if "pip install" in line]
    assert len(installs) == 3 and sum(" -q " in line for line in installs) <= 1, installs
    assert recipe.count("@echo") >= 4  # each step named
