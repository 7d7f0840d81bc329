"""ZeRO's flat buckets, and the pieces of them a rank steps (:mod:`.zero`).

Parameters are laid out in flat buckets (reverse registration order, like the data-parallel
buckets, at most ``bucket_bytes`` each), each padded to a multiple of the size ``n`` of the
bucket's data-parallel group; rank ``r`` of the group owns chunk ``r`` of every bucket::

    bucket (flat, padded):  [ chunk 0 | chunk 1 | … | chunk n-1 ]        rank r updates chunk r
                              a a a b | b b c c | c c c c | c - - -       (a, b, c: parameters)
    rank 1's pieces:          b[1:4], c[0:2]   — one inner-optimizer parameter each

The parameters become views into their bucket. The inner optimizer sees one parameter per
**piece** (a parameter's run of elements inside this rank's chunk), so a parameter without a
gradient in a step is skipped — its moments, its weight decay and its ``step`` count stay as
they were — exactly like ``torch.optim`` skips it. A chunk that is only padding has no piece.

The group of a bucket is its parameters' data-parallel group: ``dp × ep`` for the dense
parameters of an expert-parallel model (EP ranks read different micro-batches), ``dp`` for the
experts (each EP rank holds its own); plain ``dp`` without experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..comm import collectives as C
from ..comm.bucketing import partial_grad_group
from ..layers.moe import expert_shard
from ..parallel.grad_reduce import dp_buckets, presence
from ..precision.clip import counted_on_tp_rank, real_rows_mask


@dataclass
class ZeroPiece:
    """Elements ``[start, stop)`` of parameter ``index`` of a bucket, inside this rank's chunk;
    ``shard`` is the inner optimizer's parameter (a view of the bucket)."""

    index: int
    start: int
    stop: int
    shard: nn.Parameter


class ZeroBucket:
    """A flat, padded run of parameters over ``group`` and this rank's pieces of it."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], group, *, reduce_scattered: bool):
        self.group = group
        self.group_size, self.group_rank = C.group_size(group), C.group_rank(group)
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.offsets, offset = [], 0
        for p in self.params:
            self.offsets.append(offset)
            offset += p.numel()
        self.numel = offset
        self.chunk = -(-offset // self.group_size)
        self.padded = self.chunk * self.group_size
        self.lo = self.group_rank * self.chunk
        first = self.params[0]
        self.flat = torch.zeros(self.padded, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for p, off in zip(self.params, self.offsets):
                self.flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
                p.data = self.flat[off:off + p.numel()].view_as(p)  # the parameter lives here
                p._zero_bucketed = True  # (shard_parameters refuses such a parameter)
        self.pieces = []
        for i, (p, off) in enumerate(zip(self.params, self.offsets)):
            start, stop = max(0, self.lo - off), min(p.numel(), self.lo + self.chunk - off)
            if start < stop:  # a view, no copy
                shard = nn.Parameter(self.flat[off + start:off + stop])
                self.pieces.append(ZeroPiece(i, start, stop, shard))
        self.reduce_scattered = reduce_scattered
        self.grad_shard: torch.Tensor | None = None  # stage 2: chunk + presence flags, reduced
        self._counted: dict[int, torch.Tensor] = {}

    def chunk_view(self) -> torch.Tensor:
        return self.flat[self.lo:self.lo + self.chunk]

    def piece_grads(self) -> list[torch.Tensor | None]:
        """Each piece's gradient — this rank's part of the averaged gradient — or ``None`` where
        the parameter got no gradient on any rank of the group."""
        if not self.reduce_scattered:  # stage 1: the averaged gradients are whole on every rank
            grads = []
            for piece in self.pieces:
                grad = self.params[piece.index].grad
                grads.append(None if grad is None else grad.reshape(-1)[piece.start:piece.stop])
            return grads
        if self.grad_shard is None:
            return [None] * len(self.pieces)
        present = presence(self.grad_shard, len(self.params))
        data = self.grad_shard[:self.chunk].to(self.flat.dtype)  # (reduced in grad_reduce_dtype)
        out = []
        for piece in self.pieces:
            at = self.offsets[piece.index] - self.lo
            out.append(data[at + piece.start:at + piece.stop] if present[piece.index] else None)
        return out

    def norm_mask(self, piece: ZeroPiece, ctx) -> torch.Tensor | None:
        """Which elements of ``piece`` this rank adds to the dense gradient norm (``None``: all):
        those of a parameter this TP rank counts
        (:func:`~ops_transformer.precision.clip.counted_on_tp_rank`), without a padded
        vocabulary's zero rows, and never a tied embedding's last-stage copy under pp (counted
        once, on the first stage: ``parallelize/pipeline.py``). Every rank of the group counts
        its own pieces: together they cover the bucket once."""
        if piece.index not in self._counted:
            p = self.params[piece.index]
            if counted_on_tp_rank(p, ctx) and not getattr(p, "pipeline_tied_copy", False):
                mask = real_rows_mask(p).reshape(-1)[piece.start:piece.stop]
            else:
                mask = torch.zeros(piece.stop - piece.start, dtype=torch.bool, device=p.device)
            self._counted[piece.index] = mask
        return self._counted[piece.index]

    def layout(self) -> dict:
        return {"dtype": str(self.flat.dtype).replace("torch.", ""), "numel": self.numel,
                "padded_numel": self.padded, "shard_offset": self.lo, "shard_numel": self.chunk,
                "group_size": self.group_size, "group_rank": self.group_rank,
                "params": [{"name": n, "shape": list(p.shape), "offset": off, "numel": p.numel()}
                           for n, p, off in zip(self.names, self.params, self.offsets)]}


def make_buckets(model: nn.Module, ctx, bucket_bytes: int, stage: int) -> list[ZeroBucket]:
    """The model's ZeRO buckets: the dense parameters over ``dp × ep`` (``× cp`` with context
    parallelism: the gradient group, :attr:`~ops_transformer.parallel.ParallelContext.grad_group`),
    the experts over ``dp`` (``× cp``);
    in each, the parameters with partial gradients in buckets of their own (they are all-reduced,
    never reduce-scattered: see :mod:`.zero`)."""
    names = {id(p): n for n, p in model.named_parameters()}  # tied parameters once
    params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    dense_group = ctx.grad_group
    buckets = []
    for experts in (False, True):
        group = ctx.expert_grad_group if experts else dense_group
        for partial in (False, True):
            run = [p for p in reversed(params) if (expert_shard(p) is not None) == experts
                   and (partial_grad_group(p) is not None) == partial]
            for named in dp_buckets(run, bucket_bytes):
                buckets.append(ZeroBucket([(names[id(p)], p) for p in named], group,
                                          reduce_scattered=stage == 2 and not partial))
    return buckets
