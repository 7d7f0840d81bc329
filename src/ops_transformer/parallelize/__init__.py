"""``parallelize(model, ctx, plan="auto")``: tensor parallelism applied from outside, by a plan."""

from __future__ import annotations

import dataclasses
import itertools
import logging

import torch
from torch import nn

from ..layers.loss import vocab_parallel_cross_entropy
from ..layers.moe_stats import use_global_statistics
from ..memory.apply import apply_memory_options
from ..models.gpt import GPT
from ..models.hf import is_hf
from ..parallel.state import ParallelState, no_sync
from ..planner.search import chosen_layout, is_planner_output
from ..layers.fp8_linear import convert_to_fp8
from .compile import apply_compile, transformer_blocks
from .context_plan import apply_context_parallel, check_context_parallel
from .data_parallel import prepare_data_parallel
from .dropout import apply_dropout
from .gpt_plan import gpt_plan
from .hf_plans import FAMILIES, hf_plan
from .lora import add_lora
from .moe_plan import check_expert_parallel
from .options import ParallelOptions
from .overlap_plan import overlap_plan
from .plan import Plan, apply_plan
from .reducers import gradient_reducers
from .sequence_plan import check_partial_marked, sequence_parallel_plan

log = logging.getLogger("ops_transformer")
SUPPORTED = ("ops_transformer.models.GPT",) + tuple(f"Hugging Face {f}" for f in FAMILIES)


def resolve_plan(model: nn.Module, ctx, plan="auto", attention: str = "auto",
                 loss_parallel: bool = False, vocab: str = "auto", tp_plan=None) -> Plan:
    """The :class:`Plan` that ``parallelize`` applies: ``plan`` itself, its dict, or — for
    ``"auto"`` or a planner result (:func:`~ops_transformer.planner.search.chosen_layout`, whose
    degrees must be this job's) — the model's own plan (:func:`gpt_plan`, :func:`hf_plan`)."""
    if tp_plan is not None and not (plan == "auto" and is_hf(model)):
        raise ValueError("tp_plan (Hugging Face style names) applies to a Hugging Face model with "
                         "plan='auto'")
    if isinstance(plan, Plan):
        return plan
    if is_planner_output(plan):  # a planner result, or one of its rows
        layout = chosen_layout(plan)
        wanted = {"dp": layout["dp"], "ep": layout["ep"], "tp": layout["tp"]}
        actual = {"dp": ctx.dp_size, "ep": ctx.ep_size, "tp": ctx.tp_size}
        if wanted != actual:
            axes = [a for a in wanted if a != "ep" or max(wanted["ep"], actual["ep"]) > 1]

            def show(degrees):
                return " × ".join(f"{a}={degrees[a]}" for a in axes)

            raise ValueError(f"the plan is for {show(wanted)}, but this job runs {show(actual)}")
        attention, plan = layout["attention"], "auto"
    elif isinstance(plan, dict):
        return Plan.from_dict(plan)
    if plan != "auto":
        raise ValueError(f"plan must be 'auto', a Plan or a dict, got {plan!r}")
    if isinstance(model, GPT):
        return gpt_plan(model.cfg, ctx.tp_size, attention, vocab=vocab,
                        profile=getattr(ctx, "profile", None))  # agreed by every rank
    if is_hf(model):
        if attention not in ("auto", "heads"):
            raise ValueError(f"Hugging Face models support attention='heads' (or 'auto'), got "
                             f"{attention!r}")
        return hf_plan(model, ctx.tp_size, loss_parallel, vocab=vocab, tp_plan=tp_plan,
                       profile=getattr(ctx, "profile", None))  # agreed by every rank
    raise ValueError(f"no automatic plan for {type(model).__name__}; supported models: "
                     f"{', '.join(SUPPORTED)} (or pass plan= a Plan / dict)")


def parallelize(model: nn.Module, ctx, plan="auto", options: ParallelOptions | None = None, *,
                materialize=None, **option_kwargs) -> nn.Module:
    """Apply tensor (and expert) parallelism over ``ctx`` to ``model`` by a plan, with the
    gradient reductions data parallelism needs, in place; return the model.

    Build the dense model with the same RNG seed on every rank first: each rank keeps its slices.
    Afterwards a plain loop — ``loss = model(x, y)[1]; loss.backward(); optimizer.step()`` — is
    correct for any ``dp × ep × tp``, each data-parallel rank feeding its own rows of the global
    batch. ``plan``: ``"auto"`` (the reference GPT; Hugging Face GPT-2, Llama, Mistral, Qwen2,
    Qwen3, BERT, MoE families and every family with a ``base_model_tp_plan``), a :class:`Plan`
    or its dict, or a planner result (:func:`resolve_plan`). ``options``: a
    :class:`ParallelOptions` (attention, vocabulary split, loss parallelism, sequence parallelism,
    recompute, activation cache, gradient-reduction dtype and bucket size, ``tp_plan``, overlap
    and its ``chunks``, MoE statistics, LoRA adapters, ZeRO 1/2/3 laid out last: the gradient
    reducers are built once, after every other step); keyword
    arguments named like its fields build it or change it. Hugging Face models return what the
    unsharded model returns (full logits, so ``generate`` works), unless ``loss_parallel``.
    What was applied is ``model.parallel_state`` (plan, options, gradient reducers);
    ``model.parallel_plan`` is its plan. ``materialize(model)``, if given, runs once the plan is
    applied and before anything holds on to the parameters (the gradient reducers, the memory
    options): a model built on the ``meta`` device gets its tensors there —
    :func:`~ops_transformer.from_pretrained` reads each rank's shards at this point. Dropout in
    the reference GPT draws, on every rank, the mask of the model ``parallelize`` makes at
    ``tp = 1`` for its part (:mod:`.dropout`).
    """
    if getattr(getattr(model, "parallel_state", None), "plan", None) is not None:
        raise ValueError("this model is already parallelised (model.parallel_state is set)")
    check_model_device(model, ctx)
    options = check_context_parallel(model, ctx, ParallelOptions.of(options, **option_kwargs))
    resolved = resolve_plan(model, ctx, plan, options.plan_attention, options.loss_parallel,
                            options.vocab, options.tp_plan)
    check_expert_parallel(model, resolved, ctx)
    if options.sequence_parallel and ctx.tp_size > 1:
        resolved = sequence_parallel_plan(resolved, model, regather=options.regathers)
    if options.overlap != "none" and max(ctx.tp_size, ctx.ep_size) > 1:
        resolved = overlap_plan(resolved, options.overlap, options.chunks)
    if ctx.tp_size > 1:
        apply_plan(model, resolved, ctx)
        _parallel_loss(model, ctx, resolved, options)
    elif ctx.ep_size > 1:  # experts only
        apply_plan(model, Plan({k: r for k, r in resolved.rules.items()
                                if r["style"] == "moe"}), ctx)
    if materialize is not None:
        materialize(model)
    model.parallel_state = state = ParallelState(resolved, options)
    model.parallel_plan = resolved  # the same plan, for readers of the earlier attribute
    state.lora = adapt_layers(model, ctx, options)  # MoE statistics, fp8, LoRA
    apply_dropout(model, ctx, attention=resolved.attention,  # before recompute wraps the core
                  sequence_parallel=bool(options.sequence_parallel) and ctx.tp_size > 1)
    state.context_parallel = apply_context_parallel(model, ctx, options)
    apply_memory_options(model, recompute=options.recompute,
                         activation_cache=options.activation_cache)
    prepare_data_parallel(model, ctx, options)  # ZeRO 1/2 buckets, FSDP2 units; the reducers
    state.reducers = gradient_reducers(model, ctx, options)  # once, over what trains at the end
    if options.compile:  # last: the graphs see every other option
        apply_compile(model, options.compile_backend)
    log.info("parallelize: tp=%d dp=%d ep=%d attention=%s%s", ctx.tp_size, ctx.dp_size, ctx.ep_size,
             resolved.attention, f" ({resolved.reason})" if resolved.reason else "")
    return model


def apply_fp8(model: nn.Module, precision: str, backward: str = "e5m2") -> None:
    """With ``precision="fp8"``: every Transformer block's linear layers swapped for their fp8 form
    (:func:`~ops_transformer.layers.fp8_linear.convert_to_fp8`, its backward ``backward``); MoE
    models are refused.
    Other precisions: nothing here (16 bits: the caller's autocast)."""
    if precision != "fp8":
        return
    if getattr(getattr(model, "cfg", None), "n_experts", 0) \
            or getattr(getattr(model, "config", None), "num_local_experts", 0):
        raise ValueError("precision='fp8' does not combine with an MoE model yet")
    convert_to_fp8(transformer_blocks(model), backward)


def adapt_layers(model: nn.Module, ctx, options: ParallelOptions):
    """The changes to the parallel layers that come before the gradient reducers, in order: MoE
    statistics over the global batch, the fp8 linear layers of ``precision="fp8"``
    (:func:`apply_fp8`), then the LoRA adapters of ``options.lora`` (their
    :class:`~.lora.LoRAConfig`, or ``None``)."""
    if options.moe_statistics == "global":
        use_global_statistics(model, ctx)
    apply_fp8(model, options.precision, options.fp8_backward)
    if options.lora is None:
        return None
    return add_lora(model, ctx, **dataclasses.asdict(options.lora))


def check_model_device(model: nn.Module, ctx) -> None:
    """A ``ValueError`` when a parameter or buffer lives on a device other than ``ctx.device``
    (``meta`` is allowed: ``materialize`` places it): a CPU model under an NCCL context would
    otherwise fail later, inside a collective."""
    want = torch.device(ctx.device)
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        here = t.device
        if here.type == "meta" or (here.type == want.type and
                                   (want.index is None or here.index in (None, want.index))):
            continue
        raise ValueError(f"the model's {name} is on {here}, but ctx.device is {want}: move the "
                         f"model there first (model.to(ctx.device)) or build it on 'meta' and "
                         f"pass materialize=")


def _parallel_loss(model: nn.Module, ctx, plan: Plan, options: ParallelOptions) -> None:
    """``loss_parallel`` for a Hugging Face model: its loss on the sharded logits; and, under
    sequence parallelism, the check that every partial gradient is marked for its TP sum."""
    if options.sequence_parallel:
        check_partial_marked(model)
    loss_parallel = options.loss_parallel
    if loss_parallel and is_hf(model) and plan.vocab == "parallel":
        model.loss_function = vocab_parallel_causal_lm_loss(model, ctx)
    elif loss_parallel and is_hf(model):
        log.warning("parallelize: loss_parallel=True has no effect: the vocabulary is "
                    "replicated (%s); pass vocab='parallel' to split it", plan.reason)


def vocab_parallel_causal_lm_loss(model: nn.Module, ctx):
    """A drop-in for ``transformers``' ``ForCausalLMLoss`` on vocab-sharded logits."""
    vocab = model.config.vocab_size

    def loss_fn(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
                shift_labels=None, **kwargs):
        if shift_labels is None:
            labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:]
        shift_labels = shift_labels.to(logits.device)
        reduction = "mean" if num_items_in_batch is None else "sum"
        loss = vocab_parallel_cross_entropy(logits, shift_labels, ctx, ignore_index=ignore_index,
                                            reduction=reduction, vocab_size=vocab)
        return loss if num_items_in_batch is None else loss / num_items_in_batch

    return loss_fn


__all__ = ["Plan", "ParallelOptions", "parallelize", "no_sync", "gpt_plan", "resolve_plan"]
