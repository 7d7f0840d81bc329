"""``train --model DIR``: what fine-tuning a Hugging Face causal LM adds to the training loop of
:mod:`ops_transformer.train` — the model (:func:`~ops_transformer.from_pretrained`, fp32 master
weights, every rank reading only its shards), its data (:mod:`ops_transformer.corpus`), its loss;
and ``--lora-rank`` (with ``--model`` or a preset): LoRA adapters (:func:`~ops_transformer.lora`)
with every other weight frozen, and what they cost per rank.

Everything else is the loop ``train`` runs for the reference GPT: precision, clipping, ZeRO,
checkpoints and resumption, restarts, TensorBoard. The loss is the mean next-token cross-entropy
of the global batch, computed from the model's logits; with the vocabulary split over TP the
logits stay sharded (``loss_parallel``) and the loss is the vocab-parallel cross-entropy, so the
full ``tokens × vocabulary`` logits are never gathered.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from ..comm import collectives as C
from . import preflight
from .corpus import packed_corpus
from ..models.documents import document_positions, document_targets
from ..layers.loss import vocab_parallel_cross_entropy
from ..loading import from_pretrained
from ..models.gpt import GPT
from ..models.hf import own_class
from ..parallelize.hf_plans import hf_plan
from ..parallelize.lora import check_lora_args, check_rank, lora, resolve_targets
from ..parallelize.moe_plan import check_expert_parallel, n_experts_of
from ..parallelize.sequence_plan import sequence_parallel_plan


def meta_model(model_dir: str):
    """The model of ``model_dir`` on the ``meta`` device (no weights read)."""
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
    model = meta_model(cfg.model)
    plan = hf_plan(model, tp, loss_parallel=True)
    if ep > 1:
        check_expert_parallel(model, plan, _Degrees(tp, ep))
    if cfg.sequence_parallel and n_experts_of(model):
        raise ValueError(f"--sequence-parallel is not supported for {type(model).__name__}: its "
                         f"expert layers have no sequence-parallel form")
    if cfg.sequence_parallel:
        sequence_parallel_plan(plan, model)
    check_positions(cfg.seq, model.config, cfg.model)
    return model.config


def check_positions(seq: int, config, model_dir: str) -> None:
    """``--seq`` within the positions the model was built for (``max_position_embeddings``, or
    GPT-2's ``n_positions``): beyond them a learned table has no row and rotary positions were
    never trained."""
    preflight.check_positions(seq, preflight.position_limit(config.get_text_config()), model_dir)


def check_data(cfg, config, say=None) -> None:
    """``cfg.data`` tokenises into at least one sequence of ``cfg.seq`` (``say``: where the
    tokenizer's note and progress bar go, ``None`` for silence); the tokens stay cached."""
    packed_corpus(cfg.data, cfg.model, cfg.seq, config.get_text_config().vocab_size, say=say)


def build(cfg, ctx, policy):
    """``(model, data)`` on this rank: the parallel model in training mode, fp32 parameters (the
    master weights ``--precision`` autocasts from), and the packed corpus."""
    options = cfg.parallel_options(grad_reduce_dtype=policy.grad_reduce_dtype, loss_parallel=True)
    model = from_pretrained(cfg.model, ctx, dtype=torch.float32, dropout=cfg.dropout,
                            options=options)
    model.config.use_cache = False  # training: no key/value cache
    data = packed_corpus(cfg.data, cfg.model, cfg.seq,
                         model.config.get_text_config().vocab_size)
    return model.train(), data


def causal_lm_loss(model, x: torch.Tensor, y: torch.Tensor, ctx,
                   document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The mean cross-entropy of the next tokens ``y`` after ``x`` (this rank's rows). With
    ``document_ids`` (``--pack docs``) attention stays inside each packed document (positions
    restart in each, which ``transformers`` turns into its packed-sequence mask) and a document's
    last token predicts nothing. A context-parallel model (``--cp``) computes the loss of its
    whole sequences itself."""
    if getattr(model, "sequence_split", None) is not None:  # cp > 1
        return model(input_ids=x, shift_labels=y, document_ids=document_ids).loss
    kwargs = {}
    if document_ids is not None:
        kwargs["position_ids"] = document_positions(document_ids)
        y = document_targets(y, document_ids)
    logits = model(input_ids=x, use_cache=False, **kwargs).logits.float()  # (b, s, V[_pad/tp])
    vocab = model.config.get_text_config().vocab_size
    if ctx.tp_size > 1 and model.parallel_plan.vocab == "parallel":  # loss_parallel: sharded
        return vocab_parallel_cross_entropy(logits, y, ctx, vocab_size=vocab)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def micro_batch_weights(cfg, data, ctx, xs, ys) -> list[float] | None:
    """``--pack docs``: the weight of each micro-batch's mean loss so that the step's gradient is
    that of the mean over every target of the global batch. A document's last token has no
    target, so rows hold different numbers of them; weighting by ``count · readers / total``
    (``total`` all-reduced over the ``dp × ep`` ranks that read different rows, which average
    their gradients) keeps the loss and gradients those of one process. ``None``: every target
    counts (``--pack naive``), the plain ``1 / grad_accum``."""
    if cfg.pack != "docs":
        return None
    counts = torch.stack([(document_targets(y, data.document_ids(x)) != -100).sum()
                          for x, y in zip(xs, ys)]).double()
    total = counts.sum().clone()
    C.all_reduce(total, ctx.dp_ep_group if ctx.dp_ep_size > 1 else None, label="pack.tokens")
    return (counts * ctx.dp_ep_size / total).tolist()


def pipeline_pack(cfg, data, ctx, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """``--pp`` with ``--pack docs``: the targets without a document's last token, and for
    ``Pipeline.step`` the documents' positions (every stage's masks keep attention inside each
    document) and each target's weight, ``readers / targets of the global batch`` (the
    ``dp × ep`` readers average their gradients), so the step's gradient is the mean over every
    target as on one process. ``--pack naive``: ``y`` and nothing more."""
    if cfg.pack != "docs":
        return y, {}
    document_ids = data.document_ids(x)
    y = document_targets(y, document_ids)
    total = (y != -100).sum().double()
    C.all_reduce(total, ctx.dp_ep_group if ctx.dp_ep_size > 1 else None, label="pack.tokens")
    return y, {"position_ids": document_positions(document_ids),
               "target_weight": ctx.dp_ep_size / max(total.item(), 1.0)}


def pack_document_ids(cfg, data, x: torch.Tensor) -> torch.Tensor | None:
    """``--pack docs``: the document of each token of ``x`` (from the data's EOS tokens);
    ``--pack naive``: ``None`` (attention runs across the packed documents)."""
    return data.document_ids(x) if cfg.pack == "docs" else None


def describe(model) -> dict:
    """What ``train``'s metrics say about the model: the dense parameter count, its config."""
    with torch.device("meta"):
        dense = own_class(model)(model.config)
    params = sum(p.numel() for p in dict.fromkeys(dense.parameters()))
    return {"params": params, "model": json.loads(model.config.to_json_string()),
            "model_class": own_class(model).__name__}


def local_param_bytes(model) -> int:
    """The bytes of this rank's parameters (each tensor once)."""
    return sum(p.numel() * p.element_size() for p in dict.fromkeys(model.parameters()))


def check_lora(cfg, model_cfg) -> None:
    """The ``--lora-*`` flags: a rank to go with the others; rank, alpha, dropout and targets
    valid for the model (built on ``meta`` from ``model_cfg``, or ``cfg.model``'s config)."""
    if cfg.lora_rank is None:
        given = [flag for flag, value in (("--lora-alpha", cfg.lora_alpha),
                                          ("--lora-targets", cfg.lora_targets),
                                          ("--lora-dropout", cfg.lora_dropout)) if value]
        if given:
            verb = "configure" if len(given) > 1 else "configures"
            raise ValueError(f"{' and '.join(given)} {verb} LoRA adapters: add --lora-rank R")
        return
    check_lora_args(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout)
    if cfg.model:
        model = meta_model(cfg.model)
    else:
        with torch.device("meta"):
            model = GPT(model_cfg)
    check_rank(model, resolve_targets(model, cfg.lora_targets), cfg.lora_rank)


def with_lora(cfg, ctx, model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with LoRA adapters when ``cfg.lora_rank`` is set (before the optimizer is built:
    only the adapters then get gradients and optimizer state). Their base, recorded in the
    checkpoints: the model directory, or the preset and the seed that initialised it."""
    if cfg.lora_rank is None:
        return model
    base = ({"model_dir": str(Path(cfg.model).resolve())} if cfg.model
            else {"preset": cfg.preset, "seed": cfg.seed})
    return lora(model, ctx, rank=cfg.lora_rank, alpha=cfg.lora_alpha, targets=cfg.lora_targets,
                dropout=cfg.lora_dropout, seed=cfg.seed, base=base)


def lora_report(model: torch.nn.Module, opt, measured: dict | None) -> dict | None:
    """What a LoRA run trains on this rank: its adapters' configuration, the parameters that
    train and those that stay frozen, the bytes of the optimizer's state (the adapters'), and
    next to the measured model state (``measured``: parameters, gradients, optimizer state) what
    full fine-tuning would hold with AdamW (every parameter's gradient and two moments)."""
    config = model.parallel_state.lora
    if config is None:
        return None
    params = list(dict.fromkeys(model.parameters()))
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    return {**config.to_dict(), "modules": len(config.targets),
            "trainable_params_per_rank": sum(p.numel() for p in params if p.requires_grad),
            "frozen_params_per_rank": sum(p.numel() for p in params if not p.requires_grad),
            "optimizer_state_bytes_per_rank": sum(t.numel() * t.element_size() for t in state),
            "state_bytes_per_rank": measured,
            "full_finetune_state_bytes_per_rank": {"params": param_bytes, "grads": param_bytes,
                                                   "optimizer": 2 * param_bytes}}
