"""Choosing the attention strategy from the cost model, not from fixed thresholds (SPEC F5)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cost import wire_elements
from .hardware import CPU_GLOO, HardwareProfile
from .strategies import (ATTENTION_STRATEGIES, VOCAB_MODES, attention_cost, kv_problem,
                         split_comm, vocab_cost)


def resolve_profile(profile: HardwareProfile | None) -> HardwareProfile:
    """``profile``, or the built-in one. Nothing here reads a file: a calibrated profile reaches
    the cost model as an argument, usually ``ctx.profile`` (agreed by every rank at
    ``init_parallel``); the command line locates the file."""
    return profile if profile is not None else CPU_GLOO


def attention_problem(cfg, tp: int, strategy: str, seq: int | None = None) -> str | None:
    """Why ``strategy`` cannot run ``cfg`` at ``tp`` ranks, or ``None`` when it can."""
    if tp == 1:
        return None
    heads, kv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    if strategy in ("heads", "heads_allgather"):
        if heads % tp:
            return (f"n_heads ({heads}) is not divisible by tp ({tp}): head-parallel attention "
                    f"gives each rank whole heads")
        if kv_problem(kv, tp):
            return kv_problem(kv, tp)
    elif strategy == "kv_split":
        need = 2 * tp if cfg.pos == "rope" else tp
        if d % need:
            return f"head_dim ({d}) is not divisible by {need} (kv_split splits every head)"
        if seq is not None and seq % tp:
            return f"the sequence length ({seq}) is not divisible by tp ({tp}) (kv_split)"
    elif strategy == "naive":
        if cfg.d_model % tp or (kv * d) % tp:
            return (f"d_model ({cfg.d_model}) and the KV width ({kv * d}) must divide by tp "
                    f"({tp}) (naive)")
    return None


@dataclass(frozen=True)
class Option:
    strategy: str
    problem: str | None
    comm_s: float = 0.0
    compute_s: float = 0.0
    wire_bytes: float = 0.0

    @property
    def time_s(self) -> float:
        return self.comm_s + self.compute_s


def attention_options(cfg, tp: int, *, batch: int, seq: int,
                      profile: HardwareProfile | None = None, dtype=torch.float32) -> list[Option]:
    """Predicted time of one layer's attention (training step, one rank) per strategy."""
    profile = resolve_profile(profile)
    size = torch.empty((), dtype=dtype).element_size()
    options = []
    for strategy in ATTENTION_STRATEGIES:
        problem = attention_problem(cfg, tp, strategy, seq)
        if problem:
            options.append(Option(strategy, problem))
            continue
        cost = attention_cost(strategy, batch, seq, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, tp,
                              dtype, bias=cfg.bias)
        priced = cost.priced()  # each collective on its own group (KV replicas: a subgroup)
        wire = sum(wire_elements(k, c["elements"], p) * size
                   for p, comm in priced for k, c in comm.items())
        options.append(Option(strategy, None,
                              sum(profile.comm_time(comm, p, size) for p, comm in priced),
                              profile.compute_time(cost.flops), wire))
    return options


def choose_attention(cfg, tp: int, *, batch: int, seq: int,
                     profile: HardwareProfile | None = None) -> tuple[str, str]:
    """``(strategy, reason)``: the valid strategy with the least predicted time."""
    profile = resolve_profile(profile)
    options = attention_options(cfg, tp, batch=batch, seq=seq, profile=profile)
    valid = sorted((o for o in options if o.problem is None), key=lambda o: o.time_s)
    if not valid:
        raise ValueError(f"no attention strategy can split this model over tp ({tp}): "
                         + "; ".join(f"{o.strategy}: {o.problem}" for o in options))
    best = valid[0]
    others = ", ".join(f"{o.strategy} {o.time_s * 1e3:.3g}" for o in valid[1:])
    invalid = [o.strategy for o in options if o.problem]
    reason = (f"predicted {best.time_s * 1e3:.3g} ms/layer" + (f" vs {others}" if others else "")
              + f" (b={batch}, s={seq}, {profile.name})"
              + (f"; not possible: {', '.join(invalid)}" if invalid else ""))
    return best.strategy, reason


def choose_vocab(cfg, tp: int, *, batch: int, seq: int, profile: HardwareProfile | None = None,
                 head: str = "loss") -> tuple[str, str]:
    """``(mode, reason)``: shard the embedding and LM head over the vocabulary (3 collectives per
    step, ``1/tp`` of the head's FLOPs and logits) or keep them replicated (no collectives), by
    predicted time. A large vocabulary is split; a byte-level one usually is not. ``head`` as in
    :func:`~ops_transformer.planner.strategies.vocab_cost` (``cfg`` needs ``d_model`` and
    ``vocab_size``)."""
    profile = resolve_profile(profile)
    times = {}
    for mode in VOCAB_MODES:
        cost = vocab_cost(mode, batch, seq, cfg.d_model, cfg.vocab_size, tp, head=head)
        times[mode] = (sum(profile.comm_time(comm, p) for p, comm in cost.priced())
                       + profile.compute_time(cost.flops))
    mode = min(times, key=times.get)
    other = next(m for m in VOCAB_MODES if m != mode)
    return mode, (f"vocab {mode}: predicted {times[mode] * 1e3:.3g} ms/step vs {other} "
                  f"{times[other] * 1e3:.3g} (V={cfg.vocab_size})")


def choose_split(tokens: int, in_features: int, out_features: int, tp: int, input_layout: str,
                 output_layout: str, profile: HardwareProfile | None = None,
                 bytes_per_element: int = 4) -> tuple[str, dict[str, float]]:
    """Column or row for a standalone linear (:func:`~.strategies.split_comm`'s collectives,
    priced on ``profile``): ``(split, predicted seconds per option)``; ties go to column."""
    profile = resolve_profile(profile)
    times = {}
    for split in ("column", "row"):
        comm = split_comm(split, tokens, in_features, out_features, input_layout, output_layout)
        times[split] = sum(profile.comm_time(c, tp, bytes_per_element) for c in comm.values())
    return ("column" if times["column"] <= times["row"] else "row"), times
