"""A tensor-parallel plan is data: module-name pattern → style (with options).

It prints, serialises to JSON and compares like any dict; :func:`apply_plan` applies it with one
short loop. Patterns match ``named_modules()`` names component by component with ``fnmatch``
syntax, so ``*`` stands for exactly one component (``layers.*.attn.wq`` matches
``layers.3.attn.wq``, and ``layer.*.output.dense`` does not match ``layer.0.attention.output.dense``);
every pattern must match at least one module (a parameter, for ``shard_param``).

Styles (what each does to the module it names):

================== ========================================================================
style              effect (communication: forward / backward)
================== ========================================================================
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
``gather_in``      keep the module replicated; all-gather its input along the last dimension
                   first. Fwd: all-gather; bwd: none
``region``         one ``copy_to_tp_region`` on the module's first input (positional, or the
                   ``hidden_states`` keyword): the column-parallel children that share it (Q, K,
                   V) then need a single backward all-reduce between them (``set``: as
                   ``attrs``). Fwd: none; bwd: all-reduce of the input gradient
``vocab``          ``nn.Embedding`` → :class:`VocabParallelEmbedding` (vocabulary padded if
                   needed). Fwd: all-reduce of the output; bwd: none
``embed_colwise``  ``nn.Embedding`` → :class:`ColumnParallelEmbedding` (embedding dimension
                   split, must divide by tp). Fwd: all-gather of the output; bwd: none
``vocab_head``     an LM head with ``weight [V, d]`` → :class:`VocabParallelLMHead` (``tied_to``:
                   the embedding whose sharded table it shares)
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
``reduce_out``     the module computes a partial sum on each rank; its output is all-reduced
                   (``region_inputs``: its parameters are sharded raw tensors, so each
                   floating-point input's gradient is all-reduced too). Fwd: all-reduce of the
                   output; bwd: none (``region_inputs``: all-reduce of each input gradient)
``mla_kv_a``       a replicated MLA ``kv_a_proj_with_mqa`` (``rope_dim``: its last ``rope_dim``
                   output features bypass the column-parallel ``kv_b_proj`` and feed this rank's
                   heads directly). Fwd: none; bwd: all-reduce of the gradient of those features
``shard_param``    the pattern names a parameter (not a module), sliced along ``dim`` (e.g.
                   per-head attention sinks, ``dim=0``). No communication
``moe``            the reference MoE → :class:`ParallelMoE`; a ``transformers`` experts module
                   → :class:`ParallelExperts`: ``n_experts/ep`` experts per EP rank, each
                   column→row over TP, tokens moved by all-to-alls over the EP group
                   (``hf_experts``: through :class:`~.hf_experts.HFExperts`, which keeps the
                   module's call and keys — Hugging Face's ``moe_tp_experts``). Fwd: all-to-alls
                   over EP, all-reduce of the experts' output over TP; bwd: all-to-alls, all-reduce
                   of their input gradient
================== ========================================================================

Hugging Face's styles map onto these in :mod:`.hf_translate` (``colwise_gather_output`` is
``colwise`` with ``gather_output``, ``rowwise_split_input`` is ``rowwise`` with
``input_is_parallel=False``, ``packed_colwise`` is ``colwise`` with two ``sub_blocks``,
``embedding_rowwise`` is ``vocab``, ``replicate`` and ``local_params`` need no rule).
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field

import torch
from torch import nn

from ..comm.bucketing import mark_partial_grad
from ..comm.primitives import copy_to_tp_region, gather_from_tp_region, reduce_from_tp_region
from ..layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from ..layers.attention import FeatureSplitAttention
from ..layers.embedding import ColumnParallelEmbedding
from ..layers.head import GatheredLMHead, VocabParallelLMHead
from ..layers.linear import dense_weight, to_compute_dtype
from ..layers.linear_variants import (PackedRowParallelLinear, PaddedColumnParallelLinear,
                                      PaddedRowParallelLinear)
from ..layers.moe import to_expert_parallel
from ..parallel.sharding import ShardSpec, set_shard_spec
from .hf_experts import HFExperts
from .sequence_parallel import SEQUENCE_STYLES

STYLES = ("colwise", "rowwise", "gather_in", "region", "vocab", "vocab_head", "vocab_logits",
          "kv_split", "attrs", "embed_colwise", "grad_allreduce", "reduce_out", "mla_kv_a",
          "shard_param")
STYLES += ("moe",)  # mixture of experts (layers/moe.py)
STYLES += tuple(SEQUENCE_STYLES)  # sequence parallelism: see .sequence_parallel
PARAM_STYLES = ("shard_param",)  # their pattern names a parameter, not a module


@dataclass
class Plan:
    """Module pattern → ``{"style": ..., **options}``, plus the attention strategy and why."""

    rules: dict[str, dict] = field(default_factory=dict)
    attention: str = "heads"
    reason: str = ""
    vocab: str = "parallel"  # embedding and LM head: "parallel" or "replicated"

    def __post_init__(self):
        self.rules = {k: ({"style": v} if isinstance(v, str) else dict(v))
                      for k, v in self.rules.items()}
        for pattern, rule in self.rules.items():
            if rule.get("style") not in STYLES:
                raise ValueError(f"plan rule {pattern!r} has style {rule.get('style')!r}; valid "
                                 f"styles are {STYLES}")

    def to_dict(self) -> dict:
        return {"attention": self.attention, "vocab": self.vocab, "reason": self.reason,
                "rules": self.rules}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        if "rules" not in data:  # a bare {pattern: style} mapping
            return cls(rules=data)
        return cls(rules=data["rules"], attention=data.get("attention", "heads"),
                   reason=data.get("reason", ""), vocab=data.get("vocab", "parallel"))

    def __str__(self) -> str:
        width = max((len(k) for k in self.rules), default=0)
        lines = [f"attention: {self.attention}, vocab: {self.vocab}"
                 + (f" ({self.reason})" if self.reason else "")]
        for pattern, rule in self.rules.items():
            options = ", ".join(f"{k}={v}" for k, v in rule.items() if k != "style")
            lines.append(f"  {pattern:<{width}}  {rule['style']}" + (f"({options})" if options else ""))
        return "\n".join(lines)


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


def _colwise(module, ctx, groups, sub_blocks=None, kv_heads=None, reduce_input_grad=True,
             gather_output=False, pad=False):
    _linear(module)
    if pad and dense_weight(module)[0].shape[0] % ctx.tp_size:
        if sub_blocks or kv_heads is not None:
            raise ValueError("colwise: pad=True cannot be combined with sub_blocks or kv_heads")
        return PaddedColumnParallelLinear.from_dense(module, ctx, gather_output=gather_output,
                                                     reduce_input_grad=reduce_input_grad)
    replicas = 1
    if kv_heads is not None and kv_heads < ctx.tp_size:
        replicas = ctx.tp_size // kv_heads  # fewer KV heads than ranks: replicate them
    layer = ColumnParallelLinear.from_dense(module, ctx, sub_blocks=tuple(sub_blocks or ()) or None,
                                            replicas=replicas, reduce_input_grad=reduce_input_grad,
                                            gather_output=gather_output)
    if replicas > 1:
        group = groups.replica_group(replicas)
        for p in layer.parameters():  # each replica saw only its query heads: sum the gradients
            mark_partial_grad(p, group)
    return layer


def _rowwise(module, ctx, groups, input_is_parallel=True, pad=False, sub_blocks=None):
    _linear(module)
    if sub_blocks:
        if not input_is_parallel or pad:
            raise ValueError("rowwise: sub_blocks needs input_is_parallel=True and no pad")
        return PackedRowParallelLinear.from_dense(module, ctx, sub_blocks=tuple(sub_blocks))
    if pad and dense_weight(module)[0].shape[1] % ctx.tp_size:
        return PaddedRowParallelLinear.from_dense(module, ctx, input_is_parallel=input_is_parallel)
    return RowParallelLinear.from_dense(module, ctx, input_is_parallel=input_is_parallel)


def _gather_in(module, ctx, groups):
    module.register_forward_pre_hook(
        lambda m, args: (gather_from_tp_region(args[0], ctx.tp_group, -1), *args[1:]))
    return module


def _region(module, ctx, groups, set=None):
    _attrs(module, ctx, groups, set)

    def enter(m, args, kwargs):  # in autocast's dtype: the backward all-reduce runs in it too
        if args:
            return (copy_to_tp_region(to_compute_dtype(args[0]), ctx.tp_group), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            hidden = copy_to_tp_region(to_compute_dtype(kwargs["hidden_states"]), ctx.tp_group)
            return args, {**kwargs, "hidden_states": hidden}
        raise ValueError(f"region style: {type(m).__name__} was called without a positional "
                         f"input or a hidden_states keyword")

    module.register_forward_pre_hook(enter, with_kwargs=True)
    return module


def _attrs(module, ctx, groups, set=None):
    for name, value in (set or {}).items():
        if not hasattr(module, name):
            raise ValueError(f"attrs style: {type(module).__name__} has no attribute {name!r}")
        setattr(module, name, value)
    return module


def _grad_allreduce(module, ctx, groups):
    for p in module.parameters():  # summed over the TP group at the end of backward, coalesced
        mark_partial_grad(p, ctx.tp_group)
    return module


def _reduce_out(module, ctx, groups, region_inputs=False):
    if region_inputs:  # raw sharded parameters inside: every input's gradient is partial too
        def enter(m, args, kwargs):
            def region(t):
                return (copy_to_tp_region(to_compute_dtype(t), ctx.tp_group)
                        if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
            return tuple(region(a) for a in args), {k: region(v) for k, v in kwargs.items()}

        module.register_forward_pre_hook(enter, with_kwargs=True)

    def reduce(m, args, out):
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"reduce_out style: {type(m).__name__} returned "
                             f"{type(out).__name__}, expected a tensor")
        return reduce_from_tp_region(out, ctx.tp_group)

    module.register_forward_hook(reduce)
    return module


def _mla_kv_a(module, ctx, groups, rope_dim):
    def split_grad_of_rope(m, args, out):
        kv, rope = out.split([out.shape[-1] - rope_dim, rope_dim], dim=-1)
        return torch.cat([kv, copy_to_tp_region(rope, ctx.tp_group)], dim=-1)

    module.register_forward_hook(split_grad_of_rope)
    return module


def _shard_param(module, ctx, groups, param, dim=0):
    """Replace ``module.<param>`` by this rank's slice along ``dim`` (with its ShardSpec)."""
    full = getattr(module, param)
    dim = dim % full.dim()
    spec = ShardSpec(tuple(full.shape), dim, ctx.tp_rank, ctx.tp_size)
    if full.shape[dim] % ctx.tp_size:
        raise ValueError(f"shard_param: {param} has size {full.shape[dim]} along dim {dim}, which "
                         f"does not divide by tp ({ctx.tp_size})")
    shard = nn.Parameter(spec.shard(full.detach()), requires_grad=full.requires_grad)
    setattr(module, param, set_shard_spec(shard, spec))
    return module


def _vocab_head(module, ctx, groups, tied_to=None, **loss_kwargs):
    shared = groups.module(tied_to).weight if tied_to else None
    return VocabParallelLMHead.from_dense(module, ctx, shared_weight=shared, **loss_kwargs)


def _vocab_logits(module, ctx, groups, tied_to=None, gather=True):
    shared = groups.module(tied_to).weight if tied_to else None
    return GatheredLMHead.from_dense(module, ctx, shared_weight=shared, gather=gather)


_APPLY = {
    "colwise": _colwise,
    "rowwise": _rowwise,
    "gather_in": _gather_in,
    "region": _region,
    "vocab": lambda m, ctx, groups: VocabParallelEmbedding.from_dense(_plain(m, nn.Embedding), ctx,
                                                                      pad_vocab=True),
    "vocab_head": _vocab_head,
    "vocab_logits": _vocab_logits,
    "kv_split": lambda m, ctx, groups, rope=False: FeatureSplitAttention(m, ctx, rope=rope),
    "attrs": _attrs,
    "embed_colwise": lambda m, ctx, groups: ColumnParallelEmbedding.from_dense(
        _plain(m, nn.Embedding), ctx),
    "grad_allreduce": _grad_allreduce,
    "reduce_out": _reduce_out,
    "mla_kv_a": _mla_kv_a,
    "shard_param": _shard_param,
    "moe": lambda m, ctx, groups, hf_experts=False: (HFExperts.from_dense(m, ctx) if hf_experts
                                                     else to_expert_parallel(m, ctx)),
}
_APPLY.update(SEQUENCE_STYLES)


def matches(name: str, pattern: str) -> bool:
    """Component-wise ``fnmatch``: ``*`` never crosses a ``.``."""
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(fnmatch.fnmatchcase(a, b)
                                             for a, b in zip(parts, wanted))


def match_rules(model: nn.Module, plan: Plan) -> list[tuple[str, dict]]:
    """``(module or parameter name, rule)`` in plan order; every pattern must match."""
    modules = [n for n, _ in model.named_modules() if n]
    params = [n for n, _ in model.named_parameters()]
    matched = []
    for pattern, rule in plan.rules.items():
        is_param = rule["style"] in PARAM_STYLES
        hits = [n for n in (params if is_param else modules) if matches(n, pattern)]
        if not hits:
            raise ValueError(f"plan rule {pattern!r} matches no "
                             f"{'parameter' if is_param else 'module'} of {type(model).__name__}")
        matched += [(n, rule) for n in hits]
    return matched


def apply_plan(model: nn.Module, plan: Plan, ctx, groups) -> nn.Module:
    """Swap or hook every module the plan names, in plan order (so a tied head follows its
    embedding)."""
    for name, rule in match_rules(model, plan):
        options = {k: v for k, v in rule.items() if k != "style"}
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if rule["style"] in PARAM_STYLES:  # the parameter's owner keeps its place
            _APPLY[rule["style"]](parent, ctx, groups, param=child, **options)
            continue
        dense = getattr(parent, child)
        trainable = {n: p.requires_grad for n, p in dense.named_parameters()}
        new = _APPLY[rule["style"]](dense, ctx, groups, **options)
        keep_requires_grad(name, trainable, new)
        setattr(parent, child, new)
    return model


def keep_requires_grad(name: str, trainable: dict[str, bool], new: nn.Module) -> None:
    """Give the parameters of ``new`` (the module that replaces module ``name``) the
    ``requires_grad`` of the dense parameters they come from (``trainable``: name → flag before
    the swap): by name, and for a parameter of another name (a fused Q|K|V from ``wq``, ``wk``,
    ``wv``) the flag all of them share. Fused parameters that were frozen differently cannot keep
    both flags: a ``ValueError``."""
    flags = set(trainable.values())
    for pname, param in new.named_parameters():
        if pname in trainable:
            param.requires_grad_(trainable[pname])
        elif len(flags) == 1:
            param.requires_grad_(next(iter(flags)))
        elif flags:
            frozen = sorted(n for n, on in trainable.items() if not on)
            shown = ", ".join(frozen[:3]) + (f" and {len(frozen) - 3} more" if len(frozen) > 3
                                             else "")
            raise ValueError(f"parallelize: {name}.{pname} is built from the {len(trainable)} "
                             f"parameters of {name}, of which only some are frozen ({shown}): "
                             f"freeze all of them or none before parallelize")
