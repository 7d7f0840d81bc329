"""Mixture of experts (SPEC F9): the reference MoE by hand, one expert = the dense FFN, and the
expert-parallel layer and model at ep 2, ep 2 × tp 2 and dp 2 × ep 2 against the single-device MoE
fed the same per-rank micro-batches — outputs, input and weight gradients, losses and gathered
weights after 3 SGD steps, dropped-token counts, and the collectives of each MoE layer."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

from helpers import assert_rel
from ops_transformer import GPT, CommLedger, gather_full_state_dict, init_parallel, parallelize
from ops_transformer.layers.moe import ParallelMoE
from ops_transformer.models import preset
from ops_transformer.models.gpt import MLP, GPTConfig
from ops_transformer.models.moe import (MoE, Router, capacity_mask, init_routers,
                                        load_balancing_loss, moe_stats)
from ops_transformer.planner import moe_cost
from ops_transformer.precision import clip_grad_norm_

B, T, STEPS = 4, 16, 3


def _batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (B, T + 1), generator=g) for _ in range(STEPS)]


# --- the reference MoE, by hand (one process) ------------------------------------------------------

def test_load_balancing_loss_equals_the_formula_on_a_fixed_routing():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.5, 0.3, 0.2], [0.2, 0.2, 0.6]])
    index = torch.tensor([[0, 1], [1, 2], [0, 1], [2, 0]])  # 8 slots: expert 0 ×3, 1 ×3, 2 ×2
    f = torch.tensor([3 / 8, 3 / 8, 2 / 8])
    p = torch.tensor([(0.7 + 0.1 + 0.5 + 0.2) / 4, (0.2 + 0.6 + 0.3 + 0.2) / 4,
                      (0.1 + 0.3 + 0.2 + 0.6) / 4])
    assert float(load_balancing_loss(probs, index)) == pytest.approx(3 * float((f * p).sum()))
    uniform = torch.full((4, 2), 0.5)
    assert float(load_balancing_loss(uniform, torch.tensor([[0], [1], [0], [1]]))) == 1.0


def test_capacity_keeps_earlier_tokens_first():
    index = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0], [3, 0]])  # 10 slots over 4 experts
    # ceil(0.8 · 5 tokens · 2 / 4) = 2 slots per expert: expert 0 keeps tokens 0 and 1 (of 0-4),
    # expert 1 tokens 0 and 2 (of 0, 2, 3)
    keep = capacity_mask(index, 4, 0.8)
    assert keep.tolist() == [[True, True], [True, True], [False, True], [False, False],
                             [True, False]]
    assert capacity_mask(index, 4, None) is None


def test_router_renormalises_top_k_weights():
    router = Router(8, 4, top_k=2)
    with torch.no_grad():
        router.weight.copy_(torch.randn(4, 8, generator=torch.Generator().manual_seed(0)))
    x = torch.randn(5, 8)
    probs, weights, index = router(x)
    assert torch.allclose(probs.sum(-1), torch.ones(5))
    assert torch.allclose(weights.sum(-1), torch.ones(5))
    top = probs.gather(1, index)
    assert torch.allclose(weights, top / top.sum(-1, keepdim=True))
    assert Router(8, 4, top_k=1).forward(x)[1].shape == (5, 1)


def test_one_expert_top1_without_aux_loss_equals_the_dense_model():
    dense_cfg = preset("tiny", max_seq_len=T)

    def train(cfg):
        torch.manual_seed(0)  # the same seed: the expert gets the dense FFN's weights
        model = GPT(cfg)
        losses = []
        for batch in _batches():
            loss = model(batch[:, :-1], batch[:, 1:])[1]
            loss.backward()
            with torch.no_grad():  # plain SGD, lr 0.1
                for p in model.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
            losses.append(float(loss.detach()))
        return losses, model.state_dict()

    dense_losses, dense = train(dense_cfg)
    moe_losses, moe = train(dense_cfg.with_(n_experts=1, top_k=1, moe_aux_loss_coef=0.0))
    assert_rel(torch.tensor(moe_losses), torch.tensor(dense_losses), what="losses")
    for key, value in dense.items():
        assert_rel(moe[key.replace(".mlp.", ".mlp.experts.0.")], value, what=key, floor=0.02)


def test_aux_loss_is_added_with_its_coefficient():
    cfg = preset("moe-tiny", max_seq_len=T, moe_capacity_factor=None)
    batch = _batches()[0]
    torch.manual_seed(0)
    with_aux = GPT(cfg)(batch[:, :-1], batch[:, 1:])[1]
    torch.manual_seed(0)
    model = GPT(cfg.with_(moe_aux_loss_coef=0.0))
    without = model(batch[:, :-1], batch[:, 1:])[1]
    aux = moe_stats(model)["aux_loss"]
    assert aux >= 2.0 - 1e-6  # 2 MoE layers, each ≥ 1 (1 when perfectly balanced)
    assert float(with_aux.detach()) == pytest.approx(float(without.detach()) + 0.01 * aux,
                                                     rel=1e-6)


@pytest.mark.parametrize("changes,needle", [
    ({"n_experts": 4, "top_k": 5}, r"top_k \(5\) must be between 1 and n_experts \(4\)"),
    ({"n_experts": -1}, "n_experts must be 0"),
    ({"n_experts": 4, "moe_capacity_factor": 0.0}, "moe_capacity_factor must be positive"),
    ({"n_experts": 4, "moe_every": 0}, "moe_every must be at least 1"),
])
def test_invalid_moe_config(changes, needle):
    with pytest.raises(ValueError, match=needle):
        GPTConfig(**changes)


def test_moe_every_places_experts_in_every_kth_layer():
    model = GPT(preset("moe-tiny", n_layers=4, moe_every=2))
    assert [type(b.mlp).__name__ for b in model.layers] == ["MLP", "MoE", "MLP", "MoE"]


# --- the expert-parallel layer: output, gradients and collectives ------------------------------

def _moe_layer(tp, ep, capacity, one_expert):
    ctx = init_parallel(tp=tp, ep=ep)
    cfg = preset("moe-tiny", moe_capacity_factor=capacity, top_k=1 if one_expert else 2,
                 mlp="swiglu" if tp > 1 else "gelu")
    torch.manual_seed(0)
    dense = MoE(cfg, MLP)
    init_routers(dense)
    n, h = 24, cfg.d_model
    xs = [torch.randn(n, h, generator=torch.Generator().manual_seed(10 + r)) for r in range(ep)]
    gs = [torch.randn(n, h, generator=torch.Generator().manual_seed(20 + r)) for r in range(ep)]
    if one_expert:  # a router that sends every token to expert 0: uneven and empty splits
        with torch.no_grad():
            dense.router.weight.zero_()
            dense.router.weight[0, 0] = 10.0
        for x in xs:
            x[:, 0] = 1.0
    layer = ParallelMoE.from_dense(copy.deepcopy(dense), ctx)
    names = {"w_in": "w_in.weight", "b_in": "w_in.bias", "w_out": "w_out.weight",
             "b_out": "w_out.bias"}
    params = [dense.router.weight] + [m.get_parameter(names[k]) for k in names
                                      for m in dense.experts]
    ref = []  # the dense MoE on every micro-batch of the EP group: (out, dropped, grads)
    for x, g in zip(xs, gs):
        x = x.clone().requires_grad_()
        out = dense(x)
        grads = torch.autograd.grad((out * g).sum(), [x, *params], allow_unused=True)
        grads = [torch.zeros_like(p) if d is None else d for p, d in zip([x, *params], grads)]
        ref.append((out, int(dense.dropped), grads))
    mine = ref[ctx.ep_rank]
    x = xs[ctx.ep_rank].clone().requires_grad_()
    with CommLedger() as fwd:
        y = layer(x)
    with CommLedger() as bwd:
        (y * gs[ctx.ep_rank]).sum().backward()
    assert_rel(y, mine[0], what="output")
    assert int(layer.dropped) == mine[1]
    assert_rel(x.grad, mine[2][0], what="input grad")
    # the router is replicated: its gradient is this micro-batch's; an expert's sums the
    # micro-batches of the EP group (their tokens came to it)
    assert_rel(layer.router.weight.grad, mine[2][1], what="router grad")
    experts, n_exp = layer.experts, len(dense.experts)
    first, local = experts.shard.first, experts.local_experts
    for i, name in enumerate(names):
        summed = [sum(r[2][2 + i * n_exp + e] for r in ref) for e in range(n_exp)]
        full = torch.stack(summed)[first:first + local]
        param = getattr(experts, name)
        expected = param.shard_spec.shard(full) if hasattr(param, "shard_spec") else full
        assert_rel(param.grad, expected, what=f"{name} grad", floor=1e-3)
    ep_ranks = tuple(dist.get_process_group_ranks(ctx.ep_group)) if ep > 1 else (ctx.rank,)
    tp_ranks = tuple(dist.get_process_group_ranks(ctx.tp_group)) if tp > 1 else (ctx.rank,)
    return (fwd.by_group().get(ep_ranks, {}), bwd.by_group().get(ep_ranks, {}),
            fwd.by_group().get(tp_ranks, {}), bwd.by_group().get(tp_ranks, {}), n)


def _counts(summary):
    return {k: v["calls"] for k, v in summary.items()}


@pytest.mark.parametrize("tp,ep,capacity,one_expert", [
    (1, 2, None, False),
    (1, 2, 0.75, False),
    (1, 2, None, True),
    (2, 2, 1.0, False),
])
def test_expert_parallel_layer_equals_dense(run_ranks, tp, ep, capacity, one_expert):
    results = run_ranks(_moe_layer, tp * ep, tp, ep, capacity, one_expert)
    for ep_fwd, ep_bwd, tp_fwd, tp_bwd, _ in results:
        # per MoE layer: 2 all-to-alls forward (dispatch, combine) and 2 backward over EP, plus
        # the all-gather of the split sizes; the experts' column→row pair over TP
        assert _counts(ep_fwd) == {"all_gather": 1, "all_to_all": 2}
        assert _counts(ep_bwd) == {"all_to_all": 2}
        assert _counts(tp_fwd) == ({"all_reduce": 1} if tp > 1 else {})
        assert _counts(tp_bwd) == ({"all_reduce": 1} if tp > 1 else {})


def test_moe_cost_equals_the_ledger(run_ranks):
    """Dropless: each rank routes S = N·k slots; what the EP group receives is what it sends, so
    the ledger summed over the group is ep × the per-rank formula (balanced routing)."""
    tp, ep = 2, 2
    results = run_ranks(_moe_layer, tp * ep, tp, ep, None, False)
    cfg, n = preset("moe-tiny"), results[0][4]
    cost = moe_cost(1, n, cfg.d_model, cfg.d_ff, cfg.n_experts, cfg.top_k, ep, tp, swiglu=True)
    group = results[:1] + results[2:3]  # global ranks 0 and 2: one EP group (tp rank 0)

    def summed(i, kinds):
        out = {}
        for r in group:
            for kind in kinds:
                if kind in r[i]:
                    e = out.setdefault(kind, {"calls": 0, "elements": 0})
                    e["calls"] += r[i][kind]["calls"]
                    e["elements"] += r[i][kind]["elements"]
        return out

    def times(comm, k):
        return {kind: {f: v * k for f, v in c.items()} for kind, c in comm.items()}

    ep_kinds, tp_kinds = ("all_gather", "all_to_all"), ("all_reduce",)
    pick = (lambda comm, kinds: {k: v for k, v in comm.items() if k in kinds})
    assert summed(0, ep_kinds) == times(pick(cost.fwd, ep_kinds), ep)
    assert summed(1, ep_kinds) == times(pick(cost.bwd, ep_kinds), ep)
    assert summed(2, tp_kinds) == times(pick(cost.fwd, tp_kinds), ep)
    assert summed(3, tp_kinds) == times(pick(cost.bwd, tp_kinds), ep)
    assert cost.priced() == [(tp, {"all_reduce": cost.total()["all_reduce"]}),
                             (ep, cost.subgroup)]


# --- the model: 3 SGD steps against the single-device MoE -------------------------------------

def moe_model(tp, ep, dp, capacity, **options):
    """``(ctx, model, parallel)``: ``moe-tiny`` (seed 0), parallelised when there are ranks."""
    parallel = int(os.environ["WORLD_SIZE"]) > 1
    ctx = init_parallel(tp=tp, ep=ep, dp=dp) if parallel else init_parallel()
    cfg = preset("moe-tiny", max_seq_len=T, moe_capacity_factor=capacity)
    torch.manual_seed(0)
    model = GPT(cfg)
    return ctx, (parallelize(model, ctx, **options) if parallel else model), parallel


def _train(tp, ep, dp, capacity, clip=None):
    ctx, model, parallel = moe_model(tp, ep, dp, capacity)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    micro = dp * ep  # without ranks: the reference, fed every micro-batch, gradients averaged
    losses, dropped = [], []
    for batch in _batches():
        chunks = batch.chunk(micro)
        step_losses, step_dropped = [], []
        for rows in [chunks[ctx.dp_ep_rank]] if parallel else chunks:
            loss = model(rows[:, :-1], rows[:, 1:])[1]
            step_losses.append(float(loss.detach()))
            step_dropped.append(moe_stats(model)["dropped"])
            (loss if parallel else loss / micro).backward()
        if clip is not None:  # the dense model's norm: experts differ across EP ranks
            if parallel:
                clip_grad_norm_(model, clip, ctx)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(step_losses)
        dropped.append(step_dropped)
    return ctx.dp_ep_rank, losses, dropped, gather_full_state_dict(model, ctx)


@pytest.mark.parametrize("tp,ep,dp,capacity,clip", [
    (1, 2, 1, None, None),
    pytest.param(1, 2, 1, 1.0, None, marks=pytest.mark.slow),  # capacity: unmarked on the layer
    pytest.param(2, 2, 1, None, None, marks=pytest.mark.slow),
    pytest.param(2, 2, 1, 1.0, None, marks=pytest.mark.slow),
    pytest.param(1, 2, 2, None, None, marks=pytest.mark.slow),
    pytest.param(1, 4, 1, 0.75, None, marks=pytest.mark.slow),
    pytest.param(2, 2, 1, None, 0.05, marks=pytest.mark.slow),  # clipped to the dense norm
])
def test_training_equals_single_device_moe_on_the_same_micro_batches(run_ranks, tp, ep, dp,
                                                                     capacity, clip):
    _, ref_losses, ref_dropped, ref_state = run_ranks(_train, 1, 1, ep, dp, capacity, clip)[0]
    if capacity is not None:
        assert any(d for step in ref_dropped for d in step), "the capacity should drop slots"
    for micro, losses, dropped, state in run_ranks(_train, tp * ep * dp, tp, ep, dp, capacity,
                                                   clip):
        assert_rel(torch.tensor(losses)[:, 0], torch.tensor(ref_losses)[:, micro],
                   what=f"losses of micro-batch {micro}")
        assert [d[0] for d in dropped] == [d[micro] for d in ref_dropped]
        assert list(state) == list(ref_state)
        for key, value in ref_state.items():
            assert_rel(state[key], value, what=key, floor=0.02)


# --- errors ---------------------------------------------------------------------------------

def _bad_ep(n_experts):
    ctx = init_parallel(ep=int(os.environ["WORLD_SIZE"]))
    torch.manual_seed(0)
    cfg = preset("moe-tiny", n_experts=n_experts, top_k=1) if n_experts else preset("tiny")
    parallelize(GPT(cfg), ctx)


@pytest.mark.parametrize("n_experts,needle", [
    (3, r"n_experts \(3\) is not divisible by ep \(2\)"),
    (0, r"ep \(2\) > 1 needs a mixture-of-experts model"),
])
def test_bad_expert_parallel_degree_is_a_clear_error(run_ranks, n_experts, needle):
    with pytest.raises(Exception, match=needle):
        run_ranks(_bad_ep, 2, n_experts)


# --- planner and command line ------------------------------------------------------------------

def test_moe_cost_by_hand():
    c = moe_cost(b=2, s=8, h=64, ffn=128, experts=4, top_k=2, ep=2, tp=2)
    slots_h = 2 * 8 * 2 * 64  # S·h
    assert c.fwd == {"all_reduce": {"calls": 1, "elements": slots_h},
                     "all_gather": {"calls": 1, "elements": 2 * 4},
                     "all_to_all": {"calls": 2, "elements": 2 * slots_h}}
    assert c.bwd == {"all_reduce": {"calls": 1, "elements": slots_h},
                     "all_to_all": {"calls": 2, "elements": 2 * slots_h}}
    # router 2·bsh·E, experts 2·S·h·ffn·2 / tp; a step is 3 × forward
    assert c.flops == 3 * (2 * 2 * 8 * 64 * 4 + 2 * 32 * 64 * 128 * 2 / 2)
    assert moe_cost(2, 8, 64, 128, 4, 2, 1, 1).total() == {}


def test_planner_searches_ep_for_moe_models():
    from ops_transformer.planner.search import search
    from ops_transformer.planner.specs import ClusterSpec, ModelSpec

    spec = ModelSpec.from_gpt_config(preset("moe-small"))
    assert (spec.experts, spec.top_k) == (8, 2)
    result = search(spec, ClusterSpec.make("a100-80gb", 8), top=100_000)
    eps = {c["ep"] for c in result["candidates"]}
    assert eps == {1, 2, 4, 8} and all(c["ffn"] == "experts" for c in result["candidates"])
    assert f"ep={result['best']['ep']}" in result["advice"]
    with_ep = next(c for c in result["candidates"] if c["ep"] == 2 and c["tp"] == 1)
    assert with_ep["time_breakdown"]["ep_comm_s"] > 0
    dense = search(ModelSpec.from_gpt_config(preset("small")), ClusterSpec.make("a100-80gb", 8))
    assert {c["ep"] for c in dense["candidates"]} == {1}


def test_progress_line_shows_aux_loss_and_dropped_fraction(capfd, tmp_path):
    from ops_transformer.training.loop import TrainConfig, train_worker

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 200)
    metrics = train_worker(TrainConfig(preset="moe-tiny", steps=2, batch=2, seq=16,
                                       sample_tokens=2, data=str(corpus)))
    err = capfd.readouterr().err
    assert "aux=" in err and "dropped=" in err
    assert len(metrics["moe"]["aux_loss"]) == 2 and metrics["ep"] == 1


@pytest.mark.slow
def test_train_cli_with_expert_parallelism(tmp_path, capfd):
    from ops_transformer.cli.main import main

    out = tmp_path / "run"
    assert main(["train", "--ep", "2", "--preset", "moe-tiny", "--steps", "3", "--batch", "4",
                 "--seq", "32", "--out", str(out)]) == 0
    captured = capfd.readouterr()
    assert "dp=1 × ep=2 × tp=1" in captured.out and "MoE aux loss" in captured.out
    assert "aux=" in captured.err and "dropped=" in captured.err  # the progress line
    import json

    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["ep"] == 2 and len(metrics["moe"]["aux_loss"]) == 3
    assert all(a >= 2.0 - 1e-6 for a in metrics["moe"]["aux_loss"])  # 2 layers, each ≥ 1
    assert all(0.0 <= d < 1.0 for d in metrics["moe"]["dropped_fraction"])


@pytest.mark.parametrize("argv,needle", [
    (["train", "--nproc", "2", "--ep", "2"], "--ep (2) needs a mixture-of-experts preset"),
    (["train", "--nproc", "3", "--ep", "3", "--preset", "moe-tiny"],
     "--ep (3) must divide the preset's n_experts (4)"),
    (["train", "--nproc", "4", "--ep", "2", "--preset", "moe-tiny", "--batch", "6"],
     "--batch (6) must be divisible by dp (2) × ep (2)"),
])
def test_train_cli_ep_errors(argv, needle, capsys):
    from ops_transformer.cli.main import main

    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_a_planner_layout_must_match_the_expert_parallel_degree():
    from ops_transformer import ParallelContext

    ctx = ParallelContext(rank=0, world_size=2, tp_size=1, tp_rank=0, dp_size=1, dp_rank=0,
                          ep_size=2)
    layout = {"dp": 2, "tp": 1, "ep": 1, "attention": "heads"}
    with pytest.raises(ValueError, match=r"the plan is for dp=2 × ep=1 × tp=1, but this job runs "
                                         r"dp=1 × ep=2 × tp=1"):
        parallelize(GPT(preset("moe-tiny")), ctx, plan=layout)
