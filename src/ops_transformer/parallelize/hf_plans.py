"""Tensor-parallel plans for Hugging Face ``transformers`` models, one small declarative plan each.

The family comes from ``config.model_type``. Every plan is the same Megatron layout as our GPT's:
whole heads per rank behind one backward all-reduce for Q/K/V, a row-parallel output projection,
a column→row MLP; the embedding and LM head vocab-parallel (vocabulary padded internally) or
replicated, by predicted time (:func:`~.hf_vocab.vocab_rules`). Models in ``transformers`` ≥
4.48 read their head counts from the projected tensors (``view(…, -1, head_dim)``), so only a few
per-rank attributes need setting (GPT-2's fused QKV split size, the GQA group size when KV heads
are replicated).

* GPT-2: ``Conv1D`` weights are ``[in, out]`` (transposed relative to ``nn.Linear``); ``c_attn`` is
  Q|K|V fused and split per sub-block; ``lm_head`` is tied to ``wte``.
* Llama, Mistral, Qwen2, Qwen3: GQA with KV-head replication when ``tp > num_key_value_heads``;
  Qwen2's Q/K/V biases shard with their heads; Qwen3's per-head ``q_norm``/``k_norm`` stay
  replicated with their gradients summed; RoPE is untouched.
* BERT encoders: self-attention and intermediate/output; attention masks need nothing.
* Any other family whose config carries Hugging Face's ``base_model_tp_plan``: its plan translated
  style by style (:mod:`.hf_translate`), and so is any family's when the user passes ``tp_plan``.
"""

from __future__ import annotations

from torch import nn

from ..models.hf import base_prefix
from ..planner.strategies import kv_replicas
from .hf_translate import translated_plan
from .hf_vocab import vocab_rules
from .plan import Plan

FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "bert", "qwen3")
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "phimoe")  # experts over ep: hf_moe_plan

__all__ = ["FAMILIES", "gpt2_plan", "llama_plan", "bert_plan", "translated_plan", "hf_plan",
           "has_family_plan"]


def _divides(what: str, size: int, tp: int, hint: str = "") -> None:
    if size % tp:
        raise ValueError(f"{what} ({size}) is not divisible by tp ({tp}){hint}")


def _with_vocab(model, tp, rules: dict, reason: str, loss_parallel: bool, vocab: str,
                profile=None) -> Plan:
    """The family's rules behind the embedding and LM head rules the cost model chose."""
    head, mode, why = vocab_rules(model, tp, vocab, loss_parallel, profile=profile)
    return Plan(rules={**head, **rules}, attention="heads", vocab=mode,
                reason=f"{reason}; {why}")


def gpt2_plan(model, tp: int, loss_parallel: bool = False, *, vocab: str = "auto",
              profile=None) -> Plan:
    c, p = model.config, base_prefix(model)
    _divides("n_head", c.n_head, tp, "; each rank needs whole heads")
    h = c.n_embd
    rules = {
        p + "h.*.attn": {"style": "attrs", "set": {"split_size": h // tp,
                                                   "num_heads": c.n_head // tp}},
        p + "h.*.attn.c_attn": {"style": "colwise", "sub_blocks": [h, h, h]},
        p + "h.*.attn.c_proj": "rowwise",
        p + "h.*.mlp.c_fc": {"style": "colwise", "pad": True},  # n_inner padded if need be
        p + "h.*.mlp.c_proj": {"style": "rowwise", "pad": True},
    }
    return _with_vocab(model, tp, rules, "Hugging Face GPT-2 plan", loss_parallel, vocab, profile)


def llama_plan(model, tp: int, loss_parallel: bool = False, *, vocab: str = "auto",
               profile=None) -> Plan:
    """Llama, Mistral, Qwen2 and Qwen3 share module names."""
    c, p = model.config, base_prefix(model)
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    _divides("num_attention_heads", heads, tp, "; each rank needs whole query heads")
    local_q, local_kv = heads // tp, kv * kv_replicas(kv, tp, "num_key_value_heads") // tp
    no_reduce = {"style": "colwise", "reduce_input_grad": False}
    kv_rule = {**no_reduce, "kv_heads": kv}
    ffn = {"style": "colwise", "reduce_input_grad": False, "pad": True}
    rules = {
        p + "layers.*.self_attn": "region",
        p + "layers.*.self_attn.q_proj": dict(no_reduce),
        p + "layers.*.self_attn.k_proj": kv_rule,
        p + "layers.*.self_attn.v_proj": dict(kv_rule),
        p + "layers.*.self_attn.o_proj": "rowwise",
        p + "layers.*.mlp": "region",
        p + "layers.*.mlp.gate_proj": dict(ffn),
        p + "layers.*.mlp.up_proj": dict(ffn),
        p + "layers.*.mlp.down_proj": {"style": "rowwise", "pad": True},
    }
    attention = model.get_submodule(p + "layers.0.self_attn")
    for norm in ("q_norm", "k_norm"):  # Qwen3 (and Qwen3-MoE): per-head norms, so each rank
        if hasattr(attention, norm):    # sees its heads' part of their gradients
            rules[p + f"layers.*.self_attn.{norm}"] = "grad_allreduce"
    if local_q // local_kv != heads // kv:  # replicated KV heads: fewer query heads per KV head
        rules[p + "layers.*.self_attn"] = {"style": "region",
                                           "set": {"num_key_value_groups": local_q // local_kv}}
    return _with_vocab(model, tp, rules, f"Hugging Face {c.model_type} plan", loss_parallel, vocab,
                       profile)


def bert_plan(model, tp: int, loss_parallel: bool = False, *, vocab: str = "auto",
              profile=None) -> Plan:
    c, p = model.config, base_prefix(model)
    _divides("num_attention_heads", c.num_attention_heads, tp, "; each rank needs whole heads")
    no_reduce = {"style": "colwise", "reduce_input_grad": False}
    layer = p + "encoder.layer.*."
    rules = {
        layer + "attention.self": "region",
        layer + "attention.self.query": dict(no_reduce),
        layer + "attention.self.key": dict(no_reduce),
        layer + "attention.self.value": dict(no_reduce),
        layer + "attention.output.dense": "rowwise",
        layer + "intermediate.dense": {"style": "colwise", "pad": True},
        layer + "output.dense": {"style": "rowwise", "pad": True},
    }
    return _with_vocab(model, tp, rules, "Hugging Face BERT plan", loss_parallel, vocab, profile)


def hf_moe_plan(model: nn.Module, tp: int, loss_parallel: bool = False, **options) -> Plan:
    """Mixtral, Qwen2-MoE, Qwen3-MoE: the Llama plan's attention, embedding and head; per layer,
    the experts (``moe``), a shared expert or a dense MLP (column→row).

    Hugging Face MoE blocks (``transformers`` ≥ 5) share one shape: a router module ``gate``
    returning ``(logits, top_k_weights, top_k_index)`` and an experts module with 3-D
    ``gate_up_proj`` and ``down_proj`` called as ``experts(x, top_k_index, top_k_weights)``. The
    plan keeps the router (replicated, so ``output_router_logits`` and Hugging Face's auxiliary
    loss still work) and swaps the experts module for
    :class:`~ops_transformer.layers.moe.ParallelExperts` (style ``moe``). Attention, embedding and
    head follow the Llama plan; a shared expert (Qwen2-MoE) and dense layers are column→row like
    Llama's MLP.
    """
    base, p = llama_plan(model, tp, loss_parallel, **options), base_prefix(model)  # vocab=, profile=
    mlp = {k[len(p + "layers.*.mlp"):]: v for k, v in base.rules.items()
           if k.startswith(p + "layers.*.mlp")}  # "", ".gate_proj", ... → rule
    rules = {k: v for k, v in base.rules.items() if not k.startswith(p + "layers.*.mlp")}
    per_layer = []
    for layer in model.get_submodule(p + "layers"):
        block, rule = layer.mlp, {}
        if hasattr(block, "experts"):
            rule[".experts"] = "moe"
            if hasattr(block, "shared_expert"):
                rule.update({".shared_expert" + k: v for k, v in mlp.items()})
        else:
            rule.update(mlp)
        per_layer.append(rule)
    uniform = all(r == per_layer[0] for r in per_layer)
    head = {k: rules.pop(k) for k in ("lm_head",) if k in rules}  # the layers first, for reading
    for i, layer_rules in enumerate(per_layer[:1] if uniform else per_layer):
        name = f"{p}layers.{'*' if uniform else i}.mlp"
        rules.update({name + k: v for k, v in layer_rules.items()})
    rules.update(head)
    return Plan(rules=rules, attention="heads", vocab=base.vocab,
                reason=f"Hugging Face {model.config.model_type} plan (experts over ep, "
                       f"each column→row over tp); {base.reason.split('; ', 1)[-1]}")


def has_family_plan(model_type: str) -> bool:
    """Whether ``hf_plan`` uses a plan of ours for this family (else it translates Hugging
    Face's)."""
    return model_type in FAMILIES or model_type in MOE_FAMILIES


def hf_plan(model, tp: int, loss_parallel: bool = False, *, vocab: str = "auto",
            tp_plan: dict | None = None, profile=None) -> Plan:
    """The plan for a ``transformers`` model: the family's own above, else (or when ``tp_plan``
    — Hugging Face style names — overrides the family's) the translation of Hugging Face's."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    options = {"vocab": vocab, "profile": profile}
    if tp_plan is not None:
        return translated_plan(model, tp, loss_parallel, tp_plan=tp_plan, **options)
    if model_type == "gpt2":
        return gpt2_plan(model, tp, loss_parallel, **options)
    if model_type in LLAMA_LIKE:
        return llama_plan(model, tp, loss_parallel, **options)
    if model_type == "bert":
        return bert_plan(model, tp, loss_parallel, **options)
    if model_type in MOE_FAMILIES:
        return hf_moe_plan(model, tp, loss_parallel, **options)
    if getattr(model.config, "base_model_tp_plan", None) or getattr(model, "tp_plan", None):
        return translated_plan(model, tp, loss_parallel, **options)
    raise ValueError(f"no tensor-parallel plan for Hugging Face model_type {model_type!r}: "
                     f"supported families are {', '.join(FAMILIES)}, or any model whose config "
                     f"has a base_model_tp_plan")
