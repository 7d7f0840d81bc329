"""The cost model's fp8 (``planner/fp8.py``): the collectives one training step of the fp8 model
issues at tp 2 — the amax all-reduces, the sequence-parallel entries' 1-byte gathers, everything
else as the fp32 model — counted, element by element and byte by byte, as the ledger counts them;
and the local step-time model prices them so."""

from __future__ import annotations

import os

import pytest
import torch

from ops_transformer import GPT, CommLedger, init_parallel, parallelize
from ops_transformer.models import preset
from ops_transformer.planner.cost import collective_time
from ops_transformer.planner.fp8 import FP8_BYTES, fp8_amax_calls, fp8_tp_comm
from ops_transformer.planner.local import LocalTimeModel
from ops_transformer.planner.strategies import model_comm_per_step
from ops_transformer.training.optimizer import partial_numel

B, T = 2, 16


def _step(sequence_parallel, recompute, backward):
    torch.set_num_threads(1)
    ctx = init_parallel(tp=int(os.environ["WORLD_SIZE"]))
    torch.manual_seed(0)
    cfg = preset("llama-tiny")
    model = parallelize(GPT(cfg), ctx, attention="heads", vocab="parallel", precision="fp8",
                        fp8_backward=backward, sequence_parallel=sequence_parallel,
                        recompute=recompute)
    idx = torch.randint(0, 256, (B, T + 1), generator=torch.Generator().manual_seed(1))
    with CommLedger() as ledger:
        model(idx[:, :-1], idx[:, 1:])[1].backward()
    return cfg, ledger.summary(), partial_numel(model, ctx.tp_group)


@pytest.mark.parametrize("sequence_parallel, recompute, backward", [
    (False, "none", "e5m2"), (True, "none", "e5m2"), (True, "full", "fp32")])
def test_fp8_collectives_as_the_ledger_counts_them(run_ranks, sequence_parallel, recompute,
                                                   backward):
    cfg, summary, partial = run_ranks(_step, 2, sequence_parallel, recompute, backward)[0]
    fp32 = model_comm_per_step(cfg, 2, "heads", B, T, "parallel",
                               sequence_parallel=sequence_parallel, recompute=recompute,
                               partial_elements=partial)
    wide, narrow = fp8_tp_comm(fp32, cfg, 2, B, T, sequence_parallel=sequence_parallel,
                               recompute=recompute, backward=backward)
    assert {k: {"calls": v["calls"], "elements": v["elements"]} for k, v in summary.items()} \
        == dict(wide + narrow)
    total_bytes = sum(v["bytes"] for v in summary.values())
    assert total_bytes == 4 * sum(c["elements"] for c in wide.values()) \
        + FP8_BYTES * sum(c["elements"] for c in narrow.values())
    assert bool(narrow) == bool(sequence_parallel)


def test_amax_calls_per_block():
    assert fp8_amax_calls(1) == 8 + 4  # 4 column + 2 row weights + 2 row inputs; 4 gradients
    assert fp8_amax_calls(1, sequence_parallel=True, backward="fp32") == 10
    assert fp8_amax_calls(2, sequence_parallel=True, recompute="full") == 2 * (2 * 10 + 4)


def test_local_model_prices_fp8_gathers_at_one_byte():
    """Under sequence parallelism fp8 moves the entries' gathers in a quarter of fp32's bytes
    (the bandwidth term falls), and pays one α per amax all-reduce."""
    model = LocalTimeModel({"fp32": {64: 1e10}}, {"fp32": 0.0}, {"fp32": 0.0},
                           alpha_step_s=1e-4, bandwidth=1e9, cores=2)
    cfg = preset("llama-tiny")
    kw = dict(nproc=2, tp=2, dp=1, vocab="parallel", batch=8, seq=64, sequence_parallel=True)
    fp32, fp8 = model.step_time(cfg, **kw), model.step_time(cfg, precision="fp8", **kw)
    assert fp8["volume_s"] < fp32["volume_s"]
    gathers = 2 * cfg.n_layers  # the entries' all-gathers, 3 bytes an element saved
    elements = gathers * 8 * 64 * cfg.d_model
    extra = fp8_amax_calls(cfg.n_layers, sequence_parallel=True)
    bandwidth = lambda kind, n, width: collective_time(  # noqa: E731
        kind, n, 2, alpha_s=0.0, bandwidth=1e9, bytes_per_element=width)
    assert fp8["volume_s"] == pytest.approx(
        fp32["volume_s"] - bandwidth("all_gather", elements, 4)
        + bandwidth("all_gather", elements, FP8_BYTES) + bandwidth("all_reduce", extra, 4),
        rel=1e-9)
    assert fp8["calls"] == fp32["calls"] + extra
