"""The memory trade-off table behind ``ops-transformer memory`` and claim (f): for each combination
of techniques, the measured activation bytes (per layer and in total), Korthikanti et al.'s formula
for the same layer, the optimizer-state bytes, the tensor-parallel communication of a step (what
re-gathering sequence parallelism pays for its memory: one more all-gather per region) and the
step time relative to the plain run.

Every combination is built once (same seed, same weights) and kept; the timed training steps are
interleaved — one step of each combination per round — so that a machine's load drifts over all of
them alike, and each time is the median over the rounds after a warm-up round. Times are
wall-clock medians on whatever machine runs it: quote ratios, not absolute times.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from ..comm.ledger import CommLedger
from ..models.gpt import GPT, preset
from ..parallel.context import init_parallel
from ..planner.memory import activation_bytes_per_layer
from ..memory.measure import activation_memory
from ..training.optimizer import make_optimizer
from ..parallelize import parallelize
from ..parallelize.gpt_plan import check_tp_for_gpt
from .bench import sync_cuda


@dataclass(frozen=True)
class Technique:
    """One combination of memory techniques."""

    name: str
    sequence_parallel: bool | str = False  # True, or "regather"
    recompute: str = "none"
    activation_cache: str = "none"
    zero: int = 0


TECHNIQUES = (
    Technique("plain"),
    Technique("sequence parallel", sequence_parallel=True),
    Technique("selective recompute", recompute="selective"),
    Technique("full recompute", recompute="full"),
    Technique("int8 cache", activation_cache="int8"),
    Technique("SP + selective", sequence_parallel=True, recompute="selective"),
    Technique("SP regather", sequence_parallel="regather"),
    Technique("SP regather + selective", sequence_parallel="regather", recompute="selective"),
    Technique("SP + full", sequence_parallel=True, recompute="full"),
    Technique("SP + selective + int8", sequence_parallel=True, recompute="selective",
              activation_cache="int8"),
    Technique("ZeRO-1", zero=1),
    Technique("ZeRO-2", zero=2),
    Technique("SP + selective + ZeRO-2", sequence_parallel=True, recompute="selective", zero=2),
    Technique("SP + selective + int8 + ZeRO-2", sequence_parallel=True, recompute="selective",
              activation_cache="int8", zero=2),
    Technique("SP regather + selective + int8 + ZeRO-2", sequence_parallel="regather",
              recompute="selective", activation_cache="int8", zero=2),
)


@dataclass(frozen=True)
class MemoryRun:
    """What ``ops-transformer memory`` measures: a preset at ``dp × tp``, ``batch`` sequences
    (global, split over ``dp``) of ``seq`` tokens, ``steps`` timed rounds."""

    preset: str = "small"
    tp: int = 2
    dp: int = 1
    seq: int | None = None
    batch: int = 4
    steps: int = 5
    layers: int | None = None
    dropout: float | None = None  # None: the preset's (0 in every preset)
    seed: int = 0

    def model_config(self):
        base = preset(self.preset)
        changes = {"max_seq_len": max(base.max_seq_len, self.seq or 0)}
        if self.layers is not None:
            changes["n_layers"] = self.layers
        if self.dropout is not None:
            changes["dropout"] = self.dropout
        return base.with_(**changes)

    @property
    def sequence(self) -> int:
        return self.seq or preset(self.preset).max_seq_len


def techniques_for(tp: int, dp: int) -> list[Technique]:
    """The combinations that mean something at ``dp × tp``."""
    return [t for t in TECHNIQUES if (tp > 1 or not t.sequence_parallel)
            and (dp > 1 or not t.zero)]


def check_run(run: MemoryRun) -> None:
    for name in ("tp", "dp", "batch", "steps"):
        if getattr(run, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(run, name)}")
    if run.batch % run.dp:
        raise ValueError(f"--batch ({run.batch}) must be divisible by dp ({run.dp})")
    if run.tp > 1 and run.sequence % run.tp:
        raise ValueError(f"sequence parallelism splits the sequence over tp ({run.tp}) ranks: the "
                         f"sequence length s ({run.sequence}) must be divisible by tp ({run.tp})")
    check_tp_for_gpt(run.model_config(), run.tp, "heads")


def _step(model, opt, x, y) -> float:
    sync_cuda()
    start = time.perf_counter()
    model(x, y)[1].backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync_cuda()
    return time.perf_counter() - start


def _tp_comm_bytes(model, opt, x, y, tp_group) -> int:
    """Bytes of the collectives on the TP group in one training step (the ledger's count)."""
    if tp_group is None:
        return 0
    with CommLedger() as ledger:
        _step(model, opt, x, y)
    ranks = tuple(torch.distributed.get_process_group_ranks(tp_group))
    return sum(r.bytes for r in ledger.records if r.group_ranks == ranks)


def _formula(run: MemoryRun, cfg, t: Technique, tp: int, micro: int) -> float:
    return activation_bytes_per_layer(run.sequence, micro, cfg.d_model, cfg.n_heads, tp,
                                      sequence_parallel=t.sequence_parallel,
                                      recompute=t.recompute, bytes_per_element=4)


def memory_worker(run: MemoryRun) -> list[dict] | None:
    """Run on every rank; returns the table's rows on global rank 0 (``None`` elsewhere). The
    process groups it starts are torn down before it returns."""
    with init_parallel(tp=run.tp, dp=run.dp) as ctx:
        return _measure(run, ctx)


def _measure(run: MemoryRun, ctx) -> list[dict] | None:
    cfg = run.model_config()
    micro = run.batch // ctx.dp_size
    gen = torch.Generator().manual_seed(run.seed + ctx.dp_rank)
    batches = [torch.randint(0, cfg.vocab_size, (micro, run.sequence + 1), generator=gen)
               for _ in range(run.steps + 1)]
    built = []
    for t in techniques_for(ctx.tp_size, ctx.dp_size):
        torch.manual_seed(run.seed)
        model = parallelize(GPT(cfg).to(ctx.device), ctx, attention="heads",
                            sequence_parallel=t.sequence_parallel, recompute=t.recompute,
                            activation_cache=t.activation_cache)
        opt = make_optimizer(model, ctx, t.zero, lr=1e-4)
        x, y = batches[0][:, :-1].to(ctx.device), batches[0][:, 1:].to(ctx.device)
        built.append((t, model, opt, activation_memory(model, x, y), [],
                      _tp_comm_bytes(model, opt, x, y, ctx.tp_group)))
    for round_, batch in enumerate(batches):
        x, y = batch[:, :-1].to(ctx.device), batch[:, 1:].to(ctx.device)
        for t, model, opt, _, times, _ in built:
            elapsed = _step(model, opt, x, y)
            if round_:  # the first round pays one-off costs
                times.append(elapsed)
    if ctx.rank != 0:
        return None
    return _rows(run, cfg, ctx, micro, built)


def _rows(run, cfg, ctx, micro, built) -> list[dict]:
    rows = []
    for t, model, opt, act, times, comm in built:
        state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                    if torch.is_tensor(v))
        per_layer = act["per_layer"]
        rows.append({**asdict(t), "per_layer": per_layer,
                     # the first layer also holds what all layers share (RoPE tables): report the last
                     "bytes_per_layer": per_layer[-1],
                     "formula_bytes_per_layer": _formula(run, cfg, t, ctx.tp_size, micro),
                     "activation_bytes": act["total_bytes"], "optimizer_state_bytes": state,
                     "tp_comm_bytes_per_step": comm,
                     "step_s": statistics.median(times), "step_times_s": times})
    plain = rows[0]
    for row in rows:
        row["activation_saving"] = 1 - row["activation_bytes"] / plain["activation_bytes"]
        row["optimizer_saving"] = 1 - row["optimizer_state_bytes"] / plain["optimizer_state_bytes"]
        row["step_ratio"] = row["step_s"] / plain["step_s"]
    return rows
