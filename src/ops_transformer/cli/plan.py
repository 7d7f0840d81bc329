"""``ops-transformer plan``: which layout to run, how fast and in how much memory — before any GPU
hour is spent. ``--tp/--dp/...`` evaluate one layout exactly as given; ``--published`` checks the
planner against published training runs; ``--validate`` against runs on this machine."""

from __future__ import annotations

import json
from pathlib import Path

from ..comm.topology import detect_topology
from ..planner import catalogue
from ..planner.efficiency import STACKS
from ..planner.local import local_cluster, local_profile
from ..planner.memory import ATTENTION_KERNELS, LOSS_KERNELS, RECOMPUTE
from ..planner.cp_exchange import CP_STRATEGIES
from ..planner.pipeline import SCHEDULES
from ..planner.published import print_report, print_validation
from ..planner.timing import MATMUL_PRECISIONS
from ..planner.search import Options, evaluate_layout, execution, layout_problem, search
from ..planner.specs import ClusterSpec, ModelSpec
from ..planner.strategies import ATTENTION_STRATEGIES
from ..profiler.validate import run_validation
from ..utils.progress import format_table
from ._common import check_out_file
from ._calibrated import command_profile

HELP = "predict step time and memory of every dp × tp × ep (× pp × cp) layout and pick the best"
LAYOUT_FLAGS = ("tp", "dp", "ep", "zero", "recompute", "sequence_parallel", "micro_batch",
                "attention", "pp", "cp", "schedule", "virtual_stages", "cp_strategy")


def add_parser(p) -> None:
    p.add_argument("--model", help="a preset (gpt3-175b, llama3-70b, ...), a Hugging Face "
                   "config directory, or a ModelSpec / GPTConfig JSON file")
    p.add_argument("--gpu", default="a100-80gb", help="GPU type from the catalogue, or 'local' "
                   "for this machine's CPU ranks")
    p.add_argument("--gpus", type=int, help="number of GPUs (default 8; with a forced layout, "
                   "tp × dp × ep)")
    p.add_argument("--gpus-per-node", type=int, help="default: the GPU type's usual node")
    p.add_argument("--intra", help="link inside a node (default: the GPU type's)")
    p.add_argument("--inter", default="ib-ndr", help="one NIC between nodes (default ib-ndr)")
    p.add_argument("--nics-per-node", type=int, help="NICs per node (default: one per GPU)")
    p.add_argument("--seq", type=int, help="sequence length (default: the model's)")
    p.add_argument("--batch", type=int, help="global batch in sequences (default: the model's)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="default: the model's")
    p.add_argument("--attention-kernel", choices=ATTENTION_KERNELS, default="fused",
                   help="fused (flash / memory-efficient SDPA: no attention scores kept) or "
                   "eager (scores kept for backward); default fused")
    p.add_argument("--loss-kernel", choices=LOSS_KERNELS, default="fused",
                   help="fused cross-entropy on 16-bit logits, or fp32 (up-cast logits); "
                   "default fused")
    p.add_argument("--efficiency", type=float, help="achieved fraction of the GPU's dense peak "
                   "on the matmuls (default: calibrated on this GPU, else the GPU's published "
                   "figure, see docs/planner.md)")
    p.add_argument("--stack", choices=STACKS, help="the training software, for its published "
                   "efficiency")
    g = p.add_argument_group("forced layout (evaluate exactly this layout)")
    g.add_argument("--tp", type=int, help="tensor-parallel degree")
    g.add_argument("--dp", type=int, help="data-parallel degree")
    g.add_argument("--ep", type=int, help="expert-parallel degree")
    g.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="ZeRO stage")
    g.add_argument("--recompute", choices=RECOMPUTE, help="activation recomputation")
    g.add_argument("--sequence-parallel", action="store_true", default=None,
                   help="sequence parallelism (needs --tp > 1)")
    g.add_argument("--micro-batch", type=int, help="sequences per forward pass (default 1)")
    g.add_argument("--attention", choices=ATTENTION_STRATEGIES, help="attention strategy "
                   "(default heads)")
    g.add_argument("--pp", type=int, help="pipeline stages (priced; train --plan runs them: "
                   "docs/pipeline.md)")
    g.add_argument("--cp", type=int, help="context-parallel ranks (priced; train does not run "
                   "cp > 1 yet)")
    g.add_argument("--schedule", choices=SCHEDULES, help="pipeline schedule (default 1f1b)")
    g.add_argument("--virtual-stages", type=int, help="model chunks per pipeline stage "
                   "(interleaved; zbv runs 2; default 1)")
    g.add_argument("--cp-strategy", choices=CP_STRATEGIES, help="context parallelism's K/V "
                   "exchange (default ring)")
    p.add_argument("--matmul-precision", choices=MATMUL_PRECISIONS, default="default",
                   help="float8: the layers' projections on the FP8 peak (torchtitan's Float8 "
                   "linears); default: the model's dtype")
    p.add_argument("--all-layouts", action="store_true", help="search pipeline and context "
                   "parallelism too (dp × pp × cp × tp × ep); such plans do not run in train yet")
    p.add_argument("--top", type=int, default=10, help="candidates to show (default 10)")
    p.add_argument("--json", action="store_true", help="print the full result as JSON")
    p.add_argument("--out", help="also write the result as JSON (its 'best' is a plan that "
                   "'train --plan' and parallelize accept)")
    p.add_argument("--published", action="store_true", help="compare the planner with the "
                   "published training runs it ships (docs/planner.md)")
    p.add_argument("--fit", action="store_true", help="with --published: fit the constants on "
                   "the 'fit' rows again and print them")
    p.add_argument("--validate-published", action="store_true", help="per published run the "
                   "predicted and measured step time, the held-out median, and for runs with "
                   "pipeline or context parallelism the layout the planner would choose")
    p.add_argument("--validate", action="store_true", help="run reference-GPT configurations on "
                   "local ranks and compare predicted with measured step time and communication")


def _positive(args, *names) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def _named(flag: str, value, call):
    """``call()``, with a ValueError's message led by the flag the user typed."""
    try:
        return call()
    except ValueError as exc:
        text = str(exc)
        raise ValueError(text if text.startswith("--") else f"{flag} {value}: {text}") from None


def _cluster(args, gpus: int) -> ClusterSpec:
    if args.gpu == "local":
        return local_cluster(gpus, command_profile("--gpu local"), topology=detect_topology())
    card = _named("--gpu", args.gpu, lambda: catalogue.gpu(args.gpu))
    for flag, name in (("--intra", args.intra), ("--inter", args.inter)):
        if name:
            _named(flag, name, lambda: catalogue.link(name))
    per_node = args.gpus_per_node or card.gpus_per_node
    if gpus > per_node and gpus % per_node:
        where = "--gpus-per-node" if args.gpus_per_node else f"the {card.name}'s usual node"
        raise ValueError(f"--gpus ({gpus}) must be a multiple of {where} ({per_node} GPUs) when "
                         f"it spans several nodes")
    cluster = ClusterSpec.make(args.gpu, gpus, args.gpus_per_node, args.intra, args.inter,
                               args.nics_per_node)
    return cluster


def _model(args) -> ModelSpec:
    if not args.model:
        raise ValueError("--model is required (a preset, a Hugging Face config directory or a "
                         "ModelSpec / GPTConfig JSON file)")
    spec = _named("--model", args.model, lambda: ModelSpec.load(args.model))
    changes = {k: v for k, v in (("seq", args.seq), ("global_batch", args.batch),
                                 ("dtype", args.dtype)) if v is not None}
    if changes:
        spec = spec.with_(**changes, micro_batch=1)
    return spec


def _forced(args) -> bool:
    return any(getattr(args, f) is not None for f in LAYOUT_FLAGS)


def _layout(args, model: ModelSpec) -> tuple[Options, int]:
    """The forced layout and the GPU count, every inconsistency named by its flags."""
    tp, ep, mb = args.tp or 1, args.ep or 1, args.micro_batch or 1
    pp, cp = args.pp or 1, args.cp or 1
    model_parallel = tp * ep * pp * cp
    names = "--tp × --ep" + (" × --pp × --cp" if pp * cp > 1 else "")
    sizes = f"{tp} × {ep}" + (f" × {pp} × {cp}" if pp * cp > 1 else "")
    if args.dp is not None:
        gpus = model_parallel * args.dp
        if args.gpus is not None and args.gpus != gpus:
            if pp * cp == 1:
                raise ValueError(f"--tp × --dp × --ep = {tp} × {args.dp} × {ep} = {gpus}, but "
                                 f"--gpus is {args.gpus}")
            raise ValueError(f"{names} × --dp = {sizes} × {args.dp} = {gpus}, but --gpus is "
                             f"{args.gpus}")
        dp = args.dp
    else:
        gpus = args.gpus or 8
        if gpus % model_parallel:
            raise ValueError(f"--gpus ({gpus}) is not divisible by {names} ({sizes})")
        dp = gpus // model_parallel
    if model.global_batch % (dp * mb):
        raise ValueError(f"--batch ({model.global_batch}) must be a multiple of --dp × "
                         f"--micro-batch ({dp} × {mb} = {dp * mb})")
    if args.sequence_parallel and tp == 1:
        raise ValueError("--sequence-parallel needs --tp > 1")
    if args.zero and dp * cp == 1:
        raise ValueError(f"--zero {args.zero} shards over the data-parallel ranks, but --dp is 1")
    if model.experts % ep:
        raise ValueError(f"--ep ({ep}) must divide the model's {model.experts} experts")
    if model.ffn % tp:
        raise ValueError(f"--tp ({tp}) must divide the model's FFN width ({model.ffn})")
    o = Options(dp=dp, tp=tp, ep=ep, attention=args.attention or "heads",
                sequence_parallel=bool(args.sequence_parallel),
                recompute=args.recompute or "none", zero_stage=args.zero or 0, micro_batch=mb,
                pp=pp, cp=cp, schedule=args.schedule or "1f1b",
                virtual_stages=args.virtual_stages or (2 if args.schedule == "zbv" else 1),
                cp_strategy=args.cp_strategy or "ring")
    return o, gpus


def _efficiency(args, cluster) -> tuple[float | None, str | None]:
    """``--efficiency``, else a calibration of this very GPU type (``calibrate`` on a GPU)."""
    if args.efficiency is not None:
        if not 0.0 < args.efficiency <= 1.0:
            raise ValueError(f"--efficiency must be in (0, 1] (a fraction of the dense peak), "
                             f"got {args.efficiency}")
        return args.efficiency, "--efficiency"
    if args.stack is None and cluster.gpu.vendor != "cpu":
        measured = getattr(local_profile(command_profile(None)), "gpu_efficiency", {}) or {}
        if cluster.gpu.name in measured:
            return measured[cluster.gpu.name], f"calibrated on this machine's {cluster.gpu.name}"
    return None, None


def table(result: dict) -> str:
    four_d = any(c.get("pp", 1) > 1 or c.get("cp", 1) > 1 for c in result["candidates"])
    rows = [{"dp": c["dp"], "tp": c["tp"], "ep": c["ep"],
             **({"pp": c["pp"], "cp": c["cp"], "schedule": c["schedule"] if c["pp"] > 1 else ""}
                if four_d else {}),
             "attention": c["attention"],
             "SP": "yes" if c["sequence_parallel"] else "", "recompute": c["recompute"],
             "ZeRO": c["zero_stage"], "mb": c["micro_batch"],
             "GB/GPU": round(c["memory_per_gpu_bytes"] / 1e9, 1), "fits": "yes" if c["fits"]
             else "NO", "s/step": round(c["step_time_s"], 4), "MFU": f"{c['mfu']:.0%}"}
            for c in result["candidates"]]
    return format_table(rows)


def _header(result: dict) -> str:
    m, c = result["model"], result["cluster"]
    e = (result["candidates"] or [{}])[0].get("execution", {})
    return (f"{m['name']}: {m['layers']} layers, hidden {m['hidden']}, seq {m['seq']}, global "
            f"batch {m['global_batch']}, {m['dtype']} on {c['count']} × {c['gpu']['name']} "
            f"({c['gpus_per_node']} per node); {e['attention_kernel']} attention, "
            f"{e['loss_kernel']} loss, matmul efficiency {e['efficiency']:.3g} "
            f"({e['efficiency_source']})\n")


def run(args) -> int:
    if args.validate:
        return run_validation(local_profile(command_profile("--validate")), json_output=args.json)
    if args.validate_published:
        return print_validation(by_stack=args.stack is not None, json_output=args.json)
    if args.published or args.fit:
        return print_report(refit=args.fit, by_stack=args.stack is not None, json_output=args.json)
    _positive(args, "top", "gpus", "gpus_per_node", "nics_per_node", "seq", "batch", "tp", "dp",
              "ep", "micro_batch", "pp", "cp", "virtual_stages")
    if args.out:
        check_out_file(args.out)
    model = _model(args)
    forced = _forced(args)
    layout, gpus = _layout(args, model) if forced else (None, args.gpus or 8)
    cluster = _cluster(args, gpus)
    value, source = _efficiency(args, cluster)
    run_, found = _named("--matmul-precision", args.matmul_precision, lambda: execution(
        cluster, attention_kernel=args.attention_kernel, loss_kernel=args.loss_kernel,
        efficiency=value, stack=args.stack, matmul_precision=args.matmul_precision))
    if forced:
        problem = layout_problem(model, cluster, layout)
        if problem:
            flags = f"--tp {layout.tp} --attention {layout.attention}" + (
                f" --pp {layout.pp} --cp {layout.cp}" if layout.pp * layout.cp > 1 else "")
            raise ValueError(f"{flags}: {problem}")
        row = evaluate_layout(model, cluster, layout, run_)
        result = {**row, "model": model.to_dict(), "cluster": cluster.to_dict(),
                  "layout": row, "candidates": [row],
                  "best": row if row["fits"] else None,
                  "advice": "fits" if row["fits"] else "does not fit: " + "; ".join(
                      row["problems"])}
    else:
        result = _named("--gpus", gpus, lambda: search(model, cluster, top=args.top, run=run_,
                                                      runnable_only=not args.all_layouts))
    for row in result["candidates"]:
        row["execution"]["efficiency_source"] = source or found
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(_header(result))
    print(table(result))
    if forced:
        t = result["time_breakdown"]
        print("\n" + ", ".join(f"{k[:-2]} {v:.3g} s" for k, v in t.items() if v))
        print(f"\n{'fits' if result['fits'] else 'DOES NOT FIT'}: {result['step_time_s']:.3g} "
              f"s/step predicted, MFU {result['mfu']:.0%}, "
              f"{result['memory_per_gpu_bytes'] / 1e9:.1f} GB per GPU"
              + ("" if result["fits"] else f" — {'; '.join(result['problems'])}"))
        if result.get("train_problem"):
            print(f"train cannot run this layout as written: {result['train_problem']}")
        return 0
    print(f"\n{'best' if result['best'] else 'no plan fits'}: {result['advice']}")
    return 0
