"""The planner's memory model, search, JSON schema and command line (no process groups)."""

from __future__ import annotations

import json
import warnings

import pytest

from ops_transformer.cli.main import main
from ops_transformer.planner.memory import activation_bytes_per_layer, model_state_bytes
from ops_transformer.planner.search import Options, evaluate, search
from ops_transformer.planner.specs import MODEL_PRESETS, ClusterSpec

CANDIDATE_KEYS = {"dp", "tp", "ep", "attention", "ffn", "sequence_parallel", "recompute",
                  "zero_stage", "micro_batch", "fits", "memory_per_gpu_bytes",
                  "memory_breakdown", "step_time_s", "comm_bytes_per_step", "mfu"}


def test_zero_stages_by_hand():
    psi = 1e9
    assert model_state_bytes(psi, 0, 8) == {"params": 2e9, "grads": 2e9, "optimizer": 12e9}
    assert sum(model_state_bytes(psi, 1, 8).values()) == 4 * psi + 12 * psi / 8
    assert sum(model_state_bytes(psi, 2, 8).values()) == 2 * psi + 14 * psi / 8
    assert sum(model_state_bytes(psi, 3, 8).values()) == 16 * psi / 8
    # fp32 training: no master copy, 4 + 4 + 8 bytes; ZeRO-1 then shards only the 8
    assert model_state_bytes(psi, 0, 8, 4) == {"params": 4e9, "grads": 4e9, "optimizer": 8e9}
    assert sum(model_state_bytes(psi, 1, 8, 4).values()) == 8 * psi + 8 * psi / 8
    with pytest.raises(ValueError, match="zero_stage must be 0, 1, 2 or 3"):
        model_state_bytes(psi, 4, 8)


def test_korthikanti_activation_formulas():
    s, b, h, a, t = 2048, 1, 12288, 96, 8  # GPT-3 175B per layer
    sbh = s * b * h
    assert activation_bytes_per_layer(s, b, h, a, 1) == sbh * (34 + 5 * a * s / h)
    assert activation_bytes_per_layer(s, b, h, a, t) == pytest.approx(
        sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert activation_bytes_per_layer(s, b, h, a, t, sequence_parallel=True) == pytest.approx(
        sbh / t * (34 + 5 * a * s / h))
    assert activation_bytes_per_layer(s, b, h, a, t, sequence_parallel=True,
                                      recompute="selective") == pytest.approx(34 * sbh / t)
    assert activation_bytes_per_layer(s, b, h, a, t, recompute="full") == 2 * sbh


def test_gpt3_175b_on_8_a100_80gb_does_not_fit():
    result = search(MODEL_PRESETS["gpt3-175b"], ClusterSpec.make("a100-80gb", 8))
    assert result["best"] is None
    assert "2.79 TB" in result["advice"] and "GPUs of" in result["advice"]
    assert result["candidates"] and not any(c["fits"] for c in result["candidates"])


def test_llama3_70b_on_64_h100_keeps_tp_in_a_node_and_fits():
    result = search(MODEL_PRESETS["llama3-70b"], ClusterSpec.make("h100-sxm", 64, 8))
    best = result["best"]
    assert best["fits"] and best["tp"] <= 8
    assert best["memory_per_gpu_bytes"] <= 80 * 2 ** 30
    times = [float(f"{c['step_time_s']:.3g}") for c in result["candidates"]]
    assert times == sorted(times)


def test_7b_zero1_over_8_ranks_holds_4psi_plus_12psi_over_8():
    model = MODEL_PRESETS["llama2-7b"]
    row = evaluate(model, ClusterSpec.make("a100-80gb", 8),
                   Options(dp=8, tp=1, ep=1, attention="heads", sequence_parallel=False,
                           recompute="none", zero_stage=1, micro_batch=1))
    psi = model.params()
    states = sum(v for k, v in row["memory_breakdown"].items() if k != "activations")
    assert states == pytest.approx(4 * psi + 12 * psi / 8)


def test_json_schema(capsys):
    assert main(["plan", "--model", "llama2-7b", "--gpu", "a100-80gb", "--gpus", "8", "--json",
                 "--top", "3"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"model", "cluster", "candidates", "best", "advice"}
    for candidate in result["candidates"]:
        assert CANDIDATE_KEYS <= set(candidate)
        assert set(candidate["memory_breakdown"]) == {"params", "grads", "optimizer",
                                                      "activations"}


def test_mixtral_uses_expert_parallelism():
    result = search(MODEL_PRESETS["mixtral-8x7b"].with_(seq=4096),
                    ClusterSpec.make("h100-sxm", 16, 8))
    assert result["best"] is not None and result["best"]["ffn"] == "experts"


@pytest.mark.parametrize("argv,needle", [
    (["plan", "--model", "llama2-7b", "--gpu", "tpu-v9"], "unknown GPU 'tpu-v9'"),
    (["plan", "--gpu", "a100-80gb"], "--model is required"),
    (["plan", "--model", "nope"], "nope"),
])
def test_plan_errors_exit_2(argv, needle, capsys):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_train_accepts_a_plan(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main(["plan", "--model", "tiny", "--gpu", "local", "--gpus", "2", "--batch", "8",
                 "--seq", "32", "--out", str(plan), "--json"]) == 0
    capsys.readouterr()
    best = json.loads(plan.read_text())["best"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # run as written: nothing changed, nothing to warn about
        assert main(["train", "--plan", str(plan), "--steps", "2", "--seq", "32", "--batch",
                     "8", "--no-progress", "--out", str(tmp_path / "run")]) == 0
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert (metrics["tp"], metrics["dp"]) == (best["tp"], best["dp"])
    config = metrics["config"]
    assert (config["attention"], config["sequence_parallel"], config["recompute"],
            config["zero"]) == (best["attention"], best["sequence_parallel"], best["recompute"],
                                best["zero_stage"])


SEARCHES = [("llama3-70b", "h100-sxm", 64), ("gpt3-175b", "a100-80gb", 1024),
            ("mixtral-8x7b", "h100-sxm", 16), ("llama2-7b", "a100-80gb", 8)]


@pytest.mark.parametrize("name,gpu,gpus", SEARCHES)
def test_the_search_proposes_only_what_train_runs(name, gpu, gpus):
    """Issue #30 item 6: for llama3-70b on 64 x H100 the search picked heads_allgather with
    sequence parallelism (which train refuses) and ZeRO-3 (which train then ran as ZeRO-2; it
    runs ZeRO-3 now, through FSDP2, issue #24)."""
    from ops_transformer.planner.runnable import runtime_problem

    model = MODEL_PRESETS[name]
    result = search(model, ClusterSpec.make(gpu, gpus), top=10**6)
    assert result["best"] is not None
    for row in result["candidates"]:
        assert runtime_problem(tp=row["tp"], dp=row["dp"], ep=row["ep"], cp=row["cp"],
                               attention=row["attention"],
                               sequence_parallel=row["sequence_parallel"],
                               recompute=row["recompute"], zero_stage=row["zero_stage"],
                               experts=model.experts, seq=model.seq) is None, row
        assert not (row["sequence_parallel"] and row["attention"] != "heads")


@pytest.mark.parametrize("change,needle", [
    ({"sequence_parallel": True, "attention": "heads_allgather"},
     "--sequence-parallel needs --attention heads"),
    ({"zero_stage": 3, "dp": 1, "tp": 4}, "--zero 3 shards over data-parallel ranks, but dp is 1"),
    ({"zero_stage": 1, "dp": 1, "tp": 4}, "dp is 1"),
])
def test_train_plan_refuses_what_it_cannot_run_as_written(tmp_path, capsys, monkeypatch, change,
                                                          needle):
    from ops_transformer.cli import train as cli_train

    monkeypatch.setattr(cli_train, "run_training", lambda *a, **k: pytest.fail("it ran"))
    best = {"tp": 2, "dp": 2, "ep": 1, "attention": "heads", "sequence_parallel": False,
            "recompute": "none", "zero_stage": 0, **change}
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"best": best}))
    assert main(["train", "--plan", str(plan), "--seq", "32"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot run as written" in lines[0] and needle in lines[0], err


def _parallelize_with(layout):
    from ops_transformer import GPT, init_parallel, parallelize
    from ops_transformer.models import preset

    ctx = init_parallel(tp=2)
    model = parallelize(GPT(preset("tiny")), ctx, plan=layout)
    return model.parallel_plan.attention


def test_parallelize_accepts_a_planner_layout(run_ranks):
    layout = {"dp": 1, "tp": 2, "ep": 1, "attention": "heads_allgather"}
    assert run_ranks(_parallelize_with, 2, layout) == ["heads_allgather"] * 2
    with pytest.raises(ValueError, match=r"the plan is for dp=2 × tp=1, but this job runs dp=1 × "
                                         r"tp=2"):
        run_ranks(_parallelize_with, 2, {**layout, "dp": 2, "tp": 1})
