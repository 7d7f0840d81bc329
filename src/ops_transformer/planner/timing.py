"""Predicted step time of one layout: compute, tensor/expert-parallel and data-parallel
communication, optimizer (SPEC F10).

Per GPU and optimizer step, with ``k = global_batch / (dp · micro_batch)`` micro-steps::

    step = k · (matmul + attention core + memory-bound + tp_comm + ep_comm) + exposed dp_comm
           + optimizer

* **matmul**: the projections and LM head, ``3 ×`` forward FLOPs (Narayanan et al. 2021), plus the
  forward of what the recompute policy recomputes, over ``peak × efficiency`` (the achieved
  matmul efficiency of the GPU and stack, :mod:`.efficiency`).
* **attention core** (``QKᵀ`` and ``PV``, ``4bs²h/t`` forward FLOPs): eager kernels compute the
  whole ``s × s`` square, forward and backward (``3×``); fused kernels skip the masked half of a
  causal square and recompute the scores in backward (``3.5 × ½``).
* **memory-bound work** (norms, activations, softmax, dropout, residuals, the loss): ``c`` passes
  over the bytes of the layer's activations (:func:`.memory.activation_bytes_per_layer`, no
  recompute) and of the logits at the GPU's memory bandwidth, ``c`` fitted on published runs
  (:data:`.efficiency.MEMORY_PASSES`); recomputed work adds its share.
* **tp_comm** (not overlapped): the strategies' collectives (:mod:`.strategies`, equal to the
  ledger), with sequence parallelism each all-reduce becoming a reduce-scatter + all-gather of the
  same volume, priced by :func:`.network.group_time`. An MoE FFN's pair runs on the routed slots.
* **ep_comm** (MoE, not overlapped): per layer the count all-gather and the 4 all-to-alls of the
  routed slots on the EP group (:func:`.strategies.moe_cost`, equal to the ledger).
* **dp_comm** (:func:`zero_comm`, as the ZeRO paper and FSDP run them), hidden behind the compute
  it overlaps with (the backward of the last micro-step for stages 0–1, each micro-step's for 2–3).
* **optimizer**: Adam reads and writes ``32`` bytes per parameter of its shard (fp32 master,
  gradient, two moments, the 16-bit copy) at memory bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cost import Comm
from .memory import (activation_bytes_per_layer, effective_recompute, layer_matmuls, logits_bytes,
                     ops_saved)
from .network import group_time, placement
from .strategies import attention_cost, layer_cost, moe_cost, vocab_cost

ADAM_STEP_BYTES = 32


@dataclass(frozen=True)
class Execution:
    """How the kernels run, beyond the layout: the attention and loss kernels, the achieved matmul
    efficiency (fraction of the dense peak), the attention core's efficiency relative to it and
    the memory-bound passes (both fitted, :mod:`.efficiency`)."""

    attention_kernel: str = "fused"
    efficiency: float = 0.5
    memory_passes: float = 0.0
    attention_ratio: float = 1.0  # the attention core's efficiency ÷ the projections'
    loss_kernel: str = "fused"


def zero_comm(stage: int, params: float, micro_steps: int) -> Comm:
    """Data-parallel collectives of one optimizer step for ``params`` parameters per rank
    (Rajbhandari et al. 2020, §7; FSDP): stage 0 (DDP) an all-reduce of the gradients; stage 1 a
    reduce-scatter of the gradients and an all-gather of the updated parameters (the same
    ``2Ψ``); stage 2 reduces every micro-step's gradients into the shards; stage 3 all-gathers the
    parameters in forward and again in backward, and reduce-scatters the gradients, every
    micro-step (``3Ψ`` per micro-step)."""
    n = int(params)
    if stage == 0:
        return Comm().add("all_reduce", n)
    if stage == 1:
        return Comm().add("reduce_scatter", n).add("all_gather", n)
    if stage == 2:
        return Comm().add("reduce_scatter", n * micro_steps, micro_steps).add("all_gather", n)
    return (Comm().add("all_gather", 2 * n * micro_steps, 2 * micro_steps)
            .add("reduce_scatter", n * micro_steps, micro_steps))


def sequence_parallel_comm(comm: dict) -> Comm:
    """Each all-reduce as a reduce-scatter plus an all-gather of the same elements (Korthikanti
    et al. 2022, §4.2.2); the other kinds unchanged."""
    out = Comm()
    for kind, c in comm.items():
        for k in (("reduce_scatter", "all_gather") if kind == "all_reduce" else (kind,)):
            out.add(k, c["elements"], c["calls"])
    return out


def _matmul_flops(model, o, recompute: str) -> dict:
    """Forward FLOPs of one micro-step on one rank: the layers' projections, the attention
    core, the LM head, and what the recompute policy (:func:`effective_recompute`) computes
    again."""
    b, s, h, t = o.micro_batch, model.seq, model.hidden, o.tp
    ffn = model.ffn * (model.top_k if model.experts > 1 else 1)
    mats = layer_matmuls(h, model.kv_dim, ffn, model.ffn_type == "swiglu")
    per_layer = {name: 2 * b * s * (ffn if name in ("w2", "fc2") else h) * width / t
                 for name, width in mats}
    layer = sum(per_layer.values())
    core = 4 * b * s * s * h / t
    recompute = {"none": 0.0, "selective": 0.0, "full": layer,
                 "ops": layer - sum(per_layer[n] for n in ops_saved(h, model.kv_dim, ffn,
                                                                     model.ffn_type == "swiglu"))
                 }[recompute]
    return {"layers": model.layers * layer, "core": model.layers * core,
            "recompute": model.layers * recompute, "recomputed_fraction": recompute / layer,
            "head": 2 * b * s * h * model.vocab / t}


def compute_parts(model, cluster, o, attention_kernel: str, loss_kernel: str,
                  peak: float) -> dict:
    """One micro-step's compute on one rank, before the two run constants are applied:
    ``matmul_flops_s`` and ``core_flops_s`` (the projections and the attention core at the full
    peak: divide by their efficiencies) and
    ``traffic_s`` (one pass over the activation and logit bytes at the memory bandwidth: multiply
    by the memory-bound passes)."""
    recompute = effective_recompute(o.recompute, attention_kernel)
    f = _matmul_flops(model, o, recompute)
    fused = attention_kernel == "fused"
    core_passes = 3.5 * 0.5 if fused else 3.0
    core_recompute = 0.0
    if recompute in ("full", "selective"):
        core_recompute = f["core"] * (0.5 if fused else 1.0)
    matmul = 3 * (f["layers"] + f["head"]) + f["recompute"]
    core = core_passes * f["core"] + core_recompute
    size = model.bytes_per_element()
    act = activation_bytes_per_layer(
        model.seq, o.micro_batch, model.hidden, model.heads, o.tp,
        sequence_parallel=o.sequence_parallel, bytes_per_element=size,
        attention_kernel=attention_kernel, kv_heads=model.kv_heads, ffn=model.ffn,
        gated=model.ffn_type == "swiglu", dropout=model.dropout > 0)
    redo = 1 + f["recomputed_fraction"] / 3 if recompute in ("full", "ops") else 1.0
    traffic = (model.layers * act * redo
               + logits_bytes(o.micro_batch * model.seq, model.vocab, o.tp, size, loss_kernel))
    return {"matmul_flops_s": matmul / peak, "core_flops_s": core / peak,
            "traffic_s": traffic / cluster.gpu.memory_bandwidth,
            "recompute_flops": f["recompute"] + core_recompute}


def tp_comm(model, o) -> dict:
    """One micro-step's tensor-parallel collectives on one rank: ``{"main": Comm}`` on the TP
    group (per layer × layers + the vocabulary's, sequence parallelism converted) and ``{"sub":
    Comm, "sub_size"}`` on the replicated-KV subgroups."""
    if model.experts > 1:  # attention + the MoE FFN's TP pair on routed slots (moe_cost)
        layer = attention_cost(o.attention, o.micro_batch, model.seq, model.hidden, model.heads,
                               model.kv_heads, o.tp, bias=model.bias) + _moe(model, o, 1, o.tp)
    else:
        layer = layer_cost(o.attention, o.micro_batch, model.seq, model.hidden, model.heads,
                           model.kv_heads, model.ffn, o.tp, swiglu=model.ffn_type == "swiglu",
                           bias=model.bias)
    comm = layer.total().minus(layer.subgroup).scaled(model.layers)
    comm = comm + vocab_cost("parallel", o.micro_batch, model.seq, model.hidden, model.vocab,
                             o.tp).total()
    sub = layer.subgroup.scaled(model.layers)
    if o.sequence_parallel:
        comm = sequence_parallel_comm(comm)
    return {"main": comm, "sub": sub, "sub_size": layer.subgroup_size}


def _moe(model, o, ep: int, tp: int):
    """One MoE FFN of ``model`` at ``ep × tp`` (:func:`~.strategies.moe_cost`): the count
    all-gather and 4 all-to-alls of the routed slots on the EP group, the column→row pair on TP."""
    return moe_cost(o.micro_batch, model.seq, model.hidden, model.ffn, model.experts, model.top_k,
                    ep, tp, swiglu=model.ffn_type == "swiglu")


def step_parts(model, cluster, o, run: Execution, peak: float, params_per_gpu: float) -> dict:
    """Everything of the step time that does not depend on the efficiency and the memory-bound
    passes (:func:`combine` applies them), so that fitting them on published runs is cheap."""
    size = model.bytes_per_element()
    micro_steps = model.global_batch // (o.dp * o.micro_batch)
    tp = tp_comm(model, o)
    tp_s = (group_time(cluster, tp["main"], placement(cluster, o.tp, 1), size)
            + group_time(cluster, tp["sub"], placement(cluster, tp["sub_size"], 1), size))
    ep = _moe(model, o, o.ep, 1).subgroup.scaled(model.layers) if o.ep > 1 else Comm()
    dp = zero_comm(o.zero_stage, params_per_gpu, micro_steps) if o.dp > 1 else Comm()
    shard = params_per_gpu / (o.dp if o.zero_stage >= 1 else 1)
    wire = (micro_steps * (tp["main"].wire_elements(o.tp) + ep.wire_elements(o.ep)
                           + tp["sub"].wire_elements(tp["sub_size"]))
            + dp.wire_elements(o.dp)) * size
    return {**compute_parts(model, cluster, o, run.attention_kernel, run.loss_kernel, peak),
            "micro_steps": micro_steps, "zero_stage": o.zero_stage, "tp_comm_s": tp_s,
            "ep_comm_s": group_time(cluster, ep, placement(cluster, o.ep, o.tp), size),
            "dp_comm_s": group_time(cluster, dp, placement(cluster, o.dp, o.tp * o.ep), size),
            "optimizer_s": ADAM_STEP_BYTES * shard / cluster.gpu.memory_bandwidth,
            "comm_bytes_per_step": wire, "dp_comm": dp}


def combine(parts: dict, efficiency: float, memory_passes: float,
            attention_ratio: float = 1.0) -> dict:
    """The step time from :func:`step_parts` (module docstring), in the planner's JSON names."""
    k = parts["micro_steps"]
    matmul = parts["matmul_flops_s"] / efficiency
    core = parts["core_flops_s"] / (efficiency * attention_ratio)
    memory_bound = memory_passes * parts["traffic_s"]
    compute = matmul + core + memory_bound
    window = k * compute if parts["zero_stage"] >= 2 else 2 / 3 * compute
    exposed = max(0.0, parts["dp_comm_s"] - window)
    total = k * (compute + parts["tp_comm_s"] + parts["ep_comm_s"]) + exposed \
        + parts["optimizer_s"]
    return {"step_time_s": total, "compute_s": k * compute, "matmul_s": k * matmul,
            "attention_core_s": k * core, "memory_bound_s": k * memory_bound,
            "tp_comm_s": k * parts["tp_comm_s"],
            "ep_comm_s": k * parts["ep_comm_s"], "dp_comm_s": parts["dp_comm_s"],
            "dp_exposed_s": exposed, "optimizer_s": parts["optimizer_s"],
            "recompute_flops": k * parts["recompute_flops"],
            "comm_bytes_per_step": parts["comm_bytes_per_step"], "dp_comm": parts["dp_comm"],
            "micro_steps": k}


def step_time(model, cluster, o, run: Execution, peak: float, params_per_gpu: float) -> dict:
    """The step time of layout ``o`` run as ``run`` says, and its parts."""
    parts = step_parts(model, cluster, o, run, peak, params_per_gpu)
    return combine(parts, run.efficiency, run.memory_passes, run.attention_ratio)
