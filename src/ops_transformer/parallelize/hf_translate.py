"""Hugging Face's own tensor-parallel plans, translated into ours.

A ``transformers`` model whose config carries a ``base_model_tp_plan`` declares, for module (or
parameter) patterns, one of Hugging Face's styles; ``model.tp_plan`` is the whole model's plan (the
LM head's and the embedding's rules included). :func:`translated_plan` turns it into a
:class:`~.plan.Plan`, style by style:

================================  ======================================  ========================
Hugging Face style                our style (:mod:`.plan`)                a size not divisible by tp
================================  ======================================  ========================
``colwise``                       ``colwise`` (K/V: ``kv_heads``)         FFN width padded; heads
                                                                          refused
``rowwise``                       ``rowwise``                             FFN width padded
``colwise_gather_output``         ``colwise`` + ``gather_output``         padded, sliced after the
                                                                          gather
``rowwise_split_input``           ``rowwise`` + ``input_is_parallel``     padded
                                  ``=False``
``packed_colwise``                ``colwise`` + two ``sub_blocks``        refused (each half must
                                                                          divide)
``packed_rowwise``                ``rowwise`` + two ``sub_blocks``        refused
``embedding_rowwise``             ``vocab``                               vocabulary padded
``embedding_colwise``             ``embed_colwise``                       refused
``replicated_with_grad_allreduce`` ``grad_allreduce``                     —
``all_reduce``                    ``reduce_out`` (``region_inputs`` over  —
                                  raw sharded parameters: Hugging Face's
                                  style is forward-only, its input
                                  gradients would stay partial)
``mla_kv_a_proj``                 ``mla_kv_a`` (``rope_dim`` from the     —
                                  config's ``qk_rope_head_dim``)
``colwise`` / ``rowwise`` on a    ``shard_param`` (the output dim, the    refused
parameter                         next-to-last / the last; a bias stays
                                  replicated)
``local_params``, ``replicate``   no rule: our layers always compute on   —
                                  plain local tensors
``moe_tp_experts`` (an experts     ``moe`` + ``hf_experts``: the module    the expert FFN width
module; its ``gate_up_proj`` /    becomes :class:`~.hf_experts.HFExperts`  refused
``down_proj`` entries)            around our ``ParallelExperts``
``moe_identity_expert``           no rule: ``HFExperts`` adds identity    —
                                  experts after the reduction
================================  ======================================  ========================

The input embedding and the LM head are split over the vocabulary or kept replicated by predicted
time (:func:`vocab_rules`), whatever Hugging Face's plan says, unless the user's ``tp_plan`` names
them. Column layers each reduce their own input gradient (Q, K and V: three backward all-reduces
where our hand-written plans issue one). Heads must divide by tp; KV heads fewer than tp are
replicated when tp is a multiple of them, the attention module's ``num_key_value_groups`` set per
rank. A column layer paired with a row layer under the same parent (the column→row FFN) pads a
width that does not divide by tp, as do gathered-output columns and split-input rows.
"""

from __future__ import annotations

from ..layers.linear import dense_weight
from ..models.hf import base_prefix
from ..planner.strategies import kv_replicas
from .hf_vocab import module_name, text_config, tied_embeddings, vocab_rules
from .plan import Plan, matches

HF_STYLES = {  # Hugging Face style -> (our style, options); None: nothing to do
    "colwise": ("colwise", {}),
    "local_colwise": ("colwise", {}),
    "rowwise": ("rowwise", {}),
    "local_rowwise": ("rowwise", {}),
    "colwise_gather_output": ("colwise", {"gather_output": True}),
    "colwise_rep": ("colwise", {"gather_output": True}),
    "rowwise_split_input": ("rowwise", {"input_is_parallel": False}),
    "rowwise_rep": ("rowwise", {"input_is_parallel": False}),
    "packed_colwise": ("colwise", {"packed": 2}),
    "packed_rowwise": ("rowwise", {"packed": 2}),
    "embedding_rowwise": ("vocab", {}),
    "embedding_colwise": ("embed_colwise", {}),
    "replicated_with_grad_allreduce": ("grad_allreduce", {}),
    "all_reduce": ("reduce_out", {}),
    "mla_kv_a_proj": ("mla_kv_a", {}),
    "moe_tp_experts": ("moe", {"hf_experts": True}),
    "moe_identity_expert": None,
    "local_params": None,
    "replicate": None,
    "local": None,
}
NOT_TRANSLATED = {"sequence_parallel": "sequence parallelism is not part of a translated plan"}
KNOWN_STYLES = tuple(HF_STYLES) + tuple(NOT_TRANSLATED)

Q_NAMES = ("q_proj", "query", "q_b_proj", "wq")
KV_NAMES = ("k_proj", "v_proj", "key", "value", "wk", "wv")
FUSED_QKV = ("qkv_proj", "query_key_value", "c_attn", "Wqkv", "wqkv", "qkv")
# Where a family's own plan is not exact (patterns under the base model): the zoo found these.
PLAN_FIXES = {
    # xIELU's learnable alpha_p/alpha_n sit between up_proj (column) and down_proj (row): each
    # rank sees its features only, so their gradients are partial
    **dict.fromkeys(["apertus", "apertus1p5_text"],
                    {"layers.*.mlp.act_fn": "replicated_with_grad_allreduce"}),
    # q_norm/k_norm normalise over all heads (hidden_size features): heads cannot be split, so
    # attention stays replicated (its MLP is still split)
    "esmc": dict.fromkeys([f"layers.*.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj",
                                                               "o_proj")], "replicate"),
    # dt_proj mixes every KV head's values into each head's gate, and the gate then masks all
    # heads: split heads cannot reproduce it, so attention stays replicated
    "doge": dict.fromkeys([f"layers.*.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj",
                                                               "o_proj", "dt_proj")], "replicate"),
    # a per-head parameter and the value embeddings (KV-head features) the plan leaves whole:
    # this rank's heads' share of each
    "neomme": {"layers.*.self_attn.exclusive_self_attention.alpha": "colwise",
               "value_embeddings.weight": "rowwise"},
}


def hf_tp_plan(model) -> dict[str, str]:
    """The model's whole Hugging Face plan: ``model.tp_plan`` (transformers ≥ 5), else the
    config's ``base_model_tp_plan`` under the base model's prefix; plus the experts modules of
    its expert-parallel plan (:func:`hf_experts_modules`)."""
    prefix = base_prefix(model)
    plan = getattr(model, "tp_plan", None)
    if not (isinstance(plan, dict) and plan):
        plan = {prefix + k: v for k, v in (getattr(model.config, "base_model_tp_plan", None)
                                           or {}).items()}
    if not plan:
        return {}
    fixes = PLAN_FIXES.get(getattr(model.config, "model_type", None), {})
    return {**hf_experts_modules(model, prefix), **plan,
            **{prefix + k: v for k, v in fixes.items()}}


def hf_experts_modules(model, prefix: str) -> dict[str, str]:
    """``moe_tp_experts`` for every module that the model's expert-parallel plan dispatches
    (``ep_dispatch_experts``): transformers 5.25 moved the experts out of ``tp_plan`` into
    ``ep_plan`` (``base_model_ep_plan``); earlier releases mark them ``moe_tp_experts`` in
    ``tp_plan`` itself. Either way the experts module becomes our ``moe`` rule."""
    plan = getattr(model, "ep_plan", None)
    if not (isinstance(plan, dict) and plan):
        plan = {prefix + k: v for k, v in (getattr(model.config, "base_model_ep_plan", None)
                                           or {}).items()}
    return {p: "moe_tp_experts" for p, style in plan.items() if style == "ep_dispatch_experts"}


def check_styles(plan: dict[str, str], model_type: str) -> None:
    """Unknown styles, then styles that need a feature we lack: a ``ValueError`` naming both the
    style and the pattern."""
    for pattern, style in plan.items():
        if style not in KNOWN_STYLES:
            raise ValueError(f"{model_type}: tp_plan entry {pattern!r} has style {style!r}, which "
                             f"is not a Hugging Face tensor-parallel style (known: "
                             f"{', '.join(sorted(KNOWN_STYLES))})")
    for pattern, style in plan.items():
        if style in NOT_TRANSLATED:
            raise ValueError(f"{model_type}: tp_plan entry {pattern!r} has style {style!r}: "
                             f"{NOT_TRANSLATED[style]}")


class _Targets:
    """The first module (or parameter) each pattern names."""

    def __init__(self, model):
        self.modules = [(n, m) for n, m in model.named_modules() if n]
        self.params = list(model.named_parameters())

    def find(self, pattern: str):
        for kind, pairs in (("module", self.modules), ("param", self.params)):
            for name, obj in pairs:
                if matches(name, pattern):
                    return kind, name, obj
        return None


def _rule(model, pattern: str, style: str, target, head_name, embed_rule) -> dict:
    """Our rule(s) for one Hugging Face entry."""
    kind, name, obj = target
    ours, options = HF_STYLES[style]
    rule = {"style": ours, **options}
    packed = rule.pop("packed", None)
    if kind == "param":
        if ours not in ("colwise", "rowwise") or packed:
            raise ValueError(f"{pattern!r}: style {style!r} on a parameter of shape "
                             f"{tuple(obj.shape)} is not translated (a 3-D experts weight is "
                             f"split with its module: mark the module 'moe_tp_experts')")
        if ours == "rowwise" and name.endswith("bias"):
            return {}  # a row-parallel bias stays replicated
        # as Hugging Face shards them: the output dimension of a [.., out, in] weight (dim 0 of
        # a bias or a per-head vector), the input dimension (the last) for rowwise
        dim = max(obj.dim() - 2, 0) if ours == "colwise" else -1
        return {pattern: {"style": "shard_param", "dim": dim}}
    if packed:
        size = dense_weight(obj)[0].shape[0 if ours == "colwise" else 1]
        if size % packed:
            raise ValueError(f"{pattern!r}: style {style!r} packs {packed} blocks, but the size "
                             f"{size} does not divide by {packed}")
        rule["sub_blocks"] = [size // packed] * packed
    if ours == "mla_kv_a":
        rope = getattr(text_config(model), "qk_rope_head_dim", None)
        if rope is None:
            raise ValueError(f"{pattern!r}: style {style!r} needs the config's qk_rope_head_dim")
        if rope == 0:  # no RoPE features bypass kv_b_proj: its own input gradient is whole
            return {}
        rule["rope_dim"] = rope
    if name == head_name and ours == "colwise":  # a user-named head: vocab-parallel, maybe tied
        rule = {"style": "vocab_logits"}
        if tied_embeddings(model):
            if embed_rule is None:
                raise ValueError(f"{pattern!r}: the LM head is tied to the input embedding, so it "
                                 f"can only be split with it (name the embedding "
                                 f"'embedding_rowwise' too)")
            rule["tied_to"] = embed_rule
    return {pattern: rule}


def _head_counts(config, name: str) -> set[int]:
    """The values of ``name`` over the layers (one value unless the config is heterogeneous:
    ``per_layer_config``, whose global attribute ``transformers`` refuses to read)."""
    if getattr(config, "is_heterogeneous", False):
        return {getattr(c, name) for c in config.per_layer_config if getattr(c, name, None)}
    value = getattr(config, name, None)
    return {value} if value else set()


def _check_heads(model, rules: dict, tp: int, targets: _Targets) -> None:
    """Whole query heads per rank; KV heads split or replicated (then ``num_key_value_groups``
    set per rank on the attention module)."""
    split = {p: r for p, r in rules.items()
             if r["style"] == "colwise" and not r.get("gather_output")}
    last = {p: p.rsplit(".", 1)[-1] for p in split}
    if not any(n in Q_NAMES + KV_NAMES + FUSED_QKV for n in last.values()):
        return
    text = text_config(model)
    all_heads = _head_counts(text, "num_attention_heads")
    for heads in sorted(all_heads):
        if heads % tp:
            raise ValueError(f"num_attention_heads ({heads}) is not divisible by tp ({tp}); each "
                             f"rank needs whole query heads")
    kv_rules = [p for p, n in last.items() if n in KV_NAMES]
    all_kv = _head_counts(text, "num_key_value_heads") or all_heads
    if not kv_rules or all(kv % tp == 0 for kv in all_kv):
        return
    kv, heads = min(all_kv), min(all_heads, default=0)
    kv_replicas(kv, tp, "num_key_value_heads")  # the one rule: split, replicated, or an error
    if len(all_kv | all_heads) > 2:
        raise ValueError(f"num_key_value_heads ({kv}) < tp ({tp}): replicating KV heads needs one "
                         f"head count for every layer, got {sorted(all_kv | all_heads)}")
    if any(n in FUSED_QKV for n in last.values()):
        raise ValueError(f"num_key_value_heads ({kv}) < tp ({tp}) with a fused QKV projection: "
                         f"its KV heads cannot be replicated; use a tp that divides {kv}")
    for pattern in kv_rules:
        rules[pattern]["kv_heads"] = kv
        parent = pattern.rsplit(".", 1)[0]
        module = targets.find(parent)
        if module is None or not hasattr(module[2], "num_key_value_groups"):
            raise ValueError(f"num_key_value_heads ({kv}) < tp ({tp}): replicating KV heads sets "
                             f"num_key_value_groups on {parent!r}, which has none; use a tp that "
                             f"divides {kv}")
        if parent in rules and rules[parent]["style"] != "attrs":
            raise ValueError(f"{parent!r} has rule {rules[parent]} and needs per-rank attributes")
        rules[parent] = {"style": "attrs", "set": {"num_key_value_groups": heads // tp}}


NORM_NAMES = ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_norm", "key_norm")


def _per_head_norms(rules: dict, targets: _Targets) -> None:
    """Per-head Q/K norms beside split projections see only this rank's heads: their gradients
    are summed over TP even where the family's plan forgets them (sarvam_moe, qwen3_vl_moe)."""
    for pattern, rule in list(rules.items()):
        parent, _, last = pattern.rpartition(".")
        if rule["style"] != "colwise" or rule.get("gather_output") or \
                last not in Q_NAMES + KV_NAMES + FUSED_QKV:
            continue
        found = targets.find(parent)
        if found is None or found[0] != "module":
            continue
        for name, child in found[2].named_children():
            key = f"{parent}.{name}"
            if name in NORM_NAMES and key not in rules and next(child.parameters(), None) \
                    is not None:
                rules[key] = {"style": "grad_allreduce"}


def _row_inputs(model, rules: dict) -> dict:
    """A row layer reads features split by a column sibling. Where a pattern matches layers of
    both kinds (glm5_next's ``self_attn.o_proj`` in split softmax attention and in linear
    attention, which the plan leaves whole), it is kept per layer only where a sibling is
    split."""
    columns = [p for p, r in rules.items() if r["style"] == "colwise" and not r.get("gather_output")]
    names = [n for n, _ in model.named_modules() if n]
    split = {n for n in names if any(matches(n, c) for c in columns)}
    out = {}
    for pattern, rule in rules.items():
        if rule["style"] != "rowwise" or rule.get("input_is_parallel") is False:
            out[pattern] = rule
            continue
        hits = [n for n in names if matches(n, pattern)]
        fed = [n for n in hits if any(m.rpartition(".")[0] == n.rpartition(".")[0] for m in split)]
        if not fed or len(fed) == len(hits):
            out[pattern] = rule
        else:
            out.update({n: dict(rule) for n in fed})
    return out


def _pad_ffn(rules: dict) -> None:
    """Let widths that do not divide by tp be padded where that is exact: a column layer whose
    parent also holds a row layer (the column→row FFN), a gathered column, a split-input row."""
    parents = {}
    for pattern, rule in rules.items():
        parent, _, last = pattern.rpartition(".")
        attention = last in Q_NAMES + KV_NAMES + FUSED_QKV  # heads: never padded
        parents.setdefault(parent, set()).add("attention" if attention else rule["style"])
    for pattern, rule in rules.items():
        if rule["style"] not in ("colwise", "rowwise") or "sub_blocks" in rule or \
                "kv_heads" in rule:
            continue
        siblings = parents[pattern.rpartition(".")[0]]
        paired = {"colwise", "rowwise"} <= siblings and "attention" not in siblings
        if paired or rule.get("gather_output") or rule.get("input_is_parallel") is False:
            rule["pad"] = True


def translated_plan(model, tp: int, loss_parallel: bool = False, *, tp_plan: dict | None = None,
                    vocab: str = "auto", profile=None) -> Plan:
    """Hugging Face's plan for ``model`` (``model.tp_plan``) in our styles (the table above).

    ``tp_plan`` (Hugging Face style names, as ``from_pretrained(tp_plan=...)`` takes them) is
    merged over the model's own plan, entry by entry; an empty dict means no tensor parallelism.
    Its keys must name modules or parameters of the model. Patterns of the model's own plan that
    name nothing in this configuration (an optional module) are skipped.
    """
    model_type = getattr(text_config(model), "model_type", type(model).__name__)
    hf, user = hf_tp_plan(model), dict(tp_plan or {})
    targets = _Targets(model)
    for pattern in user:
        if targets.find(pattern) is None:
            raise ValueError(f"tp_plan key {pattern!r} matches no module or parameter of "
                             f"{type(model).__name__}")
    if tp_plan is not None:
        hf = {**hf, **user} if user else {}
    check_styles(hf, model_type)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    embed_name, head_name = module_name(model, embedding), module_name(model, head)
    vocab_names = {n for n in (embed_name, head_name) if n}
    user_vocab = any(matches(n, p) for p in user for n in vocab_names)
    rules, mode, why = ({}, "replicated", "vocab as the tp_plan says") if user_vocab or not hf \
        else vocab_rules(model, tp, vocab, loss_parallel, profile=profile)
    embed_rule = None
    first = sorted(hf, key=lambda p: not (embed_name and matches(embed_name, p)))
    experts = tuple(p + "." for p, s in hf.items() if s == "moe_tp_experts")
    for pattern, style in ((p, hf[p]) for p in first):  # an embedding before its tied head
        if not user_vocab and any(matches(n, pattern) for n in vocab_names):
            continue  # the vocabulary split is ours to choose
        if pattern.startswith(experts):
            continue  # the experts' weights (and identity expert): split with their module
        target = targets.find(pattern)
        if HF_STYLES[style] is None or target is None:
            continue
        new = _rule(model, pattern, style, target, head_name, embed_rule)
        if target[1] == embed_name and HF_STYLES[style][0] == "vocab":
            embed_rule = pattern
        rules.update(new)
    if user_vocab and any(r["style"] == "vocab_logits" for r in rules.values()):
        mode = "parallel"
    for pattern, rule in rules.items():  # a partial sum over raw sharded parameters
        if rule["style"] == "reduce_out" and any(
                r["style"] == "shard_param" for p, r in rules.items()
                if p.startswith(pattern + ".")):
            rule["region_inputs"] = True
    rules = _row_inputs(model, rules)
    _check_heads(model, rules, tp, targets)
    _per_head_norms(rules, targets)
    _pad_ffn(rules)
    return Plan(rules=rules, attention="heads", vocab=mode,
                reason=f"translated from {model_type}'s tp_plan; {why}")
