"""What the cost model prices, as objects: the model's spec, the rank grid (:class:`Layout`) and
the options (:class:`CostOptions`, or anything with the same attributes: a
:class:`~ops_transformer.parallelize.ParallelOptions` whose ``attention`` and ``vocab`` are
chosen, the search's :class:`~ops_transformer.planner.search.Options`).

``model_comm_per_step(spec, layout, options, batch=, seq=)``,
``activation_bytes_per_layer(spec, layout, options, batch=, seq=)`` and
``LocalTimeModel.step_time(spec, layout, options, nproc=, batch=, seq=)`` read them here, by
attribute (the planner sits below ``parallelize`` and ``training``: it imports neither, and a
``RunConfig``'s ``layout`` section serves as well as a :class:`Layout`). Their older keyword forms (``tp=``, ``attention=``, ``sequence_parallel=``, …)
build these objects with :func:`legacy_arguments` and give the same numbers
(``tests/planner/test_cost_objects.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

RECOMPUTE = ("none", "selective", "full", "ops")  # the policies the formulas price
DEGREES = ("tp", "dp", "ep", "cp", "pp")
SEQUENCE_PARALLEL = (False, True, "regather")


@dataclass(frozen=True)
class Layout:
    """The rank grid ``pp × dp × ep × cp × tp`` the cost model prices (each degree ≥ 1)."""

    tp: int = 1
    dp: int = 1
    ep: int = 1
    cp: int = 1
    pp: int = 1

    def __post_init__(self):
        for name in DEGREES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"layout.{name} must be an integer >= 1, got {value!r}")


def degree(layout, name: str) -> int:
    """``layout``'s degree ``name`` (1 when it has no such attribute or leaves it unset), checked
    as :class:`Layout` checks it."""
    value = getattr(layout, name, 1)
    value = 1 if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"layout.{name} must be an integer >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class CostOptions:
    """The options the cost model reads, for a caller without a ``ParallelOptions`` (the same
    names and meanings; ``attention`` and ``vocab`` chosen, not ``auto``): the attention strategy,
    the vocabulary split, sequence parallelism (``True`` or ``"regather"``), the recompute policy
    and the chunked overlap (``overlap``, ``chunks``)."""

    attention: str = "heads"
    vocab: str = "parallel"
    sequence_parallel: bool | str = False
    recompute: str = "none"
    overlap: str = "none"
    chunks: int = 2

    def __post_init__(self):
        sp = self.sequence_parallel
        if not (sp is True or sp is False or sp == "regather"):
            raise ValueError(f"options.sequence_parallel must be one of {SEQUENCE_PARALLEL}, got "
                             f"{self.sequence_parallel!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"options.recompute must be one of {RECOMPUTE}, got "
                             f"{self.recompute!r}")
        if isinstance(self.chunks, bool) or not isinstance(self.chunks, int) or self.chunks < 1:
            raise ValueError(f"options.chunks must be an integer >= 1, got {self.chunks!r}")
        for name in ("attention", "vocab"):
            if getattr(self, name) == "auto":
                raise ValueError(f"options.{name} is 'auto': the cost model prices a chosen "
                                 f"{name} (the plan's), not the choice")

    @classmethod
    def of(cls, options=None, **changes) -> CostOptions:
        """``options`` (any object with some of these attributes; ``None``: the defaults) as
        :class:`CostOptions`, with ``changes``. A ``ParallelOptions`` whose ``attention`` is
        ``auto`` gives its :attr:`plan_attention` (``heads`` under sequence parallelism)."""
        if isinstance(options, CostOptions):
            return replace(options, **changes) if changes else options
        values = {}
        for name in ("attention", "vocab", "sequence_parallel", "recompute", "overlap",
                     "chunks"):
            if hasattr(options, name):
                values[name] = getattr(options, name)
        if values.get("attention") == "auto":
            values["attention"] = getattr(options, "plan_attention", "auto")
        return cls(**{**values, **changes})


@dataclass(frozen=True)
class Shape:
    """The sizes of a layer the formulas read, from a
    :class:`~ops_transformer.models.GPTConfig` or a :class:`~.specs.ModelSpec`."""

    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    gated: bool
    dropout: bool


def shape_of(spec) -> Shape:
    """:class:`Shape` of ``spec``: a ``GPTConfig`` (``d_model``, ``n_heads``, …) or a
    ``ModelSpec`` (``hidden``, ``heads``, …)."""
    if hasattr(spec, "d_model"):
        return Shape(spec.d_model, spec.n_heads, spec.n_kv_heads, spec.d_ff,
                     spec.mlp == "swiglu", spec.dropout > 0)
    if hasattr(spec, "hidden"):
        return Shape(spec.hidden, spec.heads, spec.kv_heads, spec.ffn,
                     spec.ffn_type == "swiglu", spec.dropout > 0)
    raise TypeError(f"spec must be a GPTConfig or a ModelSpec, got {type(spec).__name__}")


def is_legacy(layout, keywords: dict) -> bool:
    """Whether a call is in the older form: a degree (``tp``) where the layout goes, or ``tp=``."""
    return (isinstance(layout, int) and not isinstance(layout, bool)) or (
        layout is None and "tp" in keywords)


def positional_of(*values) -> tuple:
    """The positional arguments a call gave: ``values`` without the trailing unset ones."""
    values = list(values)
    while values and values[-1] is None:
        values.pop()
    return tuple(values)


def legacy_arguments(function: str, names: tuple[str, ...], positional: tuple,
                     keywords: dict, allowed: tuple[str, ...]) -> dict:
    """The older form's loose arguments by name: ``positional`` in ``names`` order, then
    ``keywords``; a ``TypeError`` worded as Python's for a repeated or an unknown one."""
    if len(positional) > len(names):
        raise TypeError(f"{function}() takes at most {len(names)} positional arguments after "
                        f"the model ({len(positional)} given)")
    out = dict(zip(names, positional))
    for name, value in keywords.items():
        if name in out:
            raise TypeError(f"{function}() got multiple values for argument {name!r}")
        if name not in allowed:
            raise TypeError(f"{function}() got an unexpected keyword argument {name!r}")
        out[name] = value
    return out
