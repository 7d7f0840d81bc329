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
``sequence``       the sequence-parallel layout's edges (``kind``): ``scatter`` (a
                   :class:`ScatterSequence` region), ``gather`` (a :class:`GatherSequenceOutput`,
                   its parameters' gradients summed over TP), ``partial`` (the parameters'
                   gradients summed over TP)
================== =====================================================================

Sixteen kinds; what were renamed variants are options of the communicating kinds:

* ``colwise(entry="copy"|"sequence", regather=, fed=, overlap=, chunks=)`` — ``entry="sequence"``:
  behind its own :class:`GatherSequenceRegion` (no input-gradient all-reduce); ``regather=True``:
  a :class:`RegatherColumnLinear` (no input kept, the share all-gathered again in backward; with
  ``entry="sequence"`` behind its own :class:`RegatherSequenceRegion`); ``fed=True``: inside a
  chunked region, its output from the region's collective matmul; ``overlap="chunked"|"auto"``:
  the layer's own entry op (``copy_matmul``) runs in the policy's chunks (behind
  ``entry="sequence"``: its own :class:`GatherSequenceRegion` with the layer as its column, one
  ``gather_matmul``, ``regather`` an option of it); ``chunks=1`` / ``overlap="none"`` is the same
  class in one chunk.
* ``rowwise(exit="all_reduce"|"reduce_scatter", overlap=, chunks=)`` — ``reduce_scatter``:
  :class:`SequenceParallelRowLinear`; ``overlap``: the matmul and its exit collective in chunks
  (the same class: its exit op is ``matmul_all_reduce`` / ``matmul_reduce_scatter`` at any chunk
  count, the policy an attribute).
* ``region(entry="copy"|"sequence", regather=, columns=, overlap=, chunks=)`` — a
  :class:`CopyToTPRegion` (``sequence``: a :class:`GatherSequenceRegion`; ``regather`` without
  ``overlap``: :class:`RegatherSequenceRegion`); ``overlap``: the same class with ``columns``,
  the entry and those children as one collective matmul (:mod:`ops_transformer.layers.fused_entry`).
* ``moe(sequence=, overlap=, chunks=)`` — ``sequence``: on the gathered sequence
  (:class:`FullSequenceRegion`); ``overlap``: dispatch and combine in chunks
  (:mod:`ops_transformer.layers.moe_overlap`).

:mod:`.sequence_plan` and :mod:`.overlap_plan` set these options on a plan's rules. The names of
earlier versions (``colwise_sequence``, ``sequence_region_regather``, ``rowwise_chunked``,
``sequence_scatter``, … : :data:`LEGACY_STYLES`) keep working in users' plans: mapped once, when
the plan is built, with a deprecation note in the log.

Hugging Face's styles map onto these in :mod:`.hf_translate` (``colwise_gather_output`` is
``colwise`` with ``gather_output``, ``rowwise_split_input`` is ``rowwise`` with
``input_is_parallel=False``, ``packed_colwise`` is ``colwise`` with two ``sub_blocks``,
``embedding_rowwise`` is ``vocab``, ``replicate`` and ``local_params`` need no rule).
"""

from __future__ import annotations

import inspect
import logging

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
from ..layers.fused_entry import FedColumn, as_variant
from ..layers.regions import (CopyToTPRegion, FullSequenceRegion, GatherInput, GatherSequenceOutput,
                              GatherSequenceRegion, ReduceOutput, RegatherSequenceRegion,
                              RopeGradRegion, ScatterSequence)
from ..layers.sequence_parallel import SequenceParallelRowLinear, mark_partial
from ..layers.sequence_regather import RegatherColumnLinear
from ..parallel.sharding import ShardSpec, set_shard_spec
from ..planner.strategies import kv_replicas
from .hf_experts import HFExperts

log = logging.getLogger("ops_transformer")


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


def _column_layer(module, ctx, sub_blocks=None, kv_heads=None, reduce_input_grad=True,
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


def _check_choice(style: str, name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{style}: {name} must be one of {choices}, got {value!r}")


_ENTRIES = {"copy": "copy", "all_reduce": "copy", "sequence": "sequence", "all_gather": "sequence"}


def _entry_of(style: str, entry: str) -> str:
    """``copy`` (alias ``all_reduce``: its backward collective) or ``sequence`` (alias
    ``all_gather``: its forward one)."""
    _check_choice(style, "entry", entry, tuple(_ENTRIES))
    return _ENTRIES[entry]


def _overlap_of(style: str, overlap, chunks) -> str:
    """The chunking mode: ``overlap`` as given, or (``None``) ``chunked`` when ``chunks > 1``
    and ``none`` for one chunk — one chunk is the plain layer."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"{style}: chunks must be an integer >= 1, got {chunks!r}")
    if overlap is None:
        return "chunked" if chunks > 1 else "none"
    _check_choice(style, "overlap", overlap, ("none", "chunked", "auto"))
    return overlap


def colwise(module, ctx, model, *, sub_blocks=None, kv_heads=None, reduce_input_grad=True,
            gather_output=False, pad=False, entry="copy", regather=False, fed=False,
            overlap=None, chunks=1):
    """``entry``: how the layer's input enters the region — ``copy`` (replicated; backward
    all-reduce of the input gradient, none with ``reduce_input_grad=False``: a region reduces
    it) or ``sequence`` (all-gathered from the sequence-parallel layout, backward
    reduce-scatter); ``regather``: keep no input for backward (all-gather the share again
    there); ``fed``: the layer's output comes from its region's collective matmul; ``overlap``
    ``chunked``/``auto``: the layer's entry op in ``chunks`` (one implementation at any chunk
    count: the policy is an attribute of the same layer)."""
    entry, overlap = _entry_of("colwise", entry), _overlap_of("colwise", overlap, chunks)
    if fed:
        return as_variant(_column_layer(module, ctx, sub_blocks, kv_heads, False, pad=pad),
                          FedColumn)
    own = reduce_input_grad and entry == "copy" and not regather
    layer = _column_layer(module, ctx, sub_blocks, kv_heads, reduce_input_grad=own,
                          gather_output=gather_output, pad=pad)
    fused = overlap != "none" and entry == "sequence" and reduce_input_grad and not gather_output
    if regather and not fused:
        layer = RegatherColumnLinear.from_column(layer)
        return RegatherSequenceRegion.wrap(layer, ctx.tp_group) if entry == "sequence" else layer
    if overlap != "none" and own:  # its own entry op, the chunks from the policy
        layer.overlap = _policy(ctx, overlap, chunks)
    if entry != "sequence":
        return layer
    if fused:  # the entry's op computes the layer (and, regather, keeps only the share)
        return _entry(GatherSequenceRegion, layer, ctx, ("",), overlap, chunks,
                      regather=regather)
    return GatherSequenceRegion.wrap(layer, ctx.tp_group)


def rowwise(module, ctx, model, *, input_is_parallel=True, pad=False, sub_blocks=None,
            exit="all_reduce", overlap=None, chunks=1):
    """``exit``: the output's collective, ``all_reduce`` (replicated output) or
    ``reduce_scatter`` (this rank's share of the sequence: :class:`SequenceParallelRowLinear`);
    ``overlap`` ``chunked``/``auto``: the matmul and that collective in ``chunks``."""
    _check_choice("rowwise", "exit", exit, ("all_reduce", "reduce_scatter"))
    overlap = _overlap_of("rowwise", overlap, chunks)
    _linear(module)
    if exit == "reduce_scatter":
        layer = SequenceParallelRowLinear.from_dense(module, ctx)
    elif sub_blocks:
        if not input_is_parallel or pad:
            raise ValueError("rowwise: sub_blocks needs input_is_parallel=True and no pad")
        layer = PackedRowParallelLinear.from_dense(module, ctx, sub_blocks=tuple(sub_blocks))
    elif pad and dense_weight(module)[0].shape[1] % ctx.tp_size:
        layer = PaddedRowParallelLinear.from_dense(module, ctx,
                                                   input_is_parallel=input_is_parallel)
    else:
        layer = RowParallelLinear.from_dense(module, ctx, input_is_parallel=input_is_parallel)
    if overlap != "none":  # the one exit op, its chunks from the policy (one under "none")
        layer.overlap = _policy(ctx, overlap, chunks)
    return layer


def gather_in(module, ctx, model):
    return GatherInput.wrap(module, ctx.tp_group)


def attrs(module, ctx, model, *, set=None):
    for name, value in (set or {}).items():
        if not hasattr(module, name):
            raise ValueError(f"attrs style: {type(module).__name__} has no attribute {name!r}")
        setattr(module, name, value)
    return module


def region(module, ctx, model, *, set=None, entry="copy", regather=False, columns=None,
           overlap=None, chunks=1):
    """``entry``: ``copy`` (one ``copy_to_tp_region`` on the input: a backward all-reduce for
    the column children) or ``sequence`` (all-gather of the tokens; backward reduce-scatter;
    ``regather``: only this rank's share kept); ``overlap`` ``chunked``/``auto``: the entry and
    its ``columns`` children (``fed`` column layers) as one collective matmul in ``chunks``."""
    entry, overlap = _entry_of("region", entry), _overlap_of("region", overlap, chunks)
    module = attrs(module, ctx, model, set=set)
    if overlap != "none":
        if not columns:
            raise ValueError("region: overlap needs columns (the column children it computes)")
        if regather and entry != "sequence":
            raise ValueError("region: regather=True re-gathers a sequence entry "
                             "(entry='sequence')")
        if entry == "sequence":
            return _entry(GatherSequenceRegion, module, ctx, columns, overlap, chunks,
                          regather=regather)
        return _entry(CopyToTPRegion, module, ctx, columns, overlap, chunks)
    if entry == "copy":
        return CopyToTPRegion.wrap(module, ctx.tp_group)
    cls = RegatherSequenceRegion if regather else GatherSequenceRegion
    return cls.wrap(module, ctx.tp_group)


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


def moe(module, ctx, model, *, hf_experts=False, sequence=False, overlap=None, chunks=1):
    """``sequence``: under sequence parallelism the layer runs on the gathered sequence
    (:class:`FullSequenceRegion`); ``overlap`` ``chunked``/``auto``: dispatch and combine in
    ``chunks``."""
    overlap = _overlap_of("moe", overlap, chunks)
    layer = HFExperts.from_dense(module, ctx) if hf_experts else to_expert_parallel(module, ctx)
    if overlap != "none":
        experts = layer if isinstance(layer, ParallelExperts) else layer.experts
        experts.overlap = _policy(ctx, overlap, chunks)
    return FullSequenceRegion.wrap(layer, ctx.tp_group) if sequence else layer


def sequence(module, ctx, model, *, kind):
    """The sequence-parallel layout's edges: ``scatter`` (the first layer keeps this rank's share
    of its input, backward all-gather), ``gather`` (the final norm runs on the share and its
    output is all-gathered; its parameters' gradients summed over TP), ``partial`` (a module run
    on the share: its parameters' gradients summed over TP)."""
    _check_choice("sequence", "kind", kind, ("scatter", "gather", "partial"))
    if kind == "scatter":
        return ScatterSequence.wrap(module, ctx.tp_group)
    mark_partial(module, ctx.tp_group)
    return GatherSequenceOutput.wrap(module, ctx.tp_group) if kind == "gather" else module


def _policy(ctx, overlap, chunks) -> OverlapPolicy:
    return OverlapPolicy(overlap, chunks, getattr(ctx, "profile", None))  # agreed by every rank


def _entry(cls, module, ctx, columns, overlap, chunks, **settings):
    return cls.wrap(module, ctx.tp_group, columns=tuple(columns),
                    overlap=_policy(ctx, overlap, chunks), **settings)


STYLES = {style.__name__: style for style in (
    colwise, rowwise, gather_in, region, vocab, vocab_head, vocab_logits, kv_split, attrs,
    embed_colwise, grad_allreduce, reduce_out, mla_kv_a, shard_param, moe, sequence)}
# The renamed variants of earlier versions, mapped once when a plan is built (a deprecation
# note in the log): a variant is an option value of its kind.
_AUTO = {"overlap": "auto", "chunks": 2}  # what the earlier chunked styles defaulted to
LEGACY_STYLES = {
    "colwise_sequence": ("colwise", {"entry": "sequence"}),
    "colwise_regather": ("colwise", {"regather": True}),
    "colwise_sequence_regather": ("colwise", {"entry": "sequence", "regather": True}),
    "colwise_fed": ("colwise", {"fed": True}),
    "colwise_chunked": ("colwise", _AUTO),
    "colwise_sequence_chunked": ("colwise", {"entry": "sequence", **_AUTO}),
    "rowwise_sequence": ("rowwise", {"exit": "reduce_scatter"}),
    "rowwise_chunked": ("rowwise", _AUTO),
    "rowwise_sequence_chunked": ("rowwise", {"exit": "reduce_scatter", **_AUTO}),
    "sequence_region": ("region", {"entry": "sequence"}),
    "sequence_region_regather": ("region", {"entry": "sequence", "regather": True}),
    "region_chunked": ("region", _AUTO),
    "sequence_region_chunked": ("region", {"entry": "sequence", **_AUTO}),
    "moe_chunked": ("moe", _AUTO),
    "sequence_scatter": ("sequence", {"kind": "scatter"}),
    "sequence_gather": ("sequence", {"kind": "gather"}),
    "sequence_partial": ("sequence", {"kind": "partial"}),
}
_NOTED: set[str] = set()


def modern_rule(pattern: str, rule: dict) -> dict:
    """``rule`` with an earlier version's style name (:data:`LEGACY_STYLES`) as its kind and
    options (the rule's own options win: ``colwise_chunked`` with ``overlap="chunked"`` stays
    chunked); a deprecation note, once per name."""
    style = rule.get("style")
    if style not in LEGACY_STYLES:
        return rule
    kind, options = LEGACY_STYLES[style]
    if style not in _NOTED:
        _NOTED.add(style)
        log.warning("plan style %r is deprecated: it is %s(%s) (rule %r)", style, kind,
                    ", ".join(f"{k}={v!r}" for k, v in options.items()), pattern)
    return {**options, **rule, "style": kind}


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
