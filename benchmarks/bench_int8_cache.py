"""The error the 8-bit activation cache adds: gradient error after one step, and the training loss
over N steps against the exact run (same seed, same data), for the reference presets.

    .venv/bin/python benchmarks/bench_int8_cache.py                 # 200 steps of tiny, ~1 min
    .venv/bin/python benchmarks/bench_int8_cache.py --steps 300 --preset llama-tiny --out runs/x

Prints the relative gradient error (global ‖Δg‖/‖g‖ and the worst parameter's max|Δg|/max|g|),
the activation bytes kept per layer with and without the cache, and the per-step loss difference;
writes both loss curves to ``<out>/int8-loss.png`` and the numbers to ``<out>/int8.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from ops_transformer import GPT, activation_memory, parallelize
from ops_transformer.models import preset
from ops_transformer.parallel import ParallelContext
from ops_transformer.training.loop import TrainConfig, train_worker
from ops_transformer.utils.plot import write_line_plot_png


def gradient_error(name: str, seq: int = 64, batch: int = 4) -> dict:
    grads, memory = [], []
    idx = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(0))
    for cache in ("none", "int8"):
        torch.manual_seed(0)
        model = parallelize(GPT(preset(name, max_seq_len=seq)), ParallelContext.single(),
                            activation_cache=cache)
        model(idx, idx)[1].backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
        memory.append(activation_memory(model, idx, idx)["per_layer"][-1])
    exact, approx = grads
    flat, flat8 = (torch.cat([g.flatten() for g in d.values()]) for d in (exact, approx))
    worst = max(((approx[n] - exact[n]).abs().max() / exact[n].abs().max()).item() for n in exact)
    return {"preset": name, "grad_rel_error": float((flat8 - flat).norm() / flat.norm()),
            "worst_param_rel_error": worst, "bytes_per_layer": memory[0],
            "bytes_per_layer_int8": memory[1]}


def loss_curves(name: str, steps: int, seq: int, batch: int) -> dict:
    runs = {}
    for cache in ("none", "int8"):
        cfg = TrainConfig(preset=name, steps=steps, seq=seq, batch=batch, progress=False,
                          sample_tokens=1, activation_cache=cache)
        runs[cache] = train_worker(cfg)["losses"]
    diff = [abs(a - b) / a for a, b in zip(runs["none"], runs["int8"])]
    return {"losses": runs, "max_rel_loss_diff": max(diff),
            "median_rel_loss_diff": statistics.median(diff),
            "final": {k: v[-1] for k, v in runs.items()},
            "mean_last_20": {k: statistics.fmean(v[-20:]) for k, v in runs.items()}}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out", default="runs/int8-cache")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    errors = [gradient_error(n) for n in ("tiny", "llama-tiny", "small")]
    for e in errors:
        print(f"{e['preset']:<11} gradient error after one step: ‖Δg‖/‖g‖ = "
              f"{e['grad_rel_error']:.2e}, worst parameter {e['worst_param_rel_error']:.2e}; "
              f"bytes/layer {e['bytes_per_layer']:,} -> {e['bytes_per_layer_int8']:,} "
              f"({e['bytes_per_layer_int8'] / e['bytes_per_layer']:.3f})")
    curves = loss_curves(args.preset, args.steps, args.seq, args.batch)
    print(f"{args.preset}, {args.steps} steps: loss {curves['losses']['none'][0]:.4f} -> exact "
          f"{curves['final']['none']:.4f}, int8 {curves['final']['int8']:.4f}; mean of the last "
          f"20: exact {curves['mean_last_20']['none']:.4f}, int8 "
          f"{curves['mean_last_20']['int8']:.4f}; per-step |Δloss|/loss: median "
          f"{curves['median_rel_loss_diff']:.2e}, max {curves['max_rel_loss_diff']:.2e}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_line_plot_png(out / "int8-loss.png", {"exact": curves["losses"]["none"],
                                                "int8 cache": curves["losses"]["int8"]},
                        title=f"{args.preset}: training loss, exact vs int8 activations")
    (out / "int8.json").write_text(json.dumps({"gradients": errors, "curves": curves}, indent=2))
    print(f"wrote {out / 'int8-loss.png'} and {out / 'int8.json'}")


if __name__ == "__main__":
    main()
