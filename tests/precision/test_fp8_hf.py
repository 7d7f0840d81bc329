"""``parallelize(hf_model, precision="fp8")``: a Hugging Face Llama's block linears in fp8 at tp 1,
tp 2 and under sequence parallelism, equal to the dense one-process model with the same recipe
(its ``nn.Linear`` layers swapped by ``convert_to_fp8``): loss and every block gradient."""

from __future__ import annotations

import os

import pytest
import torch

import ops_transformer as ot
from ops_transformer.layers.fp8_linear import convert_to_fp8
from ops_transformer.parallel.sharding import shard_spec

tr = pytest.importorskip("transformers")

TOL = 1e-5  # fp32 summation order of partial sums (the fp8 operands are the dense ones)


def _llama():
    torch.manual_seed(0)
    cfg = tr.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)
    return tr.LlamaForCausalLM(cfg)


def _idx():
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


def _dense():
    model = _llama()
    assert convert_to_fp8(model.model.layers) == 2 * 7  # q, k, v, o, gate, up, down
    loss = model(input_ids=_idx(), labels=_idx()).loss
    loss.backward()
    return model, float(loss.detach())


def _parallel(sequence_parallel):
    torch.set_num_threads(1)
    ctx = ot.init_parallel(tp=int(os.environ["WORLD_SIZE"]))
    model = ot.parallelize(_llama(), ctx, precision="fp8", sequence_parallel=sequence_parallel)
    with ot.CommLedger() as ledger:
        loss = model(input_ids=_idx(), labels=_idx()).loss
        loss.backward()
    dense, _ = _dense()
    want = dict(dense.named_parameters())
    grads = {n: (p.grad, shard_spec(p).shard(want[n].grad) if shard_spec(p) else want[n].grad)
             for n, p in model.named_parameters() if ".layers." in n}
    fp8 = sum("Fp8" in type(m).__name__ for m in model.modules())
    return float(loss.detach()), grads, fp8, {r.label for r in ledger.records}


@pytest.mark.parametrize("tp, sequence_parallel", [(1, False), (2, False), (2, True)])
def test_hf_llama_fp8_matches_dense_fp8(run_ranks, tp, sequence_parallel):
    _, loss = _dense()
    for rank, (got, grads, fp8, labels) in enumerate(run_ranks(_parallel, tp,
                                                               sequence_parallel)):
        assert got == pytest.approx(loss, rel=TOL), rank
        assert fp8 >= 2 * 7, fp8  # every block linear is an fp8 one
        assert len(grads) == 2 * 9  # 7 linear weights + 2 norms per block
        for name, (g, want) in grads.items():
            err = float((g - want).abs().max() / want.abs().max())
            assert err < TOL, f"rank {rank} {name}: {err:.1e}"
        if tp == 2:
            assert "fp8.amax" in labels and ("fp8.gather.fwd" in labels) == sequence_parallel
