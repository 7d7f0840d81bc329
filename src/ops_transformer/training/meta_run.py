"""A dry run: everything a ``train`` run builds on each rank — the parallel model with its plan
and every option (``parallelize``, LoRA, the ZeRO layout, the pipeline stages), its optimizer —
on the ``meta`` device, and what it built, without data, a step or parameter storage.

:func:`dry_run` checks the run as ``train`` does (:func:`~.loop.validate`: the same one-line
errors; a ``--model`` run is refused, not done yet), forks its ranks (the process groups are real; every collective is faked and held to
``meta`` by :class:`~ops_transformer.testing.devices.DeviceCheck`), runs
:func:`~.loop.setup_training` on each with ``meta`` as the device, and returns a plain dict: per
rank its coordinates, local parameter count and bytes and a short summary of the local shapes;
the ranks grouped by what they hold (``roles``); the plan's decisions and the tensor-parallel
communication the cost model expects per step (``expected_tp_comm_per_step``, the number a real
run reports)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch

from ..launch import launch
from ..layers.overlap_policy import overlap_summary
from ..testing.devices import DeviceCheck
from .config import RunConfig
from .loop import TrainConfig, _model_metrics, join, micro_batch, setup_training, validate

META = torch.device("meta")
COORDINATES = ("tp_rank", "dp_rank", "ep_rank", "cp_rank", "pp_rank")


def dry_run(config: RunConfig | TrainConfig, nproc: int | None = None) -> dict:
    """What ``train`` would build for ``config`` on ``nproc`` ranks (default: the product of its
    degrees), built on ``meta``: ``{"world_size", "layout", "plan", "attention", "vocab",
    "overlap", "expected_tp_comm_per_step", "ranks", "roles"}`` (JSON-serialisable). A bad
    configuration raises the ``ValueError`` ``train`` does, before any rank starts."""
    cfg = TrainConfig.from_run_config(config) if isinstance(config, RunConfig) else config
    if nproc is None:
        nproc = cfg.tp * cfg.ep * cfg.cp * cfg.pp * (cfg.dp or 1)
    if nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {nproc}")
    if cfg.model:  # from_pretrained reads values while it loads: not on meta yet
        raise ValueError(f"--dry-run builds the reference GPT presets; a --model dry run is not "
                         f"done yet (got --model {cfg.model})")
    validate(cfg, nproc)
    ranks = launch(_build_rank, nproc, cfg)
    first = ranks[0]
    return {"world_size": nproc, **first.pop("run"),
            "ranks": ranks, "roles": _roles(ranks)}


def _build_rank(cfg: TrainConfig) -> dict:
    """One rank's set-up on ``meta``: its parameters, and (on every rank, the same) the plan."""
    torch.set_num_threads(1)
    with join(cfg) as ctx:
        ctx = dataclasses.replace(ctx, device=META)
        with DeviceCheck(META, fake_collectives=True), torch.device(META):
            state = setup_training(cfg, ctx, with_data=False)
        model = state.model
        params = [_local(p) for p in dict.fromkeys(p for m in _modules(state)
                                                   for p in m.parameters())]
        shapes = Counter("x".join(map(str, p.shape)) or "scalar" for p in params)
        plan = model.parallel_plan
        run = {"layout": {"tp": ctx.tp_size, "dp": ctx.dp_size, "ep": ctx.ep_size,
                          "cp": getattr(ctx, "cp_size", 1), "pp": getattr(ctx, "pp_size", 1),
                          "micro_batch": micro_batch(cfg, ctx.dp_ep_size),
                          "grad_accum": cfg.grad_accum, "zero": cfg.zero},
               "plan": plan.to_dict(), "attention": plan.attention, "vocab": plan.vocab,
               "overlap": cfg.overlap, "overlap_reason": overlap_summary(model)}
        if not cfg.model:
            run["expected_tp_comm_per_step"] = _model_metrics(cfg, ctx, model)[
                "expected_tp_comm_per_step"]
        return {"rank": ctx.rank, **{k: getattr(ctx, k) for k in COORDINATES if hasattr(ctx, k)},
                "params": sum(p.numel() for p in params),
                "trainable_params": sum(p.numel() for p in params if p.requires_grad),
                "param_bytes": sum(p.numel() * p.element_size() for p in params),
                "all_meta": all(p.is_meta for p in params),
                "shapes": dict(sorted(shapes.items(), key=lambda kv: -kv[1])),
                **({"run": run} if ctx.rank == 0 else {})}


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``p`` (a ZeRO-3 parameter is a DTensor over dp: its shard)."""
    return p.to_local() if hasattr(p, "to_local") else p


def _modules(state) -> list[torch.nn.Module]:
    """This rank's modules: its pipeline stages under ``--pp``, else the model."""
    return list(state.pipe.stages) if state.pipe is not None else [state.model]


def _roles(ranks: list[dict]) -> list[dict]:
    """The ranks grouped by what they hold (the same parameter count, bytes and shapes)."""
    groups: dict[tuple, dict] = {}
    for r in ranks:
        key = (r["params"], r["param_bytes"], tuple(r["shapes"].items()))
        role = groups.setdefault(key, {"ranks": [], "params": r["params"],
                                       "param_bytes": r["param_bytes"], "shapes": r["shapes"]})
        role["ranks"].append(r["rank"])
    return list(groups.values())


def table(report: dict) -> str:
    """A short table of a dry run's report (at most 100 columns)."""
    lay = report["layout"]
    lines = [f"dry run on meta: {report['world_size']} rank(s), "
             + " × ".join(f"{k}={lay[k]}" for k in ("pp", "dp", "ep", "cp", "tp")
                          if lay[k] > 1 or k == "tp")
             + f", micro-batch {lay['micro_batch']}" + (f", ZeRO-{lay['zero']}" if lay['zero']
                                                        else ""),
             f"attention {report['attention']}, vocab {report['vocab']}, "
             f"overlap {report['overlap']}"]
    comm = report.get("expected_tp_comm_per_step")
    if comm:
        lines.append("expected tensor-parallel communication per step and rank:")
        lines += [f"  {name}: {v['calls']} calls, {v['elements']:,} elements"
                  for name, v in comm.items()]
    lines.append(f"{'ranks':<24}{'parameters':>14}{'MiB':>10}  shapes (local: count)")
    for role in report["roles"]:
        ranks = ",".join(map(str, role["ranks"]))
        ranks = ranks if len(ranks) <= 22 else ranks[:21] + "…"
        shapes = " ".join(f"{s}:{n}" for s, n in role["shapes"].items())
        shapes = shapes if len(shapes) <= 50 else shapes[:49] + "…"
        lines.append(f"{ranks:<24}{role['params']:>14,}{role['param_bytes'] / 2**20:>10.2f}  "
                     f"{shapes}")
    return "\n".join(line[:100] for line in lines)
