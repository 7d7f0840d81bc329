"""Sharding metadata carried by every tensor-parallel parameter, and the way back to dense.

A sharded parameter has a ``shard_spec`` attribute (:class:`ShardSpec`): the dense parameter's
shape, the dimension it is split along, this rank's place, and — for fused weights such as QKV or
SwiGLU's gate/up — the sub-blocks that are split one by one, so that each rank holds whole pieces of
every block. With it, gathering, checkpointing and resharding need no model-specific code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..comm import collectives as C


def divide(size: int, tp: int, what: str) -> int:
    """``size // tp``, or a ``ValueError`` naming the dimension, its size and the degree."""
    if size % tp != 0:
        raise ValueError(f"{what} ({size}) is not divisible by the tensor-parallel degree "
                         f"tp ({tp}); choose a tp that divides {size}")
    return size // tp


@dataclass(frozen=True)
class ShardSpec:
    """How this rank's tensor relates to the dense one.

    ``full_shape`` is the dense (user-visible) shape. ``padded_size`` is the size of ``split_dim``
    after zero padding to a multiple of ``tp_size`` (vocabularies), ``None`` when not padded.
    ``sub_blocks`` are the sizes along ``split_dim`` of fused blocks, each split separately.
    ``replicas > 1`` splits into ``tp_size / replicas`` shards, each held by ``replicas``
    consecutive ranks (key/value heads when there are fewer KV heads than ranks). ``transposed``
    marks a parameter whose dense form is the transpose of ``full_shape`` (GPT-2's ``Conv1D``
    stores ``[in, out]`` where the parallel layer keeps ``[out, in]``).
    """

    full_shape: tuple[int, ...]
    split_dim: int
    tp_rank: int
    tp_size: int
    sub_blocks: tuple[int, ...] | None = None
    padded_size: int | None = None
    replicas: int = 1
    transposed: bool = False

    @property
    def split_size(self) -> int:
        return self.padded_size or self.full_shape[self.split_dim]

    @property
    def num_shards(self) -> int:
        return self.tp_size // self.replicas

    @property
    def shard_index(self) -> int:
        return self.tp_rank // self.replicas

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.split_dim] = self.split_size // self.num_shards
        return tuple(shape)

    def blocks(self) -> tuple[int, ...]:
        return self.sub_blocks or (self.split_size,)

    def slices(self) -> list[tuple[int, int]]:
        """``(start, length)`` ranges of the (padded) dense ``split_dim`` held by this rank."""
        out, offset = [], 0
        for block in self.blocks():
            part = block // self.num_shards
            out.append((offset + self.shard_index * part, part))
            offset += block
        return out

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the dense tensor ``full``."""
        if tuple(full.shape) != self.full_shape:
            raise ValueError(f"expected a dense tensor of shape {self.full_shape}, "
                             f"got {tuple(full.shape)}")
        full = self._pad(full)
        pieces = [full.narrow(self.split_dim, start, n) for start, n in self.slices()]
        return torch.cat(pieces, self.split_dim) if len(pieces) > 1 else pieces[0].clone()

    def unshard(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The dense tensor from the shards of all ranks (ordered by tp rank; with replicas, one
        shard per replica set is used)."""
        shards = shards[::self.replicas] if len(shards) == self.tp_size else shards
        parts = [b // self.num_shards for b in self.blocks()]
        per_rank = [s.split(parts, self.split_dim) for s in shards]
        blocks = [torch.cat([pr[i] for pr in per_rank], self.split_dim) for i in range(len(parts))]
        full = torch.cat(blocks, self.split_dim) if len(blocks) > 1 else blocks[0]
        return full.narrow(self.split_dim, 0, self.full_shape[self.split_dim])

    def _pad(self, full: torch.Tensor) -> torch.Tensor:
        extra = self.split_size - self.full_shape[self.split_dim]
        if extra == 0:
            return full
        pad_shape = list(full.shape)
        pad_shape[self.split_dim] = extra
        return torch.cat([full, full.new_zeros(pad_shape)], self.split_dim)

    def dense_order(self) -> torch.Tensor | None:
        """Indices that put an all-gathered (rank-major) ``split_dim`` back in dense order, or
        ``None`` when the rank-major order already is the dense order."""
        if not self.sub_blocks or len(self.sub_blocks) == 1:
            return None
        gathered = torch.arange(self.split_size)  # position k of the gathered tensor holds...
        specs = [ShardSpec(self.full_shape, self.split_dim, r, self.num_shards, self.sub_blocks)
                 for r in range(self.num_shards)]
        dense_index = torch.cat([torch.cat([torch.arange(s, s + n) for s, n in sp.slices()])
                                 for sp in specs])  # ...this dense index
        order = torch.empty_like(gathered)
        order[dense_index] = gathered
        return order


def set_shard_spec(param: nn.Parameter, spec: ShardSpec) -> nn.Parameter:
    param.shard_spec = spec
    return param


def shard_spec(tensor: torch.Tensor) -> ShardSpec | None:
    return getattr(tensor, "shard_spec", None)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a ``DTensor``'s local part (a parameter, gradient or optimizer
    state that FSDP2 shards over data-parallel ranks: its rows), else the tensor itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def data_shard_rows(tensor: torch.Tensor) -> tuple[int, int]:
    """``(first row, rows)`` of dim 0 of the whole (tensor-parallel) tensor that this rank's
    part of a data-parallel ``DTensor`` holds — ``torch.chunk``'s split, as FSDP2 shards — or
    ``(0, rows)`` for a plain tensor."""
    rows = tensor.shape[0] if tensor.dim() else 1
    if not isinstance(tensor, DTensor):
        return 0, rows
    mesh = tensor.device_mesh
    chunk = -(-rows // mesh.size())
    first = min(rows, mesh.get_local_rank() * chunk)
    return first, min(chunk, rows - first)


@torch.no_grad()
def gather_data_shards(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor-parallel tensor behind a data-parallel ``DTensor`` (FSDP2's dim-0 shards,
    all-gathered over its mesh's group: collective, label ``gather_full``); a plain tensor is
    returned as it is."""
    if not isinstance(tensor, DTensor):
        return tensor.detach()
    local, group = tensor._local_tensor.detach(), tensor.device_mesh.get_group()
    n, rows = tensor.device_mesh.size(), tensor.shape[0]
    chunk = -(-rows // n)
    padded = local.new_zeros((chunk, *local.shape[1:]))
    padded[:local.shape[0]].copy_(local)
    out = local.new_empty((n * chunk, *local.shape[1:]))
    C.all_gather_into(out, padded, group, label="gather_full")
    return out[:rows]


@torch.no_grad()
def gather_full(tensor: torch.Tensor, group) -> torch.Tensor:
    """The dense tensor behind a sharded parameter (every rank gets it); others are copied. A
    parameter sharded over data-parallel ranks too (FSDP2's ``DTensor``) is first gathered over
    them."""
    spec = shard_spec(tensor)
    tensor = gather_data_shards(tensor)
    if spec is None:
        return tensor.detach().clone()
    local = tensor.detach().movedim(spec.split_dim, 0).contiguous()
    out = local.new_empty((spec.tp_size * local.shape[0], *local.shape[1:]))
    C.all_gather_into(out, local, group, label="gather_full")
    shards = [s.movedim(0, spec.split_dim) for s in out.chunk(spec.tp_size, 0)]
    full = spec.unshard(shards)
    return (full.t() if spec.transposed else full).contiguous()


def gather_full_state_dict(model: nn.Module, ctx) -> dict[str, torch.Tensor]:
    """The dense state dict of a tensor-parallel model, with the keys and shapes of the model
    before it was parallelised. Every rank of the TP group receives it (collective call); with
    expert parallelism every rank of the TP and EP groups. A module whose parameters are laid out
    unlike the dense one it replaced (experts spread over ``ep``) gives its dense tensors back
    through its ``gather_dense_state()``."""
    regrouped = {f"{name}." if name else "": m for name, m in model.named_modules()
                 if hasattr(m, "gather_dense_state")}
    state, done = {}, set()
    for name, value in model.state_dict(keep_vars=True).items():
        prefix = next((p for p in regrouped if name.startswith(p)), None)
        if prefix is None:
            state[name] = gather_full(value, ctx.tp_group)
        elif prefix not in done:  # the whole module's dense tensors, where its first key was
            done.add(prefix)
            state.update({prefix + k: v for k, v in regrouped[prefix].gather_dense_state().items()})
    return state
