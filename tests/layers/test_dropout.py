"""Dropout that matches one device (issue 29 item 2): each rank applies exactly the mask of the
model ``parallelize`` makes at tp 1 to its part — its heads, its share of the tokens, its rows of
the global batch — and replicated regions identical masks on every rank; training with dropout
0.1 at tp 2 and 4, with and without sequence parallelism, equals tp 1 (≤1e-6, fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers import assert_rel
from ops_transformer import GPT, gather_full_state_dict, init_parallel, parallelize
from ops_transformer.layers.dropout import Layout, ParallelDropout, block_index, keep_mask
from ops_transformer.models import preset

FP32_EXACT = 1e-6  # the bound
B, T, STEPS, P = 4, 16, 3, 0.1


# ---------------------------------------------------------------- the mask (no process group)

def test_keep_rate_and_independence():
    seed = torch.tensor(12345, dtype=torch.int64)
    index = torch.arange(1 << 20)
    keep = keep_mask(seed, index, P)
    assert abs(keep.float().mean().item() - (1 - P)) < 2e-3  # ±4σ at n = 2^20
    other = keep_mask(seed + 1, index, P)
    both = (keep & other).float().mean().item()
    assert abs(both - (1 - P) ** 2) < 2e-3  # another seed: an independent mask
    x = keep.float() - keep.float().mean()
    for lag in (1, 2, 64, 1024):  # neighbours (features, tokens, heads) are uncorrelated
        assert abs(float((x[:-lag] * x[lag:]).mean() / x.var())) < 5e-3, lag
    assert torch.equal(keep, keep_mask(seed, index, P))  # a function of (seed, index)
    assert keep_mask(seed, index, 0.0).all()


def _reference(seed: int, index: int, p: float) -> bool:
    """The hash in plain Python integers (unsigned 32-bit arithmetic)."""
    def mix(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    h = mix((index & 0xFFFFFFFF) ^ (seed & 0xFFFFFFFF))
    return mix(h ^ (index >> 32) ^ (seed >> 32)) >= int(p * 2 ** 32)


def test_the_hash_is_unsigned_32_bit_arithmetic():
    """int32 tensors with wrapping multiplications and masked shifts compute the unsigned hash,
    for indices beyond 2^31 (int64) too."""
    seed = 0x123456789ABCDEF
    index = [0, 1, 2, 12345, 2 ** 31 - 1, 2 ** 31, 2 ** 33 + 7, 2 ** 40 + 99]
    got = keep_mask(torch.tensor(seed), torch.tensor(index), 0.5).tolist()
    assert got == [_reference(seed, i, 0.5) for i in index]
    small = keep_mask(torch.tensor(seed), torch.tensor(index[:5], dtype=torch.int32), 0.5)
    assert small.tolist() == got[:5]


def test_each_layout_is_its_part_of_the_one_device_index():
    dense = torch.arange(2 * 2 * 4 * 8 * 8).view(4, 4, 8, 8)  # (dp·b, heads, s, s), dp = 2
    for dp_rank in (0, 1):
        rows = slice(2 * dp_rank, 2 * dp_rank + 2)
        for r in range(2):
            heads = Layout("heads", r, 2, dp_rank, 2).index((2, 2, 8, 8), "cpu")
            assert torch.equal(heads.long(), dense[rows, 2 * r:2 * r + 2])
            qrows = Layout("rows", r, 2, dp_rank, 2).index((2, 4, 4, 8), "cpu")
            assert torch.equal(qrows.long(), dense[rows, :, 4 * r:4 * r + 4])
    tokens = torch.arange(2 * 4 * 8 * 3).view(2, 4 * 8 * 3)  # per dp rank: (b·s·h) flat
    for dp_rank in (0, 1):
        for r in range(4):
            share = Layout("tokens", r, 4, dp_rank, 2).index((4, 2, 3), "cpu")  # (b, s/t, h)
            assert torch.equal(share.reshape(-1).long(), tokens[dp_rank, 24 * r:24 * (r + 1)])
        full = Layout("replicated", 1, 4, dp_rank, 2).index((4, 8, 3), "cpu")
        assert torch.equal(full.reshape(-1).long(), tokens[dp_rank])
    assert block_index((3, 5), (1, 2), (2, 2), "cpu").tolist() == [[7, 8], [12, 13]]
    assert block_index((1 << 16, 1 << 16), (1, 0), (1, 2), "cpu").dtype == torch.int64
    with pytest.raises(ValueError, match="dropout layout must be one of"):
        Layout("columns")


def test_parallel_dropout_scales_and_keeps_a_boolean_mask():
    torch.manual_seed(0)
    layer = ParallelDropout(0.5, Layout())
    x = torch.ones(64, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(x)
    assert set(y.unique().tolist()) == {0.0, 2.0} and [t.dtype for t in saved] == [torch.bool]
    y.sum().backward()
    assert torch.equal(x.grad, y.detach())
    assert torch.equal(layer.eval()(x), x)
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        ParallelDropout(1.0, Layout())


# ---------------------------------------------------------------- training on ranks

def _train(tp, sp=False, attention="heads", config="tiny", recompute="none"):
    ctx = init_parallel(tp=tp)
    torch.manual_seed(0)  # the same dense weights and the same dropout stream everywhere
    cfg = preset(config, max_seq_len=T, dropout=P, vocab_size=250)
    model = parallelize(GPT(cfg), ctx, sequence_parallel=sp, attention=attention,
                        recompute=recompute)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    rows = slice(ctx.dp_rank * B // ctx.dp_size, (ctx.dp_rank + 1) * B // ctx.dp_size)
    losses = []
    for _ in range(STEPS):
        batch = torch.randint(0, 250, (B, T + 1), generator=g)
        loss = model(batch[rows, :-1], batch[rows, 1:])[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        if ctx.dp_group is not None:  # the global batch's loss
            dist.all_reduce(loss, group=ctx.dp_group)
            loss /= ctx.dp_size
        losses.append(float(loss))
    return losses, gather_full_state_dict(model, ctx)


def _assert_equal_training(reference, run):
    (ref_losses, ref_state), (losses, state) = reference, run
    assert_rel(torch.tensor(losses), torch.tensor(ref_losses), FP32_EXACT, "losses")
    for key, value in ref_state.items():
        assert_rel(state[key], value, FP32_EXACT, key, floor=0.02)  # 0.02: the init scale


@pytest.mark.parametrize("nprocs,tp,sp,attention,config,recompute", [
    (2, 2, False, "heads", "tiny", "none"),
    (2, 2, True, "heads", "tiny", "none"),
    (2, 2, "regather", "heads", "llama-tiny", "none"),
    pytest.param(4, 4, True, "heads", "tiny", "none", marks=pytest.mark.slow),
    # dp 2 × tp 2: the global batch's masks
    pytest.param(4, 2, True, "heads", "tiny", "none", marks=pytest.mark.slow),
    pytest.param(2, 2, False, "heads", "llama-tiny", "selective", marks=pytest.mark.slow),
    pytest.param(2, 2, True, "heads", "llama-tiny", "full", marks=pytest.mark.slow),
    pytest.param(4, 4, False, "heads_allgather", "tiny", "none", marks=pytest.mark.slow),
    pytest.param(2, 2, False, "kv_split", "tiny", "none", marks=pytest.mark.slow),
    pytest.param(2, 2, False, "naive", "tiny", "none", marks=pytest.mark.slow),
])
def test_dropout_training_equals_tp_1(run_ranks, nprocs, tp, sp, attention, config, recompute):
    reference = run_ranks(_train, 1, 1, False, "heads", config)[0]
    for run in run_ranks(_train, nprocs, tp, sp, attention, config, recompute):
        _assert_equal_training(reference, run)


def _masks(sp):
    """The outputs of the embedding dropout and of the first residual dropout on this rank."""
    ctx = init_parallel(tp=2)
    torch.manual_seed(0)
    model = parallelize(GPT(preset("tiny", max_seq_len=T, dropout=0.5)), ctx,
                        sequence_parallel=sp)
    seen = []
    model.drop.register_forward_hook(lambda m, a, out: seen.append(out.detach() == 0))
    model.layers[0].drop.register_forward_hook(lambda m, a, out: seen.append(out.detach() == 0))
    idx = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(1))
    model(idx, idx)
    return seen[0], seen[1]


def test_replicated_regions_share_masks_and_shards_do_not(run_ranks):
    for sp in (False, True):
        (emb0, res0), (emb1, res1) = run_ranks(_masks, 2, sp)
        assert torch.equal(emb0, emb1)  # the embedding dropout: replicated
        if sp:  # each rank's token share has its own part of the one-device mask
            assert res0.shape == (2, T // 2, 64) and not torch.equal(res0, res1)
        else:
            assert torch.equal(res0, res1)


# ---------------------------------------------------------------- Hugging Face models

tr = pytest.importorskip("transformers")


def _hf_gpt2(tp, attn_pdrop):
    ctx = init_parallel(tp=tp)
    torch.manual_seed(0)
    model = tr.GPT2LMHeadModel(tr.GPT2Config(vocab_size=101, n_positions=32, n_embd=64, n_layer=2,
                                             n_head=4, resid_pdrop=P, embd_pdrop=P,
                                             attn_pdrop=attn_pdrop)).train()
    parallelize(model, ctx)  # at tp 1 too: the one-device masks (parallelize/dropout.py)
    ids = torch.randint(0, 101, (2, T), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(1)
    return float(model(input_ids=ids, labels=ids).loss)


@pytest.mark.slow
def test_hugging_face_dropout_matches_one_device(run_ranks):
    """``parallelize`` gives a Hugging Face GPT-2 the one-device masks (embedding, residual and,
    through its attention function, the attention probabilities on a rank's heads): tp 2 equals
    tp 1 with and without attention dropout (tests/parallelize/test_hf_dropout.py: gradients,
    SP, Llama)."""
    for attn_pdrop in (0.0, P):
        dense = run_ranks(_hf_gpt2, 1, 1, attn_pdrop)[0]
        assert abs(run_ranks(_hf_gpt2, 2, 2, attn_pdrop)[0] - dense) <= FP32_EXACT * abs(dense)
