"""Hugging Face plans: Qwen3 (whose q_norm/k_norm style stopped the old translation) at tp 2 and 4
under its own plan and under Hugging Face's translated one; user tp_plan overrides and the errors
for styles we do not know or lack; the vocabulary split chosen by cost, counted by the ledger."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from helpers import assert_rel
from ops_transformer import CommLedger, gather_full_state_dict, init_parallel, parallelize

tr = pytest.importorskip("transformers")
tr.logging.set_verbosity_error()
from ops_transformer.parallelize.hf_plans import hf_plan, translated_plan  # noqa: E402

_ = (tr.Qwen3ForCausalLM, tr.Qwen3Config, tr.LlamaForCausalLM, tr.LlamaConfig,
     tr.MixtralForCausalLM, tr.MixtralConfig, tr.GenerationMixin)  # imported before the fork


def qwen3(vocab=1001, intermediate=37):
    """2 KV heads (replicated at tp 4); an FFN width that divides by neither 2 nor 4 (padded)."""
    torch.manual_seed(0)
    return tr.Qwen3ForCausalLM(tr.Qwen3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=intermediate, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64))


def _ids():
    ids = torch.randint(0, 1001, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    return ids, mask


def _run(model):
    """Logits, greedy tokens, then one SGD step on the model's own loss: the weights after it."""
    ids, mask = _ids()
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        greedy = model.generate(ids[:1, :4], max_new_tokens=6, do_sample=False, pad_token_id=0)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
    loss.backward()
    opt.step()
    return logits, greedy.tolist(), float(loss)


def _qwen3(how):
    ctx = init_parallel(tp=int(os.environ["WORLD_SIZE"]))
    model = qwen3()
    dense = copy.deepcopy(model)
    ref_logits, ref_greedy, ref_loss = _run(dense)
    plan = translated_plan(model, ctx.tp_size) if how == "translated" else "auto"
    parallelize(model, ctx, plan=plan)
    logits, greedy, loss = _run(model)
    assert_rel(logits, ref_logits, what="logits")
    assert greedy == ref_greedy
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    state = gather_full_state_dict(model, ctx)
    assert list(state) == list(dense.state_dict())
    for key, value in dense.state_dict().items():
        assert_rel(state[key], value, what=f"{key} after a step", floor=0.02)  # the init scale
    return str(model.parallel_plan)


@pytest.mark.parametrize("tp,how", [(2, "auto"), (4, "auto"), (2, "translated"),
                                    pytest.param(4, "translated", marks=pytest.mark.slow)])
def test_qwen3_equals_unsharded(run_ranks, tp, how):
    plan = run_ranks(_qwen3, tp, how)[0]
    assert "grad_allreduce" in plan  # q_norm / k_norm
    if tp == 4:
        assert "kv_heads=2" in plan and "num_key_value_groups" in plan  # KV heads replicated


# --- tp_plan: Hugging Face's conventions --------------------------------------------------------

OVERRIDE = {"model.layers.*.mlp.gate_proj": "colwise_gather_output",
            "model.layers.*.mlp.up_proj": "colwise_gather_output",
            "model.layers.*.mlp.down_proj": "rowwise_split_input"}


def _override():
    ctx = init_parallel(tp=2)
    model = qwen3(intermediate=64)
    dense = copy.deepcopy(model).eval()
    parallelize(model, ctx, tp_plan=OVERRIDE)
    ids, mask = _ids()
    with torch.no_grad():
        assert_rel(model.eval()(input_ids=ids).logits, dense(input_ids=ids).logits)
    return model.parallel_plan.rules


def test_user_tp_plan_overrides_the_family_plan(run_ranks):
    rules = run_ranks(_override, 2)[0]
    assert rules["model.layers.*.mlp.gate_proj"]["gather_output"] is True
    assert rules["model.layers.*.mlp.down_proj"]["input_is_parallel"] is False
    assert rules["model.layers.*.self_attn.q_norm"] == {"style": "grad_allreduce"}  # the rest kept


def test_empty_tp_plan_splits_nothing():
    assert translated_plan(qwen3(), 2, tp_plan={}).rules == {}


@pytest.mark.parametrize("tp_plan,needle", [
    ({"model.layers.*.mlp.up_proj": "columnwise"},
     r"'model.layers.\*.mlp.up_proj' has style 'columnwise', which is not a Hugging Face "
     r"tensor-parallel style \(known: .*colwise"),
    ({"model.layers.*.mlp.nope": "colwise"}, r"tp_plan key 'model.layers.\*.mlp.nope' matches no"),
])
def test_bad_tp_plan_is_a_clear_error(tp_plan, needle):
    with pytest.raises(ValueError, match=needle):
        hf_plan(qwen3(), 2, tp_plan=tp_plan)


def test_moe_styles_translate_to_our_experts():
    torch.manual_seed(0)
    model = tr.MixtralForCausalLM(tr.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=2))
    rules = translated_plan(model, 2).rules
    assert rules["model.layers.*.mlp.experts"] == {"style": "moe", "hf_experts": True}
    assert not [p for p in rules if p.startswith("model.layers.*.mlp.experts.")]  # with it


def _mixtral_translated(tp, ep):
    """Mixtral under Hugging Face's own plan (moe_tp_experts) rather than ours: logits and the
    gathered gradients."""
    parallel = int(os.environ["WORLD_SIZE"]) > 1
    ctx = init_parallel(tp=tp, ep=ep) if parallel else init_parallel()
    torch.manual_seed(0)
    model = tr.MixtralForCausalLM(tr.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4))
    if parallel:  # a tp_plan (even one repeating the model's entry) selects the translation
        parallelize(model, ctx, tp_plan={"model.layers.*.mlp.experts": "moe_tp_experts"})
        assert type(model.model.layers[0].mlp.experts).__name__ == "HFExperts"
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    logits = model(input_ids=ids).logits
    logits.square().mean().backward()
    params = dict(model.named_parameters())
    for p in params.values():
        p.data = p.grad
    return logits.detach(), gather_full_state_dict(model, ctx)


@pytest.mark.parametrize("tp,ep", [(2, 1), pytest.param(2, 2, marks=pytest.mark.slow)])
def test_translated_moe_plan_equals_unsharded(run_ranks, tp, ep):
    ref_logits, ref_grads = run_ranks(_mixtral_translated, 1, 1, 1)[0]
    for logits, grads in run_ranks(_mixtral_translated, tp * ep, tp, ep):
        assert_rel(logits, ref_logits, what="logits")
        for key, g in ref_grads.items():
            assert_rel(grads[key], g, what=f"gradient of {key}")


def test_heads_that_do_not_divide_are_refused():
    model = qwen3()
    model.config.num_attention_heads = 6
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\) is not divisible by tp \(4\)"):
        translated_plan(model, 4)


# --- the vocabulary split, by cost ---------------------------------------------------------------

def _step_collectives(vocab):
    ctx = init_parallel(tp=2)
    torch.manual_seed(0)
    model = tr.LlamaForCausalLM(tr.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64))
    parallelize(model, ctx)
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    with CommLedger() as ledger:
        model(input_ids=ids, labels=ids).loss.backward()
    return model.parallel_plan.vocab, sum(c["calls"] for c in ledger.summary().values())


@pytest.mark.parametrize("vocab,mode,calls", [
    (128, "replicated", 16),  # 4 per layer, as DTensor's TP: a small head is cheaper replicated
    (32000, "parallel", 19),  # + embedding all-reduce, logits all-gather, head input-grad
])
def test_vocabulary_split_by_cost(run_ranks, vocab, mode, calls):
    assert run_ranks(_step_collectives, 2, vocab)[0] == (mode, calls)


def test_vocabulary_choice_reads_the_agreed_profile():
    """The Hugging Face plans price the split on ``ctx.profile`` (the profile every rank agreed on
    at init_parallel), as the GPT plan does: a network slow enough keeps Llama-2's 32000-token
    vocabulary replicated."""
    from ops_transformer import ParallelContext
    from ops_transformer.parallelize import resolve_plan
    from ops_transformer.planner.hardware import HardwareProfile

    torch.manual_seed(0)
    model = tr.LlamaForCausalLM(tr.LlamaConfig(
        vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64))
    def ctx(profile=None):
        return ParallelContext(rank=0, world_size=2, tp_size=2, tp_rank=0, dp_size=1, dp_rank=0,
                               profile=profile)

    assert resolve_plan(model, ctx()).vocab == "parallel"
    slow = HardwareProfile("slow network", matmul_flops=1e11, alpha_s=1.0, bandwidth=1e3)
    assert resolve_plan(model, ctx(slow)).vocab == "replicated"


def test_experts_of_an_expert_parallel_plan_become_our_moe_rule():
    """transformers 5.25 keeps the experts in ``ep_plan`` (``ep_dispatch_experts``, its weights
    ``grouped_gemm``), not in ``tp_plan``: the module still becomes a ``moe_tp_experts`` entry;
    the config's ``base_model_ep_plan`` is read under the base model's prefix when the model has
    no ``ep_plan``."""
    from types import SimpleNamespace

    from ops_transformer.parallelize.hf_translate import hf_experts_modules
    ep = {"layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
          "layers.*.mlp.experts.down_proj": "grouped_gemm",
          "layers.*.mlp.experts": "ep_dispatch_experts"}
    by_model = SimpleNamespace(ep_plan={"model." + k: v for k, v in ep.items()}, config=None)
    by_config = SimpleNamespace(config=SimpleNamespace(base_model_ep_plan=ep))
    expected = {"model.layers.*.mlp.experts": "moe_tp_experts"}
    assert hf_experts_modules(by_model, "model.") == expected
    assert hf_experts_modules(by_config, "model.") == expected
    assert hf_experts_modules(SimpleNamespace(config=SimpleNamespace()), "model.") == {}
