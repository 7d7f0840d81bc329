"""Hugging Face's MoE styles (``moe_tp_experts``, ``moe_identity_expert``) on our MoE layers.

``transformers`` marks the experts module of a MoE block ``moe_tp_experts`` (its 3-D
``gate_up_proj`` / ``down_proj`` parameters ``packed_colwise`` / ``rowwise``): every rank runs its
slice of every expert and the partial outputs are summed. Our plan style ``moe`` (with
``hf_experts=True``) swaps that module for :class:`HFExperts`, a thin adapter around
:class:`~ops_transformer.layers.moe.ParallelExperts` (experts over ``ep``, each column→row over
``tp``: the communication table is in :mod:`ops_transformer.layers.moe`) that keeps the module's
call and its dense state-dict keys:

* experts written against ``transformers``' experts contract (``use_experts_implementation``:
  ``is_transposed``, ``has_gate``, ``has_bias``, a class's own ``_apply_gate``, interleaved gate
  and up rows, ``has_post_expert_norm``) — :meth:`ParallelExperts.from_stacked`; the norm after
  each expert (MuseSpark) stays a replicated parameter of this adapter, under its dense key, and
  runs on each expert's whole (TP-reduced) output before the router's weight; routing indices outside ``[0, n_experts)`` (a router's
  "no expert" sentinel, which those modules skip) are dropped;
* ``LongcatFlashExperts``: its zero-compute experts (indices ``n_routed …``) return the token
  itself, weighted — computed on every rank after the experts' reduction, which is why
  ``moe_identity_expert`` (Hugging Face divides the identity's input by ``tp`` to cancel the sum
  it then takes) needs no rule of ours; the unused ``gate_up_proj`` rows of those experts stay a
  replicated parameter;
* ``Llama4TextExperts``: every token runs through every expert, pre-scaled by its router score,
  expert-major rows ``(E·T, h)``, weights ``[E, h, 2F]`` / ``[E, F, h]``.

The split comes from what the module computes, not from the parameter styles of Hugging Face's
plan (Inkling's plan marks ``gate_up_proj`` ``colwise`` although its forward chunks it into gate
and up: each rank must hold a slice of both blocks).
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers.moe import ParallelExperts


def is_hf_experts(module: nn.Module) -> bool:
    """A ``transformers`` experts module with 3-D stacked weights."""
    weight = getattr(module, "gate_up_proj", None)
    if weight is None:
        weight = getattr(module, "up_proj", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 3


class HFExperts(nn.Module):
    """A ``transformers`` experts module computed by :class:`ParallelExperts` (see the module
    docstring). ``forward(hidden_states, top_k_index, top_k_weights)`` — or
    ``forward(rows)`` for ``call="all"`` — returns what the dense module returns."""

    def __init__(self, experts: ParallelExperts, *, call: str = "routed", identity: int = 0,
                 spare: torch.Tensor | None = None, dense_name: str = ""):
        super().__init__()
        if call not in ("routed", "all"):
            raise ValueError(f"HFExperts: call must be 'routed' or 'all', got {call!r}")
        self.experts, self.call, self.identity, self.dense_name = experts, call, identity, dense_name
        # rows of gate_up_proj that belong to identity experts: never read, kept for the state
        self.spare = None if spare is None else nn.Parameter(spare.detach().clone())

    @classmethod
    def from_dense(cls, module: nn.Module, ctx) -> HFExperts:
        name = type(module).__name__
        if hasattr(module, "is_transposed"):  # transformers' experts contract: flags say it all
            norm = (module.post_expert_norm if getattr(module, "has_post_expert_norm", False)
                    else None)  # a norm after each expert: kept here, under its dense key
            post_fn = None if norm is None else norm.forward  # a method: the module stays ours
            out = cls(ParallelExperts.from_stacked(module, ctx, post_fn=post_fn), dense_name=name)
            if norm is not None:
                out.post_expert_norm = norm
        elif name == "LongcatFlashExperts":
            if module.gate_up_proj is None:
                raise ValueError(f"{name}: no routed experts (n_routed_experts = 0) to split")
            n = module.num_routed_experts
            keys = {"w_in": "gate_up_proj", "w_out": "down_proj"}
            experts = ParallelExperts(module.gate_up_proj[:n], module.down_proj, ctx, gated=True,
                                      activation=module.act_fn, dense_keys=keys)
            out = cls(experts, identity=module.zero_expert_num,
                      spare=module.gate_up_proj[n:], dense_name=name)
        elif name == "Llama4TextExperts":
            keys = {"w_in": "gate_up_proj", "w_out": "down_proj"}
            experts = ParallelExperts(module.gate_up_proj.transpose(1, 2),
                                      module.down_proj.transpose(1, 2), ctx, gated=True,
                                      activation=module.act_fn, dense_keys=keys,
                                      dense_transposed=True)
            out = cls(experts, call="all", dense_name=name)
        else:
            raise ValueError(f"moe_tp_experts on {name}: its forward follows neither transformers' "
                             f"experts contract (use_experts_implementation) nor a layout we "
                             f"translate (LongcatFlashExperts, Llama4TextExperts)")
        for key in [k for k, _ in module.named_parameters(recurse=False)]:  # ParallelExperts
            module._parameters[key] = None  # holds them now (module's _apply_gate may still run)
        return out

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                top_k_weights: torch.Tensor | None = None) -> torch.Tensor:
        n = self.experts.n_experts
        if self.call == "all":  # (E·T, h), expert-major, already weighted by the router
            rows = hidden_states.reshape(-1, hidden_states.shape[-1])
            index = torch.arange(n, device=rows.device).repeat_interleave(rows.shape[0] // n)
            return self.experts(rows, index[:, None], rows.new_ones(rows.shape[0], 1))
        if top_k_index is None or top_k_weights is None:
            raise ValueError(f"{self.dense_name}: called without top_k_index/top_k_weights")
        routed = (top_k_index >= 0) & (top_k_index < n)
        y = self.experts(hidden_states, top_k_index.clamp(0, n - 1), top_k_weights, routed)
        if self.identity:  # zero-compute experts: the token itself, times its weight
            same = (top_k_index >= n) & (top_k_index < n + self.identity)
            weight = (top_k_weights * same).sum(-1, keepdim=True).to(hidden_states.dtype)
            y = y + hidden_states * weight
        return y.to(hidden_states.dtype)

    @torch.no_grad()
    def gather_dense_state(self) -> dict[str, torch.Tensor]:
        """The dense module's tensors, under its keys (collective over TP and EP)."""
        full = self.experts.gather_dense_state()
        if self.spare is not None:
            full["gate_up_proj"] = torch.cat([full["gate_up_proj"], self.spare.detach()])
        norm = getattr(self, "post_expert_norm", None)
        if norm is not None:  # replicated: every rank holds it whole
            full.update({f"post_expert_norm.{k}": v.detach().clone()
                         for k, v in norm.state_dict().items()})
        return full

    def extra_repr(self) -> str:
        return (f"{self.dense_name}, call={self.call}"
                + (f", identity_experts={self.identity}" if self.identity else ""))
