"""The diagnostics of a context-parallel model (SPEC F18; see :mod:`.diagnose`).

From one watched step's ledger (its ``cp.*`` labels: what the K/V exchange moved) and the cost
model at the step's shapes (:func:`~ops_transformer.planner.context_parallel.layer_figures`, on
the ranks' agreed profile):

- ``cp_exposed_exchange`` (warning): under ``ring``, one step's K/V transfer takes longer than the
  block of attention it is posted behind, so each of the ``cp−1`` steps waits (Liu et al. 2023's
  condition for a free ring: the block's compute at least the transfer's time);
- ``cp_short_sequence`` (warning): the exposed CP communication of a layer exceeds the attention
  work the split saves this rank: the sequence is too short for this ``cp`` (context
  parallelism pays where a long sequence's activations do not fit, or its attention dominates).

Both name the measured ``cp.*`` traffic of the step and the cost model's figures.
"""

from __future__ import annotations

from ..parallelize.context_plan import context_shapes
from ..planner.context_parallel import layer_figures


def _diag(code, severity, where, message, suggestion, saving=None) -> dict:
    return {"code": code, "severity": severity, "where": where, "message": message,
            "suggestion": suggestion, "estimated_saving_s": saving}


def cp_traffic(records: list) -> dict[str, list[int]]:
    """``{label: [calls, elements]}`` of the ``cp.*`` records of one step (ledger rows
    ``[kind, elements, bytes, group, label]``)."""
    out: dict[str, list[int]] = {}
    for kind, elements, _, _, label in records:
        if label.startswith("cp."):
            row = out.setdefault(f"{label} ({kind})", [0, 0])
            row[0] += 1
            row[1] += elements
    return out


def cp_checks(model, ctx, rank: dict, profile) -> list[dict]:
    """The findings above for rank 0's observed step ``rank`` (``[]`` without cp)."""
    choice = getattr(getattr(model, "parallel_state", None), "context_parallel", None)
    shape = rank.get("input_shape")
    if choice is None or shape is None or len(shape) != 2:
        return []
    shapes, tp, cp = context_shapes(model), ctx.tp_size, choice.cp
    batch, seq = shape  # whole rows: every cp rank is fed them
    layers = getattr(getattr(model, "cfg", None), "n_layers", None) or \
        getattr(model.config, "num_hidden_layers", 1)
    figures = layer_figures(choice.strategy, batch=batch, seq=seq,
                            kv_dim=max(1, shapes["kv_heads"] // tp) * shapes["head_dim"],
                            q_dim=shapes["d_model"] // tp, cp=cp, alpha_s=profile.alpha_s,
                            bandwidth=profile.bandwidth, matmul_flops=profile.matmul_flops)
    traffic = cp_traffic(rank["records"])
    seen = "; ".join(f"{label}: {calls}× {elements} elements" for label, (calls, elements)
                     in sorted(traffic.items())) or "none recorded"
    where = f"{choice.strategy} over cp={cp} ({layers} layers)"
    ms = (lambda s: f"{s * 1e3:.3g} ms")
    out = []
    if choice.strategy == "ring" and figures["transfer"] > figures["block"]:
        out.append(_diag(
            "cp_exposed_exchange", "warning", where,
            f"each ring step's K/V transfer ({ms(figures['transfer'])}) is not hidden behind the "
            f"block of attention it is posted before ({ms(figures['block'])}) at b={batch}, "
            f"s={seq}: {ms(figures['exposed'])} exposed per layer (the step's CP traffic: "
            f"{seen})",
            "longer sequences per rank (a smaller cp), context_parallel='allgather_kv' "
            "(--cp-strategy allgather_kv: one collective, no per-step latency) or a faster link",
            figures["exposed"] * layers))
    if figures["exposed"] > figures["attention"]:
        out.append(_diag(
            "cp_short_sequence", "warning", where,
            f"the sequence is too short for cp={cp}: at s={seq} ({seq // cp} tokens per rank) "
            f"the exposed CP communication ({ms(figures['exposed'])} per layer) exceeds this "
            f"rank's attention work ({ms(figures['attention'])} per layer) (the step's CP "
            f"traffic: {seen})",
            "a smaller cp (cp 1 when the activations fit: `ops-transformer plan` prices both); "
            "context parallelism pays for long sequences",
            max(figures["exposed"] - figures["attention"], 0.0) * layers))
    return out
