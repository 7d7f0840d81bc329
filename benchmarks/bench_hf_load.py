"""Loading a Hugging Face checkpoint at tp 1, 2 and 4: ``ot.from_pretrained`` (each rank reads its
shards, as blocks of the safetensors files, onto its device) vs ``transformers``'
``from_pretrained`` of the whole model, ``.to(device)`` and ``parallelize`` (docs/finetuning.md).

The checkpoint is a Llama written with ``save_pretrained`` in bf16 (default 9 layers, 319 MiB, in
shard files of 100 MB), cached in ``--dir``. Per rank:

* **peak**: the most bytes the load held allocated at once on the device. On a GPU
  ``torch.cuda.max_memory_allocated``. On a CPU the peak of the live bytes in storage the load's
  operations allocated (:class:`~ops_transformer.memory.allocations.AllocationTracker`): private
  memory; the views of the memory-mapped files that safetensors returns are page cache. There
  ``.to(device)`` is a no-op that keeps those views, so the baseline makes the private copy a
  device load makes (each parameter and buffer cloned: "device copy emulated").
* **kept**: the bytes of the parameters and buffers the rank holds once loaded.
* **load time**: wall seconds from the call to the parallel model, rounds interleaved (order
  rotated), median over rounds; ours / baseline paired by round. The files are read once first, so
  both methods read from the page cache, and each method loads once untimed (imports).

Target (issue 22): each rank's peak ≤ 1.25 × (checkpoint / tp) + replicated tensors + the largest
single tensor.

    .venv/bin/python benchmarks/bench_hf_load.py                       # tp 1, 2, 4; 3 rounds
    .venv/bin/python benchmarks/bench_hf_load.py --tp 2 --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from pathlib import Path

import torch

import ops_transformer as ot
from ops_transformer.memory.allocations import AllocationTracker

from _common import OtherLoad, finish, source_version

METHODS = ("ours", "transformers")
CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
              num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048)


def write_checkpoint(root: Path, layers: int) -> Path:
    """A random bf16 Llama saved with save_pretrained (written once per configuration)."""
    import transformers

    path = root / f"llama-{layers}l"
    if (path / "config.json").is_file():
        return path
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**CONFIG, "num_hidden_layers": layers})
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="100MB")
    return path


def _files(path: Path):
    from safetensors import safe_open

    sizes, total = [], 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                n = 1
                for s in piece.get_shape():
                    n *= s
                sizes.append(n * 2)  # bf16
        total += file.stat().st_size
    for file in path.glob("*.safetensors"):  # into the page cache: both methods read from it
        file.read_bytes()
    return total, max(sizes)


def _load(method: str, path: str, ctx):
    if method == "ours":
        return ot.from_pretrained(path, ctx)
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    model = model.to(ctx.device)
    if ctx.device.type == "cpu":  # what .to(cuda) copies: every tensor into private memory
        with torch.no_grad():
            for module in model.modules():
                for key, t in list(module._parameters.items()):
                    if t is not None:
                        module._parameters[key] = torch.nn.Parameter(t.detach().clone(),
                                                                     t.requires_grad)
                for key, t in list(module._buffers.items()):
                    if t is not None:
                        module._buffers[key] = t.clone()
        model.tie_weights()
    return ot.parallelize(model, ctx) if ctx.tp_size > 1 else model


def _peak(method: str, path: str, ctx) -> tuple[int, object]:
    """The peak live bytes the load allocated on this rank's device, and the model."""
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        model = _load(method, path, ctx)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before, model
    os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"  # transformers' reads on this thread, counted
    with AllocationTracker(ctx.device) as tracker:
        model = _load(method, path, ctx)
    os.environ.pop("HF_DEACTIVATE_ASYNC_LOAD")
    return tracker.peak, model


def _held(model) -> tuple[int, int]:
    """``(kept, replicated)``: bytes of this rank's tensors, and of those not split over TP."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
    kept = sum(t.numel() * t.element_size() for t in tensors)
    replicated = sum(t.numel() * t.element_size() for t in tensors
                     if getattr(t, "shard_spec", None) is None
                     or t.shard_spec.num_shards == 1)
    return kept, replicated


def _job(path: str, rounds: int) -> dict:
    ctx = ot.init_parallel(tp=int(os.environ["WORLD_SIZE"]))
    for method in METHODS:  # untimed: first calls import model code and build lookup tables
        del_model = _load(method, path, ctx)
        del del_model
    times = {m: [] for m in METHODS}
    for r in range(rounds):
        for method in (METHODS if r % 2 == 0 else METHODS[::-1]):
            gc.collect()
            torch.distributed.barrier()
            t0 = time.perf_counter()
            model = _load(method, path, ctx)
            torch.distributed.barrier()
            times[method].append(time.perf_counter() - t0)
            del model
    out = {"times": times, "peak": {}, "device": str(ctx.device)}
    for method in METHODS:
        gc.collect()
        torch.distributed.barrier()
        out["peak"][method], model = _peak(method, path, ctx)
        if method == "ours":
            out["kept"], out["replicated"] = _held(model)
            out["vocab"] = model.parallel_plan.vocab
        del model
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", default="1,2,4", help="tensor-parallel degrees (default 1,2,4)")
    parser.add_argument("--layers", type=int, default=9, help="Llama layers (default 9: 319 MiB)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (default 3)")
    parser.add_argument("--dir", default="/tmp/bench-hf-load", help="where the checkpoint is "
                        "written once (default /tmp/bench-hf-load)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()
    degrees = [int(t) for t in args.tp.split(",")]
    if args.rounds < 1 or args.layers < 1 or min(degrees) < 1:
        parser.error("--rounds, --layers and --tp must be at least 1")
    t0, load = time.perf_counter(), OtherLoad()
    import transformers  # imported here: the forked ranks inherit the modules

    _ = (transformers.LlamaForCausalLM, transformers.AutoModelForCausalLM)
    path = write_checkpoint(Path(args.dir), args.layers)
    size, largest = _files(path)
    print(f"Llama {args.layers} layers, hidden {CONFIG['hidden_size']}, vocab "
          f"{CONFIG['vocab_size']}: {size / 2**20:.0f} MiB of bf16 safetensors in "
          f"{len(list(path.glob('*.safetensors')))} files, largest tensor {largest / 2**20:.1f} "
          f"MiB; {args.rounds} rounds; ops_transformer {source_version()}, torch "
          f"{torch.__version__}")
    print(f"{'tp':>2} {'method':<13} {'peak MiB/rank':>13} {'kept MiB':>9} {'target MiB':>10} "
          f"{'load s':>7}  ours/transformers (paired)")
    results = {}
    for tp in degrees:
        ranks = ot.launch(_job, tp, str(path), args.rounds, timeout=3600)
        r0 = ranks[0]
        target = 1.25 * size / tp + r0["replicated"] + largest
        paired = [a / b for a, b in zip(r0["times"]["ours"], r0["times"]["transformers"])]
        for method in METHODS:
            peak = max(r["peak"][method] for r in ranks)
            kept = f"{r0['kept'] / 2**20:9.1f}" if method == "ours" else f"{'':>9}"
            ratio = (f"  {statistics.median(paired):.2f} [{min(paired):.2f}-{max(paired):.2f}]"
                     if method == "ours" else "")
            print(f"{tp:>2} {method:<13} {peak / 2**20:>13.1f} {kept} {target / 2**20:>10.1f} "
                  f"{statistics.median(r0['times'][method]):>7.2f}{ratio}")
        results[tp] = {"ranks": ranks, "target_bytes": target,
                       "meets_target": max(r["peak"]["ours"] for r in ranks) <= target}
        print(f"   tp={tp}: vocabulary {r0['vocab']}; ours {'meets' if results[tp]['meets_target'] else 'misses'} "
              f"the target on every rank" + ("; device copy emulated (CPU)"
                                              if r0["device"] == "cpu" else ""))
    finish(t0, args.json, {"checkpoint_bytes": size, "largest_tensor_bytes": largest,
                           "layers": args.layers, "results": results}, load.cores())


if __name__ == "__main__":
    main()
