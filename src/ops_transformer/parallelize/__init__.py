"""``parallelize(model, ctx, plan="auto")``: tensor parallelism applied from outside, by a plan."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from ..comm.bucketing import GradSums, add_grad_reducer
from ..memory.layers import apply_memory_options, check_memory_options
from ..models.gpt import GPT
from ..layers.moe import scale_expert_grads, split_expert_params
from ..parallel.data_parallel import DEFAULT_BUCKET_BYTES, GradSync, no_sync
from ..precision.policy import resolve_grad_reduce_dtype
from .dropout import apply_dropout
from .gpt_plan import gpt_plan
from .hf_plans import FAMILIES, hf_plan
from .moe_plan import check_expert_parallel
from .plan import Plan, apply_plan
from .sequence_parallel import (check_partial_marked, sequence_parallel_mode,
                                sequence_parallel_plan)

log = logging.getLogger("ops_transformer")
SUPPORTED = ("ops_transformer.models.GPT",) + tuple(f"Hugging Face {f}" for f in FAMILIES)


class _Groups:
    """What a style may need beyond the context: sibling modules and KV-replica groups."""

    def __init__(self, model: nn.Module, ctx):
        self.model, self.ctx, self._replica = model, ctx, {}

    def module(self, name: str) -> nn.Module:
        return self.model.get_submodule(name)

    def replica_group(self, replicas: int):
        """The group of the ``replicas`` consecutive TP ranks that hold the same KV heads. Every
        rank creates every such group, in the same order (``new_group`` is collective)."""
        if replicas not in self._replica:
            tp = self.ctx.tp_size
            mine = None
            for tp_ranks in self.ctx.mesh.mesh.reshape(-1, tp).tolist():
                for start in range(0, tp, replicas):
                    ranks = tp_ranks[start:start + replicas]
                    group = dist.new_group(ranks)
                    if self.ctx.rank in ranks:
                        mine = group
            self._replica[replicas] = mine
        return self._replica[replicas]


def _is_hf(model: nn.Module) -> bool:
    return hasattr(model, "config") and hasattr(model.config, "model_type")


def resolve_plan(model: nn.Module, ctx, plan="auto", attention: str = "auto",
                 loss_parallel: bool = False, vocab: str = "auto", tp_plan=None) -> Plan:
    if tp_plan is not None and not (plan == "auto" and _is_hf(model)):
        raise ValueError("tp_plan (Hugging Face style names) applies to a Hugging Face model with "
                         "plan='auto'")
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, dict) and "best" in plan and "candidates" in plan:  # a planner result
        if plan["best"] is None:
            raise ValueError("the planner found no layout that fits (its 'best' is null)")
        plan = plan["best"]
    if isinstance(plan, dict) and {"tp", "dp", "attention"} <= set(plan):  # a planner layout
        wanted = {"dp": plan["dp"], "ep": plan.get("ep", 1), "tp": plan["tp"]}
        actual = {"dp": ctx.dp_size, "ep": ctx.ep_size, "tp": ctx.tp_size}
        if wanted != actual:
            axes = [a for a in wanted if a != "ep" or max(wanted["ep"], actual["ep"]) > 1]

            def show(degrees):
                return " × ".join(f"{a}={degrees[a]}" for a in axes)

            raise ValueError(f"the plan is for {show(wanted)}, but this job runs {show(actual)}")
        attention = plan["attention"]
        plan = "auto"
    elif isinstance(plan, dict):
        return Plan.from_dict(plan)
    if plan != "auto":
        raise ValueError(f"plan must be 'auto', a Plan or a dict, got {plan!r}")
    if isinstance(model, GPT):
        return gpt_plan(model.cfg, ctx.tp_size, attention, vocab=vocab,
                        profile=getattr(ctx, "profile", None))  # agreed by every rank
    if _is_hf(model):
        if attention not in ("auto", "heads"):
            raise ValueError(f"Hugging Face models support attention='heads' (or 'auto'), got "
                             f"{attention!r}")
        return hf_plan(model, ctx.tp_size, loss_parallel, vocab=vocab, tp_plan=tp_plan,
                       profile=getattr(ctx, "profile", None))  # agreed by every rank
    raise ValueError(f"no automatic plan for {type(model).__name__}; supported models: "
                     f"{', '.join(SUPPORTED)} (or pass plan= a Plan / dict)")


def parallelize(model: nn.Module, ctx, plan="auto", *, attention: str = "auto",
                vocab: str = "auto", loss_parallel: bool = False,
                bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                grad_reduce_dtype: torch.dtype | None = None,
                sequence_parallel: bool | str = False,
                recompute: str = "none", activation_cache: str = "none",
                tp_plan: dict | None = None) -> nn.Module:
    """Apply tensor parallelism over ``ctx.tp_group`` and data-parallel gradient averaging over
    ``ctx.dp_group`` to ``model`` (in place) and return it.

    Build the dense model with the same RNG seed on every rank first: each rank keeps its slices.
    Afterwards a plain loop — ``loss = model(x, y)[1]; loss.backward(); optimizer.step()`` — is
    correct for any ``dp × tp``, each data-parallel rank feeding its own rows of the global batch.
    The applied plan is ``model.parallel_plan``. For the reference GPT, ``attention`` and ``vocab``
    (``"parallel"``, ``"replicated"`` or ``"auto"``: embedding and LM head split over the
    vocabulary or not) choose the strategy; ``auto`` asks the cost model. ``vocab`` applies to
    Hugging Face models too.

    Hugging Face models (GPT-2, Llama, Mistral, Qwen2, Qwen3, BERT; others through their
    ``base_model_tp_plan``) return what the unsharded model returns: full-vocabulary logits, so
    ``generate`` works unchanged. With ``loss_parallel=True`` (and the vocabulary split) the
    logits stay sharded and the loss (``labels=``) is the vocab-parallel cross-entropy — the full
    logits are never gathered. ``tp_plan``, as in ``transformers`` (``{pattern: style}`` with
    Hugging Face's style names), is merged over the model's own plan and translated.

    ``grad_reduce_dtype`` is the dtype of the gradient reductions — data-parallel averaging and the
    sums of replicated parameters' partial gradients (replicated KV heads, strategy B's output
    projection), coalesced at the end of backward
    (:class:`~ops_transformer.comm.bucketing.GradSums`). Default: float32 when the parameters are
    16-bit, else the parameters' dtype.

    Memory (SPEC F7, :mod:`ops_transformer.memory`): ``sequence_parallel=True`` keeps ``1/tp`` of
    the activations between TP regions (reference GPT with ``attention="heads"``, Hugging Face
    GPT-2/Llama/Mistral/Qwen2; the norms' partial gradients join the ``GradSums``);
    ``sequence_parallel="regather"`` keeps only this rank's ``1/tp`` share of each region's input
    and all-gathers it again in backward (one more all-gather of ``b·s·h`` per region, Megatron's
    layout, :mod:`ops_transformer.layers.sequence_regather`);
    ``recompute="selective"`` (attention core) or ``"full"`` (every layer) recomputes activations
    in backward; ``activation_cache="int8"`` keeps each layer's saved activations as int8.

    Dropout (reference GPT, :mod:`.dropout`): every rank applies exactly the mask the model
    ``parallelize`` makes at ``tp = 1`` applies to its part — its heads, its share of the tokens,
    its rows of the global batch — and replicated regions the same mask on every rank.
    """
    if getattr(model, "parallel_plan", None) is not None:
        raise ValueError("this model is already parallelised (model.parallel_plan is set)")
    check_memory_options(recompute, activation_cache)
    mode = sequence_parallel_mode(sequence_parallel)
    if mode == "regather" and recompute == "full":
        log.warning("parallelize: sequence_parallel='regather' with recompute='full' runs as "
                    "sequence_parallel=True: full recompute keeps only each layer's input, so "
                    "there is no region input to keep less of, and a re-gather would add an "
                    "all-gather per region for nothing")
        mode = "plain"
    if sequence_parallel and attention == "auto":
        attention = "heads"  # the one strategy with a sequence-parallel form
    resolved = resolve_plan(model, ctx, plan, attention, loss_parallel, vocab, tp_plan)
    if ctx.ep_size > 1:
        check_expert_parallel(model, resolved, ctx)
    if sequence_parallel and ctx.tp_size > 1:
        resolved = sequence_parallel_plan(resolved, model, regather=mode == "regather")
    if ctx.tp_size > 1:
        apply_plan(model, resolved, ctx, _Groups(model, ctx))
        if loss_parallel and _is_hf(model) and resolved.vocab == "parallel":
            model.loss_function = vocab_parallel_causal_lm_loss(model, ctx)
        elif loss_parallel and _is_hf(model):
            log.warning("parallelize: loss_parallel=True has no effect: the vocabulary is "
                        "replicated (%s); pass vocab='parallel' to split it", resolved.reason)
        if sequence_parallel:
            check_partial_marked(model)
    elif ctx.ep_size > 1:  # experts only
        apply_plan(model, Plan({k: r for k, r in resolved.rules.items() if r["style"] == "moe"}),
                   ctx, _Groups(model, ctx))
    model.parallel_plan = resolved
    # before recompute wraps the attention core: the replay then draws the same masks
    apply_dropout(model, ctx, attention=resolved.attention,
                  sequence_parallel=mode != "none" and ctx.tp_size > 1)
    reduce_dtype = resolve_grad_reduce_dtype(model, grad_reduce_dtype)
    if ctx.dp_ep_size > 1:  # EP ranks read different micro-batches, like DP ranks
        dense, experts = split_expert_params(model.parameters())
        scale_expert_grads(experts, ctx.ep_size)
        group = ctx.dp_ep_group if ctx.ep_size > 1 else ctx.dp_group
        model._ops_transformer_grad_sync = GradSync(dense, group, bucket_bytes=bucket_bytes,
                                                    reduce_dtype=reduce_dtype)
        if experts and ctx.dp_size > 1:
            model._ops_transformer_expert_grad_sync = GradSync(
                experts, ctx.dp_group, bucket_bytes=bucket_bytes, reduce_dtype=reduce_dtype)
    # Built after the data-parallel averaging, so its end-of-backward sums run after it.
    sums = GradSums.of_module(model, dtype=reduce_dtype, bucket_bytes=bucket_bytes)
    if sums is not None:
        add_grad_reducer(model, sums)
    apply_memory_options(model, recompute=recompute, activation_cache=activation_cache)
    log.info("parallelize: tp=%d dp=%d ep=%d attention=%s%s", ctx.tp_size, ctx.dp_size,
             ctx.ep_size, resolved.attention, f" ({resolved.reason})" if resolved.reason else "")
    return model


def vocab_parallel_causal_lm_loss(model: nn.Module, ctx):
    """A drop-in for ``transformers``' ``ForCausalLMLoss`` on vocab-sharded logits."""
    from ..layers.loss import vocab_parallel_cross_entropy

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


__all__ = ["Plan", "parallelize", "no_sync", "gpt_plan", "resolve_plan"]
