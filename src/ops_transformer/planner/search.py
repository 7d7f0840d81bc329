"""The planner's search: every ``dp × tp × ep`` layout with its options, ranked by predicted step
time among those that fit in memory (SPEC F10) — and one layout evaluated exactly as given.

Time comes from :mod:`.timing` (compute at the GPU's achieved efficiency, the strategies'
collectives priced on the network model of :mod:`.network`, ZeRO traffic as FSDP runs it), memory
from :mod:`.memory` (model states, activations by attention kernel and recompute policy, logits,
ZeRO-3's gathered layer). Nothing here runs a process group.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass

from . import catalogue
from .choose import attention_problem
from . import efficiency as fitted
from .memory import (ATTENTION_KERNELS, LOSS_KERNELS, activation_bytes_per_layer,
                     logits_bytes, model_state_bytes)
from .cp_exchange import CP_STRATEGIES
from .layout import CostOptions
from .pipeline import SCHEDULES, in_flight_micro_batches, stage_layers
from .runnable import runtime_problem
from .strategies import ATTENTION_STRATEGIES
from .timing import GRAD_REDUCE_BYTES, MATMUL_PRECISIONS, Execution
from .timing import step_time as _step_time

MICRO_BATCHES = (1, 2, 4, 8)
SEARCHED_RECOMPUTE = ("none", "selective", "full")  # "ops" is "selective" with a fused kernel


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
    pp: int = 1  # pipeline stages (outermost)
    cp: int = 1  # context-parallel ranks (the sequence split over them)
    schedule: str = "1f1b"  # the pipeline schedule (.pipeline.SCHEDULES)
    virtual_stages: int = 1  # model chunks per stage (interleaved, zbv)
    cp_strategy: str = "ring"  # the K/V exchange (.cp_exchange.CP_STRATEGIES)

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.ep * self.pp * self.cp


def execution(cluster, *, attention_kernel: str = "fused", loss_kernel: str = "fused",
              efficiency: float | None = None, stack: str | None = None,
              matmul_precision: str = "default") -> tuple[Execution, str]:
    """The run settings for ``cluster`` and where its efficiency comes from: ``efficiency`` when
    given, else the default of the GPU (and ``stack``, :mod:`.efficiency`); local CPU ranks run at
    the profile's measured matmul rate (efficiency 1, no separate memory-bound term)."""
    if attention_kernel not in ATTENTION_KERNELS:
        raise ValueError(f"attention_kernel must be one of {ATTENTION_KERNELS}, got "
                         f"{attention_kernel!r}")
    if loss_kernel not in LOSS_KERNELS:
        raise ValueError(f"loss_kernel must be one of {LOSS_KERNELS}, got {loss_kernel!r}")
    if matmul_precision not in MATMUL_PRECISIONS:
        raise ValueError(f"matmul_precision must be one of {MATMUL_PRECISIONS}, got "
                         f"{matmul_precision!r}")
    if matmul_precision == "float8" and not cluster.gpu.fp8_flops:
        cards = ", ".join(n for n, g in catalogue.GPUS.items() if g.fp8_flops)
        raise ValueError(f"{cluster.gpu.name} has no FP8 tensor cores (cards with FP8: {cards})")
    kernels = dict(attention_kernel=attention_kernel, loss_kernel=loss_kernel,
                   matmul_precision=matmul_precision)
    if cluster.gpu.vendor == "cpu":
        return Execution(efficiency=efficiency or 1.0, **kernels), "this machine's profile"
    constants = dict(memory_passes=fitted.MEMORY_PASSES, attention_ratio=fitted.ATTENTION_RATIO,
                     **kernels)
    if efficiency is not None:
        return Execution(efficiency=efficiency, **constants), "given"
    found = fitted.default_efficiency(cluster.gpu.name, stack, matmul_precision)
    return Execution(efficiency=found.value, **constants), found.source


def _powers_of_two(limit: int) -> list[int]:
    return [2 ** i for i in range(int(math.log2(limit)) + 1)] if limit >= 1 else [1]


def layout_problem(model, cluster, o: Options) -> str | None:
    """Why the model's sizes do not divide over layout ``o`` (``None`` when they do)."""
    if o.gpus != cluster.count:
        if o.pp == 1 and o.cp == 1:
            return (f"dp × tp × ep = {o.dp} × {o.tp} × {o.ep} = {o.gpus} is not the number of "
                    f"GPUs ({cluster.count})")
        return (f"dp × pp × cp × tp × ep = {o.dp} × {o.pp} × {o.cp} × {o.tp} × {o.ep} = "
                f"{o.gpus} is not the number of GPUs ({cluster.count})")
    if o.pp > model.layers:
        return f"pp ({o.pp}) must be at most the number of layers ({model.layers})"
    if o.schedule not in SCHEDULES:
        return f"schedule must be one of {SCHEDULES}, got {o.schedule!r}"
    if o.schedule in ("interleaved", "zbv") and o.pp > 1 \
            and model.layers < o.pp * o.virtual_stages:
        return (f"pp × virtual stages ({o.pp} × {o.virtual_stages}) must be at most the number "
                f"of layers ({model.layers})")
    if o.schedule == "zbv" and o.virtual_stages != 2:
        return f"the zbv schedule runs 2 chunks per stage, got virtual stages {o.virtual_stages}"
    if o.cp_strategy not in CP_STRATEGIES:
        return f"cp strategy must be one of {CP_STRATEGIES}, got {o.cp_strategy!r}"
    if model.seq % (2 * o.cp) and o.cp > 1:
        return (f"cp ({o.cp}) splits the sequence into 2·cp head-tail chunks: the sequence "
                f"({model.seq}) must be divisible by {2 * o.cp}")
    if model.experts % o.ep:
        return f"ep ({o.ep}) must divide the number of experts ({model.experts})"
    if model.ffn % o.tp:
        return f"tp ({o.tp}) must divide the FFN width ({model.ffn})"
    if model.global_batch % (o.dp * o.micro_batch):
        return (f"the global batch ({model.global_batch}) must be a multiple of dp × "
                f"micro-batch ({o.dp} × {o.micro_batch})")
    if o.sequence_parallel and o.tp == 1:
        return "sequence parallelism needs tp > 1"
    if o.zero_stage and o.dp * o.cp == 1:
        return f"ZeRO stage {o.zero_stage} shards over dp, which is 1"
    return attention_problem(model.gpt_config(), o.tp, o.attention, model.seq)


def candidates(model, cluster, *, runnable_only: bool = True) -> list[Options]:
    """Every layout the model's sizes allow on the cluster: with ``runnable_only`` (what
    ``train --plan`` runs) the ``dp × cp × tp × ep`` ones :func:`train_problem` accepts (cp a
    power of two up to :data:`MAX_CP`, with ``heads`` attention and both K/V strategies); else
    also pipeline parallelism (:func:`layouts_4d`)."""
    if not runnable_only:
        return layouts_4d(model, cluster)
    out = []
    n = cluster.count
    for tp, ep, cp in itertools.product(_powers_of_two(n), _powers_of_two(model.experts),
                                        _powers_of_two(min(n, MAX_CP))):
        if n % (tp * ep * cp):
            continue
        dp = n // (tp * ep * cp)
        attentions = ("heads",) if tp == 1 or cp > 1 else ATTENTION_STRATEGIES
        for attention, strategy, mb, sp, rc, zero in itertools.product(
                attentions, CP_STRATEGIES if cp > 1 else ("ring",), MICRO_BATCHES,
                (False, True), SEARCHED_RECOMPUTE, (0, 1, 2, 3)):
            o = Options(dp, tp, ep, attention, sp, rc, zero, mb, cp=cp, cp_strategy=strategy)
            if layout_problem(model, cluster, o) is None and train_problem(model, o) is None:
                out.append(o)
    return out


SEARCHED_SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1))
MAX_PP, MAX_CP = 64, 16


def layouts_4d(model, cluster) -> list[Options]:
    """``dp × pp × cp × tp (× ep)`` layouts: tp a power of two inside a node, cp a power of two up
    to :data:`MAX_CP` that splits the sequence into head-tail chunks, pp any divisor of the rest
    up to the layers and :data:`MAX_PP` with the schedules of :data:`SEARCHED_SCHEDULES`, and
    per layout ``heads`` attention (sequence-parallel when ``tp > 1``), each recompute policy,
    ZeRO 1 or 3 (0 without data parallelism) and micro-batches 1, 2, 4. Only the sizes are
    checked (:func:`layout_problem`): ``train`` does not run pp or cp yet."""
    out = []
    n = cluster.count
    for tp, ep in itertools.product(_powers_of_two(min(n, cluster.gpus_per_node)),
                                    _powers_of_two(model.experts)):
        for cp in _powers_of_two(min(MAX_CP, n // (tp * ep))):
            rest = n // (tp * ep * cp)
            if n % (tp * ep * cp):
                continue
            for pp in (d for d in range(1, min(MAX_PP, rest, model.layers) + 1) if rest % d == 0):
                dp = rest // pp
                schedules = SEARCHED_SCHEDULES if pp > 1 else (("1f1b", 1),)
                zeros = (1, 3) if dp * cp > 1 else (0,)
                for (schedule, v), mb, rc, zero in itertools.product(
                        schedules, MICRO_BATCHES[:3], SEARCHED_RECOMPUTE, zeros):
                    o = Options(dp, tp, ep, "heads", tp > 1 and model.experts == 1, rc, zero, mb,
                                pp=pp, cp=cp, schedule=schedule, virtual_stages=v)
                    if layout_problem(model, cluster, o) is None:
                        out.append(o)
    return out


def train_problem(model, o: Options) -> str | None:
    """Why ``train`` cannot run layout ``o`` of ``model`` (:mod:`.runnable`, the rule ``train``
    checks its options with): the search proposes only layouts it can run."""
    return runtime_problem(tp=o.tp, dp=o.dp, ep=o.ep, pp=o.pp, cp=o.cp, attention=o.attention,
                           sequence_parallel=o.sequence_parallel, recompute=o.recompute,
                           zero_stage=o.zero_stage, experts=model.experts, seq=model.seq,
                           model=model.name)


def params_per_gpu(model, o: Options) -> float:
    """Parameters one GPU holds before ZeRO: the dense ones over ``tp``, the experts over ``tp ×
    ep``; with ``pp`` stages the largest stage's, ``⌈layers/pp⌉`` layers and one ``V × h``
    matrix (the first stage's embedding or the last one's head, each stage keeping its copy
    when they are tied, as Megatron does)."""
    expert = model.params() - model.active_params() if model.experts > 1 else 0
    dense = model.params() - expert  # attention, embeddings, norms, shared parts
    if o.pp > 1:
        embeddings = model.vocab * model.hidden * (1 if model.tie_embeddings else 2)
        share = stage_layers(model.layers, o.pp) / model.layers
        dense = (dense - embeddings) * share + model.vocab * model.hidden
        expert = expert * share
    return dense / o.tp + expert / (o.tp * o.ep)


def _largest_unit(model, o: Options) -> float:
    """Parameters per GPU of the largest unit ZeRO-3 gathers at once: a layer or the LM head."""
    embeddings = 1 if model.tie_embeddings or o.pp > 1 else 2
    per_layer = (params_per_gpu(model, o) - model.vocab * model.hidden / o.tp
                 * embeddings) / stage_layers(model.layers, o.pp)
    return max(per_layer, model.vocab * model.hidden / o.tp)


def memory(model, o: Options, bytes_per_element: int, attention_kernel: str = "fused",
           loss_kernel: str = "fused") -> dict:
    """Peak bytes of live tensors per GPU by part (``params``, ``grads``, ``optimizer``,
    ``activations``).

    Activations: the layers' (:func:`activation_bytes_per_layer`), one layer's recomputed
    tensors while its backward runs, and the logits' working set (:func:`logits_bytes`). ZeRO-3
    also holds the gathered 16-bit parameters of the running and the prefetched unit and one
    unit's gradients, with the buffer FSDP reduce-scatters them from, in the reduce dtype
    (:data:`~.timing.GRAD_REDUCE_BYTES`: FSDP2 copies a unit's gradients into one fp32 buffer).
    Under pipelining (``pp > 1``) FSDP keeps the whole stage's parameters gathered and its
    gradients unsharded across the micro-batches (torchtitan: no reshard after forward with
    pp; the pipeline schedule syncs gradients on the last micro-batch only): ZeRO-3 then holds
    the stage's 16-bit weights and gradients whole, plus one unit's reduce buffer. A caching allocator reserves more than this peak (fragmentation; the
    published runs that report reserved memory show about 5 % more, docs/planner.md)."""
    states = model_state_bytes(params_per_gpu(model, o), o.zero_stage, o.dp * o.cp,
                               bytes_per_element)
    # o is the layout and the options; context parallelism keeps 1/cp of every activation
    shape = dict(batch=o.micro_batch, seq=model.seq, bytes_per_element=bytes_per_element,
                 attention_kernel=attention_kernel)
    kept = activation_bytes_per_layer(model, o, o, **shape)
    rebuilt = (activation_bytes_per_layer(model, o, CostOptions.of(o, recompute="none"), **shape)
               - kept if o.recompute != "none" else 0.0)
    seq = model.seq // o.cp
    logits = logits_bytes(o.micro_batch * seq, model.vocab, o.tp, bytes_per_element, loss_kernel)
    layers = stage_layers(model.layers, o.pp)
    micro_steps = max(1, model.global_batch // (o.dp * o.micro_batch))
    in_flight = in_flight_micro_batches(o.schedule, o.pp, micro_steps, o.virtual_stages)
    if o.pp == 1:
        act = model.layers * kept + rebuilt + logits
    else:  # the first stage's in-flight micro-batches, or the last one's one and its logits
        act = max(layers * kept * in_flight, layers * kept + logits) + rebuilt
    if o.zero_stage == 3 and o.pp > 1:  # FSDP under pipelining: the whole stage gathered
        stage = params_per_gpu(model, o)
        states["params"] += stage * bytes_per_element
        states["grads"] += stage * bytes_per_element + _largest_unit(model, o) * GRAD_REDUCE_BYTES
    elif o.zero_stage == 3:  # the running and the prefetched unit, one unit's gradients
        unit = _largest_unit(model, o)  # and their reduce-scatter input in the reduce dtype
        states["params"] += 2 * unit * bytes_per_element
        states["grads"] += unit * (bytes_per_element + GRAD_REDUCE_BYTES)
    return {**states, "activations": act}


def peak_flops(model, cluster) -> float:
    gpu = cluster.gpu
    return {"bf16": gpu.bf16_flops, "fp16": gpu.fp16_flops, "fp32": gpu.fp32_flops}[model.dtype]


def step_time(model, cluster, o: Options, peak: float, run: Execution | None = None):
    """Predicted step time and its parts (:func:`.timing.step_time`)."""
    run = run or execution(cluster)[0]
    return _step_time(model, cluster, o, run, peak, params_per_gpu(model, o))


def evaluate(model, cluster, o: Options, run: Execution | None = None) -> dict:
    """One candidate in the planner's JSON schema."""
    run = run or execution(cluster)[0]
    mem = memory(model, o, model.bytes_per_element(), run.attention_kernel, run.loss_kernel)
    total = sum(mem.values())
    peak = peak_flops(model, cluster)
    t = step_time(model, cluster, o, peak, run)
    tokens = model.global_batch * model.seq
    model_flops = model.flops_per_token() * tokens
    denominator = t["step_time_s"] * cluster.count * peak
    return {"dp": o.dp, "tp": o.tp, "ep": o.ep, "pp": o.pp, "cp": o.cp, "schedule": o.schedule,
            "virtual_stages": o.virtual_stages, "cp_strategy": o.cp_strategy,
            "attention": o.attention,
            "ffn": "experts" if model.experts > 1 else "column_row",
            "sequence_parallel": o.sequence_parallel, "recompute": o.recompute,
            "zero_stage": o.zero_stage, "micro_batch": o.micro_batch,
            "fits": total <= cluster.gpu.memory_bytes, "memory_per_gpu_bytes": total,
            "memory_breakdown": mem, "step_time_s": t["step_time_s"],
            "comm_bytes_per_step": t["comm_bytes_per_step"],
            "mfu": model_flops / denominator,
            "hfu": (model_flops + cluster.count * t["recompute_flops"]) / denominator,
            "tokens_per_s_per_gpu": tokens / (t["step_time_s"] * cluster.count),
            "micro_steps": t["micro_steps"], "dp_comm": t["dp_comm"], "execution": asdict(run),
            "train_problem": train_problem(model, o),
            "time_breakdown": {k: v for k, v in t.items() if k.endswith("_s")
                               and k != "step_time_s"}}


def evaluate_layout(model, cluster, o: Options, run: Execution | None = None) -> dict:
    """Exactly layout ``o``: its candidate row, plus ``"problems"`` (why it cannot run: sizes
    that do not divide, or the memory it needs against the GPU's) — empty when it can."""
    problem = layout_problem(model, cluster, o)
    if problem:
        raise ValueError(problem)
    row = evaluate(model, cluster, o, run)
    problems = []
    if not row["fits"]:
        parts = ", ".join(f"{k} {_gb(v)}" for k, v in row["memory_breakdown"].items())
        problems.append(f"needs {_gb(row['memory_per_gpu_bytes'])} per GPU ({parts}) but one "
                        f"{cluster.gpu.name} has {_gb(cluster.gpu.memory_bytes)}")
    return {**row, "problems": problems, "train_problem": train_problem(model, o)}


def search(model, cluster, *, top: int = 10, run: Execution | None = None,
           runnable_only: bool = True) -> dict:
    """``{"model", "cluster", "candidates", "best", "advice"}``: candidates that fit, fastest
    first (TP kept inside a node unless nothing else fits); when none fits, the smallest ones.
    ``runnable_only`` (the default, what ``train --plan`` runs) searches ``dp × cp × tp × ep``;
    ``False`` also pipeline parallelism (``plan --all-layouts``), whose layouts ``train --plan``
    refuses for now (each row's ``train_problem`` says why)."""
    run = run or execution(cluster)[0]
    options = candidates(model, cluster, runnable_only=runnable_only)
    if not runnable_only:  # many layouts: time only those that fit (and the smallest otherwise)
        size = model.bytes_per_element()
        sized = [(sum(memory(model, o, size, run.attention_kernel, run.loss_kernel).values()), o)
                 for o in options]
        fitting = [o for m, o in sized if m <= cluster.gpu.memory_bytes]
        options = fitting or [o for _, o in sorted(sized, key=lambda x: x[0])[:top]]
    rows = [evaluate(model, cluster, o, run) for o in options]
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
    out = {"model": model.to_dict(), "cluster": cluster.to_dict(), "candidates": shown,
           "best": best, "advice": advice(model, cluster, best, rows)}
    if not runnable_only:
        out["layouts"] = "dp × pp × cp × tp × ep (pp does not run from a plan in train yet)"
    return out


LAYOUT_KEYS = {"tp", "dp", "attention"}


def is_planner_output(data) -> bool:
    """Whether ``data`` is what :func:`search` returns (``plan --out``) or one of its rows."""
    return isinstance(data, dict) and (("best" in data and "candidates" in data)
                                       or LAYOUT_KEYS <= set(data))


def chosen_layout(data) -> dict:
    """The one reader of a planner result: the layout it chose (its ``best``, or the row itself)
    as ``{"tp", "dp", "ep", "attention", "sequence_parallel", "recompute", "zero_stage", "pp",
    "cp", "cp_strategy"}``, and for a pipelined layout (``pp > 1``) its ``"pp_schedule"``,
    ``"stages_per_rank"`` (the plan's virtual stages) and ``"micro_batch"`` (sequences per
    pipeline micro-batch). ``ValueError`` when nothing fits (``best`` is null), ``data`` is not
    a planner result, or the layout is one ``train`` cannot run
    (:func:`.runnable.runtime_problem`'s one-line reason)."""
    if isinstance(data, dict) and "best" in data:
        if data["best"] is None:
            raise ValueError("the planner found no layout that fits (its 'best' is null)")
        data = data["best"]
    if not (isinstance(data, dict) and LAYOUT_KEYS <= set(data)):
        raise ValueError("not a planner result: it has neither a 'best' layout nor 'tp', 'dp' "
                         "and 'attention'")
    pp, cp = int(data.get("pp", 1)), int(data.get("cp", 1))
    piped = {}
    if pp > 1:
        problem = runtime_problem(tp=data["tp"], dp=data["dp"], ep=data.get("ep", 1), pp=pp,
                                  cp=cp, zero_stage=data.get("zero_stage", 0))
        if problem:
            raise ValueError(problem)
        schedule = data.get("schedule", "1f1b")
        if schedule not in SCHEDULES:
            raise ValueError(f"the plan's schedule must be one of {SCHEDULES}, got "
                             f"{schedule!r}")
        piped = {"pp_schedule": schedule, "stages_per_rank": int(data.get("virtual_stages", 1)),
                 "micro_batch": data.get("micro_batch")}
    strategy = data.get("cp_strategy", "ring") if cp > 1 else "auto"
    if cp > 1 and strategy not in CP_STRATEGIES:
        raise ValueError(f"the plan's cp_strategy must be one of {CP_STRATEGIES}, got "
                         f"{strategy!r}")
    return {"tp": data["tp"], "dp": data["dp"], "ep": data.get("ep", 1),
            "attention": data["attention"],
            "sequence_parallel": bool(data.get("sequence_parallel", False)),
            "recompute": data.get("recompute", "none"), "zero_stage": data.get("zero_stage", 0),
            "pp": pp, "cp": cp, "cp_strategy": strategy, **piped}


def _gb(x: float) -> str:
    return f"{x / 1e9:,.1f} GB" if x < 1e12 else f"{x / 1e12:,.2f} TB"


def advice(model, cluster, best, rows) -> str:
    """A sentence on the chosen plan, or — when nothing fits — what would, with numbers."""
    mem = cluster.gpu.memory_bytes
    if best is not None:
        tight = (" Within 5% of the capacity: the caching allocator's fragmentation (about 5% "
                 "in the published runs, docs/planner.md) may not fit; the next candidate leaves "
                 "more room." if best["memory_per_gpu_bytes"] > 0.95 * mem else "")
        four_d = (f" × pp={best['pp']} ({best['schedule']}) × cp={best['cp']}"
                  if best.get("pp", 1) > 1 or best.get("cp", 1) > 1 else "")
        return (f"dp={best['dp']} × tp={best['tp']} × ep={best['ep']}{four_d}, attention="
                f"{best['attention']}, ZeRO-{best['zero_stage']}, recompute={best['recompute']}, "
                f"sequence_parallel={best['sequence_parallel']}, micro-batch "
                f"{best['micro_batch']}: {best['step_time_s']:.3g} s/step predicted, MFU "
                f"{best['mfu']:.0%}, {_gb(best['memory_per_gpu_bytes'])} of {_gb(mem)} per GPU."
                + tight + (f" Not runnable by train yet: {best['train_problem']}."
                           if best.get("train_problem") else ""))
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
