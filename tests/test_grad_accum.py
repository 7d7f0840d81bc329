"""Gradient accumulation (``train --grad-accum N``, ``TrainConfig.grad_accum``): each rank runs its
rows of the global batch in ``N`` micro-batches, and the step equals one step on the whole batch —
the same loss and the same accumulated gradients that the loss scaler and clipping see — while the
data-parallel all-reduces (and ZeRO-2's reduce-scatters) run once per step, not once per
micro-batch. Compared at the same layout with ``grad_accum = 1`` (which ``tests/parallelize``
checks against the dense model), at dp 1 on one process and at dp 2 × tp 2, with ZeRO-2 and fp16."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from ops_transformer.comm.ledger import CommLedger
from ops_transformer.parallel.state import parallel_state_of
from ops_transformer.training.loop import TrainConfig, join, setup_training, validate

from helpers import rel_err

BASE = dict(preset="tiny", layers=2, batch=8, seq=16, lr=1e-2, progress=False,
            clip_grad=1.0)


def _grads(state) -> list[torch.Tensor]:
    """What this rank's optimizer steps on: its parameters' gradients, or ZeRO's gradient
    chunks."""
    if hasattr(state.opt, "gather_grad_shards"):
        return [g.clone() for g in state.opt.gather_grad_shards()]
    return [p.grad.clone() for p in state.model.parameters() if p.grad is not None]


def _accumulate(cfg: TrainConfig, steps: int = 2) -> dict:
    """On every rank: the first step's accumulated gradients and loss, the calls per label of
    each step's collectives, and the losses (loss scale) of ``steps`` full steps."""
    with join(cfg) as ctx:
        state = setup_training(cfg, ctx)
        x, y = state.batch(0)
        with CommLedger() as ledger:
            metrics = state.accumulate(x, y)
        grads = _grads(state)
        state.opt.zero_grad(set_to_none=True)
        losses, labels, scales = [], [], []
        for step in range(steps):
            report, step_ledger = state.step(*state.batch(step))
            losses.append(report.metrics["loss"])
            labels.append(Counter(r.label for r in step_ledger.records))
            scales.append(None if state.scaler is None else state.scaler.scale_value)
        return {"loss": float(metrics["loss"]), "grads": grads, "losses": losses,
                "labels": labels, "backward_labels": Counter(r.label for r in ledger.records),
                "scales": scales,
                "reducers": [r.name for r in parallel_state_of(state.model).reducers]}


CASES = {  # name: (ranks, layout and precision, tolerance on gradients and losses)
    "dp1": (1, {}, 1e-6),
    "dp2xtp2": (4, {"tp": 2}, 1e-6),
    "dp2xtp2-zero2": (4, {"tp": 2, "zero": 2}, 1e-6),
    # fp16 autocast rounds each micro-batch's weight-gradient matmul to fp16 before the fp32
    # accumulation adds them, where the whole batch is rounded once: a few fp16 ulps (2^-11) of
    # the largest gradient.
    "dp2-fp16": (2, {"precision": "fp16"}, 5e-3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_accumulation_equals_one_step_on_the_whole_batch(run_ranks, name):
    ranks, layout, tol = CASES[name]
    whole_cfg = TrainConfig(**BASE, **layout)
    accum_cfg = TrainConfig(**BASE, **layout, grad_accum=2)
    validate(accum_cfg, ranks)
    whole = run_ranks(_accumulate, ranks, whole_cfg)
    accum = run_ranks(_accumulate, ranks, accum_cfg)
    for rank, (w, a) in enumerate(zip(whole, accum)):
        assert abs(a["loss"] - w["loss"]) <= tol * abs(w["loss"]), (rank, a["loss"], w["loss"])
        assert len(a["grads"]) == len(w["grads"])
        worst = max(rel_err(ga, gw) for ga, gw in zip(a["grads"], w["grads"]))
        assert worst <= tol, f"rank {rank}: accumulated gradients off by {worst:.2e}"
        for la, lw in zip(a["losses"], w["losses"]):
            assert abs(la - lw) <= tol * abs(lw), (rank, a["losses"], w["losses"])
        assert a["scales"] == w["scales"]  # fp16: the loss scaler saw the same overflows
        assert a["reducers"] == w["reducers"]
        # once per step: the data-parallel reduction and the small step statistics
        for label in ("dp_grads", "zero_grads", "step_stats", "zero_params"):
            assert a["labels"][0][label] == w["labels"][0][label], (label, a["labels"][0])
        assert a["backward_labels"]["dp_grads"] == w["backward_labels"]["dp_grads"]
        assert a["backward_labels"]["zero_grads"] == w["backward_labels"]["zero_grads"]
    if ranks > 1:  # (there was a data-parallel reduction to count)
        first = accum[0]["labels"][0]
        assert first["zero_grads" if layout.get("zero") == 2 else "dp_grads"] > 0, first


def test_micro_batches_are_the_rows_of_the_global_batch():
    """A rank's rows split into equal micro-batches: the batch must divide by dp × ep × N."""
    validate(TrainConfig(**BASE, grad_accum=4), 2)  # 8 rows over dp 2: 4 micro-batches of 1
    with pytest.raises(ValueError, match=r"--batch \(8\) must be divisible by dp \(2\) × "
                                         r"--grad-accum \(8\)"):
        validate(TrainConfig(**BASE, grad_accum=8), 2)
    with pytest.raises(ValueError, match="--grad-accum must be at least 1, got 0"):
        validate(TrainConfig(**BASE, grad_accum=0), 1)


def test_train_command_reports_the_accumulation(tmp_path, capsys):
    """``train --grad-accum 2``: the metrics carry the accumulation and the micro-batch, and the
    tensor-parallel collectives the cost model predicts for two micro-batches (``dp 1 × tp 2``)."""
    from ops_transformer.cli.main import main

    argv = ["train", "--nproc", "2", "--tp", "2", "--grad-accum", "2", "--steps", "2",
            "--batch", "4", "--seq", "16", "--no-progress",
            "--out", str(tmp_path / "run")]
    assert main(argv) == 0
    assert "accumulation 2 × micro-batch 2" in capsys.readouterr().out
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert (metrics["grad_accum"], metrics["micro_batch"]) == (2, 2)
    measured = {k: {"calls": v["calls"], "elements": v["elements"]}
                for k, v in metrics["tp_comm_per_step"].items()}
    assert measured == metrics["expected_tp_comm_per_step"]


class _DropoutConfig(TrainConfig):
    """The tiny preset with dropout 0.1 (train has no flag for it)."""

    def model_config(self):
        return super().model_config().with_(dropout=0.1)


def test_dropout_draws_alike_on_a_rank_or_a_micro_step(run_ranks):
    """Every micro-batch starts from the random state of the step, as every data-parallel rank
    does, and its dropout sites take its rows of the global batch (``micro_batch_masks``): one
    process with accumulation 2, two data-parallel ranks and one process on the whole batch
    draw the same (one-device) masks, so their losses and gradients agree as without dropout
    (what a resume from 4 to 2 ranks relies on)."""
    two = run_ranks(_accumulate, 2, _DropoutConfig(**BASE))
    one = run_ranks(_accumulate, 1, _DropoutConfig(**BASE, grad_accum=2))[0]
    whole = run_ranks(_accumulate, 1, _DropoutConfig(**BASE))[0]
    plain = run_ranks(_accumulate, 1, TrainConfig(**BASE, grad_accum=2))[0]
    assert abs(one["loss"] - whole["loss"]) <= 1e-6 * whole["loss"]
    for la, lb in zip(one["losses"], whole["losses"]):
        assert abs(la - lb) <= 1e-6 * lb, (one["losses"], whole["losses"])
    mean = (two[0]["loss"] + two[1]["loss"]) / 2  # (each rank's own, before the step averages)
    assert abs(one["loss"] - mean) <= 1e-6 * mean
    assert abs(one["loss"] - plain["loss"]) > 1e-4  # dropout did change the loss
    for la, lb in zip(one["losses"], two[0]["losses"]):
        assert abs(la - lb) <= 1e-6 * lb, (one["losses"], two[0]["losses"])
    worst = max(rel_err(a, b) for a, b in zip(one["grads"], two[0]["grads"]))
    assert worst <= 1e-6, worst


@pytest.mark.slow
def test_accumulation_with_a_hugging_face_model(tmp_path_factory, tmp_path, capsys):
    """``train --model DIR --grad-accum 2``: a Llama at tp 2 runs the losses of one micro-batch
    per step (fp32, ≤ 1e-6)."""
    pytest.importorskip("transformers")
    import hf_tiny
    from ops_transformer.cli.main import main

    path = hf_tiny.checkpoint(tmp_path_factory, "llama", tokenizer=True)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": f"{hf_tiny.TEXT} #{i}"}) + "\n"
                            for i in range(8)))
    losses = []
    for accum in ("1", "2"):
        out = tmp_path / f"accum-{accum}"
        assert main(["train", "--model", str(path), "--data", str(data), "--nproc", "2", "--tp",
                     "2", "--steps", "3", "--batch", "4", "--seq", "32", "--lr", "1e-3",
                     "--grad-accum", accum, "--no-progress", "--out", str(out)]) == 0
        losses.append(json.loads((out / "metrics.json").read_text())["losses"])
    capsys.readouterr()
    for a, b in zip(losses[1], losses[0]):
        assert abs(a - b) <= 1e-6 * abs(b), losses


def _diagnose_accumulation():
    import ops_transformer as ot
    from ops_transformer.models.gpt import GPT, preset

    ctx = ot.init_parallel(tp=2)
    torch.manual_seed(0)
    model = ot.parallelize(GPT(preset("tiny")), ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (8, 65))

    def step():  # two micro-batches of 4
        with ot.no_sync(model):
            model(x[:4, :-1], x[:4, 1:])[1].backward()
        model(x[4:, :-1], x[4:, 1:])[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return [d.to_dict() for d in ot.diagnose(model, ctx, step)]


def test_diagnose_counts_the_micro_batches_of_a_step(run_ranks):
    """Two forwards per step issue twice the tensor-parallel collectives of one: the plan's, not
    redundant ones."""
    found = run_ranks(_diagnose_accumulation, 2)[0]
    assert "redundant_collective" not in {d["code"] for d in found}, found
