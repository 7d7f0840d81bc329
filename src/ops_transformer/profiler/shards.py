"""Which dimension of each activation a tensor-parallel plan shards, followed through one forward
pass — for the ``implicit_broadcast`` diagnostic (:mod:`.broadcasts`).

:class:`ShardTracker` is a ``TorchFunctionMode`` plus forward hooks. Sources: the output of every
:class:`~ops_transformer.layers.ColumnParallelLinear` that keeps its output split (its last
dimension: this rank's ``out/tp`` features) and of every
:class:`~ops_transformer.layers.sequence_parallel.SequenceParallelRowLinear` (dim 1: this rank's
``s/t`` tokens). Each later operation carries the sharded dimension to its output:

============================ ================================================================
operation                    sharded dimension of the output
============================ ================================================================
view, reshape, flatten …     the output dimension that holds the input's outermost position in
                             the shard (row-major order: splitting ``h/tp`` into ``(nh/tp, hd)``
                             shards the heads; merging them back shards the merged one)
transpose, permute, movedim  moved with the dimension
linear, matmul, attention    kept on a batch or row/column dimension; gone when the product
                             contracts it (the row-parallel linear: partial sums, not a shard)
a reduction over it          none: the result is a **local statistic** of this rank's slice
anything else                the same dimension when the output has the input's rank
============================ ================================================================

A local statistic stays one through element-wise work (``rsqrt(var + eps)``), until a collective
of the package reduces it (the ledger sees the tensor: then it is the global statistic). An
element-wise operation that combines a tensor sharded along ``d`` with a local statistic of size 1
(or no dimension) along ``d`` is a finding: the statistic of the local ``n/tp`` slice is broadcast
back over it where the dense model reduces over all ``n``. So are a norm and a softmax over a
sharded dimension (the same broadcast inside one kernel). Broadcasts of tensors that do not come
from a shard — rotary tables over the heads, masks, parameters of size 1 — are not: they are the
same on every rank, whatever the plan splits.
"""

from __future__ import annotations

import math

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from ..comm.ledger import CommLedger
from ..layers.linear import ColumnParallelLinear
from ..layers.sequence_parallel import SequenceParallelRowLinear

ELEMENTWISE = {"add", "sub", "mul", "div", "true_divide", "subtract", "multiply", "divide", "pow",
               "where", "maximum", "minimum", "fmax", "fmin", "addcmul", "addcdiv", "lerp",
               "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__", "__mul__",
               "__rmul__", "__imul__", "__truediv__", "__rtruediv__", "__itruediv__", "__pow__",
               "__rpow__", "add_", "sub_", "mul_", "div_", "masked_fill", "copysign"}
REDUCTIONS = {"sum", "mean", "var", "std", "norm", "amax", "amin", "max", "min", "logsumexp",
              "prod", "nansum", "nanmean", "vector_norm", "var_mean", "std_mean", "aminmax"}
NORMS = {"layer_norm", "rms_norm"}
# where a reduction's dim and keepdim sit among its positional arguments (default: 1 and 2)
REDUCTION_ARGS = {"norm": (2, 3), "vector_norm": (2, 3), "var": (1, 3), "std": (1, 3),
                  "var_mean": (1, 3), "std_mean": (1, 3)}
SOFTMAXES = {"softmax", "log_softmax", "normalize"}  # a statistic over ``dim``, in one call
RESHAPES = {"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as"}
CONTRACTIONS = {"linear", "matmul", "__matmul__", "mm", "bmm", "scaled_dot_product_attention"}
STAT = "stat"  # the mark of a local statistic
# new tensors of an explicit shape (a chunked collective matmul's output buffer): not a shard of
# the tensor they are called on
FACTORIES = {"new_empty", "new_zeros", "new_ones", "new_full", "new_tensor"}


def remap(shape_in, d: int, shape_out) -> int | None:
    """The dimension of ``shape_out`` (a reshape of ``shape_in``, row-major) that carries the
    shard of dimension ``d``: the outermost output dimension inside ``d``'s span when a reshape
    splits it (``h/tp`` → ``(nh/tp, hd)``: the heads, even when this rank holds one), else the one
    that holds ``d``'s span when a reshape merges it into a larger one; ``None`` if neither."""
    after = math.prod(shape_in[d + 1:])
    top = after * shape_in[d]
    inner, inside, holding = 1, None, None
    for j in reversed(range(len(shape_out))):
        low, high = inner, inner * shape_out[j]
        if after <= low and high <= top:
            inside = j  # the last one kept is the outermost
        elif low < top <= high and holding is None:
            holding = j
        inner = high
    return inside if inside is not None else holding


def _inserted(ndim_out: int, mark: int, dim: int) -> int:
    """The shard's dimension after ``unsqueeze(dim)``."""
    return mark + (dim % ndim_out <= mark)


def _dims(arg, ndim: int) -> tuple[int, ...]:
    if arg is None:
        return tuple(range(ndim))
    dims = (arg,) if isinstance(arg, int) else tuple(arg)
    return tuple(d % ndim for d in dims) if ndim else ()


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


class ShardTracker(TorchFunctionMode):
    """``with ShardTracker(model, tp) as tracker: model(...)``; ``tracker.findings`` lists each
    implicit broadcast of a local statistic over a sharded dimension (module docstring), as
    ``{"module", "op", "shapes", "dim", "local", "full"}`` (``full`` is ``local · tp``)."""

    def __init__(self, model: torch.nn.Module, tp: int):
        super().__init__()
        self.model, self.tp = model, tp
        self.marks = WeakIdKeyDictionary()  # tensor -> sharded dim, or STAT
        self.findings: list[dict] = []
        self._stack: list[str] = []
        self._handles = []

    # -- set-up: where the shards come from, which module runs, collectives seen
    def __enter__(self):
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_pre_hook(
                lambda m, a, name=name or type(module).__name__: self._stack.append(name)))
            self._handles.append(module.register_forward_hook(self._leave, always_call=True))
            if isinstance(module, ColumnParallelLinear) and not module.gather_output:
                self._handles.append(module.register_forward_hook(
                    lambda m, a, out: self._source(out, -1)))
            elif isinstance(module, SequenceParallelRowLinear):
                self._handles.append(module.register_forward_hook(
                    lambda m, a, out: self._source(out, 1)))
        self._ledger = _ClearingLedger(self.marks).__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self._ledger.__exit__(*exc)
        for h in self._handles:
            h.remove()
        return out

    def _leave(self, module, args, output) -> None:
        if self._stack:
            self._stack.pop()

    def _source(self, out, dim: int) -> None:
        if isinstance(out, torch.Tensor) and out.dim() >= 2 and self.tp > 1:
            self.marks[out] = dim % out.dim()

    # -- the rules
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if not self._stack or not self.marks:  # outside the model's forward, or nothing sharded
            return result
        name = getattr(func, "__name__", "")
        inputs = [t for t in _tensors(list(args) + list(kwargs.values())) if t in self.marks]
        if inputs:
            try:
                self._propagate(name, args, kwargs, inputs, result)
            except (IndexError, TypeError, ValueError, RuntimeError):
                pass  # an argument form the rules do not know: the output stays unmarked
        return result

    def _propagate(self, name, args, kwargs, inputs, result) -> None:
        first = inputs[0]
        mark = self.marks[first]
        outputs = _tensors(result)
        if name in ELEMENTWISE or (name in ("max", "min") and len(args) > 1
                                   and isinstance(args[1], torch.Tensor)):
            self._elementwise(name, [t for t in _tensors(list(args)) if t is not None], outputs)
        elif name in REDUCTIONS:
            self._reduction(name, first, mark, args, kwargs, outputs)
        elif name in FACTORIES:
            return
        elif mark == STAT:
            for o in outputs:
                self.marks[o] = STAT
        elif name in NORMS or name in SOFTMAXES:
            self._fused(name, first, mark, args, kwargs)
            self._keep(first, mark, outputs)
        elif name in RESHAPES:
            for o in outputs:
                self._set(o, remap(tuple(first.shape), mark, tuple(o.shape)))
        elif name in ("unsqueeze", "squeeze"):
            self._squeezed(name, first, mark, args, kwargs, outputs)
        elif name in ("transpose", "swapaxes", "swapdims", "permute", "movedim", "moveaxis", "t"):
            self._moved(name, first, mark, args, kwargs, outputs)
        elif name in CONTRACTIONS:
            self._contracted(name, args, outputs)
        else:
            self._keep(first, mark, outputs)

    def _set(self, t: torch.Tensor, mark) -> None:
        if mark is None:
            self.marks.pop(t, None)
        else:
            self.marks[t] = mark

    def _keep(self, first, mark, outputs) -> None:
        for o in outputs:
            self._set(o, mark if o.dim() == first.dim() else None)

    def _reduction(self, name, first, mark, args, kwargs, outputs) -> None:
        at_dim, at_keep = REDUCTION_ARGS.get(name, (1, 2))
        dim = kwargs.get("dim", args[at_dim] if len(args) > at_dim else None)
        keepdim = kwargs.get("keepdim", args[at_keep] if len(args) > at_keep else False)
        if mark == STAT:
            new = STAT
        else:
            reduced = _dims(dim, first.dim())
            new = STAT if mark in reduced else (
                mark if keepdim else mark - sum(1 for r in reduced if r < mark))
        for o in outputs:
            if o.is_floating_point():
                self.marks[o] = new

    def _elementwise(self, name, operands, outputs) -> None:
        marked = [(t, self.marks.get(t)) for t in operands]
        sharded = [(t, m) for t, m in marked if m is not None and m != STAT]
        stats = [t for t, m in marked if m == STAT]
        for a, d in sharded:
            for b in stats:
                at = d - (a.dim() - b.dim())
                # size 1 (or no dimension) there, or expanded to it (stride 0): a broadcast
                if a.shape[d] > 1 and (at < 0 or b.shape[at] == 1 or b.stride(at) == 0):
                    shape = tuple(1 if stride == 0 else n for n, stride in zip(b.shape, b.stride()))
                    self._found(name, tuple(a.shape), shape, d)  # (an expanded size shown as 1)
        for o in outputs:
            if sharded:
                a, d = sharded[0]
                self._set(o, d + o.dim() - a.dim())
            elif stats:
                self.marks[o] = STAT

    def _fused(self, name, first, mark, args, kwargs) -> None:
        """A norm or softmax whose statistic spans the sharded dimension."""
        ndim = first.dim()
        if name in NORMS:  # over the last len(normalized_shape) dimensions
            shape = kwargs.get("normalized_shape", args[1] if len(args) > 1 else ())
            spans = mark >= ndim - (1 if isinstance(shape, int) else len(shape))
        else:  # softmax(x, dim), normalize(x, p=2, dim=1)
            at = 2 if name == "normalize" else 1
            dim = kwargs.get("dim", args[at] if len(args) > at else (1 if at == 2 else None))
            spans = dim is not None and dim % ndim == mark
        if spans and first.shape[mark] > 1:
            stat = tuple(1 if i == mark else n for i, n in enumerate(first.shape))
            self._found(name, tuple(first.shape), stat, mark)

    def _squeezed(self, name, first, mark, args, kwargs, outputs) -> None:
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        for o in outputs:
            if name == "unsqueeze":
                self._set(o, _inserted(o.dim(), mark, dim))
                continue
            gone = [i for i in _dims(dim, first.dim()) if first.shape[i] == 1]
            self._set(o, None if mark in gone else mark - sum(1 for i in gone if i < mark))

    def _moved(self, name, first, mark, args, kwargs, outputs) -> None:
        ndim = first.dim()
        order = list(range(ndim))
        if name == "permute":
            order = list(args[1:] if len(args) > 2 or isinstance(args[1], int) else args[1])
        elif name in ("movedim", "moveaxis"):
            src, dst = _dims(args[1], ndim), _dims(args[2], ndim)
            order = [d for d in range(ndim) if d not in src]
            for s, t in sorted(zip(dst, src)):
                order.insert(s, t)
        else:
            i, j = (args[1], args[2]) if len(args) > 2 else (0, 1)
            i, j = i % ndim, j % ndim
            order[i], order[j] = order[j], order[i]
        where = [d % ndim for d in order].index(mark)
        for o in outputs:
            self._set(o, where)

    def _contracted(self, name, args, outputs) -> None:
        """Batch and free dimensions keep their shard; a contracted one loses it."""
        a, b = args[0], args[1] if len(args) > 1 else None
        new = None
        for operand, role in ((a, "a"), (b, "b")):
            mark = self.marks.get(operand) if isinstance(operand, torch.Tensor) else None
            if mark is None or mark == STAT:
                continue
            last = operand.dim() - 1
            if name in ("linear", "scaled_dot_product_attention"):
                new = None if (role == "a" and mark == last) else (mark if role == "a" else None)
            elif (role == "a" and mark == last) or (role == "b" and mark == last - 1):
                new = None  # contracted: partial sums
            else:
                new = mark + (outputs[0].dim() - operand.dim()) if outputs else None
            break
        for o in outputs:
            self._set(o, new)

    def _found(self, op: str, shape_a, shape_b, dim: int) -> None:
        self.findings.append({"module": self._stack[-1], "op": op, "shapes": [list(shape_a),
                              list(shape_b)], "dim": dim, "local": shape_a[dim],
                              "full": shape_a[dim] * self.tp})


class _ClearingLedger(CommLedger):
    """Every tensor a collective of the package reduces or gathers is no local statistic or shard
    any more (an all-reduced statistic is the global one)."""

    def __init__(self, marks):
        super().__init__()
        self._marks = marks

    def add(self, record, tensor) -> None:
        self._marks.pop(tensor, None)
