"""The reference mixture-of-experts FFN: plain single-device PyTorch (SPEC F9).

One MoE layer replaces a Transformer block's FFN by ``n_experts`` copies of it and a router::

    probs            = softmax(x W_rᵀ)                         (N, E)   N tokens, E experts
    weights, experts = top_k(probs)                            (N, k)   renormalised when k > 1
    y[n]             = Σ_j weights[n, j] · FFN_{experts[n, j]}(x[n])     (kept slots only)

* **Capacity** (``capacity_factor`` not ``None``): per forward call (one rank's micro-batch), each
  expert takes at most ``ceil(capacity_factor · N · k / E)`` token-slots, earlier tokens first; a
  dropped slot contributes nothing (its token keeps the residual, and its other experts' outputs).
  ``None`` is dropless.
* **Load-balancing loss** (Switch Transformer, Fedus et al. 2021, eq. 4; GShard, Lepikhin et al.
  2020): ``E · Σ_i f_i · P_i`` with ``f_i`` the fraction of the ``N·k`` routed token-slots that chose
  expert ``i`` (before any dropping) and ``P_i`` the mean router probability of expert ``i``. It is
  minimal (1) for a uniform routing; only ``P_i`` carries a gradient.

The model knows nothing about parallelism: :class:`~ops_transformer.layers.moe.ParallelMoE` runs
the same computation with the experts spread over an ``ep`` axis and split over ``tp``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import check_moe_config  # noqa: F401 (its name here too)


class Router(nn.Module):
    """``x (N, h) -> (probs (N, E), top_k_weights (N, k), top_k_index (N, k))``.

    Softmax in fp32; top-k weights renormalised to sum to one when ``k > 1`` (Mixtral), the raw
    probability when ``k = 1`` (Switch). The weight starts at zero (uniform routing, and no draw
    from the random generator at construction); :class:`~ops_transformer.models.GPT` draws it after
    every other weight, so an MoE model with one expert starts from the dense model's weights.
    """

    def __init__(self, d_model: int, n_experts: int, top_k: int):
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.weight = nn.Parameter(torch.zeros(n_experts, d_model))

    def forward(self, x: torch.Tensor):
        probs = F.softmax(F.linear(x, self.weight).float(), dim=-1)  # (N, E)
        weights, index = probs.topk(self.top_k, dim=-1)  # (N, k)
        if self.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        return probs, weights.to(x.dtype), index

    def extra_repr(self) -> str:
        return f"d_model={self.weight.shape[1]}, n_experts={self.n_experts}, top_k={self.top_k}"


def expert_capacity(tokens: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    """``ceil(capacity_factor · tokens · top_k / n_experts)`` token-slots per expert."""
    return math.ceil(capacity_factor * tokens * top_k / n_experts)


def capacity_mask(index: torch.Tensor, n_experts: int, capacity_factor: float | None, *,
                  tokens: int | None = None, before: torch.Tensor | None = None
                  ) -> torch.Tensor | None:
    """``keep (N, k)``: whether each token-slot fits its expert's capacity, earlier tokens first;
    ``None`` when dropless. A token picks distinct experts, so the order of its own slots does
    not matter. ``tokens``: the tokens the capacity is of (default: these ``N``); ``before``
    ``(E,)``: slots earlier tokens elsewhere already took of each expert (the global batch's rows
    before these: :mod:`ops_transformer.layers.moe_stats`)."""
    if capacity_factor is None:
        return None
    n, k = index.shape
    limit = expert_capacity(n if tokens is None else tokens, k, n_experts, capacity_factor)
    flat = index.reshape(-1)
    one_hot = F.one_hot(flat, n_experts)  # (N·k, E), token-major
    position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # this slot's place in its expert's queue
    if before is not None:
        position = position + before[flat]
    return (position < limit).view(n, k)


def expert_counts(index: torch.Tensor, n_experts: int) -> torch.Tensor:
    """``(E,)`` float: the routed token-slots of each expert (before any dropping)."""
    flat = index.reshape(-1)  # on the device (bincount reads its max: a sync)
    return torch.zeros(n_experts, device=index.device).scatter_add_(
        0, flat, torch.ones(flat.shape, device=index.device))


def load_balancing_loss(probs: torch.Tensor, index: torch.Tensor, *,
                        counts: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
    """``E · Σ_i f_i · P_i`` over this call's tokens (``f_i`` from all routed slots). ``counts``
    ``(E,)``: the slots ``f`` is taken from instead (the global batch's); ``scale`` multiplies
    ``P`` (see :mod:`ops_transformer.layers.moe_stats`)."""
    n_experts = probs.shape[-1]
    counts = expert_counts(index, n_experts) if counts is None else counts
    f = (counts / counts.sum()).to(probs.dtype)
    return n_experts * (f * probs.mean(0) * scale).sum()


class RoutingStats:
    """What an MoE layer's last forward leaves behind: its load-balancing loss (a tensor in the
    graph) and how many of its token-slots were dropped (a 0-d integer tensor) out of how many."""

    aux_loss: torch.Tensor | None = None
    dropped: torch.Tensor | None = None
    slots: int = 0

    def route(self, probs, index) -> torch.Tensor | None:
        """The capacity's ``keep`` mask of this call's slots, its statistics recorded: over this
        call's tokens (a rank's micro-batch). :class:`~ops_transformer.layers.moe_stats.
        GlobalRouting` takes them over the global batch instead."""
        keep = capacity_mask(index, self.n_experts, self.capacity_factor)
        self._record(probs, index, keep)
        return keep

    def _record(self, probs, index, keep, **aux) -> None:
        self.aux_loss = load_balancing_loss(probs, index, **aux)
        self.dropped = (index.new_zeros(()) if keep is None else (~keep).sum())
        self.slots = index.numel()


class MoE(RoutingStats, nn.Module):
    """``n_experts`` FFNs behind a top-k router; ``expert`` builds one FFN from the config (the
    model's own MLP class, GELU or SwiGLU). Input and output ``(B, T, d_model)``."""

    def __init__(self, cfg, expert: type[nn.Module]):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.capacity_factor = cfg.moe_capacity_factor
        self.experts = nn.ModuleList(expert(cfg) for _ in range(cfg.n_experts))
        self.router = Router(cfg.d_model, cfg.n_experts, cfg.top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, h)
        probs, weights, index = self.router(x)
        keep = self.route(probs, index)
        if keep is not None:
            weights = weights * keep
        out = x.new_zeros(x.shape)
        for e, expert in enumerate(self.experts):
            selected = index == e  # (N, k)
            if keep is not None:
                selected &= keep
            token, slot = selected.nonzero(as_tuple=True)
            if token.numel():
                out = out.index_add(0, token, expert(x[token]) * weights[token, slot, None])
        return out.view(shape)

    def extra_repr(self) -> str:
        return (f"n_experts={self.n_experts}, top_k={self.top_k}, "
                f"capacity_factor={self.capacity_factor}")


def init_routers(model: nn.Module, std: float = 0.02) -> None:
    """Draw every router's weight from ``N(0, std²)``; called last by the model's constructor."""
    for module in model.modules():
        if isinstance(module, Router):
            nn.init.normal_(module.weight, std=std)


def moe_aux_loss(model: nn.Module) -> torch.Tensor | float:
    """The sum of the load-balancing losses of the model's MoE layers in the last forward."""
    losses = [m.aux_loss for m in model.modules()
              if isinstance(m, RoutingStats) and m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else 0.0


def moe_stat_tensors(model: nn.Module) -> dict | None:
    """``{"aux_loss", "dropped"}`` as 0-d float64 device tensors (summed over the MoE layers of the
    last forward on this rank) and ``"slots"`` (an int): no host sync. ``None``: no MoE layer ran."""
    layers = [m for m in model.modules() if isinstance(m, RoutingStats) and m.aux_loss is not None]
    if not layers:
        return None
    values = torch.stack([torch.stack([m.aux_loss.detach().double(), m.dropped.double()])
                          for m in layers]).sum(0)
    return {"aux_loss": values[0], "dropped": values[1], "slots": sum(m.slots for m in layers)}


def moe_stats(model: nn.Module) -> dict[str, float]:
    """``{"aux_loss", "dropped", "slots", "dropped_fraction"}`` of the last forward on this rank,
    summed over MoE layers (``aux_loss`` before the coefficient). One host sync."""
    stats = moe_stat_tensors(model)
    if stats is None:
        return {"aux_loss": 0.0, "dropped": 0, "slots": 0, "dropped_fraction": 0.0}
    aux, dropped = torch.stack([stats["aux_loss"], stats["dropped"]]).tolist()
    slots = stats["slots"]
    return {"aux_loss": aux, "dropped": int(dropped), "slots": slots,
            "dropped_fraction": dropped / slots if slots else 0.0}
