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
