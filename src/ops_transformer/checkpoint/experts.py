"""Expert-parallel weights in dense coordinates.

:class:`~ops_transformer.layers.moe.ParallelExperts` stacks the ``E/ep`` experts of its EP rank,
each split over TP: ``w_in [E/ep, W/tp, h]``, ``w_out [E/ep, h, F/tp]``, biases ``b_in``,
``b_out``. The module it replaced held either the same stacked tensors for all ``E`` experts
(``transformers``: ``gate_up_proj [E, 2F, h]``, ``down_proj [E, h, F]``) or one MLP per expert (the
reference MoE: ``experts.<e>.w_in.weight [W, h]``, …). A checkpoint stores the replaced module's
tensors, so it loads at any ``tp × ep`` and into the unparallelised model:

* stacked: one entry per tensor, its TP chunks shifted to the rank's first expert along dim 0
  (and, for a module stored ``[E, in, out]`` — ``dense_transposed`` — turned to that orientation);
* one MLP per expert: one entry per local expert ``j`` — the view ``local[j]`` — keyed
  ``<first + j>.w_in.weight``, its TP chunks those of the 2-D expert slice.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..parallel.sharding import shard_spec
from .layout import Entry, Layout, Replicated, SpecLayout

MLP_NAMES = {"w_in": "w_in.weight", "b_in": "w_in.bias", "w_out": "w_out.weight",
             "b_out": "w_out.bias"}


class ShiftedLayout:
    """``base``'s chunks of this rank's ``local`` experts, placed at expert ``first`` of
    ``n_experts`` along dim 0."""

    def __init__(self, base: Layout, first: int, n_experts: int):
        self.base, self.first = base, first
        self.global_shape = (n_experts, *base.global_shape[1:])

    def chunks(self, local: torch.Tensor):
        return [((offsets[0] + self.first, *offsets[1:]), view)
                for offsets, view in self.base.chunks(local)]


class TurnedLayout:
    """``base``'s chunks of a stacked weight with its last two dimensions swapped (modules stored
    ``[E, in, out]`` where the experts compute with ``[E, out, in]``: ``dense_transposed``)."""

    def __init__(self, base: Layout):
        self.base = base
        e, a, b = base.global_shape
        self.global_shape = (e, b, a)

    def chunks(self, local: torch.Tensor):
        return [((o[0], o[2], o[1]), view.transpose(1, 2)) for o, view in self.base.chunks(local)]


@dataclass(frozen=True)
class _Expert:
    """Selects local expert ``index`` of a stacked tensor."""

    index: int

    def __call__(self, local: torch.Tensor) -> torch.Tensor:
        return local[self.index]


def _expert_layout(param: torch.Tensor) -> Layout:
    """The layout of one expert's slice ``param[j]``."""
    spec = shard_spec(param)
    if spec is None:
        return Replicated(param.shape[1:])
    return SpecLayout(replace(spec, full_shape=spec.full_shape[1:], split_dim=spec.split_dim - 1))


def expert_entries(module, prefix: str) -> dict[str, list[Entry]]:
    shard, out = module.shard, {}
    for name in MLP_NAMES:
        param = getattr(module, name)
        if param is None:
            continue
        if module.dense_keys is not None:
            spec = shard_spec(param)
            base = SpecLayout(spec) if spec is not None else Replicated(param.shape)
            layout = ShiftedLayout(base, shard.first, shard.n_experts)
            if getattr(module, "dense_transposed", False) and param.dim() == 3:
                layout = TurnedLayout(layout)  # as gather_dense_state stores it
            out[name] = [Entry(prefix + module.dense_keys[name], layout)]
        else:
            layout = _expert_layout(param)
            out[name] = [Entry(f"{prefix}{shard.first + j}.{MLP_NAMES[name]}", layout, _Expert(j))
                         for j in range(shard.local)]
    return out


def hf_expert_entries(module, prefix: str) -> dict[str, list[Entry]]:
    """:class:`HFExperts`: its inner experts' entries under the Hugging Face module's keys (the
    inner module's own hook would name them ``<prefix>experts.gate_up_proj``)."""
    if module.spare is not None:  # identity-expert rows: see the module docstring
        return {}
    out = {f"experts.{name}": entries
           for name, entries in expert_entries(module.experts, prefix).items()}
    norm = getattr(module, "post_expert_norm", None)  # a norm after each expert: replicated
    for name, param in ([] if norm is None else norm.named_parameters()):
        out[f"post_expert_norm.{name}"] = [Entry(f"{prefix}post_expert_norm.{name}",
                                                 Replicated(param.shape))]
    return out
