"""Checkpoint layouts: the chunks every rank contributes tile the dense tensor exactly — fused
sub-blocks, padded vocabularies, key/value replicas, Conv1D transposes, replicated tensors — with no
process group."""

from __future__ import annotations

import pytest
import torch

from ops_transformer import ShardSpec
from ops_transformer.checkpoint import Replicated, SpecLayout, layout_of
from ops_transformer.checkpoint.chunked import ChunkedTensor

SPECS = {  # name → (dense shape as the layer holds it, ShardSpec options)
    "column": ((16, 6), dict(split_dim=0)),
    "row": ((6, 16), dict(split_dim=1)),
    "fused_qkv": ((16, 6), dict(split_dim=0, sub_blocks=(8, 4, 4))),
    "padded_vocab": ((10, 3), dict(split_dim=0, padded=True)),
    "kv_replicas": ((8, 6), dict(split_dim=0, kv_heads=2)),
    "conv1d": ((16, 6), dict(split_dim=0, transposed=True)),
}


def _specs(shape, tp, split_dim, sub_blocks=None, padded=False, kv_heads=None,
           transposed=False):
    size = shape[split_dim]
    padded_size = -(-size // tp) * tp if padded and size % tp else None
    replicas = tp // kv_heads if kv_heads and kv_heads < tp else 1
    return [ShardSpec(shape, split_dim, r, tp, sub_blocks, padded_size, replicas, transposed)
            for r in range(tp)]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_chunks_of_all_ranks_tile_the_dense_tensor(name, tp):
    shape, options = SPECS[name]
    specs = _specs(shape, tp, **options)
    dense = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    stored = {}  # what a checkpoint keeps: one copy of each distinct chunk
    for spec in specs:
        layout = SpecLayout(spec)
        for offsets, piece in layout.chunks(spec.shard(dense)):
            if offsets in stored:  # a replica: the same chunk, identical data
                assert torch.equal(stored[offsets], piece)
            stored[offsets] = piece.clone()
    expected = dense.t() if options.get("transposed") else dense
    assert SpecLayout(specs[0]).global_shape == tuple(expected.shape)
    rebuilt = torch.full_like(expected, float("nan"))
    covered = torch.zeros(expected.shape, dtype=torch.int)
    for offsets, piece in stored.items():
        region = tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))
        rebuilt[region] = piece
        covered[region] += 1
    assert torch.equal(covered, torch.ones_like(covered)), "chunks overlap or leave gaps"
    assert torch.equal(rebuilt, expected)


def test_padding_rows_are_not_saved_and_load_as_zero():
    spec = ShardSpec((10, 3), 0, 3, 4, padded_size=12)  # rank 3 holds row 9 and two padding rows
    layout = SpecLayout(spec)
    buffer = torch.zeros(spec.local_shape)
    (offsets, view), = layout.chunks(buffer)
    assert offsets == (9, 0) and tuple(view.shape) == (1, 3)
    view.copy_(torch.ones(1, 3))  # what a load writes
    assert buffer.tolist() == [[1, 1, 1], [0, 0, 0], [0, 0, 0]]


def test_chunks_are_views_of_the_local_tensor():
    spec = ShardSpec((16, 6), 0, 1, 2, (8, 4, 4), transposed=True)
    local = torch.zeros(spec.local_shape)
    for _, view in SpecLayout(spec).chunks(local):
        view.fill_(1.0)
    assert bool((local == 1).all())


def test_a_tensor_may_bring_its_own_layout():
    tensor = torch.zeros(4, 2)
    assert isinstance(layout_of(tensor), Replicated)
    tensor.shard_spec = ShardSpec((8, 2), 0, 1, 2)
    assert isinstance(layout_of(tensor), SpecLayout)
    tensor.checkpoint_layout = Replicated((4, 2))  # e.g. an expert-parallel or ZeRO layout
    assert layout_of(tensor) is tensor.checkpoint_layout


def test_wrong_local_shape_is_named():
    with pytest.raises(ValueError, match=r"expected a local tensor of shape \(4, 6\), got \(5, 6\)"):
        SpecLayout(ShardSpec((8, 6), 0, 0, 2)).chunks(torch.zeros(5, 6))


def test_chunked_tensor_hands_dcp_compact_contiguous_chunks():
    spec = ShardSpec((16, 6), 0, 0, 2, transposed=True)
    chunked = ChunkedTensor.of(SpecLayout(spec), torch.randn(spec.local_shape))
    items = chunked.__create_write_items__("w", chunked)
    assert [tuple(i.index.offset) for i in items] == [(0, 0)]
    assert tuple(items[0].tensor_data.size) == (6, 16)
    assert chunked.__get_tensor_shard__(items[0].index).is_contiguous()
