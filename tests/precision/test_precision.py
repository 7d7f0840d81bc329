"""Mixed-precision training: the precision policy; gradient reductions in grad_reduce_dtype; fp16
with the loss scaler trains (TP activations in fp16, gradient averaging in fp32); bf16 tracks
fp32; `train --precision ... --clip-grad` and its progress fields."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
import torch

import ops_transformer
from ops_transformer import (GPT, CommLedger, DynamicLossScaler, init_parallel, optimizer_step,
                             parallelize)
from ops_transformer.cli.main import main
from ops_transformer.models import preset
from ops_transformer.parallel import ParallelContext
from ops_transformer.precision import StepReport, precision_policy, resolve_grad_reduce_dtype
from ops_transformer.training.loop import TrainConfig, _precision_stats, train_worker
from ops_transformer.utils.progress import Progress

MQA = preset("llama-tiny", n_layers=1, max_seq_len=16, n_kv_heads=1)


def test_policies():
    assert precision_policy("fp32").compute_dtype == torch.float32
    bf16, fp16 = precision_policy("bf16"), precision_policy("fp16")
    assert (bf16.compute_dtype, bf16.loss_scaling) == (torch.bfloat16, False)
    assert (fp16.compute_dtype, fp16.loss_scaling) == (torch.float16, True)
    assert fp16.param_dtype == fp16.grad_reduce_dtype == torch.float32  # fp32 master weights
    fp8 = precision_policy("fp8")  # fp32 outside the blocks' fp8 matmuls (parallelize)
    assert (fp8.compute_dtype, fp8.loss_scaling) == (torch.float32, False)
    with pytest.raises(ValueError, match=r"precision must be one of \('fp32', 'bf16', 'fp16', "
                                         r"'fp8'\), got 'int4'"):
        precision_policy("int4")


def test_grad_reduce_dtype_default():
    linear = torch.nn.Linear(2, 2)
    assert resolve_grad_reduce_dtype(linear, None) is None  # fp32 gradients reduce as they are
    assert resolve_grad_reduce_dtype(linear.to(torch.bfloat16), None) == torch.float32
    assert resolve_grad_reduce_dtype(linear, torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="grad_reduce_dtype must be a floating-point"):
        resolve_grad_reduce_dtype(linear, torch.int8)


def _bf16_params_reduce(tp, grad_reduce_dtype):
    ctx = init_parallel(tp=tp)
    torch.manual_seed(0)
    model = parallelize(GPT(MQA).to(torch.bfloat16), ctx, vocab="replicated",
                        grad_reduce_dtype=grad_reduce_dtype)
    batch = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    rows = batch.chunk(ctx.dp_size)[ctx.dp_rank]
    with CommLedger() as ledger:
        model(rows[:, :-1], rows[:, 1:])[1].backward()
    grad_dtypes = {p.grad.dtype for p in model.parameters()}
    return {r.label: str(r.dtype) for r in ledger.records
            if r.label in ("dp_grads", "grad_sums")}, grad_dtypes


def test_16_bit_gradients_are_reduced_in_fp32_by_default(run_ranks):
    # dp 2 × tp 2: the data-parallel averaging and the replicated KV head's gradient sum
    reduced, grad_dtypes = run_ranks(_bf16_params_reduce, 4, 2, None)[0]
    assert reduced == {"dp_grads": "torch.float32", "grad_sums": "torch.float32"}
    assert grad_dtypes == {torch.bfloat16}  # cast back for the optimizer
    reduced, _ = run_ranks(_bf16_params_reduce, 2, 1, torch.bfloat16)[0]
    assert reduced == {"dp_grads": "torch.bfloat16"}


def _fp16_training(steps, overlap="none"):
    ctx = init_parallel(tp=2)
    torch.manual_seed(0)
    model = parallelize(GPT(preset("tiny", n_layers=1, max_seq_len=32)), ctx,
                        attention="heads", vocab="parallel", overlap=overlap)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = DynamicLossScaler(ctx)
    policy = precision_policy("fp16")
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        batch = torch.randint(0, 64, (4, 33), generator=gen)  # a small alphabet: learnable fast
        rows = batch.chunk(ctx.dp_size)[ctx.dp_rank]
        with CommLedger() as ledger:
            with policy.autocast(ctx.device):
                loss = model(rows[:, :-1], rows[:, 1:])[1]
            scaler.scale(loss).backward()
            report = optimizer_step(model, opt, ctx, scaler=scaler, max_norm=1.0,
                                    metrics={"loss": loss})
        opt.zero_grad(set_to_none=True)
        losses.append(report.metrics["loss"])
    dtypes = {}
    for r in ledger.records:
        dtypes.setdefault(r.label, []).append(str(r.dtype).replace("torch.", ""))
    return losses, dtypes, scaler.skipped_steps


@pytest.mark.parametrize("overlap", ["none", "chunked"])
def test_fp16_with_the_loss_scaler_trains(run_ranks, overlap):
    for losses, dtypes, skipped in run_ranks(_fp16_training, 4, 10, overlap):  # dp 2 × tp 2
        assert all(math.isfinite(x) for x in losses) and skipped < 10
        assert sum(losses[-3:]) < sum(losses[:3]), losses
        assert set(dtypes["dp_grads"]) == {"float32"}  # gradient averaging in fp32
        # TP activations and their gradients in fp16 — but the embedding's all-reduce (the first):
        # autocast keeps lookups in fp32, and each token's row comes from one rank (exact sum)
        if overlap == "none":
            assert dtypes["reduce_from_tp_region.fwd"] == ["float32", "float16", "float16"]
            labels = ("column_linear.bwd", "copy_to_tp_region.bwd")
        else:  # the two region exits' all-reduces and the entries' input gradients, in 2 chunks
            assert dtypes["reduce_from_tp_region.fwd"] == ["float32"]
            assert dtypes["matmul_all_reduce.fwd"] == ["float16"] * 4
            labels = ("column_linear.bwd", "copy_matmul.bwd")
        for label in labels:
            assert set(dtypes[label]) == {"float16"}, label
        assert dtypes["step_stats"] == ["float32"]


CORPUS = str(Path(ops_transformer.__file__).parent)  # this package's sources: quick to read


def _final_loss(precision, steps, batch=8, seq=64, data=None):
    cfg = TrainConfig(preset="tiny", tp=2, steps=steps, batch=batch, seq=seq, data=data,
                      precision=precision, progress=False, sample_tokens=0)
    metrics = train_worker(cfg)
    return None if metrics is None else metrics["loss_last"]


def test_bf16_tracks_fp32_quick(run_ranks):
    fp32 = run_ranks(_final_loss, 2, "fp32", 12, 4, 32, CORPUS)[0]
    bf16 = run_ranks(_final_loss, 2, "bf16", 12, 4, 32, CORPUS)[0]
    assert abs(bf16 - fp32) <= 0.02 * fp32, (bf16, fp32)


@pytest.mark.slow
def test_bf16_tracks_fp32_over_100_steps(run_ranks):
    fp32 = run_ranks(_final_loss, 2, "fp32", 100)[0]
    bf16 = run_ranks(_final_loss, 2, "bf16", 100)[0]
    assert abs(bf16 - fp32) <= 0.02 * fp32, (bf16, fp32)


def test_train_cli_precision_and_clipping(tmp_path, capsys):
    assert main(["train", "--nproc", "2", "--tp", "2", "--steps", "2", "--batch", "2", "--seq",
                 "16", "--precision", "bf16", "--clip-grad", "1.0", "--out", str(tmp_path),
                 "--data", CORPUS, "--json", "--no-progress"]) == 0
    text = capsys.readouterr().out
    metrics = json.loads(text[text.index("{\n"):])
    assert metrics["precision"] == "bf16" and metrics["clip_grad"] == 1.0
    assert metrics["grad_norm_last"] > 0 and "bfloat16" in metrics["comm_by_dtype"]
    assert main(["train", "--clip-grad", "0"]) == 2
    assert "--clip-grad must be positive, got 0.0" in capsys.readouterr().err


def test_progress_line_shows_the_loss_scale_and_skipped_steps():
    scaler = DynamicLossScaler(ParallelContext.single())
    scaler.skipped_steps = 3
    stats = _precision_stats(StepReport(True, grad_norm=0.5, loss_scale=2.0 ** 16), scaler)
    bar = Progress(10, desc="train", stream=io.StringIO())
    bar.update(loss=2.5, **stats)
    assert "loss=2.5 gnorm=0.5 scale=65.54k skipped=3" in bar.render()
    assert _precision_stats(StepReport(True), None) == {}
