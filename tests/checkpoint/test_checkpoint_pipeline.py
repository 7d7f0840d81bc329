"""Checkpoints at pp > 1 hold dense coordinates: each stage writes the layers it holds under their
dense names, the tied embedding once (its last-stage copy under the embedding's name). Saved at
pp 2 (× dp 2 with ZeRO-2), they resume at pp 1 × tp 2 with the weights bit-identical and the next
steps' losses the pp 2 run's; ``train --pp 2 --resume`` equals a run that never stopped, bit for
bit."""

from __future__ import annotations

import json

import pytest
import torch

from ops_transformer import (GPT, gather_full_state_dict, init_parallel, parallelize, pipeline,
                             zero_optimizer)
from ops_transformer.checkpoint import load_checkpoint, save_checkpoint
from ops_transformer.cli.main import main
from ops_transformer.models.gpt import GPTConfig

CFG = GPTConfig(vocab_size=64, n_layers=4, d_model=32, n_heads=4, d_ff=64, max_seq_len=16)
B, S = 4, 8


def _batch(i):
    batch = torch.randint(0, CFG.vocab_size, (B, S + 1), generator=torch.Generator().manual_seed(i))
    return batch[:, :-1], batch[:, 1:]


def _optimizer(model, ctx, zero):
    if zero == 3:  # FSDP2 per stage (after pipeline: each stage module a root)
        from ops_transformer.memory.fsdp import shard_parameters

        shard_parameters(model, ctx)
        return torch.optim.AdamW(model.parameters(), lr=1e-2)
    if zero:
        return zero_optimizer(model, ctx, torch.optim.AdamW, stage=zero, lr=1e-2)
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _save_at_pp2(root, dp, zero):
    """pp 2 × dp ``dp``: 2 steps, a checkpoint, then 2 more: the weights saved (this rank's, by
    dense name) and the later losses."""
    torch.set_num_threads(1)
    ctx = init_parallel(pp=2, dp=dp)
    torch.manual_seed(0)
    model = parallelize(GPT(CFG), ctx)
    pipe = pipeline(model, ctx, "1f1b", microbatches=2)
    opt = _optimizer(model, ctx, zero)
    losses = []
    for i in range(4):
        if i == 2:
            save_checkpoint(root, model, opt, ctx, step=2)
            weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                       for n, p in model.named_parameters()}
        idx, y = (t.chunk(dp)[ctx.dp_rank] for t in _batch(i))
        loss = pipe.step(idx, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(None if loss is None else loss.item())
    return weights, losses[2:]


def _resume_at_tp2(root):
    torch.set_num_threads(1)
    ctx = init_parallel(tp=2)
    torch.manual_seed(1)  # another init: everything comes from the checkpoint
    model = parallelize(GPT(CFG), ctx)
    opt = _optimizer(model, ctx, 0)
    info = load_checkpoint(root, model, opt, ctx)
    weights = gather_full_state_dict(model, ctx)
    losses = []
    for i in (2, 3):
        loss = model(*_batch(i))[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return weights, losses, info["saved_layout"]


@pytest.mark.parametrize("dp, zero", [(1, 0), (2, 2),
                                      pytest.param(2, 3, marks=pytest.mark.slow)])
def test_save_at_pp2_resume_at_tp2_is_bit_identical(run_ranks, tmp_path, dp, zero):
    saved = run_ranks(_save_at_pp2, 2 * dp, str(tmp_path), dp, zero)
    weights, losses, layout = run_ranks(_resume_at_tp2, 2, str(tmp_path))[0]
    assert layout == {"world_size": 2 * dp, "dp": dp, "tp": 1, "ep": 1, "pp": 2}
    stages = {}
    for stage_weights, _ in saved:
        stages.update(stage_weights)
    # every dense tensor, once; the last stage's tied copy equals the embedding bit for bit
    assert set(stages) == set(weights)
    assert torch.equal(stages["lm_head.weight"], stages["tok_emb.weight"])
    for name, tensor in weights.items():
        assert torch.equal(stages[name], tensor), name
    last = [ls for _, ls in saved if ls[0] is not None]  # the last stage's replicas' losses
    want = [sum(step) / dp for step in zip(*last)]  # their mean: the dense loss
    # the next two steps: Adam's moments came back too (fp32, another summation order)
    assert losses == pytest.approx(want, rel=1e-6)


def _save_dense(root):
    """One process: 2 AdamW steps and a checkpoint; the weights and the next 2 losses."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = _optimizer(model, None, 0)
    losses = []
    for i in range(4):
        if i == 2:
            save_checkpoint(root, model, opt, init_parallel(), step=2)
            weights = {n: p.detach().clone() for n, p in model.state_dict().items()}
        loss = model(*_batch(i))[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return weights, losses[2:]


def _resume_at_pp2(root):
    torch.set_num_threads(1)
    ctx = init_parallel(pp=2)
    torch.manual_seed(1)
    model = GPT(CFG)
    pipe = pipeline(model, ctx, "gpipe", microbatches=2)
    opt = _optimizer(model, ctx, 0)
    load_checkpoint(root, model, opt, ctx)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = []
    for i in (2, 3):
        loss = pipe.step(*_batch(i))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(None if loss is None else loss.item())
    return weights, losses


def test_save_at_pp1_resume_at_pp2(run_ranks, tmp_path):
    """The other way: each stage reads its layers (the last one the tied embedding into its
    head) from a one-process checkpoint."""
    want_weights, want_losses = run_ranks(_save_dense, 1, str(tmp_path))[0]
    for weights, losses in run_ranks(_resume_at_pp2, 2, str(tmp_path)):
        for name, tensor in weights.items():
            assert torch.equal(tensor, want_weights[name]), name
        if losses[0] is not None:
            assert losses == pytest.approx(want_losses, rel=1e-6)


ARGS = ["--preset", "tiny", "--batch", "4", "--seq", "32", "--no-progress", "--nproc", "2",
        "--pp", "2", "--microbatches", "2"]


def _train(tmp_path, name, *flags):
    out = tmp_path / name
    assert main(["train", *ARGS, *flags, "--out", str(out)]) == 0
    return json.loads((out / "metrics.json").read_text())


@pytest.mark.slow  # ~5 s: three train runs
def test_train_pp_resume_equals_a_run_that_never_stopped(tmp_path, capsys):
    whole = _train(tmp_path, "whole", "--steps", "4")
    ckpt = str(tmp_path / "ckpt")
    _train(tmp_path, "first", "--steps", "2", "--ckpt-dir", ckpt)
    resumed = _train(tmp_path, "resumed", "--steps", "4", "--ckpt-dir", ckpt, "--resume")
    assert resumed["resumed_from"] == 2
    assert resumed["losses"] == whole["losses"]  # bit for bit
    assert main(["checkpoint", "inspect", ckpt]) == 0
    assert "pp=2 × dp=1 × tp=1" in capsys.readouterr().out
