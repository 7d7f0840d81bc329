"""A tensor-parallel plan is data: module-name pattern → style (with options).

It prints, serialises to JSON and compares like any dict; :func:`apply_plan` applies it with one
short loop. Patterns match ``named_modules()`` names component by component with ``fnmatch``
syntax, so ``*`` stands for exactly one component (``layers.*.attn.wq`` matches
``layers.3.attn.wq``, and ``layer.*.output.dense`` does not match ``layer.0.attention.output.dense``);
every pattern must match at least one module (a parameter, for ``shard_param``).

The styles (what each rule does to the module it names, and what it communicates) are in
:mod:`.styles`; a rule's options are checked against its style when the plan is built, so a
misspelt option is a ``ValueError`` naming it.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field

from torch import nn

from .styles import PARAM_STYLES, STYLES, check_rule, modern_rule


@dataclass
class Plan:
    """Module pattern → ``{"style": ..., **options}``, plus the attention strategy and why."""

    rules: dict[str, dict] = field(default_factory=dict)
    attention: str = "heads"
    reason: str = ""
    vocab: str = "parallel"  # embedding and LM head: "parallel" or "replicated"

    def __post_init__(self):
        self.rules = {k: modern_rule(k, {"style": v} if isinstance(v, str) else dict(v))
                      for k, v in self.rules.items()}
        for pattern, rule in self.rules.items():
            check_rule(pattern, rule)

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


def apply_plan(model: nn.Module, plan: Plan, ctx) -> nn.Module:
    """Swap or wrap every module the plan names, in plan order (so a tied head follows its
    embedding): ``styles[rule["style"]](module, ctx, model, **options)`` takes the place of the
    module, in the module's mode (``train``/``eval``); a parameter style (``shard_param``)
    changes the parameter's owner in place."""
    for name, rule in match_rules(model, plan):
        style, options = STYLES[rule["style"]], {k: v for k, v in rule.items() if k != "style"}
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if rule["style"] in PARAM_STYLES:  # the parameter's owner keeps its place
            style(parent, ctx, model, param=child, **options)
        else:
            dense = getattr(parent, child)
            trainable = {n: p.requires_grad for n, p in dense.named_parameters()}
            new = style(dense, ctx, model, **options)
            new.train(dense.training)  # a module built for it starts in training mode
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
