"""The planner's search: every ``dp × tp × ep`` layout with its options, ranked by predicted step
time among those that fit in memory (SPEC F10).

Step time of one candidate (all per GPU, no pipeline parallelism)::

    compute   = FLOPs per step / N / (peak × efficiency)          (× 4/3 with full recompute,
                                                                   + the attention core's forward
                                                                   with selective recompute)
    tp_comm   = layers × micro-steps × Σ_collectives (α + wire_bytes / β_tp)
    dp_comm   = gradient reduction (ZeRO-3: + 2 parameter all-gathers) over dp, exposed only past
                the backward pass it overlaps (2/3 of compute), as DDP does
    ep_comm   = per MoE layer and micro-step, the all-to-alls of the routed tokens and the count
                all-gather (:func:`~.strategies.moe_cost`), over the EP group
    step      = compute + tp_comm + ep_comm + exposed dp_comm

``β_tp`` is the intra-node link while the TP group fits in a node, else the inter-node link
(hierarchical collectives are bounded by their slowest stage). Collective volumes come from
:mod:`.strategies` (checked against the ledger), memory from :mod:`.memory`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from types import SimpleNamespace

from ..comm.ledger import wire_elements
from .choose import attention_problem
from .memory import RECOMPUTE, activation_bytes_per_layer, model_state_bytes
from .strategies import ATTENTION_STRATEGIES, attention_cost, layer_cost, moe_cost

EFFICIENCY = 0.5  # achievable fraction of peak FLOP/s on large GEMMs (assumed; MFU 40–55% typical)
MICRO_BATCHES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Options:
    dp: int
    tp: int
    ep: int
    attention: str
    sequence_parallel: bool
    recompute: str
    zero_stage: int
    micro_batch: int


def _powers_of_two(limit: int) -> list[int]:
    return [2 ** i for i in range(int(math.log2(limit)) + 1)] if limit >= 1 else [1]


def _as_gpt(model) -> SimpleNamespace:
    """The fields :func:`attention_problem` reads, from a ModelSpec."""
    return SimpleNamespace(n_heads=model.heads, n_kv_heads=model.kv_heads,
                           head_dim=model.hidden // model.heads, d_model=model.hidden,
                           pos="rope" if model.ffn_type == "swiglu" else "learned")


def candidates(model, cluster) -> list[Options]:
    """Every layout the model's sizes allow on the cluster."""
    out = []
    n = cluster.count
    for tp, ep in itertools.product(_powers_of_two(n), _powers_of_two(model.experts)):
        if n % (tp * ep) or model.experts % ep:
            continue
        dp = n // (tp * ep)
        if model.global_batch % dp or model.ffn % tp:
            continue
        cfg = _as_gpt(model)
        for attention in ATTENTION_STRATEGIES if tp > 1 else ("heads",):
            if attention_problem(cfg, tp, attention, model.seq):
                continue
            for mb, sp, rc, zero in itertools.product(MICRO_BATCHES, (False, True), RECOMPUTE,
                                                      (0, 1, 2, 3)):
                if (model.global_batch // dp) % mb or (sp and tp == 1) or (zero and dp == 1):
                    continue
                out.append(Options(dp, tp, ep, attention, sp, rc, zero, mb))
    return out


def _params_per_gpu(model, o: Options) -> float:
    expert = model.params() - model.active_params() if model.experts > 1 else 0
    dense = model.params() - expert  # attention, embeddings, norms, shared parts
    return dense / o.tp + expert / (o.tp * o.ep)


def memory(model, o: Options, bytes_per_element: int) -> dict[str, float]:
    states = model_state_bytes(_params_per_gpu(model, o), o.zero_stage, o.dp)
    act = model.layers * activation_bytes_per_layer(
        model.seq, o.micro_batch, model.hidden, model.heads, o.tp,
        sequence_parallel=o.sequence_parallel, recompute=o.recompute,
        bytes_per_element=bytes_per_element)
    return {**states, "activations": act}


def _bandwidth(cluster, group_span: int):
    inside = group_span <= cluster.gpus_per_node or cluster.inter_link is None
    return cluster.intra_link if inside else cluster.inter_link


def _steps(kind: str, p: int) -> int:
    """Latency-bound steps of a ring collective: ``2(p−1)`` for an all-reduce, ``p−1`` else."""
    return 2 * (p - 1) if kind == "all_reduce" else p - 1


def _collectives_time(comm: dict, p: int, link, size: int) -> float:
    """α–β: every call pays ``latency_s`` per ring step plus its wire bytes over the link's
    bandwidth. With sequence parallelism an all-reduce becomes a reduce-scatter + all-gather:
    the same volume and steps in two calls."""
    if p == 1:
        return 0.0
    latency = sum(c["calls"] * _steps(k, p) for k, c in comm.items()) * link.latency_s
    wire = sum(wire_elements(k, c["elements"], p) for k, c in comm.items()) * size
    return latency + wire / link.bandwidth


def step_time(model, cluster, o: Options, peak_flops: float) -> dict[str, float]:
    size = model.bytes_per_element()
    micro_steps = model.global_batch // (o.dp * o.micro_batch)
    tokens = model.global_batch * model.seq
    flops = model.flops_per_token() * tokens
    if o.recompute == "full":
        flops *= 4 / 3
    elif o.recompute == "selective":
        flops += 4 * model.layers * tokens * model.seq * model.hidden  # attention core forward
    compute = flops / cluster.count / (peak_flops * EFFICIENCY)
    swiglu, moe_ep = model.ffn_type == "swiglu", {}
    if model.experts > 1:  # attention, then the MoE FFN: its TP pair here, its EP part below
        moe = (o.micro_batch, model.seq, model.hidden, model.ffn, model.experts, model.top_k)
        moe_tp = moe_cost(*moe, 1, o.tp, swiglu=swiglu).total()
        moe_ep = moe_cost(*moe, o.ep, 1, swiglu=swiglu).total()
        layer = attention_cost(o.attention, o.micro_batch, model.seq, model.hidden, model.heads,
                               model.kv_heads, o.tp).priced() + ([(o.tp, moe_tp)] if moe_tp else [])
    else:
        layer = layer_cost(o.attention, o.micro_batch, model.seq, model.hidden, model.heads,
                           model.kv_heads, model.ffn, o.tp, swiglu=swiglu).priced()
    link = _bandwidth(cluster, o.tp)
    tp_comm = model.layers * micro_steps * sum(_collectives_time(comm, p, link, size)
                                               for p, comm in layer)
    tp_bytes = model.layers * micro_steps * size * sum(
        wire_elements(k, c["elements"], p) for p, comm in layer for k, c in comm.items())
    grads = _params_per_gpu(model, o)
    dp_elems = {"all_reduce": {"calls": 1, "elements": int(grads)}}
    if o.zero_stage == 3:
        dp_elems["all_gather"] = {"calls": 2, "elements": int(2 * grads)}
    dp_link = _bandwidth(cluster, o.dp * o.tp * o.ep)
    dp_comm = _collectives_time(dp_elems, o.dp, dp_link, size)
    dp_bytes = sum(wire_elements(k, c["elements"], o.dp) for k, c in dp_elems.items()) * size
    ep_comm = ep_bytes = 0.0
    if moe_ep:
        ep_comm = model.layers * micro_steps * _collectives_time(
            moe_ep, o.ep, _bandwidth(cluster, o.ep * o.tp), size)
        ep_bytes = model.layers * micro_steps * size * sum(
            wire_elements(k, c["elements"], o.ep) for k, c in moe_ep.items())
    exposed_dp = max(0.0, dp_comm - 2 / 3 * compute)
    total = compute + tp_comm + ep_comm + exposed_dp
    return {"step_time_s": total, "compute_s": compute, "tp_comm_s": tp_comm,
            "dp_comm_s": dp_comm, "ep_comm_s": ep_comm,
            "comm_bytes_per_step": tp_bytes + dp_bytes + ep_bytes,
            "mfu": model.flops_per_token() * tokens / (total * cluster.count * peak_flops)}


def _peak(model, cluster) -> float:
    gpu = cluster.gpu
    return {"bf16": gpu.bf16_flops, "fp16": gpu.fp16_flops, "fp32": gpu.fp32_flops}[model.dtype]


def evaluate(model, cluster, o: Options) -> dict:
    """One candidate in the planner's JSON schema."""
    mem = memory(model, o, model.bytes_per_element())
    total = sum(mem.values())
    t = step_time(model, cluster, o, _peak(model, cluster))
    return {"dp": o.dp, "tp": o.tp, "ep": o.ep, "attention": o.attention,
            "ffn": "experts" if model.experts > 1 else "column_row",
            "sequence_parallel": o.sequence_parallel, "recompute": o.recompute,
            "zero_stage": o.zero_stage, "micro_batch": o.micro_batch,
            "fits": total <= cluster.gpu.memory_bytes, "memory_per_gpu_bytes": total,
            "memory_breakdown": mem, "step_time_s": t["step_time_s"],
            "comm_bytes_per_step": t["comm_bytes_per_step"], "mfu": t["mfu"],
            "time_breakdown": {k: v for k, v in t.items() if k.endswith("_s")}}


def search(model, cluster, *, top: int = 10) -> dict:
    """``{"model", "cluster", "candidates", "best", "advice"}``: candidates that fit, fastest
    first (TP kept inside a node unless nothing else fits); when none fits, the smallest ones."""
    rows = [evaluate(model, cluster, o) for o in candidates(model, cluster)]
    if not rows:
        raise ValueError(f"no layout of {model.name} divides over {cluster.count} GPUs: check "
                         f"heads ({model.heads}), ffn ({model.ffn}) and the global batch "
                         f"({model.global_batch}) against the GPU count")
    # equal predicted times (to 3 significant digits): the one with more memory headroom first
    fitting = sorted((r for r in rows if r["fits"]),
                     key=lambda r: (float(f"{r['step_time_s']:.3g}"), r["memory_per_gpu_bytes"]))
    inside = [r for r in fitting if r["tp"] <= cluster.gpus_per_node]
    pool = inside or fitting
    best = pool[0] if pool else None
    shown = pool[:top] if pool else sorted(rows, key=lambda r: r["memory_per_gpu_bytes"])[:top]
    return {"model": model.to_dict(), "cluster": cluster.to_dict(), "candidates": shown,
            "best": best, "advice": advice(model, cluster, best, rows)}


def _gb(x: float) -> str:
    return f"{x / 1e9:,.1f} GB" if x < 1e12 else f"{x / 1e12:,.2f} TB"


def advice(model, cluster, best, rows) -> str:
    """A sentence on the chosen plan, or — when nothing fits — what would, with numbers."""
    mem = cluster.gpu.memory_bytes
    if best is not None:
        return (f"dp={best['dp']} × tp={best['tp']} × ep={best['ep']}, attention="
                f"{best['attention']}, ZeRO-{best['zero_stage']}, recompute={best['recompute']}, "
                f"sequence_parallel={best['sequence_parallel']}, micro-batch "
                f"{best['micro_batch']}: {best['step_time_s']:.3g} s/step predicted, MFU "
                f"{best['mfu']:.0%}, {_gb(best['memory_per_gpu_bytes'])} of {_gb(mem)} per GPU.")
    states = 16 * model.params()
    smallest = min(rows, key=lambda r: r["memory_per_gpu_bytes"])
    act = smallest["memory_breakdown"]["activations"]
    need = math.ceil(states / max(mem - act, 1e-9 * mem))
    parts = [f"Nothing fits. Model states alone are {model.params() / 1e9:,.1f}e9 parameters × "
             f"16 B = {_gb(states)} against {cluster.count} × {_gb(mem)} = "
             f"{_gb(cluster.count * mem)} of GPU memory.",
             f"The smallest layout (dp={smallest['dp']} × tp={smallest['tp']}, ZeRO-"
             f"{smallest['zero_stage']}, recompute={smallest['recompute']}) still needs "
             f"{_gb(smallest['memory_per_gpu_bytes'])} per GPU."]
    if states > cluster.count * mem * 0.9:
        parts.append(f"With ZeRO-3 and full recompute you need at least {need} GPUs of "
                     f"{_gb(mem)} (or CPU/NVMe offload of the {_gb(12 * model.params())} of "
                     f"optimizer state).")
    if act > 0.5 * mem:
        parts.append(f"Activations alone take {_gb(act)} per GPU at seq {model.seq}: use a "
                     f"shorter sequence or a smaller micro-batch.")
    return " ".join(parts)
