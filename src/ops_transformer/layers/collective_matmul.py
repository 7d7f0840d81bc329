"""Collective matmuls: a region's entry or exit collective split into chunks and pipelined with
its matmul (SPEC F4; Wang et al. 2023, "Overlap communication with dependent computation via
decomposition"; torchtitan's async TP; Megatron-LM's TP communication overlap).

These ops are the only implementation of the column entry's input-gradient all-reduce and of the
row and sequence-parallel exits: ``ColumnParallelLinear`` (:mod:`.linear`) runs ``copy_matmul``,
``RowParallelLinear`` ``matmul_all_reduce`` and ``SequenceParallelRowLinear`` ``matmul_reduce_
scatter``, with ``chunks=1`` under ``overlap="none"`` — one chunk *is* the plain layer (one
collective, labelled in the ledger as the plain primitive's) — and the cost model's choice under
``"auto"``. Each skips a backward collective whose result nobody needs (an input without
``requires_grad``).

Tokens are rows (``x`` of shape ``(tokens, features)``). ``chunks`` pieces of rows move one
collective each, so the total bytes are those of the one unchunked call and the ledger shows
``chunks`` calls of the same kind. Each op is exact: every row is multiplied as in the unchunked
layer (only the blocking of the matmul, hence the rounding, may differ).

=========================== ========================================= ==================================
op                          forward                                   backward
=========================== ========================================= ==================================
:func:`gather_matmul`       all-gather chunk ``i+1`` while chunk ``i``  input gradient chunk by chunk, each
(sequence-parallel entry)   is multiplied by every column weight      reduce-scattered while the next is
                                                                      computed; weight gradients behind
                                                                      the last ones
:func:`copy_matmul`         column matmuls (no communication)         the same, all-reducing the chunks
(tensor-parallel entry)
:func:`matmul_reduce_scatter` row matmul of chunk ``i+1`` while chunk ``i``  all-gather of the output gradient's
(sequence-parallel exit)    is reduce-scattered                        chunk ``i+1`` while chunk ``i`` is
                                                                      multiplied
:func:`matmul_all_reduce`   row matmul of chunk ``i+1`` while chunk ``i``  none (the output gradient is
(tensor-parallel exit)      is all-reduced                             replicated)
=========================== ========================================= ==================================

Under sequence parallelism rank ``r`` holds rows ``[r·n, (r+1)·n)`` of the ``t·n`` tokens; chunk
``i`` is piece ``i`` of every rank's share, so a gathered chunk is ``(t, m, ·)`` and lands in the
full activation at ``[:, offset_i : offset_i + m]`` of its ``(t, n, ·)`` view. Collectives run in
the dtype the unchunked layers use (the input's for the sequence-parallel gather, the compute
dtype for the rest), so the ledger's bytes match theirs under autocast too.
"""

from __future__ import annotations

import contextlib

import torch

from ..comm import collectives as C


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype ``torch.autocast`` runs matrix products in here, or ``None`` outside autocast.
    Backward runs outside autocast, so a custom matmul must cast its saved inputs itself."""
    device = x.device.type
    try:
        enabled = torch.is_autocast_enabled(device)
    except RuntimeError:  # a device type autocast does not know (meta): nothing is autocast
        return None
    return torch.get_autocast_dtype(device) if enabled else None


def chunk_bounds(rows: int, chunks: int) -> list[tuple[int, int]]:
    """``(offset, size)`` of ``min(chunks, rows)`` pieces of ``rows`` (sizes differ by at most
    one, the larger first; one empty piece for no rows)."""
    chunks = max(1, min(chunks, rows))
    base, extra = rows // chunks, rows % chunks  # (not divmod: Dynamo cannot trace it on a SymInt)
    out, offset = [], 0
    for i in range(chunks):
        size = base + (i < extra)
        out.append((offset, size))
        offset += size
    return out


def _wait(handles) -> None:
    for h in handles:
        if h is not None:
            h.wait()


def _gathered(bufs: list, source: torch.Tensor, bounds, group, label: str):
    """Each chunk's ``(i, start, rows)`` once its all-gather of ``source``'s rows into
    ``bufs[i]`` has arrived — the next chunk's all-gather already in flight (double buffering:
    chunk ``i``'s matmul runs while chunk ``i+1`` is gathered)."""
    def start(i):
        s, m = bounds[i]
        return C.all_gather_into(bufs[i], source[s:s + m], group, async_op=True, label=label)

    pending = start(0)
    for i, (s, m) in enumerate(bounds):
        following = start(i + 1) if i + 1 < len(bounds) else None
        _wait([pending])
        pending = following
        yield i, s, m


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _compute(x: torch.Tensor, tensors) -> tuple[torch.dtype, list]:
    """The dtype the matmuls run in (autocast's, else the first tensor's) and ``tensors`` cast to
    it — outside the autograd functions, so the casts have their own backward."""
    dtype = _autocast_dtype(x) or next((t for t in tensors if t is not None), x).dtype
    return dtype, [None if t is None else t.to(dtype) for t in tensors]


def _plain(x: torch.Tensor):
    """No autocast inside the functions: their inputs are already in the compute dtype."""
    if _autocast_dtype(x) is None:
        return contextlib.nullcontext()
    return torch.autocast(x.device.type, enabled=False)


class _GatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_share, group, chunks, compute_dtype, labels, regather, *params):
        weights, biases = params[0::2], params[1::2]
        t, (n, h) = group.size(), x_share.shape
        bounds = chunk_bounds(n, chunks)
        bufs = [x_share.new_empty((t * m, h)) for _, m in bounds]
        # one chunk: the gathered buffer is the full activation (no copy)
        x_full = bufs[0].view(t, n, h) if len(bounds) == 1 else x_share.new_empty((t, n, h))
        outs = [x_share.new_empty((t, n, w.shape[0]), dtype=w.dtype) for w in weights]

        for i, s, m in _gathered(bufs, x_share, bounds, group, labels[0]):
            if len(bounds) > 1:
                x_full[:, s:s + m].copy_(bufs[i].view(t, m, h))
            rows = bufs[i].to(compute_dtype)
            for y, w, b in zip(outs, weights, biases):
                y_i = rows.mm(w.t()) if b is None else torch.addmm(b, rows, w.t())
                y[:, s:s + m].copy_(y_i.view(t, m, -1))
            bufs[i] = None  # a chunk's buffer is not needed once copied
        # without column weights (the plain entry) backward needs no gathered input; with
        # ``regather`` it keeps only this rank's share and all-gathers it again in backward
        kept = None if not weights else (x_share if regather else x_full)
        ctx.save_for_backward(kept, *weights)
        ctx.group, ctx.bounds, ctx.compute_dtype = group, bounds, compute_dtype
        ctx.shape, ctx.label = (t, n, h), labels[1]
        ctx.regather = bool(regather and weights)
        ctx.has_bias = [b is not None for b in biases]
        return (x_full, *outs)

    @staticmethod
    def backward(ctx, grad_x_full, *grad_outs):
        kept, *weights = ctx.saved_tensors
        group, bounds, dtype = ctx.group, ctx.bounds, ctx.compute_dtype
        (t, n, h), needs = ctx.shape, ctx.needs_input_grad[6:]
        x_full, pending = kept, None
        if ctx.regather:  # the re-gather runs while the input gradient is computed
            x_full = kept.new_empty((t, n, h))
            pending = C.all_gather_into(x_full.view(t * n, h), kept, group, async_op=True,
                                        label="sequence_regather.bwd")
        like = grad_x_full if x_full is None else x_full
        used = [(g, w) for g, w in zip(grad_outs, weights) if g is not None]
        if not ctx.needs_input_grad[0]:  # nobody needs the input gradient: no reduce-scatter
            _wait([pending])
            return (None,) * 6 + tuple(_weight_grads(grad_outs, x_full, dtype, ctx.has_bias,
                                                     needs))
        grad_share = like.new_empty((n, h))
        handles, inputs = [], []
        for s, m in bounds:
            g_x = _chunk_input_grad(used, grad_x_full, s, m, t, h, like).to(like.dtype)
            inputs.append(g_x)  # alive until its reduce-scatter is done
            handles.append(C.reduce_scatter_into(grad_share[s:s + m], g_x, group, async_op=True,
                                                 label=ctx.label))
        _wait([pending])
        grads = _weight_grads(grad_outs, x_full, dtype, ctx.has_bias, needs)
        _wait(handles)
        return (grad_share, None, None, None, None, None, *grads)


def _chunk_input_grad(used, grad_x_full, s, m, t, h, like) -> torch.Tensor:
    """``Σ_c ∂L/∂y_c[:, s:s+m] · W_c`` (+ the gathered input's own gradient) as ``(t·m, h)``."""
    g_x = None
    for g, w in used:
        g_i = g[:, s:s + m].reshape(t * m, -1)
        g_x = g_i.mm(w) if g_x is None else g_x.addmm_(g_i, w)
    own = None if grad_x_full is None else grad_x_full[:, s:s + m].reshape(t * m, h)
    if g_x is None:
        return like.new_zeros((t * m, h)) if own is None else own.contiguous()
    return g_x if own is None else g_x.add_(own.to(g_x.dtype))


def _weight_grads(grad_outs, x, dtype, has_bias, needs) -> list:
    """``[∂W_1, ∂b_1, ∂W_2, ...]`` of column matmuls ``y_c = x W_cᵀ + b_c`` over all rows (``x``
    cast to ``dtype`` unless ``None``; none without column weights)."""
    if not grad_outs:
        return []
    x_2d, out = (_flat(x) if dtype is None else _flat(x).to(dtype)), []
    for c, g in enumerate(grad_outs):
        need_w, need_b = needs[2 * c], needs[2 * c + 1]
        g_2d = None if g is None else _flat(g)
        out.append(g_2d.t().mm(x_2d) if g is not None and need_w else None)
        out.append(g_2d.sum(0) if g is not None and need_b and has_bias[c] else None)
    return out


def gather_matmul(x_share: torch.Tensor, weights, biases, group, chunks: int,
                  labels: tuple[str, str] = ("gather_matmul.fwd", "gather_matmul.bwd"), *,
                  regather: bool = False):
    """Sequence-parallel entry: ``x_full = all-gather(x_share)`` and ``y_c = x_full W_cᵀ + b_c``
    for every column weight, pipelined in ``chunks``. ``x_share`` ``(n, h)`` rows of this rank;
    returns ``(x_full (t, n, h), [y_c (t, n, out_c)])`` in rank-major token order. With no
    weights and one chunk, the plain entry (:func:`~.sequence_parallel.gather_sequence_region`):
    all-gather, backward reduce-scatter, nothing kept. ``regather`` (``sequence_parallel=
    "regather"``, :mod:`.sequence_regather`): keep ``x_share`` instead of ``x_full`` for the
    weight gradients, all-gathered again in backward (label ``sequence_regather.bwd``) while the
    input gradient is computed."""
    dtype, params = _compute(x_share, [p for pair in zip(weights, biases) for p in pair])
    with _plain(x_share):
        out = _GatherMatmul.apply(x_share.contiguous(), group, chunks, dtype, labels, regather,
                                  *params)
    return out[0], list(out[1:])


class _CopyMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, chunks, label, input_from, *params):
        weights, biases = params[0::2], params[1::2]
        outs = [torch.nn.functional.linear(x, w, b) for w, b in zip(weights, biases)]
        # without column weights (the plain entry) backward needs no input; with
        # ``input_from`` it gets it there (a re-gathering region's entry: nothing kept here)
        ctx.save_for_backward(x if weights and input_from is None else None, *weights)
        ctx.group, ctx.bounds, ctx.label = group, chunk_bounds(x.shape[0], chunks), label
        ctx.shape, ctx.dtype, ctx.input_from = x.shape, x.dtype, input_from
        ctx.has_bias = [b is not None for b in biases]
        return (x.view_as(x), *outs)

    @staticmethod
    def backward(ctx, grad_x_own, *grad_outs):
        x, *weights = ctx.saved_tensors
        if ctx.input_from is not None:  # the input, all-gathered again while ∂x is computed
            return _CopyMatmul._from_input(ctx, grad_x_own, grad_outs, weights)
        used = [(g, w) for g, w in zip(grad_outs, weights) if g is not None]
        if not ctx.needs_input_grad[0]:  # nobody needs the input gradient: no all-reduce
            return (None,) * 5 + tuple(_weight_grads(grad_outs, x, None, ctx.has_bias,
                                                     ctx.needs_input_grad[5:]))
        like = grad_x_own if x is None else x
        grad_x, handles = like.new_empty(ctx.shape), []
        for s, m in ctx.bounds:  # each chunk's all-reduce runs while the next is computed
            g_x = grad_x[s:s + m]
            for j, (g, w) in enumerate(used):
                if j == 0:
                    torch.mm(g[s:s + m], w, out=g_x)
                else:
                    g_x.addmm_(g[s:s + m], w)
            if used and grad_x_own is not None:
                g_x.add_(grad_x_own[s:s + m])
            elif grad_x_own is not None:
                g_x.copy_(grad_x_own[s:s + m])
            elif not used:
                g_x.zero_()
            handles.append(C.all_reduce(g_x, ctx.group, async_op=True, label=ctx.label))
        grads = _weight_grads(grad_outs, x, None, ctx.has_bias, ctx.needs_input_grad[5:])
        _wait(handles)
        return (grad_x, None, None, None, None, *grads)

    @staticmethod
    def _from_input(ctx, grad_x_own, grad_outs, weights):
        """Backward of a column matmul inside a re-gathering region: ``∂x = Σ ∂Y_c·W_c`` (the
        region's entry reduce-scatters it: no all-reduce here) while ``input_from()`` re-gathers
        the input, then the weight gradients from it."""
        full, pending = ctx.input_from()
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_x_own
            for g, w in zip(grad_outs, weights):
                if g is not None:
                    grad_x = g.mm(w) if grad_x is None else grad_x + g.mm(w)
        _wait([pending])
        x = full.reshape(ctx.shape).to(ctx.dtype)  # (the compute dtype, as forward's input)
        grads = _weight_grads(grad_outs, x, None, ctx.has_bias, ctx.needs_input_grad[5:])
        return (grad_x, None, None, None, None, *grads)


def copy_matmul(x: torch.Tensor, weights, biases, group, chunks: int,
                label: str = "copy_matmul.bwd", *, input_from=None):
    """Tensor-parallel entry: ``y_c = x W_cᵀ + b_c`` for every column weight, with one
    copy-to-region for all of them — its backward all-reduce of ``∂L/∂x`` split into ``chunks``
    (each running while the next chunk's input gradient is computed, the last ones behind the
    weight gradients). ``x`` ``(n, h)``; returns ``(x, [y_c])`` (``x``'s own uses in the region
    add their gradient to the all-reduced sum). With no weights and one chunk, the plain
    ``copy_to_tp_region`` of a region's input (:class:`~.regions.CopyToTPRegion`): nothing kept.
    ``input_from`` (a column layer of a re-gathering sequence-parallel region,
    :mod:`.sequence_regather`): keep no input; backward calls ``input_from() -> (x_full,
    handle)`` for it (the region's re-gather, waited on after ``∂x``) and all-reduces nothing
    (pass ``group=None``: the region's entry reduce-scatters ``∂x``)."""
    _, (x, *params) = _compute(x, [x] + [p for pair in zip(weights, biases) for p in pair])
    with _plain(x):
        out = _CopyMatmul.apply(x.contiguous(), group, chunks, label, input_from, *params)
    return out[0], list(out[1:])


class _Box:
    """Where :class:`_SavedFirst` leaves its node for the exit op that reads its tensors."""

    node = None


class _SavedFirst(torch.autograd.Function):
    """Identity on ``x`` that saves ``(x, weight)`` for the exit op after it. Saved here, they
    are stored before that op's collectives run, so full recompute, which replays a layer only up
    to the last tensor its backward needs (torch's checkpoint stops early), does not replay a
    layer's closing reduce-scatter or all-reduce — as for the unchunked row layer."""

    @staticmethod
    def forward(ctx, x, weight, box):
        ctx.save_for_backward(x, weight)
        box.node = ctx
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def _saved_first(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, _Box]:
    box = _Box()
    return _SavedFirst.apply(x, weight, box), box


class _MatmulAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group, chunks, box, label):
        y = x.new_empty((x.shape[0], weight.shape[0]))
        handles = []
        for s, m in chunk_bounds(x.shape[0], chunks):
            torch.mm(x[s:s + m], weight.t(), out=y[s:s + m])
            handles.append(C.all_reduce(y[s:s + m], group, async_op=True, label=label))
        _wait(handles)
        ctx.box = box
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.box.node.saved_tensors
        grad_x = grad.mm(weight) if ctx.needs_input_grad[0] else None
        grad_w = grad.t().mm(x) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None, None, None, None


def matmul_all_reduce(x: torch.Tensor, weight: torch.Tensor, group, chunks: int,
                      label: str | None = None) -> torch.Tensor:
    """Tensor-parallel exit: ``all-reduce(x Wᵀ)`` with the matmul of chunk ``i+1`` running while
    chunk ``i`` is all-reduced. ``x`` ``(n, in/t)``; returns ``(n, out)``. The ledger's label:
    ``reduce_from_tp_region.fwd`` for one chunk (the plain row layer's exit), else
    ``matmul_all_reduce.fwd``."""
    label = label or ("reduce_from_tp_region.fwd" if chunks == 1 else "matmul_all_reduce.fwd")
    _, (x, weight) = _compute(x, [x, weight])
    with _plain(x):
        x, box = _saved_first(x.contiguous(), weight)
        return _MatmulAllReduce.apply(x, weight, group, chunks, box, label)


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group, chunks, box, labels):
        t = group.size()
        n, k = x.shape[0] // t, x.shape[1]
        x3 = x.view(t, n, k)
        out = x.new_empty((n, weight.shape[0]))
        bounds, handles, partials = chunk_bounds(n, chunks), [], []
        for s, m in bounds:
            partial = x3[:, s:s + m].reshape(t * m, k).mm(weight.t())  # (t·m, out)
            partials.append(partial)  # alive until its reduce-scatter is done
            handles.append(C.reduce_scatter_into(out[s:s + m], partial, group, async_op=True,
                                                 label=labels[0]))
        _wait(handles)
        ctx.group, ctx.bounds, ctx.box, ctx.label = group, bounds, box, labels[1]
        return out

    @staticmethod
    def backward(ctx, grad_share):
        x, weight = ctx.box.node.saved_tensors
        group, bounds = ctx.group, ctx.bounds
        t = group.size()
        n, k = x.shape[0] // t, x.shape[1]
        x3, grad_share = x.view(t, n, k), grad_share.contiguous()
        grad_x = x.new_empty((t, n, k))
        grad_w = weight.new_zeros(weight.shape) if ctx.needs_input_grad[1] else None
        bufs = [grad_share.new_empty((t * m, grad_share.shape[1])) for _, m in bounds]

        for i, s, m in _gathered(bufs, grad_share, bounds, group, ctx.label):
            g = bufs[i]  # (t·m, out): the output gradient of chunk i's rows on every rank
            grad_x[:, s:s + m].copy_(g.mm(weight).view(t, m, k))
            if grad_w is not None:
                grad_w.addmm_(g.t(), x3[:, s:s + m].reshape(t * m, k))
            bufs[i] = None
        return grad_x.view(t * n, k), grad_w, None, None, None, None


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group,
                          chunks: int, labels: tuple[str, str] | None = None) -> torch.Tensor:
    """Sequence-parallel exit: ``reduce-scatter(x Wᵀ)`` over the token rows, the matmul of chunk
    ``i+1`` running while chunk ``i`` is reduce-scattered. ``x`` ``(t·n, in/t)`` in rank-major
    token order; returns this rank's ``(n, out)``. The ledger's labels (forward, backward): those
    of the plain layer's ``reduce_scatter_along`` for one chunk, else
    ``matmul_reduce_scatter.fwd`` / ``.bwd``."""
    labels = labels or (("reduce_scatter_along.fwd", "reduce_scatter_along.bwd") if chunks == 1
                        else ("matmul_reduce_scatter.fwd", "matmul_reduce_scatter.bwd"))
    _, (x, weight) = _compute(x, [x, weight])
    with _plain(x):
        x, box = _saved_first(x.contiguous(), weight)
        return _MatmulReduceScatter.apply(x, weight, group, chunks, box, labels)
