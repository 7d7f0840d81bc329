"""Sharded checkpoint save and load time and size (docs/checkpoints.md).

The reference GPT (default ``gpt2-124m``, fp32) with AdamW state after one step, on ``--tp`` local
gloo ranks. Interleaved round by round (order rotated):

* ``save``: :func:`save_checkpoint` — DCP write of each rank's chunks, fsync, SHA-256 of every
  file, manifest, rename, ``latest``;
* ``torch.save``: the baseline without any of the guarantees — each rank ``torch.save`` of its own
  model and optimizer ``state_dict`` to one file, fsynced (not reshardable, not verified, not
  atomic);
* ``load``: :func:`load_checkpoint` at the same layout (verification included), and ``verify``
  alone (every file re-hashed, shared by the ranks).

Then, in one process, ``load tp=1``: the same checkpoint resharded to a single rank. Sizes are the
bytes on disk. Times are wall seconds on rank 0; the machine is shared, so read medians and ratios.

    .venv/bin/python benchmarks/bench_checkpoint.py                    # gpt2-124m, tp 2, 3 rounds
    .venv/bin/python benchmarks/bench_checkpoint.py --preset small --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import ops_transformer as ot
from ops_transformer.checkpoint import store, verify
from ops_transformer.models.gpt import preset

from _common import OtherLoad, finish, source_version

METHODS = ("save", "torch.save", "load", "verify")


def _model(cfg, tp, seed=0):
    ctx = ot.init_parallel(tp=tp)
    torch.manual_seed(seed)
    model = ot.parallelize(ot.GPT(cfg), ctx, vocab="parallel")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab_size, (1, 33))
    model(x[:, :-1], x[:, 1:])[1].backward()  # one step: AdamW state exists
    opt.step()
    opt.zero_grad(set_to_none=True)
    return ctx, model, opt


def _torch_save(path: Path, model, opt) -> None:
    with open(path, "wb") as f:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())


def _job(cfg, tp, root: str, rounds: int) -> dict:
    ctx, model, opt = _model(cfg, tp)
    root = Path(root)
    times = {m: [] for m in METHODS}
    for r in range(rounds):
        order = METHODS if r % 2 == 0 else (METHODS[1], METHODS[0], *METHODS[2:])
        for method in order:
            torch.distributed.barrier()
            t0 = time.perf_counter()
            if method == "save":
                ot.save_checkpoint(root / "dcp", model, opt, ctx, r, keep=1)
            elif method == "torch.save":
                _torch_save(root / f"plain-{ctx.rank}.pt", model, opt)
            elif method == "load":
                ot.load_checkpoint(root / "dcp", model, opt, ctx)
            else:
                path = store.resolve(root / "dcp", None)
                verify(path, store.read_manifest(path), ctx)
            torch.distributed.barrier()
            times[method].append(time.perf_counter() - t0)
    sizes = {"save": store.read_manifest(store.resolve(root / "dcp", None))["total_bytes"],
             "torch.save": sum(p.stat().st_size for p in root.glob("plain-*.pt"))}
    return {"times": times, "sizes": sizes}


def _load_single(cfg, root: Path, rounds: int) -> list[float]:
    ctx, model, opt = _model(cfg, 1, seed=1)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        ot.load_checkpoint(root / "dcp", model, opt, ctx)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gpt2-124m")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", help="where to write (default: a temporary directory, removed)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()
    if args.rounds < 1 or args.tp < 1:
        parser.error("--rounds and --tp must be at least 1")
    cfg = preset(args.preset)
    t0, load = time.perf_counter(), OtherLoad()
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-checkpoint-"))
    try:
        result = ot.launch(_job, args.tp, cfg, args.tp, str(root), args.rounds,
                           timeout=3600)[0]
        result["times"]["load tp=1"] = ot.launch(_load_single, 1, cfg, root, args.rounds,
                                                 timeout=3600)[0]
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    params = sum(p.numel() for p in ot.GPT(cfg).parameters())
    print(f"{args.preset}: {params / 1e6:.1f} M parameters, fp32, AdamW; saved at tp={args.tp}; "
          f"{args.rounds} rounds; ops_transformer {source_version()}, torch {torch.__version__}")
    print(f"size on disk: checkpoint {result['sizes']['save'] / 2**20:.1f} MiB, torch.save of the "
          f"shards {result['sizes']['torch.save'] / 2**20:.1f} MiB")
    print(f"{'method':<12} {'median s':>9} {'min s':>7} {'max s':>7} {'GB/s':>6}")
    size = result["sizes"]["save"]
    for method, values in result["times"].items():
        med = statistics.median(values)
        print(f"{method:<12} {med:>9.2f} {min(values):>7.2f} {max(values):>7.2f} "
              f"{size / med / 1e9:>6.2f}")
    save, plain = result["times"]["save"], result["times"]["torch.save"]
    ratios = [a / b for a, b in zip(save, plain)]
    print(f"save / torch.save (paired by round): median {statistics.median(ratios):.2f} "
          f"[{min(ratios):.2f}-{max(ratios):.2f}]")
    finish(t0, args.json, {"preset": args.preset, "params": params, "tp": args.tp, **result},
           load.cores())


if __name__ == "__main__":
    main()
