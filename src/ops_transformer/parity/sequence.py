"""A parity check under context parallelism: every recorded tensor back in the dense sequence.

With ``cp > 1`` each rank of ``ctx.cp_group`` runs its two chunks of every sequence (head-tail
balanced: rank ``r`` holds chunks ``r`` and ``2·cp−1−r`` of ``2·cp``,
:func:`~ops_transformer.layers.context_attention.shard_sequence`). Before the TP layouts of
:mod:`.layout` are inferred, :func:`to_dense_sequence` gathers every tensor that holds this rank's
tokens over the cp group and puts the chunks back in order
(:func:`~ops_transformer.layers.context_attention.unshard_sequence`), so that what follows compares
whole sequences, as at cp 1.

Which dimension is the sequence: one where the dense tensor has the whole sequence (``seq``
tokens) and this rank's ``seq / cp`` — the sequence dimension of the usual layouts first
(``(b, s, h)``: 1; ``(b, heads, s, d)``: 2), then the others, a rotary table's ``(s, d)`` last.
A tensor with none is left as it is (the model's loss, which every rank holds whole). A
module's own scalar output inside the model (a fused head's loss) is the mean over this rank's
tokens only, which the model's exit then weights by their share: it is not compared (the model's
loss is, at the root).

Gradients: each rank's loss gradient is scaled by ``cp`` (its part of a sum averaged over
``dp × ep × cp``, :mod:`~ops_transformer.parallelize.context_plan`), so the gradient of every
gathered activation is ``cp`` times the dense one; it is divided back.
"""

from __future__ import annotations

import torch

from ..comm import collectives as C
from ..layers.context_attention import unshard_sequence
from .record import ROOT, Call


def sequence_length(inputs: tuple[tuple, dict]) -> int | None:
    """The sequence length of a batch: the second dimension of its first 2-D (or more) tensor."""
    args, kwargs = inputs
    first = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)
                  and t.dim() >= 2), None)
    return None if first is None else first.shape[1]


def sequence_dim(local: tuple[int, ...], ref: tuple[int, ...], seq: int, cp: int) -> int | None:
    """The dimension of a tensor of shape ``local`` (dense: ``ref``) that holds this rank's
    ``seq / cp`` tokens, or ``None`` (pure)."""
    if len(local) != len(ref) or seq % cp:
        return None
    found = [d for d in range(len(ref)) if ref[d] == seq and local[d] * cp == seq]
    usual = {3: 1, 4: 2}.get(len(ref))
    if usual in found:
        return usual
    later = [d for d in found if d > 0]
    return later[0] if later else (found[0] if found else None)


def _gather(t: torch.Tensor, dim: int, group, cp: int) -> torch.Tensor:
    """The whole sequence of ``t`` from every rank of the cp ``group`` (collective)."""
    local = t.detach().movedim(dim, 0).contiguous()
    out = local.new_empty((cp * local.shape[0], *local.shape[1:]))
    C.all_gather_into(out, local, group, label="parity.gather")
    parts = [p.movedim(0, dim) for p in out.chunk(cp, 0)]
    return unshard_sequence(parts, dim)


def _dense(tensors: list[torch.Tensor], shapes: list[tuple], seq: int, ctx,
           scale: float = 1.0) -> list[torch.Tensor]:
    out = []
    for i, t in enumerate(tensors):
        dim = sequence_dim(tuple(t.shape), tuple(shapes[i]), seq, ctx.cp_size) \
            if t is not None and i < len(shapes) else None
        if dim is None:
            out.append(t)
            continue
        whole = _gather(t, dim, ctx.cp_group, ctx.cp_size)
        out.append(whole / scale if scale != 1.0 else whole)
    return out


def to_dense_sequence(meta: list[dict], calls: list[Call], seq: int, ctx) -> None:
    """Every recorded input, output and output gradient of the calls the dense run also made,
    gathered over ``ctx.cp_group`` along its sequence dimension, in place (collective over the
    cp group: every rank calls it with the same calls, as :func:`.compare.agree_on_calls`
    checked)."""
    if ctx.cp_size == 1:
        return
    mine = {c.key: c for c in calls}
    for entry in meta:
        call = mine.get(entry["key"])
        if call is None:
            continue
        call.inputs = _dense(call.inputs, entry["inputs"], seq, ctx)
        shapes = dict(zip(entry["paths"], entry["outputs"]))
        if entry["name"] != ROOT:  # this rank's share of a loss: not the dense one (above)
            shapes = {p: s for p, s in shapes.items() if len(s)}
            for i, path in enumerate(call.paths):
                if path not in shapes:
                    call.outputs[i] = None
                    call.grads.pop(path, None)
        outputs = [(p, t) for p, t in zip(call.paths, call.outputs) if p in shapes]
        for (path, _), whole in zip(outputs, _dense([t for _, t in outputs],
                                                    [shapes[p] for p, _ in outputs], seq, ctx)):
            call.outputs[call.paths.index(path)] = whole
        grads = [(p, g) for p, g in sorted(call.grads.items()) if p in shapes]
        for (path, _), whole in zip(grads, _dense([g for _, g in grads],
                                                  [shapes[p] for p, _ in grads], seq, ctx,
                                                  scale=float(ctx.cp_size))):
            call.grads[path] = whole
