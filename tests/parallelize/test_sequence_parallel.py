"""Sequence parallelism and recompute on the reference GPT: training equals the dense run at tp 2
and 4 and dp 2 × tp 2 (both model families, every recompute mode); the ledger per layer; the one
coalesced all-reduce of the norms' partial gradients; clear errors."""

from __future__ import annotations

import os

import pytest
import torch

from helpers import assert_rel
from ops_transformer import GPT, CommLedger, init_parallel, parallelize
from ops_transformer.parallelize import gpt_plan
from ops_transformer.parallelize.sequence_plan import sequence_parallel_plan
from test_gpt_parallel import B, CONFIGS, T, _batches, _delta
from test_gpt_parallel import _train as train_dense_or_parallel


def _train(config, opt_name, tp, sp=False, recompute="none"):
    options = {"sequence_parallel": sp} if sp else {}
    if recompute != "none":
        options["recompute"] = recompute
    return train_dense_or_parallel(config, opt_name, tp, "heads", "parallel", **options)


def _assert_same_training(reference, runs):
    ref_losses, ref_state = reference
    for losses, state in runs:
        assert_rel(torch.tensor(losses), torch.tensor(ref_losses), what="per-step losses")
        assert list(state) == list(ref_state)
        for key, value in ref_state.items():
            assert_rel(state[key], value, what=key, floor=0.02)  # 0.02: the init scale


CASES = [  # config, optimizer, processes, tp, recompute (the first runs in the default suite)
    ("llama", "adamw", 2, 2, "full"),
    ("gpt2", "sgd", 2, 2, "none"),
    ("llama", "adamw", 4, 2, "full"),
    ("gpt2", "adamw", 4, 4, "none"),
    ("gpt2", "adamw", 4, 2, "selective"),
    ("gpt2", "sgd", 2, 2, "full"),
    ("llama", "adamw", 2, 2, "none"),
    ("llama", "sgd", 4, 4, "selective"),
    ("llama", "adamw", 4, 4, "full"),
    ("llama", "adamw", 2, 2, "selective"),
]


@pytest.mark.parametrize("config,opt_name,nprocs,tp,recompute", [
    c if i < 1 else pytest.param(*c, marks=pytest.mark.slow) for i, c in enumerate(CASES)])
def test_sequence_parallel_training_equals_dense(run_ranks, config, opt_name, nprocs, tp,
                                                 recompute):
    reference = run_ranks(_train, 1, config, opt_name, 1)[0]
    _assert_same_training(reference, run_ranks(_train, nprocs, config, opt_name, tp, True,
                                               recompute))


@pytest.mark.slow
@pytest.mark.parametrize("config", ["gpt2", "llama"])
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_without_sequence_parallelism_equals_dense(run_ranks, config, recompute):
    reference = run_ranks(_train, 1, config, "adamw", 1)[0]
    _assert_same_training(reference, run_ranks(_train, 1, config, "adamw", 1, False, recompute))
    _assert_same_training(reference, run_ranks(_train, 2, config, "adamw", 2, False, recompute))


def _ledgers(config, n_layers, recompute="none"):
    ctx = init_parallel(tp=int(os.environ["WORLD_SIZE"]))
    torch.manual_seed(0)
    model = parallelize(GPT(CONFIGS[config].with_(n_layers=n_layers)), ctx, attention="heads",
                        vocab="parallel", sequence_parallel=True, recompute=recompute)
    batch = _batches()[0]
    with CommLedger() as fwd:
        loss = model(batch[:, :-1], batch[:, 1:])[1]
    with CommLedger() as bwd:
        loss.backward()
    partial = sum(p.numel() for p in model.parameters()
                  if getattr(p, "partial_grad_group", None) is ctx.tp_group)
    return fwd.summary(), bwd.summary(), [(r.kind, r.elements, r.label) for r in bwd.records], \
        partial


@pytest.mark.parametrize("config", ["gpt2", pytest.param("llama", marks=pytest.mark.slow)])
def test_each_layer_gathers_and_scatters_the_sequence(run_ranks, config):
    """Per layer: 2 all-gathers + 2 reduce-scatters of b·s·h in forward and in backward, no
    all-reduce; the norms' (and row biases') partial gradients: one all-reduce per backward."""
    bsh = B * T * CONFIGS[config].d_model
    one = run_ranks(_ledgers, 2, config, 1)[0]
    two = run_ranks(_ledgers, 2, config, 2)[0]
    pair = {"calls": 2, "elements": 2 * bsh, "bytes": 8 * bsh}
    per_layer = {"all_gather": pair, "reduce_scatter": pair}
    assert _delta(two[0], one[0]) == per_layer
    assert _delta(two[1], one[1]) == per_layer
    for _, _, records, partial in (one, two):
        norm_reductions = [r for r in records if r[2] == "grad_sums"]
        assert norm_reductions == [("all_reduce", partial, "grad_sums")]
    assert two[3] > one[3] > 0


def test_full_recompute_replays_the_forward_collectives(run_ranks):
    bsh = B * T * CONFIGS["gpt2"].d_model
    plain = run_ranks(_ledgers, 2, "gpt2", 1)[0]
    full = run_ranks(_ledgers, 2, "gpt2", 1, "full")[0]
    assert full[0] == plain[0]  # the same forward
    # Backward replays the layer's forward up to the last tensor it saves (torch's checkpoint
    # stops early): both all-gathers and the attention's reduce-scatter run again; the FFN's
    # reduce-scatter, whose output only feeds the residual add, does not.
    assert _delta(full[1], plain[1]) == {
        "all_gather": {"calls": 2, "elements": 2 * bsh, "bytes": 8 * bsh},
        "reduce_scatter": {"calls": 1, "elements": bsh, "bytes": 4 * bsh}}


def _bad_length():
    ctx = init_parallel(tp=2)
    model = parallelize(GPT(CONFIGS["gpt2"]), ctx, sequence_parallel=True)
    idx = torch.zeros(2, 15, dtype=torch.long)
    model(idx, idx)


def test_a_sequence_that_does_not_divide_by_tp_is_a_clear_error(run_ranks):
    with pytest.raises(Exception, match=r"sequence length s \(15\) must be divisible by tp \(2\)"):
        run_ranks(_bad_length, 2)


def test_other_attention_strategies_say_they_cannot_combine():
    for attention in ("heads_allgather", "kv_split", "naive"):
        plan = gpt_plan(CONFIGS["gpt2"], 2, attention, vocab="parallel")
        with pytest.raises(ValueError, match="needs attention='heads'"):
            sequence_parallel_plan(plan, GPT(CONFIGS["gpt2"]))


def test_the_plan_is_data():
    plan = sequence_parallel_plan(gpt_plan(CONFIGS["llama"], 2, "heads", vocab="parallel"),
                                  GPT(CONFIGS["llama"]))
    rules = plan.rules
    assert rules["layers.0"] == {"style": "sequence", "kind": "scatter"}
    assert rules["norm"] == {"style": "sequence", "kind": "gather"}
    assert rules["layers.*.attn"] == {"style": "region", "entry": "sequence"}  # one all-gather
    assert rules["layers.*.mlp.w_in"]["entry"] == "sequence"  # its own all-gather
    assert rules["layers.*.attn.wo"] == rules["layers.*.mlp.w_out"] == {
        "style": "rowwise", "exit": "reduce_scatter"}
    assert rules["layers.*.norm1"] == {"style": "sequence", "kind": "partial"}
    assert "sequence parallel" in plan.reason and '"kind": "scatter"' in plan.to_json()


def test_earlier_style_names_keep_working(caplog):
    """Issue 33: the renamed variants are options of a few kinds; the earlier names in a user's
    plan map onto them once, with a deprecation note."""
    from ops_transformer.parallelize import Plan
    from ops_transformer.parallelize.styles import LEGACY_STYLES, STYLES, style_options

    assert len(STYLES) <= 16
    with caplog.at_level("WARNING", logger="ops_transformer"):
        plan = Plan({"a": "colwise_sequence", "b": {"style": "rowwise_chunked", "chunks": 4},
                     "c": "sequence_region_regather"})
    assert plan.rules == {"a": {"style": "colwise", "entry": "sequence"},
                          "b": {"style": "rowwise", "overlap": "auto", "chunks": 4},
                          "c": {"style": "region", "entry": "sequence", "regather": True}}
    assert "plan style 'colwise_sequence' is deprecated" in caplog.text
    for old, (kind, options) in LEGACY_STYLES.items():
        assert kind in STYLES and set(options) <= set(style_options(kind)), old


def _generate():
    ctx = init_parallel(tp=int(os.environ["WORLD_SIZE"]))
    torch.manual_seed(0)
    model = GPT(CONFIGS["llama"])
    if ctx.tp_size > 1:
        model = parallelize(model, ctx, sequence_parallel=True, recompute="full")
    return model.generate(torch.tensor([[1, 2, 3]]), 6, temperature=0).tolist()


@pytest.mark.slow
def test_generation_runs_as_plain_tensor_parallelism(run_ranks):
    """Inference keeps no activations: any length works, and the tokens equal the dense model's."""
    dense = run_ranks(_generate, 1)[0]
    assert run_ranks(_generate, 2) == [dense, dense]


def _grads_with_dropout(config, recompute, tp=1, sp=False):
    ctx = init_parallel(tp=tp)
    torch.manual_seed(0)
    model = parallelize(GPT(CONFIGS[config].with_(dropout=0.1)), ctx, attention="heads",
                        sequence_parallel=sp, recompute=recompute)
    batch = _batches()[0]
    torch.manual_seed(1)  # the dropout masks' generator state, the same for every mode
    loss = model(batch[:, :-1], batch[:, 1:])[1]
    loss.backward()
    return float(loss), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("config", ["gpt2", "llama"])
def test_recompute_reproduces_dropout_masks(run_ranks, config):
    """With dropout, every recompute mode gives the same loss and gradients as none (≤1e-6)."""
    loss, grads = run_ranks(_grads_with_dropout, 1, config, "none")[0]
    for recompute in ("selective", "full"):
        other, other_grads = run_ranks(_grads_with_dropout, 1, config, recompute)[0]
        assert abs(other - loss) <= 1e-6 * abs(loss)
        for name, g in grads.items():
            assert_rel(other_grads[name], g, rtol=1e-6, what=f"{recompute} {name}")


@pytest.mark.slow
def test_recompute_reproduces_dropout_masks_with_sequence_parallelism(run_ranks):
    plain = run_ranks(_grads_with_dropout, 2, "llama", "none", 2, True)
    for recompute in ("selective", "full"):
        for (loss, grads), (other, other_grads) in zip(
                plain, run_ranks(_grads_with_dropout, 2, "llama", recompute, 2, True)):
            assert abs(other - loss) <= 1e-6 * abs(loss)
            for name, g in grads.items():
                assert_rel(other_grads[name], g, rtol=1e-6, what=f"{recompute} {name}")
