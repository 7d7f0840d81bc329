"""``ops-transformer calibrate`` (SPEC F10, F11): the α–β fit and the threshold rule on synthetic
points, the calibrated profile's cost functions, and a quick end-to-end run through the CLI."""

from __future__ import annotations

import json
import random

import pytest

from ops_transformer.cli.calibrate import parse_world_sizes, summary
from ops_transformer.cli.main import main
from ops_transformer.comm.ledger import wire_elements
from ops_transformer.profiler.calibrate import (KINDS, _fit_kinds, crossover, fit_alpha_beta,
                                               fit_rel_error, message_elements)
from ops_transformer.cli._calibrated import profile_path
from ops_transformer.planner.calibrated import CalibratedProfile, load_profile
from ops_transformer.planner.local import LocalTimeModel, local_time_model
from ops_transformer.planner.hardware import HardwareProfile

SIZES = [4 * 4 ** k for k in range(12)]  # 4 B … 16 MiB


def _line(alpha, beta, noise=0.0, seed=0):
    rng = random.Random(seed)
    return [(x, (alpha + x / beta) * (1 + rng.uniform(-noise, noise))) for x in SIZES]


def test_fit_recovers_alpha_and_beta_exactly():
    alpha, beta = fit_alpha_beta(_line(50e-6, 2e9))
    assert alpha == pytest.approx(50e-6, rel=1e-9) and beta == pytest.approx(2e9, rel=1e-9)
    assert fit_rel_error(_line(50e-6, 2e9), alpha, beta) < 1e-9


def test_fit_with_noise_weighs_small_and_large_messages_alike():
    points = _line(200e-6, 1e9, noise=0.1, seed=3)
    alpha, beta = fit_alpha_beta(points)
    assert alpha == pytest.approx(200e-6, rel=0.1) and beta == pytest.approx(1e9, rel=0.1)
    # unweighted least squares would let the 16 MiB point decide α; relative errors stay small
    assert fit_rel_error(points, alpha, beta) < 0.1


def test_one_fast_small_message_does_not_drag_alpha_down():
    points = [(x, 4e-3 + x / 1e9) for x in SIZES]
    points[0] = (SIZES[0], 0.5e-3)  # like gloo's 1-element all-reduce on an oversubscribed CPU
    alpha, beta = fit_alpha_beta(points)
    assert alpha == pytest.approx(4e-3, rel=0.15) and beta == pytest.approx(1e9, rel=0.15)
    assert fit_rel_error(points, alpha, beta) < 0.12
    assert fit_alpha_beta(points, iterations=0)[0] < 1.5e-3  # weights 1/t² alone: α ≈ 0.9 ms


def test_fit_clamps_a_negative_latency_to_zero():
    points = [(1e3, 0.9e-6), (1e6, 1e-3), (1e7, 1e-2)]  # t ≈ x / 1e9, the small point is fast
    alpha, beta = fit_alpha_beta(points)
    assert alpha == 0.0 and beta == pytest.approx(1e9, rel=0.05)


@pytest.mark.parametrize("points,needle", [
    ([(1024, 1e-3)], "two message sizes or more"),
    ([(8, 1e-3), (8, 2e-3)], "two message sizes or more"),
    ([(8, 1e-3), (1024, 0.0)], "positive times"),
    ([(8, 2e-3), (1 << 20, 1e-3)], "do not grow with the message size"),
])
def test_fit_rejects_unusable_points(points, needle):
    with pytest.raises(ValueError) as info:
        fit_alpha_beta(points)
    assert needle in str(info.value)


def test_crossover_finds_where_the_faster_method_changes():
    # send/recv: 20 µs + x / 1 GB/s; all-gather: 100 µs + x / 4 GB/s -> cross near 107 KB
    pts = [(x, 20e-6 + x / 1e9, 100e-6 + x / 4e9) for x in SIZES]
    assert crossover(pts) == (262144, "send_recv")
    noisy = [list(p) for p in pts]
    noisy[2][1] = 1.0  # one noisy size does not move the threshold
    assert crossover(noisy) == (262144, "send_recv")
    flipped = [(x, b, a) for x, a, b in pts]
    assert crossover(flipped) == (262144, "all_gather")
    assert crossover([(x, 1e-6, 2e-6) for x in SIZES]) == (None, "send_recv")


def test_flat_noisy_times_fall_back_to_bounds():
    flat = [[16, 3e-3], [1024, 4e-3], [1 << 20, 2.5e-3]]  # noise above every transfer time
    rising = [[16, 1e-4], [1024, 1.1e-4], [1 << 20, 1.1e-3]]
    per_rank = [{k: (flat if k == "all_gather" else rising) for k in KINDS}]
    fits = _fit_kinds(per_rank, 2)
    gather = fits["all_gather"]
    assert gather["fit"] == "bounds" and gather["alpha_s"] == 3e-3
    assert gather["bandwidth"] == pytest.approx((1 << 19) / 2.5e-3)  # max wire bytes / t
    assert fits["all_reduce"]["fit"] == "least squares" and fits["all_reduce"]["bandwidth"] > 0


def test_message_elements_divides_split_collectives():
    assert message_elements("all_reduce", 4, 4) == 1
    assert message_elements("all_gather", 4, 4) == 4
    assert message_elements("all_to_all", 1 << 20, 4) == (1 << 18)
    assert message_elements("reduce_scatter", 100, 3) == 27


def _profile() -> CalibratedProfile:
    per_kind = {2: {"all_reduce": (1e-4, 1e9), "all_gather": (2e-4, 2e9)},
                4: {"all_reduce": (3e-4, 0.5e9)}}
    return CalibratedProfile("test", 1e10, 1e-4, 1e9, per_kind=per_kind, p2p_threshold_bytes=None)


def test_calibrated_profile_uses_the_nearest_measured_world_size_per_kind():
    prof = _profile()
    assert isinstance(prof, HardwareProfile)
    n = 1 << 20
    assert prof.collective_time("all_reduce", n, 2) == pytest.approx(
        1e-4 + wire_elements("all_reduce", n, 2) * 4 / 1e9)
    assert prof.collective_time("all_reduce", n, 8) == pytest.approx(  # nearest measured: 4
        3e-4 + wire_elements("all_reduce", n, 8) * 4 / 0.5e9)
    assert prof.alpha_beta("all_reduce", 3) == (3e-4, 0.5e9)  # tie between 2 and 4: the larger
    assert prof.alpha_beta("all_gather", 2) == (2e-4, 2e9)
    assert prof.alpha_beta("broadcast", 2) == (1e-4, 1e9)  # never measured: the base figures
    assert prof.alpha_beta("all_gather", 4) == (1e-4, 1e9)
    assert prof.collective_time("all_reduce", n, 1) == 0.0
    comm = {"all_reduce": {"calls": 2, "elements": 2 * n},
            "all_gather": {"calls": 1, "elements": n}}
    assert prof.comm_time(comm, 2) == pytest.approx(
        2 * 1e-4 + wire_elements("all_reduce", 2 * n, 2) * 4 / 1e9
        + 2e-4 + wire_elements("all_gather", n, 2) * 4 / 2e9)
    assert prof.comm_time(comm, 1) == 0.0


def test_quick_calibration_end_to_end(tmp_path, capsys, monkeypatch):
    from ops_transformer.profiler import local_model as lm

    # the step-time model's matmul rates up to 256 (the tiny preset's runs use ~128): the 512 and
    # 1024 products in bf16/fp16 on one CPU thread were ~20 of the test's ~28 s
    monkeypatch.setattr(lm, "MATMUL_SIZES", (64, 128, 256))
    out = tmp_path / "sub" / "profile.json"
    assert main(["calibrate", "--quick", "--out", str(out), "--json", "--no-progress"]) == 0
    printed = json.loads(capsys.readouterr().out)
    data = json.loads(out.read_text())
    assert printed == data
    assert {"name", "created", "machine", "matmul_flops", "matmul_flops_best", "collectives",
            "p2p_threshold_bytes", "p2p"} <= set(data)
    assert data["machine"]["threads_per_rank"] == 1 and "topology" in data["machine"]
    assert set(data["matmul_flops"]) == {"256", "512"}
    assert data["matmul_flops_best"] == max(data["matmul_flops"].values()) > 0
    assert set(data["collectives"]) == {"2"} and set(data["collectives"]["2"]) == set(KINDS)
    for kind, entry in data["collectives"]["2"].items():
        assert entry["alpha_s"] >= 0 and entry["bandwidth"] > 0, kind
        assert len(entry["points"]) == 4 and all(b > 0 and t > 0 for b, t in entry["points"])
    threshold = data["p2p_threshold_bytes"]
    assert threshold is None or threshold in [b for b, _, _ in data["p2p"]["points"]]
    assert data["p2p"]["small_messages"] in ("send_recv", "all_gather")

    prof = load_profile(out)
    assert isinstance(prof, CalibratedProfile) and prof.matmul_flops == data["matmul_flops_best"]
    assert (prof.alpha_s, prof.bandwidth) == (data["collectives"]["2"]["all_reduce"]["alpha_s"],
                                              data["collectives"]["2"]["all_reduce"]["bandwidth"])
    assert set(prof.per_kind[2]) == set(KINDS) and prof.matmul_by_size[512] > 0
    assert prof.collective_time("all_gather", 1 << 20, 2) > prof.collective_time(
        "all_gather", 1 << 10, 2) > 0
    assert prof.compute_time(1e9) > 0
    text = summary(data)
    assert "all_reduce" in text and "two ranks swapping" in text
    overlap = data["overlap"]  # (a CPU machine)
    assert 0.0 <= overlap["efficiency"] <= 1.0 and prof.overlap_efficiency == overlap["efficiency"]
    assert [p["bytes"] for p in overlap["points"]] == [1 << 20]
    assert all(p["t_comm"] > 0 and p["t_comp"] > 0 and p["t_both"] > 0 and p["matmuls"] >= 1
               for p in overlap["points"])
    assert "an all-reduce beside matmuls hides" in text
    model = LocalTimeModel.from_dict(data["local_model"])  # the step-time model (issue #30)
    assert set(model.per_layer_s) == set(model.fixed_s) == {"fp32", "bf16", "fp16"}
    assert model.alpha_step_s >= 0 and model.sharing >= 1 and model.cores >= 1
    assert local_time_model(prof) == model


def test_overlap_efficiency_from_the_three_times():
    from ops_transformer.profiler.overlap_efficiency import efficiency

    assert efficiency(2.0, 3.0, 3.0) == 1.0  # the pair takes the longer alone: fully hidden
    assert efficiency(2.0, 3.0, 5.0) == 0.0  # their sum: nothing hidden
    assert efficiency(2.0, 3.0, 4.0) == pytest.approx(0.5)
    assert efficiency(2.0, 3.0, 6.5) == 0.0 and efficiency(2.0, 3.0, 2.5) == 1.0  # clamped
    assert efficiency(0.0, 3.0, 3.0) == 0.0


@pytest.mark.parametrize("argv,needle", [
    (["calibrate", "--quick", "--world-sizes", "2,x"], "comma-separated integers"),
    (["calibrate", "--quick", "--world-sizes", "1"], "at least 2"),
])
def test_bad_world_sizes_exit_2(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_parse_world_sizes():
    assert parse_world_sizes("2,4") == (2, 4) and parse_world_sizes(" 2, 8 ,") == (2, 8)


def test_load_profile_errors(tmp_path):
    with pytest.raises(ValueError, match="run `ops-transformer calibrate` first"):
        load_profile(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    for text, needle in (("{not json", "is not a valid calibration profile"),
                         (json.dumps({"name": "x", "collectives": {}}),
                          "missing matmul_flops_best, collectives"),
                         (json.dumps({"name": "x", "matmul_flops_best": 1,
                                      "collectives": {"2": {"all_reduce": {}}}}), "'alpha_s'"),
                         ("[1, 2]", "a JSON list, not an object")):
        bad.write_text(text)
        with pytest.raises(ValueError, match=needle) as info:
            load_profile(bad)
        message = str(info.value)
        assert str(bad) in message and "ops-transformer calibrate" in message
        assert "\n" not in message
    assert profile_path().name == "no-profile.json"  # conftest points it away


def test_default_profile_path_without_override(monkeypatch):
    monkeypatch.delenv("OPS_TRANSFORMER_PROFILE")
    assert profile_path().parts[-3:] == (".cache", "ops-transformer", "profile.json")
