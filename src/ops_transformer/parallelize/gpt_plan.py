"""The tensor-parallel plan of the reference GPT (:mod:`ops_transformer.models.gpt`).

The FFN is column→row in every plan; an MoE FFN (``n_experts > 0``) has its experts spread over
the ``ep`` axis, each column→row (:mod:`ops_transformer.layers.moe`). The embedding and LM head are vocab-parallel (with the
vocab-parallel loss) or replicated, by predicted time (``vocab="auto"``): three collectives per step
against ``tp`` times the head's FLOPs — a byte-level vocabulary is cheaper replicated, GPT-2's
50257 is not. The attention strategy (SPEC F5) is one of:

* ``heads`` (A, Megatron-LM): Q, K, V column-parallel by whole heads behind one
  ``copy_to_tp_region``; the output projection row-parallel. Per layer, with the FFN: forward 2
  all-reduces, backward 2 all-reduces, each of ``b·s·h`` elements.
* ``heads_allgather`` (A, the seed's description): head outputs all-gathered, output projection
  replicated. Forward: 1 all-gather + 1 all-reduce; backward: 2 all-reduces.
* ``kv_split`` (B): every head's features split; partial scores reduce-scattered over query rows
  (:class:`~ops_transformer.layers.attention.FeatureSplitAttention`). Works with more ranks than
  heads; its communication grows with ``s²``.
* ``naive``: Q, K, V and the output projection each an isolated column-parallel linear with its
  output gathered, attention replicated — the baseline of the seed's "~40% less" claim.
* ``auto``: the valid strategy with the least predicted time from the cost model
  (:mod:`ops_transformer.planner`), with the reason recorded in the plan.

KV heads (A): split with the query heads when ``n_kv_heads % tp == 0``; replicated on
``tp/n_kv_heads`` ranks each when ``tp % n_kv_heads == 0`` (their gradients summed over the
replicas); otherwise not possible.
"""

from __future__ import annotations

from ..models.config import GPTConfig, check_ffn_split
from ..planner.choose import attention_problem, choose_attention, choose_vocab
from ..planner.hardware import HardwareProfile
from ..planner.strategies import ATTENTION_STRATEGIES, VOCAB_MODES
from .plan import Plan

from ..schema.choices import ATTENTION_CHOICES
AUTO_BATCH = 8  # the micro-batch `auto` assumes when none is given


def check_tp_for_gpt(cfg: GPTConfig, tp: int, attention: str = "heads",
                     seq: int | None = None) -> None:
    """Every size the plan splits must divide by ``tp`` (or, for KV heads, be replicable)."""
    problem = attention_problem(cfg, tp, attention, seq) if attention != "auto" else None
    if problem:
        raise ValueError(f"attention={attention!r}: {problem}")
    check_ffn_split(cfg, tp)


def _attention_rules(cfg: GPTConfig, attention: str) -> dict:
    if attention == "kv_split":
        return {"layers.*.attn": {"style": "kv_split", "rope": cfg.pos == "rope"}}
    if attention == "naive":
        gathered = {"style": "colwise", "gather_output": True}
        return {f"layers.*.attn.{name}": dict(gathered) for name in ("wq", "wk", "wv", "wo")}
    kv = {"style": "colwise", "reduce_input_grad": False, "kv_heads": cfg.n_kv_heads}
    return {
        "layers.*.attn": "region",
        "layers.*.attn.wq": {"style": "colwise", "reduce_input_grad": False},
        "layers.*.attn.wk": kv,
        "layers.*.attn.wv": dict(kv),
        "layers.*.attn.wo": "rowwise" if attention == "heads" else "gather_in",
    }


def _ffn_rules(cfg: GPTConfig) -> dict:
    """Column→row for a dense FFN; ``moe`` (experts over ``ep``, each column→row over ``tp``, the
    router replicated) for an MoE one. With ``moe_every > 1`` the layers are named one by one."""
    dense = {"w_in": ({"style": "colwise", "sub_blocks": [cfg.d_ff, cfg.d_ff]}
                      if cfg.mlp == "swiglu" else "colwise"), "w_out": "rowwise"}
    moe = [cfg.is_moe_layer(i) for i in range(cfg.n_layers)]
    if not any(moe):
        return {f"layers.*.mlp.{name}": rule for name, rule in dense.items()}
    if all(moe):
        return {"layers.*.mlp": "moe"}
    rules = {}
    for i, is_moe in enumerate(moe):
        rules.update({f"layers.{i}.mlp": "moe"} if is_moe else
                     {f"layers.{i}.mlp.{name}": rule for name, rule in dense.items()})
    return rules


def gpt_plan(cfg: GPTConfig, tp: int, attention: str = "auto", *, vocab: str = "auto",
             batch: int = AUTO_BATCH, seq: int | None = None,
             profile: HardwareProfile | None = None) -> Plan:
    """The plan for ``GPT(cfg)`` at ``tp`` ranks. ``auto`` (attention, and ``vocab``: split the
    embedding and LM head or keep them replicated) ranks the options by predicted time for a
    micro-batch of ``batch`` sequences of ``seq`` tokens (default ``cfg.max_seq_len``) on
    ``profile`` (default: the built-in one; ``parallelize`` passes ``ctx.profile``, the profile every
    rank agreed on at ``init_parallel``)."""
    if attention not in ATTENTION_CHOICES:
        raise ValueError(f"attention must be one of {ATTENTION_CHOICES}, got {attention!r}")
    if vocab not in ("auto",) + VOCAB_MODES:
        raise ValueError(f"vocab must be one of {('auto',) + VOCAB_MODES}, got {vocab!r}")
    check_tp_for_gpt(cfg, tp, attention, seq)
    reason = "as requested"
    if attention == "auto":
        if tp == 1:
            attention, reason = "heads", "tp=1: no communication either way"
        else:
            attention, reason = choose_attention(cfg, tp, batch=batch, seq=seq or cfg.max_seq_len,
                                                 profile=profile)
    if vocab == "auto":
        if tp == 1:
            vocab = "parallel"
        else:
            vocab, why = choose_vocab(cfg, tp, batch=batch, seq=seq or cfg.max_seq_len,
                                      profile=profile)
            reason += f"; {why}"
    rules = {**_attention_rules(cfg, attention), **_ffn_rules(cfg)}
    if vocab == "parallel":
        rules = {"tok_emb": "vocab", **rules,
                 "lm_head": ({"style": "vocab_head", "tied_to": "tok_emb"} if cfg.tie_embeddings
                             else "vocab_head")}
    return Plan(rules=rules, attention=attention, reason=reason, vocab=vocab)
