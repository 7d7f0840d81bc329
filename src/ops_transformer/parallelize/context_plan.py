"""Context parallelism applied to a model (SPEC F18): the sequence split over ``ctx.cp_group``.

``parallelize(model, ctx, context_parallel="auto" | "ring" | "allgather_kv")`` on a context with
``cp > 1`` (``init_parallel(cp=...)``) does three things to the reference GPT:

1. **Entry** — every ``cp`` rank is fed the *whole* sequences (the same rows, like the TP
   ranks); the model becomes a :class:`ContextParallelGPT` (the same parameters and names),
   whose :class:`SequenceSplit` (``model.sequence_split``) keeps this rank's two chunks of the
   tokens and targets (head-tail balanced: rank ``r`` holds chunks ``r`` and ``2·cp−1−r`` of
   ``2·cp``, :func:`~ops_transformer.layers.context_attention.shard_sequence`) and passes their
   positions to the model (``positions=``, for the learned or rotary position embedding). A
   sequence that ``2·cp`` does not divide is a ``ValueError`` naming the sizes.
2. **Attention** — each layer's core (``attn.core``) becomes a
   :class:`~ops_transformer.layers.context_attention.ContextParallelCore` (``attn.cp_core``:
   ``print(model)`` names its strategy and collectives), with this rank's TP heads
   (``attention="heads"``) and its tokens.
3. **Exit** — the loss is normalised by the *global* token count: each rank's mean over its
   targets is weighted by its share of the non-ignored targets of the whole rows (counted on
   every rank, which has them) and summed over the group (one all-reduce, label ``cp.loss``), so
   the loss every rank returns is the one-device loss. Dense gradients are averaged over
   ``dp × ep × cp`` (:attr:`~ops_transformer.parallel.ParallelContext.grad_group`); as each
   ``cp`` rank's gradient is a part of a sum, its loss gradient is scaled by ``cp`` (as
   Megatron-LM does).

Dropout keeps the one-device masks (each site's :class:`~ops_transformer.layers.dropout.Layout`
learns this rank's head-tail tokens; the cores draw their blocks' masks), and MoE layers take
their capacity and load-balancing statistics over the cp group's whole rows
(:mod:`ops_transformer.layers.moe_context`). Hugging Face Llama, Mistral and Qwen2 get the same
through :mod:`.context_hf` (without dropout).

The logits a rank returns are those of its own tokens (in the head-tail order of
:func:`shard_sequence`; :func:`~ops_transformer.layers.context_attention.unshard_sequence` puts
gathered ones back in order). ``context_parallel="auto"`` asks the cost model
(:func:`~ops_transformer.planner.context_parallel.choose_strategy`, at ``max_seq_len``) and
records the reason (``model.parallel_state.context_parallel``).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from torch import nn

from ..comm.primitives import reduce_from_tp_region
from ..layers.context_attention import (ContextParallelCore, head_tail_chunks, local_positions,
                                       shard_sequence)
from ..layers.dropout import ParallelDropout
from ..layers.moe_context import use_context_statistics
from ..models.documents import check_document_ids, document_positions, document_targets
from ..models.gpt import GPT
from ..planner.choose import resolve_profile
from ..planner.context_parallel import (CP_CHOICES, CP_LIMITS, ULYSSES, check_sequence,
                                        check_ulysses, choose_strategy)
from .context_hf import CP_FAMILIES, apply_hf_context_parallel, supports_context_parallel
from .gpt_plan import AUTO_BATCH

log = logging.getLogger("ops_transformer")
IGNORE_INDEX = -100  # F.cross_entropy's, which the reference GPT's head uses


@dataclass(frozen=True)
class ContextParallelChoice:
    """The strategy ``parallelize`` applied over ``cp`` ranks, and why."""

    strategy: str
    reason: str
    cp: int


def check_context_parallel(model: nn.Module, ctx, options):
    """``options`` for a model split over ``cp`` ranks (``attention="auto"`` becomes
    ``heads``); a ``ValueError`` naming what does not compose with context parallelism yet."""
    if options.context_parallel not in CP_CHOICES:
        raise ValueError(f"context_parallel must be one of {CP_CHOICES}, got "
                         f"{options.context_parallel!r}")
    if ctx.cp_size == 1:
        return options
    if not (isinstance(model, GPT) or supports_context_parallel(model)):
        raise ValueError(f"context parallelism (cp={ctx.cp_size}) supports the reference GPT and "
                         f"Hugging Face {', '.join(CP_FAMILIES)}; got {type(model).__name__}")
    if not isinstance(model, GPT) and _hf_dropout(model) > 0:
        raise ValueError(f"context parallelism (cp={ctx.cp_size}) does not compose with "
                         f"a Hugging Face model's attention dropout > 0 yet: "
                         f"{CP_LIMITS['hf_dropout']}")
    if options.attention not in ("auto", "heads"):
        raise ValueError(f"context parallelism (cp={ctx.cp_size}) splits the tokens of "
                         f"attention='heads' (each TP rank its heads); got "
                         f"attention={options.attention!r}")
    return dataclasses.replace(options, attention="heads")


def _hf_dropout(model: nn.Module) -> float:
    return float(getattr(model.config, "attention_dropout", 0.0) or 0.0)


def context_shapes(model: nn.Module) -> dict:
    """``max_seq_len, n_kv_heads, head_dim, d_model`` of the reference GPT or a HF decoder."""
    if isinstance(model, GPT):
        cfg = model.cfg
        return dict(seq=cfg.max_seq_len, kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                    d_model=cfg.d_model)
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return dict(seq=c.max_position_embeddings, kv_heads=c.num_key_value_heads,
                head_dim=head_dim, d_model=c.num_attention_heads * head_dim)


def choose_context_parallel(model: nn.Module, ctx, requested: str) -> ContextParallelChoice:
    """``requested`` itself, or for ``auto`` the cost model's choice at ``max_seq_len`` on the
    agreed profile (every rank decides alike)."""
    if requested != "auto":
        return ContextParallelChoice(requested, f"forced (context_parallel={requested!r})",
                                     ctx.cp_size)
    shapes, tp = context_shapes(model), ctx.tp_size
    profile = resolve_profile(getattr(ctx, "profile", None))
    kv_heads = max(1, shapes["kv_heads"] // tp)  # replicated KV heads: one per rank
    strategy, reason = choose_strategy(
        batch=AUTO_BATCH, seq=shapes["seq"], kv_dim=kv_heads * shapes["head_dim"],
        q_dim=shapes["d_model"] // tp, cp=ctx.cp_size, alpha_s=profile.alpha_s,
        bandwidth=profile.bandwidth, matmul_flops=profile.matmul_flops)
    return ContextParallelChoice(strategy, reason, ctx.cp_size)


def apply_context_parallel(model: nn.Module, ctx, options) -> ContextParallelChoice | None:
    """Split ``model``'s sequences over ``ctx.cp_group`` (entry, attention cores, exit: above);
    ``None`` at ``cp = 1``."""
    if ctx.cp_size == 1:
        return None
    plan = model.parallel_state.plan
    if ctx.tp_size > 1 and plan is not None and plan.attention != "heads":
        raise ValueError(f"context parallelism (cp={ctx.cp_size}) splits the tokens of "
                         f"attention='heads'; the plan has attention={plan.attention!r}")
    choice = choose_context_parallel(model, ctx, options.context_parallel)
    shapes = context_shapes(model)
    if choice.strategy == ULYSSES:  # each cp rank 1/cp of this rank's heads: named now
        check_ulysses(shapes["d_model"] // shapes["head_dim"] // ctx.tp_size,
                      max(1, shapes["kv_heads"] // ctx.tp_size), ctx.cp_size)
    split = SequenceSplit(ctx, shapes["seq"])
    if isinstance(model, GPT):
        for block in model.layers:
            # a submodule, so print(model) names it; ``Attention.forward`` calls the instance's
            # ``core`` (as parallelize/dropout.py replaces it), a class method otherwise
            block.attn.cp_core = ContextParallelCore(ctx, choice.strategy, choice.reason,
                                                     switch=split.switch,
                                                     dropout=model.cfg.dropout)
            block.attn.core = block.attn.cp_core.__call__
        head_tail_dropout(model, ctx)  # the embedding and residual sites: this rank's tokens
        model.sequence_split = split
        use_context_statistics(model, ctx, split.switch)  # MoE: capacity and aux over the rows
        model.__class__ = ContextParallelGPT  # the same parameters and names; its forward splits
    else:
        apply_hf_context_parallel(model, ctx, choice, split)
    log.info("parallelize: cp=%d context_parallel=%s (%s)", ctx.cp_size, choice.strategy,
             choice.reason)
    return choice


def head_tail_dropout(model: nn.Module, ctx) -> int:
    """Give every :class:`~ops_transformer.layers.dropout.ParallelDropout` of ``model`` (what
    :mod:`.dropout` made of the reference GPT's embedding and residual sites) this rank's
    head-tail tokens of the one-device mask; returns how many."""
    sites = [m for m in model.modules() if isinstance(m, ParallelDropout)]
    for module in sites:
        module.layout = dataclasses.replace(module.layout, cp_rank=ctx.cp_rank, cp=ctx.cp_size)
    return len(sites)


class ContextParallelGPT(GPT):
    """The reference GPT fed whole sequences, of which this rank computes its part
    (:class:`SequenceSplit`): ``apply_context_parallel`` gives a parallelised GPT this class."""

    def forward(self, idx, targets=None, *, positions=None, document_ids=None):
        if positions is not None:
            raise ValueError("a context-parallel model takes whole sequences: it places their "
                             "positions itself (positions= must be None)")
        if not self.sequence_split.switch.on:  # generate(): every rank the whole sequence
            logits, loss = super().forward(idx, targets, document_ids=document_ids)
            return logits, GPT.add_aux_loss(self, loss)
        local, local_targets, positions, total = self.sequence_split.enter(idx, targets,
                                                                           document_ids)
        logits, loss = super().forward(local, local_targets, positions=positions,
                                       document_ids=document_ids)  # whole: the cores read them
        # the MoE load-balancing loss after the exit: it is normalised over the cp group's
        # tokens already (layers/moe_context.py), the cross-entropy by the exit
        return logits, GPT.add_aux_loss(self, self.sequence_split.exit(loss, local_targets,
                                                                       total))

    def add_aux_loss(self, loss):
        return loss  # added by forward, after the sequence split's exit

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, **kwargs):
        """Sampling, unsplit: every ``cp`` rank runs the whole (short, growing) sequence with its
        full copy of the weights (its TP shards under TP) and draws the same tokens."""
        self.sequence_split.switch.on = False
        try:
            return super().generate(idx, max_new_tokens, **kwargs)
        finally:
            self.sequence_split.switch.on = True


class CoreSwitch:
    """Whether the sequence is split (the attention cores and the model's entry read it)."""

    on = True


class SequenceSplit(nn.Module):
    """The entry and exit of a model whose sequences are split over ``cp`` ranks: this rank's
    chunks in, the loss over the whole sequences out."""

    def __init__(self, ctx, max_seq_len: int):
        super().__init__()
        self.group, self.cp, self.rank, self.max_seq_len = ctx.cp_group, ctx.cp_size, \
            ctx.cp_rank, max_seq_len
        self.switch = CoreSwitch()  # off while generate() runs whole sequences

    def enter(self, idx, targets, document_ids=None):
        """``(idx, targets, positions, total)`` of this rank's two chunks (head-tail) and the
        whole rows' number of targets (every rank has them: no collective); with packed
        documents, the positions inside each document and no target across a boundary."""
        seq = idx.shape[1]
        check_sequence(seq, self.cp)
        if seq > self.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len ({self.max_seq_len})")
        local = shard_sequence(idx, self.rank, self.cp)
        if document_ids is None:
            positions = local_positions(local.shape[1], self.rank, self.cp, idx.device)
        else:
            check_document_ids(document_ids, idx)
            positions = shard_sequence(document_positions(document_ids), self.rank, self.cp)
            if targets is not None:
                targets = document_targets(targets, document_ids)
        total = None
        if targets is not None:
            total = self.targets_in(targets)
            targets = shard_sequence(targets, self.rank, self.cp)
        return local, targets, positions, total

    @staticmethod
    def targets_in(targets: torch.Tensor) -> torch.Tensor:
        """The targets that count (not ``-100``) in the whole rows."""
        return (targets != IGNORE_INDEX).sum()

    def exit(self, loss, targets, total):
        """The loss of the whole sequences: each rank's mean over its ``targets`` weighted by
        its share of the rows' ``total``; the gradient of each rank's part scaled by ``cp``
        (averaged over ``dp × ep × cp`` afterwards)."""
        if loss is None:
            return None
        local = self.targets_in(targets).to(loss.dtype)
        share = loss * (local / total.to(loss.dtype))  # Σ over this rank's tokens ÷ the count
        value = reduce_from_tp_region(share.detach(), self.group, label="cp.loss")
        return value + self.cp * (share - share.detach())

    def extra_repr(self) -> str:
        return (f"cp={self.cp}, rank={self.rank}: tokens, targets and positions of chunks "
                f"{head_tail_chunks(self.rank, self.cp)} of {2 * self.cp}; loss over the global "
                f"token count (all-reduce cp.loss)")
