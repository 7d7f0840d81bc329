"""Re-gathering sequence parallelism (``sequence_parallel="regather"``, SPEC F7, issue 29 item 1):
equal to plain sequence parallelism (≤1e-6, fp32) and to the dense model, exactly one more
all-gather of ``b·s·h`` per region in backward, ``sbh·(1−1/t)`` fewer saved values per region,
the cost model's count, the values ``parallelize`` and ``train`` take."""

from __future__ import annotations

import json
import os

import pytest
import torch

from helpers import assert_rel
from ops_transformer import GPT, CommLedger, init_parallel, parallelize
from ops_transformer.cli.main import main
from ops_transformer.layers.overlap_regions import ChunkedGatherSequenceRegion
from ops_transformer.layers.sequence_regather import RegatherColumnLinear
from ops_transformer.memory import activation_memory
from ops_transformer.models import preset
from ops_transformer.planner.memory import fused_activation_bytes_per_layer
from ops_transformer.planner.strategies import model_comm_per_step
from test_gpt_parallel import B, CONFIGS, T, _batches
from test_gpt_parallel import _train as train_dense_or_parallel
from test_sequence_parallel import _assert_same_training
from test_sequence_parallel import _train as train_sp

FP32_EXACT = 1e-6  # the bound against plain sequence parallelism


def _regathering(model) -> list[str]:
    """The column layers that keep no input for backward: each ``RegatherColumnLinear``
    (``overlap="none"``) and the columns a re-gathering entry op computes (``auto``, ``chunked``)."""
    names = []
    for name, m in model.named_modules():
        if isinstance(m, RegatherColumnLinear):
            names.append(name)
        elif isinstance(m, ChunkedGatherSequenceRegion) and m.regather:
            names += [f"{name}.{c}" if c else name for c in m.columns]
    return sorted(names)


def _step(config, sp, recompute="none", n_layers=2, activation_cache="none", overlap="auto"):
    ctx = init_parallel(tp=int(os.environ["WORLD_SIZE"]))
    torch.manual_seed(0)
    model = parallelize(GPT(CONFIGS[config].with_(n_layers=n_layers)), ctx, attention="heads",
                        vocab="parallel", sequence_parallel=sp, recompute=recompute,
                        activation_cache=activation_cache, overlap=overlap)
    batch = _batches()[0]
    x, y = batch[:, :-1], batch[:, 1:]
    saved = activation_memory(model, x, y)["per_layer"]
    with CommLedger() as fwd:
        logits, loss = model(x, y)
    with CommLedger() as bwd:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    regathering = _regathering(model)
    records = [(r.kind, r.elements, r.label) for r in bwd.records]
    return (float(loss), logits.detach(), grads, fwd.summary(), bwd.summary(), records, saved,
            regathering)


@pytest.mark.parametrize("config,tp,overlap", [
    ("gpt2", 2, "auto"), ("llama", 2, "auto"), ("llama", 2, "none"), ("gpt2", 2, "chunked"),
    pytest.param("gpt2", 4, "auto", marks=pytest.mark.slow),
    pytest.param("llama", 4, "chunked", marks=pytest.mark.slow)])
def test_regather_equals_plain_sequence_parallelism(run_ranks, config, tp, overlap):
    """At every overlap mode (``chunked``: the re-gathering entries in chunks too, issue 33)."""
    plain = run_ranks(_step, tp, config, True, overlap=overlap)
    regather = run_ranks(_step, tp, config, "regather", overlap=overlap)
    bsh = B * T * CONFIGS[config].d_model
    for p, r in zip(plain, regather):
        assert abs(r[0] - p[0]) <= FP32_EXACT * abs(p[0])
        assert_rel(r[1], p[1], FP32_EXACT, "logits")
        for name, g in p[2].items():
            assert_rel(r[2][name], g, FP32_EXACT, f"grad {name}", floor=1e-8)
        assert r[3] == p[3]  # the same forward collectives
        # backward: exactly one more all-gather of b·s·h per region (attention, FFN) and layer
        extra = [rec for rec in r[5] if rec[2] == "sequence_regather.bwd"]
        assert extra == [("all_gather", bsh, "sequence_regather.bwd")] * 4
        assert [rec[:2] for rec in r[5] if rec[2] != "sequence_regather.bwd"] == \
            [rec[:2] for rec in p[5]]  # and otherwise the same, in the same order
        assert r[4]["all_gather"]["calls"] == p[4]["all_gather"]["calls"] + 4
        # fewer saved bytes: each region keeps the b·s/t·h share, not the gathered b·s·h input
        fewer = 2 * bsh * (1 - 1 / tp) * 4
        assert [a - b for a, b in zip(p[6], r[6])] == [fewer, fewer]
        assert len(r[7]) == 8 and p[7] == []  # wq, wk, wv and w_in of 2 layers


def test_the_reference_layer_keeps_what_the_formula_says(run_ranks):
    """GELU layers at dropout 0: the measured bytes of the last layer equal the fused formula's
    with the gathered inputs replaced by their share (``2sbh/t``), with and without selective
    recompute."""
    cfg = CONFIGS["gpt2"]
    for recompute in ("none", "selective"):
        measured = run_ranks(_step, 2, "gpt2", "regather", recompute)[0][6][-1]
        assert measured == fused_activation_bytes_per_layer(
            T, B, cfg.d_model, cfg.n_heads, 2, sequence_parallel="regather",
            recompute=recompute, bytes_per_element=4), recompute


@pytest.mark.slow  # train's metrics check the same (test_train_sequence_parallel_regather)
def test_the_cost_model_counts_the_re_gathers(run_ranks):
    for config in ("gpt2", "llama"):
        cfg = CONFIGS[config]
        r = run_ranks(_step, 2, config, "regather")[0]
        partial = r[5][[rec[2] for rec in r[5]].index("grad_sums")][1]
        expected = model_comm_per_step(cfg.with_(n_layers=2), 2, "heads", B, T, "parallel",
                                       sequence_parallel="regather", partial_elements=partial)
        measured = {k: {"calls": r[3].get(k, {}).get("calls", 0) + r[4].get(k, {}).get("calls", 0),
                        "elements": r[3].get(k, {}).get("elements", 0)
                        + r[4].get(k, {}).get("elements", 0)} for k in set(r[3]) | set(r[4])}
        assert measured == dict(expected), config


@pytest.mark.parametrize("nprocs,tp", [(1, 1), (2, 2), pytest.param(4, 4, marks=pytest.mark.slow)])
def test_chunked_regather_training_equals_dense(run_ranks, nprocs, tp):
    """Issue 33: ``sequence_parallel="regather"`` with ``overlap="chunked"`` (the re-gathering
    entries in chunks, each region's columns in its one op) trains like the dense model: the
    losses and weights of every step (forward, input and weight gradients through the AdamW
    updates), tp 1, 2 and 4."""
    reference = run_ranks(train_dense_or_parallel, 1, "llama", "adamw", 1, "heads")[0]
    _assert_same_training(reference, run_ranks(
        train_dense_or_parallel, nprocs, "llama", "adamw", tp, "heads", "parallel",
        sequence_parallel="regather", overlap="chunked"))


@pytest.mark.slow
def test_training_equals_dense(run_ranks):
    reference = run_ranks(train_sp, 1, "llama", "adamw", 1)[0]
    _assert_same_training(reference, run_ranks(train_sp, 2, "llama", "adamw", 2, "regather"))


@pytest.mark.slow
@pytest.mark.parametrize("config,nprocs,tp,recompute", [
    ("gpt2", 4, 2, "selective"), ("llama", 4, 4, "none"), ("gpt2", 2, 2, "full")])
def test_training_equals_dense_more_layouts(run_ranks, config, nprocs, tp, recompute):
    reference = run_ranks(train_sp, 1, config, "adamw", 1)[0]
    _assert_same_training(reference, run_ranks(train_sp, nprocs, config, "adamw", tp,
                                               "regather", recompute))


@pytest.mark.slow
def test_full_recompute_runs_plain_sequence_parallelism(run_ranks):
    full = run_ranks(_step, 2, "gpt2", "regather", "full")[0]
    plain = run_ranks(_step, 2, "gpt2", True, "full")[0]
    assert full[7] == [] and full[3] == plain[3] and full[4] == plain[4]


@pytest.mark.slow
def test_int8_cache_keeps_the_share_quantised(run_ranks):
    r = run_ranks(_step, 2, "gpt2", "regather", "none", 2, "int8")[0]
    p = run_ranks(_step, 2, "gpt2", True, "none", 2, "int8")[0]
    assert r[6][-1] < p[6][-1]
    assert abs(r[0] - p[0]) <= FP32_EXACT * abs(p[0])  # the forward is not quantised


@pytest.mark.parametrize("value", ["plain", "yes", 1, None, "Regather"])
def test_other_values_are_a_clear_error(value):
    with pytest.raises(ValueError, match=r"sequence_parallel must be one of \(False, True, "
                                         r"'regather'\).*got " + repr(value).replace("(", r"\(")):
        parallelize(GPT(CONFIGS["gpt2"]), init_parallel(), sequence_parallel=value)


def test_the_plan_names_the_regathering_styles(run_ranks):
    def plans():
        ctx = init_parallel(tp=2)
        out = []
        for overlap in ("none", "chunked"):
            torch.manual_seed(0)
            out.append(parallelize(GPT(CONFIGS["llama"]), ctx, sequence_parallel="regather",
                                   overlap=overlap).parallel_plan.rules)
        return out

    rules, chunked = run_ranks(plans, 2)[0]
    # (issue 33: the re-gathering variants are options of their kinds, not renamed styles)
    assert rules["layers.*.attn"] == {"style": "region", "entry": "sequence", "regather": True}
    assert rules["layers.*.attn.wq"] == {"style": "colwise", "regather": True}
    assert rules["layers.*.attn.wo"] == {"style": "rowwise", "exit": "reduce_scatter"}
    w_in = rules["layers.*.mlp.w_in"]  # (its gate|up sub-blocks too)
    assert (w_in["style"], w_in["entry"], w_in["regather"]) == ("colwise", "sequence", True)
    # with overlap (issue 33) the re-gathering entries run in chunks too, as one op with their
    # columns (regather an option of the entry); the exits as before
    extra = {"overlap": "chunked", "chunks": 2}
    assert chunked["layers.*.attn"] == {**rules["layers.*.attn"], "columns": ["wq", "wk", "wv"],
                                        **extra}
    assert chunked["layers.*.attn.wq"] == {"style": "colwise", "fed": True}
    assert chunked["layers.*.mlp.w_in"] == {**rules["layers.*.mlp.w_in"], **extra}
    assert chunked["layers.*.attn.wo"] == {"style": "rowwise", "exit": "reduce_scatter",
                                           "overlap": "chunked", "chunks": 2}


# ---------------------------------------------------------------- Hugging Face models

tr = pytest.importorskip("transformers")


def _hf_step(family, sp):
    from test_hf_memory import _batch, make

    ctx = init_parallel(tp=2)
    model = parallelize(make(family).train(), ctx, sequence_parallel=sp)
    ids, mask, labels = _batch()
    with CommLedger() as ledger:
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(out.loss), grads, ledger.summary()["all_gather"]["calls"]


@pytest.mark.slow  # ~5 s each alone
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hugging_face_regather_equals_plain(run_ranks, family):
    plain = run_ranks(_hf_step, 2, family, True)[0]
    regather = run_ranks(_hf_step, 2, family, "regather")[0]
    assert abs(regather[0] - plain[0]) <= FP32_EXACT * abs(plain[0])
    for name, g in plain[1].items():
        assert_rel(regather[1][name], g, FP32_EXACT, name, floor=1e-8)
    assert regather[2] > plain[2]


# ---------------------------------------------------------------- the command line

def test_train_sequence_parallel_regather(tmp_path, capsys):
    assert main(["train", "--nproc", "2", "--tp", "2", "--steps", "2", "--batch", "2", "--seq",
                 "32", "--sequence-parallel", "regather", "--recompute", "selective",
                 "--out", str(tmp_path / "run"), "--no-progress", "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["config"]["sequence_parallel"] == "regather"
    measured = {k: {"calls": v["calls"], "elements": v["elements"]}
                for k, v in metrics["tp_comm_per_step"].items()}
    assert measured == metrics["expected_tp_comm_per_step"]  # the re-gathers, as modelled
    cfg = preset("tiny")
    plain = model_comm_per_step(cfg, 2, "heads", 2, 32, metrics["plan"]["vocab"],
                                sequence_parallel=True,
                                partial_elements=measured["all_reduce"]["elements"])
    assert measured["all_gather"]["calls"] == plain["all_gather"]["calls"] + 2 * cfg.n_layers


def test_train_other_sequence_parallel_values_exit_2(tmp_path, capsys):
    assert main(["train", "--nproc", "2", "--tp", "2", "--sequence-parallel", "sometimes",
                 "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--sequence-parallel takes no value" in err and "'regather'" in err
    assert "got 'sometimes'" in err and len(err.splitlines()) == 1


def test_memory_command_shows_the_trade_off(capsys):
    assert main(["memory", "--preset", "tiny", "--tp", "2", "--seq", "32", "--batch", "2",
                 "--layers", "1", "--steps", "1", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    plain, regather = rows["SP + selective"], rows["SP regather + selective"]
    assert regather["bytes_per_layer"] < plain["bytes_per_layer"]
    bsh = 2 * 32 * preset("tiny").d_model
    # one more all-gather of b·s·h fp32 per region (2 per layer) in backward
    assert regather["tp_comm_bytes_per_step"] - plain["tp_comm_bytes_per_step"] == 2 * bsh * 4
