"""Attention strategies B (kv_split) and naive, and `auto`: exact training at tp 2 and 4 (also with
fewer heads than ranks); `auto` follows the cost model."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_rel
from ops_transformer.models import preset
from ops_transformer.parallelize import gpt_plan
from ops_transformer.planner import attention_options
from test_gpt_parallel import CONFIGS, _train

# 2 heads of 32 features: kv_split at tp 4 gives each rank 8 features of both heads (4 per RoPE half)
FEW_HEADS = {
    "gpt2-2heads": CONFIGS["gpt2"].with_(n_heads=2, n_kv_heads=2),
    "llama-2heads": CONFIGS["llama"].with_(n_heads=2, n_kv_heads=1),
}
CONFIGS.update(FEW_HEADS)


@pytest.mark.parametrize("config,opt_name,nprocs,tp,attention", [
    ("gpt2", "sgd", 2, 2, "kv_split"),
    ("llama", "adamw", 4, 4, "kv_split"),
    ("gpt2-2heads", "adamw", 4, 4, "kv_split"),
    ("llama-2heads", "sgd", 4, 4, "auto"),  # heads < tp: auto must pick kv_split
    ("llama", "sgd", 4, 2, "kv_split"),  # dp 2 × tp 2
    ("gpt2", "adamw", 2, 2, "naive"),
    ("llama", "sgd", 4, 4, "naive"),
])
def test_training_equals_dense(run_ranks, config, opt_name, nprocs, tp, attention):
    dense_losses, dense_state = run_ranks(_train, 1, config, opt_name, 1, "auto")[0]
    for losses, state in run_ranks(_train, nprocs, config, opt_name, tp, attention):
        assert_rel(torch.tensor(losses), torch.tensor(dense_losses), what="per-step losses")
        assert list(state) == list(dense_state)
        for key, value in dense_state.items():
            assert_rel(state[key], value, what=key, floor=0.02)  # 0.02: the init scale


def test_auto_picks_kv_split_when_heads_are_fewer_than_ranks():
    plan = gpt_plan(FEW_HEADS["llama-2heads"], 4)
    assert plan.attention == "kv_split"
    assert "not possible: heads, heads_allgather" in plan.reason


@pytest.mark.parametrize("name,tp,seq", [("tiny", 2, 64), ("small", 4, 256), ("llama-tiny", 2, 32),
                                         ("small", 2, 2048)])
def test_auto_is_the_cost_models_argmin(name, tp, seq):
    cfg = preset(name)
    plan = gpt_plan(cfg, tp, batch=4, seq=seq)
    options = [o for o in attention_options(cfg, tp, batch=4, seq=seq) if o.problem is None]
    assert plan.attention == min(options, key=lambda o: o.time_s).strategy
    assert f"s={seq}" in plan.reason and "ms/layer" in plan.reason


def test_kv_split_sequence_must_divide():
    with pytest.raises(ValueError, match=r"sequence length \(33\) is not divisible by tp \(2\)"):
        gpt_plan(CONFIGS["gpt2"], 2, "kv_split", seq=33)
    with pytest.raises(ValueError, match=r"head_dim \(16\) is not divisible by 32"):
        gpt_plan(CONFIGS["llama"], 16, "kv_split")
