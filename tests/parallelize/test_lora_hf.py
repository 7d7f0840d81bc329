"""ot.lora on Hugging Face models against PEFT on the unsharded model (the same adapter values):
logits and every adapter gradient. Llama: GQA with KV heads split (tp 2) and replicated (tp 4), an
FFN width padded at tp 4, sequence parallelism; GPT-2: Conv1D weights and the fused Q|K|V."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_rel, local_part, set_from_dense
from ops_transformer import init_parallel, lora, parallelize
from ops_transformer.parallel.sharding import shard_spec

tr = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB, RANK, ALPHA = 96, 4, 8.0


def make(family: str):
    torch.manual_seed(0)
    if family == "llama":  # 130 = 2·65: split at tp 2, padded to 132 at tp 4
        return tr.LlamaForCausalLM(tr.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=130, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    return tr.GPT2LMHeadModel(tr.GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def _compare(family, sequence_parallel):
    tp = int(os.environ["WORLD_SIZE"])
    ctx = init_parallel(tp=tp)
    model = lora(parallelize(make(family), ctx, overlap="none", sequence_parallel=sequence_parallel), ctx,
                 rank=RANK, alpha=ALPHA)
    config = model.parallel_state.lora
    reference = peft.get_peft_model(make(family), peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=list(config.targets),
        fan_in_fan_out=config.fan_in_fan_out))
    named = dict(reference.named_parameters())
    g = torch.Generator().manual_seed(1)
    for name in config.targets:
        layer = model.get_submodule(name)
        for role in ("A", "B"):
            factor = getattr(layer, f"lora_{role}").weight
            dense = torch.randn(shard_spec(factor).full_shape if shard_spec(factor)
                                else factor.shape, generator=g) * 0.2
            set_from_dense(factor, dense)
            with torch.no_grad():
                named[f"base_model.model.{name}.lora_{role}.default.weight"].copy_(dense)
    ids = torch.randint(0, VOCAB, (2, 8), generator=g)
    logits = model(input_ids=ids).logits
    ref_logits = reference(input_ids=ids).logits
    assert_rel(logits, ref_logits, what="logits")
    F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    F.cross_entropy(ref_logits.flatten(0, 1), ids.flatten()).backward()
    for name in config.targets:
        layer = model.get_submodule(name)
        for role in ("A", "B"):
            factor = getattr(layer, f"lora_{role}").weight
            ref = named[f"base_model.model.{name}.lora_{role}.default.weight"].grad
            assert_rel(factor.grad, local_part(factor, ref), what=f"{name} {role} grad")
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)
    return config.targets, config.fan_in_fan_out


@pytest.mark.parametrize("family,tp,sequence_parallel", [
    pytest.param("llama", 1, False, marks=pytest.mark.slow), ("llama", 2, False),
    ("llama", 4, False), pytest.param("llama", 2, True, marks=pytest.mark.slow),
    ("gpt2", 2, False)])
def test_lora_on_hf_models_equals_peft(run_ranks, family, tp, sequence_parallel):
    targets, fan_in_fan_out = run_ranks(_compare, tp, family, sequence_parallel)[0]
    per_layer = 7 if family == "llama" else 4  # q, k, v, o, gate, up, down | c_attn, c_proj × 2
    assert len(targets) == 2 * per_layer
    assert fan_in_fan_out == (family == "gpt2")
