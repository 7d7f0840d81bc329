"""One TP=1 Transformer block, forward + backward at bf16 on one GPU: achieved FLOP/s (for ``make
gpu-check``; it adds MFU against the catalogue's peak).

The block is the reference GPT's (``models/gpt.py``: pre-LayerNorm, causal attention, GELU MLP)
after ``parallelize`` on a one-rank context, hidden 4096, 32 heads, FFN 16384, sequence 2048,
batch 1, weights in fp32 under bf16 autocast (what ``train --precision bf16`` runs). FLOPs per
step: forward ``24·s·h² + 4·s²·h`` (the GEMMs and both attention matmuls, counted without the
causal half, as Megatron-LM's MFU does), backward twice that. Timed with CUDA events over
``--steps`` steps after ``--warmup``; prints one JSON object.

``--methods eager,compiled,compiled_fp8`` times the block eager, under
``torch.compile(fullgraph=True)`` (``--backend``, default ``inductor``; the compile is paid in the
warm-up, its seconds reported) and compiled with its linear layers in fp8 (``precision="fp8"``:
tensorwise dynamic e4m3 scales through ``torch._scaled_mm``, the e5m2 backward; the FLOPs counted
are the same): per method ``step_ms``, ``tokens_per_s`` and ``achieved_tflops`` (``make
gpu-check``'s ``block_compile`` section adds MFU), and ``compiled/eager``,
``compiled_fp8/eager``. The top-level figures stay the first
method's. ``--device cpu`` with small sizes (``--hidden 64 --heads 4 --seq 32``) runs the same
script where no GPU is (timed with ``perf_counter``; what the test suite does).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from ops_transformer import parallelize
from ops_transformer.models.gpt import GPT, GPTConfig
from ops_transformer.parallel.context import ParallelContext


METHODS = ("eager", "compiled", "fp8", "compiled_fp8")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--methods", default="eager", help=f"comma-separated, from {METHODS}")
    p.add_argument("--backend", default="inductor", help="torch.compile backend of 'compiled'")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: a smoke run with small sizes (no GPU needed)")
    args = p.parse_args(argv)
    methods = args.methods.split(",")
    if [m for m in methods if m not in METHODS]:
        p.error(f"--methods: choose from {METHODS}, got {args.methods!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_block: no GPU is visible")
    device = (torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda"
              else torch.device("cpu"))
    h, s = args.hidden, args.seq
    flops = 3 * (24 * s * h * h + 4 * s * s * h)
    results = {m: time_block(m, args, device) for m in methods}
    for r in results.values():
        r.update(achieved_flops=flops / r["step_s"], achieved_tflops=flops / r["step_s"] / 1e12,
                 tokens_per_s=s / r["step_s"], step_ms=r["step_s"] * 1e3)
    first = results[methods[0]]
    out = {"hidden": h, "seq": s, "heads": args.heads, "device": device.type,
           "step_ms": first["step_ms"], "flops_per_step": flops,
           "achieved_flops": first["achieved_flops"], "achieved_tflops": first["achieved_tflops"],
           "methods": results}
    for other in ("compiled", "fp8", "compiled_fp8"):
        if "eager" in results and other in results:
            out[f"{other}/eager"] = results[other]["step_s"] / results["eager"]["step_s"]
    if device.type == "cuda":
        out["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
    print(json.dumps(out))


def time_block(method: str, args, device) -> dict:
    """``{"step_s", "warmup_s"}`` of forward + backward of a fresh block (bf16 autocast)."""
    h, s = args.hidden, args.seq
    cfg = GPTConfig(vocab_size=256, n_layers=1, d_model=h, n_heads=args.heads, d_ff=4 * h,
                    max_seq_len=s)
    torch.manual_seed(0)
    ctx = ParallelContext.single(device)
    model = parallelize(GPT(cfg).to(device), ctx, compile=method.startswith("compiled"),
                        compile_backend=args.backend,
                        precision="fp8" if method.endswith("fp8") else "fp32")
    block = model.layers[0]
    x = torch.randn(1, s, h, device=device, requires_grad=True)
    grad = torch.randn(1, s, h, device=device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y = block(x)
        y.backward(grad)
        block.zero_grad(set_to_none=True)
        x.grad = None

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
    sync()
    warmup_s = time.perf_counter() - t0
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.steps):
            step()
        end.record()
        sync()
        return {"step_s": start.elapsed_time(end) / 1e3 / args.steps, "warmup_s": warmup_s}
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    return {"step_s": (time.perf_counter() - t0) / args.steps, "warmup_s": warmup_s}


if __name__ == "__main__":
    main()
