"""``shard_parameters`` on Hugging Face models: GPT-2 (Conv1D weights, tied embeddings), Llama (with
sequence parallelism and Hugging Face's own full recompute) and Mixtral (experts over tp, or over
ep with dense parameters over dp × ep) at 4 ranks equal the unsharded model after 3 AdamW steps;
``train --model DIR --zero 3`` (``from_pretrained``, then FSDP2) equals one rank."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F

import hf_tiny
from helpers import assert_rel
from ops_transformer import gather_full_state_dict, init_parallel, parallelize, shard_parameters

tr = pytest.importorskip("transformers")
tr.logging.set_verbosity_error()
B, T, STEPS = 4, 16, 3


def _batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, hf_tiny.VOCAB, (B, T + 1), generator=g) for _ in range(STEPS)]


def _train(family, tp=1, ep=1, shard=False, **options):
    ctx = init_parallel(tp=tp, ep=ep)
    model = hf_tiny.build(family)
    if ctx.world_size > 1:
        model = parallelize(model, ctx, **options)
        if shard:
            with warnings.catch_warnings():  # (FSDP2: the padded vocabulary's logits are a view)
                warnings.simplefilter("ignore", UserWarning)
                shard_parameters(model, ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-3, weight_decay=0.1)
    n, r = ctx.dp_ep_size, ctx.dp_ep_rank
    for batch in _batches():
        rows = batch[r * B // n:(r + 1) * B // n]
        logits = model(input_ids=rows[:, :-1]).logits.float()
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    return gather_full_state_dict(model, ctx)


def _assert_equal(results, reference):
    for state in results:
        assert list(state) == list(reference)
        for key, value in reference.items():
            assert_rel(state[key], value, rtol=1e-5, what=key, floor=0.02)


@pytest.mark.parametrize("family,layout,options", [
    ("gpt2", {"tp": 2}, {}),
    pytest.param("llama", {"tp": 2}, {"sequence_parallel": True, "recompute": "full"},
                 marks=pytest.mark.slow),
    pytest.param("mixtral", {"tp": 2}, {}, marks=pytest.mark.slow),
    pytest.param("mixtral", {"ep": 2}, {}, marks=pytest.mark.slow),
], ids=["gpt2-dp2xtp2", "llama-dp2xtp2-sp-full", "mixtral-dp2xtp2", "mixtral-dp2xep2"])
def test_hugging_face_models_sharded_equal_the_unsharded_model(run_ranks, family, layout,
                                                               options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        reference = run_ranks(_train, 1, family)[0]
        _assert_equal(run_ranks(_train, 4, family, shard=True, **layout, **options), reference)


@pytest.mark.slow
def test_train_model_dir_with_zero3_equals_one_rank(tmp_path_factory, tmp_path, capsys):
    from ops_transformer.cli.main import main

    path = hf_tiny.checkpoint(tmp_path_factory, "llama", tokenizer=True)
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"{hf_tiny.TEXT} #{i}"}) for i in range(12)))
    steps = ["--model", str(path), "--data", str(data), "--steps", "4", "--batch", "4", "--seq",
             "32", "--lr", "1e-3", "--no-progress", "--json"]
    runs = {}
    for name, layout in (("one", ["--nproc", "1"]),
                         ("zero3", ["--nproc", "4", "--tp", "2", "--zero", "3"])):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # ZeRO-3 runs as asked: no warning
            assert main(["train", *steps, *layout, "--out", str(tmp_path / name)]) == 0
        capsys.readouterr()
        runs[name] = json.loads((tmp_path / name / "metrics.json").read_text())
    assert runs["zero3"]["config"]["zero"] == 3
    assert_rel(torch.tensor(runs["zero3"]["losses"]), torch.tensor(runs["one"]["losses"]),
               what="losses")
    held, dense = runs["zero3"]["model_state_bytes_per_rank"], runs["one"]
    assert held["params"] < dense["model_state_bytes_per_rank"]["params"] / 3.5  # ≈ 1/(dp·tp)
