"""LoRA adapters on linear layers, sharded like their base layer (Hu et al. 2021, PEFT's layout).

An adapter adds ``s · B A drop(x)`` to a linear layer's ``W x + b``, with ``s = alpha / rank``
and two factors, in dense coordinates PEFT's ``lora_A.weight [rank, in]`` and
``lora_B.weight [out, rank]``. Under tensor parallelism each factor is cut as the base weight is
along the dimension they share, so the adapter's output lands where the layer's own does and
rides on the layer's own collectives::

    column-parallel (W split over outputs)        row-parallel (W split over inputs)

    x ─┬─ W_r ─────────────────┐                  x_r ─┬─ W_r ───────────────┐
       └─ drop ─ A ─ B_r ─ ·s ─┴─ + ─▶ y_r             └─ drop ─ A_r ─ B ─ ·s ─┴─ + ─▶ all-reduce ─▶ y
    A [rank, in]       replicated                 A_r [rank, in/tp]  split like W (per sub-block)
    B_r [out/tp, rank] split like W                B   [out, rank]    replicated
                       (Q|K|V, gate|up: each sub-block its own slice of B)

============== ================= ======================================= =======================
base layer     forward           backward: activation gradient           backward: factors
============== ================= ======================================= =======================
column         none              ``∂x = ∂y_r W_r + s·(∂y_r B_r) A``,     ``∂A`` partial on each
                                 partial: summed by the layer's own      rank: summed over tp
                                 input-gradient all-reduce (or the       (``GradSums``), ``∂B_r``
                                 region's, for Q/K/V or gate/up)         exact
row            the layer's own   none (``∂y`` is replicated)             ``∂B`` partial: summed
               all-reduce sums                                            over tp, ``∂A_r`` exact
               ``x_r A_rᵀ Bᵀ``
               with ``x_r W_rᵀ``
dense          none              none                                    as the base weight's
============== ================= ======================================= =======================

The row case needs no collective of its own because ``Σ_r x_r A_rᵀ Bᵀ = (Σ_r x_r A_rᵀ) Bᵀ``: each
rank's partial ``x_r A_rᵀ`` times the replicated ``B`` is a partial of the adapter's output, added
to the layer's partial before its all-reduce. In the column case the adapter's part of the input
gradient is a partial sum like the layer's, so both go into one all-reduce: a layer that reduces
its own input gradient computes the adapter on the input its collective matmul
(:func:`~.collective_matmul.copy_matmul`) hands back, so the adapter's partial joins that op's
all-reduce (in chunks too) — the same collective, of the same size. A row layer's adapter rides
on its exit op the same way (:func:`~.linear.exit_operands`). The replicated factor's gradient is partial on each rank; it is
marked (:func:`~ops_transformer.comm.bucketing.mark_partial_grad`) so that the model's
:class:`~ops_transformer.parallel.grad_reduce.GradSums` sums every adapter's in one coalesced
all-reduce per backward. The cost: the replicated factor's matmul (``rank`` columns) is repeated
on every rank.

Dropout (``drop``) is on the adapter's input, as PEFT's ``lora_dropout``, with the one-device
masks of :mod:`.dropout` (a counter-based hash of each element's index in the one-device tensor):
a column layer's input is replicated over TP, and its rows are this data-parallel rank's rows of
the global batch; a row layer's rank takes the indices of the dense input (``[…, in]``) cut as
``A`` is. So the masks at any ``dp × tp`` are those of one device running the global batch.

A layer gets its adapter in place (:func:`add_adapter`): its class becomes a small subclass of its
own (``LoRA[ColumnParallelLinear]``, made once per class, as a region is) with two children,
``lora_A`` and ``lora_B`` (:class:`LoRAFactor`), whose ``weight`` carries a
:class:`~ops_transformer.parallel.sharding.ShardSpec` when it is split — gathering, checkpoints
and export need nothing else. Names, the base layer's keys and ``isinstance`` are unchanged.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..comm import collectives as C
from ..comm.bucketing import mark_partial_grad, partial_grad_group
from ..parallel.sharding import ShardSpec, set_shard_spec, shard_spec
from .dropout import Layout, dropout, dropout_at
from .fp8_linear import Fp8Linear
from .linear import ColumnParallelLinear, RowParallelLinear, dense_weight
from .linear_variants import without_padding_grad
from .mixin import mix_into
from .overlap_regions import _ChunkedEntry
from .regions import GatherInput, GatherSequenceRegion, Region, RopeGradRegion

SUPPORTED = ("nn.Linear, GPT-2's Conv1D, ColumnParallelLinear and RowParallelLinear (with their "
             "padded, packed and sequence-parallel forms)")
# Regions a replicated (dense) linear may sit in: each gives every rank the layer's whole output.
DENSE_REGIONS = (GatherInput, RopeGradRegion)


class LoRAFactor(nn.Module):
    """One factor of an adapter, PEFT's ``lora_A`` or ``lora_B``: ``weight`` is this rank's part of
    the dense ``[rank, in]`` (A) or ``[out, rank]`` (B) matrix (``weight.shard_spec`` when split)."""

    def __init__(self, role: str, local: torch.Tensor, spec: ShardSpec | None):
        super().__init__()
        self.role = role
        self.weight = nn.Parameter(local)
        if spec is not None:
            set_shard_spec(self.weight, spec)

    def value(self) -> torch.Tensor:
        """``weight`` for the forward: on a padded layer, the gradient of this rank's padding is
        zeroed (as the layer's own weight's), so the padding stays zero."""
        spec = shard_spec(self.weight)
        if spec is None or not spec.padded_size:
            return self.weight
        return without_padding_grad(self.weight, spec)

    @property
    def dense_shape(self) -> tuple[int, ...]:
        spec = shard_spec(self.weight)
        return tuple(self.weight.shape) if spec is None else spec.full_shape

    def extra_repr(self) -> str:
        spec, group = shard_spec(self.weight), partial_grad_group(self.weight)
        shape = f"{self.role} {list(self.dense_shape)}"
        if spec is None or spec.tp_size == 1:
            where = "replicated"
        else:
            features = "output" if spec.split_dim == 0 else "input"
            blocks = ", per sub-block" if spec.sub_blocks and len(spec.sub_blocks) > 1 else ""
            where = f"split over {features} features{blocks}: {list(self.weight.shape)} per rank"
        summed = (f", gradient summed over {C.group_size(group)} ranks (grad_sums)"
                  if group is not None else "")
        return f"{shape}, {where}{summed}"


class LoRA(nn.Module):
    """What every adapted layer shares (mixed into its class by :func:`add_adapter`): the factors
    ``lora_A``, ``lora_B``, ``lora_rank``, ``lora_alpha``, ``lora_scaling`` and ``lora_dropout``, and
    the adapter's output on this rank's factors."""

    lora_A: LoRAFactor
    lora_B: LoRAFactor
    lora_rank, lora_alpha, lora_scaling, lora_dropout = 0, 0.0, 0.0, 0.0
    lora_layout = Layout()  # where this rank's rows sit in the global batch (dropout masks)
    lora_comm = ""  # how the adapter rides on the layer's collectives (extra_repr)

    def adapter(self, x: torch.Tensor) -> torch.Tensor:
        """``s · B A drop(x)`` on this rank's factors, PEFT's ``lora_B(lora_A(dropout(x))) *
        scaling``."""
        h = F.linear(self.lora_input(x), self.lora_A.value())  # (…, rank): partial for a row
        return F.linear(h, self.lora_B.value()) * self.lora_scaling  # layer

    def lora_input(self, x: torch.Tensor) -> torch.Tensor:
        """Dropout on the adapter's input: the one-device mask (:mod:`.dropout`) of this rank's
        rows of the global batch (the input is replicated over TP)."""
        return dropout(x, self.lora_dropout, self.lora_layout, self.training)

    def extra_repr(self) -> str:
        mine = (f"lora: rank={self.lora_rank}, alpha={self.lora_alpha:g} "
                f"(scaling {self.lora_scaling:g}), dropout={self.lora_dropout:g}, {self.lora_comm}")
        inner = super().extra_repr()
        return f"{inner}, {mine}" if inner else mine


class LoRAColumn(LoRA):
    """The adapter of a column-parallel layer: ``A`` replicated, ``B`` split as ``W``."""

    lora_comm = "adapter input gradient joins the layer's all-reduce"

    def local_output(self, x, weight, bias):
        if self.tp_size > 1 and self.reduce_input_grad:  # both partial input gradients, one sum
            x_region, y = self.entry(x, weight, bias)
            return y + self.adapter(x_region)
        return super().local_output(x, weight, bias) + self.adapter(x)


class LoRARow(LoRA):
    """The adapter of a row-parallel layer: ``A`` split as ``W``, ``B`` replicated."""

    lora_comm = "adapter partial x·Aᵀ·Bᵀ summed by the layer's output all-reduce"

    def partial_output(self, x_local, weight, bias=None):
        return super().partial_output(x_local, weight, bias) + self.adapter(x_local)

    def lora_input(self, x_local: torch.Tensor) -> torch.Tensor:
        """Dropout on this rank's input features: their part of the one-device mask (the
        indices of the dense input's elements, cut as ``A`` is)."""
        if not (self.training and self.lora_dropout) or self.tp_size == 1:
            return super().lora_input(x_local)
        spec = shard_spec(self.lora_A.weight)  # [rank, in], split over in as the layer's input
        dense = (*x_local.shape[:-1], spec.full_shape[1])
        x_spec = dataclasses.replace(spec, full_shape=dense, split_dim=len(dense) - 1)
        index = x_spec.shard(self.lora_layout.index(dense, x_local.device))
        return dropout_at(x_local, self.lora_dropout, index)


class LoRADense(LoRA):
    """The adapter of a replicated ``nn.Linear`` or ``Conv1D`` (tp 1, or a layer the plan keeps
    whole): both factors replicated; their gradients summed where the weight's are."""

    lora_comm = "no communication"

    def forward(self, x):
        if isinstance(self, Region):  # the region's collective first; the adapter: own_forward
            return super().forward(x)
        return super().forward(x) + self.adapter(x)

    def own_forward(self, x):
        return super().own_forward(x) + self.adapter(x)


def base_class(module: nn.Module) -> type:
    """The layer's own class, under any regions it is wrapped in."""
    return next(c for c in type(module).__mro__
                if not issubclass(c, (Region, LoRA, _ChunkedEntry)))


def is_conv1d(module: nn.Module) -> bool:
    """Whether the dense layer is a GPT-2 ``Conv1D`` (weight ``[in, out]``; PEFT's
    ``fan_in_fan_out``), before or after it was parallelised."""
    spec = getattr(module, "weight_spec", None)
    if spec is not None:
        return spec.transposed
    return base_class(module).__name__ == "Conv1D" and hasattr(module, "nf")


def adapter_kind(module: nn.Module) -> type[LoRA] | None:
    """The adapter ``module`` takes (:class:`LoRAColumn`, :class:`LoRARow`, :class:`LoRADense`),
    or ``None`` for a layer type LoRA does not support (already adapted ones included)."""
    if isinstance(module, LoRA):
        return None
    regions = [c for c in type(module).__mro__ if Region in c.__bases__]  # the region kinds
    base = base_class(module)
    if issubclass(base, ColumnParallelLinear):  # a chunked entry adds the adapter in its op
        fused = isinstance(module, _ChunkedEntry) and bool(module.columns)
        return LoRAColumn if fused or all(r is GatherSequenceRegion for r in regions) else None
    if issubclass(base, RowParallelLinear):
        return LoRARow if not regions else None
    if base in (nn.Linear, Fp8Linear) or (base.__name__ == "Conv1D" and hasattr(module, "nf")):
        return LoRADense if all(r in DENSE_REGIONS for r in regions) else None
    return None


def dense_dims(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of the dense layer behind ``module``."""
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        return module.in_features, module.out_features
    out_features, in_features = dense_weight(module)[0].shape
    return in_features, out_features


def add_adapter(module: nn.Module, ctx, *, rank: int, alpha: float, dropout: float,
                generator: torch.Generator) -> nn.Module:
    """Give ``module`` (in place) a LoRA adapter of ``rank``, sharded like it; returns it.

    ``A`` is drawn Kaiming-uniform (``a = √5``, PEFT's default) and ``B`` set to zero in dense
    coordinates from ``generator`` (on the CPU, in fp32), then sliced: every tp starts from the
    same adapter. The factors take the base weight's device and dtype."""
    kind = adapter_kind(module)
    if kind is None:
        raise ValueError(f"LoRA does not support {type(module).__name__}; it adapts {SUPPORTED}")
    in_features, out_features = dense_dims(module)
    a_dense = torch.empty(rank, in_features)
    nn.init.kaiming_uniform_(a_dense, a=math.sqrt(5), generator=generator)
    b_dense = torch.zeros(out_features, rank)
    base = module.weight
    specs = _factor_specs(module, kind, rank)
    factors = {}
    for role, dense, spec in (("A", a_dense, specs[0]), ("B", b_dense, specs[1])):
        local = dense if spec is None else spec.shard(dense)
        factors[role] = LoRAFactor(role, local.to(base.device, base.dtype), spec)
    for factor in factors.values():
        factor.train(module.training)
    _mark_partial(module, kind, factors, ctx)
    _set_class(module, kind)
    module.lora_A, module.lora_B = factors["A"], factors["B"]
    module.lora_rank, module.lora_alpha, module.lora_dropout = rank, float(alpha), float(dropout)
    module.lora_layout = Layout("replicated", ctx.tp_rank, ctx.tp_size, ctx.dp_ep_rank,
                                ctx.dp_ep_size, getattr(ctx, "cp_rank", 0),
                                getattr(ctx, "cp_size", 1))  # cp: this rank's head-tail tokens
    module.lora_scaling = alpha / rank
    return module


def _factor_specs(module, kind, rank) -> tuple[ShardSpec | None, ShardSpec | None]:
    """``(A's, B's)`` shard specs: the split factor's is the base weight's along the dimension
    they share (sub-blocks, padding and KV replicas included); the other one is replicated."""
    spec = getattr(module, "weight_spec", None)
    if kind is LoRADense or spec is None:
        return None, None
    in_features, out_features = dense_dims(module)
    if kind is LoRAColumn:
        return None, dataclasses.replace(spec, full_shape=(out_features, rank), transposed=False)
    return dataclasses.replace(spec, full_shape=(rank, in_features), transposed=False), None


def _mark_partial(module, kind, factors, ctx) -> None:
    """The replicated factor's gradient is partial over the TP group; the split one's is partial
    where the base weight's is (KV heads replicated over a subgroup)."""
    group = partial_grad_group(module.weight)
    replicated = {LoRAColumn: "A", LoRARow: "B"}.get(kind)
    for role, factor in factors.items():
        mark_partial_grad(factor.weight, ctx.tp_group if role == replicated else group)


def _set_class(module: nn.Module, kind: type[LoRA]) -> None:
    mix_into(module, kind, "LoRA[{}]")


def adapters(model: nn.Module) -> dict[str, LoRA]:
    """Every adapted layer of ``model`` by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRA)}


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapters' parameters by state-dict name (``<module>.lora_A.weight`` …)."""
    return {f"{name}.lora_{role}.weight": getattr(m, f"lora_{role}").weight
            for name, m in adapters(model).items() for role in ("A", "B")}
