"""ZeRO over the data-parallel axis, tensor-parallel aware (Rajbhandari et al. 2020, stages 1–2).

Every rank holds its own tensor-parallel shards; ZeRO shards *those* over each parameter's
data-parallel group (the ranks with the same ``tp_rank``, which hold the same shapes: ``dp``, or
``dp × ep`` for the dense parameters of an expert-parallel model). Parameters are laid out in flat
buckets, padded to a multiple of the group's size; rank ``r`` of the group owns chunk ``r`` of
every bucket, and the inner optimizer steps this rank's **pieces** — each parameter's run of
elements inside the chunk (:mod:`.zero_buckets`), so its state (Adam's moments) is ``1/n`` of
the unsharded state.

* stage 1: gradients are averaged as usual (the model's
  :class:`~ops_transformer.parallel.grad_reduce.GradSync` all-reduce); ``step`` takes this rank's
  pieces of them, runs the inner optimizer and all-gathers the updated chunks into the buckets
  (one all-gather per bucket, over its group).
* stage 2: as stage 1, but the gradient all-reduce is replaced by a reduce-scatter
  (:class:`~ops_transformer.parallel.grad_shard.ReduceScatterGradSync`, swapped into the model's
  reducer chain, ``model.parallel_state.reducers``, where the averaging was): each rank receives
  only its chunk of the averaged gradients, and the full gradients are freed as each bucket is
  reduced.

Parameters whose gradients are partial sums over a TP group (sequence parallelism's norms and row
biases, replicated KV heads, strategy B's output projection: :func:`mark_partial_grad`) keep their
own buckets: they are all-reduced over their group before the end-of-backward
:class:`~ops_transformer.parallel.grad_reduce.GradSums` completes them (a reduce-scatter would free
them before that), then sliced like stage 1's.

Exactly the unsharded optimizer's arithmetic, element by element, for element-wise optimizers
(SGD, Adam, AdamW, …) — including a parameter that got no gradient in a step on any rank (frozen,
unused): it keeps ``grad = None`` and its pieces are skipped, as ``torch.optim`` skips it.

``state_dict()`` is this rank's shard, with the layout needed to reshard it (see
:mod:`.zero_state`): ``{"state", "param_groups", "zero": layout}``; the inner state's key ``j`` is
piece ``j`` of ``layout["pieces"]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..comm import collectives as C
from ..comm.bucketing import DEFAULT_BUCKET_BYTES
from ..parallel.grad_reduce import GradSync
from ..parallel.grad_shard import ReduceScatterGradSync
from ..parallel.state import parallel_state_of
from ..precision.clip import check_max_norm, clip_grads_with_norm_, reduce_norm_parts, total_norm
from .zero_buckets import ZeroBucket, make_buckets

STAGES = (1, 2)


@dataclass
class ZeroLayout:
    """The ZeRO buckets of a model (``model.parallel_state.zero``): laid out by
    ``parallelize(..., data_parallel={"zero": stage})`` — the reducer chain then built in the
    stage's form — or by :class:`ZeroOptimizer` itself; ``optimizer``: the one that steps them
    (``None`` until :func:`zero_optimizer` is called)."""

    stage: int
    buckets: list
    bucket_bytes: int
    optimizer: object = None


def lay_out_zero(model: nn.Module, ctx, stage: int, bucket_bytes: int) -> ZeroLayout:
    """The parameters that train moved into ZeRO buckets (:func:`make_buckets`), for
    :func:`zero_reducers` and a later :func:`zero_optimizer`."""
    buckets = make_buckets(model, ctx, bucket_bytes, stage)
    if not buckets:
        raise ValueError("zero_optimizer: the model has no parameter that requires grad")
    return ZeroLayout(stage, buckets, bucket_bytes)


class ZeroOptimizer(torch.optim.Optimizer):
    """An optimizer whose state (stage 1) and gradients (stage 2) are sharded over each
    parameter's data-parallel group; see the module docstring. Build it with
    :func:`zero_optimizer`."""

    def __init__(self, model: nn.Module, ctx, optimizer_cls, *, stage: int | None = None,
                 bucket_bytes: int | None = None, **optimizer_kwargs):
        if stage not in STAGES + (None,):
            raise ValueError(f"stage must be 1 or 2, got {stage!r}")
        state = parallel_state_of(model, create=True)
        if state.sharding is not None:
            raise ValueError("zero_optimizer: this model's parameters are sharded already "
                             "(shard_parameters, ZeRO-3): its optimizer state is sharded with "
                             "them; use a plain torch.optim optimizer")
        layout = getattr(state, "zero", None)
        if layout is None:
            reducers = state.reducers
            if ctx.dp_ep_size * ctx.cp_size > 1 and reducers.get("dp") is None:
                raise ValueError("zero_optimizer shards over data-parallel ranks and needs their "
                                 "gradient averaging: build the model with parallelize(model, "
                                 "ctx) first")
            layout = lay_out_zero(model, ctx, stage or 1, bucket_bytes or DEFAULT_BUCKET_BYTES)
            layout.optimizer = self  # (claimed: see below)
            if layout.stage == 2:
                reducers.replace_averaging(zero_reducers(layout, _reduce_dtype(reducers)))
            state.zero = layout
        elif layout.optimizer is not None:
            raise ValueError(f"zero_optimizer: this model's parameters belong to a ZeRO "
                             f"optimizer already (stage {layout.stage}); build one per model")
        elif stage not in (None, layout.stage):
            raise ValueError(f"zero_optimizer: stage={stage!r}, but parallelize laid out ZeRO "
                             f"stage {layout.stage} (data_parallel zero={layout.stage}): pass "
                             f"stage={layout.stage} or leave it out")
        self.ctx, self.stage, self.buckets = ctx, layout.stage, layout.buckets
        self.pieces = [(b, piece) for b in self.buckets for piece in b.pieces]
        shards = [piece.shard for _, piece in self.pieces]
        if not shards:  # every chunk of this rank is padding: nothing to step
            shards = [nn.Parameter(self.buckets[0].flat.new_zeros(0))]
        self.inner = optimizer_cls(shards, **optimizer_kwargs)
        super().__init__(shards, self.inner.defaults)
        self._share_inner_state()
        self._laid_out = True
        self._model_params = [p for b in self.buckets for p in b.params]
        self._grads_gathered = False
        layout.optimizer = self
        for r in state.reducers:
            if isinstance(r, ReduceScatterGradSync):
                r.unclaimed = None

    def _share_inner_state(self) -> None:
        """The wrapper shows the inner optimizer's groups and state (an LR scheduler built on the
        wrapper changes the real learning rate), also after ``load_state_dict`` replaced them."""
        self.param_groups, self.state = self.inner.param_groups, self.inner.state
        self.defaults = self.inner.defaults

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
            C.all_gather_into(b.flat, b.chunk_view().clone(), b.group, label="zero_params")
        return loss

    def gather_grad_shards(self) -> list[torch.Tensor]:
        """Set each piece's gradient (``param_groups``' parameters) to this rank's part of the
        averaged gradients — ``None`` for a parameter without a gradient on every rank — and
        return those that are set; ``step`` uses these. A loss scaler's ``unscale_`` and
        :meth:`clip_grad_norm_` act on them, so call this first
        (:func:`~ops_transformer.precision.optimizer_step` does). Once per step: later calls return
        the same tensors."""
        if not self._grads_gathered:
            for b in self.buckets:
                for piece, grad in zip(b.pieces, b.piece_grads()):
                    piece.shard.grad = grad
            self._grads_gathered = True
        return [piece.shard.grad for _, piece in self.pieces if piece.shard.grad is not None]

    def grad_norm_partial(self, norm_type: float = 2.0) -> torch.Tensor:
        """This rank's share of the dense model's gradient norm over the gathered pieces (one
        float32 element, ``Σ|g|ᵖ``, or ``max|g|`` for ``inf``): summed (max) over every rank of the
        job it is ``‖g‖ᵖ`` — what :func:`~ops_transformer.precision.clip.grad_norm_partial` gives
        for the unsharded gradients."""
        grads = self.gather_grad_shards()
        parts = [torch.linalg.vector_norm(piece.shard.grad[b.norm_mask(piece, self.ctx)],
                                          norm_type, dtype=torch.float32)
                 for b, piece in self.pieces if piece.shard.grad is not None]
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
        clip_grads_with_norm_([piece.shard for _, piece in self.pieces
                               if piece.shard.grad is not None], max_norm, norm)
        return norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._model_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        for b, piece in self.pieces:
            piece.shard.grad = None
        for b in self.buckets:
            b.grad_shard = None
        self._grads_gathered = False

    def layout(self) -> dict:
        """Which parameter lives where: per bucket its parameters' names, shapes and flat offsets
        and the chunk this rank owns; per piece (inner-optimizer parameter ``j``) its bucket,
        parameter and run of elements."""
        index = {id(b): i for i, b in enumerate(self.buckets)}
        return {"stage": self.stage, "dp_size": self.ctx.dp_size, "dp_rank": self.ctx.dp_rank,
                "ep_size": self.ctx.ep_size, "ep_rank": self.ctx.ep_rank,
                **({"cp_size": self.ctx.cp_size, "cp_rank": self.ctx.cp_rank}
                   if self.ctx.cp_size > 1 else {}),
                "tp_size": self.ctx.tp_size, "tp_rank": self.ctx.tp_rank,
                "buckets": [b.layout() for b in self.buckets],
                "pieces": [{"bucket": index[id(b)], "name": b.names[piece.index],
                            "start": piece.start, "stop": piece.stop}
                           for b, piece in self.pieces]}

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
        self._share_inner_state()

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
                f"buckets={len(self.buckets)}, pieces={len(self.pieces)}, "
                f"inner={type(self.inner).__name__})")


def zero_reducers(layout: ZeroLayout, reduce_dtype=None) -> list:
    """The data-parallel reducers of ZeRO stage 2 (``[]`` for stage 1: the plain averaging stays):
    a reduce-scatter for the plain buckets, the usual all-reduce for the partial-gradient buckets
    (whose TP sums, later in the chain, must find their gradients). The experts' buckets are
    among them (over ``dp``)."""
    if layout.stage != 2:
        return []
    reducers = [ReduceScatterGradSync(layout.buckets, reduce_dtype=reduce_dtype)]
    if layout.optimizer is None:
        reducers[0].unclaimed = (
            "data_parallel zero=2 reduce-scatters the gradients into ZeRO buckets that only "
            "ot.zero_optimizer(model, ctx, torch.optim.AdamW, ...) steps: build it before the "
            "first backward (a plain torch.optim optimizer would see no gradient)")
    for group_buckets in _by_group(b for b in layout.buckets if not b.reduce_scattered):
        if group_buckets[0].group_size > 1:
            partial = [p for b in group_buckets for p in b.params]
            name = "dp_partial" if not reducers[1:] else f"dp_partial_{len(reducers)}"
            reducers.append(GradSync(reversed(partial), group_buckets[0].group,
                                     bucket_bytes=layout.bucket_bytes, reduce_dtype=reduce_dtype,
                                     name=name))
    return reducers


def _reduce_dtype(reducers):
    return getattr(reducers.get("dp"), "reduce_dtype", None)


def _by_group(buckets) -> list[list[ZeroBucket]]:
    groups: dict[int, list[ZeroBucket]] = {}
    for b in buckets:
        groups.setdefault(id(b.group), []).append(b)
    return list(groups.values())


def zero_optimizer(model: nn.Module, ctx, optimizer_cls, stage: int | None = None,
                   **optimizer_kwargs) -> ZeroOptimizer:
    """``optimizer_cls(model.parameters(), **optimizer_kwargs)``, sharded over each parameter's
    data-parallel group with ZeRO ``stage`` 1 (optimizer state) or 2 (and gradients); see
    :mod:`.zero`. Call it after :func:`~ops_transformer.parallelize` (it moves the parameters into
    flat buckets, unless ``parallelize(..., data_parallel={"zero": stage})`` did: the optimizer
    then steps those, and ``stage`` defaults to theirs; otherwise to 1)."""
    return ZeroOptimizer(model, ctx, optimizer_cls, stage=stage, **optimizer_kwargs)
