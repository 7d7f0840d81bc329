"""``profile`` and ``diagnose`` on a context-parallel run: the ``cp.*`` ledger labels in the
profile (summary and text), and the CP diagnostics (``cp_exposed_exchange``, ``cp_short_sequence``)
when the ring exchange is not hidden or the sequence is too short for cp — and neither on a long
sequence, where the ring hides its transfers (the cost model at the step's shapes)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import ops_transformer as ot
from ops_transformer.models.gpt import GPT, preset
from ops_transformer.parallelize.context_plan import ContextParallelChoice
from ops_transformer.planner.context_parallel import layer_comm
from ops_transformer.planner.hardware import CPU_GLOO
from ops_transformer.profiler.context_checks import cp_checks
from ops_transformer.profiler.report import summary_text

LAYERS = 2


def _cp_worker(strategy):
    ctx = ot.init_parallel(cp=2)
    torch.manual_seed(0)
    model = ot.parallelize(GPT(preset("llama-tiny", n_layers=LAYERS, max_seq_len=64)), ctx,
                           context_parallel=strategy)
    x = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))

    def step():
        model(x[:, :-1], x[:, 1:])[1].backward()

    summary = ot.profile_step(step, ctx, steps=2, warmup=1).summary()
    found = [d.to_dict() for d in ot.diagnose(model, ctx, step)]
    return summary, summary_text(summary), found


@pytest.mark.parametrize("strategy", ["ring", pytest.param("allgather_kv",
                                                            marks=pytest.mark.slow)])
def test_profile_and_diagnose_see_the_cp_collectives(run_ranks, strategy):
    (summary, text, found), other = run_ranks(_cp_worker, 2, strategy)
    cfg = preset("llama-tiny")
    comm = layer_comm(strategy, batch=2, seq=32, kv_dim=cfg.n_kv_heads * cfg.head_dim, cp=2)
    labels = summary["cp_collectives"]
    fwd, bwd = f"cp.{strategy}.fwd", f"cp.{strategy}.bwd"
    for label, part in ((fwd, "fwd"), (bwd, "bwd")):
        (kind, c), = comm[part].items()
        assert labels[label]["kind"] == kind
        assert labels[label]["calls"] == LAYERS * c["calls"]  # the formula per layer × layers
        assert labels[label]["elements"] == LAYERS * c["elements"]
    assert labels["cp.loss.fwd"]["calls"] == 1  # the loss over the global token count
    assert fwd in text and "cp collective (label)" in text
    assert found == other[2]  # the same findings on every rank
    codes = {d["code"] for d in found}
    assert "cp_short_sequence" in codes, found  # 16 tokens per rank
    assert ("cp_exposed_exchange" in codes) == (strategy == "ring")
    hit = next(d for d in found if d["code"] == "cp_short_sequence")
    assert hit["severity"] == "warning" and "too short for cp=2" in hit["message"]
    assert f"{fwd} (" in hit["message"] and hit["suggestion"] and hit["estimated_saving_s"] > 0


def _rank(seq):
    return {"input_shape": [2, seq], "records": [["send_recv", 512, 2048, [0, 1], "cp.ring.fwd"]]}


def test_cp_findings_follow_the_cost_model():
    """Pure logic: at s = 64 (b 2, cp 2, the built-in CPU profile) a ring step moves its K/V in
    0.24 ms behind 6 µs of attention — both findings; at s = 1024 the block (1.5 ms) hides the
    transfer (0.5 ms) and attention outweighs the exposed time — none; without cp, none."""
    model = GPT(preset("llama-tiny", n_layers=LAYERS, max_seq_len=1024))
    ctx = SimpleNamespace(tp_size=1)
    model.parallel_state = SimpleNamespace(context_parallel=ContextParallelChoice("ring", "", 2))
    short = {d["code"] for d in cp_checks(model, ctx, _rank(64), CPU_GLOO)}
    assert short == {"cp_exposed_exchange", "cp_short_sequence"}
    assert cp_checks(model, ctx, _rank(1024), CPU_GLOO) == []
    model.parallel_state.context_parallel = None
    assert cp_checks(model, ctx, _rank(64), CPU_GLOO) == []
