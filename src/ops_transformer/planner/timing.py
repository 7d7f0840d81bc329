"""Predicted step time of one layout: compute, tensor/expert/context-parallel, pipeline and
data-parallel communication, optimizer (SPEC F10, F18, F19).

Per GPU of the slowest pipeline stage and optimizer step, with ``k = global_batch / (dp ·
micro_batch)`` micro-steps::

    step = k · t_micro · (1 + bubble) + exposed dp_comm + optimizer
    t_micro = matmul + attention core + memory-bound + tp_comm + ep_comm + exposed cp + pp p2p

* **matmul**: each projection's three GEMMs (forward, input and weight gradient) and the LM
  head's, plus the forwards the recompute policy recomputes, each a roofline with tile/wave
  quantisation (:mod:`.roofline`) under the ceiling of the GPU and stack (:mod:`.efficiency`);
  ``b·s/cp`` tokens per rank, the stage's ``⌈layers/pp⌉`` layers.
* **attention core** (``QKᵀ`` and ``PV``, ``4bs²h/t/cp`` forward FLOPs): eager kernels compute the
  whole ``s × s`` square, forward and backward (``3×``); fused kernels skip the masked half of a
  causal square and recompute the scores in backward (``3.5 × ½``); at ceiling × the fitted
  attention ratio × its wave quantisation, bounded below by its bytes.
* **memory-bound work** (norms, activations, softmax, dropout, residuals, the loss): ``c`` passes
  over the bytes of the layer's activations (:func:`.memory.activation_bytes_per_layer`, no
  recompute) and of the logits at the GPU's memory bandwidth, ``c`` fitted on published runs
  (:data:`.efficiency.MEMORY_PASSES`); recomputed work adds its share.
* **tp_comm** (not overlapped): the strategies' collectives (:mod:`.strategies`, equal to the
  ledger), with sequence parallelism each all-reduce becoming a reduce-scatter + all-gather of the
  same volume, priced by :func:`.network.group_time`. An MoE FFN's pair runs on the routed slots.
* **ep_comm** (MoE, not overlapped): per layer the count all-gather and the 4 all-to-alls of the
  routed slots on the EP group (:func:`.strategies.moe_cost`, equal to the ledger).
* **cp** (:mod:`.cp_exchange`): each layer's K/V exchange, the ring's hidden under its pass's
  attention core but for what exceeds it, the all-gather's exposed.
* **pp** (:mod:`.pipeline`): the schedule's bubble and the activation / gradient sent between
  stages per micro-step and chunk.
* **dp_comm** (:func:`zero_comm`, as the ZeRO paper and FSDP run them, over ``dp × cp``), hidden
  behind the compute it overlaps with (the backward of the last micro-step for stages 0–1, each
  micro-step's for 2–3).
* **optimizer**: Adam reads and writes ``32`` bytes per parameter of its shard (fp32 master,
  gradient, two moments, the 16-bit copy) at memory bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cost import Comm
from .memory import (activation_bytes_per_layer, effective_recompute, layer_matmuls, logits_bytes,
                     ops_saved)
from .cp_exchange import cp_layer_comm, exposed_cp_time
from .layout import CostOptions
from .network import group_time, p2p_alpha_beta, placement
from .pipeline import boundary_elements, bubble_fraction, stage_layers
from .roofline import (attention_bounds, bounded, gemm_bounds, memory_bound_time,
                       training_gemms)
from .strategies import attention_cost, layer_cost, moe_cost, vocab_cost

ADAM_STEP_BYTES = 32
# Gradients reduce in fp32 when the weights are 16-bit: torchtitan's default
# (training.mixed_precision_reduce = "float32", FSDP2's reduce_dtype), Megatron-LM's with bf16
# (accumulate_allreduce_grads_in_fp32 is forced on), and this library's (grad_reduce_dtype None).
GRAD_REDUCE_BYTES = 4


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
    matmul_precision: str = "default"  # "float8": the layers' projections on the FP8 peak


MATMUL_PRECISIONS = ("default", "float8")


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


def split_dp_comm(comm: Comm) -> tuple[Comm, Comm]:
    """``(parameters, gradients)`` of :func:`zero_comm`: the all-gathers move the 16-bit
    parameters, the all-reduces and reduce-scatters the gradients, in
    :data:`GRAD_REDUCE_BYTES`."""
    params = Comm({k: dict(v) for k, v in comm.items() if k == "all_gather"})
    return params, Comm({k: dict(v) for k, v in comm.items() if k != "all_gather"})


def sequence_parallel_comm(comm: dict) -> Comm:
    """Each all-reduce as a reduce-scatter plus an all-gather of the same elements (Korthikanti
    et al. 2022, §4.2.2); the other kinds unchanged."""
    out = Comm()
    for kind, c in comm.items():
        for k in (("reduce_scatter", "all_gather") if kind == "all_reduce" else (kind,)):
            out.add(k, c["elements"], c["calls"])
    return out


ROW_PARALLEL = ("o", "w2", "fc2")  # projections whose input is split over tp


def _tokens(model, o) -> int:
    """Rows of every GEMM on one rank per micro-step: the micro-batch's tokens over ``cp``."""
    return o.micro_batch * model.seq // getattr(o, "cp", 1)


def _matmul_flops(model, o, recompute: str) -> dict:
    """Forward FLOPs of one micro-step on one rank of the slowest pipeline stage (all layers
    without pipelining): the layers' projections, the attention core, the LM head, and what the
    recompute policy (:func:`effective_recompute`) computes again."""
    b, s, h, t = o.micro_batch, model.seq, model.hidden, o.tp
    cp = getattr(o, "cp", 1)
    layers = stage_layers(model.layers, getattr(o, "pp", 1))
    ffn = model.ffn * (model.top_k if model.experts > 1 else 1)
    mats = layer_matmuls(h, model.kv_dim, ffn, model.ffn_type == "swiglu")
    per_layer = {name: 2 * b * s / cp * (ffn if name in ("w2", "fc2") else h) * width / t
                 for name, width in mats}
    layer = sum(per_layer.values())
    core = 4 * b * s * s * h / t / cp
    recompute = {"none": 0.0, "selective": 0.0, "full": layer,
                 "ops": layer - sum(per_layer[n] for n in ops_saved(h, model.kv_dim, ffn,
                                                                     model.ffn_type == "swiglu"))
                 }[recompute]
    return {"layers": layers * layer, "core": layers * core, "stage_layers": layers,
            "recompute": layers * recompute, "recomputed_fraction": recompute / layer,
            "head": 2 * b * s / cp * h * model.vocab / t}


def _projection_shapes(model, o) -> list[tuple[str, int, int]]:
    """``(name, k, n)`` per rank of each projection of a layer (KV heads replicated when tp
    exceeds them: at least one head per rank)."""
    h, t = model.hidden, o.tp
    ffn = model.ffn * (model.top_k if model.experts > 1 else 1)
    out = []
    for name, width in layer_matmuls(h, model.kv_dim, ffn, model.ffn_type == "swiglu"):
        if name in ROW_PARALLEL:
            out.append((name, (ffn if name != "o" else h) // t, width))
        elif name in ("k", "v"):
            out.append((name, h, max(1, model.kv_heads // t) * model.head_dim))
        else:
            out.append((name, h, width // t))
    return out


def gemm_parts(model, cluster, o, recompute: str, peak: float,
               precision: str = "default") -> list[tuple[float, float, float]]:
    """``(compute_s at ceiling 1, memory_s, count)`` of every GEMM of one micro-step on the slowest
    stage (:mod:`.roofline`): three per projection and layer, the recomputed forwards, the LM
    head's three. With ``precision="float8"`` the layers' projections run at the card's FP8 peak
    and move 1-byte operands (torchtitan's Float8 linears; the LM head stays 16-bit)."""
    gpu, size = cluster.gpu, model.bytes_per_element()
    if precision not in MATMUL_PRECISIONS:
        raise ValueError(f"matmul precision must be one of {MATMUL_PRECISIONS}, got "
                         f"{precision!r}")
    if precision == "float8" and not gpu.fp8_flops:
        raise ValueError(f"{gpu.name} has no FP8 tensor cores (matmul precision 'float8')")
    layer_peak, layer_size = (gpu.fp8_flops, 1) if precision == "float8" else (peak, size)
    bw = gpu.memory_bandwidth
    tokens = _tokens(model, o)
    layers = stage_layers(model.layers, getattr(o, "pp", 1))
    saved = set(ops_saved(model.hidden, model.kv_dim, model.ffn, model.ffn_type == "swiglu"))
    parts = []

    def add(m, n, k, count, rate=peak, width=size):
        c, mem = gemm_bounds(m, n, k, peak=rate, bandwidth=bw, bytes_per_element=width,
                             sms=gpu.sms)
        parts.append((c, mem if gpu.sms else 0.0, count))

    for name, k, n in _projection_shapes(model, o):
        for m_, n_, k_ in training_gemms(tokens, k, n):
            add(m_, n_, k_, layers, layer_peak, layer_size)
        if recompute == "full" or (recompute == "ops" and name not in saved):
            add(tokens, n, k, layers, layer_peak, layer_size)
    for m_, n_, k_ in training_gemms(tokens, model.hidden, model.vocab // o.tp):
        add(m_, n_, k_, 1)
    return parts


def compute_parts(model, cluster, o, attention_kernel: str, loss_kernel: str,
                  peak: float, precision: str = "default") -> dict:
    """One micro-step's compute on one rank of the slowest stage, before the run constants are
    applied: ``gemms`` (:func:`gemm_parts`: divide each compute bound by the ceiling), ``core``
    (the attention core's compute bound at the full peak and memory bound: divide by ceiling ×
    attention ratio), ``core_forward_share`` (of the core's FLOPs, what forward computes) and
    ``traffic_s`` (one pass over the activation and logit bytes at the memory bandwidth:
    multiply by the memory-bound passes)."""
    recompute = effective_recompute(o.recompute, attention_kernel)
    f = _matmul_flops(model, o, recompute)
    fused = attention_kernel == "fused"
    cp = getattr(o, "cp", 1)
    core_passes = 3.5 * 0.5 if fused else 3.0
    core_recompute = 0.0
    if recompute in ("full", "selective"):
        core_recompute = f["core"] * (0.5 if fused else 1.0)
    matmul = 3 * (f["layers"] + f["head"]) + f["recompute"]
    core = core_passes * f["core"] + core_recompute
    size = model.bytes_per_element()
    gpu = cluster.gpu
    heads = max(1, model.heads // o.tp)
    core_c, core_m = attention_bounds(
        flops=core, batch=o.micro_batch, heads=heads, q_len=model.seq // cp, kv_len=model.seq,
        head_dim=model.head_dim, kv_heads=max(1, model.kv_heads // o.tp), peak=peak,
        bandwidth=gpu.memory_bandwidth, bytes_per_element=size, sms=gpu.sms)
    act = activation_bytes_per_layer(  # all the layer's activations: no recompute
        model, o, CostOptions(sequence_parallel=o.sequence_parallel), batch=o.micro_batch,
        seq=model.seq, bytes_per_element=size, attention_kernel=attention_kernel)
    redo = 1 + f["recomputed_fraction"] / 3 if recompute in ("full", "ops") else 1.0
    traffic = (f["stage_layers"] * act * redo
               + logits_bytes(o.micro_batch * model.seq // cp, model.vocab, o.tp, size,
                              loss_kernel))
    forward_core = (0.5 if fused else 1.0) * f["core"] * (2 if recompute in ("full",) else 1)
    return {"gemms": gemm_parts(model, cluster, o, recompute, peak, precision),
            "matmul_flops_s": matmul / peak,
            "core": (core_c, core_m * (3.5 if fused else 3.0) if gpu.sms else 0.0),
            "core_flops_s": core / peak, "core_forward_share": forward_core / core,
            "traffic_s": memory_bound_time(traffic, gpu.memory_bandwidth),
            "recompute_flops": f["recompute"] + core_recompute,
            "stage_layers": f["stage_layers"]}


def tp_comm(model, o) -> dict:
    """One micro-step's tensor-parallel collectives on one rank of the slowest stage: ``{"main":
    Comm}`` on the TP group (per layer × the stage's layers + the vocabulary's, sequence
    parallelism converted; a CP rank's ``s/cp`` tokens) and ``{"sub": Comm, "sub_size"}`` on the
    replicated-KV subgroups."""
    seq = model.seq // getattr(o, "cp", 1)
    layers = stage_layers(model.layers, getattr(o, "pp", 1))
    if model.experts > 1:  # attention + the MoE FFN's TP pair on routed slots (moe_cost)
        layer = attention_cost(o.attention, o.micro_batch, seq, model.hidden, model.heads,
                               model.kv_heads, o.tp, bias=model.bias) + _moe(model, o, 1, o.tp)
    else:
        layer = layer_cost(o.attention, o.micro_batch, seq, model.hidden, model.heads,
                           model.kv_heads, model.ffn, o.tp, swiglu=model.ffn_type == "swiglu",
                           bias=model.bias)
    comm = layer.total().minus(layer.subgroup).scaled(layers)
    comm = comm + vocab_cost("parallel", o.micro_batch, seq, model.hidden, model.vocab,
                             o.tp).total()
    sub = layer.subgroup.scaled(layers)
    if o.sequence_parallel:
        comm = sequence_parallel_comm(comm)
    return {"main": comm, "sub": sub, "sub_size": layer.subgroup_size}


def _moe(model, o, ep: int, tp: int):
    """One MoE FFN of ``model`` at ``ep × tp`` (:func:`~.strategies.moe_cost`): the count
    all-gather and 4 all-to-alls of the routed slots on the EP group, the column→row pair on TP."""
    return moe_cost(o.micro_batch, model.seq // getattr(o, "cp", 1), model.hidden, model.ffn,
                    model.experts, model.top_k, ep, tp, swiglu=model.ffn_type == "swiglu")


def p2p_time(cluster, elements: float, where, bytes_per_element: int, calls: int) -> float:
    """``calls`` point-to-point transfers of ``elements`` in all between neighbours of the group
    ``where`` (one hop each; across nodes at one NIC's rate, :func:`.network.p2p_alpha_beta`)."""
    if where.size <= 1 or calls == 0:
        return 0.0
    alpha, beta = p2p_alpha_beta(cluster, where)("send_recv", 2)
    return calls * alpha + elements * bytes_per_element / beta


def cp_parts(model, cluster, o) -> dict:
    """Seconds of one layer's CP exchange on one rank, forward and backward
    (:func:`.cp_exchange.cp_layer_comm`), on the CP group (ranks ``tp`` apart)."""
    cp = getattr(o, "cp", 1)
    if cp == 1:
        return {"cp_forward_s": 0.0, "cp_backward_s": 0.0, "cp_layer_elements": 0.0}
    strategy = getattr(o, "cp_strategy", "ring")
    comm = cp_layer_comm(strategy, o.micro_batch, model.seq, model.kv_heads, model.head_dim, cp,
                         o.tp)
    where, size = placement(cluster, cp, o.tp), model.bytes_per_element()
    if strategy == "ring":
        times = {k: p2p_time(cluster, c["send_recv"]["elements"], where, size,
                             c["send_recv"]["calls"]) for k, c in comm.items()}
    else:
        times = {k: group_time(cluster, c, where, size) for k, c in comm.items()}
    wire = sum(c.wire_elements(cp) if strategy != "ring" else c["send_recv"]["elements"]
               for c in comm.values())
    return {"cp_forward_s": times["forward"], "cp_backward_s": times["backward"],
            "cp_layer_elements": wire}


def pp_parts(model, cluster, o, micro_steps: int) -> dict:
    """The pipeline's bubble fraction and one micro-step's stage-boundary transfers: forward the
    activation, backward its gradient, once per model chunk (``virtual_stages``)."""
    pp = getattr(o, "pp", 1)
    if pp == 1:
        return {"bubble": 0.0, "pp_comm_s": 0.0, "pp_elements": 0.0}
    v = getattr(o, "virtual_stages", 1)
    n = boundary_elements(o.micro_batch, model.seq, model.hidden, tp=o.tp,
                          cp=getattr(o, "cp", 1))
    stride = o.tp * getattr(o, "cp", 1) * o.ep * o.dp
    where = placement(cluster, pp, stride)
    return {"bubble": bubble_fraction(getattr(o, "schedule", "1f1b"), pp, micro_steps, v),
            "pp_comm_s": p2p_time(cluster, 2 * v * n, where, model.bytes_per_element(), 2 * v),
            "pp_elements": 2 * v * n}


def step_parts(model, cluster, o, run: Execution, peak: float, params_per_gpu: float) -> dict:
    """Everything of the step time that does not depend on the efficiency and the memory-bound
    passes (:func:`combine` applies them), so that fitting them on published runs is cheap."""
    size = model.bytes_per_element()
    cp = getattr(o, "cp", 1)
    micro_steps = model.global_batch // (o.dp * o.micro_batch)
    tp = tp_comm(model, o)
    tp_s = (group_time(cluster, tp["main"], placement(cluster, o.tp, 1), size)
            + group_time(cluster, tp["sub"], placement(cluster, tp["sub_size"], 1), size))
    layers = stage_layers(model.layers, getattr(o, "pp", 1))
    ep = _moe(model, o, o.ep, 1).subgroup.scaled(layers) if o.ep > 1 else Comm()
    replicas = o.dp * cp  # the weights are replicated over dp and cp: gradients reduce over both
    dp = zero_comm(o.zero_stage, params_per_gpu, micro_steps) if replicas > 1 else Comm()
    shard = params_per_gpu / (replicas if o.zero_stage >= 1 else 1)
    cpp, ppp = cp_parts(model, cluster, o), pp_parts(model, cluster, o, micro_steps)
    params, grads = split_dp_comm(dp)
    wire = (micro_steps * (tp["main"].wire_elements(o.tp) + ep.wire_elements(o.ep)
                           + tp["sub"].wire_elements(tp["sub_size"])
                           + layers * cpp["cp_layer_elements"] + ppp["pp_elements"])
            + params.wire_elements(replicas)) * size \
        + grads.wire_elements(replicas) * GRAD_REDUCE_BYTES
    dp_where = placement(cluster, replicas, o.tp if cp > 1 else o.tp * o.ep)
    return {**compute_parts(model, cluster, o, run.attention_kernel, run.loss_kernel, peak,
                            run.matmul_precision),
            **cpp, **ppp,
            "micro_steps": micro_steps, "zero_stage": o.zero_stage, "tp_comm_s": tp_s,
            "recompute_forward": effective_recompute(o.recompute, run.attention_kernel) == "full",
            "cp_strategy": getattr(o, "cp_strategy", "ring"),
            "ep_comm_s": group_time(cluster, ep, placement(cluster, o.ep, o.tp), size),
            "dp_comm_s": (group_time(cluster, params, dp_where, size)
                          + group_time(cluster, grads, dp_where, GRAD_REDUCE_BYTES)),
            "optimizer_s": ADAM_STEP_BYTES * shard / cluster.gpu.memory_bandwidth,
            "comm_bytes_per_step": wire, "dp_comm": dp}


def _cp_exposed(parts: dict, core_s: float) -> float:
    """One micro-step's exposed CP exchange: per layer, forward (twice with full recompute)
    and backward, each against the attention core's time of that pass."""
    if not parts["cp_forward_s"] and not parts["cp_backward_s"]:
        return 0.0
    per_layer = core_s / parts["stage_layers"]
    fwd, bwd = per_layer * parts["core_forward_share"], per_layer * (
        1 - parts["core_forward_share"])
    passes = 2 if parts["recompute_forward"] else 1
    fwd_one = fwd / passes
    strategy = parts["cp_strategy"]
    return parts["stage_layers"] * (
        passes * exposed_cp_time(strategy, parts["cp_forward_s"], fwd_one)
        + exposed_cp_time(strategy, parts["cp_backward_s"], bwd))


def combine(parts: dict, efficiency: float, memory_passes: float,
            attention_ratio: float = 1.0) -> dict:
    """The step time from :func:`step_parts` (module docstring), in the planner's JSON names."""
    k = parts["micro_steps"]
    matmul = bounded(parts["gemms"], efficiency)
    core_c, core_m = parts["core"]
    core = max(core_c / (efficiency * attention_ratio), core_m)
    memory_bound = memory_passes * parts["traffic_s"]
    compute = matmul + core + memory_bound
    cp_exposed = _cp_exposed(parts, core)
    window = k * compute if parts["zero_stage"] >= 2 else 2 / 3 * compute
    exposed = max(0.0, parts["dp_comm_s"] - window)
    micro = compute + parts["tp_comm_s"] + parts["ep_comm_s"] + cp_exposed + parts["pp_comm_s"]
    bubble = k * micro * parts["bubble"]
    total = k * micro + bubble + exposed + parts["optimizer_s"]
    return {"step_time_s": total, "compute_s": k * compute, "matmul_s": k * matmul,
            "attention_core_s": k * core, "memory_bound_s": k * memory_bound,
            "tp_comm_s": k * parts["tp_comm_s"],
            "ep_comm_s": k * parts["ep_comm_s"],
            "cp_comm_s": k * parts["stage_layers"] * (
                parts["cp_forward_s"] * (2 if parts["recompute_forward"] else 1)
                + parts["cp_backward_s"]),
            "cp_exposed_s": k * cp_exposed, "pp_comm_s": k * parts["pp_comm_s"],
            "pp_bubble_s": bubble, "dp_comm_s": parts["dp_comm_s"],
            "dp_exposed_s": exposed, "optimizer_s": parts["optimizer_s"],
            "recompute_flops": k * parts["recompute_flops"],
            "comm_bytes_per_step": parts["comm_bytes_per_step"], "dp_comm": parts["dp_comm"],
            "micro_steps": k}


def step_time(model, cluster, o, run: Execution, peak: float, params_per_gpu: float) -> dict:
    """The step time of layout ``o`` run as ``run`` says, and its parts."""
    parts = step_parts(model, cluster, o, run, peak, params_per_gpu)
    return combine(parts, run.efficiency, run.memory_passes, run.attention_ratio)
