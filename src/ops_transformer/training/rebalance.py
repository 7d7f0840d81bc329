"""Resuming on another number of ranks: the layout re-planned so that the run stays the run (SPEC F13).

A checkpoint's manifest records the layout it was saved at (``dp × ep × tp``) and how the global
batch was split (its ``meta``, :func:`~ops_transformer.train.batch_layout`: global batch,
micro-batch, accumulation). Resuming on ``W`` ranks with ``rebalance="auto"`` (the default):

1. **tp, ep and cp** — the run's own when it states them, else the checkpoint's — are kept when
   they still fit ``W`` ranks (``tp · ep · cp`` divides ``W``, the global batch divides over the
   new data readers, ``train`` can run it — ``2·cp`` divides the sequence — and the model fits in
   memory); otherwise the planner ranks every other ``(tp, ep, cp)`` for ``W`` ranks
   (:func:`~ops_transformer.planner.search.evaluate`: fits in memory first — context
   parallelism divides the activations by ``cp`` — then the predicted step time) and the first
   that fits is taken. The ``cp`` ranks of a data reader share its rows, so ``cp`` changes
   nothing in the batch split; the checkpoint is in dense coordinates, so any ``cp`` reads it;
2. **dp** ``= W / (tp · ep · cp)`` (a stated ``--dp`` that no longer fits is replaced);
3. **accumulation** ``= global batch / (micro-batch · dp · ep)``: the micro-batch — what one
   forward sees, on which memory, MoE capacity and the load-balancing loss depend — is the
   checkpoint's, so ``micro × accum × dp × ep`` (the global batch) is unchanged, and with it the
   sample order (a batch's rows are a function of ``(seed, step)`` and their index alone,
   :mod:`ops_transformer.data`) and the learning-rate schedule (a function of the step);
4. ZeRO needs ``dp > 1`` and sequence parallelism ``tp > 1``: where the new layout has neither,
   they are turned off, and said;
5. **pp** (a checkpoint or a run with pipeline stages): the run's ``pp`` when its layout runs on
   ``W`` ranks, else the checkpoint's, else another that divides ``W``; then tp, dp and the
   accumulation as above (:func:`_rebalance_pipeline`; the pipeline's micro-batches stay).
   Context parallelism runs as given.

:func:`~ops_transformer.checkpoint.load_checkpoint` then reshards the parameters, the optimizer
(and ZeRO) state, the loss scaler and the RNG states. A size that holds neither the global batch
nor the model is a ``ValueError`` naming both. ``rebalance="off"`` keeps the layout and the
accumulation as given (the micro-batch then follows them). Pure logic: no process group.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .checkpoints import REBALANCE, saved_settings, saved_split
from ..comm.topology import cpu_topology
from ..planner.local import local_cluster
from ..planner.search import Options, evaluate, layout_problem
from ..planner.specs import ModelSpec
from ..planner.strategies import ATTENTION_STRATEGIES
from .loop import RESUMED_SETTINGS, TrainConfig, validate

LAYOUT_FIELDS = ("tp", "dp", "ep", "grad_accum", "cp")


@dataclass(frozen=True)
class Rebalanced:
    """What a resume on ``world_size`` ranks runs: ``cfg`` (the re-planned config), ``saved``
    (the checkpoint's layout and batch split, :func:`saved_split`; ``None`` without one) and
    ``notes`` (what changed, beyond the layout and the accumulation)."""

    cfg: TrainConfig
    world_size: int
    saved: dict | None = None
    notes: tuple[str, ...] = ()
    changed: bool = field(default=False)

    def message(self) -> str:
        """One line for stderr: the old and new layouts and accumulations (``""``: nothing
        changed)."""
        if not self.changed:
            return ""
        s, c = self.saved, self.cfg
        dp = self.world_size // (c.tp * c.ep * c.cp * c.pp)
        old = layout_text(s['dp'], s['ep'], s['tp'], s.get('pp', 1), s.get('cp', 1))
        text = (f"resuming step {s['step']} of {c.ckpt_dir} on {self.world_size} ranks (saved on "
                f"{s['world_size']}): layout {old}"
                f" → {layout_text(dp, c.ep, c.tp, c.pp, c.cp)}, accumulation {s['grad_accum']} → "
                f"{c.grad_accum} (global batch {c.batch}, micro-batch {s['micro_batch']} per "
                f"rank kept)")
        return "; ".join([text, *self.notes])


def layout_text(dp: int, ep: int, tp: int, pp: int = 1, cp: int = 1) -> str:
    """``"dp 2 × tp 2"`` (``"dp 1 × ep 2 × tp 1"`` with experts over ranks, ``"pp 2 × dp 1 ×
    tp 2"`` with pipeline stages, ``"dp 1 × cp 2 × tp 1"`` with the sequence split)."""
    return ((f"pp {pp} × " if pp > 1 else "") + f"dp {dp} × " + (f"ep {ep} × " if ep > 1 else "")
            + (f"cp {cp} × " if cp > 1 else "") + f"tp {tp}")


LORA_SETTINGS = ("lora_rank", "lora_alpha", "lora_targets", "lora_dropout")


def resumed_settings(cfg: TrainConfig, given: set[str]) -> tuple[TrainConfig, str]:
    """``cfg`` with the run's own settings for a ``--resume``: the batch, sequence, learning rate
    and schedule (:data:`~ops_transformer.train.RESUMED_SETTINGS`) and the LoRA adapters of the
    newest checkpoint in ``cfg.ckpt_dir``, except those in ``given`` (the fields the command line
    set); and one line saying what was taken and what overrides the checkpoint (``""``: nothing
    to say). A given LoRA rank or target list that is not the checkpoint's cannot load its
    adapters: a ``ValueError`` before any rank starts."""
    if not (cfg.resume and cfg.ckpt_dir):
        return cfg, ""
    saved = saved_settings(cfg.ckpt_dir)
    if saved is None:
        return cfg, ""
    values = dict(saved["settings"])
    if "batch" not in values and saved["global_batch"]:
        values["batch"] = saved["global_batch"]  # a checkpoint from before settings were kept
    lora = saved["lora"]
    _check_lora(cfg, given, lora, saved["step"])
    if lora:
        values.update(lora_rank=lora["rank"], lora_alpha=lora["alpha"],
                      lora_targets=tuple(lora["targets"]), lora_dropout=lora["dropout"])
    taken, overridden = {}, []
    for name, value in values.items():
        if name not in (*RESUMED_SETTINGS, *LORA_SETTINGS):
            continue
        mine = getattr(cfg, name)
        if name in given:
            if mine != value and name != "lora_targets":
                overridden.append(f"{_flag(name)} {_text(mine)} (the checkpoint's: "
                                  f"{_text(value)})")
        elif mine != value:
            taken[name] = value
    parts = []
    if taken:
        parts.append("kept the run's " + ", ".join(
            f"{_flag(k)[2:].replace('-', ' ')} {_text(v)}" for k, v in taken.items()
            if k != "lora_targets") + (" (and its LoRA targets)" if "lora_targets" in taken
                                       else ""))
    if overridden:
        parts.append("as given: " + ", ".join(overridden))
    line = (f"--resume from step {saved['step']} of {cfg.ckpt_dir}: " + "; ".join(parts)
            if parts else "")
    return dataclasses.replace(cfg, **taken), line


def _check_lora(cfg: TrainConfig, given: set[str], lora: dict | None, step: int) -> None:
    where = f"the checkpoint at step {step} in {cfg.ckpt_dir}"
    if lora is None:
        if "lora_rank" in given and cfg.lora_rank is not None:
            raise ValueError(f"--lora-rank {cfg.lora_rank}: {where} holds a whole model, no LoRA "
                             f"adapters; drop --lora-rank to resume it, or use a new --ckpt-dir")
        return
    if "lora_rank" in given and cfg.lora_rank != lora["rank"]:
        raise ValueError(f"--lora-rank {cfg.lora_rank} differs from {where}, whose adapters have "
                         f"rank {lora['rank']}: drop --lora-rank to resume them, or start a new "
                         f"--ckpt-dir")


def _flag(name: str) -> str:
    return "--" + {"lr_schedule": "lr-schedule"}.get(name, name.replace("_", "-"))


def _text(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def stated_fields(cfg: TrainConfig) -> set[str]:
    """The layout fields of ``cfg`` that differ from :class:`TrainConfig`'s defaults: what a
    caller that cannot say which it set is taken to have stated."""
    default = TrainConfig()
    return {k for k in LAYOUT_FIELDS if getattr(cfg, k) != getattr(default, k)}


def rebalance(cfg: TrainConfig, world_size: int, *, stated=None, cluster=None) -> Rebalanced:
    """``cfg`` re-planned for a resume on ``world_size`` ranks (module docstring); ``cfg``
    itself without ``--resume``, without a checkpoint, or with ``rebalance="off"``.

    ``stated``: the fields of :data:`LAYOUT_FIELDS` the caller set (the command line passes its
    flags; ``None``: :func:`stated_fields`) — a stated ``tp`` or ``ep`` is preferred to the
    checkpoint's. ``cluster``: the planner's picture of these ranks
    (:func:`~ops_transformer.planner.local.local_cluster`; ``None``: this machine's CPU ranks
    with the built-in profile)."""
    if cfg.rebalance not in REBALANCE:
        raise ValueError(f"--rebalance must be one of {', '.join(REBALANCE)}, got "
                         f"{cfg.rebalance!r}")
    if not (cfg.resume and cfg.ckpt_dir) or cfg.rebalance == "off":
        return Rebalanced(cfg, world_size)
    saved = saved_split(cfg.ckpt_dir, cfg.batch)
    if saved is None:
        return Rebalanced(cfg, world_size)
    if cfg.pp > 1 or saved.get("pp", 1) > 1:
        return _rebalance_pipeline(cfg, world_size, saved, stated)
    micro = saved["micro_batch"]
    if cfg.batch % micro:
        raise ValueError(f"--batch {cfg.batch} is not a multiple of the micro-batch of the "
                         f"checkpoint in {cfg.ckpt_dir} ({micro} sequences): pass a multiple, or "
                         f"--rebalance off to run the layout as given")
    stated = stated_fields(cfg) if stated is None else set(stated)
    prefer = tuple(getattr(cfg, k) if k in stated else saved.get(k, 1) for k in ("tp", "ep", "cp"))
    cluster = cluster or local_cluster(world_size, topology=cpu_topology())
    spec = model_spec(cfg, micro)
    problems = {}
    for tp, ep, cp in _ordered(cfg, world_size, prefer, spec, cluster):
        planned, notes = _with_layout(cfg, world_size, tp, ep, micro, cp)
        problem = _problem(planned, world_size, spec, cluster)
        if problem is None:
            return _result(cfg, planned, world_size, saved, stated, prefer, notes, problems)
        problems[(tp, ep, cp)] = problem
    raise _no_layout(cfg, world_size, micro, problems)


def _rebalance_pipeline(cfg: TrainConfig, world: int, saved: dict, stated) -> Rebalanced:
    """A resume where the checkpoint or the run has pipeline stages (``pp > 1``): the run's
    ``pp`` when it runs on ``world`` ranks, else the checkpoint's, else every other ``pp`` that
    divides them (1 first, then the deeper ones); ``tp`` as for any resume (the run's when
    stated, else the checkpoint's), then the others; ``dp = world / (pp · tp)`` and the
    accumulation that keeps the checkpoint's micro-batch (``train`` runs accumulation with pp:
    each accumulated micro-batch one schedule), so the global batch, the sample order and the
    pipeline's micro-batches are unchanged. ZeRO at dp 1 and sequence parallelism at tp 1 are
    turned off, and said."""
    micro = saved["micro_batch"]
    stated = stated_fields(cfg) if stated is None else set(stated)
    prefer_tp = cfg.tp if "tp" in stated else saved["tp"]
    pps = list(dict.fromkeys([cfg.pp, saved.get("pp", 1), 1, *_divisors(world)]))
    tps = list(dict.fromkeys([prefer_tp, *_divisors(world)]))
    problems = {}
    for pp in pps:
        for tp in tps:
            if world % (pp * tp):
                continue
            planned, notes = _with_layout(cfg, world // pp, tp, 1, micro)
            planned = dataclasses.replace(planned, pp=pp)
            try:
                validate(planned, world)
            except ValueError as exc:
                problems[(pp, tp)] = str(exc)
                continue
            if pp != cfg.pp:
                why = problems.get((cfg.pp, prefer_tp), "its layout does not run")
                notes.insert(0, f"pp {cfg.pp} does not fit {world} ranks ({why}): pp {pp}")
            if tp != prefer_tp:
                notes.insert(0, f"tp {prefer_tp} does not fit {world} ranks: tp {tp}")
            dp = world // (pp * tp)
            new = (world, pp, dp, tp, planned.grad_accum)
            old = (saved["world_size"], saved.get("pp", 1), saved["dp"], saved["tp"],
                   saved["grad_accum"])
            return Rebalanced(planned, world, saved, tuple(notes),
                              changed=new != old or bool(notes))
    tried = "; ".join(f"pp {pp} × tp {tp}: {why}" for (pp, tp), why in list(problems.items())[:3])
    raise ValueError(f"cannot resume {cfg.ckpt_dir} on {world} ranks: no pp × tp layout holds "
                     f"the global batch of {cfg.batch} sequences as micro-batches of {micro} and "
                     f"the model: {tried}; resume on another number of ranks, or pass "
                     f"--rebalance off")


def model_spec(cfg: TrainConfig, micro: int) -> ModelSpec:
    """The planner's picture of the run's model (the preset, or ``--model``'s config) at its
    sequence, global batch, ``micro``-batch and precision."""
    run = dict(seq=cfg.seq, global_batch=cfg.batch, micro_batch=micro, dtype=cfg.precision)
    if cfg.model:
        return ModelSpec.load(cfg.model, **run)
    return ModelSpec.from_gpt_config(cfg.model_config(), **run)


def _ordered(cfg, world: int, prefer: tuple[int, int, int], spec: ModelSpec, cluster) -> list:
    """``prefer`` first, then every other ``(tp, ep, cp)`` of ``world`` ranks as the planner ranks
    them: those that fit in memory first, then by predicted step time (``cp`` only where
    ``2·cp`` divides the sequence)."""
    pairs = [(tp, ep, cp) for tp in _divisors(world) for ep in _divisors(world // tp)
             for cp in _divisors(world // (tp * ep))
             if spec.experts % ep == 0 and (cp == 1 or cfg.seq % (2 * cp) == 0)
             and (tp, ep, cp) != prefer]
    rows = {(tp, ep, cp): _planned_row(cfg, world, tp, ep, spec, cluster, cp)
            for tp, ep, cp in pairs}
    ranked = sorted(pairs, key=lambda p: (rows[p] is None, not (rows[p] or {}).get("fits"),
                                          (rows[p] or {}).get("step_time_s", 0.0), p))
    return [prefer] + ranked


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _planned_row(cfg, world: int, tp: int, ep: int, model: ModelSpec, cluster,
                 cp: int = 1) -> dict | None:
    """The planner's row for ``model`` at ``tp × ep × cp`` on ``world`` ranks (its fastest
    attention strategy when ``cfg.attention`` is ``auto``; ``heads`` under cp), or ``None`` when
    no strategy is valid."""
    dp, micro = world // (tp * ep * cp), model.micro_batch
    strategies = ([cfg.attention] if cfg.attention != "auto" else
                  ["heads"] if tp == 1 or cp > 1 else list(ATTENTION_STRATEGIES))
    exchange = cfg.cp_strategy if cfg.cp_strategy in ("ring", "allgather_kv") else "ring"
    rows = []
    for attention in strategies:
        o = Options(dp, tp, ep, attention, bool(cfg.sequence_parallel) and tp > 1, cfg.recompute,
                    cfg.zero if dp * cp > 1 else 0, micro, cp=cp, cp_strategy=exchange)
        if layout_problem(model, cluster, o) is None:  # else: its sizes do not divide at tp
            rows.append(evaluate(model, cluster, o))
    return min(rows, key=lambda r: r["step_time_s"]) if rows else None


def _with_layout(cfg, world: int, tp: int, ep: int, micro: int,
                 cp: int = 1) -> tuple[TrainConfig, list]:
    """``cfg`` at ``tp × ep × cp`` on ``world`` ranks with the accumulation that keeps ``micro``;
    the notes say what else had to change (ZeRO at dp × cp 1, sequence parallelism at tp 1)."""
    dp = max(world // (tp * ep * cp), 1)  # (0 when tp × ep × cp does not fit: _problem says so)
    accum = max(cfg.batch // (micro * dp * ep), 1)
    changes, notes = {"tp": tp, "ep": ep, "cp": cp, "dp": None, "grad_accum": accum}, []
    if cfg.zero and dp * cp == 1:
        changes["zero"] = 0
        notes.append(f"ZeRO-{cfg.zero} off (it shards over data-parallel ranks: dp is 1)")
    if cfg.sequence_parallel and tp == 1:
        changes["sequence_parallel"] = False
        notes.append("sequence parallelism off (tp is 1)")
    return dataclasses.replace(cfg, **changes), notes


def _problem(cfg: TrainConfig, world: int, spec: ModelSpec, cluster) -> tuple[str, str] | None:
    """Why ``cfg`` cannot run on ``world`` ranks at ``spec``'s micro-batch (``None``: it can),
    as ``(kind, reason)``: ``ranks`` (``tp × ep`` does not divide them), ``batch`` (the
    micro-batches do not divide over the data-parallel readers) or ``model`` (``train`` refuses
    the layout, or the planner finds it too big for a rank's memory)."""
    if world % (cfg.tp * cfg.ep * cfg.cp):
        what = "tp × ep" + (" × cp" if cfg.cp > 1 else "")
        return "ranks", f"{what} = {cfg.tp * cfg.ep * cfg.cp} does not divide {world} ranks"
    readers, micro = world // (cfg.tp * cfg.cp), spec.micro_batch
    if cfg.batch % (micro * readers):
        return "batch", (f"{cfg.batch // micro} micro-batches do not divide over dp × ep = "
                         f"{readers}")
    try:
        validate(cfg, world)
    except ValueError as exc:
        return "model", str(exc)
    row = _planned_row(cfg, world, cfg.tp, cfg.ep, spec, cluster, cfg.cp)
    if row is not None and not row["fits"]:
        return "model", (f"needs {row['memory_per_gpu_bytes'] / 2**30:.1f} GiB per rank, one "
                         f"has {cluster.gpu.memory_bytes / 2**30:.1f}")
    return None


def _result(cfg, planned, world, saved, stated, prefer, notes, problems) -> Rebalanced:
    """The chosen config with what it changed: a stated degree not kept, a new ``dp``."""
    if (planned.tp, planned.ep, planned.cp) != prefer:
        why = problems.get(prefer, ("", ""))[1]
        notes.insert(0, f"{_degrees(*prefer)} does not fit {world} ranks ({why}): the planner "
                     f"chose {_degrees(planned.tp, planned.ep, planned.cp)}")
    dp = world // (planned.tp * planned.ep * planned.cp)
    if "dp" in stated and cfg.dp is not None and cfg.dp != dp:
        notes.append(f"--dp {cfg.dp} replaced by {dp}")
    if "grad_accum" in stated and cfg.grad_accum != planned.grad_accum:
        notes.append(f"--grad-accum {cfg.grad_accum} replaced by {planned.grad_accum} (it keeps "
                     f"the micro-batch; --rebalance off runs the one given)")
    new = (world, dp, planned.ep, planned.tp, planned.grad_accum, planned.cp)
    old = tuple(saved.get(k, 1) for k in ("world_size", "dp", "ep", "tp", "grad_accum", "cp"))
    return Rebalanced(planned, world, saved, tuple(notes), changed=new != old or bool(notes))


def _degrees(tp: int, ep: int, cp: int) -> str:
    """``"tp 2"``, ``"tp 1 × ep 2"``, ``"tp 1 × cp 2"``."""
    return f"tp {tp}" + (f" × ep {ep}" if ep > 1 else "") + (f" × cp {cp}" if cp > 1 else "")


def _no_layout(cfg, world: int, micro: int, problems: dict) -> ValueError:
    """The one-line error: the size against the global batch and the model, with why each
    layout tried does not hold them (a layout of ``tp = world`` always splits the batch, so at
    least one reason is the model's)."""
    tried = "; ".join(f"{_degrees(*degrees)}: {why}"
                      for degrees, (_, why) in list(problems.items())[:4])
    return ValueError(f"cannot resume {cfg.ckpt_dir} on {world} ranks: no layout of {world} "
                      f"ranks holds both the global batch of {cfg.batch} sequences (as "
                      f"{cfg.batch // micro} micro-batches of {micro}) and the model "
                      f"({cfg.model or cfg.preset}): {tried}; resume on another number of ranks, or pass "
                      f"--rebalance off (the micro-batch then changes)")
