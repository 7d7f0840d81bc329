"""Issue 33's defects of composition, each against the dense one-process computation: a parameter
unfrozen after ``ot.lora`` is reduced like any other (or refused in one line under ZeRO), and the
default ``overlap="auto"`` issues no collective whose result nobody needs (a column → row MLP
whose input needs no gradient: one all-reduce, under SP one reduce-scatter)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from helpers import assert_rel
from ops_transformer import GPT, CommLedger, init_parallel, lora, parallelize
from ops_transformer.models import preset

B, T = 4, 16
CFG = preset("llama-tiny", vocab_size=64, max_seq_len=T)


def _batch():
    return torch.randint(0, CFG.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(0))


def _unfrozen_norm_grad(dp, tp, **options):
    """The final norm's gradient after ``ot.lora`` and then unfreezing it, on this rank (from its
    rows of the batch), twice: the second backward after the norm joined the reducers."""
    ctx = init_parallel(tp=tp, dp=dp)
    torch.manual_seed(0)
    model = lora(parallelize(GPT(CFG), ctx, attention="heads", **options), ctx, rank=4)
    model.norm.weight.requires_grad_(True)  # PEFT's modules_to_save
    rows = slice(ctx.dp_rank * B // dp, (ctx.dp_rank + 1) * B // dp)
    batch, grads = _batch()[rows], []
    for _ in range(2):
        model(batch[:, :-1], batch[:, 1:])[1].backward()
        grads.append(model.norm.weight.grad.clone())
        model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("world,dp,tp,options", [
    (2, 2, 1, {}),  # data-parallel averaging
    (2, 1, 2, {"sequence_parallel": True}),  # an SP norm: its partial gradient summed over tp
])
def test_parameter_unfrozen_after_lora_is_reduced(run_ranks, world, dp, tp, options):
    """Issue 33, defect 2: ``ot.lora`` built the reducers over the adapters; a norm unfrozen
    afterwards kept each rank's own gradient (1.07 relative from the whole batch's at dp 2)."""
    reference = run_ranks(_unfrozen_norm_grad, 1, 1, 1)[0]
    for rank_grads in run_ranks(_unfrozen_norm_grad, world, dp, tp, **options):
        for got, want in zip(rank_grads, reference):
            assert_rel(got, want, what="unfrozen norm gradient")


def _unfrozen_under_zero2():
    from ops_transformer import zero_optimizer

    ctx = init_parallel(tp=1, dp=2)
    torch.manual_seed(0)
    model = lora(parallelize(GPT(CFG), ctx), ctx, rank=4)
    zero_optimizer(model, ctx, torch.optim.AdamW, lr=1e-3, stage=2)
    model.norm.weight.requires_grad_(True)
    batch = _batch()[ctx.dp_rank * 2:(ctx.dp_rank + 1) * 2]
    with pytest.raises(RuntimeError) as err:
        model(batch[:, :-1], batch[:, 1:])[1].backward()
    return str(err.value)


def test_parameter_unfrozen_after_zero_is_refused_in_one_line(run_ranks):
    message = run_ranks(_unfrozen_under_zero2, 2)[0]
    assert message.startswith("norm.weight: requires_grad was turned on after ZeRO")
    assert "\n" not in message


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


PLANS = {"tp": {"fc1": "colwise", "fc2": "rowwise"},
         "sp": {"fc1": "colwise_sequence", "fc2": "rowwise_sequence"}}


def _mlp_calls(layout, overlap):
    """Collective calls of one forward and backward of the MLP on an input without gradient, and
    the weight gradients (dense coordinates, gathered) to compare with one process."""
    from ops_transformer import gather_full_state_dict

    ctx = init_parallel(tp=int(os.environ["WORLD_SIZE"]))
    torch.manual_seed(0)
    dense = MLP()
    torch.manual_seed(0)
    model = parallelize(MLP(), ctx, PLANS[layout], overlap=overlap)
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    dense(x).pow(2).sum().backward()
    if layout == "sp":  # this rank's share of the sequence
        n = x.shape[1] // ctx.tp_size
        x = x[:, ctx.tp_rank * n:(ctx.tp_rank + 1) * n]
    with CommLedger() as ledger:
        model(x).pow(2).sum().backward()
    for name, p in model.named_parameters():
        p.data = p.grad  # gather the gradients as if they were the weights
    grads = gather_full_state_dict(model, ctx)
    for name, p in dense.named_parameters():
        assert_rel(grads[name], p.grad, what=f"{name} grad ({layout}, {overlap})")
    return {kind: v["calls"] for kind, v in ledger.summary().items()}


@pytest.mark.parametrize("layout", ["tp", "sp"])
def test_input_without_grad_needs_no_entry_collective(run_ranks, layout):
    """Issue 33, defect 3 (PyTorch's ``test_tp_examples`` case): ``overlap="auto"`` issued the
    entry's input-gradient all-reduce (SP: reduce-scatter) although the input needs no gradient —
    2 calls where ``none`` and the plan's minimum have 1."""
    none = run_ranks(_mlp_calls, 2, layout, "none")[0]
    auto = run_ranks(_mlp_calls, 2, layout, "auto")[0]
    assert auto == none
    if layout == "tp":
        assert none == {"all_reduce": 1}
    else:  # gather in, reduce-scatter out; backward: the exit's all-gather; the bias sums
        assert none["reduce_scatter"] == 1 and none["all_gather"] == 2


def test_train_flags_dropout_and_moe_statistics():
    """Issue 33: ``train --dropout P`` (it had no flag) and ``--moe-statistics``; a Hugging Face
    model keeps its own dropout (refused in one line)."""
    import argparse

    from ops_transformer.cli.train import add_parser, config_from_args
    from ops_transformer.training.loop import TrainConfig, validate

    parser = argparse.ArgumentParser()
    add_parser(parser)
    args = parser.parse_args(["--dropout", "0.1", "--moe-statistics", "global"])
    cfg = config_from_args(args, "train")
    assert (cfg.dropout, cfg.moe_statistics) == (0.1, "global")
    assert cfg.model_config().dropout == 0.1
    assert cfg.parallel_options().moe_statistics == "global"
    assert TrainConfig().model_config().dropout == 0.0  # the preset's own
    with pytest.raises(ValueError, match=r"--dropout must be in \[0, 1\), got 1.5"):
        validate(TrainConfig(dropout=1.5), 1)
    with pytest.raises(ValueError, match="--moe-statistics|moe_statistics must be one of"):
        validate(TrainConfig(moe_statistics="batch"), 1)


def _style_options():
    from ops_transformer.layers import ColumnParallelLinear, RowParallelLinear

    ctx = init_parallel(tp=2)
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    out = {}
    for chunks in (1, 2):
        torch.manual_seed(0)
        plan = {"fc1": {"style": "colwise", "entry": "copy", "chunks": chunks},
                "fc2": {"style": "rowwise", "exit": "all_reduce", "chunks": chunks}}
        model = parallelize(MLP(), ctx, plan, overlap="none")
        with CommLedger() as ledger:
            model(x.clone().requires_grad_()).pow(2).sum().backward()
        out[chunks] = ({n: p.grad for n, p in model.named_parameters()},
                       {k: v["calls"] for k, v in ledger.summary().items()},
                       (type(model.fc1) is ColumnParallelLinear,
                        type(model.fc2) is RowParallelLinear))
    return out


def test_one_chunk_is_the_plain_layer(run_ranks):
    """Issue 33: the communicating kinds take ``chunks``; one implementation per communicating
    matmul: ``chunks=1`` and ``chunks=2`` are the same column / row classes (the collective matmul
    with its chunk count an option) — the same gradients, each collective in two calls."""
    out = run_ranks(_style_options, 2)[0]
    assert out[1][2] == (True, True) and out[2][2] == (True, True)
    assert out[1][1] == {"all_reduce": 2} and out[2][1] == {"all_reduce": 4}
    for name, grad in out[1][0].items():
        assert_rel(out[2][0][name], grad, what=name)
