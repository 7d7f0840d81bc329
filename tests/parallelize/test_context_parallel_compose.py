"""Context parallelism with the other options of ``parallelize``: one step of the reference GPT
split over ``cp`` ranks (with TP where the option needs it) against the one-process model — the
loss, and every parameter's gradient gathered to dense — fp32 within 1e-5 relative; the ledger
where an option changes what travels."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers import rel_err
from ops_transformer import CommLedger, GPT, gather_full_state_dict, init_parallel, parallelize
from ops_transformer.models.gpt import preset

B, S = 2, 16


def _batch(vocab):
    return torch.randint(0, vocab, (B, S + 1), generator=torch.Generator().manual_seed(1))


def dense_grads(model, ctx) -> dict[str, torch.Tensor]:
    """Every parameter's gradient in dense coordinates (the TP shards gathered)."""
    kept = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
        grads = gather_full_state_dict(model, ctx)
        for n, p in model.named_parameters():
            p.copy_(kept[n])
    return grads


def one_step(name, tp, cp, strategy="ring", *, cfg=None, **options):
    """``(loss, dense loss, worst gradient error and its name, forward and backward ledgers,
    print(model))`` on this rank."""
    torch.set_num_threads(1)
    ctx = init_parallel(tp=tp, cp=cp)
    torch.manual_seed(0)
    dense = GPT(preset(name, n_layers=2, max_seq_len=32, **(cfg or {})))
    model = parallelize(copy.deepcopy(dense), ctx, context_parallel=strategy, **options)
    batch = _batch(dense.cfg.vocab_size)
    _, ref = dense(batch[:, :-1], batch[:, 1:])
    ref.backward()
    with CommLedger() as fwd:
        _, loss = model(batch[:, :-1], batch[:, 1:])
    with CommLedger() as bwd:
        loss.backward()
    grads = dense_grads(model, ctx)
    worst = max((rel_err(grads[n], p.grad), n) for n, p in dense.named_parameters()
                if p.grad is not None)
    return float(loss.detach()), float(ref), worst, fwd, bwd, repr(model)


def assert_exact(results, tol=1e-5):
    for rank, (loss, ref, worst, *_) in enumerate(results):
        assert abs(loss - ref) <= 1e-6 * abs(ref), (rank, loss, ref)
        assert worst[0] <= tol, f"rank {rank}: gradient of {worst[1]} differs by {worst[0]:.2e}"


def _records(ledger, *labels):
    return [(r.kind, r.elements) for r in ledger.records if r.label.startswith(labels)]


@pytest.mark.parametrize("name,strategy", [("llama-tiny", "ring"), ("tiny", "allgather_kv")])
@pytest.mark.parametrize("sp", [True, "regather"])
def test_sequence_parallel_within_cp(run_ranks, name, strategy, sp):
    """tp 2 × cp 2: each cp rank's s/cp tokens split again over tp between the regions."""
    results = run_ranks(one_step, 4, name, 2, 2, strategy, sequence_parallel=sp)
    assert_exact(results)
    cfg = preset(name)
    fwd, bwd = results[0][3], results[0][4]
    tokens = B * (S // 2) * cfg.d_model  # a region's gathered input: this cp rank's tokens
    sp_fwd = [(r.kind, r.elements) for r in fwd.records if not r.label.startswith("cp.")]
    assert sp_fwd and all(n == tokens for _, n in sp_fwd), sp_fwd
    assert len(sp_fwd) == 4 * 2 + 1  # 2 regions in and out per layer, the final gather
    assert {kind for kind, _ in sp_fwd} == {"all_gather", "reduce_scatter"}  # no all-reduce
    if strategy == "ring":  # cp − 1 exchanges of this rank's K and V (its tp share of the heads)
        kv = 2 * B * (S // 2) * cfg.n_kv_heads * cfg.head_dim // 2
        assert _records(fwd, "cp.ring") == [("send_recv", kv)] * 2


@pytest.mark.parametrize("strategy", ["ring", "allgather_kv"])
@pytest.mark.parametrize("recompute,tp", [("selective", 1), ("full", 1), ("selective", 2)])
def test_recompute_replays_the_cp_exchange_in_backward(run_ranks, strategy, recompute, tp):
    """Selective (the attention core) and full (each layer) recompute under cp 2: backward
    replays each layer's forward K/V exchange once, labelled as forward traffic, then runs its
    own; nothing else changes."""
    results = run_ranks(one_step, 2 * tp, "llama-tiny", tp, 2, strategy, recompute=recompute)
    assert_exact(results)
    plain = run_ranks(one_step, 2 * tp, "llama-tiny", tp, 2, strategy)[0]
    fwd, bwd = results[0][3], results[0][4]
    forward_kv = _records(plain[3], f"cp.{strategy}.fwd")
    assert _records(fwd, f"cp.{strategy}") == forward_kv  # 2 layers' worth
    assert _records(bwd, f"cp.{strategy}.fwd") == forward_kv  # the replay, once
    assert _records(bwd, f"cp.{strategy}.bwd") == _records(plain[4], f"cp.{strategy}.bwd")


def zero_steps(dp, cp, stage, steps=3):
    """``(losses, dense losses, worst weight error, last step's ledger, optimizer state bytes)``
    of ``steps`` SGD-with-momentum steps with ZeRO ``stage`` over ``dp × cp``."""
    from ops_transformer import shard_parameters, zero_optimizer

    torch.set_num_threads(1)
    ctx = init_parallel(dp=dp, cp=cp)
    torch.manual_seed(0)
    dense = GPT(preset("llama-tiny", n_layers=2, max_seq_len=32))
    model = parallelize(copy.deepcopy(dense), ctx, context_parallel="ring")
    kw = dict(lr=0.1, momentum=0.9)
    if stage == 3:
        shard_parameters(model, ctx)
        opt = torch.optim.SGD(model.parameters(), **kw)
    else:
        opt = zero_optimizer(model, ctx, torch.optim.SGD, stage=stage, **kw)
    ref_opt = torch.optim.SGD(dense.parameters(), **kw)
    g = torch.Generator().manual_seed(1)
    losses, ref_losses = [], []
    for _ in range(steps):
        batch = torch.randint(0, 256, (B * dp, S + 1), generator=g)
        _, ref = dense(batch[:, :-1], batch[:, 1:])
        ref.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        rows = batch.chunk(dp)[ctx.dp_rank]  # each dp rank its rows, every cp rank all of them
        with CommLedger() as ledger:
            _, loss = model(rows[:, :-1], rows[:, 1:])
            loss.backward()
            opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        ref_losses.append(float(ref.detach()))
    weights = gather_full_state_dict(model, ctx)
    worst = max((rel_err(weights[k], v), k) for k, v in dense.state_dict().items())
    local = [getattr(v, "_local_tensor", v) for s in opt.state.values() for v in s.values()]
    return losses, ref_losses, worst, ledger, sum(v.numel() for v in local if torch.is_tensor(v))


ZERO_TRAFFIC = {1: ("dp_grads", "zero_params"), 2: ("zero_grads", "zero_params"),
                3: ("fsdp_grads", "fsdp_params")}


@pytest.mark.parametrize("dp,stage", [(1, 1), (1, 2), (1, 3), (2, 2)])
def test_zero_shards_over_dp_times_cp(run_ranks, dp, stage):
    """ZeRO 1/2/3 under cp 2: the optimizer state (and stage 2's gradients, stage 3's
    parameters) sharded over dp × cp — the cp ranks hold the same parameters — and three steps
    equal to one process; the ZeRO collectives run over dp × cp ranks."""
    results = run_ranks(zero_steps, 2 * dp, dp, 2, stage)
    n_params = sum(v.numel() for v in GPT(preset("llama-tiny", n_layers=2,
                                                 max_seq_len=32)).parameters())
    for rank, (losses, ref, worst, ledger, state) in enumerate(results):
        if dp == 1:  # with dp 2 each rank's loss is its rows'; the weights show the rest
            assert all(abs(a - b) <= 1e-6 * b for a, b in zip(losses, ref)), (losses, ref)
        assert worst[0] <= 1e-5, f"rank {rank}: {worst}"
        assert state <= n_params / (2 * dp) + 64 * 2 * dp, (state, n_params)  # 1/(dp·cp) + pad
        labels = {r.label: r.group_size for r in ledger.records
                  if r.label.startswith(ZERO_TRAFFIC[stage])}
        assert labels == dict.fromkeys(ZERO_TRAFFIC[stage], 2 * dp), labels


def lora_steps(tp, cp, steps=3, **lora):
    """``(losses, dense losses, worst error of the adapters after the steps)``: LoRA added by
    ``parallelize(lora=...)`` at ``tp × cp`` and on one process (``ParallelContext.single``)."""
    from ops_transformer import ParallelContext

    torch.set_num_threads(1)
    ctx = init_parallel(tp=tp, cp=cp)
    torch.manual_seed(0)
    dense = GPT(preset("llama-tiny", n_layers=2, max_seq_len=32))
    lora = {"rank": 4, **lora}
    model = parallelize(copy.deepcopy(dense), ctx, context_parallel="ring", lora=lora)
    ref_model = parallelize(dense, ParallelContext.single(), lora=lora)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ref_opt = torch.optim.SGD([p for p in ref_model.parameters() if p.requires_grad], lr=0.5)
    g = torch.Generator().manual_seed(1)
    losses, ref_losses = [], []
    for _ in range(steps):
        batch = torch.randint(0, 256, (B, S + 1), generator=g)
        for m, o, out in ((model, opt, losses), (ref_model, ref_opt, ref_losses)):
            with CommLedger() as step_ledger:
                _, loss = m(batch[:, :-1], batch[:, 1:])
                loss.backward()
            ledger = step_ledger if m is model else ledger
            o.step()
            o.zero_grad()
            out.append(float(loss.detach()))
    weights = gather_full_state_dict(model, ctx)
    worst = max((rel_err(weights[k], v), k) for k, v in ref_model.state_dict().items()
                if "lora" in k)
    adapters = [p for p in model.parameters() if p.requires_grad]
    trainable = sum(p.numel() for p in adapters) + len(adapters)  # + one presence flag each
    averaged = [(r.group_size, r.elements) for r in ledger.records if r.label == "dp_grads"]
    return losses, ref_losses, worst, averaged, trainable


@pytest.mark.parametrize("tp", [1, 2])
def test_lora_under_cp_equals_one_process(run_ranks, tp):
    """LoRA (``parallelize(lora=)``) at cp 2 and tp 2 × cp 2: three steps of the adapters equal
    to one process; only the adapters' gradients are averaged over the cp ranks."""
    for losses, ref, worst, averaged, trainable in run_ranks(lora_steps, 2 * tp, tp, 2):
        assert all(abs(a - b) <= 1e-6 * b for a, b in zip(losses, ref)), (losses, ref)
        assert worst[0] <= 1e-5, worst
        assert averaged == [(2, trainable)], (averaged, trainable)  # one bucket, over cp


def _hf_dropout_refused():
    import hf_tiny

    ctx = init_parallel(cp=2)
    model = hf_tiny.build("llama").float()
    model.config.attention_dropout = 0.1
    with pytest.raises(ValueError, match=r"\(cp=2\) does not compose with a Hugging Face "
                                         r"model's attention dropout > 0 yet: Hugging Face"):
        parallelize(model, ctx)
    return True


@pytest.mark.slow  # transformers' import in each rank (~15 s)
def test_hf_attention_dropout_under_cp_is_one_line(run_ranks):
    """A Hugging Face model keeps its own attention dropout, whose masks no rank can split: one
    line (the reference GPT's dropout and LoRA dropout run under cp:
    tests/parallelize/test_context_parallel_dropout.py)."""
    assert all(run_ranks(_hf_dropout_refused, 2))
