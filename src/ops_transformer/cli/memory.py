"""``ops-transformer memory``: what each memory technique saves and costs, measured on local ranks
(sequence parallelism, recompute, the int8 activation cache, ZeRO; SPEC F7)."""

from __future__ import annotations

from dataclasses import asdict

from ..profiler.memory_tradeoff import MemoryRun, check_run, memory_worker
from ..models.gpt import PRESETS
from ..launch import launch
from ..utils.progress import format_table
from ._common import (add_launch_timeout, launch_timeout, print_json, status, under_torchrun,
                      world_size)

HELP = "measure activation and optimizer memory and step time of each memory technique"


def add_parser(p) -> None:
    p.add_argument("--preset", default="small", help=f"model preset: {', '.join(PRESETS)} "
                   f"(default small)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (default 2)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel degree (default 1; 2+ adds "
                   "the ZeRO rows)")
    p.add_argument("--seq", type=int, help="sequence length (default: the preset's)")
    p.add_argument("--batch", type=int, default=4, help="global batch in sequences (default 4)")
    p.add_argument("--layers", type=int, help="override the preset's number of layers")
    p.add_argument("--dropout", type=float, help="dropout probability (default: the preset's, "
                   "0); above 0 the attention core stores its as² tensors, as Korthikanti et al. "
                   "assume")
    p.add_argument("--steps", type=int, default=5, help="timed training steps per technique, "
                   "interleaved (default 5, after one warm-up step)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    add_launch_timeout(p)


def _kib(value: float) -> str:
    return f"{value / 1024:,.1f}"


def table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        out.append({
            "technique": r["name"],
            "KiB/layer": _kib(r["bytes_per_layer"]),
            "formula KiB/layer": _kib(r["formula_bytes_per_layer"]),
            "measured/formula": round(r["bytes_per_layer"] / r["formula_bytes_per_layer"], 3),
            "activations KiB": _kib(r["activation_bytes"]),
            "saved": f"{r['activation_saving']:.1%}",
            "optimizer KiB": _kib(r["optimizer_state_bytes"]),
            "opt. saved": f"{r['optimizer_saving']:.1%}",
            "TP comm KiB/step": _kib(r.get("tp_comm_bytes_per_step", 0)),
            "step × plain": round(r["step_ratio"], 3),
        })
    return format_table(out)


def run(args) -> int:
    spec = MemoryRun(preset=args.preset, tp=args.tp, dp=args.dp, seq=args.seq, batch=args.batch,
                     steps=args.steps, layers=args.layers, dropout=args.dropout)
    if spec.preset not in PRESETS:
        raise ValueError(f"unknown preset {spec.preset!r}; choose one of {sorted(PRESETS)}")
    check_run(spec)
    timeout = launch_timeout(args)
    nprocs = spec.tp * spec.dp
    if under_torchrun():
        if world_size() != nprocs:
            raise ValueError(f"under torchrun the job has {world_size()} ranks, but --dp "
                             f"{spec.dp} × --tp {spec.tp} needs {nprocs}")
        rows = memory_worker(spec)
        if rows is None:  # not rank 0
            return 0
    else:
        status(f"memory: measuring each technique on {nprocs} local ranks ...")
        rows = launch(memory_worker, nprocs, spec, timeout=timeout)[0]
    if args.json:
        print_json({"run": asdict(spec), "rows": rows})
        return 0
    cfg = spec.model_config()
    print(f"{spec.preset} ({cfg.n_layers} layers, h {cfg.d_model}, {cfg.n_heads} heads, dropout "
          f"{cfg.dropout}) at dp={spec.dp} × tp={spec.tp}, {spec.batch // spec.dp} × "
          f"{spec.sequence} tokens per rank, fp32; bytes per rank. Formula: Korthikanti et al. "
          f"2022 per layer (16-bit figures × 2), which assumes eager attention (as² scores) "
          f"and dropout")
    print(table(rows))
    print(f"\nstep time: median of {spec.steps} interleaved steps each, relative to 'plain' "
          f"({rows[0]['step_s'] * 1e3:.1f} ms)")
    return 0
