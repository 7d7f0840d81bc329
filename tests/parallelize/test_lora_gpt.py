"""ot.lora on the reference GPT: the same adapter at tp 1, 2, 4 and dp 2 × tp 2, trained to the
same adapter as PEFT on the dense model (5 AdamW steps, clipped), frozen weights with no gradient and no optimizer
state, the step's ledger against the base model's, and one-line errors for bad arguments."""

from __future__ import annotations

import os

import pytest
import torch

from helpers import assert_rel
from ops_transformer import (GPT, CommLedger, gather_full_state_dict, init_parallel, lora,
                             optimizer_step, parallelize)
from ops_transformer.models import preset

B, T, STEPS, RANK, ALPHA = 4, 16, 5, 4, 8.0
# RoPE, RMSNorm, SwiGLU (gate|up fused: per sub-block slices of B), GQA with 2 KV heads: split at
# tp 2, replicated over pairs of ranks at tp 4 (B of wk, wv summed over each pair).
CFG = preset("llama-tiny", vocab_size=64, max_seq_len=T)
LR, EPS, CLIP = 5e-3, 1e-3, 0.28  # eps: see tests/parallelize/test_gpt_parallel.py, _optimizer


def _batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, CFG.vocab_size, (B, T + 1), generator=g) for _ in range(STEPS + 1)]


def _adapters(model, ctx) -> dict[str, torch.Tensor]:
    return {k: v for k, v in gather_full_state_dict(model, ctx).items() if "lora_" in k}


def _grouped(ledger, tp_ranks):
    """``{part: {kind: calls/elements}}`` of the TP group's records: activations, grad_sums."""
    out = {}
    for r in ledger.records:
        part = ("grad_sums" if r.label == "grad_sums" else
                "activations" if r.group_ranks == tp_ranks else "other")
        entry = out.setdefault(part, {}).setdefault(r.kind, {"calls": 0, "elements": 0})
        entry["calls"] += 1
        entry["elements"] += r.elements
    return out


def _step_ledgers(model, ctx, batch, tp_ranks):
    with CommLedger() as fwd:
        loss = model(batch[:, :-1], batch[:, 1:])[1]
    with CommLedger() as bwd:
        loss.backward()
    model.zero_grad(set_to_none=True)
    return _grouped(fwd, tp_ranks), _grouped(bwd, tp_ranks)


def _train(tp):
    ctx = init_parallel(tp=tp)
    tp_ranks = tuple(range(ctx.rank - ctx.tp_rank, ctx.rank - ctx.tp_rank + tp))
    torch.manual_seed(0)
    base = parallelize(GPT(CFG), ctx, overlap="none", attention="heads", vocab="parallel")
    torch.manual_seed(0)
    model = lora(parallelize(GPT(CFG), ctx, overlap="none", attention="heads", vocab="parallel"), ctx,
                 rank=RANK, alpha=ALPHA)
    initial = _adapters(model, ctx)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, eps=EPS)
    batches = _batches()
    ledgers = {"base": _step_ledgers(base, ctx, batches[-1], tp_ranks),
               "lora": _step_ledgers(model, ctx, batches[-1], tp_ranks)}
    norms, rows = [], slice(ctx.dp_rank * B // ctx.dp_size, (ctx.dp_rank + 1) * B // ctx.dp_size)
    for batch in batches[:STEPS]:
        batch = batch[rows]  # this data-parallel rank's rows
        model(batch[:, :-1], batch[:, 1:])[1].backward()
        frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
        assert frozen and all(model.get_parameter(n).grad is None for n in frozen)
        norms.append(optimizer_step(model, opt, ctx, max_norm=CLIP).grad_norm)
        opt.zero_grad(set_to_none=True)
    assert len(opt.state) == len(trainable)  # optimizer state for the adapters only
    assert all(p.requires_grad == ("lora_" in n) for n, p in model.named_parameters())
    local = sum(p.numel() for p in trainable)
    return initial, _adapters(model, ctx), norms, ledgers, local, model.parallel_state.lora.targets


def _peft_reference(initial, targets):
    """PEFT on the dense model: the same initial adapters, the same 5 clipped AdamW steps."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = peft.get_peft_model(GPT(CFG), peft.LoraConfig(r=RANK, lora_alpha=ALPHA,
                                                          target_modules=list(targets)))
    named = dict(model.named_parameters())
    with torch.no_grad():
        for key, value in initial.items():
            module, role = key.rsplit(".lora_", 1)
            named[f"base_model.model.{module}.lora_{role[0]}.default.weight"].copy_(value)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, eps=EPS)
    norms = []
    for batch in _batches()[:STEPS]:
        model(batch[:, :-1], batch[:, 1:])[1].backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(trainable, CLIP)))
        opt.step()
        opt.zero_grad()
    return {k.replace("base_model.model.", "").replace(".default", ""): v.detach()
            for k, v in named.items() if "lora_" in k}, norms


@pytest.fixture(scope="module")
def runs(request):
    from conftest import _run_ranks

    runs = {tp: _run_ranks(_train, tp, tp)[0] for tp in (1, 2, 4)}
    runs["dp2xtp2"] = _run_ranks(_train, 4, 2)[0]
    return runs


def test_same_adapter_at_every_tp_and_as_peft(runs):
    initial, final, norms, _, _, targets = runs[1]
    assert len(targets) == 12  # wq, wk, wv, wo, w_in, w_out of both layers
    assert all(torch.count_nonzero(v) == 0 for k, v in initial.items() if "lora_B" in k)
    reference, ref_norms = _peft_reference(initial, targets)
    assert sorted(reference) == sorted(final)
    for tp in (1, 2, 4, "dp2xtp2"):
        tp_initial, tp_final, tp_norms, *_ = runs[tp]
        for key in initial:  # drawn from one generator in dense coordinates, then sliced
            assert torch.equal(tp_initial[key], initial[key]), (tp, key)
            assert_rel(tp_final[key], reference[key], what=f"tp={tp} {key}")
        for ours, theirs in zip(tp_norms, ref_norms):  # clipping saw the adapters only
            assert abs(ours - theirs) <= 1e-5 * theirs, (tp, tp_norms, ref_norms)
    assert any(n > CLIP for n in ref_norms) and any(n < CLIP for n in ref_norms), ref_norms


@pytest.mark.parametrize("tp", [2, 4])
def test_ledger_forward_equal_backward_adds_one_all_reduce(runs, tp):
    *_, ledgers, local, _ = runs[tp]
    (base_fwd, base_bwd), (lora_fwd, lora_bwd) = ledgers["base"], ledgers["lora"]
    assert lora_fwd == base_fwd
    # Activation gradients: the base model's, less the first layer's input-gradient all-reduce
    # (nothing below it trains, so autograd does not ask for it).
    activations = B * T * CFG.d_model
    expected = {"all_reduce": {"calls": base_bwd["activations"]["all_reduce"]["calls"] - 1,
                               "elements": base_bwd["activations"]["all_reduce"]["elements"]
                               - activations}}
    assert lora_bwd["activations"] == expected
    replicated = CFG.n_layers * (4 * RANK * CFG.d_model + 2 * CFG.d_model * RANK)  # A: wq, wk,
    sums = lora_bwd["grad_sums"]["all_reduce"]  # wv, w_in; B: wo, w_out
    kv_replicated = tp > CFG.n_kv_heads  # B of wk, wv summed over each pair of KV replicas
    base_sums = base_bwd.get("grad_sums", {}).get("all_reduce", {"calls": 0})
    assert sums["calls"] == 1 + kv_replicated == base_sums["calls"] + 1
    kv_elements = 2 * CFG.n_layers * CFG.n_kv_heads * CFG.head_dim * RANK // (tp // 2)
    assert sums["elements"] == replicated + (kv_elements if kv_replicated else 0) <= local


def _errors():
    ctx = init_parallel(tp=int(os.environ["WORLD_SIZE"]))
    torch.manual_seed(0)

    def fresh():
        return parallelize(GPT(CFG), ctx, overlap="none", attention="heads", vocab="replicated")

    cases = [
        (dict(rank=0), "rank must be a positive integer, got 0"),
        (dict(rank=-2), "rank must be a positive integer, got -2"),
        (dict(rank=65), "rank (65) exceeds the smaller dimension of layers.0.attn.wq"),
        (dict(rank=4, alpha=0), "alpha must be a positive number"),
        (dict(rank=4, dropout=1.0), "dropout must be in [0, 1)"),
        (dict(rank=4, targets=["*.q_proj"]), "target pattern '*.q_proj' matches no module"),
        (dict(rank=4, targets="wq"), "target 'wq' matches no module of GPT; did you mean '*.wq'?"),
        (dict(rank=4, targets=["tok_emb"]), "tok_emb (Embedding) is a layer type LoRA does "
                                            "not support"),
        (dict(rank=4, targets=["lm_head"]), "lm_head (LMHead) is a layer type LoRA does not"),
        (dict(rank=4, targets=["layers.*.norm1"]), "matches 2 module(s), none of a type LoRA "
                                                   "supports"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError) as err:
            lora(fresh(), ctx, **kwargs)
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    model = lora(fresh(), ctx, rank=4, targets=["layers.0.attn.wq", "*.w_out"])
    assert model.parallel_state.lora.targets == ("layers.0.attn.wq", "layers.0.mlp.w_out",
                                                 "layers.1.mlp.w_out")
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        lora(model, ctx, rank=4)
    with pytest.raises(ValueError, match="call ot.parallelize"):
        lora(GPT(CFG), ctx, rank=4)


def test_lora_errors(run_ranks):
    run_ranks(_errors, 2)


def _eval_mode_kept():
    ctx = init_parallel(tp=2)
    torch.manual_seed(0)
    model = lora(parallelize(GPT(CFG.with_(dropout=0.1)).eval(), ctx, overlap="none", attention="heads"), ctx,
                 rank=4, dropout=0.1)
    x = torch.randint(0, CFG.vocab_size, (1, 8))
    with torch.no_grad():  # no dropout anywhere: the same logits twice
        assert torch.equal(model(x)[0], model(x)[0])
    return [n for n, m in model.named_modules() if m.training]


def test_parallelize_and_lora_keep_eval_mode(run_ranks):
    """The parallel layers a plan builds, and the adapters, take the mode of the module they
    replace or adapt (they used to start in training mode, so the adapters' dropout ran in an
    ``eval()`` model)."""
    assert run_ranks(_eval_mode_kept, 2)[0] == []


def _sequence_parallel(mode, overlap="none"):
    ctx = init_parallel(tp=2)
    torch.manual_seed(0)
    model = lora(parallelize(GPT(CFG), ctx, overlap=overlap, chunks=2, attention="heads",
                             sequence_parallel=mode), ctx, rank=RANK)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B non-zero, so that every factor gets a gradient
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    batch = _batches()[0]
    loss = model(batch[:, :-1], batch[:, 1:])[1]
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_lora_under_sequence_parallelism_and_regather(run_ranks):
    """The adapters join the sequence-parallel layers too, the re-gathering column layers
    included (their local matmul is where the adapter adds its part)."""
    loss, grads = run_ranks(_sequence_parallel, 2, True)[0]
    loss_rg, grads_rg = run_ranks(_sequence_parallel, 2, "regather")[0]
    assert_rel(loss_rg, loss, what="loss")
    assert grads.keys() == grads_rg.keys() and len(grads) == 24
    for name in grads:
        assert_rel(grads_rg[name], grads[name], what=name)


def _every_overlap():
    """Loss and adapter gradients under each overlap mode, with and without SP (one launch)."""
    return {(sp, overlap): _sequence_parallel(sp, overlap)
            for sp in (False, True) for overlap in ("none", "chunked", "auto")}


def test_lora_under_every_overlap_mode(run_ranks):
    """Issue 33: ``ot.lora`` after the default ``overlap="auto"`` (the LoRA example of
    docs/finetuning.md) and after ``"chunked"``, with and without sequence parallelism: the
    adapters run inside the collective matmuls and every gradient is ``overlap="none"``'s."""
    runs = run_ranks(_every_overlap, 2)[0]
    for (sp, overlap), (loss, grads) in runs.items():
        ref_loss, ref_grads = runs[(sp, "none")]
        assert_rel(loss, ref_loss, what=f"loss sp={sp} overlap={overlap}")
        assert grads.keys() == ref_grads.keys() and len(grads) == 24
        for name in grads:
            assert_rel(grads[name], ref_grads[name], what=f"{name} sp={sp} overlap={overlap}")


def _default_overlap_matches_tp1():
    ctx = init_parallel(tp=int(os.environ["WORLD_SIZE"]))
    torch.manual_seed(0)
    model = lora(parallelize(GPT(CFG), ctx), ctx, rank=RANK)  # every default: overlap="auto"
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    losses = []
    for batch in _batches()[:3]:
        loss = model(batch[:, :-1], batch[:, 1:])[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses, _adapters(model, ctx)


def test_lora_after_default_parallelize_equals_tp1(run_ranks):
    """Issue 33, defect 1: ``ot.lora(ot.parallelize(model, ctx), ctx, rank=…)`` with the defaults
    used to raise (``overlap='auto'`` installed the fused classes); three SGD steps at tp 2 now
    equal tp 1."""
    losses1, adapters1 = run_ranks(_default_overlap_matches_tp1, 1)[0]
    losses2, adapters2 = run_ranks(_default_overlap_matches_tp1, 2)[0]
    assert_rel(torch.tensor(losses2), torch.tensor(losses1), what="losses")
    for name, value in adapters1.items():
        assert_rel(adapters2[name], value, what=name)


def _lora_as_an_option(inside):
    ctx = init_parallel(tp=2)
    torch.manual_seed(0)
    if inside:  # one ordered preparation: the reducers are built once, over the adapters
        model = parallelize(GPT(CFG), ctx, lora={"rank": RANK, "alpha": ALPHA})
    else:
        model = lora(parallelize(GPT(CFG), ctx), ctx, rank=RANK, alpha=ALPHA)
    dp_params = sum(p.numel() for r in model.parallel_state.reducers if r.name == "dp"
                    for b in r.buckets for p in b.params)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    rows = slice(ctx.dp_rank * B // ctx.dp_size, (ctx.dp_rank + 1) * B // ctx.dp_size)
    for batch in _batches()[:2]:
        model(batch[rows, :-1], batch[rows, 1:])[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return _adapters(model, ctx), model.parallel_state.lora, dp_params, trainable


def test_lora_as_a_parallelize_option_equals_ot_lora(run_ranks):
    """Issue 33: ``parallelize(..., lora={...})`` adds the adapters after the plan and before the
    gradient reducers, which it builds once over the adapters alone (dp 2 × tp 2); the same
    adapters as ``ot.lora`` afterwards."""
    inside = run_ranks(_lora_as_an_option, 4, True)[0]
    after = run_ranks(_lora_as_an_option, 4, False)[0]
    assert inside[1] == after[1] and inside[2] == inside[3] == after[2]
    for name, value in after[0].items():
        assert_rel(inside[0][name], value, what=name)
    from ops_transformer import ParallelOptions

    with pytest.raises(ValueError, match="lora: rank must be a positive integer, got 0"):
        ParallelOptions(lora={"rank": 0})
