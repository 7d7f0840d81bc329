"""``train --model DIR``: what fine-tuning a Hugging Face causal LM adds to the training loop of
:mod:`ops_transformer.train` — the model (:func:`~ops_transformer.from_pretrained`, fp32 master
weights, every rank reading only its shards), its data (:mod:`ops_transformer.corpus`), its loss.

Everything else is the loop ``train`` runs for the reference GPT: precision, clipping, ZeRO,
checkpoints and resumption, restarts, TensorBoard. The loss is the mean next-token cross-entropy
of the global batch, computed from the model's logits; with the vocabulary split over TP the
logits stay sharded (``loss_parallel``) and the loss is the vocab-parallel cross-entropy, so the
full ``tokens × vocabulary`` logits are never gathered.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from .corpus import packed_corpus
from .layers.loss import vocab_parallel_cross_entropy
from .loading import from_pretrained
from .parallelize.hf_plans import hf_plan
from .parallelize.moe_plan import check_expert_parallel, n_experts_of
from .parallelize.sequence_plan import sequence_parallel_plan


def _meta_model(model_dir: str):
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


class _Degrees:
    """The degrees of a layout, where a check needs a context but no process group."""

    def __init__(self, tp: int, ep: int):
        self.tp_size, self.ep_size = tp, ep


def check_model(cfg, tp: int, ep: int):
    """Before any rank starts: ``cfg.model`` splits over ``tp`` (× ``ep``) with the chosen
    options — its plan is built on a ``meta`` copy. Returns the model's config."""
    if cfg.attention not in ("auto", "heads"):
        raise ValueError(f"--attention {cfg.attention} is for the reference GPT; a Hugging Face "
                         f"model runs head-parallel attention (heads)")
    model = _meta_model(cfg.model)
    plan = hf_plan(model, tp, loss_parallel=True)
    if ep > 1:
        check_expert_parallel(model, plan, _Degrees(tp, ep))
    if cfg.sequence_parallel and n_experts_of(model):
        raise ValueError(f"--sequence-parallel is not supported for {type(model).__name__}: its "
                         f"expert layers have no sequence-parallel form")
    if cfg.sequence_parallel:
        sequence_parallel_plan(plan, model)
    return model.config


def check_data(cfg, config, say=None) -> None:
    """``cfg.data`` tokenises into at least one sequence of ``cfg.seq`` (``say``: where the
    tokenizer's note and progress bar go, ``None`` for silence); the tokens stay cached."""
    packed_corpus(cfg.data, cfg.model, cfg.seq, config.get_text_config().vocab_size, say=say)


def build(cfg, ctx, policy):
    """``(model, data)`` on this rank: the parallel model in training mode, fp32 parameters (the
    master weights ``--precision`` autocasts from), and the packed corpus."""
    options = cfg.parallel_options(grad_reduce_dtype=policy.grad_reduce_dtype, loss_parallel=True)
    model = from_pretrained(cfg.model, ctx, dtype=torch.float32, options=options)
    model.config.use_cache = False  # training: no key/value cache
    data = packed_corpus(cfg.data, cfg.model, cfg.seq,
                         model.config.get_text_config().vocab_size)
    return model.train(), data


def causal_lm_loss(model, x: torch.Tensor, y: torch.Tensor, ctx) -> torch.Tensor:
    """The mean cross-entropy of the next tokens ``y`` after ``x`` (this rank's rows)."""
    logits = model(input_ids=x, use_cache=False).logits.float()  # (b, s, V) or (b, s, V_pad/tp)
    vocab = model.config.get_text_config().vocab_size
    if ctx.tp_size > 1 and model.parallel_plan.vocab == "parallel":  # loss_parallel: sharded
        return vocab_parallel_cross_entropy(logits, y, ctx, vocab_size=vocab)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def describe(model) -> dict:
    """What ``train``'s metrics say about the model: the dense parameter count, its config."""
    with torch.device("meta"):
        dense = type(model)(model.config)
    params = sum(p.numel() for p in dict.fromkeys(dense.parameters()))
    return {"params": params, "model": json.loads(model.config.to_json_string()),
            "model_class": type(model).__name__}


def local_param_bytes(model) -> int:
    """The bytes of this rank's parameters (each tensor once)."""
    return sum(p.numel() * p.element_size() for p in dict.fromkeys(model.parameters()))
