"""A tensor-parallel plan is data: module-name pattern → style (with options).

It prints, serialises to JSON and compares like any dict; :func:`apply_plan` applies it with one
short loop. Patterns match ``named_modules()`` names component by component with ``fnmatch``
syntax, so ``*`` stands for exactly one component (``layers.*.attn.wq`` matches
``layers.3.attn.wq``, and ``layer.*.output.dense`` does not match ``layer.0.attention.output.dense``);
every pattern must match at least one module.

Styles (what each does to the module it names):

============== =============================================================================
style          effect
============== =============================================================================
``colwise``    ``nn.Linear`` → :class:`ColumnParallelLinear` (options: ``sub_blocks``,
               ``kv_heads`` for key/value projections, replicated when fewer than ranks,
               ``reduce_input_grad``, ``gather_output``)
``rowwise``    ``nn.Linear`` → :class:`RowParallelLinear` (input already split by features)
``gather_in``  keep the module replicated; all-gather its input along the last dimension first
``region``     one ``copy_to_tp_region`` on the module's first input (positional, or the
               ``hidden_states`` keyword): the column-parallel children that share it (Q, K, V)
               then need a single backward all-reduce between them (``set``: as ``attrs``)
``vocab``      ``nn.Embedding`` → :class:`VocabParallelEmbedding` (vocabulary padded if needed)
``vocab_head`` an LM head with ``weight [V, d]`` → :class:`VocabParallelLMHead` (``tied_to``:
               the embedding whose sharded table it shares)
``vocab_logits`` an ``nn.Linear`` LM head → :class:`GatheredLMHead`: full logits out (``tied_to``
               as above; ``gather=False`` keeps them sharded for a vocab-parallel loss)
``kv_split``   the reference attention → :class:`FeatureSplitAttention` (strategy B; ``rope``)
``attrs``      set the module's per-rank attributes (``set``: name → value), e.g. the split size of
               a fused QKV output in Hugging Face's GPT-2
``moe``        the reference MoE → :class:`ParallelMoE`; a ``transformers`` experts module →
               :class:`ParallelExperts`: ``n_experts/ep`` experts per EP rank, each column→row
               over TP, tokens moved by all-to-alls over the EP group
============== =============================================================================
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field

from torch import nn

from ..comm.bucketing import mark_partial_grad
from ..comm.primitives import copy_to_tp_region, gather_from_tp_region
from ..layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from ..layers.attention import FeatureSplitAttention
from ..layers.head import GatheredLMHead, VocabParallelLMHead
from ..layers.linear import to_compute_dtype
from ..layers.moe import to_expert_parallel
from .sequence_parallel import SEQUENCE_STYLES

STYLES = ("colwise", "rowwise", "gather_in", "region", "vocab", "vocab_head", "vocab_logits",
          "kv_split", "attrs")
STYLES += ("moe",)  # mixture of experts (layers/moe.py)
STYLES += tuple(SEQUENCE_STYLES)  # sequence parallelism: see .sequence_parallel


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
             gather_output=False):
    _linear(module)
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


def _vocab_head(module, ctx, groups, tied_to=None, **loss_kwargs):
    shared = groups.module(tied_to).weight if tied_to else None
    return VocabParallelLMHead.from_dense(module, ctx, shared_weight=shared, **loss_kwargs)


def _vocab_logits(module, ctx, groups, tied_to=None, gather=True):
    shared = groups.module(tied_to).weight if tied_to else None
    return GatheredLMHead.from_dense(module, ctx, shared_weight=shared, gather=gather)


_APPLY = {
    "colwise": _colwise,
    "rowwise": lambda m, ctx, groups: RowParallelLinear.from_dense(_linear(m), ctx),
    "gather_in": _gather_in,
    "region": _region,
    "vocab": lambda m, ctx, groups: VocabParallelEmbedding.from_dense(_plain(m, nn.Embedding), ctx,
                                                                      pad_vocab=True),
    "vocab_head": _vocab_head,
    "vocab_logits": _vocab_logits,
    "kv_split": lambda m, ctx, groups, rope=False: FeatureSplitAttention(m, ctx, rope=rope),
    "attrs": _attrs,
    "moe": lambda m, ctx, groups: to_expert_parallel(m, ctx),
}
_APPLY.update(SEQUENCE_STYLES)


def matches(name: str, pattern: str) -> bool:
    """Component-wise ``fnmatch``: ``*`` never crosses a ``.``."""
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(fnmatch.fnmatchcase(a, b)
                                             for a, b in zip(parts, wanted))


def match_rules(model: nn.Module, plan: Plan) -> list[tuple[str, dict]]:
    """``(module name, rule)`` in plan order; every pattern must match a module."""
    names = [n for n, _ in model.named_modules() if n]
    matched = []
    for pattern, rule in plan.rules.items():
        hits = [n for n in names if matches(n, pattern)]
        if not hits:
            raise ValueError(f"plan rule {pattern!r} matches no module of "
                             f"{type(model).__name__}")
        matched += [(n, rule) for n in hits]
    return matched


def apply_plan(model: nn.Module, plan: Plan, ctx, groups) -> nn.Module:
    """Swap or hook every module the plan names, in plan order (so a tied head follows its
    embedding)."""
    for name, rule in match_rules(model, plan):
        options = {k: v for k, v in rule.items() if k != "style"}
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        new = _APPLY[rule["style"]](getattr(parent, child), ctx, groups, **options)
        setattr(parent, child, new)
    return model
