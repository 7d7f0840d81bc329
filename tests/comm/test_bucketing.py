"""Coalescing (comm/bucketing.py): one all-reduce for many small tensors; replicated parameters'
partial gradients summed once per backward for all layers, right under gradient accumulation; a
training step's ledger holds at most 2 collectives below 64 KB (3 with the vocab-parallel loss),
whatever the number of layers."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_rel
from ops_transformer import (GPT, CommLedger, DynamicLossScaler, all_reduce_coalesced,
                             init_parallel, no_sync, optimizer_step, parallelize)
from ops_transformer.models import preset

SMALL = 64 * 1024  # bytes: "small" collectives are latency-bound


def _coalesced():
    ctx = init_parallel(tp=2)
    r = float(ctx.rank + 1)
    tensors = [torch.full((2, 3), r), torch.full((4,), r, dtype=torch.bfloat16), torch.tensor(r)]
    with CommLedger() as ledger:
        out = all_reduce_coalesced(tensors, ctx.tp_group)
    return [t.tolist() for t in out], [(x.kind, x.elements, str(x.dtype)) for x in ledger.records]


def test_all_reduce_coalesced_is_one_call(run_ranks):
    for out, records in run_ranks(_coalesced, 2):
        assert out == [[[3.0] * 3] * 2, [3.0] * 4, 3.0]
        assert records == [("all_reduce", 11, "torch.float32")]  # mixed dtypes: float32


# --- partial gradients of replicated parameters -----------------------------------------------------

MQA = preset("llama-tiny", max_seq_len=16, n_kv_heads=1)  # at tp 2 the KV head is replicated


def _kv_grads(mode):
    ctx = init_parallel(tp=2)
    torch.manual_seed(0)
    model = parallelize(GPT(MQA), ctx, attention="heads", vocab="replicated")
    batch = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    with CommLedger() as ledger:
        if mode == "once":
            model(batch[:, :-1], batch[:, 1:])[1].backward()
        for i, part in enumerate(batch.chunk(2) if mode != "once" else ()):
            loss = model(part[:, :-1], part[:, 1:])[1] / 2
            if mode == "no_sync" and i == 0:
                with no_sync(model):
                    loss.backward()
            else:
                loss.backward()
    sums = [r for r in ledger.records if r.label == "grad_sums"]
    return ({n: p.grad.clone() for n, p in model.named_parameters()},
            [(r.elements, r.group_ranks) for r in sums])


def test_partial_gradients_are_summed_once_and_accumulate_correctly(run_ranks):
    kv = MQA.head_dim * MQA.d_model  # wk or wv of one layer: one head, replicated on both ranks
    once = run_ranks(_kv_grads, 2, "once")
    for mode, calls in (("accumulate", 2), ("no_sync", 1)):
        for (g1, sums1), (g2, sums2) in zip(once, run_ranks(_kv_grads, 2, mode)):
            assert sums1 == [(2 * MQA.n_layers * kv, (0, 1))]  # both layers, wk and wv: one call
            assert len(sums2) == calls, mode  # once per backward outside no_sync
            for name in g1:
                assert_rel(g2[name], g1[name], what=f"{mode}: {name}")


# --- the small-collective bound of a training step --------------------------------------------------

def _step_records(n_layers, tp, vocab):
    ctx = init_parallel(tp=tp)
    torch.manual_seed(0)
    model = parallelize(GPT(MQA.with_(n_layers=n_layers, max_seq_len=64)), ctx,
                        attention="heads", vocab=vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = DynamicLossScaler(ctx)
    batch = torch.randint(0, 256, (4 * ctx.dp_size, 65), generator=torch.Generator().manual_seed(0))
    rows = batch.chunk(ctx.dp_size)[ctx.dp_rank]  # 4 × 64 tokens: activations of 64 KB
    with CommLedger() as ledger:  # forward, backward, clipping, optimizer step
        loss = model(rows[:, :-1], rows[:, 1:])[1]
        scaler.scale(loss).backward()
        report = optimizer_step(model, opt, ctx, scaler=scaler, max_norm=1.0,
                                metrics={"loss": loss})
    assert report.stepped and report.grad_norm > 0
    return [(r.label, r.kind, r.bytes) for r in ledger.records if r.bytes < SMALL]


@pytest.mark.parametrize("nprocs,tp,vocab,bound", [
    pytest.param(2, 2, "replicated", 2, marks=pytest.mark.slow),
    (2, 2, "parallel", 3),
    (4, 2, "replicated", 2),  # dp 2 × tp 2
])
def test_a_training_step_has_at_most_two_small_collectives(run_ranks, nprocs, tp, vocab, bound):
    small = run_ranks(_step_records, nprocs, 4, tp, vocab)[0]
    assert len(small) <= bound, small
    labels = {label for label, _, _ in small}
    # the replicated KV heads' gradient sums (all 4 layers), the step's flag + norm + loss
    assert labels == {"grad_sums", "step_stats"} | ({"vocab_parallel_ce.stats"}
                                                    if vocab == "parallel" else set())
    if nprocs == 2:  # whatever the number of layers: the same calls (fewer bytes)
        one_layer = run_ranks(_step_records, nprocs, 1, tp, vocab)[0]
        assert [x[:2] for x in one_layer] == [x[:2] for x in small]
