"""The cost model's formulas (ops_transformer.planner) against the communication ledger of real runs,
exactly, for every attention strategy at four shapes; and hand-computed values with no process
group."""

from __future__ import annotations

import os

import pytest
import torch

from ops_transformer import GPT, CommLedger, init_parallel, parallelize
from ops_transformer.models import preset
from ops_transformer.planner import attention_cost, ffn_cost, layer_cost
from ops_transformer.planner.strategies import grad_sum_calls_per_step

SHAPES = {  # name: (config, tp, batch, seq)
    "gpt2-h64-tp2": (preset("tiny", vocab_size=256), 2, 2, 8),
    "llama-gqa-tp4": (preset("llama-tiny"), 4, 1, 16),  # 2 KV heads: replicated for heads*
    "gpt2-6heads-tp2": (preset("tiny", d_model=48, n_heads=6, d_ff=96), 2, 3, 12),
    "llama-mqa-tp2": (preset("llama-tiny", n_heads=2, n_kv_heads=1), 2, 2, 8),
}


def _per_layer(config, batch, seq, attention):
    ctx = init_parallel(tp=int(os.environ["WORLD_SIZE"]))
    counts = []
    for n_layers in (1, 2):
        torch.manual_seed(0)
        model = parallelize(GPT(config.with_(n_layers=n_layers)), ctx, attention=attention)
        idx = torch.randint(0, 256, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
        with CommLedger() as fwd:
            loss = model(idx[:, :-1], idx[:, 1:])[1]
        with CommLedger() as bwd:
            loss.backward()
        counts.append((fwd.summary(), bwd.summary()))
    (f1, b1), (f2, b2) = counts

    def delta(a, b):
        out = {k: {"calls": a[k]["calls"] - b.get(k, {}).get("calls", 0),
                   "elements": a[k]["elements"] - b.get(k, {}).get("elements", 0)} for k in a}
        return {k: v for k, v in out.items() if v["calls"]}

    return delta(f2, f1), delta(b2, b1)


@pytest.mark.parametrize("attention", ["heads", "heads_allgather", "kv_split", "naive"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_formula_equals_ledger(run_ranks, attention, shape):
    config, tp, batch, seq = SHAPES[shape]
    fwd, bwd = run_ranks(_per_layer, tp, config, batch, seq, attention)[0]
    cost = layer_cost(attention, batch, seq, config.d_model, config.n_heads, config.n_kv_heads,
                      config.d_ff, tp, bias=config.bias, swiglu=config.mlp == "swiglu")
    assert fwd == cost.fwd, "forward"
    assert bwd == cost.bwd, "backward"


# --- hand-computed values (no process group) ------------------------------------------------------

def test_heads_by_hand():
    c = attention_cost("heads", b=2, s=8, h=64, heads=4, kv_heads=4, tp=2)
    assert c.fwd == {"all_reduce": {"calls": 1, "elements": 1024}}  # b·s·h
    assert c.bwd == {"all_reduce": {"calls": 1, "elements": 1024}}
    # projections 2·b·s·h·(h + 2·kv_dim) = 2·2·8·64·192, output 2·2·8·64·64,
    # core 4·b·s²·h = 4·2·64·64; all divided by tp = 2; a training step is 3 × forward
    assert c.flops == 3 * (393216 / 2 + 131072 / 2 + 32768 / 2)


def test_kv_split_grows_with_s_squared():
    c = attention_cost("kv_split", b=1, s=128, h=64, heads=4, kv_heads=4, tp=4)
    assert c.fwd["reduce_scatter"] == {"calls": 1, "elements": 4 * 128 * 128}  # b·a·s²
    assert c.bwd["all_gather"]["elements"] == 4 * 128 * 128 + 0  # the score gradient
    longer = attention_cost("kv_split", b=1, s=256, h=64, heads=4, kv_heads=4, tp=4)
    assert longer.fwd["reduce_scatter"]["elements"] == 4 * c.fwd["reduce_scatter"]["elements"]


def test_naive_moves_more_than_heads():
    naive = attention_cost("naive", 1, 16, 64, 4, 4, 2).total()
    heads = attention_cost("heads", 1, 16, 64, 4, 4, 2).total()
    assert naive == {"all_gather": {"calls": 4, "elements": 4096},
                     "all_reduce": {"calls": 4, "elements": 4096}}
    assert heads == {"all_reduce": {"calls": 2, "elements": 2048}}


def test_replicated_kv_heads_add_their_gradient_sums():
    c = attention_cost("heads", 1, 8, 64, 4, 2, 4, bias=True)  # head_dim 16
    # the elements per layer; the call once per step, coalesced for all layers
    assert c.bwd["all_reduce"] == {"calls": 1, "elements": 8 * 64 + 2 * 16 * 64 + 16}
    assert grad_sum_calls_per_step("heads", 2, 4) == 1
    assert grad_sum_calls_per_step("heads", 4, 4) == 0  # KV heads split: nothing to sum
    assert grad_sum_calls_per_step("kv_split", 4, 2) == 1  # the replicated output projection


def test_ffn_and_tp1():
    f = ffn_cost(2, 8, 64, 256, 4)
    assert f.fwd == f.bwd == {"all_reduce": {"calls": 1, "elements": 1024}}
    assert f.flops == 3 * 2 * 2 * 8 * 64 * 256 * 2 / 4
    assert attention_cost("heads", 2, 8, 64, 4, 4, 1).total() == {}
    with pytest.raises(ValueError, match="strategy must be one of"):
        attention_cost("rows", 2, 8, 64, 4, 4, 2)


def test_replica_sums_are_priced_on_their_own_group():
    c = attention_cost("heads", 2, 8, 64, 4, 2, 4, bias=False)  # 2 KV heads at tp 4: pairs
    (p_main, main), (p_sub, sub) = c.priced()
    assert (p_main, p_sub) == (4, 2)
    assert sub == {"all_reduce": {"calls": 0, "elements": 2 * 16 * 64}}  # one call per step
    assert main == {"all_reduce": {"calls": 2, "elements": 2 * 2 * 8 * 64}}
