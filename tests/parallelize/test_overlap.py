"""Overlap: every mode computes what ``overlap="none"`` computes (loss and every gradient,
<= 1e-6 relative, fp32) at tp 2 and 4 and dp 2 × tp 2, with and without sequence parallelism,
with recompute and with experts over ep 2; the ledger moves the same bytes, in the calls the
cost formula counts; ``auto`` follows the cost model when the profile's latency changes."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from ops_transformer import GPT, CommLedger, init_parallel, parallelize
from ops_transformer.layers.overlap_policy import overlap_decisions
from ops_transformer.training.optimizer import partial_numel
from ops_transformer.models import preset
from ops_transformer.planner import HardwareProfile
from ops_transformer.planner.overlap import moe_chunk_calls
from ops_transformer.planner.strategies import model_comm_per_step
from test_gpt_parallel import B, CONFIGS, T, _batches

transformers = pytest.importorskip("transformers")  # imported once here, not in every rank
LlamaConfig, LlamaForCausalLM = transformers.LlamaConfig, transformers.LlamaForCausalLM

MODES = ("none", "chunked", "auto")
EXACT = 1e-6
# A profile on which chunks always pay (no latency) and one on which they never do.
FAST = HardwareProfile("no latency", matmul_flops=1e9, alpha_s=0.0, bandwidth=1e9)
SLOW = HardwareProfile("1 s latency", matmul_flops=1e9, alpha_s=1.0, bandwidth=1e9)


def _config(name):
    if name == "moe":
        return preset("moe-tiny", vocab_size=250, max_seq_len=T)
    if name.endswith("-dropout"):  # one-device masks: every mode draws the same ones
        return dataclasses.replace(CONFIGS[name[:-len("-dropout")]], dropout=0.1)
    return CONFIGS[name]


def _step(ctx, config, overlap, chunks, **options):
    """One forward and backward of a fresh model: loss, gradients, ledger, the TP group's
    collectives and what the cost formula predicts for them."""
    torch.manual_seed(0)
    cfg = _config(config)
    model = parallelize(GPT(cfg), ctx, attention="heads", vocab="parallel", overlap=overlap,
                        chunks=chunks, **options)
    rows = B // ctx.dp_ep_size
    batch = _batches()[0][ctx.dp_ep_rank * rows:(ctx.dp_ep_rank + 1) * rows]
    with CommLedger() as ledger:
        loss = model(batch[:, :-1], batch[:, 1:])[1]
        loss.backward()
    tp_ranks = tuple(r for r in range(ctx.world_size) if r // ctx.tp_size == ctx.rank // ctx.tp_size)
    expected = model_comm_per_step(
        cfg, ctx.tp_size, "heads", rows, T, sequence_parallel=options.get("sequence_parallel",
                                                                          False),
        recompute=options.get("recompute", "none"), overlap=overlap, chunks=chunks,
        partial_elements=partial_numel(model, ctx.tp_group), profile=ctx.profile, ep=ctx.ep_size)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return (float(loss.detach()), grads, ledger.summary(), ledger.by_group().get(tp_ranks, {}),
            expected, overlap_decisions(model))


def _modes(config, tp, chunks=2, ep=1, profile=None, **options):
    ctx = init_parallel(tp=tp, ep=ep, profile=profile)
    return {mode: _step(ctx, config, mode, chunks, **options) for mode in MODES}


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _calls_and_elements(summary):
    return {k: {"calls": v["calls"], "elements": v["elements"]} for k, v in summary.items()}


def _volume(summary):
    return {k: (v["elements"], v["bytes"]) for k, v in summary.items()}


def _calls(summary):
    return {k: v["calls"] for k, v in summary.items()}


def _assert_same_as_none(results, balanced=True):
    """``balanced=False``: routed experts, whose elements the formula counts only for a
    balanced routing (its calls are exact)."""
    loss, grads, ledger, *_ = results["none"]
    for mode in ("chunked", "auto"):
        other_loss, other_grads, other_ledger, tp_comm, expected, _ = results[mode]
        assert abs(other_loss - loss) <= EXACT * abs(loss), mode
        assert other_grads.keys() == grads.keys()
        for name, g in grads.items():
            assert _rel(other_grads[name], g) <= EXACT, (mode, name, _rel(other_grads[name], g))
        assert _volume(other_ledger) == _volume(ledger), mode  # the same bytes, in more calls
        if balanced:
            assert _calls_and_elements(tp_comm) == expected, mode  # the calls the formula counts
        else:
            assert _calls(tp_comm) == _calls(expected), mode


CASES = [  # config, processes, tp, options (the first six run in the default suite)
    ("gpt2", 2, 2, {}),
    ("llama", 4, 4, {"sequence_parallel": True}),
    ("llama", 2, 2, {"sequence_parallel": True, "recompute": "full"}),
    ("gpt2", 4, 2, {}),  # dp 2 × tp 2
    # the re-gathering entries stay whole; the exits run in chunks
    ("llama", 2, 2, {"sequence_parallel": "regather"}),
    ("gpt2-dropout", 2, 2, {"sequence_parallel": True}),
    ("gpt2", 2, 2, {"recompute": "full"}),
    ("llama", 4, 2, {"sequence_parallel": True, "recompute": "selective"}),  # dp 2 × tp 2
    ("gpt2", 4, 4, {"recompute": "selective"}),
    ("llama", 4, 4, {}),
]


@pytest.mark.parametrize("config,nprocs,tp,options", [
    c if i < 6 else pytest.param(*c, marks=pytest.mark.slow) for i, c in enumerate(CASES)])
def test_every_mode_equals_none(run_ranks, config, nprocs, tp, options):
    # llama at tp 4 without SP replicates each of its 2 KV heads on a pair of ranks: the formula
    # counts the replicas' gradient sums in the all-reduce elements, but they run on the pairs'
    # groups, outside the TP group's ledger; there the calls are compared (the bytes of every
    # mode still equal none's, over all groups)
    replicated_kv = config == "llama" and tp == 4 and not options.get("sequence_parallel")
    for rank_results in run_ranks(_modes, nprocs, config, tp, 3, **options):
        _assert_same_as_none(rank_results, balanced=not replicated_kv)
        chunked = rank_results["chunked"]
        assert chunked[3] != rank_results["none"][3]  # the chunks show in the ledger


@pytest.mark.parametrize("nprocs,tp,recompute", [
    (2, 1, "none"), (4, 2, "none"), pytest.param(2, 1, "full", marks=pytest.mark.slow)])
def test_expert_all_to_alls_in_chunks_equal_none(run_ranks, nprocs, tp, recompute):
    chunks = 3
    for results in run_ranks(_modes, nprocs, "moe", tp, chunks, 2, recompute=recompute):
        _assert_same_as_none(results, balanced=False)
        none, chunked = results["none"][2], results["chunked"][2]
        cfg = _config("moe")
        _, extra = moe_chunk_calls(slots=1, h=cfg.d_model, expert_width=1, ep=2, tp=tp,
                                   overlap="chunked", chunks=chunks, recompute=recompute)
        layers = cfg.n_layers
        assert chunked["all_to_all"]["calls"] == (none["all_to_all"]["calls"]
                                                  + extra["all_to_all"]["calls"] * layers)
        assert chunked["all_gather"] == none["all_gather"]  # one exchange of counts per call


def _auto_on(config, profile, **options):
    ctx = init_parallel(tp=2, profile=profile)
    return {mode: _step(ctx, config, mode, 2, **options) for mode in ("none", "chunked", "auto")}


@pytest.mark.parametrize("sp", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_auto_follows_the_profiles_latency(run_ranks, sp):
    options = {"sequence_parallel": sp}
    fast = run_ranks(_auto_on, 2, "llama", FAST, **options)[0]
    slow = run_ranks(_auto_on, 2, "llama", SLOW, **options)[0]
    assert fast["auto"][3] == fast["chunked"][3] != fast["none"][3]  # chunks pay: chunked
    assert slow["auto"][3] == slow["none"][3]  # they never pay: one call each
    for results in (fast, slow):
        _assert_same_as_none(results)
    reasons = [d["reason"] for ds in fast["auto"][5].values() for d in ds]
    assert reasons and all("2 chunks save" in r and "no latency" in r for r in reasons)
    reasons = [d["reason"] for ds in slow["auto"][5].values() for d in ds]
    assert reasons and all(r.startswith("not chunked") for r in reasons)


def _hf_llama(sp, chunks):
    ctx = init_parallel(tp=int(os.environ["WORLD_SIZE"]))
    return {mode: _hf_llama_step(ctx, mode, sp, chunks) for mode in ("none", "chunked")}


def _hf_llama_step(ctx, overlap, sp, chunks):
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                         max_position_embeddings=64)
    model = parallelize(LlamaForCausalLM(config), ctx, sequence_parallel=sp, overlap=overlap,
                        chunks=chunks)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with CommLedger() as ledger:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return float(out.loss.detach()), grads, ledger.summary(), repr(model)


@pytest.mark.parametrize("tp,sp", [(2, True), pytest.param(2, False, marks=pytest.mark.slow),
                                   pytest.param(4, True, marks=pytest.mark.slow)])
def test_hugging_face_llama_in_chunks_equals_none(run_ranks, tp, sp):
    chunks, layers = 3, 2
    results = run_ranks(_hf_llama, tp, sp, chunks)[0]
    none, chunked = results["none"], results["chunked"]
    assert abs(chunked[0] - none[0]) <= EXACT * none[0]
    for name, g in none[1].items():
        assert _rel(chunked[1][name], g) <= EXACT, name
    assert _volume(chunked[2]) == _volume(none[2])
    # each region's collective, one per direction: 4 per layer, (chunks - 1) more calls each
    kinds = {"all_gather": 4, "reduce_scatter": 4} if sp else {"all_reduce": 4}
    for kind, per_layer in kinds.items():
        assert chunked[2][kind]["calls"] - none[2][kind]["calls"] == \
            (chunks - 1) * per_layer * layers
    text = chunked[3]
    for shown in ("FedColumnParallelLinear(", "output: matmul_all_reduce over tp=" if not sp else
                  "output: matmul_reduce_scatter over tp=", "overlap=chunked (chunks 3)",
                  "as gather_matmul with q_proj, k_proj, v_proj" if sp else
                  "as copy_matmul with gate_proj, up_proj"):
        assert shown in text, shown


def test_options_are_checked():
    from ops_transformer.parallelize import ParallelOptions

    with pytest.raises(ValueError, match=r"overlap must be one of \('none', 'chunked', 'auto'\)"):
        ParallelOptions(overlap="always")
    with pytest.raises(ValueError, match="chunks must be an integer >= 1, got 0"):
        ParallelOptions(chunks=0)
    assert ParallelOptions().overlap == "auto" and ParallelOptions().chunks == 2


def test_train_lora_keeps_every_overlap_mode():
    """Issue 33: LoRA runs inside the chunked collective matmuls, so ``train --lora-rank`` keeps
    ``--overlap`` as given (it used to turn ``auto`` into ``none`` and refuse ``chunked``)."""
    from ops_transformer.training.loop import TrainConfig

    assert TrainConfig(lora_rank=4).parallel_options().overlap == "auto"
    assert TrainConfig(lora_rank=4, overlap="chunked").parallel_options().overlap == "chunked"
