"""Memory per pipeline stage measured against the planner (docs/pipeline.md).

The reference GPT (``--layers`` layers of ``--d-model``, fp32) at pp 2 on 2 local gloo ranks, for
each schedule and micro-batch count: on each rank, the peak of the tensor storage one
``Pipeline.step`` creates (:class:`~ops_transformer.memory.allocations.AllocationTracker`, every
operation's new storage until it is freed: the activations autograd keeps, the gradients, the
boundary buffers and the temporaries), after a warm-up step and with the gradients set to
``None`` before it, so they count. Next to it the planner's figure for the same layout
(``planner.search.memory``: activations + gradients of the busiest stage — the first stage's
in-flight micro-batches, or the last stage's one with its logits, whichever is larger), with
the attention and loss kernels given (``--attention-kernel``, ``--loss-kernel``).

    .venv/bin/python benchmarks/bench_pipeline_memory.py
    .venv/bin/python benchmarks/bench_pipeline_memory.py --micro 2 4 8 --json out.json
"""

from __future__ import annotations

import argparse
import json

import torch

import ops_transformer as ot
from ops_transformer.memory.allocations import AllocationTracker
from ops_transformer.models.gpt import GPTConfig
from ops_transformer.planner.search import Options, memory
from ops_transformer.planner.specs import ModelSpec


def _cfg(args) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab, n_layers=args.layers, d_model=args.d_model,
                     n_heads=8, d_ff=4 * args.d_model, max_seq_len=args.seq)


def _measure(args, schedule: str, v: int, m: int) -> dict:
    """On one rank: the peak bytes one step creates, its gradients' bytes and its stages."""
    torch.set_num_threads(1)
    ctx = ot.init_parallel(pp=2)
    torch.manual_seed(0)
    model = ot.GPT(_cfg(args))
    pipe = ot.pipeline(model, ctx, schedule, microbatches=m, stages_per_rank=v)
    g = torch.Generator().manual_seed(0)
    idx, y = (torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in "xy")
    pipe.step(idx, y)  # warm-up: pipelining's first step also infers the boundary shapes
    model.zero_grad(set_to_none=True)
    with AllocationTracker("cpu") as tracker:
        pipe.step(idx, y)
    grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    return {"pp_rank": ctx.pp_rank, "peak_bytes": tracker.peak, "grad_bytes": grads,
            "stages": [f"{s.layer_ids.start}-{s.layer_ids.stop - 1}" for s in pipe.stages]}


def planned(args, schedule: str, v: int, m: int) -> dict:
    cfg = _cfg(args)
    spec = ModelSpec.from_gpt_config(cfg, seq=args.seq, global_batch=args.batch,
                                     micro_batch=args.batch // m, dtype="fp32")
    o = Options(1, 1, 1, "heads", False, "none", 0, args.batch // m, pp=2, schedule=schedule,
                virtual_stages=v)
    return memory(spec, o, 4, args.attention_kernel, args.loss_kernel)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved"])
    p.add_argument("--attention-kernel", default="fused", choices=["fused", "eager"])
    p.add_argument("--loss-kernel", default="fp32", choices=["fused", "fp32"])
    p.add_argument("--json")
    args = p.parse_args()
    rows = []
    for schedule in args.schedules:
        v = 2 if schedule == "interleaved" else 1
        for m in args.micro:
            ranks = sorted(ot.launch(_measure, 2, args, schedule, v, m),
                           key=lambda r: r["pp_rank"])
            plan = planned(args, schedule, v, m)
            predicted = plan["activations"] + plan["grads"]
            row = {"schedule": schedule, "v": v, "microbatches": m, "ranks": ranks,
                   "planner_activations_bytes": plan["activations"],
                   "planner_grads_bytes": plan["grads"], "planner_bytes": predicted}
            rows.append(row)
            measured = " / ".join(f"{r['peak_bytes'] / 2**20:6.2f}" for r in ranks)
            worst = max(r["peak_bytes"] for r in ranks)
            print(f"{schedule:12s} v={v} m={m}: peak per stage (MiB) {measured}; planner "
                  f"{predicted / 2**20:6.2f} (activations {plan['activations'] / 2**20:.2f} + "
                  f"grads {plan['grads'] / 2**20:.2f}); busiest / planner "
                  f"{worst / predicted:.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
