"""The plan styles: what each rule of a :class:`~.plan.Plan` does to the module it names.

A style is a function ``style(module, ctx, model, *, options) -> module`` (``model``: the root, for
a tied head's embedding); its keyword-only parameters are the options a rule may carry, checked
when the plan is built (:func:`check_rule`). A style that communicates returns a parallel layer or
a region (:mod:`ops_transformer.layers.regions`) whose ``extra_repr`` names the collective — no
style registers a hook — so ``print(model)`` shows every collective of the plan.

================== =====================================================================
style              effect (communication: forward / backward)
================== =====================================================================
``colwise``        ``nn.Linear`` → :class:`ColumnParallelLinear` (options: ``sub_blocks``,
                   ``kv_heads`` for key/value projections, replicated when fewer than ranks,
                   ``reduce_input_grad``, ``gather_output``; ``pad``: an output width that does
                   not divide by tp is padded, :class:`PaddedColumnParallelLinear`).
                   Fwd: none (``gather_output``: all-gather of the output); bwd: all-reduce of
                   the input gradient (none with ``reduce_input_grad=False``)
``rowwise``        ``nn.Linear`` → :class:`RowParallelLinear` (input already split by features;
                   ``input_is_parallel=False``: the full input, sliced locally; ``pad``: an input
                   width that does not divide by tp is padded; ``sub_blocks``: a packed input,
                   :class:`PackedRowParallelLinear`). Fwd: all-reduce of the output; bwd: none
                   (``input_is_parallel=False``: all-gather of the input gradient)
``gather_in``      the module stays replicated, a :class:`GatherInput` region: its input is
                   all-gathered along the last dimension. Fwd: all-gather; bwd: none
``region``         a :class:`CopyToTPRegion`: one ``copy_to_tp_region`` on the module's first
                   input (positional, or the ``hidden_states`` keyword), so the column-parallel
                   children that share it (Q, K, V) need a single backward all-reduce (``set``:
                   as ``attrs``). Fwd: none; bwd: all-reduce of the input gradient
``vocab``          ``nn.Embedding`` → :class:`VocabParallelEmbedding` (vocabulary padded if
                   needed). Fwd: all-reduce of the output; bwd: none
``embed_colwise``  ``nn.Embedding`` → :class:`ColumnParallelEmbedding` (embedding dimension
                   split, must divide by tp). Fwd: all-gather of the output; bwd: none
``vocab_head``     an LM head with ``weight [V, d]`` → :class:`VocabParallelLMHead` (``tied_to``:
                   the embedding whose sharded table it shares; the loss options of
                   :func:`vocab_parallel_cross_entropy`)
``vocab_logits``   an ``nn.Linear`` LM head → :class:`GatheredLMHead`: full logits out
                   (``tied_to`` as above; ``gather=False`` keeps them sharded for a
                   vocab-parallel loss). Fwd: all-gather of the logits; bwd: all-reduce of the
                   input gradient
``kv_split``       the reference attention → :class:`FeatureSplitAttention` (strategy B; ``rope``)
``attrs``          set the module's per-rank attributes (``set``: name → value), e.g. the split
                   size of a fused QKV output in Hugging Face's GPT-2. No communication
``grad_allreduce`` parameters stay replicated, their gradients are summed over the TP group (a
                   norm over per-head features, e.g. Qwen3's ``q_norm``, sees only this rank's
                   heads). Fwd: none; bwd: their sum, coalesced with the other partial gradients
                   into one all-reduce per bucket at the end of backward (``GradSums``)
``reduce_out``     a :class:`ReduceOutput` region: the module computes a partial sum on each
                   rank and its output is all-reduced (``region_inputs``: its parameters are
                   sharded raw tensors, so each floating-point input's gradient is all-reduced
                   too). Fwd: all-reduce of the output; bwd: none (``region_inputs``: all-reduce
                   of each input gradient)
``mla_kv_a``       a replicated MLA ``kv_a_proj_with_mqa`` as a :class:`RopeGradRegion`
                   (``rope_dim``: its last ``rope_dim`` output features bypass the
                   column-parallel ``kv_b_proj`` and feed this rank's heads directly). Fwd: none;
                   bwd: all-reduce of the gradient of those features
``shard_param``    the pattern names a parameter (not a module), sliced along ``dim`` (e.g.
                   per-head attention sinks, ``dim=0``). No communication
``moe``            the reference MoE → :class:`ParallelMoE`; a ``transformers`` experts module
                   → :class:`ParallelExperts`: ``n_experts/ep`` experts per EP rank, each
                   column→row over TP, tokens moved by all-to-alls over the EP group
                   (``hf_experts``: through :class:`~.hf_experts.HFExperts`, which keeps the
                   module's call and keys — Hugging Face's ``moe_tp_experts``). Fwd: all-to-alls
                   over EP, all-reduce of the experts' output over TP; bwd: all-to-alls, all-reduce
                   of their input gradient
================== =====================================================================

Sequence parallelism (:mod:`.sequence_plan` rewrites a plan into these): ``sequence_scatter`` (a
:class:`ScatterSequence` region), ``sequence_region`` (a :class:`GatherSequenceRegion`; ``set``),
``colwise_sequence`` (``colwise`` without the input-gradient all-reduce, behind a
:class:`GatherSequenceRegion`), ``rowwise_sequence`` (:class:`SequenceParallelRowLinear`),
``sequence_gather`` (a :class:`GatherSequenceOutput`; its parameters' gradients summed over TP) and
``sequence_partial`` (the parameters' gradients summed over TP); with
``sequence_parallel="regather"``, ``sequence_region_regather`` (a :class:`RegatherSequenceRegion`:
the entry keeps only this rank's share), ``colwise_regather`` (a :class:`RegatherColumnLinear`
fed by it: no input kept, the share all-gathered again in backward) and
``colwise_sequence_regather`` (both in one: the column layer behind its own re-gathering entry).

Overlap (:mod:`.overlap_plan` rewrites a plan into these; options ``overlap`` — ``"chunked"`` or
``"auto"`` — and ``chunks``): ``region_chunked`` / ``sequence_region_chunked`` (the region computes
its ``columns``, ``colwise_fed`` children, as one collective matmul:
:mod:`ops_transformer.layers.overlap_regions`), ``colwise_chunked`` / ``colwise_sequence_chunked``
(a column layer that is its own such region), ``rowwise_chunked`` / ``rowwise_sequence_chunked``
(the row matmul and its all-reduce / reduce-scatter in chunks) and ``moe_chunked`` (dispatch and
combine in chunks, :mod:`ops_transformer.layers.moe_overlap`): the same collectives, each split
into chunks pipelined with its matmul.

Hugging Face's styles map onto these in :mod:`.hf_translate` (``colwise_gather_output`` is
``colwise`` with ``gather_output``, ``rowwise_split_input`` is ``rowwise`` with
``input_is_parallel=False``, ``packed_colwise`` is ``colwise`` with two ``sub_blocks``,
``embedding_rowwise`` is ``vocab``, ``replicate`` and ``local_params`` need no rule).
"""

from __future__ import annotations

import inspect

from torch import nn

from ..comm.bucketing import mark_partial_grad
from ..layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from ..layers.attention import FeatureSplitAttention
from ..layers.embedding import ColumnParallelEmbedding
from ..layers.head import GatheredLMHead, VocabParallelLMHead
from ..layers.linear import dense_weight
from ..layers.linear_variants import (PackedRowParallelLinear, PaddedColumnParallelLinear,
                                      PaddedRowParallelLinear)
from ..layers.moe import ParallelExperts, to_expert_parallel
from ..layers.overlap_policy import OverlapPolicy
from ..layers.overlap_regions import (ChunkedCopyToTPRegion, ChunkedGatherSequenceRegion,
                                      ChunkedRowOutput, ChunkedRowScatter, FedColumn, as_variant)
from ..layers.regions import (CopyToTPRegion, FullSequenceRegion, GatherInput, GatherSequenceOutput,
                              GatherSequenceRegion, ReduceOutput, RegatherSequenceRegion,
                              RopeGradRegion, ScatterSequence)
from ..layers.sequence_parallel import SequenceParallelRowLinear, mark_partial
from ..layers.sequence_regather import RegatherColumnLinear
from ..parallel.sharding import ShardSpec, set_shard_spec
from ..planner.strategies import kv_replicas
from .hf_experts import HFExperts


def _plain(module: nn.Module, cls: type) -> nn.Module:
    """Styles that swap a module for a parallel one must not drop behaviour a subclass adds."""
    if type(module) is not cls:
        raise ValueError(f"this style replaces a plain {cls.__name__}; got "
                         f"{type(module).__name__}, whose forward may differ")
    return module


def _linear(module: nn.Module) -> nn.Module:
    if type(module) is nn.Linear or (type(module).__name__ == "Conv1D" and hasattr(module, "nf")):
        return module
    raise ValueError(f"colwise/rowwise replace an nn.Linear (or GPT-2's Conv1D); got "
                     f"{type(module).__name__}, whose forward may differ")


def colwise(module, ctx, model, *, sub_blocks=None, kv_heads=None, reduce_input_grad=True,
            gather_output=False, pad=False):
    _linear(module)
    if pad and dense_weight(module)[0].shape[0] % ctx.tp_size:
        if sub_blocks or kv_heads is not None:
            raise ValueError("colwise: pad=True cannot be combined with sub_blocks or kv_heads")
        return PaddedColumnParallelLinear.from_dense(module, ctx, gather_output=gather_output,
                                                     reduce_input_grad=reduce_input_grad)
    replicas = 1 if kv_heads is None else kv_replicas(kv_heads, ctx.tp_size)
    layer = ColumnParallelLinear.from_dense(module, ctx, sub_blocks=tuple(sub_blocks or ()) or None,
                                            replicas=replicas, reduce_input_grad=reduce_input_grad,
                                            gather_output=gather_output)
    if replicas > 1:
        group = ctx.kv_replica_group(replicas)  # made by the context, once per job
        for p in layer.parameters():  # each replica saw only its query heads: sum the gradients
            mark_partial_grad(p, group)
    return layer


def rowwise(module, ctx, model, *, input_is_parallel=True, pad=False, sub_blocks=None):
    _linear(module)
    if sub_blocks:
        if not input_is_parallel or pad:
            raise ValueError("rowwise: sub_blocks needs input_is_parallel=True and no pad")
        return PackedRowParallelLinear.from_dense(module, ctx, sub_blocks=tuple(sub_blocks))
    if pad and dense_weight(module)[0].shape[1] % ctx.tp_size:
        return PaddedRowParallelLinear.from_dense(module, ctx, input_is_parallel=input_is_parallel)
    return RowParallelLinear.from_dense(module, ctx, input_is_parallel=input_is_parallel)


def gather_in(module, ctx, model):
    return GatherInput.wrap(module, ctx.tp_group)


def attrs(module, ctx, model, *, set=None):
    for name, value in (set or {}).items():
        if not hasattr(module, name):
            raise ValueError(f"attrs style: {type(module).__name__} has no attribute {name!r}")
        setattr(module, name, value)
    return module


def region(module, ctx, model, *, set=None):
    return CopyToTPRegion.wrap(attrs(module, ctx, model, set=set), ctx.tp_group)


def vocab(module, ctx, model):
    return VocabParallelEmbedding.from_dense(_plain(module, nn.Embedding), ctx, pad_vocab=True)


def embed_colwise(module, ctx, model):
    return ColumnParallelEmbedding.from_dense(_plain(module, nn.Embedding), ctx)


def vocab_head(module, ctx, model, *, tied_to=None, ignore_index=-100, label_smoothing=0.0,
               reduction="mean"):
    shared = model.get_submodule(tied_to).weight if tied_to else None
    return VocabParallelLMHead.from_dense(module, ctx, shared_weight=shared,
                                          ignore_index=ignore_index,
                                          label_smoothing=label_smoothing, reduction=reduction)


def vocab_logits(module, ctx, model, *, tied_to=None, gather=True):
    shared = model.get_submodule(tied_to).weight if tied_to else None
    return GatheredLMHead.from_dense(module, ctx, shared_weight=shared, gather=gather)


def kv_split(module, ctx, model, *, rope=False):
    return FeatureSplitAttention(module, ctx, rope=rope)


def grad_allreduce(module, ctx, model):
    for p in module.parameters():  # summed over the TP group at the end of backward, coalesced
        mark_partial_grad(p, ctx.tp_group)
    return module


def reduce_out(module, ctx, model, *, region_inputs=False):
    return ReduceOutput.wrap(module, ctx.tp_group, region_inputs=region_inputs)


def mla_kv_a(module, ctx, model, *, rope_dim):
    return RopeGradRegion.wrap(module, ctx.tp_group, rope_dim=rope_dim)


def shard_param(owner, ctx, model, *, param, dim=0):
    """Replace ``owner.<param>`` by this rank's slice along ``dim`` (with its ShardSpec)."""
    full = getattr(owner, param)
    dim = dim % full.dim()
    spec = ShardSpec(tuple(full.shape), dim, ctx.tp_rank, ctx.tp_size)
    if full.shape[dim] % ctx.tp_size:
        raise ValueError(f"shard_param: {param} has size {full.shape[dim]} along dim {dim}, which "
                         f"does not divide by tp ({ctx.tp_size})")
    shard = nn.Parameter(spec.shard(full.detach()), requires_grad=full.requires_grad)
    setattr(owner, param, set_shard_spec(shard, spec))
    return owner


def moe(module, ctx, model, *, hf_experts=False, sequence=False):
    layer = HFExperts.from_dense(module, ctx) if hf_experts else to_expert_parallel(module, ctx)
    return FullSequenceRegion.wrap(layer, ctx.tp_group) if sequence else layer


def sequence_scatter(module, ctx, model):
    return ScatterSequence.wrap(module, ctx.tp_group)


def sequence_region(module, ctx, model, *, set=None):
    return GatherSequenceRegion.wrap(attrs(module, ctx, model, set=set), ctx.tp_group)


def colwise_sequence(module, ctx, model, *, sub_blocks=None, kv_heads=None, gather_output=False):
    layer = colwise(module, ctx, model, sub_blocks=sub_blocks, kv_heads=kv_heads,
                    reduce_input_grad=False, gather_output=gather_output)
    return GatherSequenceRegion.wrap(layer, ctx.tp_group)


def sequence_region_regather(module, ctx, model, *, set=None):
    return RegatherSequenceRegion.wrap(attrs(module, ctx, model, set=set), ctx.tp_group)


def colwise_regather(module, ctx, model, *, sub_blocks=None, kv_heads=None):
    return RegatherColumnLinear.from_column(colwise(module, ctx, model, sub_blocks=sub_blocks,
                                                    kv_heads=kv_heads, reduce_input_grad=False))


def colwise_sequence_regather(module, ctx, model, *, sub_blocks=None, kv_heads=None):
    layer = colwise_regather(module, ctx, model, sub_blocks=sub_blocks, kv_heads=kv_heads)
    return RegatherSequenceRegion.wrap(layer, ctx.tp_group)


def rowwise_sequence(module, ctx, model):
    return SequenceParallelRowLinear.from_dense(module, ctx)


def sequence_gather(module, ctx, model):
    mark_partial(module, ctx.tp_group)
    return GatherSequenceOutput.wrap(module, ctx.tp_group)


def sequence_partial(module, ctx, model):
    mark_partial(module, ctx.tp_group)
    return module


def _policy(ctx, overlap, chunks) -> OverlapPolicy:
    return OverlapPolicy(overlap, chunks, getattr(ctx, "profile", None))  # agreed by every rank


def _entry(cls, module, ctx, columns, overlap, chunks):
    return cls.wrap(module, ctx.tp_group, columns=tuple(columns),
                    overlap=_policy(ctx, overlap, chunks))


def _column(module, ctx, model, sub_blocks, kv_heads, pad=False):
    return colwise(module, ctx, model, sub_blocks=sub_blocks, kv_heads=kv_heads,
                   reduce_input_grad=False, pad=pad)  # (its entry region reduces the gradient)


def region_chunked(module, ctx, model, *, columns, set=None, overlap="auto", chunks=2):
    module = attrs(module, ctx, model, set=set)
    return _entry(ChunkedCopyToTPRegion, module, ctx, columns, overlap, chunks)


def colwise_fed(module, ctx, model, *, sub_blocks=None, kv_heads=None, pad=False):
    return as_variant(_column(module, ctx, model, sub_blocks, kv_heads, pad), FedColumn)


def colwise_chunked(module, ctx, model, *, sub_blocks=None, kv_heads=None, pad=False,
                    overlap="auto", chunks=2):
    layer = _column(module, ctx, model, sub_blocks, kv_heads, pad)
    return _entry(ChunkedCopyToTPRegion, layer, ctx, ("",), overlap, chunks)


def rowwise_chunked(module, ctx, model, *, input_is_parallel=True, pad=False, sub_blocks=None,
                    overlap="auto", chunks=2):
    layer = rowwise(module, ctx, model, input_is_parallel=input_is_parallel, pad=pad,
                    sub_blocks=sub_blocks)
    return as_variant(layer, ChunkedRowOutput, overlap=_policy(ctx, overlap, chunks))


def sequence_region_chunked(module, ctx, model, *, columns, set=None, overlap="auto", chunks=2):
    module = attrs(module, ctx, model, set=set)
    return _entry(ChunkedGatherSequenceRegion, module, ctx, columns, overlap, chunks)


def colwise_sequence_chunked(module, ctx, model, *, sub_blocks=None, kv_heads=None,
                             overlap="auto", chunks=2):
    layer = _column(module, ctx, model, sub_blocks, kv_heads)
    return _entry(ChunkedGatherSequenceRegion, layer, ctx, ("",), overlap, chunks)


def rowwise_sequence_chunked(module, ctx, model, *, overlap="auto", chunks=2):
    return as_variant(rowwise_sequence(module, ctx, model), ChunkedRowScatter,
                      overlap=_policy(ctx, overlap, chunks))


def moe_chunked(module, ctx, model, *, hf_experts=False, sequence=False, overlap="auto",
                chunks=2):
    layer = moe(module, ctx, model, hf_experts=hf_experts, sequence=sequence)
    experts = layer if isinstance(layer, ParallelExperts) else layer.experts
    experts.overlap = _policy(ctx, overlap, chunks)
    return layer


STYLES = {style.__name__: style for style in (
    colwise, rowwise, gather_in, region, vocab, vocab_head, vocab_logits, kv_split, attrs,
    embed_colwise, grad_allreduce, reduce_out, mla_kv_a, shard_param, moe, sequence_scatter,
    sequence_region, colwise_sequence, rowwise_sequence, sequence_gather, sequence_partial,
    sequence_region_regather, colwise_regather, colwise_sequence_regather,
    region_chunked, colwise_fed, colwise_chunked, rowwise_chunked, sequence_region_chunked,
    colwise_sequence_chunked, rowwise_sequence_chunked, moe_chunked)}
PARAM_STYLES = ("shard_param",)  # their pattern names a parameter, not a module
_SET_BY_APPLIER = {"param"}  # shard_param's parameter name comes from the pattern


def style_options(style: str) -> dict[str, inspect.Parameter]:
    """The options a rule of ``style`` may carry: its keyword-only parameters."""
    return {name: p for name, p in inspect.signature(STYLES[style]).parameters.items()
            if p.kind is p.KEYWORD_ONLY and name not in _SET_BY_APPLIER}


def check_rule(pattern: str, rule: dict) -> None:
    """A ``ValueError`` naming the rule when its style is unknown, an option is not one of its
    style's, or a required option is missing."""
    style = rule.get("style")
    if style not in STYLES:
        raise ValueError(f"plan rule {pattern!r} has style {style!r}; valid styles are "
                         f"{tuple(STYLES)}")
    allowed = style_options(style)
    unknown = sorted(set(rule) - {"style"} - set(allowed))
    if unknown:
        raise ValueError(f"plan rule {pattern!r} (style {style!r}) has option(s) {unknown} that "
                         f"style does not take; its options are {sorted(allowed) or 'none'}")
    missing = sorted(n for n, p in allowed.items() if p.default is p.empty and n not in rule)
    if missing:
        raise ValueError(f"plan rule {pattern!r} (style {style!r}) needs option(s) {missing}")
