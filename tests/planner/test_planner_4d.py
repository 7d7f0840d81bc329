"""The planner's 4-D terms against hand-computed cases: the pipeline bubble and in-flight
micro-batches of each schedule, a compute-bound and a bandwidth-bound GEMM, wave quantisation,
context parallelism's exchange volumes; the 4-D search, the one validity rule for pp and cp, and
``plan --validate-published``. Pure logic: no process group."""

from __future__ import annotations

import json

import pytest

from ops_transformer.cli.main import main
from ops_transformer.planner import published as P
from ops_transformer.planner.cp_exchange import cp_layer_comm, exposed_cp_time, kv_width
from ops_transformer.planner.pipeline import (bubble_fraction, boundary_elements,
                                              in_flight_micro_batches, stage_layers)
from ops_transformer.planner.roofline import gemm_time, wave_efficiency
from ops_transformer.planner.runnable import runtime_problem
from ops_transformer.planner.search import (Options, candidates, chosen_layout, evaluate,
                                            execution, memory, search)
from ops_transformer.planner.specs import MODEL_PRESETS, ClusterSpec

A100_PEAK, A100_BW, A100_SMS = 312e12, 2039e9, 108


# --- pipeline -------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule,virtual,bubble", [
    ("gpipe", 1, 3 / 8), ("1f1b", 1, 3 / 8), ("interleaved", 2, 3 / 16),
    ("interleaved", 4, 3 / 32), ("zero_bubble", 1, 1 / 8), ("zbv", 2, 0.0)])
def test_bubble_fraction_per_schedule(schedule, virtual, bubble):
    # p = 4 stages, m = 8 micro-batches: (p-1)/m = 3/8, interleaved (p-1)/(v·m), ZB-H1 a third
    assert bubble_fraction(schedule, 4, 8, virtual) == pytest.approx(bubble)
    assert bubble_fraction(schedule, 1, 8, virtual) == 0.0


def test_first_stage_in_flight_micro_batches():
    assert in_flight_micro_batches("gpipe", 4, 8) == 8  # all m forwards before any backward
    assert in_flight_micro_batches("1f1b", 4, 8) == 4  # p warm-up forwards
    assert in_flight_micro_batches("1f1b", 8, 2) == 2  # never more than there are
    assert in_flight_micro_batches("interleaved", 4, 8, 2) == pytest.approx(4 * (1 + 3 / 8))
    assert in_flight_micro_batches("1f1b", 1, 8) == 1


def test_bad_schedule_is_named():
    with pytest.raises(ValueError, match="schedule must be one of"):
        bubble_fraction("pipedream", 4, 8)
    with pytest.raises(ValueError, match="zbv schedule runs 2 chunks"):
        bubble_fraction("zbv", 4, 8, 1)


def test_stage_layers_and_boundary():
    assert stage_layers(126, 16) == 8 and stage_layers(96, 16) == 6
    # b·(s/cp)·h over tp: 2 · (4096/2) · 8192 / 8
    assert boundary_elements(2, 4096, 8192, tp=8, cp=2) == 2 * 2048 * 8192 // 8


def test_step_time_adds_the_bubble_of_its_schedule():
    model = MODEL_PRESETS["llama3-70b"].with_(global_batch=64)
    cluster = ClusterSpec.make("h100-sxm", 64, 8)
    run = execution(cluster)[0]
    for schedule, v in (("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1)):
        o = Options(8, 4, 1, "heads", True, "full", 1, 1, pp=2, schedule=schedule,
                    virtual_stages=v)
        t = evaluate(model, cluster, o, run)["time_breakdown"]
        busy = (t["compute_s"] + t["tp_comm_s"] + t["cp_exposed_s"] + t["pp_comm_s"]
                + t["ep_comm_s"])
        assert t["pp_bubble_s"] == pytest.approx(busy * bubble_fraction(schedule, 2, 8, v))


# --- roofline -------------------------------------------------------------------------------------

def test_wave_quantisation_by_hand():
    assert wave_efficiency(128 * 108, 128, A100_SMS) == pytest.approx(1.0)  # one full wave
    assert wave_efficiency(128 * 109, 128, A100_SMS) == pytest.approx(109 / 216)  # 1 tile over
    assert wave_efficiency(100, 128, A100_SMS) == pytest.approx(100 / 128 / 108)  # padded tile
    assert wave_efficiency(7, 9, 0) == 1.0  # not modelled


def test_a_square_gemm_is_compute_bound():
    m = n = k = 8192
    tiles = 64 * 64
    wave = tiles / (-(-tiles // 108) * 108)  # 4096 tiles in 38 waves of 108
    compute = 2 * m * n * k / (A100_PEAK * 0.7 * wave)
    assert compute > 3 * m * n * 2 / A100_BW
    assert gemm_time(m, n, k, peak=A100_PEAK, bandwidth=A100_BW, bytes_per_element=2,
                     ceiling=0.7, sms=A100_SMS) == pytest.approx(compute)


def test_a_skinny_gemm_is_bandwidth_bound():
    m, n, k = 8192, 8192, 16  # 2·m·n·k = 2.1 GFLOP but the 8192² output is written once
    moved = (m * k + k * n + m * n) * 2 / A100_BW
    assert moved > 2 * m * n * k / (A100_PEAK * 0.7)
    assert gemm_time(m, n, k, peak=A100_PEAK, bandwidth=A100_BW, bytes_per_element=2,
                     ceiling=0.7, sms=A100_SMS) == pytest.approx(moved)


def test_efficiency_by_shape_small_models_run_below_large_ones():
    cluster = ClusterSpec.make("a100-80gb", 8)
    run = execution(cluster, efficiency=0.7)[0]
    o = Options(8, 1, 1, "heads", False, "none", 0, 1)

    def achieved(name):
        model = MODEL_PRESETS[name].with_(global_batch=8, seq=2048)
        row = evaluate(model, cluster, o, run)
        flops = 3 * 2 * model.active_params() * model.seq  # projections, per sequence
        return flops / (row["time_breakdown"]["matmul_s"] * 312e12)

    assert achieved("gpt2-124m") < achieved("llama2-7b") <= 0.7


# --- context parallelism --------------------------------------------------------------------------

def test_ring_exchange_volumes():
    # b 2, s 4096, 8 KV heads of 128 over tp 2: h_kv = 512; cp 4: blocks of 2·2·1024·512
    block = 2 * 2 * 1024 * 512
    comm = cp_layer_comm("ring", 2, 4096, 8, 128, 4, 2)
    assert comm["forward"] == {"send_recv": {"calls": 3, "elements": 3 * block}}
    # backward: cp − 1 K/V exchanges again and cp dK/dV hops home (context_parallel.layer_comm)
    assert comm["backward"] == {"send_recv": {"calls": 7, "elements": 7 * block}}


def test_allgather_exchange_volumes():
    gathered = 2 * 2 * 4096 * 512
    comm = cp_layer_comm("allgather_kv", 2, 4096, 8, 128, 4, 2)
    assert comm["forward"] == {"all_gather": {"calls": 1, "elements": gathered}}
    assert comm["backward"] == {"reduce_scatter": {"calls": 1, "elements": gathered}}
    assert cp_layer_comm("ring", 2, 4096, 8, 128, 1, 2)["forward"] == {}


def test_kv_heads_replicated_beyond_tp():
    assert kv_width(8, 128, 2) == 512 and kv_width(8, 128, 16) == 128


def test_ring_hides_under_attention_allgather_does_not():
    assert exposed_cp_time("ring", 2.0, 3.0) == 0.0
    assert exposed_cp_time("ring", 5.0, 3.0) == 2.0
    assert exposed_cp_time("allgather_kv", 2.0, 3.0) == 2.0


def test_a_ring_across_nodes_runs_at_one_nics_rate():
    # Llama 3 405B (GQA: 8 KV heads of 128), s = 32768, b = 1, tp 1 × cp 16 on H100 nodes of 8
    # with 8 NDR NICs (45 GB/s each): the CP group spans 2 nodes, 8 ranks in each. One block is
    # X = 2·b·(s/cp)·h_kv = 2 · 2048 · 1024 = 4,194,304 bf16 elements (8.39 MB). Of each step's 16
    # sends the two at the node boundaries leave the node, each through its GPU's one NIC, and
    # the step waits for them: forward cp − 1 = 15 steps of 4 µs + 8.39 MB / 45 GB/s (186 µs),
    # 2.856 ms a layer. (Priced at the node's 8 NICs, as a ring collective gets, it was 0.36 ms.)
    from ops_transformer.planner.network import group_alpha_beta, p2p_alpha_beta, placement
    from ops_transformer.planner.timing import cp_parts

    model = MODEL_PRESETS["llama3-405b"].with_(seq=32768, global_batch=64, micro_batch=1)
    cluster = ClusterSpec.make("h100-sxm-96gb", 512, inter="ib-ndr", nics_per_node=8)
    o = Options(32, 1, 1, "heads", False, "selective", 3, 1, cp=16)
    x = 2 * 1 * (32768 // 16) * 8 * 128
    assert x == 4_194_304
    got = cp_parts(model, cluster, o)
    assert got["cp_forward_s"] == pytest.approx(15 * 4e-6 + 15 * 2 * x / 45e9)
    assert got["cp_forward_s"] == pytest.approx(2.856e-3, rel=1e-3)
    assert got["cp_backward_s"] == pytest.approx(31 * 4e-6 + 31 * 2 * x / 45e9)
    where = placement(cluster, 16, 1)
    assert (where.per_node, where.nodes) == (8, 2)
    assert p2p_alpha_beta(cluster, where)("send_recv", 2)[1] == 45e9  # one NIC
    assert group_alpha_beta(cluster, where)("all_gather", 16)[1] == 360e9  # a ring per NIC
    inside = placement(ClusterSpec.make("h100-sxm-96gb", 8), 8, 1)  # one node: NVLink
    assert p2p_alpha_beta(cluster, inside)("send_recv", 2)[1] == cluster.intra_link.bandwidth


def test_cp_keeps_one_cp_th_of_the_activations():
    model = MODEL_PRESETS["llama3-8b"].with_(seq=16384, global_batch=8)
    half = model.with_(seq=8192)
    o2 = Options(4, 1, 1, "heads", False, "full", 3, 1, cp=2)
    o1 = Options(8, 1, 1, "heads", False, "full", 3, 1)
    assert memory(model, o2, 2)["activations"] == pytest.approx(
        memory(half, o1, 2)["activations"])


def test_first_stage_holds_p_micro_batches_of_its_layers():
    model = MODEL_PRESETS["llama3-70b"].with_(global_batch=64)
    o = Options(8, 4, 1, "heads", True, "full", 1, 1, pp=4)  # 80 layers: 20 per stage, m = 8
    one = Options(8, 4, 1, "heads", True, "full", 1, 1)
    per_layer = (memory(model, one, 2)["activations"]
                 - memory(model.with_(layers=79), one, 2)["activations"])
    stage = memory(model, o, 2)["activations"]
    rebuilt = memory(model, one, 2)["activations"] - 80 * per_layer
    from ops_transformer.planner.memory import logits_bytes
    rebuilt -= logits_bytes(8192, model.vocab, 4, 2, "fused")
    assert stage == pytest.approx(20 * per_layer * 4 + rebuilt)


# --- the one validity rule, the search --------------------------------------------------------------

def test_runtime_refuses_pp_and_cp_in_one_line():
    assert runtime_problem(tp=2, dp=2, pp=4) is None  # train --pp runs it
    assert runtime_problem(tp=2, dp=2, pp=4, zero_stage=2) is None  # ZeRO-1/2 per stage
    assert runtime_problem(tp=2, dp=2, pp=4, zero_stage=3) is None  # FSDP2 per stage
    assert runtime_problem(tp=2, dp=2, pp=2, cp=2) == (
        "--pp 2 does not combine with --cp yet: drop one of them")
    assert runtime_problem(tp=1, dp=2, cp=2) is None  # train --cp runs it
    assert runtime_problem(tp=1, dp=2, cp=2, zero_stage=2) is None  # ZeRO over dp × cp
    assert runtime_problem(tp=1, dp=1, cp=2, experts=8) is None  # MoE over the whole rows
    layout = chosen_layout({"tp": 2, "dp": 2, "cp": 2, "attention": "heads",
                            "cp_strategy": "allgather_kv"})
    assert layout["cp"] == 2 and layout["cp_strategy"] == "allgather_kv"  # train --plan runs it
    assert runtime_problem(tp=2, dp=2) is None
    piped = chosen_layout({"tp": 2, "dp": 2, "pp": 2, "attention": "heads", "schedule":
                           "interleaved", "virtual_stages": 2, "micro_batch": 1})
    assert (piped["pp"], piped["pp_schedule"], piped["stages_per_rank"], piped["micro_batch"]) \
        == (2, "interleaved", 2, 1)  # train --plan runs it
    with pytest.raises(ValueError, match="--pp 2 does not combine with --cp yet"):
        chosen_layout({"tp": 1, "dp": 1, "pp": 2, "cp": 2, "attention": "heads"})
    assert chosen_layout({"tp": 2, "dp": 2, "attention": "heads"})["pp"] == 1


def test_train_plan_runs_a_pipelined_plan(tmp_path, capsys):
    """``train --plan`` of a plan with pp: its pp, schedule, virtual stages and micro-batch size
    (``--batch`` rows per dp rank in micro-batches of the plan's size) run as written — the
    losses of the same run given by flags; a conflicting ``--pp`` is one line."""
    plan = tmp_path / "pp.json"
    assert main(["plan", "--model", "tiny", "--gpu", "local", "--gpus", "2", "--tp", "1",
                 "--dp", "1", "--pp", "2", "--schedule", "1f1b", "--micro-batch", "2",
                 "--batch", "4", "--seq", "32", "--out", str(plan)]) == 0
    run = ["--preset", "tiny", "--batch", "4", "--seq", "32", "--steps", "2", "--no-progress",
           "--nproc", "2"]
    assert main(["train", "--plan", str(plan), *run, "--out", str(tmp_path / "plan")]) == 0
    assert main(["train", "--pp", "2", "--pp-schedule", "1f1b", "--microbatches", "2", *run,
                 "--out", str(tmp_path / "flags")]) == 0
    planned, flagged = (json.loads((tmp_path / d / "metrics.json").read_text())
                        for d in ("plan", "flags"))
    assert (planned["pp"], planned["pp_schedule"], planned["microbatches"]) == (2, "1f1b", 2)
    assert planned["losses"] == flagged["losses"]
    capsys.readouterr()
    assert main(["train", "--plan", str(plan), *run, "--microbatches", "4"]) == 2
    err = capsys.readouterr().err
    assert "sets --microbatches 2, but also --microbatches 4 was given" in err
    assert len(err.strip().splitlines()) == 1


def test_the_default_search_proposes_only_runnable_layouts():
    model = MODEL_PRESETS["llama3-70b"]
    cluster = ClusterSpec.make("h100-sxm", 64, 8)
    assert all(o.pp == 1 for o in candidates(model, cluster))
    best = search(model, cluster, top=3)["best"]
    assert best["pp"] == 1 and best["train_problem"] is None


def test_the_4d_search_proposes_pp_and_cp_where_they_win():
    rows = {r["id"]: r for r in P.load()["runs"]}
    long_context = P.planner_choice(rows["llama3-8b-h100-sxm-96gb-8g-dp1-cp8-s262144-float8"])
    assert long_context["cp"] == 8  # 262k tokens fit on 8 GPUs only split 8 ways
    deep = P.planner_choice(rows["megatron-gpt-1008b-a100-80gb-3072g-tp8-pp64-s2048-full"])
    assert deep["pp"] > 1 and deep["fits"]
    assert "does not combine with" in deep["train_problem"]  # ZeRO / recompute with pp: not yet


# --- the published runs -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def validation():
    return P.validate_published()


def test_holdout_median_within_10_percent_and_every_run_fits():
    report = P.report()  # the figures validate_published adds the planner's choices to (~1 s)
    assert report["median_abs_step_error_holdout"] <= 0.10
    assert report["not_fitting"] == []
    assert set(report["holdout_rows"]).isdisjoint(report["fit_rows"])


@pytest.mark.slow  # the planner's search on every pp/cp row (~15 s); two rows are checked above
def test_the_dataset_has_pp_and_cp_runs_each_with_the_planners_choice(validation):
    rows = [r for r in validation["rows"] if r["uses_pp_or_cp"]]
    assert sum(r["pp"] > 1 for r in rows) >= 8 and sum(r["cp"] > 1 for r in rows) >= 6
    assert {r["split"] for r in rows} == {"fit", "holdout"}
    for r in rows:
        assert r["planner_choice"] is not None, r["id"]
        assert r["planner_choice"]["predicted_step_s"] > 0 and r["predicted_step_s"] > 0


@pytest.mark.slow  # the command recomputes the whole validation (~12 s); the figures are tested above
def test_validate_published_command(validation, capsys):
    out = "\n".join(P.validation_lines(validation))  # what the command prints
    assert "held-out median |step-time error|" in out and "'holdout' rows" in out
    assert "planner tp" in out and "megatron-gpt-1008b" in out
    assert main(["plan", "--validate-published", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["median_abs_step_error_holdout"] == validation["median_abs_step_error_holdout"]
    assert all("planner_choice" in r for r in rep["rows"] if r["uses_pp_or_cp"])


@pytest.mark.parametrize("flags,needle", [
    (["--tp", "8", "--dp", "1", "--pp", "200"], "pp (200) must be at most the number of layers (80)"),
    (["--dp", "1", "--cp", "3"], "must be divisible by 6"),
    (["--pp", "2", "--schedule", "zbv", "--virtual-stages", "3"], "zbv schedule runs 2 chunks"),
    (["--matmul-precision", "float8"], "--matmul-precision float8: a100-80gb has no FP8"),
    (["--pp", "2", "--tp", "2", "--gpus", "6"], "--tp × --ep × --pp × --cp (2 × 1 × 2 × 1)"),
    (["--pp", "0"], "--pp must be at least 1, got 0"),
])
def test_4d_flag_errors_name_the_flag(flags, needle, capsys):
    assert main(["plan", "--model", "llama3-70b", "--gpu", "a100-80gb", *flags]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_flash_attention_bounds_by_hand():
    from ops_transformer.planner.roofline import attention_bounds
    # b 1, 8 heads, 1024 queries: 8 · 8 = 64 query blocks, one wave of 108 SMs at 64/108
    compute, moved = attention_bounds(flops=1e12, batch=1, heads=8, q_len=1024, kv_len=1024,
                                      head_dim=128, kv_heads=8, peak=A100_PEAK,
                                      bandwidth=A100_BW, bytes_per_element=2, sms=A100_SMS)
    assert compute == pytest.approx(1e12 / (A100_PEAK * 64 / 108))
    assert moved == pytest.approx(1 * 128 * (2 * 8 * 1024 + 2 * 8 * 1024) * 2 / A100_BW)


def test_the_default_search_and_train_plan_take_cp(tmp_path):
    """cp is in the search ``train --plan`` runs, and a plan's cp and strategy reach train."""
    from ops_transformer.cli.train import layout_from_plan

    model = MODEL_PRESETS["llama3-8b"]
    layouts = candidates(model, ClusterSpec.make("h100-sxm", 8, 8))
    assert {o.cp for o in layouts} >= {1, 2, 4, 8}
    assert {o.cp_strategy for o in layouts if o.cp > 1} == {"ring", "allgather_kv"}
    assert all(o.attention == "heads" for o in layouts if o.cp > 1)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"tp": 1, "dp": 1, "cp": 2, "cp_strategy": "allgather_kv",
                                "attention": "heads", "zero_stage": 1}))
    layout = layout_from_plan(str(plan))
    assert layout["cp"] == 2 and layout["cp_strategy"] == "allgather_kv" and layout["zero"] == 1
