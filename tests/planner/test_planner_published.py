"""The planner against the published training runs it ships (planner/data/published_runs.json),
and ``ops-transformer plan`` with a forced layout. Pure logic: no process group."""

from __future__ import annotations

import json

import pytest

from ops_transformer.cli.main import main
from ops_transformer.planner import efficiency as E
from ops_transformer.planner import published as P
from ops_transformer.profiler.calibrate import gpu_efficiency
from ops_transformer.planner.calibrated import load_profile


@pytest.fixture(scope="module")
def report():
    return P.report()


def test_every_row_names_its_source_and_what_was_measured():
    data = P.load()
    assert len(data["runs"]) >= 30
    ids = [r["id"] for r in data["runs"]]
    assert len(ids) == len(set(ids))
    for r in data["runs"]:
        assert r["source"] and r["url"].startswith("https://"), r["id"]
        assert r["split"] in ("fit", "holdout") and r["stack"] in E.STACKS
        assert {"tokens_per_s", "tokens_per_s_per_gpu", "tflops_per_gpu",
                "model_tflops_per_gpu"} & set(r["measured"])
        lay = r["layout"]
        assert lay["tp"] * lay["dp"] * lay.get("pp", 1) * lay.get("cp", 1) == r["gpus"], r["id"]
    assert {r["split"] for r in data["runs"]} == {"fit", "holdout"}


def test_every_published_run_is_predicted_to_fit(report):
    assert report["not_fitting"] == []


def test_memory_within_10_percent_where_the_source_measured_it(report):
    measured = [r for r in report["rows"] if "memory_error" in r]
    assert measured, "no row reports memory"
    for r in measured:
        assert abs(r["memory_error"]) <= 0.10, (r["id"], r["memory_error"])


def test_holdout_median_step_time_error_is_at_most_15_percent(report):
    assert report["median_abs_step_error_holdout"] <= 0.15


@pytest.mark.slow  # the golden-section fit over every 'fit' row (~5 s); the constants' accuracy
def test_built_in_constants_are_the_fit():  # is checked by the hold-out tests above
    found = P.fit()
    assert found["by_gpu"] == {g: v for g, v in E.FITTED_BY_GPU.items() if g in found["by_gpu"]}
    assert found["by_stack"] == E.FITTED_BY_STACK
    assert found["memory_passes"] == pytest.approx(E.MEMORY_PASSES, abs=0.01)
    assert found["attention_ratio"] == pytest.approx(E.ATTENTION_RATIO, abs=0.001)


def test_measured_step_time_from_narayanan_teraflops():
    row = next(r for r in P.load()["runs"] if "tflops_per_gpu" in r["measured"])
    model = P.run_model(row)
    l, h, s, v, b = model.layers, model.hidden, model.seq, model.vocab, model.global_batch
    flops = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    assert P.measured_step_s(row, model) == pytest.approx(
        flops / (row["gpus"] * row["measured"]["tflops_per_gpu"] * 1e12))


def test_published_command(capsys):
    assert main(["plan", "--published"]) == 0
    out = capsys.readouterr().out
    assert "| run | split |" in out and "median |step-time error|: hold-out" in out
    assert "every run is predicted to fit" in out


# --- forced layout --------------------------------------------------------------------------------

FORCED = ["plan", "--model", "llama3-8b", "--gpu", "h100-96gb", "--tp", "1", "--dp", "8",
          "--zero", "3", "--recompute", "selective", "--micro-batch", "2", "--batch", "16",
          "--loss-kernel", "fp32", "--json"]


def test_forced_layout_evaluates_exactly_that_layout(capsys):
    assert main(FORCED) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["tp"], result["dp"], result["zero_stage"], result["recompute"],
            result["micro_batch"]) == (1, 8, 3, "selective", 2)
    assert result["fits"] and result["best"] == result["layout"] == result["candidates"][0]
    assert result["problems"] == [] and result["cluster"]["count"] == 8
    row = P.predict(next(r for r in P.load()["runs"]
                         if r["id"].startswith("llama3-8b-h100-sxm-96gb-8g")))
    assert result["step_time_s"] == pytest.approx(row["predicted_step_s"])
    assert result["memory_per_gpu_bytes"] / 2 ** 30 == pytest.approx(row["predicted_memory_gib"])


def test_forced_layout_that_does_not_fit_says_why(capsys):
    argv = ["plan", "--model", "llama3-70b", "--gpu", "a100-80gb", "--tp", "2", "--dp", "4",
            "--sequence-parallel", "--micro-batch", "1", "--batch", "8", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert not result["fits"] and result["best"] is None
    assert "per GPU" in result["problems"][0] and "one a100-80gb has" in result["problems"][0]
    assert result["sequence_parallel"] and result["tp"] == 2
    assert main(argv[:-1]) == 0
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_attention_kernel_and_efficiency_flags(capsys):
    def run(*extra):
        assert main(FORCED[:-1] + ["--recompute", "none", "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    fused, eager = run(), run("--attention-kernel", "eager")
    assert eager["memory_breakdown"]["activations"] > fused["memory_breakdown"]["activations"]
    slow = run("--efficiency", "0.2")
    assert slow["step_time_s"] > fused["step_time_s"]
    assert slow["execution"]["efficiency"] == 0.2
    assert slow["execution"]["efficiency_source"] == "--efficiency"


def test_calibrated_gpu_efficiency_is_used_for_that_card(tmp_path, monkeypatch, capsys):
    profile = tmp_path / "profile.json"
    entry = gpu_efficiency("NVIDIA H100 80GB HBM3", 80 * 2 ** 30, {"8192x4096x16384": 6.9e14})
    assert entry["catalogue"] == "h100-sxm"
    assert entry["matmul_efficiency"] == pytest.approx(6.9e14 / 989.5e12)
    profile.write_text(json.dumps({
        "name": "gpu box", "matmul_flops_best": 1e13, "gpu": entry,
        "collectives": {"2": {"all_reduce": {"alpha_s": 1e-5, "bandwidth": 1e11}}}}))
    assert load_profile(profile).gpu_efficiency == {"h100-sxm": entry["matmul_efficiency"]}
    monkeypatch.setenv("OPS_TRANSFORMER_PROFILE", str(profile))  # where the command finds it
    argv = ["plan", "--model", "llama2-7b", "--gpu", "h100-sxm", "--tp", "1", "--dp", "8",
            "--batch", "8", "--json"]
    assert main(argv) == 0
    execution = json.loads(capsys.readouterr().out)["execution"]
    assert execution["efficiency"] == pytest.approx(entry["matmul_efficiency"])
    assert "calibrated" in execution["efficiency_source"]
    assert main(argv[:4] + ["a100-80gb"] + argv[5:]) == 0  # another card: its default
    assert json.loads(capsys.readouterr().out)["execution"]["efficiency"] == \
        E.FITTED_BY_GPU["a100-80gb"]


@pytest.mark.parametrize("argv,needle", [
    (["--top", "0"], "--top must be at least 1, got 0"),
    (["--top", "-3"], "--top must be at least 1, got -3"),
    (["--gpus", "0"], "--gpus must be at least 1, got 0"),
    (["--batch", "-1"], "--batch must be at least 1, got -1"),
    (["--gpus", "12"], "--gpus (12) must be a multiple of the a100-80gb's usual node (8 GPUs)"),
    (["--gpus", "12", "--gpus-per-node", "8"], "--gpus (12) must be a multiple of --gpus-per-node"),
    (["--efficiency", "1.5"], "--efficiency must be in (0, 1]"),
    (["--tp", "2", "--dp", "2", "--gpus", "8"],
     "--tp × --dp × --ep = 2 × 2 × 1 = 4, but --gpus is 8"),
    (["--tp", "3"], "--gpus (8) is not divisible by --tp × --ep (3 × 1)"),
    (["--dp", "8", "--micro-batch", "3", "--batch", "16"],
     "--batch (16) must be a multiple of --dp × --micro-batch (8 × 3 = 24)"),
    (["--dp", "8", "--sequence-parallel"], "--sequence-parallel needs --tp > 1"),
    (["--tp", "8", "--dp", "1", "--zero", "1"], "--zero 1 shards over the data-parallel ranks"),
    (["--model", "llama-tiny", "--tp", "8", "--dp", "1", "--batch", "8"],
     "--tp 8 --attention heads: n_heads (4) is not divisible by tp (8)"),
    (["--gpu", "h100", "--inter", "ethernet"], "--inter ethernet: unknown link 'ethernet'"),
])
def test_plan_errors_name_the_flag(argv, needle, capsys):
    assert main(["plan", "--model", "llama2-7b", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert "global_batch" not in err and "count" not in err


def test_model_errors_name_the_flag(capsys):
    assert main(["plan", "--model", "nope"]) == 2
    assert "--model nope:" in capsys.readouterr().err


def test_bf16_matmul_measurement_runs_on_any_device():
    import torch

    from ops_transformer.profiler.calibrate import bf16_matmul_flops

    flops = bf16_matmul_flops(torch.device("cpu"), ((16, 32, 64), (8, 64, 32)), repeats=2)
    assert set(flops) == {"16x32x64", "8x64x32"} and min(flops.values()) > 0
