"""The cost model's shared pieces (one Comm type, one collective-time formula), the network model,
ZeRO volumes, memory by attention kernel and recompute policy, recompute cost and efficiency
(ops_transformer.planner). Pure logic: no process group."""

from __future__ import annotations

import json

import pytest

from ops_transformer.comm.ledger import wire_elements
from ops_transformer.models import preset
from ops_transformer.parallelize.linear_split import split_comm
from ops_transformer.planner import efficiency as E
from ops_transformer.planner.catalogue import LINKS, gpu_for_device
from ops_transformer.planner.cost import (Comm, collective_time, comm_time, hierarchical_time,
                                          link_alpha, ring_steps)
from ops_transformer.planner.hardware import CPU_GLOO
from ops_transformer.planner.memory import activation_bytes_per_layer, logits_bytes
from ops_transformer.planner.network import group_time, inter_alpha_beta, placement
from ops_transformer.planner.search import Options, evaluate, execution
from ops_transformer.planner.specs import MODEL_PRESETS, ClusterSpec, ModelSpec
from ops_transformer.planner.strategies import model_comm_per_step
from ops_transformer.planner.timing import Execution, sequence_parallel_comm, zero_comm
from ops_transformer.training.loop import expected_comm_per_step


# --- one {kind: {calls, elements}} type -----------------------------------------------------------

def test_comm_type_adds_scales_and_compares_as_a_dict():
    a = Comm.of(("all_reduce", 100), ("all_gather", 0), ("all_reduce", 50))
    assert a == {"all_reduce": {"calls": 2, "elements": 150}}  # empty calls are left out
    b = a + {"all_gather": {"calls": 1, "elements": 8}}
    assert b == {"all_reduce": {"calls": 2, "elements": 150},
                 "all_gather": {"calls": 1, "elements": 8}}
    assert b.minus(a) == {"all_gather": {"calls": 1, "elements": 8}}
    assert a.scaled(3) == {"all_reduce": {"calls": 6, "elements": 450}} and b.calls == 3
    assert b.wire_elements(4) == wire_elements("all_reduce", 150, 4) + wire_elements(
        "all_gather", 8, 4)
    assert json.loads(json.dumps(b)) == b


def test_strategies_linear_split_and_training_metrics_share_the_type():
    cfg = preset("llama-tiny")
    step = model_comm_per_step(cfg, 2, "heads", 2, 16)
    assert isinstance(step, Comm) and step == expected_comm_per_step(cfg, 2, "heads", 2, 16)
    split = split_comm("column", 8, 4, 6, "sharded", "replicated")
    assert all(isinstance(c, Comm) for c in split.values())
    assert split["fwd"] == {"all_gather": {"calls": 2, "elements": 8 * 4 + 8 * 6}}


# --- one collective-time formula ------------------------------------------------------------------

def test_collective_time_is_hockney_with_ring_volumes():
    n, p = 1 << 20, 4
    t = collective_time("all_reduce", n, p, alpha_s=1e-5, bandwidth=1e9, bytes_per_element=2,
                        calls=3)
    assert t == pytest.approx(3e-5 + 2 * (p - 1) / p * n * 2 / 1e9)
    assert collective_time("all_reduce", n, 1, alpha_s=1e-5, bandwidth=1e9) == 0.0
    assert [ring_steps(k, 8) for k in ("all_reduce", "all_gather", "reduce_scatter")] == [14, 7, 7]
    assert link_alpha("all_reduce", 8, 2e-6) == pytest.approx(28e-6)


def test_profiles_and_links_price_through_the_same_formula():
    comm = Comm.of(("all_reduce", 4096), ("all_gather", 1024))
    expected = sum(collective_time(k, c["elements"], 2, alpha_s=CPU_GLOO.alpha_s,
                                   bandwidth=CPU_GLOO.bandwidth, calls=c["calls"])
                   for k, c in comm.items())
    assert CPU_GLOO.comm_time(comm, 2) == pytest.approx(expected)
    assert comm_time(comm, 2, CPU_GLOO.alpha_beta) == pytest.approx(expected)
    cluster = ClusterSpec.make("a100-80gb", 8)
    link = cluster.intra_link
    by_link = sum(collective_time(k, c["elements"], 8, alpha_s=link_alpha(k, 8, link.latency_s),
                                  bandwidth=link.bandwidth, bytes_per_element=2)
                  for k, c in comm.items())
    assert group_time(cluster, comm, placement(cluster, 8, 1), 2) == pytest.approx(by_link)


def test_hierarchical_all_reduce_is_three_flat_collectives():
    intra = lambda k, p: (1e-6, 100e9)  # noqa: E731
    inter = lambda k, p: (5e-6, 10e9)  # noqa: E731
    n, nodes, per_node = 8 << 20, 4, 8
    t = hierarchical_time("all_reduce", n, nodes=nodes, per_node=per_node, intra=intra,
                          inter=inter, bytes_per_element=2)
    rs = collective_time("reduce_scatter", n, per_node, alpha_s=1e-6, bandwidth=100e9,
                         bytes_per_element=2)
    ar = collective_time("all_reduce", n / per_node, nodes, alpha_s=5e-6, bandwidth=10e9,
                         bytes_per_element=2)
    ag = collective_time("all_gather", n, per_node, alpha_s=1e-6, bandwidth=100e9,
                         bytes_per_element=2)
    assert t == pytest.approx(rs + ar + ag)
    assert hierarchical_time("all_gather", n, nodes=1, per_node=8, intra=intra, inter=inter) == \
        pytest.approx(collective_time("all_gather", n, 8, alpha_s=1e-6, bandwidth=100e9))


# --- network model: NICs per node and members per node --------------------------------------------

def test_placement_follows_the_rank_grid():
    c = ClusterSpec.make("h100-sxm", 32)
    assert placement(c, 8, 1) == placement(c, 8, 1).__class__(8, 8, 1)  # TP 8: one node
    dp_over_tp8 = placement(c, 4, 8)
    assert (dp_over_tp8.per_node, dp_over_tp8.nodes) == (1, 4)
    dp_tp1 = placement(c, 32, 1)
    assert (dp_tp1.per_node, dp_tp1.nodes) == (8, 4)
    dp_tp2 = placement(c, 16, 2)
    assert (dp_tp2.per_node, dp_tp2.nodes) == (4, 4)


def test_a_group_across_nodes_gets_the_nics_its_members_use():
    c = ClusterSpec.make("h100-sxm", 32)  # 8 NDR NICs per node, one per GPU
    nic = LINKS["ib-ndr"].bandwidth
    one_per_node = inter_alpha_beta(c, 1)("all_reduce", 4)[1]
    eight_per_node = inter_alpha_beta(c, 8)("all_reduce", 32)[1]
    assert one_per_node == pytest.approx(nic)
    assert eight_per_node == pytest.approx(min(8 * nic, c.intra_link.bandwidth))
    assert eight_per_node / one_per_node == pytest.approx(8)  # TP 1 vs TP 8: NCCL's rings per NIC
    shared = ClusterSpec.make("h100-sxm", 32, nics_per_node=1)  # one NIC for the whole node
    assert inter_alpha_beta(shared, 8)("all_reduce", 32)[1] == pytest.approx(nic)
    assert inter_alpha_beta(shared, 1)("all_reduce", 4)[1] == pytest.approx(nic / 8)


def test_group_time_takes_the_cheaper_of_flat_and_hierarchical():
    c = ClusterSpec.make("a100-80gb", 64, inter="ib-hdr", nics_per_node=1)
    comm = Comm.of(("all_reduce", 1 << 26))
    where = placement(c, 64, 1)
    flat_ab = inter_alpha_beta(c, where.per_node)
    alpha, beta = flat_ab("all_reduce", 64)
    flat = collective_time("all_reduce", 1 << 26, 64, alpha_s=alpha, bandwidth=beta,
                           bytes_per_element=2)
    t = group_time(c, comm, where, 2)
    assert t <= flat and t > 0


# --- ZeRO volumes as the ZeRO paper and FSDP run them ---------------------------------------------

def test_zero_stage_volumes():
    psi, p, k = 1_000_000, 8, 4
    ddp, z1, z2, z3 = (zero_comm(s, psi, k) for s in (0, 1, 2, 3))
    assert ddp == {"all_reduce": {"calls": 1, "elements": psi}}
    assert z1 == {"reduce_scatter": {"calls": 1, "elements": psi},
                  "all_gather": {"calls": 1, "elements": psi}}
    assert ddp.wire_elements(p) == pytest.approx(z1.wire_elements(p))  # both 2Ψ(p−1)/p
    assert z2["reduce_scatter"] == {"calls": k, "elements": k * psi}
    # ZeRO-3: reduce-scatter Ψ + all-gather Ψ twice per micro-step = 3Ψ(p−1)/p (not AR + AG 2Ψ)
    assert z3 == {"all_gather": {"calls": 2 * k, "elements": 2 * k * psi},
                  "reduce_scatter": {"calls": k, "elements": k * psi}}
    assert z3.wire_elements(p) == pytest.approx(3 * k * psi * (p - 1) / p)


def test_gradients_reduce_in_fp32_parameters_gather_in_16_bits():
    # ZeRO-3 over dp 8 in one node: per micro-step two all-gathers of the bf16 parameters and one
    # reduce-scatter of the gradients in fp32 (GRAD_REDUCE_BYTES, torchtitan's and Megatron's
    # default with bf16 weights): 2 · 2Ψ·7/8 + 4Ψ·7/8 bytes at NVLink's β, plus 3 calls' α.
    from ops_transformer.planner.search import params_per_gpu
    from ops_transformer.planner.timing import GRAD_REDUCE_BYTES, split_dp_comm

    assert GRAD_REDUCE_BYTES == 4
    model = MODEL_PRESETS["llama3-8b"].with_(seq=2048, global_batch=8, micro_batch=1)
    c = ClusterSpec.make("h100-sxm", 8)
    o = Options(8, 1, 1, "heads", False, "none", 3, 1)
    row = evaluate(model, c, o)
    psi = int(params_per_gpu(model, o))
    params, grads = split_dp_comm(row["dp_comm"])
    assert params == {"all_gather": {"calls": 2, "elements": 2 * psi}}
    assert grads == {"reduce_scatter": {"calls": 1, "elements": psi}}
    link = c.intra_link
    alpha = 7 * link.latency_s
    expected = 3 * alpha + (2 * 2 * psi + 4 * psi) * 7 / 8 / link.bandwidth
    assert row["time_breakdown"]["dp_comm_s"] == pytest.approx(expected)


def test_zero3_memory_holds_the_reduce_buffer_and_under_pp_the_whole_stage():
    # Llama 3 405B at tp 1 over 512 ranks: a layer is (Ψ − 2·V·h) / 126 = 3.19e9 parameters;
    # ZeRO-3 holds two gathered bf16 layers, one layer's bf16 gradients and the fp32 buffer FSDP
    # reduce-scatters them from: grads = 2Ψ/512 + (2 + 4)·unit. 103.4 GiB: it does not fit 95.
    from ops_transformer.planner.search import _largest_unit, memory, params_per_gpu

    model = MODEL_PRESETS["llama3-405b"].with_(seq=32768, global_batch=64, micro_batch=1)
    psi, vh = model.params(), model.vocab * model.hidden
    unit = (psi - 2 * vh) / model.layers
    assert unit == pytest.approx(3.19e9, rel=1e-3)
    o = Options(32, 1, 1, "heads", False, "selective", 3, 1, cp=16)
    got = memory(model, o, 2, "fused", "fp32")  # the row's kernels (torchtitan's fp32 loss)
    assert got["params"] == pytest.approx(2 * psi / 512 + 2 * 2 * unit)
    assert got["grads"] == pytest.approx(2 * psi / 512 + (2 + 4) * unit)
    assert sum(got.values()) / 2**30 == pytest.approx(103.4, abs=0.1)
    # under pipelining FSDP keeps the stage gathered and its gradients unsharded: tp 2 × pp 2
    # holds a stage's Ψ_stage bf16 weights and gradients whole (462 GiB in all)
    o = Options(16, 2, 1, "heads", True, "selective", 3, 1, pp=2, cp=8, schedule="zero_bubble")
    stage = params_per_gpu(model, o)
    got = memory(model, o, 2, "fused", "fp32")
    assert got["params"] == pytest.approx(2 * stage / 128 + 2 * stage)
    assert got["grads"] == pytest.approx(2 * stage / 128 + 2 * stage + 4 * _largest_unit(model, o))
    assert sum(got.values()) / 2**30 == pytest.approx(462, abs=1)


def test_sequence_parallel_keeps_the_volume_in_twice_the_calls():
    comm = Comm.of(("all_reduce", 1024), ("all_gather", 12))
    sp = sequence_parallel_comm(comm)
    assert sp == {"reduce_scatter": {"calls": 1, "elements": 1024},
                  "all_gather": {"calls": 2, "elements": 1036}}
    assert sp.wire_elements(4) == pytest.approx(comm.wire_elements(4))


# --- memory by attention kernel -------------------------------------------------------------------

S, B, H, A, T = 4096, 2, 4096, 32, 4


def test_fused_attention_keeps_no_scores_only_the_log_sum_exp():
    eager = activation_bytes_per_layer(S, B, H, A, T, attention_kernel="eager")
    fused = activation_bytes_per_layer(S, B, H, A, T, attention_kernel="fused")
    sbh = S * B * H
    assert eager - fused == pytest.approx(sbh * 5 * A * S / (H * T) - 4 * A * S * B / T)
    assert fused == pytest.approx(sbh * (10 + 24 / T) + 4 * A * S * B / T)
    no_dropout = activation_bytes_per_layer(S, B, H, A, T, attention_kernel="eager",
                                            dropout=False)
    assert no_dropout == pytest.approx(sbh * (8 + 24 / T + 2 * A * S / (H * T)))


def test_llama_layer_by_hand():
    kv, ffn = 8, 14336  # GQA, gated FFN, no dropout, bf16, tp 1
    got = activation_bytes_per_layer(S, 1, H, A, 1, attention_kernel="fused", kv_heads=kv,
                                     ffn=ffn, gated=True, dropout=False)
    sbh = S * H
    # norms 4, projection inputs 4; Q 2, K and V 2·kv/a each, attention output 2, 4 gated tensors
    assert got == pytest.approx(sbh * (8 + 2 + 4 * kv / A + 2 + 8 * ffn / H) + 4 * A * S)


def test_recompute_policies():
    sbh = S * B * H
    kw = dict(kv_heads=8, ffn=14336, gated=True, dropout=False)
    full = activation_bytes_per_layer(S, B, H, A, 1, recompute="full", **kw)
    assert full == 2 * sbh
    ops = activation_bytes_per_layer(S, B, H, A, 1, recompute="ops", attention_kernel="fused", **kw)
    # input 2; q 2, v 2·kv/a, w1 2·ffn/h, w2 2 (every other projection); attention output 2
    assert ops == pytest.approx(sbh * (2 + 2 + 2 * 8 / A + 2 * 14336 / H + 2 + 2)
                                + 4 * A * S * B)
    fused_selective = activation_bytes_per_layer(S, B, H, A, 1, recompute="selective",
                                                 attention_kernel="fused", **kw)
    assert fused_selective == ops  # a fused kernel has no scores to drop
    eager_selective = activation_bytes_per_layer(S, B, H, A, T, recompute="selective")
    assert eager_selective == pytest.approx(sbh * (10 + 24 / T))  # Korthikanti et al.


def test_logits_working_set_by_loss_kernel():
    assert logits_bytes(1000, 50000, 1, 2, "fused") == 1000 * 50000 * 4
    assert logits_bytes(1000, 50000, 2, 2, "fp32") == 1000 * 25000 * 14
    with pytest.raises(ValueError, match="loss_kernel must be one of"):
        logits_bytes(1, 1, 1, 2, "int8")


def test_eager_attention_at_long_sequences_does_not_fit_where_fused_does():
    model = MODEL_PRESETS["llama3-8b"].with_(global_batch=8)
    cluster = ClusterSpec.make("h100-sxm", 8)
    o = Options(dp=8, tp=1, ep=1, attention="heads", sequence_parallel=False, recompute="none",
                zero_stage=3, micro_batch=1)
    fused = evaluate(model, cluster, o, execution(cluster, attention_kernel="fused")[0])
    eager = evaluate(model, cluster, o, execution(cluster, attention_kernel="eager")[0])
    assert fused["fits"] and not eager["fits"]
    assert eager["memory_breakdown"]["activations"] > 2 * fused["memory_breakdown"]["activations"]


# --- recompute cost is what is recomputed ---------------------------------------------------------

def _row(recompute, kernel="fused", **model_changes):
    model = MODEL_PRESETS["llama2-7b"].with_(global_batch=8, **model_changes)
    cluster = ClusterSpec.make("a100-80gb", 8)
    o = Options(dp=8, tp=1, ep=1, attention="heads", sequence_parallel=False,
                recompute=recompute, zero_stage=1, micro_batch=1)
    return evaluate(model, cluster, o, Execution(kernel, 0.5, 0.0, 1.0))


def test_recompute_cost_depends_on_what_is_recomputed():
    base = _row("none")
    full, selective = _row("full"), _row("selective")
    m = MODEL_PRESETS["llama2-7b"]
    b, s, h, f = 1, m.seq, m.hidden, m.ffn
    layer_fwd = 2 * b * s * h * (4 * h + 3 * f)  # q, k, v, o and the gated FFN, MHA
    core_fwd = 4 * b * s * s * h
    assert full["hfu"] > full["mfu"] and base["hfu"] == base["mfu"]
    gpus = 8
    recomputed = (full["hfu"] - full["mfu"]) / full["mfu"] * m.flops_per_token() * 8 * s / gpus
    assert recomputed == pytest.approx(m.layers * (layer_fwd + core_fwd / 2), rel=1e-6)
    sel = (selective["hfu"] - selective["mfu"]) / selective["mfu"] * m.flops_per_token() * 8 * s \
        / gpus
    assert sel == pytest.approx(m.layers * 2 * b * s * h * (2 * h + f), rel=1e-6)  # k, o, w3
    assert base["step_time_s"] < selective["step_time_s"] < full["step_time_s"]
    ratio = full["step_time_s"] / base["step_time_s"]
    assert ratio != pytest.approx(4 / 3, abs=0.01)
    eager = _row("selective", kernel="eager")
    eager_base = _row("none", kernel="eager")
    extra = (eager["hfu"] - eager["mfu"]) / eager["mfu"] * m.flops_per_token() * 8 * s / gpus
    assert extra == pytest.approx(m.layers * core_fwd, rel=1e-6)  # eager: the attention core
    assert eager["memory_per_gpu_bytes"] < eager_base["memory_per_gpu_bytes"]


# --- efficiency as an input -----------------------------------------------------------------------

def test_efficiency_defaults_carry_their_source():
    a100 = E.default_efficiency("a100-80gb")
    assert 0 < a100.value <= 1 and "published_runs.json" in a100.source
    assert E.default_efficiency("h200").value == E.FITTED_BY_GPU["h100-sxm"]
    assert "same compute die" in E.default_efficiency("h200").source
    assert "median" in E.default_efficiency("b200").source
    with pytest.raises(ValueError, match="stack must be one of"):
        E.default_efficiency("a100-80gb", "deepspeed")


def test_efficiency_is_an_input():
    model = MODEL_PRESETS["llama2-7b"].with_(global_batch=64)
    cluster = ClusterSpec.make("a100-80gb", 8)
    o = Options(8, 1, 1, "heads", False, "none", 1, 1)
    slow = evaluate(model, cluster, o, execution(cluster, efficiency=0.3)[0])
    fast = evaluate(model, cluster, o, execution(cluster, efficiency=0.6)[0])
    assert slow["time_breakdown"]["matmul_s"] == pytest.approx(
        2 * fast["time_breakdown"]["matmul_s"])
    run, source = execution(cluster, efficiency=0.45)
    assert run.efficiency == 0.45 and source == "given"


@pytest.mark.parametrize("name,gib,card", [
    ("NVIDIA H100 80GB HBM3", 79.6, "h100-sxm"), ("NVIDIA H100", 95.0, "h100-sxm-96gb"),
    ("NVIDIA A100-SXM4-40GB", 39.4, "a100-40gb"), ("NVIDIA A100-SXM4-80GB", 79.2, "a100-80gb"),
    ("NVIDIA H200", 139.8, "h200"), ("NVIDIA H100 PCIe", 79.6, "h100-pcie"),
    ("NVIDIA GeForce RTX 4090", 23.6, None)])
def test_devices_map_to_catalogue_cards(name, gib, card):
    assert gpu_for_device(name, int(gib * 2 ** 30)) == card


# --- one model description ------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny", "llama-tiny", "small", "llama-style"])
def test_model_spec_and_gpt_config_convert_without_loss(name):
    cfg = preset(name)
    spec = ModelSpec.from_gpt_config(cfg)
    assert spec.gpt_config() == cfg
    assert ModelSpec.from_gpt_config(spec.gpt_config()) == spec


def test_the_planner_reads_positions_instead_of_guessing_them():
    # SwiGLU with learned positions: kv_split needs head_dim % tp, not % 2·tp (rotary pairs).
    spec = ModelSpec.from_gpt_config(preset("tiny", mlp="swiglu", d_model=24, n_heads=2,
                                            d_ff=48))
    from ops_transformer.planner.search import layout_problem

    o = Options(dp=1, tp=4, ep=1, attention="kv_split", sequence_parallel=False,
                recompute="none", zero_stage=0, micro_batch=1)
    cluster = ClusterSpec.make("a100-80gb", 4)
    assert spec.pos == "learned" and layout_problem(spec.with_(seq=16), cluster, o) is None
    assert "head_dim (12) is not divisible by 8" in layout_problem(
        spec.with_(seq=16, pos="rope"), cluster, o)


# --- the activation formula against our own model's saved tensors ---------------------------------

def _saved_bytes(cfg, batch, seq):
    """Bytes autograd keeps for backward (saved_tensors_hooks, one count per storage, parameters
    left out)."""
    import torch

    from ops_transformer import GPT

    torch.manual_seed(0)
    model = GPT(cfg)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    idx = torch.randint(0, cfg.vocab_size, (batch, seq + 1),
                        generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx[:, :-1], idx[:, 1:])
    return sum(kept.values())


@pytest.mark.parametrize("name,changes", [("tiny", {}), ("tiny", {"d_model": 128, "d_ff": 512}),
                                          ("llama-tiny", {}), ("llama-tiny", {"n_kv_heads": 4})])
def test_fused_formula_matches_the_reference_model(name, changes):
    """Per layer (3 layers minus 1), fp32 on CPU, where SDPA is a fused kernel that keeps the
    log-sum-exp. The Llama family keeps two things the formula leaves to fused kernels: each
    eager RMSNorm's normalised output (``sbh``) and, with GQA, K and V repeated to all heads."""
    b, s = 2, 64
    one, three = (preset(name, n_layers=n, max_seq_len=s, **changes) for n in (1, 3))
    per_layer = (_saved_bytes(three, b, s) - _saved_bytes(one, b, s)) / 2
    cfg = one
    formula = activation_bytes_per_layer(
        s, b, cfg.d_model, cfg.n_heads, 1, attention_kernel="fused", kv_heads=cfg.n_kv_heads,
        ffn=cfg.d_ff, gated=cfg.mlp == "swiglu", dropout=False, bytes_per_element=4)
    extra = 0.0
    if cfg.norm == "rmsnorm":
        sbh = s * b * cfg.d_model * 4
        extra = 2 * sbh + 2 * (1 - cfg.n_kv_heads / cfg.n_heads) * sbh
    assert per_layer == pytest.approx(formula + extra, rel=0.01)


def test_mqa_replica_sums_are_priced_on_their_own_group():
    """With one KV head at tp 4 the replica group is the whole TP group: both parts still count."""
    from ops_transformer.planner.timing import tp_comm

    model = MODEL_PRESETS["llama2-7b"].with_(kv_heads=1, global_batch=8)
    o = Options(dp=2, tp=4, ep=1, attention="heads", sequence_parallel=False, recompute="none",
                zero_stage=0, micro_batch=1)
    parts = tp_comm(model, o)
    head_dim = model.hidden // model.heads
    assert parts["sub_size"] == 4
    assert parts["sub"]["all_reduce"]["elements"] == model.layers * 2 * head_dim * model.hidden
    assert parts["main"]["all_reduce"]["calls"] == model.layers * 4 + 2  # + embedding, LM head
