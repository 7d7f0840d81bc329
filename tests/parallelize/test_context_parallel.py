"""The reference GPT with its sequences split over cp ranks (ring and allgather_kv), alone and
with tensor parallelism (tp 2 × cp 2), against one device over 10 optimizer steps: the loss of
every step and the weights after the last, fp32 within 1e-6 relative; the CP traffic in the
ledger; the errors for what does not compose."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import rel_err
from ops_transformer import CommLedger, GPT, gather_full_state_dict, init_parallel, parallelize
from ops_transformer.models.gpt import preset
from ops_transformer.planner import context_parallel as cpcost

B, S, STEPS = 2, 16, 10
CONFIGS = {"tiny": dict(n_layers=2, max_seq_len=32),  # learned positions, tied embeddings, MHA
           "llama-tiny": dict(n_layers=2, max_seq_len=32)}  # RoPE, GQA (2 KV heads), untied


def _batches(vocab):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (B, S + 1), generator=g) for _ in range(STEPS)]


def _train(model, batches):
    # SGD, as check_parity steps: Adam divides by √v, which turns a 1e-7 rounding of a near-zero
    # gradient entry into a 1e-5 weight difference after a few steps (measured: 3e-5 in wq)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for batch in batches:
        _, loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()  # the gradient reducers finish at the end of backward
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _cp_vs_dense(name, tp, cp, strategy):
    torch.set_num_threads(1)
    ctx = init_parallel(tp=tp, cp=cp)
    torch.manual_seed(0)
    dense = GPT(preset(name, **CONFIGS[name]))
    model = parallelize(copy.deepcopy(dense), ctx, context_parallel=strategy)
    batches = _batches(dense.cfg.vocab_size)
    ref_losses = _train(dense, batches)
    losses = _train(model, batches)
    weights = gather_full_state_dict(model, ctx)
    worst = max((rel_err(weights[k], v), k) for k, v in dense.state_dict().items())
    choice = model.parallel_state.context_parallel
    return losses, ref_losses, worst, (choice.strategy, choice.reason), repr(model)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("tp,cp,strategy", [(1, 2, "ring"), (1, 2, "allgather_kv"),
                                            (2, 2, "ring"), (1, 2, "ulysses")])
def test_gpt_context_parallel_equals_one_device(run_ranks, name, tp, cp, strategy):
    for rank, (losses, ref, worst, choice, text) in enumerate(
            run_ranks(_cp_vs_dense, tp * cp, name, tp, cp, strategy)):
        for step, (mine, theirs) in enumerate(zip(losses, ref)):
            assert abs(mine - theirs) <= 1e-6 * abs(theirs), (rank, step, mine, theirs)
        assert worst[0] <= 1e-6, f"rank {rank}: weights after {STEPS} steps differ by {worst}"
        assert choice[0] == strategy and "forced" in choice[1]
        assert f"strategy={strategy}, cp={cp}" in text


def _ledger_of_one_step(strategy):
    torch.set_num_threads(1)
    ctx = init_parallel(cp=2)
    torch.manual_seed(0)
    model = parallelize(GPT(preset("llama-tiny", max_seq_len=32)), ctx, context_parallel=strategy)
    batch = _batches(256)[0]
    with CommLedger() as fwd:
        _, loss = model(batch[:, :-1], batch[:, 1:])
    with CommLedger() as bwd:
        loss.backward()
    return _attention_traffic(fwd), _attention_traffic(bwd), [r.label for r in fwd.records]


def _attention_traffic(ledger):
    """The summary of the records labelled ``cp.ring.*`` / ``cp.allgather_kv.*``."""
    kept = CommLedger()
    kept.records = [r for r in ledger.records
                    if r.label.startswith(("cp.ring", "cp.allgather_kv", "cp.ulysses"))]
    return kept.summary()


@pytest.mark.parametrize("strategy", ["ring", "allgather_kv", "ulysses"])
def test_gpt_cp_traffic_equals_the_formula_per_layer(run_ranks, strategy):
    cfg = preset("llama-tiny")
    fwd, bwd, labels = run_ranks(_ledger_of_one_step, 2, strategy)[0]
    per_layer = cpcost.layer_comm(strategy, batch=B, seq=S, kv_dim=cfg.n_kv_heads * cfg.head_dim,
                                  cp=2, q_dim=cfg.d_model)
    for got, want in ((fwd, per_layer["fwd"]), (bwd, per_layer["bwd"])):
        scaled = {k: {"calls": c["calls"] * cfg.n_layers, "elements": c["elements"] * cfg.n_layers,
                      "bytes": 4 * c["elements"] * cfg.n_layers} for k, c in want.items()}
        assert got == scaled
    assert labels.count("cp.loss.fwd") == 1 and not any("tokens" in label for label in labels)


def _bad_sequence():
    ctx = init_parallel(cp=2)
    model = parallelize(GPT(preset("tiny", max_seq_len=32)), ctx, context_parallel="ring")
    with pytest.raises(ValueError, match=r"sequence length 10 is not divisible by 4 \(cp=2\)"):
        model(torch.zeros(1, 10, dtype=torch.long))
    with pytest.raises(ValueError, match="attention='kv_split'"):
        parallelize(GPT(preset("tiny")), ctx, attention="kv_split")
    auto = parallelize(GPT(preset("tiny", max_seq_len=32)), ctx).parallel_state.context_parallel
    return auto.strategy, auto.reason


def test_bad_sequence_and_unsupported_options_are_clear_errors(run_ranks):
    strategy, reason = run_ranks(_bad_sequence, 2)[0]
    assert strategy in cpcost.CP_STRATEGIES and "ring" in reason and "allgather_kv" in reason


def _packed_documents(strategy):
    torch.set_num_threads(1)
    ctx = init_parallel(cp=2)
    torch.manual_seed(0)
    dense = GPT(preset("llama-tiny", max_seq_len=32))
    model = parallelize(copy.deepcopy(dense), ctx, context_parallel=strategy)
    batch = _batches(256)[0]
    ids = torch.tensor([[0] * 3 + [1] * 9 + [2] * 4, [0] * 10 + [1] * 6])  # boundaries anywhere
    _, ref = dense(batch[:, :-1], batch[:, 1:], document_ids=ids)
    ref.backward()
    _, loss = model(batch[:, :-1], batch[:, 1:], document_ids=ids)
    loss.backward()
    grads = dict(dense.named_parameters())
    worst = max(rel_err(p.grad, grads[n].grad) for n, p in model.named_parameters())
    return float(loss), float(ref), worst


@pytest.mark.parametrize("strategy", ["ring", "allgather_kv"])
def test_packed_documents_at_cp2_equal_one_device(run_ranks, strategy):
    for loss, ref, worst in run_ranks(_packed_documents, 2, strategy):
        assert abs(loss - ref) <= 1e-6 * ref and worst <= 1e-5, (loss, ref, worst)
