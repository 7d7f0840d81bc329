"""Mixture-of-experts layers over an expert-parallel (``ep``) and a tensor-parallel (``tp``) axis.

:class:`ParallelExperts` holds ``n_experts / ep`` experts on each EP rank, each split column→row
over TP, and moves every token-slot to the rank of its expert and back::

    EP rank 0: experts 0 … E/ep−1          EP rank 1: experts E/ep … 2E/ep−1      …
    ┌───────────────────────────┐          ┌───────────────────────────┐
    │ w_in  [E/ep, W/tp, h]     │  column  │ w_in  [E/ep, W/tp, h]     │   W = F, or 2F (gate|up,
    │ w_out [E/ep, h, F/tp]     │  row     │ w_out [E/ep, h, F/tp]     │   each block split)
    └───────────────────────────┘          └───────────────────────────┘

Per call, with ``S`` the token-slots this rank routes (``N·k`` minus dropped ones) and ``R`` the
rows it receives for its experts:

==================  ==================================================  =========================
group               forward                                             backward
==================  ==================================================  =========================
EP                  all-gather of the per-expert slot counts (``ep·E``   all-to-all ``R·h`` (combine),
                    integers: the split sizes of the uneven all-to-all), all-to-all ``S·h``
                    all-to-all ``S·h`` (dispatch), all-to-all ``R·h``    (dispatch)
                    (combine)
TP                  all-reduce ``R·h`` of the experts' partial outputs  all-reduce ``R·h`` (input
                                                                        gradient of the experts)
==================  ==================================================  =========================

Summed over an EP group, ``Σ R = Σ S``: with balanced routing every rank receives what it sends.
The call signature ``(x, top_k_index, top_k_weights)`` is the one of ``transformers``' experts
modules, so a Hugging Face MoE block keeps its own router and calls this in its experts' place.
:class:`ParallelMoE` is the reference :class:`~ops_transformer.models.moe.MoE` (router, capacity,
load-balancing loss) in front of a :class:`ParallelExperts`.

Gradients: experts see the token-slots of every EP rank, so their gradients are sums over the
``ep`` micro-batches of the group; :func:`scale_expert_grads` divides them by ``ep`` so that, once
averaged over ``dp`` only, they equal the gradient of the mean loss over the ``dp × ep``
micro-batches (Megatron-core scales its expert gradients the same way).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..comm import collectives as C
from ..comm.primitives import all_to_all, copy_to_tp_region, reduce_from_tp_region
from ..models.moe import MoE, RoutingStats
from ..parallel.sharding import ShardSpec, divide, gather_full, set_shard_spec
from .moe_overlap import dispatch_combine_chunked, gather_counts


@dataclass(frozen=True)
class ExpertShard:
    """Which experts a parameter holds along its dim 0: ``[first, first + local)`` of
    ``n_experts``, on EP rank ``ep_rank`` of ``ep_size``."""

    n_experts: int
    ep_rank: int
    ep_size: int

    @property
    def local(self) -> int:
        return self.n_experts // self.ep_size

    @property
    def first(self) -> int:
        return self.ep_rank * self.local


def expert_shard(param: torch.Tensor) -> ExpertShard | None:
    return getattr(param, "expert_shard", None)


def check_experts_divide(n_experts: int, ep: int) -> int:
    """``n_experts // ep``, or a ``ValueError`` naming both."""
    if n_experts % ep:
        raise ValueError(f"n_experts ({n_experts}) is not divisible by ep ({ep}): every EP rank "
                         f"must hold the same number of experts; choose an ep that divides "
                         f"{n_experts}")
    return n_experts // ep


@dataclass
class _Routes:
    """Split sizes of one dispatch: rows sent to / received from each EP rank, and the received
    rows' order (source-major) regrouped expert-major for the local experts."""

    send: list[int] | None  # None: ep = 1, nothing moves
    recv: list[int] | None
    per_expert: list[int]  # received rows per local expert
    to_expert_major: torch.Tensor | None  # None: already expert-major (ep = 1)


class ParallelExperts(nn.Module):
    """The experts of one MoE layer (see the module docstring for the partition and the
    collectives). ``forward(x (N, h), top_k_index (N, k), top_k_weights (N, k), keep=None)``
    returns ``Σ_j weight · expert(x)`` per token over the slots with ``keep`` (all when ``None``).

    Weights are stacked per local expert: ``w_in [E/ep, W/tp, h]``, ``w_out [E/ep, h, F/tp]``,
    optional ``b_in [E/ep, W/tp]`` and ``b_out [E/ep, h]`` (replicated over TP, added once). Each
    carries a ``shard_spec`` (TP) and an ``expert_shard`` (EP). ``gated``: the first half of the
    ``W = 2F`` rows is the gate, ``act(gate) * up`` (SwiGLU); else ``act(x w_inᵀ)``.
    """

    def __init__(self, w_in: torch.Tensor, w_out: torch.Tensor, ctx, *,
                 b_in: torch.Tensor | None = None, b_out: torch.Tensor | None = None,
                 gated: bool, activation: Callable, dense_keys: dict[str, str] | None = None,
                 gate_fn: Callable | None = None, dense_transposed: bool = False,
                 interleaved: bool = False, post_fn: Callable | None = None):
        super().__init__()
        n_experts, width, d_model = w_in.shape
        d_ff = w_out.shape[2]
        local = check_experts_divide(n_experts, ctx.ep_size)
        divide(d_ff, ctx.tp_size, "ParallelExperts: the expert FFN width d_ff")
        self.n_experts, self.d_model, self.d_ff, self.gated = n_experts, d_model, d_ff, gated
        self.activation, self.dense_keys = activation, dense_keys
        # gate_fn: an elementwise function of each (gate, up) pair, called on this rank's
        # [gate | up] rows (a transformers experts module's own _apply_gate); None: act(gate) * up
        self.gate_fn, self.dense_transposed = gate_fn, dense_transposed
        # interleaved: gate and up rows alternate (g0, u0, g1, u1, …; gpt-oss); a contiguous TP
        # chunk of an even number of rows then holds whole (gate, up) pairs, so W splits plainly
        # post_fn: a row-wise function of each expert's whole output before the router's weight
        # (a norm after each expert: MuseSpark); it runs after the TP all-reduce
        self.interleaved, self.post_fn = interleaved and gated, post_fn
        self.tp_group, self.tp_size, self.ep_group, self.ep_size = (ctx.tp_group, ctx.tp_size,
                                                                    ctx.ep_group, ctx.ep_size)
        shard = ExpertShard(n_experts, ctx.ep_rank, ctx.ep_size)
        mine = slice(shard.first, shard.first + local)
        blocks = (d_ff, d_ff) if gated and not interleaved else None

        def param(dense, split_dim, sub_blocks=None):
            if dense is None:
                return None
            spec = ShardSpec((local, *dense.shape[1:]), split_dim, ctx.tp_rank, ctx.tp_size,
                             sub_blocks) if split_dim is not None else None
            local_dense = dense.detach()[mine]
            p = nn.Parameter(spec.shard(local_dense) if spec else local_dense.clone())
            if spec:
                set_shard_spec(p, spec)
            p.expert_shard = shard
            return p

        self.w_in = param(w_in, 1, blocks)  # (E/ep, W/tp, h)
        self.w_out = param(w_out, 2)  # (E/ep, h, F/tp)
        self.b_in = param(b_in, 1, blocks)  # (E/ep, W/tp) or None
        self.b_out = param(b_out, None)  # (E/ep, h) or None
        self.shard = shard
        self.overlap = None  # an OverlapPolicy: dispatch and combine in chunks (moe_chunked)

    @property
    def local_experts(self) -> int:
        return self.shard.local

    # --- forward ----------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        n, k = top_k_index.shape
        token = torch.arange(n, device=x.device).repeat_interleave(k)  # (N·k,) slot → token
        expert, weight = top_k_index.reshape(-1), top_k_weights.reshape(-1).to(x.dtype)
        if keep is not None:
            kept = keep.reshape(-1)
            token, expert, weight = token[kept], expert[kept], weight[kept]
        order = torch.argsort(expert, stable=True)  # expert-major, earlier tokens first
        token, expert, weight = token[order], expert[order], weight[order]
        counts = torch.bincount(expert, minlength=self.n_experts)  # (E,) slots per expert
        if self.overlap is not None and self.ep_size > 1:
            y = self._dispatch_combine_chunked(x[token], counts)
        else:
            y = self._dispatch_combine(x[token], counts)
        return x.new_zeros(x.shape).index_add(0, token, y * weight[:, None])  # (N, h)

    def _dispatch_combine(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts' outputs for ``rows`` (this rank's slots, expert-sorted): one dispatch
        all-to-all, the experts, one combine all-to-all."""
        routes = self._routes(counts)
        rows = all_to_all(rows, self.ep_group, output_splits=routes.recv,
                          input_splits=routes.send)  # (R, h), source-major
        if routes.to_expert_major is not None:
            rows = rows[routes.to_expert_major]
        y = self._experts(rows, routes.per_expert)  # (R, h)
        if routes.to_expert_major is not None:
            y = y[torch.argsort(routes.to_expert_major)]  # back to source-major
        return all_to_all(y, self.ep_group, output_splits=routes.send, input_splits=routes.recv)

    def _dispatch_combine_chunked(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The same, the all-to-alls in chunks pipelined with the experts
        (:mod:`.moe_overlap`); the chunks are decided from the EP group's largest number of
        slots, which every rank of the group knows."""
        everyone = gather_counts(counts, self.ep_group, self.ep_size, self.shard.local)
        slots = max(sum(map(sum, row)) for row in everyone)  # the same on every EP rank
        width = (self.w_in.shape[1] + self.w_out.shape[2])  # per rank: W/tp + F/tp
        chunks = self.overlap.chunks_for("experts", slots, self.d_model, width, self.ep_size,
                                         rows.dtype)
        return dispatch_combine_chunked(self, rows, everyone, chunks)

    def _routes(self, counts: torch.Tensor) -> _Routes:
        local, ep = self.shard.local, self.ep_size
        if ep == 1:
            return _Routes(None, None, counts.tolist(), None)
        everyone = counts.new_empty(ep * self.n_experts)
        C.all_gather_into(everyone, counts, self.ep_group, label="moe_counts")
        everyone = everyone.view(ep, ep, local).tolist()  # [source][destination][local expert]
        me = self.shard.ep_rank
        send = [sum(everyone[me][dst]) for dst in range(ep)]
        mine = [everyone[src][me] for src in range(ep)]  # [source][local expert]
        recv = [sum(row) for row in mine]
        starts, offset = [], 0  # where each (source, local expert) block begins in the rows
        for src in range(ep):
            starts.append([])
            for n in mine[src]:
                starts[src].append(offset)
                offset += n
        index = [torch.arange(starts[src][e], starts[src][e] + mine[src][e])
                 for e in range(local) for src in range(ep)]
        order = torch.cat(index).to(counts.device) if index else counts.new_zeros(0)
        return _Routes(send, recv, [sum(mine[src][e] for src in range(ep)) for e in range(local)],
                       order)

    def _experts(self, rows: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        """Every local expert on its contiguous block of ``rows``: one TP region for all of them
        (one backward all-reduce of the input gradient, one forward all-reduce of the output)."""
        rows = copy_to_tp_region(rows, self.tp_group)
        partial = []
        for e, x_e in enumerate(rows.split(per_expert)):
            h = F.linear(x_e, self.w_in[e], None if self.b_in is None else self.b_in[e])
            if self.gated and self.gate_fn is not None:
                h = self.gate_fn(h)  # [gate | up] (or pairs): this rank's slice of each block
            elif self.interleaved:
                h = self.activation(h[..., 0::2]) * h[..., 1::2]
            elif self.gated:
                gate, up = h.chunk(2, dim=-1)  # this rank's slice of each block
                h = self.activation(gate) * up
            else:
                h = self.activation(h)
            partial.append(F.linear(h, self.w_out[e]))  # (rows_e, h): partial over TP
        y = reduce_from_tp_region(torch.cat(partial), self.tp_group, inplace=True)
        if self.b_out is not None:
            y = y + self.b_out.repeat_interleave(torch.tensor(per_expert, device=y.device), 0)
        return y if self.post_fn is None else self.post_fn(y)

    # --- back to dense ----------------------------------------------------------------------

    @torch.no_grad()
    def gather_dense_state(self) -> dict[str, torch.Tensor]:
        """All experts' dense tensors (collective over TP and EP; every rank gets them), under the
        keys of the module this one replaced: ``dense_keys`` maps ``w_in``/``w_out``/``b_in``/
        ``b_out`` to stacked tensors' names (Hugging Face's ``gate_up_proj``, ``down_proj``);
        without it, the keys of a ``ModuleList`` of MLPs (``0.w_in.weight``, …)."""
        full = {}
        for name in ("w_in", "b_in", "w_out", "b_out"):
            p = getattr(self, name)
            if p is None:
                continue
            local = gather_full(p, self.tp_group).contiguous()  # (E/ep, ...)
            out = local.new_empty((self.n_experts, *local.shape[1:]))
            C.all_gather_into(out, local, self.ep_group, label="gather_experts")
            full[name] = out
        if self.dense_keys is not None:  # dense_transposed: stored [E, in, out] there
            turn = (lambda t: t.transpose(1, 2).contiguous() if self.dense_transposed and
                    t.dim() == 3 else t)
            return {self.dense_keys[name]: turn(t) for name, t in full.items()}
        names = {"w_in": "w_in.weight", "b_in": "w_in.bias", "w_out": "w_out.weight",
                 "b_out": "w_out.bias"}
        return {f"{e}.{names[n]}": full[n][e].clone() for e in range(self.n_experts)
                for n in ("w_in", "b_in", "w_out", "b_out") if n in full}

    @classmethod
    def from_mlps(cls, experts, ctx, *, gated: bool) -> ParallelExperts:
        """From a list of dense MLPs with ``w_in`` / ``w_out`` linears (the reference model's)."""
        stack = (lambda ts: None if ts[0] is None else torch.stack([t.detach() for t in ts]))
        return cls(stack([m.w_in.weight for m in experts]), stack([m.w_out.weight for m in experts]),
                   ctx, b_in=stack([m.w_in.bias for m in experts]),
                   b_out=stack([m.w_out.bias for m in experts]), gated=gated,
                   activation=F.silu if gated else F.gelu)

    @classmethod
    def from_stacked(cls, experts: nn.Module, ctx, *,
                     post_fn: Callable | None = None) -> ParallelExperts:
        """From a ``transformers`` experts module: 3-D ``gate_up_proj [E, 2F, h]`` (gate first)
        and ``down_proj [E, h, F]``, ``act_fn`` (Mixtral, Qwen2/3-MoE, OLMoE). The flags that
        ``transformers``' ``use_experts_implementation`` sets are honoured: ``is_transposed``
        (``[E, h, 2F]`` and ``[E, F, h]``), ``has_gate=False`` (``up_proj``, ``act(x wᵀ)``),
        biases, a class's own ``_apply_gate`` (clamped or softcapped SwiGLUs),
        ``is_concatenated=False`` (gate and up rows interleaved: gpt-oss) and
        ``has_post_expert_norm`` (``post_fn``: the caller passes the norm, which stays its
        module's parameter — :class:`~ops_transformer.parallelize.hf_experts.HFExperts` holds it)."""
        name = type(experts).__name__
        interleaved = not getattr(experts, "is_concatenated", True)
        post_fn = post_fn if getattr(experts, "has_post_expert_norm", False) else None
        if getattr(experts, "has_post_expert_norm", False) and post_fn is None:
            raise ValueError(f"{name}: has_post_expert_norm: pass the norm as post_fn")
        gated = getattr(experts, "has_gate", True)
        first = "gate_up_proj" if gated else "up_proj"
        keys = {"w_in": first, "w_out": "down_proj"}
        biases = {}
        for short, key in (("b_in", f"{first}_bias"), ("b_out", "down_proj_bias")):
            if getattr(experts, key, None) is not None:
                biases[short], keys[short] = getattr(experts, key), key
        turn = getattr(experts, "is_transposed", False)
        w_in, w_out = getattr(experts, first), experts.down_proj
        if turn:
            w_in, w_out = w_in.transpose(1, 2), w_out.transpose(1, 2)
        own_gate = getattr(type(experts), "_apply_gate", None)
        default = getattr(own_gate, "__module__", "") == "transformers.integrations.moe"
        gate_fn = experts._apply_gate if gated and own_gate is not None and not default else None
        activation = getattr(experts, "act_fn", None)  # a custom gate may apply its own
        if activation is None and gate_fn is None:
            raise ValueError(f"{name}: no act_fn and no _apply_gate of its own")
        return cls(w_in, w_out, ctx, gated=gated, activation=activation, dense_keys=keys,
                   gate_fn=gate_fn, dense_transposed=turn, interleaved=interleaved,
                   post_fn=post_fn, **biases)

    def extra_repr(self) -> str:
        return (f"n_experts={self.n_experts}, local_experts={self.local_experts} "
                f"(from {self.shard.first}), ep={self.ep_size}, d_model={self.d_model}, "
                f"d_ff={self.d_ff}, d_ff_per_rank={self.d_ff // self.tp_size}, tp={self.tp_size}, "
                f"gated={self.gated}" + ("" if self.overlap is None else
                                         f", dispatch/combine in chunks: {self.overlap!r}"))


class ParallelMoE(RoutingStats, nn.Module):
    """The reference :class:`~ops_transformer.models.moe.MoE` with its experts in a
    :class:`ParallelExperts`: the router (replicated) and the capacity run on this rank's tokens
    exactly as on one device; only the experts' work is distributed."""

    def __init__(self, experts: ParallelExperts, router: nn.Module, *, top_k: int,
                 capacity_factor: float | None):
        super().__init__()
        self.experts, self.router = experts, router  # experts first: the dense key order
        self.n_experts, self.top_k, self.capacity_factor = experts.n_experts, top_k, capacity_factor

    @classmethod
    def from_dense(cls, moe: MoE, ctx) -> ParallelMoE:
        gated = moe.experts[0].swiglu
        return cls(ParallelExperts.from_mlps(list(moe.experts), ctx, gated=gated), moe.router,
                   top_k=moe.top_k, capacity_factor=moe.capacity_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, h): this rank's micro-batch
        probs, weights, index = self.router(x)
        keep = self.route(probs, index)  # (capacity and statistics: RoutingStats.route)
        return self.experts(x, index, weights, keep).view(shape)

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, capacity_factor={self.capacity_factor}"


def to_expert_parallel(module: nn.Module, ctx) -> nn.Module:
    """The ``moe`` plan style: a reference :class:`MoE` → :class:`ParallelMoE`; a
    ``transformers`` experts module (3-D ``gate_up_proj``/``down_proj``) → :class:`ParallelExperts`
    (its block keeps its own router)."""
    if isinstance(module, MoE):
        return ParallelMoE.from_dense(module, ctx)
    if isinstance(getattr(module, "gate_up_proj", None), torch.Tensor) and \
            getattr(module, "gate_up_proj").dim() == 3:
        return ParallelExperts.from_stacked(module, ctx)
    raise ValueError(f"the moe style replaces a reference MoE or a transformers experts module "
                     f"with 3-D gate_up_proj/down_proj weights; got {type(module).__name__}")


def scale_expert_grads(params, ep: int) -> list:
    """Divide the gradient of each expert parameter by ``ep`` as it is produced (see the module
    docstring), once however often it is called; returns the hook handles it registered."""
    if ep == 1:
        return []
    handles = []
    for p in params:  # once per parameter: a rebuilt reducer chain (pipeline, LoRA) calls again
        if getattr(p, "_ep_grad_hook", None) is None:
            p._ep_grad_hook = p.register_hook(lambda grad: grad / ep)
            handles.append(p._ep_grad_hook)
    return handles


def split_expert_params(params) -> tuple[list, list]:
    """``(dense, experts)``: parameters replicated over EP, and those holding this rank's experts
    (their gradients average over ``dp`` only, after :func:`scale_expert_grads`)."""
    dense, experts = [], []
    for p in dict.fromkeys(params):  # tied weights once
        (experts if expert_shard(p) is not None else dense).append(p)
    return dense, experts
