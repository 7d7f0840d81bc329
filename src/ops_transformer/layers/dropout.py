"""Dropout that draws, on every rank, exactly the one-device model's mask for the part it holds.

Plain ``nn.Dropout`` draws a mask for the tensor it is given: a rank holding 2 of 8 heads, or
``1/t`` of the tokens, draws a mask of that size from a generator every rank shares — the same
pattern on every rank, unrelated to what one device would draw, and (with fewer numbers drawn
than one device draws) generators that drift apart from the one-device stream afterwards.

Here every dropout site draws **one** 64-bit seed from the device's default generator (the same
number on every rank and on one device: all consume the stream alike, and activation
checkpointing restores it for the replay) and derives the keep decision of each element from a
counter-based hash of ``(seed, the element's index in the one-device tensor)``. A rank computes
only its own elements — skipping ahead costs nothing — so:

=================== ===================================================== ====================
:class:`Layout`     what this rank holds of the one-device tensor         examples
=================== ===================================================== ====================
``replicated``      all of it (identical masks on every rank of the       embedding and
                    TP group)                                             residual dropout
``tokens``          its contiguous ``1/t`` share of the ``b·s`` tokens    residual dropout
                    (:mod:`.sequence_parallel`'s layout)                  under SP
``heads``           heads ``[r·a/t, (r+1)·a/t)`` of ``(b, a, s, s)``      attention dropout
``rows``            query rows ``[r·s/t, (r+1)·s/t)`` of ``(b, a, s, s)`` ``kv_split``
=================== ===================================================== ====================

and data-parallel rank ``d`` holds rows ``[d·b, (d+1)·b)`` of the global batch: ``dp × tp``
draws the masks of one device running the global batch. Under context parallelism (``cp_rank``
of ``cp``) dim 1 holds the rank's head-tail chunks of the sequence, whose positions the index
follows (:meth:`Layout._cp_index`); the attention probabilities' blocks take theirs from
:meth:`Layout.attention_index` (:mod:`.context_attention`, :mod:`.ulysses`). The hash (:func:`keep_mask`) is two
rounds of a 32-bit integer mixer (Wellons' ``lowbias32``, a bijection with low bias) over the
index's two 32-bit halves and the seed's, in place on int32; a value is kept when its 32-bit hash
is at least ``⌊p·2³²⌋``. It is not a cryptographic generator; its keep rate and independence are tested. The
mask is kept for backward as booleans (1 byte per element, Korthikanti et al.'s count).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

M32 = 0xFFFFFFFF
LAYOUTS = ("replicated", "tokens", "heads", "rows")


def _signed32(value: int) -> int:
    """The int32 whose bits are the unsigned 32-bit ``value``."""
    return value - (1 << 32) if value >= 1 << 31 else value


def _mix32_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """Wellons' ``lowbias32`` integer hash, in place on int32 holding unsigned 32-bit values
    (multiplications wrap modulo 2³²; right shifts are made logical by masking)."""
    for shift, multiplier in ((16, 0x7FEB352D), (15, 0x846CA68B), (16, None)):
        torch.bitwise_right_shift(x, shift, out=tmp)
        tmp &= (1 << (32 - shift)) - 1
        x ^= tmp
        if multiplier is not None:
            x *= _signed32(multiplier)
    return x


def keep_mask(seed: torch.Tensor, index: torch.Tensor, p: float) -> torch.Tensor:
    """Booleans: whether the element with one-device ``index`` (int32 or int64, any shape)
    survives dropout ``p`` under ``seed`` (an int64 scalar tensor): two rounds of
    :func:`_mix32_`, keyed by the seed's and the index's 32-bit halves; kept when the unsigned
    32-bit hash is at least ``⌊p·2³²⌋``."""
    low = (seed & M32).to(torch.int32)
    high = ((seed >> 32) & M32).to(torch.int32)
    if index.dtype == torch.int64:  # beyond 2³¹ elements: the high half joins the second round
        x = (index & M32).to(torch.int32)
        high = high ^ (index >> 32).to(torch.int32)
    else:
        x = index.to(torch.int32, copy=True)
    tmp = torch.empty_like(x)
    x ^= low
    _mix32_(x, tmp)
    x ^= high
    _mix32_(x, tmp)
    x ^= _signed32(1 << 31)  # unsigned order as signed order
    return x >= int(p * 2 ** 32) - (1 << 31)


def draw_seed(device) -> torch.Tensor:
    """One 62-bit seed from ``device``'s default generator, left on the device (no host sync)."""
    return torch.randint(0, 2 ** 62, (), dtype=torch.int64, device=device)


def _index_dtype(dense_shape) -> torch.dtype:
    n = 1
    for size in dense_shape:
        n *= size
    return torch.int32 if n < 1 << 31 else torch.int64


def block_index(dense_shape, starts, local_shape, device) -> torch.Tensor:
    """The row-major index in a ``dense_shape`` tensor of each element of its block that begins
    at ``starts`` and has ``local_shape`` (int32 below 2³¹ elements, else int64). Built outer
    dimension first, so only the last addition is as large as the block."""
    dtype = _index_dtype(dense_shape)
    strides = [1] * len(dense_shape)
    for d in reversed(range(len(dense_shape) - 1)):
        strides[d] = strides[d + 1] * dense_shape[d + 1]
    index = torch.zeros((), dtype=dtype, device=device)
    for d in range(len(dense_shape)):
        positions = starts[d] + torch.arange(local_shape[d], dtype=dtype, device=device)
        index = index.unsqueeze(-1) + positions * strides[d]
    return index


@dataclass(frozen=True)
class Layout:
    """Where this rank's tensor sits in the one-device tensor (module docstring): ``kind`` of
    :data:`LAYOUTS`, this rank's ``tp_rank`` of ``tp`` and its ``dp_rank`` of ``dp`` (the batch
    rows it holds of the global batch)."""

    kind: str = "replicated"
    tp_rank: int = 0
    tp: int = 1
    dp_rank: int = 0
    dp: int = 1
    cp_rank: int = 0  # context parallelism: dim 1 holds this rank's head-tail chunks of cp
    cp: int = 1

    def __post_init__(self):
        if self.kind not in LAYOUTS:
            raise ValueError(f"dropout layout must be one of {LAYOUTS}, got {self.kind!r}")

    def index(self, local_shape, device) -> torch.Tensor:
        """The one-device index of every element of a local tensor of ``local_shape``."""
        if self.cp > 1:
            return self._cp_index(tuple(local_shape), device)
        b = local_shape[0]
        dense, starts = [b * self.dp, *local_shape[1:]], [self.dp_rank * b] + [0] * (
            len(local_shape) - 1)
        if self.kind == "tokens":  # (b, s/t, h): a contiguous share of the b·s token rows
            n = 1
            for size in local_shape:
                n *= size
            start = self.dp_rank * n * self.tp + self.tp_rank * n
            dtype = _index_dtype((n * self.tp * self.dp,))
            return (start + torch.arange(n, dtype=dtype, device=device)).view(local_shape)
        if self.kind in ("heads", "rows"):  # (b, a, s, s): heads or query rows split
            dim = 1 if self.kind == "heads" else 2
            dense[dim] *= self.tp
            starts[dim] = self.tp_rank * local_shape[dim]
        return block_index(dense, starts, local_shape, device)

    def _cp_index(self, local_shape, device) -> torch.Tensor:
        """Under context parallelism, a ``(b, s/cp, …)`` tensor whose dim 1 holds this rank's
        chunks ``r`` and ``2·cp−1−r`` of the sequence (``replicated``), or a ``(b, s/(cp·t), …)``
        one holding the contiguous ``1/t`` share of those ``b·s/cp`` token rows (``tokens``:
        sequence parallelism inside cp). Indices in int64."""
        if self.kind not in ("replicated", "tokens"):
            raise ValueError(f"dropout layout {self.kind!r} under cp: the attention "
                             f"probabilities' mask is drawn per block (attention_index)")
        b, here = local_shape[0], local_shape[1]
        inner = 1
        for size in local_shape[2:]:
            inner *= size
        s_local = here * (self.tp if self.kind == "tokens" else 1)
        token = torch.arange(b * here, device=device)  # this tensor's token rows, in order
        if self.kind == "tokens":
            token = token + self.tp_rank * b * here
        row, place = token // s_local, token % s_local
        position = head_tail_positions(s_local, self.cp_rank, self.cp, device)[place]
        flat = (self.dp_rank * b + row) * (s_local * self.cp) + position  # (b·here,)
        index = flat.unsqueeze(-1) * inner + torch.arange(inner, device=device)
        return index.view(local_shape)

    def attention_index(self, batch: int, heads: int, q_pos: torch.Tensor, k_pos: torch.Tensor,
                        seq: int) -> torch.Tensor:
        """``(batch, heads, len(q_pos), len(k_pos))`` int64: the one-device indices in the
        ``(b·dp, heads·t, seq, seq)`` attention probabilities of this rank's rows, its heads
        (``tp_rank``'s of ``tp``) and the query and key positions given (a context-parallel
        attention block)."""
        device = q_pos.device
        rows = self.dp_rank * batch + torch.arange(batch, device=device)
        head = self.tp_rank * heads + torch.arange(heads, device=device)
        bh = rows[:, None] * (heads * self.tp) + head[None, :]  # (b, h)
        qk = q_pos.long()[:, None] * seq + k_pos.long()[None, :]  # (q, k)
        return bh[:, :, None, None] * (seq * seq) + qk


def head_tail_positions(seq_local: int, cp_rank: int, cp: int, device=None) -> torch.Tensor:
    """The whole-sequence positions of the ``seq_local`` tokens of ``cp_rank``: chunks ``r`` and
    ``2·cp−1−r`` of ``2·cp`` (the layout of :mod:`.context_attention`, which builds on this
    module)."""
    c = seq_local // 2
    return torch.cat([torch.arange(k * c, (k + 1) * c, device=device)
                      for k in (cp_rank, 2 * cp - 1 - cp_rank)])


class _MaskedScale(torch.autograd.Function):
    """``x · keep / (1 − p)``, keeping the boolean mask (1 byte per element) for backward."""

    @staticmethod
    def forward(ctx, x, keep, scale):
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return x.masked_fill(~keep, 0) * scale

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return grad.masked_fill(~keep, 0) * ctx.scale, None, None


def dropout(x: torch.Tensor, p: float, layout: Layout, training: bool = True) -> torch.Tensor:
    """Dropout ``p`` of ``x``, whose elements are ``layout``'s part of the one-device tensor,
    with exactly the one-device mask (module docstring). Identity when not ``training`` or
    ``p == 0``."""
    if not training or p == 0.0:
        return x
    return dropout_at(x, p, layout.index(tuple(x.shape), x.device))


def dropout_at(x: torch.Tensor, p: float, index: torch.Tensor) -> torch.Tensor:
    """Dropout ``p`` (in training) of ``x``, whose elements have the one-device indices ``index``
    (shaped like ``x``): for a part no :class:`Layout` describes (a row-parallel layer's input
    features, LoRA's dropout)."""
    if p >= 1.0:
        return x * 0.0
    keep = keep_mask(draw_seed(x.device), index, p)
    return _MaskedScale.apply(x, keep, 1.0 / (1.0 - p))


class ParallelDropout(nn.Module):
    """An ``nn.Dropout(p)`` whose mask is the one-device model's for this rank's part of its input
    (:class:`Layout`); ``print(model)`` shows the layout."""

    def __init__(self, p: float, layout: Layout):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p, self.layout = p, layout

    @classmethod
    def from_dense(cls, module: nn.Dropout, layout: Layout) -> ParallelDropout:
        if type(module) is not nn.Dropout:
            raise ValueError(f"ParallelDropout replaces an nn.Dropout, got {type(module).__name__}")
        layer = cls(module.p, layout)
        return layer.train(module.training)  # the mode of the nn.Dropout it replaces

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.layout, self.training)

    def extra_repr(self) -> str:
        lay = self.layout
        return (f"p={self.p}, layout={lay.kind}, tp_rank={lay.tp_rank}/{lay.tp}, "
                f"dp_rank={lay.dp_rank}/{lay.dp}" +
                (f", cp_rank={lay.cp_rank}/{lay.cp} (head-tail)" if lay.cp > 1 else ""))


@contextlib.contextmanager
def micro_batch_masks(model: nn.Module, index: int, count: int):
    """Inside, every dropout site of ``model`` draws the one-device masks of micro-batch
    ``index`` of the ``count`` consecutive ones this rank's rows split into (gradient
    accumulation): a site's rows of the global batch ``[d·b, (d+1)·b)`` become those of
    micro-batch ``d·count + index`` of ``dp·count``. A site is a :class:`ParallelDropout`
    (``layout``) or a module with a ``dropout_layout`` (the attention cores)."""
    moved = []
    if count > 1:
        for module in model.modules():
            for name in ("layout", "dropout_layout"):
                layout = getattr(module, name, None)
                if isinstance(layout, Layout):
                    moved.append((module, name, layout))
                    setattr(module, name, dataclasses.replace(
                        layout, dp_rank=layout.dp_rank * count + index, dp=layout.dp * count))
    try:
        yield
    finally:
        for module, name, layout in moved:
            setattr(module, name, layout)
