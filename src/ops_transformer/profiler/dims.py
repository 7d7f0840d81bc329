"""The diagnostics that need only the model: sizes that do not divide by ``tp``
(``not_divisible``) and matmul sizes off the Tensor-Core tile (``unaligned_dim``); see
:mod:`.diagnose`."""

from __future__ import annotations

from torch import nn

from ..planner.choose import attention_problem
from ..planner.strategies import kv_problem

TILE, MINIMUM = 64, 8


def model_sizes(model: nn.Module) -> dict | None:
    """Global sizes of the reference GPT (``model.cfg``) or a Hugging Face model (``config``)."""
    cfg = getattr(model, "cfg", None)
    if cfg is not None and hasattr(cfg, "d_model"):
        return {"hidden": cfg.d_model, "heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads,
                "ffn": cfg.d_ff, "vocabulary": cfg.vocab_size, "head_dim": cfg.head_dim,
                "gpt": cfg}
    hf = getattr(model, "config", None)
    if hf is not None and hasattr(hf, "hidden_size") and hasattr(hf, "num_attention_heads"):
        heads = hf.num_attention_heads
        return {"hidden": hf.hidden_size, "heads": heads,
                "kv_heads": getattr(hf, "num_key_value_heads", None) or heads,
                "ffn": getattr(hf, "intermediate_size", None) or 4 * hf.hidden_size,
                "vocabulary": hf.vocab_size, "head_dim": hf.hidden_size // heads, "gpt": None}
    return None


def _diag(code, severity, where, message, suggestion) -> dict:
    return {"code": code, "severity": severity, "where": where, "message": message,
            "suggestion": suggestion, "estimated_saving_s": None}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and d <= 64]


def _attention(sizes: dict, tp: int) -> list[dict]:
    heads, kv = sizes["heads"], sizes["kv_heads"]
    if sizes["gpt"] is not None:
        problem = attention_problem(sizes["gpt"], tp, "heads")
        fallback = attention_problem(sizes["gpt"], tp, "kv_split") is None
    else:
        problem = (f"n_heads ({heads}) is not divisible by tp ({tp})" if heads % tp else
                   kv_problem(kv, tp))
        fallback = False
    if problem is None:
        return []
    if fallback:
        return [_diag("not_divisible", "warning", "attention", problem + "; only the K/V "
                      "feature split (kv_split) can run it, and its communication grows with "
                      "the sequence squared", f"use a tp that divides {heads} heads "
                      f"({_divisors(heads)}) for head-parallel attention, or accept kv_split")]
    return [_diag("not_divisible", "error", "attention", problem,
                  f"use a tp that divides n_heads ({_divisors(heads)}) and is compatible with "
                  f"n_kv_heads ({kv})")]


def divisibility(sizes: dict, tp: int) -> list[dict]:
    """What a TP plan at ``tp`` cannot split (dense model, before ``parallelize``)."""
    out = _attention(sizes, tp)
    if sizes["ffn"] % tp:
        out.append(_diag("not_divisible", "error", "mlp", f"the FFN size ({sizes['ffn']}) is not "
                         f"divisible by tp ({tp}): column→row splits it",
                         f"use a tp among {_divisors(sizes['ffn'])}, or an FFN size that "
                         f"divides by {tp}"))
    if sizes["vocabulary"] % tp:
        v = sizes["vocabulary"]
        padded = -(-v // (TILE * tp)) * TILE * tp
        out.append(_diag("not_divisible", "info", "vocabulary", f"the vocabulary ({v}) is not "
                         f"divisible by tp ({tp}): a vocab-parallel embedding must pad it "
                         f"(pad_vocab=True) or stay replicated",
                         f"pad the vocabulary to {padded} (a multiple of {TILE}·tp)"))
    return out


def alignment(sizes: dict | None, model: nn.Module) -> list[dict]:
    """Matmul sizes that are not multiples of :data:`TILE`: the model's hidden, FFN and
    vocabulary sizes, or, for another model, every linear layer's (global) sizes."""
    if sizes is not None:
        named = {"hidden": [sizes["hidden"]], "ffn": [sizes["ffn"]],
                 "vocabulary": [sizes["vocabulary"]]}
    else:
        named = {}
        for name, m in model.named_modules():
            for attr in ("in_features", "out_features"):
                if isinstance(getattr(m, attr, None), int):
                    named.setdefault(f"{name}.{attr}", []).append(getattr(m, attr))
    by_size: dict[int, list[str]] = {}
    for where, values in named.items():
        for v in values:
            if v % TILE:
                by_size.setdefault(v, []).append(where)
    out = []
    for size, where in sorted(by_size.items()):
        severity = "warning" if size % MINIMUM else "info"
        padded = -(-size // TILE) * TILE
        out.append(_diag("unaligned_dim", severity, ", ".join(where[:4]) +
                         (f" (+{len(where) - 4} more)" if len(where) > 4 else ""),
                         f"dimension {size} is not a multiple of {TILE}"
                         + (f" (not even of {MINIMUM})" if size % MINIMUM else "")
                         + ": 16-bit matmuls on Tensor Cores run in tiles of that size, so the "
                         "remainder wastes a partial tile",
                         f"use {padded} (pad the vocabulary, or pick sizes that are multiples "
                         f"of {TILE}, also after dividing by tp)"))
    return out


def dimension_checks(model: nn.Module, tp: int) -> list[dict]:
    sizes = model_sizes(model)
    out = []
    if sizes is not None and tp > 1 and getattr(model, "parallel_plan", None) is None:
        out += divisibility(sizes, tp)
    return out + alignment(sizes, model)
