"""The plan styles Hugging Face's plans translate to, each against its dense module at tp 1, 2
and 4: output, input gradient, every parameter's gradient (gathered), the weights after one SGD
step, and the exact collectives from the ledger."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import assert_rel
from ops_transformer import CommLedger, ParallelContext, gather_full_state_dict, init_parallel
from ops_transformer.parallel.state import attach_grad_sums
from ops_transformer.layers.embedding import ColumnParallelEmbedding
from ops_transformer.layers.linear_variants import (PackedRowParallelLinear,
                                                    PaddedColumnParallelLinear,
                                                    PaddedRowParallelLinear)
from ops_transformer.parallel.sharding import gather_full, shard_spec
from ops_transformer.parallelize.plan import Plan, apply_plan

B, S, H = 2, 3, 8
HEADS, D = 4, 4  # 4 heads of 4 features


class FFN(nn.Module):
    """Column → activation → row; ``width`` need not divide by tp. Sigmoid(0) = 0.5: padding
    features are not zero after it, so only the masked padding weights keep the result exact."""

    def __init__(self, width=37, act=torch.sigmoid, bias=True):
        super().__init__()
        self.up, self.down, self.act = nn.Linear(H, width, bias=bias), nn.Linear(width, H), act

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class PerHeadNorm(nn.Module):
    """Qwen3's q_norm: an RMSNorm over each head's features, between a column and a row layer;
    ``sinks``: a per-head parameter (attention sinks)."""

    def __init__(self):
        super().__init__()
        self.q, self.o = nn.Linear(H, HEADS * D), nn.Linear(HEADS * D, H)
        self.norm = nn.RMSNorm(D)
        self.sinks = nn.Parameter(torch.rand(HEADS) + 0.5)

    def forward(self, x):
        heads = self.norm(self.q(x).view(B, S, -1, D)) * self.sinks.view(-1, 1)
        return self.o(heads.flatten(-2))


class Partial(nn.Module):
    """A module whose output is a partial sum on each rank (Hugging Face's ``all_reduce``): a
    column layer, then a linear whose weight is split along its input."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(H, 16), nn.Linear(16, H, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class RawPartial(nn.Module):
    """Inkling's shared experts: raw weights (no linear modules) split by ``shard_param``, so the
    input gradient each rank computes is partial too (``reduce_out`` with ``region_inputs``)."""

    def __init__(self):
        super().__init__()
        self.up = nn.Parameter(torch.randn(16, H) * 0.3)
        self.down = nn.Parameter(torch.randn(H, 16) * 0.3)

    def forward(self, x):
        return F.linear(F.gelu(F.linear(x, self.up)), self.down)


class Wrapper(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.mlp = inner

    def forward(self, x):
        return self.mlp(x)


class LatentKV(nn.Module):
    """MLA's key path: a replicated ``kv_a`` whose last ``ROPE`` features bypass the
    column-parallel ``kv_b`` and join every (local) head directly."""

    ROPE = 2

    def __init__(self):
        super().__init__()
        self.kv_a = nn.Linear(H, 6 + self.ROPE)
        self.kv_b = nn.Linear(6, HEADS * D)
        self.o = nn.Linear(HEADS * (D + self.ROPE), H)

    def forward(self, x):
        latent, rope = self.kv_a(x).split([6, self.ROPE], -1)
        heads = self.kv_b(latent).view(B, S, -1, D)
        rope = rope.unsqueeze(-2).expand(-1, -1, heads.shape[-2], -1)
        return self.o(torch.cat([heads, rope], -1).flatten(-2))


class PackedPair(nn.Module):
    """A fused column layer (two blocks) feeding a row layer over the same packed features."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(H, 24), nn.Linear(24, H)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, H, padding_idx=0)

    def forward(self, idx):
        return self.emb(idx)


CASES = {
    # name: (model, rules, fwd collectives, bwd collectives) with n = B·S·H elements per all-reduce
    "padded_ffn": (FFN, {"up": {"style": "colwise", "pad": True},
                         "down": {"style": "rowwise", "pad": True}},
                   {"all_reduce": 1}, {"all_reduce": 1}),
    "padded_gather_split": (FFN, {"up": {"style": "colwise", "pad": True, "gather_output": True},
                                  "down": {"style": "rowwise", "pad": True,
                                           "input_is_parallel": False}},
                            {"all_gather": 1, "all_reduce": 1},
                            {"all_gather": 1, "all_reduce": 1}),
    "packed": (PackedPair, {"fc1": {"style": "colwise", "sub_blocks": [12, 12]},
                            "fc2": {"style": "rowwise", "sub_blocks": [12, 12]}},
               {"all_reduce": 1}, {"all_reduce": 1}),
    "grad_allreduce_and_sinks": (PerHeadNorm, {"q": "colwise", "norm": "grad_allreduce",
                                               "sinks": "shard_param", "o": "rowwise"},
                                 {"all_reduce": 1}, {"all_reduce": 2}),
    "reduce_out": (lambda: Wrapper(Partial()),
                   {"mlp.up": "colwise", "mlp.down.weight": {"style": "shard_param", "dim": -1},
                    "mlp": "reduce_out"}, {"all_reduce": 1}, {"all_reduce": 1}),
    "reduce_out_raw": (lambda: Wrapper(RawPartial()),
                       {"mlp.up": "shard_param", "mlp.down": {"style": "shard_param", "dim": -1},
                        "mlp": {"style": "reduce_out", "region_inputs": True}},
                       {"all_reduce": 1}, {"all_reduce": 1}),
    "mla_kv_a": (LatentKV, {"kv_a": {"style": "mla_kv_a", "rope_dim": LatentKV.ROPE},
                            "kv_b": "colwise", "o": "rowwise"},
                 {"all_reduce": 1}, {"all_reduce": 2}),
    "embed_colwise": (Embed, {"emb": "embed_colwise"}, {"all_gather": 1}, {}),
}


def _grads(model, ctx) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        grad = p.grad.detach().clone()
        if shard_spec(p) is not None:
            grad.shard_spec = shard_spec(p)
            grad = gather_full(grad, ctx.tp_group)
        out[name] = grad
    return out


def _case(name):
    ctx = init_parallel(tp=int(os.environ["WORLD_SIZE"]))
    make, rules, _, _ = CASES[name]
    torch.manual_seed(0)
    dense = make()
    model = copy.deepcopy(dense)
    if name == "embed_colwise":
        x = torch.randint(0, 11, (B, S))
        x[0, 0] = 0
    else:
        x = torch.randn(B, S, H)
    grad_out = torch.randn(B, S, H)
    x_ref = x.clone().requires_grad_(x.is_floating_point())
    y_ref = dense(x_ref)
    y_ref.backward(grad_out)

    apply_plan(model, Plan(rules=rules), ctx)
    attach_grad_sums(model)  # the partial gradients grad_allreduce marks (parallelize does this)
    x_tp = x.clone().requires_grad_(x.is_floating_point())
    with CommLedger() as fwd:
        y = model(x_tp)
    with CommLedger() as bwd:
        y.backward(grad_out)
    assert_rel(y, y_ref, what=f"{name} output")
    if x.is_floating_point():
        assert_rel(x_tp.grad, x_ref.grad, what=f"{name} input grad")
    ref_grads = {n: p.grad for n, p in dense.named_parameters()}
    for key, grad in _grads(model, ctx).items():
        assert_rel(grad, ref_grads[key], what=f"{name} {key} grad")
    for m in (dense, model):  # one step: padding must stay zero for the result to stay exact
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    after = gather_full_state_dict(model, ctx)
    for key, value in dense.state_dict().items():
        assert_rel(after[key], value, what=f"{name} {key} after a step")
    with torch.no_grad():
        assert_rel(model(x), dense(x), what=f"{name} output after a step")
    return fwd.summary(), bwd.summary()


def _calls(summary):
    return {kind: c["calls"] for kind, c in summary.items()}


QUICK = ("padded_ffn", "grad_allreduce_and_sinks", "mla_kv_a")  # at tp 1 and 4 by default too


@pytest.mark.parametrize("name,tp", [
    pytest.param(name, tp, marks=() if tp == 2 or name in QUICK else pytest.mark.slow)
    for name in CASES for tp in (1, 2, 4)])
def test_style_equals_dense(run_ranks, name, tp):
    fwd, bwd = run_ranks(_case, tp, name)[0]
    _, _, want_fwd, want_bwd = CASES[name]
    assert (_calls(fwd), _calls(bwd)) == (({}, {}) if tp == 1 else (want_fwd, want_bwd))


def test_padded_layers_show_sizes_and_refuse_what_they_cannot_pad():
    ctx = ParallelContext(rank=0, world_size=2, tp_size=2, tp_rank=1, dp_size=1, dp_rank=0)
    col = PaddedColumnParallelLinear.from_dense(nn.Linear(8, 37), ctx)
    assert (col.out_features, col.out_features_per_rank) == (37, 19)
    assert "padded_to=38" in repr(col)
    row = PaddedRowParallelLinear.from_dense(nn.Linear(37, 8), ctx)
    assert (row.in_features, row.in_features_per_rank) == (37, 19)
    assert float(row.weight.detach()[:, -1].abs().max()) == 0.0  # rank 1 holds the zero padding column
    with pytest.raises(ValueError, match=r"sub-block 0 of in_features \(5\) is not divisible"):
        PackedRowParallelLinear.from_dense(nn.Linear(10, 4), ctx, sub_blocks=(5, 5))
    with pytest.raises(ValueError, match=r"embedding_dim \(7\) is not divisible"):
        ColumnParallelEmbedding.from_dense(nn.Embedding(4, 7), ctx)
