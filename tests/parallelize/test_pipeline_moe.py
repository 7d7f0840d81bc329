"""MoE layers inside pipeline stages (``parallelize/pipeline_moe.py``): pp 2 with ``m``
micro-batches routes each micro-batch by itself, so its reference is one device accumulating
the same ``m`` micro-batches (Megatron-LM and torchtitan route per micro-batch too): the loss
(cross-entropy plus every stage's load-balancing term), every gradient (the routers' included:
the middle stages' aux loss reaches the backward) and the MoE statistics within 1e-5."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_rel
from ops_transformer import GPT, init_parallel, pipeline
from ops_transformer.models.gpt import GPTConfig
from ops_transformer.models.moe import moe_stats

RTOL = 1e-5  # fp32: the same micro-batches on the same rows, the stages' sums in another order
CFG = GPTConfig(vocab_size=64, n_layers=4, d_model=32, n_heads=4, d_ff=64, max_seq_len=16,
                n_experts=4, top_k=2, moe_capacity_factor=1.25, moe_aux_loss_coef=0.1)
B, T = 8, 8


def _batch():
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, CFG.vocab_size, (B, T), generator=g),
            torch.randint(0, CFG.vocab_size, (B, T), generator=g))


def _one_device(pieces: int):
    """One device, the batch in ``pieces`` micro-batches (``train --grad-accum``): each backward
    of ``(CE + c·aux) / pieces``; the mean loss, the gradients, the mean aux loss."""
    torch.manual_seed(0)
    model = GPT(CFG)
    idx, y = _batch()
    loss_sum, aux_sum = 0.0, 0.0
    for x_micro, y_micro in zip(idx.chunk(pieces), y.chunk(pieces)):
        loss = model(x_micro, y_micro)[1]
        (loss / pieces).backward()
        loss_sum += loss.item()
        aux_sum += moe_stats(model)["aux_loss"]
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss_sum / pieces, grads, aux_sum / pieces


def _piped(schedule, v, m, n):
    torch.set_num_threads(1)
    ctx = init_parallel(pp=2)
    torch.manual_seed(0)
    model = GPT(CFG)
    pipe = pipeline(model, ctx, schedule, microbatches=m, stages_per_rank=v)
    idx, y = _batch()
    metrics = pipe.step_metrics(idx, y, grad_accum=n)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return {k: float(t) for k, t in metrics.items()}, grads


SLOW = pytest.mark.slow  # ~3-9 s each on a loaded machine: the default suite keeps two


@pytest.mark.parametrize("schedule, v, m, n", [
    ("gpipe", 1, 2, 1), ("zero_bubble", 2, 2, 1), pytest.param("1f1b", 1, 4, 1, marks=SLOW),
    pytest.param("1f1b", 1, 2, 2, marks=SLOW), pytest.param("interleaved", 2, 2, 1, marks=SLOW),
])
def test_pp2_moe_equals_one_device_with_the_same_micro_batches(run_ranks, schedule, v, m, n):
    want_loss, want_grads, want_aux = _one_device(n * m)
    results = run_ranks(_piped, 2, schedule, v, m, n)
    # optimizer_step averages the metrics over the pp ranks: each rank's share counts pp times
    metrics = {k: sum(r[0][k] for r in results) / 2 for k in results[0][0]}
    assert metrics["loss"] == pytest.approx(want_loss, rel=RTOL)
    assert metrics["moe_aux_loss"] == pytest.approx(want_aux, rel=RTOL)
    seen = set()
    for rank, (_, grads) in enumerate(results):
        seen |= set(grads)
        for name, grad in grads.items():
            dense = "tok_emb.weight" if name == "lm_head.weight" else name  # tied, summed
            assert_rel(grad, want_grads[dense], RTOL, f"pp rank {rank}: {name}")
    assert seen == set(want_grads) | {"lm_head.weight"}
    routers = [name for name in want_grads if "router" in name or "gate" in name]
    assert routers and any(name in results[0][1] for name in routers)  # stage 0's routers too


def test_pp2_moe_is_not_one_pass_over_the_batch(run_ranks):
    """The reference matters: per micro-batch routing differs from routing the whole batch
    (capacity and load-balancing loss over fewer tokens), so the test above can fail."""
    whole_loss, whole_grads, _ = _one_device(1)
    results = run_ranks(_piped, 2, "1f1b", 1, 4, 1)
    loss = sum(r[0]["loss"] for r in results) / 2
    differs = abs(loss - whole_loss) > RTOL * abs(whole_loss) or any(
        not torch.allclose(g, whole_grads[k], rtol=RTOL, atol=0) for r in results
        for k, g in r[1].items() if k in whole_grads)
    assert differs
