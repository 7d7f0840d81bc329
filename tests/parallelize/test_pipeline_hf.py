"""Pipeline parallelism of Hugging Face decoders (``ot.pipeline`` on GPT-2, Llama, Mistral,
Qwen2 built from tiny configs): per-step losses and every gradient equal the unsplit model within
1e-6, with the dense parameter names; tied embeddings (GPT-2, ``tie_word_embeddings``) summed
between the end stages; pp 2 × tp 2 with the vocabulary split and the vocab-parallel loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_rel, local_part
from ops_transformer import init_parallel, parallelize, pipeline
from ops_transformer.parallel.sharding import shard_spec

tr = pytest.importorskip("transformers")
tr.logging.set_verbosity_error()
RTOL = 1e-6  # fp32: the stages run the dense ops on the same rows, summed in another order
VOCAB, B, T = 96, 4, 8
CAUSAL = {"llama": (tr.LlamaConfig, tr.LlamaForCausalLM),
          "mistral": (tr.MistralConfig, tr.MistralForCausalLM),
          "qwen2": (tr.Qwen2Config, tr.Qwen2ForCausalLM)}
_ = (tr.GPT2LMHeadModel, tr.GPT2Config)  # resolved in the parent: ranks inherit the modules


def make(family: str, tied: bool = False):
    torch.manual_seed(0)
    if family == "gpt2":  # tied embeddings; no dropout, to compare with the dense model
        return tr.GPT2LMHeadModel(tr.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32,
                                                n_layer=4, n_head=4, resid_pdrop=0.0,
                                                embd_pdrop=0.0, attn_pdrop=0.0))
    config_cls, model_cls = CAUSAL[family]
    return model_cls(config_cls(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=32, vocab_size=VOCAB,
                                tie_word_embeddings=tied))


def _data(steps):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (B, T), generator=g),
             torch.randint(0, VOCAB, (B, T), generator=g)) for _ in range(steps)]


def _dense(family, tied, steps, lr=0.5):
    model = make(family, tied)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], None
    for x, y in _data(steps):
        opt.zero_grad()
        logits = model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        losses.append(loss.item())
        opt.step()
    return losses, grads


def _piped(family, tied, schedule, v, m, tp, steps, dense_grads, lr=0.5, **options):
    torch.set_num_threads(1)
    ctx = init_parallel(pp=2, tp=tp)
    model = make(family, tied)
    if tp > 1:
        model = parallelize(model, ctx, **options)
    pipe = pipeline(model, ctx, schedule, microbatches=m, stages_per_rank=v)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], None
    for x, y in _data(steps):
        opt.zero_grad()
        loss = pipe.step(x, y)
        if grads is None:
            grads = {n: (p.grad.clone(), _local(p, dense_grads[_dense_name(n, pipe)]))
                     for n, p in model.named_parameters()}
        losses.append(None if loss is None else loss.item())
        opt.step()
    tied_copy = [(n, p.pipeline_tied_copy) for n, p in model.named_parameters()
                 if hasattr(p, "pipeline_tied_copy")]
    return ctx.pp_rank, losses, grads, {n for n, _ in model.named_parameters()}, tied_copy


def _local(param, dense):
    """This rank's part of ``dense``; GPT-2's ``Conv1D`` weights are held as ``nn.Linear`` ones
    (the transpose) under tp."""
    spec = shard_spec(param)
    return local_part(param, dense.t() if spec is not None and spec.transposed else dense)


def _dense_name(name, pipe):
    param = pipe.model.get_parameter(name)
    return getattr(param, "pipeline_tied_copy", name)


def _check(results, dense_losses, dense_grads):
    seen = set()
    for pp_rank, losses, grads, names, _ in results:
        seen |= names
        if losses[0] is not None:
            for got, want in zip(losses, dense_losses):
                assert abs(got - want) <= RTOL * abs(want), (got, want)
        for name, (grad, want) in grads.items():
            assert_rel(grad, want, RTOL, f"pp rank {pp_rank}: {name}")
    return seen


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gpt2"])
def test_pp2_hf_family_equals_dense(run_ranks, family):
    dense_losses, dense_grads = _dense(family, False, 2)
    results = run_ranks(_piped, 2, family, False, "1f1b", 1, 2, 1, 2, dense_grads)
    seen = _check(results, dense_losses, dense_grads)
    tied = [t for r in results for t in r[4]]
    if family == "gpt2":  # tied: the head's copy on the last stage, written as the embedding
        assert tied == [("lm_head.weight", "transformer.wte.weight")]
        seen.discard("lm_head.weight")
    else:
        assert tied == []
    assert seen == set(dense_grads)  # dense names, every parameter on some stage
    assert any(n.startswith("model.layers.3.") or n.startswith("transformer.h.3.")
               for n in results[1][3]) and not any(".layers.0." in n or ".h.0." in n
                                                   for n in results[1][3])


def test_pp2_llama_tied_interleaved_equals_dense(run_ranks):
    dense_losses, dense_grads = _dense("llama", True, 2)
    results = run_ranks(_piped, 2, "llama", True, "interleaved", 2, 4, 1, 2, dense_grads)
    _check(results, dense_losses, dense_grads)
    assert [t for r in results for t in r[4]] == [("lm_head.weight",
                                                   "model.embed_tokens.weight")]


@pytest.mark.slow
@pytest.mark.parametrize("family,options", [
    ("llama", {"loss_parallel": True}), ("gpt2", {}),
    ("llama", {"sequence_parallel": True}), ("gpt2", {"sequence_parallel": True})])
def test_pp2_tp2_hf_equals_dense(run_ranks, family, options):
    """pp 2 × tp 2: the vocabulary split (with the vocab-parallel loss), GPT-2's Conv1D weights,
    sequence parallelism (each boundary transfer (b/m, s/tp, h))."""
    dense_losses, dense_grads = _dense(family, False, 3)
    results = run_ranks(_piped, 4, family, False, "1f1b", 1, 2, 2, 3, dense_grads,
                        vocab="parallel", **options)
    _check(results, dense_losses, dense_grads)


def test_pipeline_refuses_other_hf_models():
    with pytest.raises(ValueError, match="families gpt2, llama"):
        pipeline(tr.BertModel(tr.BertConfig(hidden_size=32, num_hidden_layers=2,
                                            num_attention_heads=4, intermediate_size=64)),
                 object())


def _positions():
    """Two packed documents in every row: positions restart at token 5."""
    pos = torch.arange(T).repeat(B, 1)
    pos[:, 5:] -= 5
    return pos


def _dense_packed(family):
    model = make(family)
    logits = model(input_ids=_data(1)[0][0], position_ids=_positions(), use_cache=False).logits
    loss = F.cross_entropy(logits.flatten(0, 1), _data(1)[0][1].flatten())
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _piped_packed(family, dense_grads):
    torch.set_num_threads(1)
    ctx = init_parallel(pp=2)
    model = make(family)
    pipe = pipeline(model, ctx, "1f1b", microbatches=2)
    (x, y), = _data(1)
    loss = pipe.step(x, y, position_ids=_positions())
    grads = {n: (p.grad.clone(), dense_grads[_dense_name(n, pipe)])
             for n, p in model.named_parameters()}
    return None if loss is None else loss.item(), grads


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_pp2_packed_documents_equal_dense(run_ranks, family):
    """``position_ids`` (``train --pack docs``) reach every stage: attention stays inside each
    packed document, as in the model's own forward."""
    want, dense_grads = _dense_packed(family)
    assert abs(want - _dense(family, False, 1)[0][0]) > 1e-4  # the documents do matter
    results = run_ranks(_piped_packed, 2, family, dense_grads)
    assert results[0][0] is None and abs(results[1][0] - want) <= RTOL * want
    for _, grads in results:
        for name, (grad, ref) in grads.items():
            assert_rel(grad, ref, RTOL, name)
