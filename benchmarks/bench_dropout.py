"""The cost of dropout that matches one device (layers/dropout.py), on one process.

    .venv/bin/python benchmarks/bench_dropout.py                     # ~1 min
    .venv/bin/python benchmarks/bench_dropout.py --rounds 15 --json dropout.json

1. One rank's attention-probability mask, ``(b, a/tp, s, s)`` of a ``(b, a, s, s)`` tensor, at
   tp 1, 2 and 4, three ways: ``native`` — ``bernoulli_`` on the local tensor, what ``nn.Dropout``
   draws (not the one-device mask: the baseline cost); ``counter`` — ours, the counter-based hash
   of the one-device index of this rank's elements only; ``full+slice`` — draw the whole
   one-device mask from the shared generator and keep this rank's heads (the other exact way).
2. A training step of the reference GPT with dropout 0.1 at tp 1: ``parallelize`` (our masks and
   the explicit attention core) against the model as written (``nn.Dropout`` and SDPA's dropout).

Methods are interleaved round by round; each figure is the median over rounds of the per-round
ratio to the baseline. Quote ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ops_transformer import GPT, parallelize
from ops_transformer.layers.dropout import Layout, draw_seed, keep_mask
from ops_transformer.models import preset
from ops_transformer.parallel import ParallelContext

P = 0.1


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def mask_costs(b: int, a: int, s: int, rounds: int) -> list[dict]:
    rows = []
    for tp in (1, 2, 4):
        local = (b, a // tp, s, s)
        layout = Layout("heads", tp - 1, tp)  # the last rank: the largest offsets
        methods = {
            "native": lambda: torch.empty(local).bernoulli_(1 - P),
            "counter": lambda: keep_mask(draw_seed("cpu"), layout.index(local, "cpu"), P),
            "full+slice": lambda: (torch.rand(b, a, s, s) >= P)[:, (tp - 1) * (a // tp):],
        }
        ratios = {name: [] for name in methods}
        times = {name: [] for name in methods}
        for round_ in range(rounds + 1):
            measured = {name: _time(fn) for name, fn in methods.items()}
            if round_:  # the first round warms up
                for name, t in measured.items():
                    times[name].append(t)
                    ratios[name].append(t / measured["native"])
        rows.append({"tp": tp, "local_elements": b * (a // tp) * s * s,
                     **{f"{n}_ms": 1e3 * statistics.median(v) for n, v in times.items()},
                     **{f"{n}_x_native": statistics.median(v) for n, v in ratios.items()}})
    return rows


def step_cost(name: str, batch: int, seq: int, rounds: int) -> dict:
    cfg = preset(name, max_seq_len=seq, dropout=P)
    torch.manual_seed(0)
    dense = GPT(cfg)
    torch.manual_seed(0)
    ours = parallelize(GPT(cfg), ParallelContext.single())
    idx = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))

    def step(model):
        model(idx, idx)[1].backward()
        model.zero_grad(set_to_none=True)

    ratios, times = [], {"native": [], "ours": []}
    for round_ in range(rounds + 1):
        t_native, t_ours = _time(lambda: step(dense)), _time(lambda: step(ours))
        if round_:
            times["native"].append(t_native)
            times["ours"].append(t_ours)
            ratios.append(t_ours / t_native)
    return {"preset": name, "batch": batch, "seq": seq,
            "native_ms": 1e3 * statistics.median(times["native"]),
            "ours_ms": 1e3 * statistics.median(times["ours"]),
            "ours_x_native": statistics.median(ratios)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    masks = mask_costs(8, 8, 256, args.rounds)
    print("attention mask (b 8, a 8, s 256) of one rank, median ms and × native:")
    for r in masks:
        print(f"  tp {r['tp']}: native {r['native_ms']:.1f}  counter {r['counter_ms']:.1f} "
              f"({r['counter_x_native']:.2f}x)  full+slice {r['full+slice_ms']:.1f} "
              f"({r['full+slice_x_native']:.2f}x)")
    steps = [step_cost("tiny", 8, 128, args.rounds), step_cost("small", 4, 256, args.rounds)]
    for r in steps:
        print(f"training step {r['preset']} ({r['batch']}x{r['seq']}, dropout {P}): native "
              f"{r['native_ms']:.1f} ms, ours {r['ours_ms']:.1f} ms ({r['ours_x_native']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"masks": masks, "steps": steps}, f, indent=2)


if __name__ == "__main__":
    main()
