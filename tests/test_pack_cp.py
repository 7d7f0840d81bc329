"""``train --model --pack {docs,naive}`` and ``train --model --cp 2``: packed documents stay apart by
default (the losses differ from the naive packing's), and a Hugging Face Llama split over cp 2
ranks has the one-process losses, with documents."""

from __future__ import annotations

import json

import pytest
import torch

import hf_tiny
from helpers import assert_rel
from ops_transformer.cli.main import main

pytest.importorskip("transformers")
STEPS = ["--steps", "4", "--batch", "4", "--seq", "32", "--lr", "1e-3", "--no-progress"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"{hf_tiny.TEXT[:40 + 9 * i]} #{i}"})
                              for i in range(12)) + "\n")
    return path


def _losses(tmp_path_factory, model, data, *flags):
    out = tmp_path_factory.mktemp("run")
    argv = ["train", "--model", str(model), "--data", str(data), *flags, *STEPS, "--out", str(out)]
    assert main(argv) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    return metrics, torch.tensor(metrics["losses"])


def test_pack_docs_is_the_default_and_cp2_has_its_losses(tmp_path_factory, data):
    model = hf_tiny.checkpoint(tmp_path_factory, "llama", tokenizer=True)
    one, docs = _losses(tmp_path_factory, model, data, "--nproc", "1")
    _, naive = _losses(tmp_path_factory, model, data, "--nproc", "1", "--pack", "naive")
    cp, split = _losses(tmp_path_factory, model, data, "--nproc", "2", "--cp", "2",
                        "--cp-strategy", "allgather_kv")
    assert one["config"]["pack"] == "docs"
    assert (docs - naive).abs().max() > 1e-3  # attention across documents changes the loss
    assert_rel(split, docs, what="cp 2 losses")
    assert cp["cp"] == 2 and cp["cp_strategy"] == "allgather_kv"


def test_pack_docs_dp2_with_accumulation_has_the_one_process_losses(tmp_path_factory, data):
    """Rows hold different numbers of targets under --pack docs: the step's loss is the mean over
    the global batch's targets at any dp and accumulation."""
    model = hf_tiny.checkpoint(tmp_path_factory, "llama", tokenizer=True)
    _, one = _losses(tmp_path_factory, model, data, "--nproc", "1")
    _, dp2 = _losses(tmp_path_factory, model, data, "--nproc", "2", "--dp", "2", "--grad-accum",
                     "2")
    assert_rel(dp2, one, what="dp 2 losses")
