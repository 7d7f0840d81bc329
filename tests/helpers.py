"""Shared assertions for the tests (imported by test modules; pytest puts tests/ on sys.path)."""

from __future__ import annotations

import os

import torch

FP32_RTOL = 1e-5
# bf16 keeps 8 significant bits (unit roundoff 2^-8 ≈ 3.9e-3). A TP layer rounds each rank's
# partial result to bf16 before the all-reduce and rounds the sum again, where the dense layer rounds
# once, so a few bf16 ulps of difference relative to the largest value are expected.
BF16_RTOL = 2e-2


def rel_err(actual: torch.Tensor, expected: torch.Tensor, floor: float = 1e-12) -> float:
    """max |actual - expected| / max(max |expected|, floor) (computed in fp64)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = expected.abs().max().clamp_min(floor)
    return float((actual - expected).abs().max() / scale)


def assert_rel(actual, expected, rtol=FP32_RTOL, what="", floor=1e-12):
    err = rel_err(actual, expected, floor)
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol:.1e}"


def rank_chunk(full: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    return full.chunk(world, dim)[rank]


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, ended but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def local_part(param: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``dense`` for ``param``: its shard by the parameter's ``ShardSpec``,
    or ``dense`` itself for a replicated parameter."""
    from ops_transformer.parallel.sharding import shard_spec

    spec = shard_spec(param)
    return dense if spec is None else spec.shard(dense)


def set_from_dense(param: torch.Tensor, dense: torch.Tensor) -> None:
    """Copy this rank's part of the dense tensor ``dense`` into ``param``."""
    with torch.no_grad():
        param.copy_(local_part(param, dense))
