"""parallelize(GPT): training at tp 2 and 4 and at dp 2 × tp 2 equals dense full-batch training,
both attention output modes, both model families; exact collectives per layer; clear errors."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from helpers import assert_rel
from ops_transformer import (GPT, CommLedger, Plan, gather_full_state_dict, init_parallel, no_sync,
                             parallelize)
from ops_transformer.models import preset
from ops_transformer.parallelize import gpt_plan

B, T, STEPS = 4, 16, 3
# GPT-2 family: LayerNorm, learned positions, GELU, biases, tied embeddings. Llama family: RMSNorm,
# RoPE, SwiGLU, GQA (2 KV heads: split at tp 2, replicated at tp 4), untied. Vocab 250 is padded
# to 252 at tp 4.
CONFIGS = {
    "gpt2": preset("tiny", vocab_size=250, max_seq_len=T),
    "llama": preset("llama-tiny", vocab_size=250, max_seq_len=T),
}


def _batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 250, (B, T + 1), generator=g) for _ in range(STEPS)]


def _optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    # Adam divides by sqrt(v) + eps, so for a gradient element g near or below eps its update is
    # about lr·g/eps: a rounding difference δg in that element moves the weight by up to
    # lr·δg/eps. Any reordering of a sum (TP's partial sums, dp's averaging, another BLAS blocking)
    # gives δg ≈ 2e-8 here (2e-7 of the largest gradient; more in bias gradients, which sum many
    # tokens with cancellation). With lr=1e-3 and eps=1e-3 that is ~2e-8, far below 1e-5 of the
    # weight scale (2e-7); eps=1e-4 left no margin (1.07e-5 seen on one CPU). With the default
    # eps=1e-8 such elements get updates differing by up to lr, whatever computes them.
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-3)


def _train(config, opt_name, tp, attention, vocab="parallel", **options):
    """``options``: more of ``parallelize``'s arguments (sequence parallelism, recompute)."""
    ctx = init_parallel(tp=tp)
    torch.manual_seed(0)
    model = GPT(CONFIGS[config])
    if int(os.environ["WORLD_SIZE"]) > 1 or options:
        model = parallelize(model, ctx, attention=attention, vocab=vocab, **options)
    opt = _optimizer(opt_name, model.parameters())
    rows = slice(ctx.dp_rank * B // ctx.dp_size, (ctx.dp_rank + 1) * B // ctx.dp_size)
    losses = []
    for batch in _batches():
        loss = model(batch[rows, :-1], batch[rows, 1:])[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        if ctx.dp_group is not None:  # report the global-batch loss
            dist.all_reduce(loss, group=ctx.dp_group)
            loss /= ctx.dp_size
        losses.append(float(loss))
    return losses, gather_full_state_dict(model, ctx)


@pytest.mark.parametrize("config,opt_name,nprocs,tp,attention", [
    ("gpt2", "sgd", 2, 2, "heads"),
    ("gpt2", "adamw", 2, 2, "heads_allgather"),
    ("gpt2", "adamw", 4, 4, "heads"),
    ("gpt2", "sgd", 4, 2, "heads_allgather"),
    ("llama", "adamw", 2, 2, "heads"),
    ("llama", "sgd", 4, 4, "heads_allgather"),
    ("llama", "adamw", 4, 4, "heads"),
    ("llama", "adamw", 4, 2, "heads"),
])
def test_training_equals_dense(run_ranks, config, opt_name, nprocs, tp, attention):
    dense_losses, dense_state = run_ranks(_train, 1, config, opt_name, 1, attention)[0]
    for losses, state in run_ranks(_train, nprocs, config, opt_name, tp, attention):
        assert_rel(torch.tensor(losses), torch.tensor(dense_losses), what="per-step losses")
        assert list(state) == list(dense_state)
        for key, value in dense_state.items():
            assert value.shape == state[key].shape, key
            # Parameters that start at zero (biases) hold a few updates of size ~lr after 3 steps;
            # their error is measured against the model's weight scale (init std 0.02).
            assert_rel(state[key], value, what=key, floor=0.02)


def _collectives(config, n_layers, attention, vocab="parallel"):
    ctx = init_parallel(tp=int(os.environ["WORLD_SIZE"]))
    torch.manual_seed(0)
    model = parallelize(GPT(CONFIGS[config].with_(n_layers=n_layers)), ctx, attention=attention,
                        vocab=vocab)
    batch = _batches()[0]
    with CommLedger() as fwd:
        loss = model(batch[:, :-1], batch[:, 1:])[1]
    with CommLedger() as bwd:
        loss.backward()
    tp_ranks = tuple(range(ctx.tp_size))
    return fwd.by_group().get(tp_ranks, {}), bwd.by_group().get(tp_ranks, {}), bwd.by_group()


def _delta(a, b):
    out = {k: {f: a[k][f] - b.get(k, {}).get(f, 0) for f in a[k]} for k in a}
    return {k: v for k, v in out.items() if v["calls"]}


@pytest.mark.parametrize("attention", ["heads", "heads_allgather"])
def test_each_layer_issues_the_minimum_collectives(run_ranks, attention):
    bsh = B * T * CONFIGS["gpt2"].d_model
    one = run_ranks(_collectives, 2, "gpt2", 1, attention)[0]
    two = run_ranks(_collectives, 2, "gpt2", 2, attention)[0]
    per_layer_fwd, per_layer_bwd = _delta(two[0], one[0]), _delta(two[1], one[1])
    ar = {"calls": 2, "elements": 2 * bsh, "bytes": 8 * bsh}
    if attention == "heads":
        assert per_layer_fwd == {"all_reduce": ar}
    else:
        half = {"calls": 1, "elements": bsh, "bytes": 4 * bsh}
        assert per_layer_fwd == {"all_reduce": half, "all_gather": half}
    assert per_layer_bwd == {"all_reduce": ar}
    # Outside the layers: the embedding's all-reduce and the loss's all-gather (3 statistics per
    # token from each of the 2 ranks) in forward, the head's input gradient in backward.
    n = B * T
    fwd1, bwd1 = one[0], one[1]
    assert _delta(fwd1, per_layer_fwd) == {
        "all_reduce": {"calls": 1, "elements": bsh, "bytes": 4 * bsh},
        "all_gather": {"calls": 1, "elements": 2 * 3 * n, "bytes": 4 * 6 * n}}
    assert _delta(bwd1, per_layer_bwd) == {"all_reduce": {"calls": 1, "elements": bsh,
                                                          "bytes": 4 * bsh}}


@pytest.mark.parametrize("config,nprocs,tp", [("gpt2", 2, 2), ("llama", 4, 2)])
def test_replicated_vocabulary_trains_like_dense(run_ranks, config, nprocs, tp):
    dense_losses, dense_state = run_ranks(_train, 1, config, "adamw", 1, "heads")[0]
    for losses, state in run_ranks(_train, nprocs, config, "adamw", tp, "heads", "replicated"):
        assert_rel(torch.tensor(losses), torch.tensor(dense_losses), what="per-step losses")
        for key, value in dense_state.items():
            assert_rel(state[key], value, what=key, floor=0.02)


def test_replicated_vocabulary_communicates_only_inside_the_layers(run_ranks):
    fwd, bwd, _ = run_ranks(_collectives, 2, "gpt2", 1, "heads", "replicated")[0]
    bsh = B * T * CONFIGS["gpt2"].d_model
    assert fwd == bwd == {"all_reduce": {"calls": 2, "elements": 2 * bsh, "bytes": 8 * bsh}}


def test_auto_keeps_a_byte_vocabulary_replicated_and_splits_gpt2s():
    assert gpt_plan(CONFIGS["gpt2"].with_(vocab_size=256), 2, batch=8, seq=64).vocab == \
        "replicated"
    assert gpt_plan(preset("gpt2-124m"), 2, batch=8, seq=1024).vocab == "parallel"


def test_replicated_kv_heads_sum_their_gradients_over_the_replicas(run_ranks):
    fwd, bwd, groups = run_ranks(_collectives, 4, "llama", 2, "heads")[0]
    kv = CONFIGS["llama"].n_kv_heads * CONFIGS["llama"].head_dim * CONFIGS["llama"].d_model
    # wk and wv of both layers, each [n_kv_heads·head_dim / 2 shards, d_model] on this rank, summed
    # in one coalesced all-reduce at the end of backward (not one per parameter per layer)
    assert groups[(0, 1)] == {"all_reduce": {"calls": 1, "elements": 2 * kv, "bytes": 8 * kv}}
    assert fwd["all_reduce"]["calls"] == 2 * 2 + 1  # attention + FFN per layer, embedding
    assert fwd["all_gather"]["calls"] == 1  # the loss


def _accumulate(micro):
    ctx = init_parallel(tp=2)
    torch.manual_seed(0)
    model = parallelize(GPT(CONFIGS["gpt2"]), ctx)
    batch = _batches()[0]
    rows = batch[ctx.dp_rank * 2:(ctx.dp_rank + 1) * 2]  # this dp rank's 2 rows
    parts = rows.chunk(micro)
    with CommLedger() as ledger:
        for i, part in enumerate(parts):
            if i < micro - 1:
                with no_sync(model):
                    (model(part[:, :-1], part[:, 1:])[1] / micro).backward()
            else:
                (model(part[:, :-1], part[:, 1:])[1] / micro).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    dp_calls = ledger.by_group().get((ctx.tp_rank, ctx.tp_rank + 2), {})
    return grads, dp_calls


def test_gradient_accumulation_with_no_sync(run_ranks):
    once = run_ranks(_accumulate, 4, 1)
    twice = run_ranks(_accumulate, 4, 2)
    for (g1, dp1), (g2, dp2) in zip(once, twice):
        assert dp1 == dp2 and dp1["all_reduce"]["calls"] >= 1  # averaged once per step
        for name in g1:
            assert_rel(g2[name], g1[name], what=name)


def _generate():
    ctx = init_parallel(tp=int(os.environ["WORLD_SIZE"]))
    torch.manual_seed(0)
    model = GPT(CONFIGS["llama"])
    if ctx.tp_size > 1:
        model = parallelize(model, ctx)
    prompt = torch.tensor([[1, 2, 3, 4]])
    greedy = model.generate(prompt, 8, temperature=0)
    sampled = model.generate(prompt, 8, generator=torch.Generator().manual_seed(5))
    logits, loss = model(prompt)
    return greedy.tolist(), sampled.tolist(), logits.shape, loss


def test_generation_matches_dense(run_ranks):
    dense = run_ranks(_generate, 1)[0]
    for out in run_ranks(_generate, 4):
        assert out[0] == dense[0] and out[1] == dense[1]
        assert out[2] == (1, 4, 250) and out[3] is None  # full logits, padding sliced away


def test_plan_is_data():
    plan = gpt_plan(CONFIGS["llama"], 4, "heads")
    again = Plan.from_dict(json.loads(plan.to_json()))
    assert again.to_dict() == plan.to_dict()
    assert plan.rules["layers.*.mlp.w_in"] == {"style": "colwise", "sub_blocks": [176, 176]}
    assert "layers.*.attn.wo" in str(plan) and "rowwise" in str(plan)


@pytest.mark.parametrize("changes,tp,needle", [
    ({"n_heads": 4, "d_model": 64}, 8, r"n_heads \(4\) is not divisible by tp \(8\)"),
    ({"n_heads": 6, "n_kv_heads": 3, "d_model": 48}, 2,
     r"n_kv_heads \(3\) and tp \(2\)"),
    ({"d_ff": 250}, 4, r"d_ff \(250\) is not divisible by tp \(4\)"),
])
def test_sizes_that_cannot_be_split_are_clear_errors(changes, tp, needle):
    with pytest.raises(ValueError, match=needle):
        gpt_plan(CONFIGS["gpt2"].with_(**changes), tp, "heads")


def test_unknown_attention_and_preset():
    with pytest.raises(ValueError, match="attention must be one of"):
        gpt_plan(CONFIGS["gpt2"], 2, "rows")
    with pytest.raises(ValueError, match=r"no attention strategy can split this model over tp "
                                         r"\(8\): heads: n_heads \(3\) .* kv_split: head_dim "
                                         r"\(20\) .* naive: d_model \(60\)"):
        gpt_plan(CONFIGS["gpt2"].with_(d_model=60, n_heads=3, n_kv_heads=3), 8)
    with pytest.raises(ValueError, match="unknown preset 'huge'; choose one of"):
        preset("huge")


def _tp_larger_than_world():
    init_parallel(tp=4)


def test_tp_larger_than_world(run_ranks):
    with pytest.raises(ValueError, match=r"world size 2 is not divisible by tp \(4\)"):
        run_ranks(_tp_larger_than_world, 2)
