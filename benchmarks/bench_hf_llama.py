"""Time a Hugging Face Llama training step at tp=2: ``parallelize`` vs DTensor, and against its floor.

One step is the forward with ``labels`` (the loss), ``loss.backward()`` and dropping the gradients,
fp32, on 2 local gloo ranks with one intra-op thread each. Methods, interleaved round by round (the
order rotates each round):

* ``ours``    — ``parallelize(model, ctx, overlap="none")``: the plan ``parallelize`` chooses for
  this model, every collective in one call (as before overlap existed);
* ``auto``    — ``parallelize(model, ctx)``: the default, ``overlap="auto"`` (per region the chunk
  count the cost model chooses on the agreed profile, 1 where chunking does not pay; issue 33:
  never more calls than ``none`` where it runs one chunk, and no slower than ``ours``);
* ``overlap`` — ``parallelize(model, ctx, overlap="chunked", chunks=N)``: the same plan, each
  region's collective split into ``N`` chunks pipelined with its matmul (``--chunks``, default 2);
* ``dtensor`` — ``parallelize_module(model, ctx.mesh["tp"], plan)`` with ``ColwiseParallel`` on
  ``q/k/v_proj`` and ``gate/up_proj`` and ``RowwiseParallel`` on ``o_proj`` and ``down_proj`` of
  every layer (embedding and LM head replicated), as torchtitan applies it;
* ``nocomm``  — ``ours`` with its communication removed: every ``torch.distributed`` call of
  :mod:`ops_transformer.comm.collectives` replaced by a local copy of the right shape (the values
  are wrong, the compute and the library's own work are the same);
* ``alone``   — the collectives ``ours`` issued in one step (from its ``CommLedger``), each issued
  alone after a barrier, their times summed: the time the step's communication takes without
  compute around it.

Reported: ``ours / dtensor``, ``overlap / dtensor``, ``auto / ours`` (with each one's collective
calls per step) and the floor ratios ``ours / (nocomm +
alone)`` and ``overlap / (nocomm + alone)`` (1 would mean the step costs exactly its compute plus
its communication; below 1, communication overlapped compute), each as the median over rounds of
the per-round ratio of medians; what ``overlap="auto"`` (the default) decides for each region on
this profile; and, after the timed rounds, the profiler's exposed communication per step
(``profile_step``: the time the step threads wait on collectives) of ``ours`` and ``overlap``.
Targets (issues 15, 26): ``ours/dtensor`` ≤ 0.5 at ``small`` (0.45 with overlap) and ≤ 0.8 at
``medium``; floor ≤ 1.1 at both; exposed communication at ``medium`` halved by ``overlap``.

Before timing, every size is checked once: ``ours`` and ``dtensor`` losses and full-vocabulary
logits against the dense model's, and one step's collectives (``CommLedger``).

    python benchmarks/bench_hf_llama.py --rounds 10 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn

import ops_transformer
from ops_transformer import CommLedger, parallelize, profile_step
from ops_transformer.comm import collectives as C
from ops_transformer.layers.overlap_policy import overlap_summary

from _common import (OtherLoad, add_timing_args, check_counts, finish, format_paired, interleave,
                     job_meta, method_stats, paired_ratio, rel_err, time_steps)

# the baseline first (method_stats)
METHODS = ("dtensor", "ours", "auto", "overlap", "nocomm", "alone")
TP = 2
SEED = 1234


@dataclass(frozen=True)
class Size:
    name: str
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    seq: int
    batch: int
    steps: int
    warmup: int
    target: float  # ours / dtensor must not exceed it


SIZES = {
    "small": Size("small", 128, 256, 4, 8, 8, 512, 64, 4, steps=20, warmup=3, target=0.5),
    "medium": Size("medium", 512, 1536, 2, 8, 8, 512, 256, 4, steps=6, warmup=2, target=0.8),
}
FLOOR_TARGET = 1.1


def dense_llama(size: Size) -> nn.Module:
    """The dense model, from the same seed on every rank and for every method."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=size.hidden, intermediate_size=size.ffn,
                         num_hidden_layers=size.layers, num_attention_heads=size.heads,
                         num_key_value_heads=size.kv_heads, vocab_size=size.vocab,
                         max_position_embeddings=max(size.seq, 128), attn_implementation="sdpa")
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config)


def dtensor_llama(size: Size, tp_mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    model = dense_llama(size)
    plan = {}
    for i in range(size.layers):
        p = f"model.layers.{i}."
        plan.update({p + "self_attn.q_proj": ColwiseParallel(),
                     p + "self_attn.k_proj": ColwiseParallel(),
                     p + "self_attn.v_proj": ColwiseParallel(),
                     p + "self_attn.o_proj": RowwiseParallel(),
                     p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
                     p + "mlp.down_proj": RowwiseParallel()})
    return parallelize_module(model, tp_mesh, plan)


def train_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Forward with labels, backward, drop the gradients; returns the detached loss."""
    ids, labels = batch
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    for p in model.parameters():
        p.grad = None
    return loss.detach()


class _NoComm:
    """``torch.distributed`` for :mod:`ops_transformer.comm.collectives`, minus the communication:
    collectives fill their outputs locally (all-gather: the input in every slot; reduce-scatter:
    this rank's block), point-to-point calls do nothing."""

    class _Done:
        def wait(self, timeout=None):
            return True

        def is_completed(self):
            return True

    def __getattr__(self, name):
        return getattr(dist, name)

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        return self._Done() if async_op else None

    def broadcast(self, tensor, src=0, group=None, async_op=False):
        return self._Done() if async_op else None

    def isend(self, tensor, dst=None, group=None, tag=0):
        return self._Done()

    def irecv(self, tensor, src=None, group=None, tag=0):
        return self._Done()

    def all_to_all_single(self, output, input, *args, group=None, async_op=False):
        output.copy_(input)
        return self._Done() if async_op else None

    def all_gather(self, output, input, group=None, async_op=False):
        output.view(-1, input.numel()).copy_(input.reshape(1, -1))
        return self._Done() if async_op else None

    def reduce_scatter(self, output, input, op=None, group=None, async_op=False):
        output.copy_(input.reshape(-1, output.numel())[group.rank()].view_as(output))
        return self._Done() if async_op else None


@contextlib.contextmanager
def communication_removed():
    fake = _NoComm()
    saved = C.dist, C._all_gather_single, C._reduce_scatter_single
    C.dist, C._all_gather_single, C._reduce_scatter_single = fake, fake.all_gather, \
        fake.reduce_scatter
    try:
        yield
    finally:
        C.dist, C._all_gather_single, C._reduce_scatter_single = saved


def replay(record, groups: dict) -> float:
    """Seconds of one recorded collective issued alone (through the engine: same algorithm)."""
    group, n = groups[record.group_ranks], record.elements
    p = len(record.group_ranks)
    full, shard = torch.ones(n, dtype=record.dtype), torch.ones(n // p, dtype=record.dtype)
    ops = {"all_reduce": lambda: C.all_reduce(full, group),
           "all_gather": lambda: C.all_gather_into(full, shard, group),
           "reduce_scatter": lambda: C.reduce_scatter_into(shard, full, group)}
    if record.kind not in ops:
        raise ValueError(f"no replay for {record.kind}")
    dist.barrier(group=group)
    t0 = time.perf_counter()
    ops[record.kind]()
    return time.perf_counter() - t0


def exposed_comm(model, ctx, batches, steps: int = 3) -> dict:
    """The profiler's split of ``steps`` steps (after one warm-up): per rank the mean exposed
    communication and step time, seconds."""
    state = {"i": 0}

    def step():
        state["i"] += 1
        train_step(model, batches[state["i"] % len(batches)])

    summary = profile_step(step, ctx, steps=steps, warmup=1).summary()
    return {"exposed_comm_s": [r["exposed_comm_s"] for r in summary["per_rank"]],
            "comm_s": [r["comm_s"] for r in summary["per_rank"]],
            "step_s": [r["step_time_s"] for r in summary["per_rank"]]}


def bench_size(size: Size, ctx, rounds: int, steps: int | None, warmup: int | None,
               chunks: int = 2) -> dict:
    from transformers import set_seed

    set_seed(SEED)
    models = {"ours": parallelize(dense_llama(size), ctx, overlap="none"),
              "auto": parallelize(dense_llama(size), ctx),  # the default: overlap="auto"
              "overlap": parallelize(dense_llama(size), ctx, overlap="chunked", chunks=chunks),
              "dtensor": dtensor_llama(size, ctx.mesh["tp"])}
    gen = torch.Generator().manual_seed(SEED)
    batches = [(ids, ids.clone()) for ids in
               (torch.randint(0, size.vocab, (size.batch, size.seq), generator=gen)
                for _ in range(4))]
    losses = {m: float(train_step(model, batches[0])) for m, model in models.items()}
    dense = dense_llama(size)
    losses["dense"] = float(train_step(dense, batches[0]))
    with torch.no_grad():  # the full-vocabulary logits against the dense model's
        ref = dense(input_ids=batches[0][0]).logits
        logits_err = {m: rel_err(model(input_ids=batches[0][0]).logits, ref)
                      for m, model in models.items()}
    with CommLedger() as ledger:
        train_step(models["ours"], batches[1])
    records = list(ledger.records)
    groups = {tuple(dist.get_process_group_ranks(ctx.tp_group)): ctx.tp_group}
    steps, warmup = steps or size.steps, size.warmup if warmup is None else warmup
    state = {"i": 0}

    def next_batch():
        state["i"] += 1
        return batches[state["i"] % len(batches)]

    def block(method: str) -> list[float]:
        if method == "alone":
            return [sum(replay(r, groups) for r in records) for _ in range(steps)]
        model = models["ours" if method == "nocomm" else method]
        with communication_removed() if method == "nocomm" else contextlib.nullcontext():
            return time_steps(lambda: train_step(model, next_batch()), warmup, steps)

    with CommLedger() as chunked:
        train_step(models["overlap"], batches[1])
    with CommLedger() as auto:
        train_step(models["auto"], batches[1])
    times = interleave(METHODS, rounds, block)
    exposed = {m: exposed_comm(models[m], ctx, batches) for m in ("ours", "overlap")}
    return {"size": asdict(size), "losses": losses, "logits_rel_err": logits_err,
            "steps": steps, "warmup": warmup,
            "attention": models["ours"].parallel_plan.reason,
            "ledger": ledger.summary(), "by_algorithm": ledger.by_algorithm(),
            "overlap_ledger": chunked.summary(), "auto_ledger": auto.summary(),
            "exposed": exposed, "auto": overlap_summary(models["auto"]),
            "collectives_per_step": len(records), "times": times}


def rank_main(sizes, rounds, steps, warmup, profile, chunks=2):
    ctx = ops_transformer.init_parallel(tp=TP, profile=profile)
    return {"rank": ctx.rank, "backend": ctx.backend, "threads": torch.get_num_threads(),
            "profile": ctx.profile.name,
            "overlap_efficiency": getattr(ctx.profile, "overlap_efficiency", 1.0),
            "results": [bench_size(s, ctx, rounds, steps, warmup, chunks) for s in sizes]}


def floor_ratios(times: dict, method: str = "ours") -> list[float]:
    """Per round: ``method`` / (nocomm + alone), each the round's median."""
    med = {m: [statistics.median(block) for block in times[m]] for m in METHODS}
    return [o / (n + a) for o, n, a in zip(med[method], med["nocomm"], med["alone"])]


def _floor(times: dict, method: str) -> dict:
    floors = floor_ratios(times, method)
    return {"median": statistics.median(floors), "min": min(floors), "max": max(floors)}


def _verdict(value: float, target: float) -> str:
    return f"target <= {target}: {'met' if value <= target else 'NOT met'}"


def report(per_rank: list[dict]) -> list[dict]:
    rows = []
    for i, res in enumerate(per_rank[0]["results"]):
        s, times = res["size"], res["times"]
        stats = method_stats([r["results"][i]["times"] for r in per_rank], METHODS, "dtensor")
        ratios = {m: paired_ratio(times, m, "dtensor") for m in ("ours", "overlap")}
        auto_ratio = paired_ratio(times, "auto", "ours")
        calls = {m: sum(v["calls"] for v in res[key].values())
                 for m, key in (("ours", "ledger"), ("auto", "auto_ledger"))}
        floors = {m: _floor(times, m) for m in ("ours", "overlap")}
        exposed = {m: max(res["exposed"][m]["exposed_comm_s"]) for m in ("ours", "overlap")}
        dense = res["losses"]["dense"]
        print(f"\n[{s['name']}] Llama hidden {s['hidden']}, FFN {s['ffn']}, {s['layers']} layers, "
              f"{s['heads']} heads / {s['kv_heads']} KV, vocab {s['vocab']}, batch {s['batch']} "
              f"x seq {s['seq']}; {res['warmup']} untimed + {res['steps']} timed steps per block")
        print("  vs dense: loss rel. diff " + ", ".join(
            f"{m} {abs(res['losses'][m] - dense) / dense:.1e}" for m in ("ours", "auto", "overlap",
                                                                       "dtensor"))
              + "; logits max rel. err " + ", ".join(
                  f"{m} {res['logits_rel_err'][m]:.1e}" for m in ("ours", "auto", "overlap",
                                                                  "dtensor")))
        print(f"  ours per step: {res['collectives_per_step']} collectives {res['ledger']} "
              f"by algorithm {sorted(res['by_algorithm'])}")
        print(f"  overlap per step: {res['overlap_ledger']}")
        print(f"  overlap='auto' (the default) here: {res['auto']}")
        print(f"  auto per step: {res['auto_ledger']}; calls auto {calls['auto']} vs none "
              f"{calls['ours']}")
        print("  rank 0 median ms: " + ", ".join(f"{m} {stats['ms'][m]:.2f}" for m in METHODS))
        for m in ("ours", "overlap"):
            target = s["target"] if m == "ours" or s["name"] != "small" else 0.45
            print(f"  {m:<8} / dtensor  {format_paired(ratios[m])}   "
                  f"{_verdict(ratios[m]['median'], target)}")
        print(f"  auto     / ours     {format_paired(auto_ratio)}   "
              f"{_verdict(auto_ratio['median'], 1.0)} (issue 33: no slower than none)")
        for m in ("ours", "overlap"):
            print(f"  floor {m} / (nocomm + alone)  {format_paired(floors[m])}   "
                  f"{_verdict(floors[m]['median'], FLOOR_TARGET)}")
        print(f"  exposed communication per step (profiler, slowest rank): ours "
              f"{1e3 * exposed['ours']:.2f} ms, overlap {1e3 * exposed['overlap']:.2f} ms "
              f"({exposed['overlap'] / exposed['ours']:.2f}x; target <= 0.5 at medium)")
        rows.append({"size": s, "ms": stats["ms"], "ours/dtensor": ratios["ours"],
                     "overlap/dtensor": ratios["overlap"], "auto/ours": auto_ratio,
                     "calls_per_step": calls, "floor": floors["ours"],
                     "floor_overlap": floors["overlap"], "exposed_comm_s": exposed,
                     "auto": res["auto"], "losses": res["losses"],
                     "logits_rel_err": res["logits_rel_err"], "ledger": res["ledger"],
                     "overlap_ledger": res["overlap_ledger"], "auto_ledger": res["auto_ledger"],
                     "by_algorithm": res["by_algorithm"]})
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="small,medium", help=f"from {', '.join(SIZES)}")
    p.add_argument("--profile", help="hardware profile for our collective algorithms and plan "
                   "(default: the calibrated one where the CLI finds it, else the built-in one; "
                   "'builtin' forces the built-in one)")
    p.add_argument("--chunks", type=int, default=2, help="chunks of the overlap method "
                   "(default 2)")
    add_timing_args(p, rounds=10, steps=None, warmup=None,
                    steps_help="timed steps per method per round (default per size)")
    args = p.parse_args(argv)
    check_counts(p, args, SIZES)
    if args.chunks < 1:
        p.error(f"--chunks must be >= 1, got {args.chunks}")
    if args.profile is None:
        from ops_transformer.cli._calibrated import profile_path

        args.profile = str(profile_path()) if profile_path().exists() else None
    elif args.profile == "builtin":
        args.profile = None
    t0, other = time.perf_counter(), OtherLoad()
    per_rank = ops_transformer.launch(rank_main, TP, [SIZES[s] for s in args.sizes.split(",")],
                                      args.rounds, args.steps, args.warmup, args.profile,
                                      args.chunks, timeout=3600)
    other_cores = other.cores()
    meta = job_meta(per_rank[0], args, profile=per_rank[0]["profile"],
                    overlap_efficiency=per_rank[0]["overlap_efficiency"],
                    other_load_cores=other_cores)
    print(f"ops_transformer {meta['ops_transformer']}, torch {meta['torch']}, {meta['backend']}, "
          f"tp={TP}, {meta['threads_per_rank']} thread per rank, {meta['cpus']} CPUs, "
          f"rounds={args.rounds}, profile: {meta['profile']}")
    rows = report(per_rank)
    finish(t0, args.json, {"meta": meta, "rows": rows, "raw": per_rank}, other_cores)


if __name__ == "__main__":
    main()
