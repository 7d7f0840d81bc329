"""Column- and row-parallel linear layers (Megatron-LM's partition, Shoeybi et al. 2019).

Both follow ``nn.Linear``: ``y = x Wᵀ + b`` with ``W`` of shape ``[out, in]``. Global sizes stay
global (``in_features``, ``out_features``); the per-rank size is ``*_per_rank``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.primitives import gather_from_tp_region, scatter_to_tp_region
from ..parallel.sharding import ShardSpec, divide, gather_full, set_shard_spec
from .collective_matmul import _autocast_dtype, copy_matmul, matmul_all_reduce


def to_compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the autocast dtype (unchanged outside autocast): for an activation whose only
    consumers are matmuls — which would cast it anyway — so that the all-reduce of its gradient
    runs in 16 bits too."""
    dtype = _autocast_dtype(x)
    return x if dtype is None or not x.is_floating_point() else x.to(dtype)


def linear_with_grad_all_reduce(x, weight, bias, group, chunks: int = 1,
                                label: str = "column_linear.bwd"):
    """``F.linear(x, weight, bias)`` whose backward all-reduces ``∂L/∂x`` over ``group`` — in
    ``chunks``, each while the next chunk's input gradient is computed, the last behind the
    weight-gradient matmul (:func:`~.collective_matmul.copy_matmul`: ``copy_to_tp_region`` fused
    with the matmul). No all-reduce when ``x`` needs no gradient."""
    if group is None or group.size() == 1:
        return F.linear(x, weight, bias)
    _, (y,) = copy_matmul(x.reshape(-1, x.shape[-1]), [weight], [bias], group, chunks, label)
    return y.view(*x.shape[:-1], y.shape[-1])


def chunks_of(layer, region: str, x_2d: torch.Tensor, out_features: int) -> int:
    """How many chunks ``layer``'s collective matmul runs: 1 without an overlap policy
    (``overlap="none"``), else its :class:`~.overlap_policy.OverlapPolicy`'s choice for these
    sizes — the one policy every communicating matmul asks."""
    if layer.overlap is None:
        return 1
    return layer.overlap.chunks_for(region, x_2d.shape[0], x_2d.shape[-1], out_features,
                                    layer.tp_size, _autocast_dtype(x_2d) or x_2d.dtype)


def exit_operands(layer, x_local: torch.Tensor, weight: torch.Tensor):
    """``(x, W)`` of a row layer's exit matmul (``x_local`` ``(…, in/tp)``); with a LoRA adapter (:mod:`.lora`), its split
    factor's output joins as ``rank`` more input columns, ``[x, s·drop(x) A_rᵀ] [W_r, B]ᵀ`` — so the
    adapter's partial output rides on the exit's own collective (no collective added)."""
    if not hasattr(layer, "adapter"):
        return x_local, weight
    h = F.linear(layer.lora_input(x_local), layer.lora_A.value()) * layer.lora_scaling
    dtype = _autocast_dtype(x_local) or weight.dtype
    return (torch.cat([x_local.to(dtype), h.to(dtype)], dim=-1),
            torch.cat([weight.to(dtype), layer.lora_B.value().to(dtype)], dim=-1))


def dense_weight(module: nn.Module) -> tuple[torch.Tensor, bool]:
    """``(weight [out, in], transposed)`` of an ``nn.Linear`` or of a GPT-2 style ``Conv1D``
    (which computes ``x W + b`` with ``W [in, out]``)."""
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return module.weight.detach().t(), True
    return module.weight.detach(), False


def _dense_linear(in_features, out_features, bias, device, dtype) -> nn.Linear:
    """The dense layer whose slices initialise a parallel one: with the same RNG state on every
    rank, a parallel layer starts from exactly the weights ``nn.Linear`` would have."""
    return nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)


class _TPLinear(nn.Module):
    """What the column and row layers share: the dense layer they are slices of."""

    bias_spec = None  # the row layer's bias is replicated (added once, after the reduction)

    def _load_dense(self, dense: nn.Module) -> None:
        weight, transposed = dense_weight(dense)
        if transposed:
            self.weight_spec = dataclasses.replace(self.weight_spec, transposed=True)
        self.weight = set_shard_spec(nn.Parameter(self.weight_spec.shard(weight)), self.weight_spec)
        if dense.bias is None:
            self.register_parameter("bias", None)
        elif self.bias_spec is None:
            self.bias = nn.Parameter(dense.bias.detach().clone())
        else:
            self.bias = set_shard_spec(nn.Parameter(self.bias_spec.shard(dense.bias.detach())),
                                       self.bias_spec)

    def to_dense(self) -> nn.Linear:
        """The dense ``nn.Linear`` (collective over the TP group; every rank gets it)."""
        weight = gather_full(self.weight, self.tp_group)
        if self.weight_spec.transposed:  # gather_full gives Conv1D's layout; nn.Linear: [out, in]
            weight = weight.t()
        dense = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                          device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            dense.weight.copy_(weight)
            if self.bias is not None:
                dense.bias.copy_(gather_full(self.bias, self.tp_group))
        return dense


class ColumnParallelLinear(_TPLinear):
    """``y = x Wᵀ + b`` with ``W`` split along its output features (rows)::

                 ┌ W_0 (out/tp × in) ┐          y_0 = x W_0ᵀ + b_0   on rank 0
        W  =     │ W_1               │   ⇒      y_1 = x W_1ᵀ + b_1   on rank 1
                 └ …                 ┘          …

    The input ``x`` is replicated; each rank produces its slice of the output features.

    * forward: no communication; with ``gather_output=True`` an all-gather of ``y`` along the last
      dimension (backward of that gather: keep this rank's slice, no communication).
    * backward: one all-reduce of the input gradient ``∂L/∂x`` (size of ``x``), overlapped with the
      weight-gradient matmul — none when ``x`` needs no gradient. It is the collective matmul
      :func:`~.collective_matmul.copy_matmul`; with an :attr:`overlap` policy the all-reduce runs
      in the policy's chunks (:func:`chunks_of`), each while the next chunk's gradient is computed.

    ``sub_blocks`` (sizes summing to ``out_features``) marks a fused weight such as Q|K|V: each block
    is split separately, so every rank holds whole slices of each block. ``replicas=k`` splits the
    output features into ``tp/k`` shards held by ``k`` consecutive ranks each (key/value heads when
    there are fewer KV heads than ranks). ``reduce_input_grad=False`` leaves the all-reduce of the
    input gradient to the caller: several layers reading the same input (Q, K and V) then share one
    ``copy_to_tp_region`` and one all-reduce.
    """

    overlap = None  # an OverlapPolicy (parallelize's overlap="chunked"/"auto"): chunks_of

    def __init__(self, in_features: int, out_features: int, ctx, *, bias: bool = True,
                 gather_output: bool = False, sub_blocks: tuple[int, ...] | None = None,
                 replicas: int = 1, reduce_input_grad: bool = True, device=None, dtype=None):
        super().__init__()
        tp = ctx.tp_size
        if replicas < 1 or tp % replicas or (replicas > 1 and (gather_output or sub_blocks)):
            raise ValueError(f"replicas ({replicas}) must divide tp ({tp}) and cannot be combined "
                             f"with gather_output or sub_blocks")
        shards = tp // replicas
        if sub_blocks is not None:
            if sum(sub_blocks) != out_features:
                raise ValueError(f"sub_blocks {tuple(sub_blocks)} sum to {sum(sub_blocks)}, "
                                 f"expected out_features ({out_features})")
            for i, block in enumerate(sub_blocks):
                divide(block, shards, f"ColumnParallelLinear: sub-block {i} of out_features")
            sub_blocks = tuple(sub_blocks)
        self.in_features, self.out_features = in_features, out_features
        what = "ColumnParallelLinear: out_features" + (f" (held by {replicas} replicas per shard)"
                                                       if replicas > 1 else "")
        self.out_features_per_rank = divide(out_features, shards, what)
        self.gather_output, self.sub_blocks = gather_output, sub_blocks
        self.replicas, self.reduce_input_grad = replicas, reduce_input_grad
        self.tp_group, self.tp_size, self.tp_rank = ctx.tp_group, tp, ctx.tp_rank
        self.weight_spec = ShardSpec((out_features, in_features), 0, ctx.tp_rank, tp, sub_blocks,
                                     replicas=replicas)
        self.bias_spec = ShardSpec((out_features,), 0, ctx.tp_rank, tp, sub_blocks,
                                   replicas=replicas)
        order = self.weight_spec.dense_order() if gather_output else None
        if order is not None and device is not None and torch.device(device).type != "meta":
            order = order.to(device)
        self.register_buffer("_gather_order", order, persistent=False)
        dense = _dense_linear(in_features, out_features, bias, device, dtype)
        self._load_dense(dense)

    @classmethod
    def from_dense(cls, linear: nn.Module, ctx, *, gather_output: bool = False,
                   sub_blocks: tuple[int, ...] | None = None, replicas: int = 1,
                   reduce_input_grad: bool = True) -> ColumnParallelLinear:
        """This rank's exact slice of a dense ``nn.Linear`` (``weight [out, in]``) or GPT-2
        ``Conv1D`` (``weight [in, out]``)."""
        out_features, in_features = dense_weight(linear)[0].shape
        layer = cls(in_features, out_features, ctx, bias=linear.bias is not None,
                    gather_output=gather_output, sub_blocks=sub_blocks, replicas=replicas,
                    reduce_input_grad=reduce_input_grad, device="meta", dtype=linear.weight.dtype)
        layer._load_dense(linear)
        if layer._gather_order is not None:  # a dense layer on meta (shards filled later by
            device = linear.weight.device      # from_pretrained) keeps the order on the CPU
            layer._gather_order = layer.weight_spec.dense_order().to(
                "cpu" if device.type == "meta" else device)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x, self.weight, self.bias)

    def _forward(self, x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
        y = self.local_output(x, weight, bias)
        if self.tp_size == 1:
            return y
        if self.gather_output:
            y = gather_from_tp_region(y, self.tp_group, -1)
            if self._gather_order is not None:
                y = y.index_select(-1, self._gather_order)
        return y

    def local_output(self, x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
        """This rank's output features ``x W_rᵀ + b_r``, before any gather."""
        return self.entry(x, weight, bias)[1]

    def entry(self, x: torch.Tensor, weight: torch.Tensor, bias):
        """``(x as the layer's region sees it, x W_rᵀ + b_r)``: with ``reduce_input_grad`` by the
        collective matmul :func:`~.collective_matmul.copy_matmul` (its chunks from
        :func:`chunks_of`; one: the plain all-reduce of ``∂L/∂x``, overlapped with the
        weight-gradient matmul; none when ``x`` needs no gradient). An adapter (:mod:`.lora`) adds
        its output computed on the first, so its partial input gradient joins that all-reduce."""
        if self.tp_size == 1 or not self.reduce_input_grad:
            return x, F.linear(x, weight, bias)
        x_2d = x.reshape(-1, x.shape[-1])
        chunks = (chunks_of(self, "tp_entry", x_2d, weight.shape[0])
                  if torch.is_grad_enabled() else 1)  # (its only collective is in backward)
        label = "column_linear.bwd" if chunks == 1 else "copy_matmul.bwd"
        x_same, (y,) = copy_matmul(x_2d, [weight], [bias], self.tp_group, chunks, label)
        return x_same.view(x.shape), y.view(*x.shape[:-1], y.shape[-1])

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"out_features_per_rank={self.out_features_per_rank}, tp={self.tp_size}, "
                f"bias={self.bias is not None}, gather_output={self.gather_output}"
                + (f", sub_blocks={self.sub_blocks}" if self.sub_blocks else "")
                + (f", replicas={self.replicas}" if self.replicas > 1 else "")
                + ("" if self.reduce_input_grad else ", reduce_input_grad=False")
                + (f", input: copy_matmul over tp={self.tp_size} (bwd the input-gradient "
                   f"all-reduce in chunks, overlapped), {self.overlap!r}"
                   if self.overlap is not None and self.reduce_input_grad else ""))


class RowParallelLinear(_TPLinear):
    """``y = x Wᵀ + b`` with ``W`` split along its input features (columns)::

        W = [ W_0 | W_1 | … ]   (out × in/tp each)      y = Σ_r x_r W_rᵀ  + b

    Each rank multiplies its slice ``x_r`` of the input features; the partial outputs are summed.

    * forward: one all-reduce of the output (size of ``y``); the bias, replicated, is added once
      after it. With ``input_is_parallel=False`` the full ``x`` is taken and sliced locally (its
      backward then all-gathers the input gradient).
    * backward: no communication (the gradient of ``y`` is already replicated).

    The exit is the collective matmul :func:`~.collective_matmul.matmul_all_reduce`: one chunk
    without an :attr:`overlap` policy, else the policy's chunks (:func:`chunks_of`), the matmul of
    chunk ``i+1`` running while chunk ``i`` is all-reduced. A LoRA adapter's partial output joins
    the same op (:func:`exit_operands`).
    """

    overlap = None  # an OverlapPolicy (parallelize's overlap="chunked"/"auto"): chunks_of
    exit_name = "matmul_all_reduce"  # (extra_repr)
    exit_comm = "fwd the row matmul and its all-reduce in chunks, overlapped; bwd none"

    def __init__(self, in_features: int, out_features: int, ctx, *, bias: bool = True,
                 input_is_parallel: bool = True, device=None, dtype=None):
        super().__init__()
        tp = ctx.tp_size
        self.in_features, self.out_features = in_features, out_features
        self.in_features_per_rank = divide(in_features, tp, "RowParallelLinear: in_features")
        self.input_is_parallel = input_is_parallel
        self.tp_group, self.tp_size, self.tp_rank = ctx.tp_group, tp, ctx.tp_rank
        self.weight_spec = ShardSpec((out_features, in_features), 1, ctx.tp_rank, tp)
        self._load_dense(_dense_linear(in_features, out_features, bias, device, dtype))

    @classmethod
    def from_dense(cls, linear: nn.Module, ctx, *,
                   input_is_parallel: bool = True) -> RowParallelLinear:
        """This rank's exact slice of a dense ``nn.Linear`` (``weight [out, in]``) or GPT-2
        ``Conv1D`` (``weight [in, out]``)."""
        out_features, in_features = dense_weight(linear)[0].shape
        layer = cls(in_features, out_features, ctx, bias=linear.bias is not None,
                    input_is_parallel=input_is_parallel, device="meta",
                    dtype=linear.weight.dtype)
        layer._load_dense(linear)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x, self.weight)

    def _forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.partial_output(x, weight, self.bias)  # the whole sum
        x_local = x if self.input_is_parallel else scatter_to_tp_region(x, self.tp_group, -1)
        if x_local.shape[-1] != self.in_features_per_rank:
            raise ValueError(
                f"RowParallelLinear expects the last dimension of its input to be "
                f"in_features_per_rank ({self.in_features_per_rank} = {self.in_features} / tp "
                f"{self.tp_size}) with input_is_parallel=True, got {x_local.shape[-1]}")
        y = self.exit(x_local, weight)
        return y + self.bias if self.bias is not None else y

    def exit(self, x_local: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``Σ_r x_r W_rᵀ`` (with an adapter's partial, :func:`exit_operands`) by the collective
        matmul :func:`~.collective_matmul.matmul_all_reduce`, its chunks from
        :func:`chunks_of` (one: the plain all-reduce)."""
        chunks = chunks_of(self, "tp_exit", x_local.reshape(-1, x_local.shape[-1]), weight.shape[0])
        x_in, w = exit_operands(self, x_local, weight)
        y = matmul_all_reduce(x_in.reshape(-1, x_in.shape[-1]), w, self.tp_group, chunks)
        return y.view(*x_local.shape[:-1], w.shape[0])

    def partial_output(self, x_local: torch.Tensor, weight: torch.Tensor,
                       bias=None) -> torch.Tensor:
        """``x_r W_rᵀ (+ b)``: this rank's partial sum of the output, before it is reduced (an
        adapter adds its own partial here: :mod:`.lora`)."""
        return F.linear(x_local, weight, bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"in_features_per_rank={self.in_features_per_rank}, tp={self.tp_size}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}"
                + (f", output: {self.exit_name} over tp={self.tp_size} ({self.exit_comm}), "
                   f"{self.overlap!r}" if self.overlap is not None else ""))
