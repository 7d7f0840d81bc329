"""The tensor-parallel plan of the reference GPT (:mod:`ops_transformer.models.gpt`).

Head-parallel attention (strategy A of SPEC F5) and a column→row FFN, Megatron-LM's layout:

* ``heads``: Q, K, V column-parallel by whole heads behind one ``copy_to_tp_region``; the output
  projection row-parallel. Per layer: forward 2 all-reduces (attention output, FFN output), backward
  2 all-reduces (attention input, FFN input), each of ``b·s·h`` elements.
* ``heads_allgather``: the same, but head outputs are all-gathered and the output projection is
  replicated. Per layer: forward 1 all-gather + 1 all-reduce, backward 2 all-reduces.

KV heads: split with the query heads when ``n_kv_heads % tp == 0``; replicated on ``tp/n_kv_heads``
ranks each when ``tp % n_kv_heads == 0`` (their gradients summed over the replicas); otherwise a
``ValueError``.
"""

from __future__ import annotations

from ..models.gpt import GPTConfig
from .plan import Plan

ATTENTION_MODES = ("heads", "heads_allgather")
NOT_YET = ("kv_split", "naive")


def check_tp_for_gpt(cfg: GPTConfig, tp: int) -> None:
    """Every size the plan splits must divide by ``tp`` (or, for KV heads, be replicable)."""
    if cfg.n_heads % tp:
        raise ValueError(f"n_heads ({cfg.n_heads}) is not divisible by tp ({tp}): head-parallel "
                         f"attention gives each rank whole heads; choose a tp that divides "
                         f"{cfg.n_heads}")
    kv = cfg.n_kv_heads
    if kv % tp and tp % kv:
        raise ValueError(f"n_kv_heads ({kv}) and tp ({tp}): KV heads can be split when tp divides "
                         f"n_kv_heads or replicated when n_kv_heads divides tp; neither holds")
    if cfg.d_ff % tp:
        raise ValueError(f"d_ff ({cfg.d_ff}) is not divisible by tp ({tp})")


def gpt_plan(cfg: GPTConfig, tp: int, attention: str = "auto") -> Plan:
    """The plan for ``GPT(cfg)`` at ``tp`` ranks with the given attention output mode."""
    if attention in NOT_YET:
        raise ValueError(f"attention={attention!r} is not implemented yet; available: "
                         f"{('auto',) + ATTENTION_MODES}")
    if attention not in ("auto",) + ATTENTION_MODES:
        raise ValueError(f"attention must be one of {('auto',) + ATTENTION_MODES}, "
                         f"got {attention!r}")
    check_tp_for_gpt(cfg, tp)
    reason = ""
    if attention == "auto":
        attention = "heads"
        reason = ("heads divide by tp; the row-parallel output projection moves as much as the "
                  "all-gather and keeps the projection's weights and FLOPs sharded")
    kv = {"style": "colwise", "reduce_input_grad": False, "kv_heads": cfg.n_kv_heads}
    rules = {
        "tok_emb": "vocab",
        "layers.*.attn": "region",
        "layers.*.attn.wq": {"style": "colwise", "reduce_input_grad": False},
        "layers.*.attn.wk": kv,
        "layers.*.attn.wv": dict(kv),
        "layers.*.attn.wo": "rowwise" if attention == "heads" else "gather_in",
        "layers.*.mlp.w_in": ({"style": "colwise", "sub_blocks": [cfg.d_ff, cfg.d_ff]}
                              if cfg.mlp == "swiglu" else "colwise"),
        "layers.*.mlp.w_out": "rowwise",
        "lm_head": ({"style": "vocab_head", "tied_to": "tok_emb"} if cfg.tie_embeddings
                    else "vocab_head"),
    }
    return Plan(rules=rules, attention=attention, reason=reason)
