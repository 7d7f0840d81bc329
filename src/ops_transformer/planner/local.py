"""This machine as a "cluster" for the planner (``plan --gpu local``): its CPU ranks over loopback.

Throughput and link figures come from the profile it is given (the command line passes the calibrated
one, ``ops-transformer calibrate``, when it exists), else from the rough
:data:`~ops_transformer.planner.hardware.CPU_GLOO`; memory is this machine's RAM shared by the
ranks; the topology is the one the caller detected
(:func:`~ops_transformer.comm.topology.detect_topology`: the command line runs it), so the planner
itself probes nothing.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from ..models.gpt import GPT
from .catalogue import GPU, Link
from .cost import Comm, comm_time
from .fp8 import FP8_BYTES, fp8_tp_comm
from .hardware import CPU_GLOO
from .layout import CostOptions, Layout, degree, legacy_arguments
from .specs import ClusterSpec
from .strategies import layer_cost, model_comm_per_step


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def local_profile(profile=None):
    """``profile`` (the command line passes the calibrated one when it exists), else the rough
    built-in :data:`CPU_GLOO`."""
    return profile if profile is not None else CPU_GLOO


def local_cluster(ranks: int, profile=None, *, topology) -> ClusterSpec:
    """``ranks`` local processes: the link of ``topology`` (a detected
    :class:`~ops_transformer.comm.topology.Topology`; loopback on a CPU machine) with the
    profile's α and β, the profile's matmul rate, and the RAM shared by the ranks."""
    if ranks < 1:
        raise ValueError(f"--gpus must be at least 1, got {ranks}")
    profile = local_profile(profile)
    flops = profile.matmul_flops
    device = GPU(f"local-{topology.kind} ({topology.source})", bf16_flops=flops, fp16_flops=flops, fp32_flops=flops,
                 memory_bytes=_ram_bytes() // ranks, memory_bandwidth=10e9, intra_link="loopback",
                 gpus_per_node=ranks, vendor="cpu")
    # a ring all-reduce over 2 ranks has 2 steps: the measured α is split over them
    link = Link(topology.intra_link_name(), bandwidth=profile.bandwidth,
                latency_s=profile.alpha_s / 2)
    return ClusterSpec(gpu=device, count=ranks, gpus_per_node=ranks, intra_link=link,
                       inter_link=None)


PRECISIONS = ("fp32", "bf16", "fp16")
LEGACY_STEP_KEYWORDS = ("tp", "dp", "ep", "attention", "vocab", "sequence_parallel", "recompute")


@dataclass(frozen=True)
class LocalTimeModel:
    """The step time of the reference GPT on this machine's CPU ranks, with the constants that
    ``ops-transformer calibrate`` fits (``"local_model"`` in the profile; ``plan --validate`` fits
    the same ones)::

        step = c · (FLOPs / matmul FLOP/s[precision, size] + layers × per_layer[precision]
                    + fixed[precision]) + calls × α_step + wire bytes / β

    with ``c`` the slowdown of ranks sharing the machine: 1 for one rank, ``sharing`` (measured
    with two) times ``max(1, ranks / max(cores, 2))`` for more. The per-layer and fixed overheads
    are what a CPU step costs besides its FLOPs (the framework's per-operator time, casts under
    autocast, the optimizer); ``α_step`` is the effective time of one collective call on a loaded
    machine (it includes the wait for the slower rank); ``β`` the profile's all-reduce bandwidth.
    The data-parallel gradient averaging is one all-reduce per 25 MiB bucket of each rank's
    parameters (ZeRO: a reduce-scatter and an all-gather)."""

    matmul_flops: dict  # precision -> {n: FLOP/s of an n × n product on one rank (one thread)}
    per_layer_s: dict  # precision -> seconds per layer per step beyond the FLOPs
    fixed_s: dict  # precision -> seconds per step beyond the layers
    alpha_step_s: float
    bandwidth: float
    cores: int
    sharing: float = 1.0  # how much slower each of two local ranks computes than one alone

    @classmethod
    def from_dict(cls, d: dict) -> LocalTimeModel:
        return cls({k: {int(n): float(f) for n, f in v.items()}
                    for k, v in d["matmul_flops"].items()},
                   {k: float(v) for k, v in d["per_layer_s"].items()},
                   {k: float(v) for k, v in d["fixed_s"].items()},
                   float(d["alpha_step_s"]), float(d["bandwidth"]), int(d["cores"]),
                   float(d.get("sharing", 1.0)))

    def to_dict(self) -> dict:
        return {"matmul_flops": {k: {str(n): f for n, f in v.items()}
                                 for k, v in self.matmul_flops.items()},
                "per_layer_s": dict(self.per_layer_s),
                "fixed_s": dict(self.fixed_s), "alpha_step_s": self.alpha_step_s,
                "bandwidth": self.bandwidth, "cores": self.cores, "sharing": self.sharing}

    def _of(self, table: dict, precision: str) -> float:
        """A precision's constant; fp16 falls back to bf16's (both autocast), then fp32's."""
        for p in (precision, "bf16" if precision == "fp16" else precision, "fp32"):
            if p in table:
                return table[p]
        raise ValueError(f"the local model has no constants for {precision!r}")

    def matmul_rate(self, precision: str, model_cfg, tp: int) -> float:
        """FLOP/s of this model's matmuls: the measured rate at the size ``√(h · d_ff/tp)`` (the
        geometric mean of a layer's two projection widths), interpolated on a log scale."""
        measured = sorted(self._of(self.matmul_flops, precision).items())
        n = math.sqrt(model_cfg.d_model * model_cfg.d_ff / tp)
        if n <= measured[0][0]:
            return measured[0][1]
        for (n0, f0), (n1, f1) in zip(measured, measured[1:]):
            if n <= n1:
                w = math.log(n / n0) / math.log(n1 / n0)
                return math.exp((1 - w) * math.log(f0) + w * math.log(f1))
        return measured[-1][1]

    def step_time(self, spec, layout=None, options=None, *, nproc: int, batch: int, seq: int,
                  precision: str = "fp32", zero: int = 0, partial_elements: int = 0,
                  **legacy) -> dict:
        """``{"step_s", "compute_s", "comm_s", "calls", "alone_s", "volume_s"}`` of one training
        step on one rank (``alone_s``: the compute of a rank alone on the machine; ``volume_s``:
        the communication's bandwidth term) of model ``spec`` on ``nproc`` local ranks laid out
        as ``layout`` (``tp``, ``dp``, ``ep``; ``dp`` unset: ``nproc / (tp · ep)``) with
        ``options`` (``attention``, ``vocab``, ``sequence_parallel``, ``recompute``), for a
        global ``batch`` of sequences of ``seq`` tokens, autocast ``precision`` and ZeRO stage
        ``zero``. The older form ``step_time(cfg, nproc=, tp=, dp=, ep=1, attention="heads",
        vocab="replicated", sequence_parallel=False, recompute="none", batch=, seq=, …)`` builds
        the two objects and gives the same numbers."""
        if layout is None and "tp" in legacy:
            old = legacy_arguments("step_time", (), (), legacy, LEGACY_STEP_KEYWORDS)
            if "dp" not in old:
                raise TypeError("step_time() missing required keyword argument 'dp'")
            layout = Layout(tp=old["tp"], dp=old["dp"], ep=old.get("ep", 1))
            options = CostOptions(attention=old.get("attention", "heads"),
                                  vocab=old.get("vocab", "replicated"),
                                  sequence_parallel=old.get("sequence_parallel", False),
                                  recompute=old.get("recompute", "none"))
        elif legacy:
            raise TypeError(f"step_time() got unexpected keyword arguments: {sorted(legacy)}")
        for name in ("cp", "pp"):
            if degree(layout, name) > 1:
                raise ValueError(f"the local time model prices dp × tp × ep layouts; layout.{name}"
                                 f" is {degree(layout, name)}")
        tp, ep = degree(layout, "tp"), degree(layout, "ep")
        dp = getattr(layout, "dp", None)
        dp = nproc // (tp * ep) if dp is None else degree(layout, "dp")
        o = CostOptions.of(options if options is not None else CostOptions(vocab="replicated"))
        return self._step_time(spec, nproc=nproc, tp=tp, dp=dp, ep=ep, attention=o.attention,
                               vocab=o.vocab, batch=batch, seq=seq, precision=precision,
                               sequence_parallel=o.sequence_parallel, recompute=o.recompute,
                               zero=zero, partial_elements=partial_elements)

    def _step_time(self, model_cfg, *, nproc: int, tp: int, dp: int, ep: int, attention: str,
                   vocab: str, batch: int, seq: int, precision: str,
                   sequence_parallel: bool | str, recompute: str, zero: int,
                   partial_elements: int) -> dict:
        rows = batch // max(dp * ep, 1)
        flops = step_flops_per_rank(model_cfg, tp, rows, seq, attention, vocab, recompute)
        layers = model_cfg.n_layers * (4 / 3 if recompute == "full" else 1.0)
        shared = 1.0 if nproc <= 1 else self.sharing * max(1.0, nproc / max(self.cores, 2))
        alone = (flops / self.matmul_rate(precision, model_cfg, tp)
                 + layers * self._of(self.per_layer_s, precision)
                 + self._of(self.fixed_s, precision))
        compute = shared * alone
        tp_comm = model_comm_per_step(
            model_cfg, Layout(tp=tp, ep=ep),
            CostOptions(attention=attention, vocab=vocab, sequence_parallel=sequence_parallel,
                        recompute=recompute), batch=rows, seq=seq,
            partial_elements=partial_elements)
        alpha_beta = lambda kind, group: (self.alpha_step_s, self.bandwidth)  # noqa: E731
        # TP activations in autocast's dtype (fp8: fp32, but the SP entries' 1-byte gathers)
        width = 4 if precision in ("fp32", "fp8") else 2
        bandwidth_only = lambda kind, group: (0.0, self.bandwidth)  # noqa: E731
        narrow = Comm()
        if precision == "fp8":
            tp_comm, narrow = fp8_tp_comm(tp_comm, model_cfg, tp, rows, seq,
                                          sequence_parallel=sequence_parallel,
                                          recompute=recompute)
        comm = (comm_time(tp_comm, tp, alpha_beta, width)
                + comm_time(narrow, tp, alpha_beta, FP8_BYTES))
        volume = (comm_time(tp_comm, tp, bandwidth_only, width)
                  + comm_time(narrow, tp, bandwidth_only, FP8_BYTES))
        calls = tp_comm.calls + narrow.calls
        if dp * ep > 1:
            grads = dp_grad_comm(model_cfg, tp, zero)
            comm += comm_time(grads, dp * ep, alpha_beta, 4)  # gradients reduce in fp32
            volume += comm_time(grads, dp * ep, bandwidth_only, 4)
            calls += grads.calls
        return {"step_s": compute + comm, "compute_s": compute, "comm_s": comm, "calls": calls,
                "alone_s": alone, "volume_s": volume}


def step_flops_per_rank(model_cfg, tp: int, batch: int, seq: int, attention: str = "heads",
                        vocab: str = "replicated", recompute: str = "none") -> float:
    """Training FLOPs of one step on one rank: the layers (:func:`~.strategies.layer_cost`), the
    LM head (split over ``tp`` only with a vocab-parallel plan), the replays of recompute (full:
    each layer's forward again; selective: the attention core's ``4·b·s²·h/tp``)."""
    m = model_cfg
    layer = layer_cost(attention, batch, seq, m.d_model, m.n_heads, m.n_kv_heads, m.d_ff, tp,
                       bias=m.bias, swiglu=m.mlp == "swiglu").flops
    if recompute == "full":
        layer *= 4 / 3
    elif recompute == "selective":
        layer += 4 * batch * seq * seq * m.d_model / tp
    head = 3 * 2 * batch * seq * m.d_model * m.vocab_size
    return m.n_layers * layer + head / (tp if vocab == "parallel" and tp > 1 else 1)


def dp_grad_comm(model_cfg, tp: int, zero: int = 0, bucket_bytes: int = 25 << 20) -> Comm:
    """The data-parallel gradient averaging of one step: each rank's share of the parameters
    (``1/tp`` of the dense ones), in 25 MiB fp32 buckets, plus the one coalesced all-reduce of the
    small metrics (loss, norm, overflow); ZeRO reduce-scatters the gradients and all-gathers the
    updated parameters instead."""
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(model_cfg).parameters()) / tp
    buckets = max(1, math.ceil(4 * params / bucket_bytes))
    out = Comm().add("all_reduce", 3)
    if zero:
        return out.add("reduce_scatter", params, buckets).add("all_gather", params, buckets)
    return out.add("all_reduce", params, buckets)


def local_time_model(profile) -> LocalTimeModel | None:
    """The calibrated local model of ``profile`` (``calibrate`` writes it), or ``None``."""
    data = getattr(profile, "local_model", None)
    return LocalTimeModel.from_dict(data) if data else None
