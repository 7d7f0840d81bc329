"""ZeRO over the data-parallel axis, tensor-parallel aware (Rajbhandari et al. 2020, stages 1–2).

Every rank holds its own tensor-parallel shards; ZeRO shards *those* over ``ctx.dp_group`` only (the
ranks with the same ``tp_rank``, which hold the same shapes). Parameters are laid out in flat buckets
(reverse registration order, like the data-parallel buckets, at most ``bucket_bytes`` each), each
padded to a multiple of ``dp``; data-parallel rank ``r`` owns chunk ``r`` of every bucket::

    bucket b (flat, padded):  [ chunk 0 | chunk 1 | … | chunk dp-1 ]     rank r updates chunk r
    parameters are views into their bucket; the inner optimizer sees one parameter per bucket:
    this rank's chunk (so its state — Adam's moments — is 1/dp of the unsharded state)

* stage 1: gradients are averaged over ``dp`` as usual (the model's
  :class:`~ops_transformer.parallel.grad_reduce.GradSync` all-reduce); ``step``
  copies this rank's chunk of them, runs the inner optimizer on the chunks and all-gathers the
  updated chunks into the buckets (one all-gather per bucket, ``dp_group``).
* stage 2: as stage 1, but the gradient all-reduce is replaced by a reduce-scatter
  (:class:`~ops_transformer.parallel.grad_reduce.ReduceScatterGradSync`, swapped into the model's
  reducer chain, ``model.parallel_state.reducers``, where the averaging was): each rank receives
  only its chunk of the averaged gradients, and the full gradients are freed as each bucket is
  reduced.

Parameters whose gradients are partial sums over a TP group (sequence parallelism's norms and row
biases, replicated KV heads, strategy B's output projection: :func:`mark_partial_grad`) keep their
own buckets: they are all-reduced over ``dp`` before the end-of-backward
:class:`~ops_transformer.parallel.grad_reduce.GradSums` completes them (a reduce-scatter would free them
before that), then sliced like stage 1's.

Exactly the unsharded optimizer's arithmetic, element by element, for element-wise optimizers
(SGD, Adam, AdamW, …). One difference: a parameter that got no gradient in a step is stepped with a
zero gradient (its bucket mates did get one), where the unsharded optimizer skips it.

``state_dict()`` is this rank's shard, with the layout needed to reshard it (see
:mod:`.zero_state`): ``{"state", "param_groups", "zero": layout}``; the inner state's key ``i`` is
bucket ``i``'s chunk.
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm import collectives as C
from ..comm.bucketing import DEFAULT_BUCKET_BYTES, partial_grad_group
from ..parallel.grad_reduce import GradSync, ReduceScatterGradSync, dp_buckets
from ..parallel.state import parallel_state_of
from ..precision.clip import (check_max_norm, clip_grads_with_norm_, counted_on_tp_rank,
                              real_rows_mask, reduce_norm_parts, total_norm)

STAGES = (1, 2)


class ZeroBucket:
    """A flat, dp-padded run of parameters and this rank's chunk of it."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], dp: int, dp_rank: int, *,
                 reduce_scattered: bool):
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.offsets, offset = [], 0
        for p in self.params:
            self.offsets.append(offset)
            offset += p.numel()
        self.numel = offset
        self.chunk = -(-offset // dp)
        self.padded = self.chunk * dp
        self.lo = dp_rank * self.chunk
        first = self.params[0]
        self.flat = torch.zeros(self.padded, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for p, off in zip(self.params, self.offsets):
                self.flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
                p.data = self.flat[off:off + p.numel()].view_as(p)  # the parameter lives here
        self.shard = nn.Parameter(self.flat[self.lo:self.lo + self.chunk])  # a view, no copy
        self.reduce_scattered = reduce_scattered
        self.grad_shard: torch.Tensor | None = None  # stage 2: this rank's reduced gradients
        self.counted: torch.Tensor | None = None  # see norm_mask

    def norm_mask(self, ctx) -> torch.Tensor:
        """Which elements of this rank's chunk it adds to the dense gradient norm: those of the
        parameters this TP rank counts (:func:`~ops_transformer.precision.clip.counted_on_tp_rank`),
        without a padded vocabulary's zero rows and the bucket's padding. Every data-parallel rank
        counts its own chunk: together the chunks cover the bucket once."""
        if self.counted is None:
            mask = torch.zeros(self.padded, dtype=torch.bool, device=self.flat.device)
            for p, off in zip(self.params, self.offsets):
                if counted_on_tp_rank(p, ctx):
                    mask[off:off + p.numel()] = real_rows_mask(p).reshape(-1)
            self.counted = mask[self.lo:self.lo + self.chunk]
        return self.counted

    def shard_grad(self) -> torch.Tensor | None:
        """This rank's chunk of the (already averaged) gradients, or ``None`` if none."""
        if self.reduce_scattered:  # (reduced in grad_reduce_dtype: back to the parameters')
            return None if self.grad_shard is None else self.grad_shard.to(self.flat.dtype)
        out, hi = None, self.lo + self.chunk
        for p, off in zip(self.params, self.offsets):
            start, stop = max(off, self.lo), min(off + p.numel(), hi)
            if start >= stop or p.grad is None:
                continue
            if out is None:
                out = torch.zeros(self.chunk, dtype=self.flat.dtype, device=self.flat.device)
            out[start - self.lo:stop - self.lo].copy_(p.grad.reshape(-1)[start - off:stop - off])
        return out

    def layout(self) -> dict:
        return {"dtype": str(self.flat.dtype).replace("torch.", ""), "numel": self.numel,
                "padded_numel": self.padded, "shard_offset": self.lo, "shard_numel": self.chunk,
                "params": [{"name": n, "shape": list(p.shape), "offset": off, "numel": p.numel()}
                           for n, p, off in zip(self.names, self.params, self.offsets)]}


def _make_buckets(model: nn.Module, ctx, bucket_bytes: int, stage: int) -> list[ZeroBucket]:
    names = {id(p): n for n, p in model.named_parameters()}  # tied parameters once
    params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    buckets = []
    for partial in (False, True):
        group = [p for p in reversed(params) if (partial_grad_group(p) is not None) == partial]
        for run in dp_buckets(group, bucket_bytes):
            buckets.append(ZeroBucket([(names[id(p)], p) for p in run], ctx.dp_size,
                                      ctx.dp_rank, reduce_scattered=stage == 2 and not partial))
    return buckets


class ZeroOptimizer(torch.optim.Optimizer):
    """An optimizer whose state (stage 1) and gradients (stage 2) are sharded over ``ctx.dp_group``;
    see the module docstring. Build it with :func:`zero_optimizer`."""

    def __init__(self, model: nn.Module, ctx, optimizer_cls, *, stage: int = 1,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, **optimizer_kwargs):
        if stage not in STAGES:
            raise ValueError(f"stage must be 1 or 2, got {stage!r}")
        reducers = parallel_state_of(model, create=True).reducers
        sync = reducers.get("dp")
        if ctx.dp_size > 1 and sync is None:
            raise ValueError("zero_optimizer shards over data-parallel ranks and needs their "
                             "gradient averaging: build the model with parallelize(model, ctx) "
                             "first")
        self.ctx, self.stage = ctx, stage
        self.buckets = _make_buckets(model, ctx, bucket_bytes, stage)
        if not self.buckets:
            raise ValueError("zero_optimizer: the model has no parameter that requires grad")
        self.inner = optimizer_cls([b.shard for b in self.buckets], **optimizer_kwargs)
        super().__init__([b.shard for b in self.buckets], self.inner.defaults)
        self.param_groups, self.state = self.inner.param_groups, self.inner.state
        self._laid_out = True
        self._model_params = [p for b in self.buckets for p in b.params]
        self._grads_gathered = False
        if stage == 2:
            _swap_in_reduce_scatter(reducers, sync, self.buckets, ctx.dp_group, bucket_bytes)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.gather_grad_shards()
        self.inner.step()
        self._grads_gathered = False
        for b in self.buckets:  # every rank takes part, stepped or not
            C.all_gather_into(b.flat, b.shard.detach().clone(), self.ctx.dp_group,
                              label="zero_params")
        return loss

    def gather_grad_shards(self) -> list[torch.Tensor]:
        """Set each bucket chunk's gradient (``param_groups``' parameters) to this rank's chunk of
        the averaged gradients and return them; ``step`` uses these. A loss scaler's ``unscale_``
        and :meth:`clip_grad_norm_` act on them, so call this first
        (:func:`~ops_transformer.precision.optimizer_step` does). Once per step: later calls return
        the same tensors."""
        if not self._grads_gathered:
            for b in self.buckets:
                b.shard.grad = b.shard_grad()
            self._grads_gathered = True
        return [b.shard.grad for b in self.buckets if b.shard.grad is not None]

    def grad_norm_partial(self, norm_type: float = 2.0) -> torch.Tensor:
        """This rank's share of the dense model's gradient norm over the gathered chunks (one
        float32 element, ``Σ|g|ᵖ``, or ``max|g|`` for ``inf``): summed (max) over every rank of the
        job it is ``‖g‖ᵖ`` — what :func:`~ops_transformer.precision.clip.grad_norm_partial` gives
        for the unsharded gradients."""
        grads = self.gather_grad_shards()
        parts = [torch.linalg.vector_norm(b.shard.grad[b.norm_mask(self.ctx)], norm_type,
                                          dtype=torch.float32)
                 for b in self.buckets if b.shard.grad is not None]
        return reduce_norm_parts(parts, norm_type, grads[0].device if grads else self.ctx.device)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the sharded gradients to the dense model's total norm ``max_norm`` and return the
        norm before clipping — equal to ``torch.nn.utils.clip_grad_norm_`` on the unsharded
        model's gradients. One all-reduce of one element over the job; then :meth:`step`."""
        check_max_norm(max_norm, norm_type)
        share = self.grad_norm_partial(norm_type)
        C.all_reduce(share, self.ctx.world_group, label="grad_norm",
                     op=C.ReduceOp.MAX if norm_type == float("inf") else C.ReduceOp.SUM)
        norm = total_norm(share, norm_type)
        clip_grads_with_norm_([b.shard for b in self.buckets if b.shard.grad is not None],
                              max_norm, norm)
        return norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._model_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        for b in self.buckets:
            b.shard.grad = None
            b.grad_shard = None
        self._grads_gathered = False

    def layout(self) -> dict:
        """Which parameter lives where: per bucket its parameters' names, shapes and flat offsets,
        and the chunk this rank owns."""
        return {"stage": self.stage, "dp_size": self.ctx.dp_size, "dp_rank": self.ctx.dp_rank,
                "tp_size": self.ctx.tp_size, "tp_rank": self.ctx.tp_rank,
                "buckets": [b.layout() for b in self.buckets]}

    def state_dict(self) -> dict:
        inner = self.inner.state_dict()
        return {"state": inner["state"], "param_groups": inner["param_groups"],
                "zero": self.layout()}

    def load_state_dict(self, state_dict: dict) -> None:
        saved, mine = state_dict.get("zero"), self.layout()
        if saved is None:
            raise ValueError("load_state_dict: not a ZeRO optimizer state dict (no 'zero' layout)")
        if {k: v for k, v in saved.items() if k != "stage"} != \
                {k: v for k, v in mine.items() if k != "stage"}:
            raise ValueError(
                f"load_state_dict: the state was saved by dp rank {saved['dp_rank']} of "
                f"{saved['dp_size']} (tp rank {saved['tp_rank']} of {saved['tp_size']}) with "
                f"another parameter layout than this optimizer's (dp rank {mine['dp_rank']} of "
                f"{mine['dp_size']}); reshard it with ops_transformer.memory.zero_state")
        self.inner.load_state_dict({"state": state_dict["state"],
                                    "param_groups": state_dict["param_groups"]})

    def add_param_group(self, param_group: dict) -> None:
        if not getattr(self, "_laid_out", False):  # from torch.optim.Optimizer.__init__
            return super().add_param_group(param_group)
        raise ValueError("ZeroOptimizer lays out every parameter at construction; it cannot add a "
                         "parameter group later")

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank."""
        return sum(v.numel() * v.element_size() for s in self.state.values() for v in s.values()
                   if torch.is_tensor(v))

    def __repr__(self) -> str:
        return (f"ZeroOptimizer(stage={self.stage}, dp={self.ctx.dp_size}, "
                f"buckets={len(self.buckets)}, inner={type(self.inner).__name__})")


def _swap_in_reduce_scatter(reducers, sync, buckets, group, bucket_bytes: int) -> None:
    """Stage 2's reduction in place of the model's data-parallel averaging ``sync`` (first in the
    chain when there is none, dp = 1): a reduce-scatter for the plain buckets, the usual all-reduce
    for the partial-gradient buckets (whose TP sums, later in the chain, must find their
    gradients)."""
    dtype = getattr(sync, "reduce_dtype", None)
    swapped = [ReduceScatterGradSync(buckets, group, reduce_dtype=dtype)]
    partial = [p for b in buckets if not b.reduce_scattered for p in b.params]
    if partial and C.group_size(group) > 1:
        swapped.append(GradSync(reversed(partial), group, bucket_bytes=bucket_bytes,
                                reduce_dtype=dtype, name="dp_partial"))
    if sync is None:
        reducers.insert(0, swapped)
    else:
        reducers.replace(sync, swapped)


def zero_optimizer(model: nn.Module, ctx, optimizer_cls, stage: int = 1,
                   **optimizer_kwargs) -> ZeroOptimizer:
    """``optimizer_cls(model.parameters(), **optimizer_kwargs)``, sharded over ``ctx.dp_group``
    with ZeRO ``stage`` 1 (optimizer state) or 2 (and gradients); see :mod:`.zero`. Call it after
    :func:`~ops_transformer.parallelize` (it moves the parameters into flat buckets)."""
    return ZeroOptimizer(model, ctx, optimizer_cls, stage=stage, **optimizer_kwargs)
