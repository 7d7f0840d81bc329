"""The vocabulary split of a Hugging Face model: embedding and LM head vocab-parallel or
replicated, chosen by predicted time as the reference GPT's are (SPEC F10, issue #15 item 5)."""

from __future__ import annotations

from types import SimpleNamespace

from torch import nn

from ..planner.choose import choose_vocab

AUTO_BATCH, MAX_AUTO_SEQ = 8, 2048  # the micro-batch the vocabulary choice assumes


def text_config(model):
    config = model.config
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def tied_embeddings(model) -> bool:
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    return out is not None and inp is not None and out.weight is inp.weight


def module_name(model, module) -> str | None:
    return next((n for n, m in model.named_modules() if m is module and n), None)


def _head_ok(head) -> bool:
    return type(head) is nn.Linear and head.bias is None


def vocab_rules(model, tp: int, vocab: str = "auto", loss_parallel: bool = False, *,
                profile=None) -> tuple[dict, str, str]:
    """``(rules, mode, reason)`` for the input embedding and the LM head: vocab-parallel
    (embedding ``vocab``, head ``vocab_logits``, tied when the model ties them) or replicated (no
    rules). ``auto`` asks the cost model (:func:`~ops_transformer.planner.choose_vocab`) for a
    micro-batch of 8 sequences of the model's context (at most 2048 tokens); a head that returns
    full logits pays an all-gather of ``N·V`` elements, a ``loss_parallel`` head only the loss
    statistics, a model without a head only the embedding's all-reduce (so it stays
    replicated)."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if type(embedding) is not nn.Embedding or (head is not None and not _head_ok(head)):
        # A subclass (Gemma's scaled embedding) or a head with a bias is not swapped.
        return {}, "replicated", "vocab replicated: an embedding or LM head of a kind not swapped"
    if vocab not in ("auto", "parallel", "replicated"):
        raise ValueError(f"vocab must be 'auto', 'parallel' or 'replicated', got {vocab!r}")
    reason = f"vocab {vocab}: as requested"
    if vocab == "auto" and tp == 1:
        vocab, reason = "parallel", "vocab parallel: tp=1"
    elif vocab == "auto":
        text = text_config(model)
        seq = min(getattr(text, "max_position_embeddings", None) or MAX_AUTO_SEQ, MAX_AUTO_SEQ)
        spec = SimpleNamespace(d_model=embedding.embedding_dim,
                               vocab_size=embedding.num_embeddings)
        kind = "none" if head is None else ("loss" if loss_parallel else "logits")
        vocab, reason = choose_vocab(spec, tp, batch=AUTO_BATCH, seq=seq, profile=profile,
                                     head=kind)
    if vocab == "replicated":
        return {}, vocab, reason
    embed = module_name(model, embedding)
    rules = {embed: {"style": "vocab"}}
    if head is not None:
        rule = {"style": "vocab_logits"}
        if tied_embeddings(model):
            rule["tied_to"] = embed
        if loss_parallel:
            rule["gather"] = False
        rules[module_name(model, head)] = rule
    return rules, vocab, reason
