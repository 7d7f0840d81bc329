"""Sequence parallelism and recompute on Hugging Face Llama (and GPT-2, Mistral, Qwen2): training
equals the unsharded model at tp 2 and 4 and dp 2 × tp 2; generation still works."""

from __future__ import annotations

import os

import pytest
import torch

from helpers import assert_rel
from ops_transformer import CommLedger, gather_full_state_dict, init_parallel, parallelize

tr = pytest.importorskip("transformers")
tr.logging.set_verbosity_error()
VOCAB = 1001
SEQ = 12  # divides by 2 and 4
FAMILIES = {"llama": (tr.LlamaConfig, tr.LlamaForCausalLM),
            "mistral": (tr.MistralConfig, tr.MistralForCausalLM),
            "qwen2": (tr.Qwen2Config, tr.Qwen2ForCausalLM)}
_ = (tr.GPT2LMHeadModel, tr.GPT2Config, tr.GenerationMixin)  # imported once, in the parent


def make(family: str):
    torch.manual_seed(0)
    if family == "gpt2":
        return tr.GPT2LMHeadModel(tr.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64,
                                                n_layer=2, n_head=4, resid_pdrop=0.0,
                                                embd_pdrop=0.0, attn_pdrop=0.0))
    config_cls, model_cls = FAMILIES[family]
    return model_cls(config_cls(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=64, vocab_size=VOCAB))


def _batch():
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # a padded sequence
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _train(family, tp, sp, recompute):
    ctx = init_parallel(tp=tp)
    model = make(family).train()
    if int(os.environ["WORLD_SIZE"]) > 1 or recompute != "none":
        model = parallelize(model, ctx, sequence_parallel=sp, recompute=recompute)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ids, mask, labels = _batch()
    losses = []
    for _ in range(3):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, gather_full_state_dict(model, ctx)


CASES = [  # family, processes, tp, recompute
    ("llama", 2, 2, "selective"),
    ("llama", 4, 4, "full"),
    ("llama", 2, 2, "none"),
    ("llama", 4, 4, "none"),
    ("llama", 2, 2, "full"),
    ("llama", 4, 4, "selective"),
    ("gpt2", 2, 2, "none"),
    ("gpt2", 4, 4, "full"),
    ("mistral", 4, 4, "selective"),
    ("qwen2", 2, 2, "full"),
]


@pytest.mark.parametrize("family,nprocs,tp,recompute", [
    c if i < 1 else pytest.param(*c, marks=pytest.mark.slow) for i, c in enumerate(CASES)])
def test_sequence_parallel_training_equals_unsharded(run_ranks, family, nprocs, tp, recompute):
    ref_losses, ref_state = run_ranks(_train, 1, family, 1, False, "none")[0]
    for losses, state in run_ranks(_train, nprocs, family, tp, True, recompute):
        assert_rel(torch.tensor(losses), torch.tensor(ref_losses), what="losses")
        for key, value in ref_state.items():
            assert_rel(state[key], value, what=key, floor=0.02)  # 0.02: the init scale


def _dp_train(family, recompute):
    """dp 2 × tp 2 against one process holding the dp-averaged loss of the same two halves."""
    ctx = init_parallel(tp=2)
    model = parallelize(make(family).train(), ctx, sequence_parallel=True, recompute=recompute)
    return _steps(model, ctx)


def _dp_reference(family):
    ctx = init_parallel(tp=1)
    return _steps(make(family).train(), ctx, halves=True)


def _steps(model, ctx, halves=False):
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ids, mask, labels = _batch()
    for _ in range(3):
        if halves:  # the two dp ranks' mean losses, averaged
            loss = sum(model(input_ids=ids[r], attention_mask=mask[r], labels=labels[r]).loss
                       for r in (slice(0, 2), slice(2, 4))) / 2
        else:
            r = slice(ctx.dp_rank * 2, ctx.dp_rank * 2 + 2)
            loss = model(input_ids=ids[r], attention_mask=mask[r], labels=labels[r]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return gather_full_state_dict(model, ctx)


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_dp2_tp2_sequence_parallel_equals_unsharded(run_ranks, recompute):
    reference = run_ranks(_dp_reference, 1, "llama")[0]
    for state in run_ranks(_dp_train, 4, "llama", recompute):
        for key, value in reference.items():
            assert_rel(state[key], value, what=key, floor=0.02)


def _ledger(family):
    ctx = init_parallel(tp=2)
    model = parallelize(make(family).train(), ctx, sequence_parallel=True)
    ids, mask, labels = _batch()
    with CommLedger() as ledger:
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    return [(r.kind, r.label) for r in ledger.records]


def test_llama_layers_communicate_by_gather_and_scatter(run_ranks):
    records = run_ranks(_ledger, 2, "llama")[0]
    kinds = [k for k, label in records]
    layers = 2
    assert kinds.count("reduce_scatter") == 2 * 2 * layers  # fwd + bwd, attention + MLP
    assert [r for r in records if r[0] == "all_reduce"] == [
        ("all_reduce", "reduce_from_tp_region.fwd"),  # the vocab-parallel embedding
        ("all_reduce", "column_linear.bwd"),  # the LM head's input gradient
        ("all_reduce", "grad_sums")]  # the norms: one coalesced all-reduce


def _generate(family):
    ctx = init_parallel(tp=int(os.environ["WORLD_SIZE"]))
    model = make(family).eval()
    if ctx.tp_size > 1:
        model = parallelize(model, ctx, sequence_parallel=True, recompute="selective")
    ids, mask, _ = _batch()
    with torch.no_grad():
        return model.generate(ids[:1, :5], attention_mask=mask[:1, :5], max_new_tokens=5,
                              do_sample=False, pad_token_id=0).tolist()


@pytest.mark.slow
def test_generation_is_unchanged(run_ranks):
    dense = run_ranks(_generate, 1, "llama")[0]
    assert run_ranks(_generate, 2, "llama") == [dense, dense]


def test_bert_says_it_has_no_sequence_parallel_form():
    from ops_transformer.parallelize.sequence_plan import sequence_parallel_layout

    model = tr.BertModel(tr.BertConfig(hidden_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, intermediate_size=64))
    with pytest.raises(ValueError, match="sequence_parallel=True supports"):
        sequence_parallel_layout(model)
