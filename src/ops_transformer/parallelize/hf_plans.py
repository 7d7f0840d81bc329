"""Tensor-parallel plans for Hugging Face ``transformers`` models, one small declarative plan each.

The family comes from ``config.model_type``. Every plan is the same Megatron layout as our GPT's:
whole heads per rank behind one backward all-reduce for Q/K/V, a row-parallel output projection,
a column→row MLP, a vocab-parallel embedding and LM head (vocabulary padded internally). Models in
``transformers`` ≥ 4.48 read their head counts from the projected tensors (``view(…, -1,
head_dim)``), so only a few per-rank attributes need setting (GPT-2's fused QKV split size, the GQA
group size when KV heads are replicated).

* GPT-2: ``Conv1D`` weights are ``[in, out]`` (transposed relative to ``nn.Linear``); ``c_attn`` is
  Q|K|V fused and split per sub-block; ``lm_head`` is tied to ``wte``.
* Llama, Mistral, Qwen2: GQA with KV-head replication when ``tp > num_key_value_heads``; Qwen2's
  Q/K/V biases shard with their heads; RoPE is untouched.
* BERT encoders: self-attention and intermediate/output; attention masks need nothing.
* Any other family whose config carries Hugging Face's ``base_model_tp_plan``: its ``colwise`` /
  ``rowwise`` entries are translated (each column layer then reduces its own input gradient).
"""

from __future__ import annotations

from torch import nn

from .plan import Plan

FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "bert")


def _prefix(model: nn.Module) -> str:
    """``"transformer."`` for a GPT2LMHeadModel, ``""`` for a bare GPT2Model, and so on."""
    base = getattr(model, "base_model_prefix", "")
    return f"{base}." if base and isinstance(getattr(model, base, None), nn.Module) else ""


def _tied(model: nn.Module) -> bool:
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    return out is not None and inp is not None and out.weight is inp.weight


def _module_name(model: nn.Module, module: nn.Module | None) -> str | None:
    return next((name for name, m in model.named_modules() if m is module and name), None)


def _divides(what: str, size: int, tp: int, hint: str = "") -> None:
    if size % tp:
        raise ValueError(f"{what} ({size}) is not divisible by tp ({tp}){hint}")


def _head(model, p: str, embed: str, loss_parallel: bool) -> dict:
    if model.get_output_embeddings() is None:
        return {}
    rule = {"style": "vocab_logits"}
    if _tied(model):
        rule["tied_to"] = p + embed
    if loss_parallel:
        rule["gather"] = False
    return {"lm_head": rule}


def gpt2_plan(model, tp: int, loss_parallel: bool = False) -> Plan:
    c, p = model.config, _prefix(model)
    _divides("n_head", c.n_head, tp, "; each rank needs whole heads")
    _divides("n_inner (the MLP width)", c.n_inner or 4 * c.n_embd, tp)
    h = c.n_embd
    rules = {
        p + "wte": "vocab",
        p + "h.*.attn": {"style": "attrs", "set": {"split_size": h // tp,
                                                   "num_heads": c.n_head // tp}},
        p + "h.*.attn.c_attn": {"style": "colwise", "sub_blocks": [h, h, h]},
        p + "h.*.attn.c_proj": "rowwise",
        p + "h.*.mlp.c_fc": "colwise",
        p + "h.*.mlp.c_proj": "rowwise",
    }
    rules.update(_head(model, p, "wte", loss_parallel))
    return Plan(rules=rules, attention="heads", reason="Hugging Face GPT-2 plan")


def llama_plan(model, tp: int, loss_parallel: bool = False) -> Plan:
    """Llama, Mistral and Qwen2 share module names."""
    c, p = model.config, _prefix(model)
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    _divides("num_attention_heads", heads, tp, "; each rank needs whole query heads")
    if kv % tp and tp % kv:
        raise ValueError(f"num_key_value_heads ({kv}) and tp ({tp}): KV heads can be split when tp "
                         f"divides them or replicated when they divide tp; neither holds")
    _divides("intermediate_size", c.intermediate_size, tp)
    local_q, local_kv = heads // tp, max(kv // tp, 1)
    no_reduce = {"style": "colwise", "reduce_input_grad": False}
    kv_rule = {**no_reduce, "kv_heads": kv}
    rules = {
        p + "embed_tokens": "vocab",
        p + "layers.*.self_attn": "region",
        p + "layers.*.self_attn.q_proj": dict(no_reduce),
        p + "layers.*.self_attn.k_proj": kv_rule,
        p + "layers.*.self_attn.v_proj": dict(kv_rule),
        p + "layers.*.self_attn.o_proj": "rowwise",
        p + "layers.*.mlp": "region",
        p + "layers.*.mlp.gate_proj": dict(no_reduce),
        p + "layers.*.mlp.up_proj": dict(no_reduce),
        p + "layers.*.mlp.down_proj": "rowwise",
    }
    if local_q // local_kv != heads // kv:  # replicated KV heads: fewer query heads per KV head
        rules[p + "layers.*.self_attn"] = {"style": "region",
                                           "set": {"num_key_value_groups": local_q // local_kv}}
    rules.update(_head(model, p, "embed_tokens", loss_parallel))
    return Plan(rules=rules, attention="heads", reason=f"Hugging Face {c.model_type} plan")


def bert_plan(model, tp: int, loss_parallel: bool = False) -> Plan:
    c, p = model.config, _prefix(model)
    _divides("num_attention_heads", c.num_attention_heads, tp, "; each rank needs whole heads")
    _divides("intermediate_size", c.intermediate_size, tp)
    no_reduce = {"style": "colwise", "reduce_input_grad": False}
    layer = p + "encoder.layer.*."
    rules = {
        p + "embeddings.word_embeddings": "vocab",
        layer + "attention.self": "region",
        layer + "attention.self.query": dict(no_reduce),
        layer + "attention.self.key": dict(no_reduce),
        layer + "attention.self.value": dict(no_reduce),
        layer + "attention.output.dense": "rowwise",
        layer + "intermediate.dense": "colwise",
        layer + "output.dense": "rowwise",
    }
    return Plan(rules=rules, attention="heads", reason="Hugging Face BERT plan")


_TRANSLATE = {"colwise": "colwise", "rowwise": "rowwise", "local_colwise": "colwise",
              "local_rowwise": "rowwise"}


def translated_plan(model, tp: int, loss_parallel: bool = False) -> Plan:
    """Hugging Face's own ``base_model_tp_plan`` in our styles. Key/value projections are told the
    number of KV heads (split or replicated as in :func:`llama_plan`); each column layer reduces
    its own input gradient, so Q/K/V cost three backward all-reduces instead of one."""
    c, p = model.config, _prefix(model)
    heads = getattr(c, "num_attention_heads", None)
    kv = getattr(c, "num_key_value_heads", None) or heads
    if heads:
        _divides("num_attention_heads", heads, tp, "; each rank needs whole query heads")
        if kv % tp and tp % kv:
            raise ValueError(f"num_key_value_heads ({kv}) and tp ({tp}): KV heads can be split when "
                             f"tp divides them or replicated when they divide tp; neither holds")
    rules = {}
    for pattern, style in c.base_model_tp_plan.items():
        if style not in _TRANSLATE:
            raise ValueError(f"{c.model_type}: base_model_tp_plan entry {pattern!r} has style "
                             f"{style!r}, which has no translation (known: {sorted(_TRANSLATE)})")
        rule = {"style": _TRANSLATE[style]}
        if pattern.endswith(("k_proj", "v_proj")) and heads:
            rule["kv_heads"] = kv
            if tp > kv:  # replicated KV heads: fewer query heads per KV head on each rank
                rules[p + pattern.rsplit(".", 1)[0]] = {
                    "style": "attrs", "set": {"num_key_value_groups": heads // tp}}
        rules[p + pattern] = rule
    embedding = model.get_input_embeddings()
    # Only a plain nn.Embedding can be swapped (Gemma's scaled embedding, for one, cannot): the
    # others stay replicated, with their LM head.
    embed = _module_name(model, embedding) if type(embedding) is nn.Embedding else None
    if embed is not None:  # vocab-parallel embedding first, so a tied head can share its shard
        rules = {embed: "vocab", **rules}
        rules.update(_head(model, "", embed, loss_parallel))
    return Plan(rules=rules, attention="heads",
                reason=f"translated from {c.model_type}'s base_model_tp_plan")


def hf_plan(model, tp: int, loss_parallel: bool = False) -> Plan:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type == "gpt2":
        return gpt2_plan(model, tp, loss_parallel)
    if model_type in ("llama", "mistral", "qwen2"):
        return llama_plan(model, tp, loss_parallel)
    if model_type == "bert":
        return bert_plan(model, tp, loss_parallel)
    from .moe_plan import MOE_FAMILIES, hf_moe_plan  # experts: their own module

    if model_type in MOE_FAMILIES:
        return hf_moe_plan(model, tp, loss_parallel)
    if getattr(model.config, "base_model_tp_plan", None):
        return translated_plan(model, tp, loss_parallel)
    raise ValueError(f"no tensor-parallel plan for Hugging Face model_type {model_type!r}: "
                     f"supported families are {', '.join(FAMILIES)}, or any model whose config "
                     f"has a base_model_tp_plan")
