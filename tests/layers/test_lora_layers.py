"""LoRA adapters on column, row and fused sub-block linears against a dense PEFT-style reference
(``base(x) + lora_B(lora_A(dropout(x))) * scaling``): forward, input gradient and every adapter
gradient at tp 1, 2, 4 and dp 2 × tp 2 (with and without dropout); frozen weights get no gradient; the ledger: the forward
equals the base model's, the backward adds one coalesced all-reduce of the replicated factors."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import assert_rel, local_part, set_from_dense
from ops_transformer import CommLedger, gather_full_state_dict, init_parallel, lora, parallelize
from ops_transformer.layers.dropout import Layout, dropout

B, S, IN, HID, RANK, ALPHA = 4, 3, 16, 32, 4, 8.0
PLAN = {"fc": "colwise", "proj": "rowwise",
        "gate_up": {"style": "colwise", "sub_blocks": [HID, HID]}, "down": "rowwise"}
TARGETS = ("fc", "proj", "gate_up", "down")
COLUMNS, ROWS = ("fc", "gate_up"), ("proj", "down")


class Net(nn.Module):
    """Column → row (GELU), then a fused gate|up column → row (SwiGLU)."""

    def __init__(self):
        super().__init__()
        self.fc, self.proj = nn.Linear(IN, HID), nn.Linear(HID, IN)
        self.gate_up, self.down = nn.Linear(IN, 2 * HID), nn.Linear(HID, IN)

    def forward(self, x):
        h = self.proj(F.gelu(self.fc(x)))
        gate, up = self.gate_up(h).chunk(2, -1)
        return self.down(F.silu(gate) * up)


def _factors():
    """Non-zero dense factors (B starts at zero, which would hide A's gradient)."""
    g = torch.Generator().manual_seed(1)
    dims = {"fc": (IN, HID), "proj": (HID, IN), "gate_up": (IN, 2 * HID), "down": (HID, IN)}
    return {n: (torch.randn(RANK, i, generator=g) * 0.3, torch.randn(o, RANK, generator=g) * 0.3)
            for n, (i, o) in dims.items()}


def _reference(net, factors, x, grad_out, dropout, dp):
    """The dense computation with adapters, and its gradients (the loss averaged over dp as the
    data-parallel averaging does)."""
    x = x.clone().requires_grad_()
    params = {n: [a.clone().requires_grad_(), b.clone().requires_grad_()]
              for n, (a, b) in factors.items()}

    def adapted(name, h):
        a, b = params[name]
        return getattr(net, name)(h) + F.linear(F.linear(one_device(h, dropout), a), b) * (
            ALPHA / RANK)

    torch.manual_seed(5)  # the dropout masks, drawn in the layers' order
    h = adapted("proj", F.gelu(adapted("fc", x)))
    gate, up = adapted("gate_up", h).chunk(2, -1)
    y = adapted("down", F.silu(gate) * up)
    (y * grad_out).sum().backward()
    grads = {n: (a.grad / dp, b.grad / dp) for n, (a, b) in params.items()}
    return y.detach(), x.grad, grads


def _split(ledger):
    """The ledger's summary per part: activations (forward/backward), ``grad_sums``,
    ``dp_grads``."""
    parts = {}
    for r in ledger.records:
        part = r.label if r.label in ("grad_sums", "dp_grads") else "activations"
        entry = parts.setdefault(part, {}).setdefault(r.kind, {"calls": 0, "elements": 0})
        entry["calls"] += 1
        entry["elements"] += r.elements
    return parts


def _run(tp, dropout, overlap="none"):
    ctx = init_parallel(tp=tp)
    torch.manual_seed(0)
    dense = Net()
    torch.manual_seed(0)
    base = parallelize(Net(), ctx, PLAN, overlap=overlap, chunks=2)
    torch.manual_seed(0)
    model = lora(parallelize(Net(), ctx, PLAN, overlap=overlap, chunks=2), ctx, rank=RANK,
                 alpha=ALPHA, targets=TARGETS, dropout=dropout)
    factors = _factors()
    for name, (a, b) in factors.items():
        set_from_dense(model.get_submodule(name).lora_A.weight, a)
        set_from_dense(model.get_submodule(name).lora_B.weight, b)
    g = torch.Generator().manual_seed(2)
    x_all, grad_all = torch.randn(B, S, IN, generator=g), torch.randn(B, S, IN, generator=g)
    rows = slice(ctx.dp_rank * B // ctx.dp_size, (ctx.dp_rank + 1) * B // ctx.dp_size)
    y_ref, gx_ref, grads_ref = _reference(dense, factors, x_all, grad_all, dropout, ctx.dp_size)

    ledgers = {}
    for name, net in (("base", base), ("lora", model)):
        x = x_all[rows].clone().requires_grad_()
        torch.manual_seed(5)
        with CommLedger() as fwd:
            y = net(x)
        with CommLedger() as bwd:
            (y * grad_all[rows]).sum().backward()
        ledgers[name] = (_split(fwd), _split(bwd))
    assert_rel(y, y_ref[rows], what="output")
    assert_rel(x.grad, gx_ref[rows], what="input grad")
    for name, (ga, gb) in grads_ref.items():
        layer = model.get_submodule(name)
        assert_rel(layer.lora_A.weight.grad, local_part(layer.lora_A.weight, ga), what=f"{name} A grad")
        assert_rel(layer.lora_B.weight.grad, local_part(layer.lora_B.weight, gb), what=f"{name} B grad")
    frozen = [n for n, p in model.named_parameters() if "lora_" not in n]
    assert frozen and all(model.get_parameter(n).grad is None for n in frozen)
    assert all(not model.get_parameter(n).requires_grad for n in frozen)
    state = gather_full_state_dict(model, ctx)  # dense coordinates: PEFT's names and shapes
    shapes = {k: tuple(v.shape) for k, v in state.items() if "lora_" in k}
    assert shapes["gate_up.lora_B.weight"] == (2 * HID, RANK)
    assert shapes["proj.lora_A.weight"] == (RANK, HID)
    assert torch.equal(state["gate_up.lora_B.weight"], factors["gate_up"][1])
    trained = [p for p in model.parameters() if p.requires_grad]
    # the averaging's all-reduce: the gradients and one presence flag per parameter (issue 24:
    # a parameter without a gradient on every rank keeps grad None)
    return ledgers, sum(p.numel() for p in trained) + len(trained)


@pytest.mark.parametrize("tp,world,dropout", [(2, 2, 0.0), (2, 2, 0.2), (4, 4, 0.0)])
def test_lora_inside_chunked_collective_matmuls(run_ranks, tp, world, dropout):
    """Issue 33: under ``overlap="chunked"`` the adapters run inside the fused ops (a column's
    adapter on the op's input, its input gradient in the op's chunked all-reduce; a row's split
    ``A`` as ``rank`` more columns of the exit matmul): the same dense reference, and the forward
    still moves exactly the base model's collectives."""
    ledgers, _ = run_ranks(_run, world, tp, dropout, "chunked")[0]
    assert ledgers["lora"][0] == ledgers["base"][0]
    assert ledgers["lora"][1].get("activations") == ledgers["base"][1].get("activations")


def _replicated_elements():
    """The replicated factors: A of the column layers, B of the row layers."""
    return 2 * RANK * IN + 2 * IN * RANK


@pytest.mark.parametrize("tp,world", [(1, 1), (2, 2), (4, 4), (2, 4)])
def test_lora_linears_match_dense_reference(run_ranks, tp, world):
    ledgers, local = run_ranks(_run, world, tp, 0.0)[0]
    base, adapted = ledgers["base"], ledgers["lora"]
    assert adapted[0] == base[0]  # forward: exactly the base model's collectives
    base_bwd, lora_bwd = base[1], adapted[1]
    assert lora_bwd.get("activations") == base_bwd.get("activations")
    if tp > 1:  # one coalesced all-reduce of the replicated factors' partial gradients
        assert lora_bwd["grad_sums"] == {"all_reduce": {"calls": 1,
                                                        "elements": _replicated_elements()}}
    else:
        assert "grad_sums" not in lora_bwd
    if world > tp:  # data-parallel averaging of the adapters only
        assert lora_bwd["dp_grads"] == {"all_reduce": {"calls": 1, "elements": local}}
        assert base_bwd["dp_grads"]["all_reduce"]["elements"] > local
    else:
        assert "dp_grads" not in lora_bwd


@pytest.mark.parametrize("tp,world", [(1, 1), (2, 2), (2, 4)])
def test_lora_dropout_matches_one_device_masks(run_ranks, tp, world):
    """Dropout 0.2 on the adapters' input: each rank applies its part of the one-device masks
    (its rows of the global batch; a row layer: its input features)."""
    run_ranks(_run, world, tp, 0.2)


def one_device(x, p):
    """The one-device dropout of the global batch (layers/dropout.py)."""
    return dropout(x, p, Layout())
