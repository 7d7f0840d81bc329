"""The calibrated local step-time model (issue #30 item 11): after ``calibrate``, ``sweep``,
``bench`` and ``train --plan`` predict with it — measured per-dtype matmul rates (bf16 is not
priced like fp32), per-layer and fixed overheads, the effective time per collective call — not
with the built-in CPU figures (6–100× below the measurement here). Its accuracy is a measurement,
in docs/planner.md; these tests check the formula and who uses it."""

from __future__ import annotations

import json
import math

import pytest

from ops_transformer.cli.main import main
from ops_transformer.models import preset
from ops_transformer.planner.cost import comm_time
from ops_transformer.planner.local import (LocalTimeModel, dp_grad_comm, local_time_model,
                                           step_flops_per_rank)
from ops_transformer.planner.calibrated import CalibratedProfile
from ops_transformer.planner.strategies import model_comm_per_step
from ops_transformer.training.loop import TrainConfig

RATES = {"fp32": {64: 1e11, 1024: 1e11}, "bf16": {64: 2e10, 1024: 8e11},
         "fp16": {64: 2e10, 1024: 1e11}}
LOCAL = {"matmul_flops": {k: {str(n): f for n, f in v.items()} for k, v in RATES.items()},
         "per_layer_s": {"fp32": 4e-3, "bf16": 8e-3, "fp16": 9e-3},
         "fixed_s": {"fp32": 2e-3, "bf16": 3e-3, "fp16": 5e-3},
         "alpha_step_s": 5e-4, "bandwidth": 1e9, "cores": 2, "sharing": 1.25}


def _profile(local=LOCAL) -> CalibratedProfile:
    return CalibratedProfile("test", 1e11, 1e-4, 1e9, per_kind={2: {"all_reduce": (1e-4, 1e9)}},
                             local_model=dict(local or {}))


def test_the_formula():
    model = LocalTimeModel.from_dict(LOCAL)
    assert LocalTimeModel.from_dict(model.to_dict()) == model
    cfg = preset("tiny")
    n = math.sqrt(cfg.d_model * cfg.d_ff / 2)  # 90.5: between the measured 64 and 1024
    w = math.log(n / 64) / math.log(1024 / 64)
    rate = math.exp((1 - w) * math.log(2e10) + w * math.log(8e11))
    assert model.matmul_rate("bf16", cfg, 2) == pytest.approx(rate)
    got = model.step_time(cfg, nproc=2, tp=2, dp=1, attention="heads", vocab="replicated",
                          batch=8, seq=64, precision="bf16")
    alone = (step_flops_per_rank(cfg, 2, 8, 64, "heads", "replicated") / rate
             + cfg.n_layers * 8e-3 + 3e-3)
    comm = comm_time(model_comm_per_step(cfg, 2, "heads", 8, 64, "replicated"), 2,
                     lambda kind, p: (5e-4, 1e9), 2)  # 16-bit activations under autocast
    assert got["alone_s"] == pytest.approx(alone)
    assert got["step_s"] == pytest.approx(1.25 * alone + comm)
    fp32 = model.step_time(cfg, nproc=2, tp=2, dp=1, attention="heads", vocab="replicated",
                           batch=8, seq=64)
    assert fp32["step_s"] != pytest.approx(got["step_s"])  # bf16 is not priced like fp32
    one = model.step_time(cfg, nproc=1, tp=1, dp=1, batch=8, seq=64)
    assert one["step_s"] == pytest.approx(one["alone_s"])  # alone, nothing to communicate
    dp2 = model.step_time(cfg, nproc=2, tp=1, dp=2, batch=8, seq=64)
    grads = dp_grad_comm(cfg, 1)
    assert grads["all_reduce"]["calls"] == 2  # one bucket of gradients, one of metrics
    assert dp2["comm_s"] == pytest.approx(comm_time(grads, 2, lambda kind, p: (5e-4, 1e9)))


def test_sweep_predicts_with_the_calibrated_model_when_the_profile_has_one():
    from ops_transformer.profiler.sweep import predicted_step_s

    cfg = TrainConfig(tp=2, batch=8, seq=64, precision="bf16")
    expected = local_time_model(_profile()).step_time(
        cfg.model_config(), nproc=2, tp=2, dp=1, attention="heads", vocab="replicated", batch=8,
        seq=64, precision="bf16")["step_s"]
    assert predicted_step_s(cfg, 2, "heads", 1, _profile(), "replicated") == pytest.approx(
        expected)
    built_in = predicted_step_s(cfg, 2, "heads", 1, _profile(local=None), "replicated")
    assert built_in is not None and built_in != pytest.approx(expected)


def test_bench_predicts_ours_and_the_single_process_methods():
    from ops_transformer.cli.bench import predictions
    from ops_transformer.profiler.bench import Size

    got = predictions(Size("tiny", "tiny", batch=8, seq=64, steps=2, warmup=1), _profile())
    assert set(got) == {"ours", "tp1", "plain"} and all(v > 0 for v in got.values())
    assert predictions(Size("tiny", "tiny", batch=8, seq=64, steps=2, warmup=1),
                       _profile(local=None)) == {}


def _write_profile(path):
    data = {"name": "test", "matmul_flops_best": 1e11,
            "collectives": {"2": {"all_reduce": {"alpha_s": 1e-4, "bandwidth": 1e9}}},
            "local_model": LOCAL}
    path.write_text(json.dumps(data))
    return path


def test_train_plan_reports_the_calibrated_prediction(tmp_path, monkeypatch, capsys):
    from ops_transformer.profiler.local_model import predict_step_s

    monkeypatch.setenv("OPS_TRANSFORMER_PROFILE", str(_write_profile(tmp_path / "p.json")))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"best": {"tp": 2, "dp": 1, "ep": 1, "attention": "heads"}}))
    argv = ["train", "--plan", str(plan), "--steps", "3", "--batch", "8", "--seq", "32",
            "--no-progress", "--out", str(tmp_path / "run")]
    assert main(argv + ["--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    cfg = TrainConfig(tp=2, dp=1, batch=8, seq=32, attention="heads")
    from ops_transformer.planner.calibrated import load_profile

    assert metrics["predicted_step_s"] == pytest.approx(
        predict_step_s(cfg, 2, load_profile(tmp_path / "p.json"), attention="heads",
                       vocab=metrics["vocab"]))
    assert main(argv) == 0
    assert "calibrated local model" in capsys.readouterr().out
