"""The cost model takes objects (issue 34, item 4): ``model_comm_per_step(spec, layout, options)``,
``activation_bytes_per_layer(spec, layout, options)``, ``LocalTimeModel.step_time(spec, layout,
options)`` give the numbers of their older loose-keyword forms, for a ``Layout`` or a run
configuration's ``layout`` section, a ``CostOptions``, a ``ParallelOptions`` or the search's
``Options``. Pure logic: no process group."""

from __future__ import annotations

import itertools

import pytest

from ops_transformer.models.gpt import preset
from ops_transformer.parallelize.options import ParallelOptions
from ops_transformer.planner.hardware import CPU_GLOO
from ops_transformer.planner.layout import CostOptions, Layout
from ops_transformer.planner.local import LocalTimeModel
from ops_transformer.planner.memory import activation_bytes_per_layer, layer_activation_bytes
from ops_transformer.planner.search import Options
from ops_transformer.planner.specs import MODEL_PRESETS
from ops_transformer.planner.strategies import _model_comm, model_comm_per_step
from ops_transformer.training.config import LayoutSection

LOCAL = {"matmul_flops": {"fp32": {"64": 1e10, "1024": 4e11}, "bf16": {"64": 2e10, "1024": 8e11}},
         "per_layer_s": {"fp32": 1e-2, "bf16": 8e-3}, "fixed_s": {"fp32": 5e-3, "bf16": 3e-3},
         "alpha_step_s": 5e-4, "bandwidth": 1e9, "cores": 2, "sharing": 1.25}


@pytest.mark.parametrize("name", ["tiny", "llama-tiny", "moe-tiny"])
def test_model_comm_per_step_takes_the_objects(name):
    cfg = preset(name)
    grid = itertools.product((1, 2, 4), ("heads", "kv_split", "naive"), ("parallel", "replicated"),
                             (False, True, "regather"), ("none", "full"),
                             ("none", "chunked"), (1, 2))
    seen = 0
    for tp, attention, vocab, sp, rc, overlap, ep in grid:
        if (sp and attention != "heads") or (tp == 4 and name == "llama-tiny" and
                                             attention != "heads"):
            continue
        kw = dict(sequence_parallel=sp, recompute=rc, overlap=overlap, chunks=3,
                  partial_elements=96, profile=CPU_GLOO, ep=ep, grad_accum=2)
        old = model_comm_per_step(cfg, tp, attention, 4, 32, vocab, **kw)
        loose = _model_comm(cfg, tp, attention, 4, 32, vocab, **kw)
        options = CostOptions(attention=attention, vocab=vocab, sequence_parallel=sp,
                              recompute=rc, overlap=overlap, chunks=3)
        new = model_comm_per_step(cfg, Layout(tp=tp, ep=ep), options, batch=4, seq=32,
                                  partial_elements=96, profile=CPU_GLOO, grad_accum=2)
        assert old == loose == new, (tp, attention, vocab, sp, rc, overlap, ep)
        seen += 1
    assert seen > 50


def test_model_comm_per_step_reads_parallel_options_and_the_layout_section():
    cfg = preset("tiny")
    old = model_comm_per_step(cfg, 2, "heads", 4, 32, "parallel", sequence_parallel=True,
                              recompute="full", overlap="chunked", chunks=2)
    # attention "auto" under sequence parallelism is the plan's "heads" (plan_attention)
    opts = ParallelOptions(sequence_parallel=True, recompute="full", overlap="chunked",
                           vocab="parallel")
    section = LayoutSection(tp=2)  # dp unset: the model's collectives do not read it
    assert model_comm_per_step(cfg, section, opts, batch=4, seq=32) == old
    # keyword spellings of the older form
    assert model_comm_per_step(cfg, tp=2, attention="heads", batch=4, seq=32,
                               sequence_parallel=True, recompute="full", overlap="chunked",
                               chunks=2) == old
    assert model_comm_per_step(cfg, 2, "heads", batch=4, seq=32, sequence_parallel=True,
                               recompute="full", overlap="chunked", chunks=2) == old


def test_cp_splits_the_sequence_the_tp_collectives_see():
    cfg = preset("tiny")
    half = model_comm_per_step(cfg, 2, "heads", 4, 16)
    assert model_comm_per_step(cfg, Layout(tp=2, cp=2), CostOptions(), batch=4, seq=32) == half
    with pytest.raises(ValueError, match=r"cp \(3\) must divide the sequence length \(32\)"):
        model_comm_per_step(cfg, Layout(tp=2, cp=3), CostOptions(), batch=4, seq=32)


def test_bad_objects_and_arguments_are_named():
    cfg = preset("tiny")
    with pytest.raises(ValueError, match=r"options.attention is 'auto'"):
        model_comm_per_step(cfg, Layout(tp=2), ParallelOptions(), batch=4, seq=32)
    with pytest.raises(ValueError, match=r"layout.tp must be an integer >= 1, got 0"):
        Layout(tp=0)
    with pytest.raises(ValueError, match=r"options.recompute must be one of"):
        CostOptions(recompute="all")
    with pytest.raises(ValueError, match=r"options.sequence_parallel must be one of"):
        CostOptions(sequence_parallel=1)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'tp_size'"):
        model_comm_per_step(cfg, 2, "heads", 4, 32, tp_size=2)
    with pytest.raises(TypeError, match=r"multiple values for argument 'attention'"):
        model_comm_per_step(cfg, 2, "heads", 4, 32, attention="naive")
    with pytest.raises(TypeError, match=r"unexpected arguments: \['recompute'\]"):
        model_comm_per_step(cfg, Layout(tp=2), CostOptions(), batch=4, seq=32, recompute="full")
    with pytest.raises(TypeError, match=r"needs batch= and seq="):
        model_comm_per_step(cfg, Layout(tp=2), CostOptions())


def test_activation_bytes_take_the_objects():
    spec = MODEL_PRESETS["llama3-8b"]
    gpt = spec.gpt_config()
    for tp, cp, sp, rc, kernel, b in itertools.product(
            (1, 2, 8), (1, 4), (False, True), ("none", "selective", "full", "ops"),
            ("eager", "fused"), (1, 2)):
        old = activation_bytes_per_layer(
            8192 // cp, b, spec.hidden, spec.heads, tp, sequence_parallel=sp, recompute=rc,
            bytes_per_element=2, attention_kernel=kernel, kv_heads=spec.kv_heads, ffn=spec.ffn,
            gated=True, dropout=False)
        loose = layer_activation_bytes(
            8192 // cp, b, spec.hidden, spec.heads, tp, sequence_parallel=sp, recompute=rc,
            attention_kernel=kernel, kv_heads=spec.kv_heads, ffn=spec.ffn, gated=True,
            dropout=False)
        searched = Options(dp=1, tp=tp, ep=1, attention="heads", sequence_parallel=sp,
                           recompute=rc, zero_stage=0, micro_batch=b, cp=cp)
        layout, options = Layout(tp=tp, cp=cp), CostOptions(sequence_parallel=sp, recompute=rc)
        kw = dict(batch=b, seq=8192, attention_kernel=kernel)
        assert old == loose == activation_bytes_per_layer(spec, layout, options, **kw) \
            == activation_bytes_per_layer(gpt, layout, options, **kw) \
            == activation_bytes_per_layer(spec, searched, searched, **kw)
    # the paper's keywords, by name
    assert activation_bytes_per_layer(s=2048, b=1, h=4096, a=32, t=8) == \
        activation_bytes_per_layer(2048, 1, 4096, 32, 8)


def test_local_step_time_takes_the_objects():
    model = LocalTimeModel.from_dict(LOCAL)
    for (tp, dp), sp, rc in itertools.product(((1, 1), (2, 1), (1, 2), (2, 2)), (False, True),
                                              ("none", "full")):
        if sp and tp == 1:
            continue
        zero, precision = int(dp > 1), "bf16" if tp > 1 else "fp32"
        cfg, nproc = preset("llama-tiny" if rc == "full" else "tiny"), tp * dp
        old = model.step_time(cfg, nproc=nproc, tp=tp, dp=dp, attention="heads",
                              vocab="parallel", batch=8, seq=32, precision=precision,
                              sequence_parallel=sp, recompute=rc, zero=zero,
                              partial_elements=64)
        loose = model._step_time(cfg, nproc=nproc, tp=tp, dp=dp, ep=1, attention="heads",
                                 vocab="parallel", batch=8, seq=32, precision=precision,
                                 sequence_parallel=sp, recompute=rc, zero=zero,
                                 partial_elements=64)
        options = CostOptions(vocab="parallel", sequence_parallel=sp, recompute=rc)
        new = model.step_time(cfg, Layout(tp=tp, dp=dp), options, nproc=nproc, batch=8, seq=32,
                              precision=precision, zero=zero, partial_elements=64)
        unset_dp = model.step_time(cfg, LayoutSection(tp=tp), options, nproc=nproc, batch=8,
                                   seq=32, precision=precision, zero=zero, partial_elements=64)
        assert old == loose == new == unset_dp
    # the older form's default vocabulary is the replicated one; so is the new form's
    cfg = preset("tiny")
    assert model.step_time(cfg, nproc=2, tp=2, dp=1, batch=8, seq=32) == \
        model.step_time(cfg, Layout(tp=2), None, nproc=2, batch=8, seq=32)
    with pytest.raises(ValueError, match=r"prices dp × tp × ep layouts; layout.cp is 2"):
        model.step_time(cfg, Layout(cp=2), None, nproc=2, batch=8, seq=32)
