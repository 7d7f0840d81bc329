"""Our TP against PyTorch DTensor TP and the plain model: one GPT training step, interleaved
(``ops-transformer bench`` and ``benchmarks/bench_gpt.py``).

One step of the reference GPT in fp32: forward with targets → loss, ``loss.backward()``,
``AdamW.step()``, ``zero_grad(set_to_none=True)``. Five methods run in the same job, interleaved
round by round (the order rotates each round, a barrier starts each block):

* ``ours``      — ``parallelize(GPT(cfg), ctx)``, the full plan (vocab-parallel or replicated
  embedding/head as the cost model chooses, head-parallel attention, column→row MLP);
* ``ours-proj`` — ``parallelize`` with ``ours``' plan less its ``tok_emb`` and ``lm_head`` rules:
  the projections DTensor splits (like for like);
* ``dtensor``   — ``parallelize_module(block, ctx.mesh["tp"], plan)`` per block: ColwiseParallel
  on ``attn.wq/wk/wv`` and ``mlp.w_in``, RowwiseParallel on ``attn.wo`` and ``mlp.w_out``;
* ``plain``     — the dense GPT in one process (rank 0) while the other ranks wait at a barrier;
* ``tp1``       — ``parallelize(GPT(cfg), ParallelContext.single())`` on rank 0.

``bench --model DIR`` (``Size.model``) runs the same five methods on a Hugging Face Llama-family
causal LM (Llama, Mistral, Qwen2) read from its ``save_pretrained`` directory in fp32, its loss
from ``labels``: ``ours`` is ``parallelize`` of it (the plan ``train --model`` runs),
``ours-proj`` that plan less the embedding and LM head, ``dtensor`` ColwiseParallel on
``q/k/v_proj`` and ``gate/up_proj`` and RowwiseParallel on ``o_proj`` and ``down_proj`` of every
layer (as torchtitan applies it).

Every model starts from the same seed; before timing, the losses of two steps are checked against
``plain``'s and one step's collectives are counted (dispatcher and ledger). Times are rank 0's
per-step wall times; ratios are of medians, pooled and paired by round.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..comm.ledger import CommLedger
from ..models.gpt import GPT, preset
from ..models.hf import is_hf
from ..parallel.context import ParallelContext, init_parallel
from ..parallelize import Plan, parallelize


def sync_cuda() -> None:
    """Wait for the queued GPU work (when this process uses CUDA): a wall clock read after a step
    that only queued kernels measures their launch, not their run."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def time_steps(step: Callable[[], object], warmup: int, steps: int) -> list[float]:
    """Per-step wall times (s) of ``steps`` calls of ``step`` after ``warmup`` untimed ones (on a
    GPU, synchronised before each clock read)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        sync_cuda()
        t0 = time.perf_counter()
        step()
        sync_cuda()
        times.append(time.perf_counter() - t0)
    return times


def interleave(methods: Sequence[str], rounds: int, block: Callable[[str], list[float]], *,
               rank0_only: Sequence[str] = ()) -> dict[str, list[list[float]]]:
    """Run ``block(method)`` for every method, round by round, rotating the order each round.

    A barrier starts each block, so the ranks enter it together. Methods in ``rank0_only`` run on
    rank 0 only; the other ranks wait at the barrier that starts the next block. Returns this
    rank's per-step times by method: one list per round.
    """
    methods = tuple(methods)
    rank = dist.get_rank()
    times: dict[str, list[list[float]]] = {m: [] for m in methods}
    for r in range(rounds):
        order = methods[r % len(methods):] + methods[:r % len(methods)]
        for method in order:
            dist.barrier()  # start each block together
            if method not in rank0_only or rank == 0:
                times[method].append(block(method))
    dist.barrier()
    return times


def median_ms(blocks: list[list[float]]) -> float | None:
    """The median (ms) of all steps of all blocks, or ``None`` without any."""
    flat = [t for block in blocks for t in block]
    return 1e3 * statistics.median(flat) if flat else None


def paired_ratio(times: dict[str, list], num: str, den: str) -> dict[str, float]:
    """Median, min and max over rounds of ``num``'s round median over ``den``'s round median.

    Blocks of one round run seconds apart, so pairing them cancels slow drifts of the machine.
    """
    ratios = [median_ms([a]) / median_ms([b]) for a, b in zip(times[num], times[den])]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def format_paired(ratio: dict[str, float]) -> str:
    """``median [min-max]`` of a :func:`paired_ratio`."""
    return f"{ratio['median']:.2f} [{ratio['min']:.2f}-{ratio['max']:.2f}]"


METHODS = ("ours", "ours-proj", "dtensor", "plain", "tp1")
RANK0_ONLY = ("plain", "tp1")
RATIOS = (("ours", "dtensor"), ("ours-proj", "dtensor"), ("ours", "plain"), ("tp1", "plain"),
          ("ours", "ours-proj"))
TP = 2
SEED = 1234
LR = 1e-5  # small, so the model stays near its initialisation over all timed steps
N_BATCHES = 8  # a pool of random batches, cycled


@dataclass(frozen=True)
class Size:
    """A GPT preset, the batch (``batch`` sequences of ``seq`` tokens), and the default numbers of
    timed and untimed (warm-up) steps per block."""

    name: str
    preset: str
    batch: int
    seq: int
    steps: int
    warmup: int
    model: str | None = None  # a Hugging Face causal LM directory (bench --model), else the preset


HF_FAMILIES = ("llama", "mistral", "qwen2")  # bench --model: DTensor's plan below fits these
HF_DTENSOR_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise",
                   "self_attn.v_proj": "colwise", "self_attn.o_proj": "rowwise",
                   "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
                   "mlp.down_proj": "rowwise"}
HF_VOCAB_RULES = ("model.embed_tokens", "lm_head")  # what ours-proj leaves out of an HF plan

SIZES = {
    "small": Size("small", "tiny", batch=8, seq=64, steps=30, warmup=3),  # 2 layers, d 64
    "medium": Size("medium", "small", batch=8, seq=128, steps=3, warmup=1),  # 4 layers, d 256
}


def dense_gpt(cfg, device: torch.device | str = "cpu") -> GPT:
    """The dense reference model, from the same seed on every rank and for every method (drawn
    on the CPU, then moved to ``device``: the same weights on any device)."""
    torch.manual_seed(SEED)
    return GPT(cfg).to(device)


def dense_model(size: Size, device: torch.device | str = "cpu") -> nn.Module:
    """The dense model of ``size``: the preset's GPT (:func:`dense_gpt`), or the Hugging Face
    directory's weights in fp32 (the same on every rank and for every method)."""
    if size.model is None:
        return dense_gpt(preset(size.preset), device)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    return AutoModelForCausalLM.from_pretrained(size.model, torch_dtype=torch.float32).to(device)


def model_config(size: Size):
    """The preset's ``GPTConfig``, or the Hugging Face directory's config."""
    if size.model is None:
        return preset(size.preset)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(size.model)


def applied_plan(model: nn.Module) -> Plan:
    """The plan ``parallelize`` applied."""
    return model.parallel_plan


def projections_plan(full: Plan) -> Plan:
    """``full`` without the embedding and LM-head rules: the projections DTensor gets."""
    rules = {k: v for k, v in full.rules.items()
             if k not in ("tok_emb", "lm_head") + HF_VOCAB_RULES}
    return Plan(rules=rules, attention=full.attention, reason="projections only (as DTensor)",
                vocab="replicated")


def dtensor_gpt(cfg, tp_mesh) -> nn.Module:
    """The dense GPT with DTensor TP on each block's projections (as torchtitan applies it)."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    model = dense_gpt(cfg, tp_mesh.device_type)
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel(),
            "mlp.w_in": ColwiseParallel(), "mlp.w_out": RowwiseParallel(),
        })
    return model


def dtensor_hf(size: Size, tp_mesh) -> nn.Module:
    """The dense Hugging Face model with DTensor TP on every layer's projections
    (:data:`HF_DTENSOR_PLAN`)."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    model = dense_model(size, tp_mesh.device_type)
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, {name: styles[style]()
                                            for name, style in HF_DTENSOR_PLAN.items()})
    return model


def build_models(size: Size, ctx) -> dict[str, nn.Module]:
    """Every method's model of one size (``plain`` and ``tp1`` on rank 0 only)."""
    dev = ctx.device
    ours = parallelize(dense_model(size, dev), ctx)
    dtensor = (dtensor_gpt(preset(size.preset), ctx.mesh["tp"]) if size.model is None
               else dtensor_hf(size, ctx.mesh["tp"]))
    models = {"ours": ours,
              "ours-proj": parallelize(dense_model(size, dev), ctx,
                                       plan=projections_plan(applied_plan(ours))),
              "dtensor": dtensor}
    if ctx.rank == 0:
        models["plain"] = dense_model(size, dev)
        models["tp1"] = parallelize(dense_model(size, dev), ParallelContext.single(dev))
    return models


def make_batches(size: Size, vocab: int,
                 device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``N_BATCHES`` pairs of (tokens, next tokens), each ``(batch, seq)``; equal on all ranks
    (drawn on the CPU, then moved to ``device``)."""
    gen = torch.Generator().manual_seed(size.batch * 1000 + size.seq)
    pool = []
    for _ in range(N_BATCHES):
        seq = torch.randint(0, vocab, (size.batch, size.seq + 1), generator=gen).to(device)
        pool.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return pool


def train_step(model: nn.Module, opt: torch.optim.Optimizer, idx: torch.Tensor,
               targets: torch.Tensor) -> torch.Tensor:
    """Forward with targets, backward, AdamW step, zero_grad; returns the (detached) loss. (A
    Hugging Face model: its loss from ``labels``, which it shifts itself: ``idx``.)"""
    if is_hf(model):
        loss = model(input_ids=idx, labels=idx).loss
    else:
        _, loss = model(idx, targets)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def check_losses(models, opts, batches) -> dict[str, list[float]]:
    """Untimed: the losses of the first two steps of every method (same batches, same weights)."""
    return {m: [float(train_step(models[m], opts[m], *batches[i])) for i in range(2)]
            for m in models}


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives that reach the dispatcher — DTensor's functional collectives and
    ``torch.distributed``'s c10d ops — with the elements of their input, by op name.

    ``CommDebugMode`` would do for DTensor, but its module tracker fails on the GPT's forward in
    torch 2.13 (``IndexError`` in ``_fw_set_module_hook``); this is the part of it we need. Like
    it, a DTensor op is passed on (``NotImplemented``) so that its desugared collectives are seen.
    """

    def __init__(self):
        super().__init__()
        self.counts: dict[str, dict[str, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        namespace = getattr(func, "namespace", "")
        name = func._opname if hasattr(func, "_opname") else str(func)
        if namespace in ("_c10d_functional", "c10d") and not name.startswith(
                ("wait", "barrier", "monitored_barrier", "_wrap")):
            tensors = [t for t in tree_flatten(args[0])[0] if isinstance(t, torch.Tensor)]
            entry = self.counts.setdefault(name, {"calls": 0, "elements": 0})
            entry["calls"] += 1
            entry["elements"] += sum(t.numel() for t in tensors)
        return func(*args, **(kwargs or {}))


def count_collectives(models, opts, batch) -> dict[str, dict]:
    """One step's collectives as the process group sees them (:class:`CollectiveCounter`) for the
    tp=2 methods, and for ours also our ``CommLedger`` (by kind and by label)."""
    out = {}
    for m in ("ours", "ours-proj", "dtensor"):
        with CommLedger() as ledger, CollectiveCounter() as counter:
            train_step(models[m], opts[m], *batch)
        out[m] = {"dispatched": counter.counts}
        if m != "dtensor":
            out[m]["ledger"] = ledger.summary()
            out[m]["labels"] = dict(Counter(f"{r.kind}:{r.label}" for r in ledger.records))
    return out


def bench_size(size: Size, ctx, rounds: int, steps: int | None, warmup: int | None) -> dict:
    """Check, count and time one size on this rank (``None``: the size's default)."""
    cfg = model_config(size)
    models = build_models(size, ctx)
    opts = {m: torch.optim.AdamW(model.parameters(), lr=LR) for m, model in models.items()}
    batches = make_batches(size, cfg.vocab_size, ctx.device)
    losses = check_losses(models, opts, batches)
    same_tp1 = repr(models["tp1"]) == repr(models["plain"]) if "tp1" in models else None
    plan = applied_plan(models["ours"])
    attention = f"{plan.attention} ({plan.reason})" if plan.reason else plan.attention
    comms = count_collectives(models, opts, batches[2])
    cycles = {m: itertools.cycle(batches) for m in models}  # per method: ranks stay in step
    steps = steps or size.steps
    warmup = size.warmup if warmup is None else warmup

    def block(method: str) -> list[float]:
        model, opt, cycle = models[method], opts[method], cycles[method]
        return time_steps(lambda: train_step(model, opt, *next(cycle)), warmup, steps)

    times = interleave(METHODS, rounds, block, rank0_only=RANK0_ONLY)
    last = {m: float(train_step(models[m], opts[m], *batches[0])) for m in models}
    return {"size": asdict(size), "config": cfg.to_dict(), "steps": steps, "warmup": warmup,
            "tp1_same_as_plain": same_tp1, "attention": attention, "losses": losses,
            "last_losses": last, "comms": comms, "times": times,
            "params": {m: sum(p.numel() for p in models[m].parameters()) for m in models}}


def rank_main(sizes: list[Size], rounds: int, steps: int | None, warmup: int | None) -> dict:
    """What each rank runs under ``ops_transformer.launch``."""
    ctx = init_parallel(tp=TP)
    results = [bench_size(size, ctx, rounds, steps, warmup) for size in sizes]
    return {"rank": ctx.rank, "backend": ctx.backend, "threads": torch.get_num_threads(),
            "results": results}


def _key(num: str, den: str) -> str:
    return f"{num}/{den}"


def summarise(per_rank: list[dict]) -> list[dict]:
    """One row per size: rank 0's median step time per method (all steps of all rounds pooled),
    the spread of its per-round medians, rank 1's medians, and the ratios (pooled and paired)."""
    rows = []
    for i, res0 in enumerate(per_rank[0]["results"]):
        times = res0["times"]
        plain = res0["losses"]["plain"]
        row = {k: res0[k] for k in ("size", "config", "steps", "warmup", "tp1_same_as_plain",
                                    "attention", "comms", "params", "last_losses")}
        row["loss_rel_diff"] = {m: [abs(a - b) / abs(b) for a, b in zip(loss, plain)]
                                for m, loss in res0["losses"].items() if m != "plain"}
        row["plain_losses"] = plain
        row["ms"], row["round_ms"], row["rank1_ms"] = {}, {}, {}
        for m in METHODS:
            row["ms"][m] = median_ms(times[m])
            per_round = [median_ms([block]) for block in times[m]]
            row["round_ms"][m] = [min(per_round), max(per_round)]
            if m not in RANK0_ONLY:
                row["rank1_ms"][m] = median_ms(per_rank[1]["results"][i]["times"][m])
        row["ratios"] = {_key(n, d): row["ms"][n] / row["ms"][d] for n, d in RATIOS}
        row["paired"] = {_key(n, d): paired_ratio(times, n, d) for n, d in RATIOS}
        rows.append(row)
    return rows


