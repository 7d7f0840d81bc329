"""A checkpoint saved at cp 2 holds dense coordinates: it resumes at cp 1 × tp 2 with the weights
and the optimizer state bit-identical, and the next step's loss is the cp 2 run's."""

from __future__ import annotations

import torch

from ops_transformer import GPT, gather_full_state_dict, init_parallel, parallelize
from ops_transformer.checkpoint import load_checkpoint, save_checkpoint
from ops_transformer.models.gpt import preset

B, S = 2, 16


def _setup(tp, cp):
    torch.set_num_threads(1)
    ctx = init_parallel(tp=tp, cp=cp)
    torch.manual_seed(0)
    model = parallelize(GPT(preset("llama-tiny", max_seq_len=32)), ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return ctx, model, opt


def _step(model, opt, i):
    batch = torch.randint(0, 256, (B, S + 1), generator=torch.Generator().manual_seed(i))
    _, loss = model(batch[:, :-1], batch[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def _save_at_cp2(root):
    ctx, model, opt = _setup(1, 2)
    for i in range(2):
        _step(model, opt, i)
    save_checkpoint(root, model, opt, ctx, step=2)
    weights = gather_full_state_dict(model, ctx)
    next_loss = _step(model, opt, 2)
    return weights, next_loss


def _resume_at_tp2(root):
    ctx, model, opt = _setup(2, 1)
    info = load_checkpoint(root, model, opt, ctx)
    weights = gather_full_state_dict(model, ctx)
    return weights, _step(model, opt, 2), info["saved_layout"], info["resharded"]


def test_resume_cp2_as_tp2_is_bit_identical(run_ranks, tmp_path):
    saved, loss_cp2 = run_ranks(_save_at_cp2, 2, str(tmp_path))[0]
    weights, loss_tp2, layout, resharded = run_ranks(_resume_at_tp2, 2, str(tmp_path))[0]
    assert layout == {"world_size": 2, "dp": 1, "tp": 1, "ep": 1, "cp": 2} and resharded
    for name, tensor in saved.items():
        assert torch.equal(weights[name], tensor), name
    assert abs(loss_tp2 - loss_cp2) <= 1e-6 * loss_cp2
