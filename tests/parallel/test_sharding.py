"""ShardSpec: slicing, sub-blocks, padding and the way back, with no process group."""

from __future__ import annotations

import pytest
import torch

from ops_transformer import ShardSpec


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("dim,blocks", [(0, None), (1, None), (0, (8, 4, 4)), (0, (8, 8))])
def test_shard_then_unshard_is_identity(tp, dim, blocks):
    full = torch.randn(16, 12)
    specs = [ShardSpec((16, 12), dim, r, tp, blocks) for r in range(tp)]
    shards = [s.shard(full) for s in specs]
    assert all(tuple(s.shape) == specs[0].local_shape for s in shards)
    assert torch.equal(specs[0].unshard(shards), full)


def test_sub_blocks_give_each_rank_a_slice_of_every_block():
    full = torch.arange(16).float()  # q = 0..7, k = 8..11, v = 12..15
    spec = ShardSpec((16,), 0, 1, 2, (8, 4, 4))
    assert spec.shard(full).tolist() == [4, 5, 6, 7, 10, 11, 14, 15]
    assert spec.slices() == [(4, 4), (10, 2), (14, 2)]


def test_dense_order_undoes_rank_major_gather():
    full = torch.arange(16).float()
    specs = [ShardSpec((16,), 0, r, 2, (8, 4, 4)) for r in range(2)]
    gathered = torch.cat([s.shard(full) for s in specs])
    assert torch.equal(gathered[specs[0].dense_order()], full)
    assert ShardSpec((16,), 0, 0, 2).dense_order() is None


def test_padding_rows_are_zero_and_dropped_on_the_way_back():
    full = torch.randn(10, 3)
    specs = [ShardSpec((10, 3), 0, r, 4, padded_size=12) for r in range(4)]
    shards = [s.shard(full) for s in specs]
    assert specs[3].local_shape == (3, 3)
    assert torch.equal(shards[3][1:], torch.zeros(2, 3))
    assert torch.equal(specs[0].unshard(shards), full)


def test_shard_rejects_wrong_shape():
    with pytest.raises(ValueError, match=r"expected a dense tensor of shape \(4, 4\), got \(4, 5\)"):
        ShardSpec((4, 4), 0, 0, 2).shard(torch.zeros(4, 5))
