"""One TP=1 Transformer block, forward + backward at bf16 on one GPU: achieved FLOP/s (for ``make
gpu-check``; it adds MFU against the catalogue's peak).

The block is the reference GPT's (``models/gpt.py``: pre-LayerNorm, causal attention, GELU MLP)
after ``parallelize`` on a one-rank context, hidden 4096, 32 heads, FFN 16384, sequence 2048,
batch 1, weights in fp32 under bf16 autocast (what ``train --precision bf16`` runs). FLOPs per
step: forward ``24·s·h² + 4·s²·h`` (the GEMMs and both attention matmuls, counted without the
causal half, as Megatron-LM's MFU does), backward twice that. Timed with CUDA events over
``--steps`` steps after ``--warmup``; prints one JSON object.
"""

from __future__ import annotations

import argparse
import json

import torch

from ops_transformer import parallelize
from ops_transformer.models.gpt import GPT, GPTConfig
from ops_transformer.parallel.context import ParallelContext


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_block: no GPU is visible")
    device = torch.device("cuda", torch.cuda.current_device())
    h, s = args.hidden, args.seq
    cfg = GPTConfig(vocab_size=256, n_layers=1, d_model=h, n_heads=args.heads, d_ff=4 * h,
                    max_seq_len=s)
    ctx = ParallelContext.single(device)
    model = parallelize(GPT(cfg).to(device), ctx)
    block = model.layers[0]
    x = torch.randn(1, s, h, device=device, requires_grad=True)
    grad = torch.randn(1, s, h, device=device)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = block(x)
        y.backward(grad)
        block.zero_grad(set_to_none=True)
        x.grad = None

    for _ in range(args.warmup):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(args.steps):
        step()
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / args.steps
    flops = 3 * (24 * s * h * h + 4 * s * s * h)
    print(json.dumps({"hidden": h, "seq": s, "heads": args.heads, "step_ms": seconds * 1e3,
                      "flops_per_step": flops, "achieved_flops": flops / seconds,
                      "achieved_tflops": flops / seconds / 1e12,
                      "max_memory_allocated": torch.cuda.max_memory_allocated(device)}))


if __name__ == "__main__":
    main()
