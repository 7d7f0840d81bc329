"""parallelize() on Hugging Face MoE models (tiny configs, random weights): Mixtral over TP (experts
split), over EP and both; Qwen2-MoE (shared expert, a dense layer), Qwen3-MoE and PhiMoE: logits,
greedy generation and training steps equal the unsharded model fed the same per-rank inputs."""

from __future__ import annotations

import os

import pytest
import torch

from helpers import assert_rel
from ops_transformer import gather_full_state_dict, init_parallel, parallelize

tr = pytest.importorskip("transformers")
tr.logging.set_verbosity_error()
VOCAB = 1001
_ = (tr.MixtralForCausalLM, tr.MixtralConfig, tr.Qwen2MoeForCausalLM, tr.Qwen2MoeConfig,
     tr.Qwen3MoeForCausalLM, tr.Qwen3MoeConfig, tr.PhimoeForCausalLM, tr.PhimoeConfig,
     tr.GenerationMixin)  # imported in the parent: forked ranks inherit them


def make(family: str):
    torch.manual_seed(0)
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                 vocab_size=VOCAB)
    if family == "mixtral":
        return tr.MixtralForCausalLM(tr.MixtralConfig(**small, num_local_experts=4,
                                                      num_experts_per_tok=2))
    if family == "qwen3_moe":  # per-head q/k norms
        return tr.Qwen3MoeForCausalLM(tr.Qwen3MoeConfig(**small, num_experts=4, head_dim=16,
                                                        num_experts_per_tok=2,
                                                        moe_intermediate_size=64))
    if family == "phimoe":  # LayerNorm, attention biases, sparsemixer routing
        return tr.PhimoeForCausalLM(tr.PhimoeConfig(**small, num_local_experts=4,
                                                    num_experts_per_tok=2))
    # layer 0 dense (mlp_only_layers), layer 1 experts + a gated shared expert
    return tr.Qwen2MoeForCausalLM(tr.Qwen2MoeConfig(
        **small, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=96, mlp_only_layers=[0]))


def _ids(ep_rank: int):
    return torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1 + ep_rank))


def _forward(family, tp, ep):
    parallel = int(os.environ["WORLD_SIZE"]) > 1
    ctx = init_parallel(tp=tp, ep=ep) if parallel else init_parallel()
    model = make(family).eval()
    if parallel:
        model = parallelize(model, ctx)
    out = []
    for ep_rank in [ctx.ep_rank] if parallel else range(ep):  # the reference: every EP rank's
        ids = _ids(ep_rank)
        with torch.no_grad():
            logits = model(input_ids=ids).logits
            # the same number of steps on every rank: EP ranks run each forward together
            greedy = model.generate(ids[:1, :4], max_new_tokens=8, min_new_tokens=8,
                                    do_sample=False, pad_token_id=0)
        out.append((ctx.ep_rank if parallel else ep_rank, logits, greedy.tolist()))
    return out, gather_full_state_dict(model, ctx)


@pytest.mark.parametrize("family,tp,ep", [
    ("mixtral", 2, 1),
    ("mixtral", 1, 2),
    pytest.param("mixtral", 2, 2, marks=pytest.mark.slow),
    pytest.param("qwen2_moe", 2, 1, marks=pytest.mark.slow),
    pytest.param("qwen2_moe", 1, 2, marks=pytest.mark.slow),
    pytest.param("qwen3_moe", 2, 2, marks=pytest.mark.slow),
    pytest.param("phimoe", 2, 2, marks=pytest.mark.slow),
])
def test_logits_and_generation_equal_unsharded(run_ranks, family, tp, ep):
    ref, ref_state = run_ranks(_forward, 1, family, tp, ep)[0]
    for out, state in run_ranks(_forward, tp * ep, family, tp, ep):
        (ep_rank, logits, greedy), = out
        assert logits.shape == ref[ep_rank][1].shape  # full vocabulary
        assert_rel(logits, ref[ep_rank][1], what=f"{family} logits")
        assert greedy == ref[ep_rank][2]
        assert list(state) == list(ref_state)  # Hugging Face's keys: gate_up_proj, down_proj
        assert all(torch.equal(state[k], ref_state[k]) for k in ref_state)


def _train(family, tp, ep):
    parallel = int(os.environ["WORLD_SIZE"]) > 1
    ctx = init_parallel(tp=tp, ep=ep) if parallel else init_parallel()
    model = make(family).train()
    model.config.output_router_logits = True  # Hugging Face's load-balancing loss, per rank
    if parallel:
        model = parallelize(model, ctx)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(3):
        step = []
        for ep_rank in [ctx.ep_rank] if parallel else range(ep):
            ids = _ids(ep_rank)
            loss = model(input_ids=ids, labels=ids).loss
            step.append(float(loss.detach()))
            (loss if parallel else loss / ep).backward()
        opt.step()
        opt.zero_grad()
        losses.append(step)
    return ctx.ep_rank, losses, gather_full_state_dict(model, ctx)


@pytest.mark.slow
@pytest.mark.parametrize("family,tp,ep", [("mixtral", 1, 2), ("mixtral", 2, 2)])
def test_training_equals_unsharded(run_ranks, family, tp, ep):
    _, ref_losses, ref_state = run_ranks(_train, 1, family, tp, ep)[0]
    for ep_rank, losses, state in run_ranks(_train, tp * ep, family, tp, ep):
        assert_rel(torch.tensor(losses)[:, 0], torch.tensor(ref_losses)[:, ep_rank],
                   what="losses")
        for key, value in ref_state.items():
            assert_rel(state[key], value, what=key, floor=0.02)
