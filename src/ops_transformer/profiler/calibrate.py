"""Measure this machine into a hardware profile (``ops-transformer calibrate``; SPEC F10, F11).

Three measurements, each a median of several timed runs, one intra-op thread per rank (as in
training, see :func:`~ops_transformer.parallel.launch.launch`):

- **matmul**: fp32 ``n × n`` products, ``2n³ / t`` FLOP/s for ``n`` in 256 … 2048. On a GPU also
  the **matmul efficiency** the planner uses (:mod:`.efficiency`): bf16 products of the shapes of
  a Transformer layer's projections (``tokens × h`` by ``h × 4h`` and back, ``h`` 4096 and 8192,
  8192 tokens), their best FLOP/s over the card's dense bf16 peak (:func:`gpu_efficiency`).
- **collectives**: all-reduce, all-gather, reduce-scatter and all-to-all on ``p`` local ranks, for
  messages of 4 B … 16 MiB (×4 steps). A message of ``n`` elements is the full logical tensor (the
  ledger's convention). Hockney's model ``t = α + w/β`` is fitted per kind, with ``w`` the bytes one
  rank sends with ring algorithms, :func:`~ops_transformer.comm.ledger.wire_elements` × 4:
  ``2(p−1)/p·n`` for an all-reduce, ``(p−1)/p·n`` for the others.
- **small messages**: two ranks swap ``n``-byte tensors, by a send/recv pair and by an all-gather;
  the profile records the size where the faster method changes (``None`` when one wins
  everywhere).
- **overlap** (CPU): how much of an all-reduce running beside matmuls is hidden, ``η``
  (:mod:`.overlap_efficiency`), which ``overlap="auto"`` weighs chunks by.
- **step-time model** (CPU machines): the constants of the local step-time model that ``sweep``,
  ``bench`` and ``train --plan`` predict with, fitted on small training runs
  (:mod:`.local_model`), under ``"local_model"``.

The profile (JSON, keys are strings)::

    {"name", "created", "machine": {...}, "matmul_flops": {n: FLOP/s}, "matmul_flops_best",
     "gpu": {"device", "catalogue", "bf16_flops": {shape: FLOP/s}, "peak_bf16_flops",
             "matmul_efficiency", "matmul_flops_by_dtype": {"bf16", "fp16", "fp32": FLOP/s}}
            (GPU machines only),
     "collectives": {p: {kind: {"alpha_s", "bandwidth", "fit", "fit_rel_error",
                                "points": [[message bytes, seconds], ...]}}},
     "p2p_threshold_bytes": int | null,
     "p2p": {"small_messages": "send_recv" | "all_gather",
             "points": [[bytes, send_recv s, all_gather s], ...]},
     "overlap": {"efficiency", "points": [{"bytes", "matmuls", "t_comm", "t_comp", "t_both",
                                           "efficiency"}, ...]} (CPU machines only)}

:func:`load_profile` turns it into a :class:`CalibratedProfile` for the cost model.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import time

import torch

from ..comm import collectives as C
from ..comm.ledger import wire_elements
from ..parallel.context import init_parallel
from ..launch.local import launch
from ..utils.progress import Progress
from .local_model import fit_local_model, fit_runs
from ..comm.topology import detect_topology
from ..planner.catalogue import GPUS, gpu_for_device
from .overlap_efficiency import measure_overlap

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
MATMUL_SIZES, QUICK_MATMUL_SIZES = (256, 512, 1024, 2048), (256, 512)
MESSAGE_BYTES = tuple(4 * 4 ** k for k in range(12))  # 4 B, 16 B, …, 16 MiB
QUICK_MESSAGE_BYTES = (4, 1024, 1 << 16, 1 << 20)
FP32 = 4


def repeats_for(nbytes: int, quick: bool) -> int:
    """Timed runs per point: many for small messages (noisy, cheap), few for large ones."""
    if quick:
        return 5
    return 41 if nbytes <= 1 << 16 else 21 if nbytes <= 1 << 20 else 7


def _weighted_line(pts, w) -> tuple[float, float]:
    """``(a, b)`` minimising ``Σ w·(t − a − b·x)²``, with ``a`` clamped at 0 (then ``b`` refitted
    through the origin): ``b = (W·Sxt − Sx·St) / (W·Sxx − Sx²)``, ``a = (St − b·Sx) / W`` with
    ``W = Σw``, ``Sx = Σw·x``, ``St = Σw·t``, ``Sxx = Σw·x²``, ``Sxt = Σw·x·t``."""
    W = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, pts))
    st = sum(wi * t for wi, (_, t) in zip(w, pts))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, pts))
    sxt = sum(wi * x * t for wi, (x, t) in zip(w, pts))
    b = (W * sxt - sx * st) / (W * sxx - sx * sx)
    a = (st - b * sx) / W
    return (a, b) if a >= 0 else (0.0, sxt / sxx)


def fit_alpha_beta(points, iterations: int = 50) -> tuple[float, float]:
    """``(α, β)`` of ``t = α + x/β`` over ``(x bytes, t seconds)`` points (least squares).

    Residuals are relative, so the small messages that fix ``α`` count as much as the large ones
    that fix ``β``: first weights ``w = 1/t²`` (closed form, :func:`_weighted_line`), then
    ``w = 1/f²`` with ``f = a + b·x`` the previous fit's prediction, until it settles (iteratively
    reweighted least squares). The second step treats over- and under-prediction alike: with
    ``1/t²`` alone, one fast small message (gloo's 1-element all-reduce) drags ``α`` far below every
    other size. ``α = a``, ``β = 1/b``; a negative ``a`` (latency lost in noise) becomes 0.
    """
    pts = [(float(x), float(t)) for x, t in points]
    if len({x for x, _ in pts}) < 2 or any(t <= 0 for _, t in pts):
        raise ValueError(f"fitting α and β needs two message sizes or more and positive times, "
                         f"got {pts}")
    a, b = _weighted_line(pts, [1.0 / t ** 2 for _, t in pts])
    for _ in range(iterations):
        if b <= 0:
            break
        prev = (a, b)
        a, b = _weighted_line(pts, [1.0 / (a + b * x) ** 2 for x, _ in pts])
        if abs(a - prev[0]) <= 1e-9 * max(a, 1e-30) and abs(b - prev[1]) <= 1e-9 * b:
            break
    if b <= 0:
        raise ValueError(f"the times do not grow with the message size; β cannot be fitted: {pts}")
    return a, 1.0 / b


def fit_rel_error(points, alpha: float, beta: float) -> float:
    """Median of ``|t − (α + x/β)| / t`` over the points."""
    return statistics.median(abs(t - alpha - x / beta) / t for x, t in points)


def crossover(points) -> tuple[int | None, str]:
    """Where the faster of send/recv and all-gather changes, from ``(bytes, t_p2p, t_ag)`` points.

    Each size votes for its faster method. Of all splits "sizes below ``s`` → one method, from
    ``s`` on → the other", and "one method at every size", the one that disagrees with the fewest
    votes wins (ties: one method everywhere, then the smallest ``s``), so a single noisy size does
    not move the threshold. Returns ``(s or None, the method for small messages)``.
    """
    pts = sorted(points)
    votes = ["send_recv" if tp < tg else "all_gather" for _, tp, tg in pts]
    best = None
    for k in range(len(pts)):
        for small in ("send_recv", "all_gather"):
            large = small if k == 0 else ("all_gather" if small == "send_recv" else "send_recv")
            errors = sum(v != small for v in votes[:k]) + sum(v != large for v in votes[k:])
            if best is None or errors < best[0]:
                best = (errors, k, small)
    _, k, small = best
    return (int(pts[k][0]) if k else None), small


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(op, group, device: torch.device, repeats: int) -> float:
    """Median seconds of one ``op()`` over ``repeats`` runs, each started after a barrier.

    One call per sample, not the mean of a back-to-back loop: on a shared CPU a few calls take a
    scheduler tick (~4 ms) longer, and a mean would carry those into every point of the fit."""
    op()  # the first call may set up connections
    _sync(device)
    times = []
    for _ in range(repeats):
        C.barrier(group)
        _sync(device)
        start = time.perf_counter()
        op()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def message_elements(kind: str, nbytes: int, p: int) -> int:
    """fp32 elements of a message of about ``nbytes``; a multiple of ``p`` when it is split."""
    n = max(1, nbytes // FP32)
    return n if kind == "all_reduce" else -(-n // p) * p


def _collective_op(kind: str, n: int, p: int, group, device):
    """The call to time for a message of ``n`` elements (the full tensor, ledger convention)."""
    full, shard = torch.zeros(n, device=device), torch.zeros(n // p, device=device)
    if kind == "all_reduce":
        return lambda: C.all_reduce(full, group)
    if kind == "all_gather":
        return lambda: C.all_gather_into(full, shard, group)
    if kind == "reduce_scatter":
        return lambda: C.reduce_scatter_into(shard, full, group)
    out = torch.zeros(n, device=device)
    return lambda: C.all_to_all_into(out, full, group)


def _matmul_worker(sizes, repeats: int, progress: bool) -> dict[int, float]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    flops = {}
    with Progress(len(sizes), desc="matmul", enabled=progress) as bar:
        for n in sizes:
            a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
            flops[n] = 2 * n ** 3 / _median_time(lambda: a @ b, None, device, repeats)
            bar.update(**{"GFLOP/s": flops[n] / 1e9})
    return flops


GPU_SHAPES = ((8192, 4096, 16384), (8192, 16384, 4096), (8192, 8192, 32768),
              (8192, 32768, 8192))  # (tokens, in, out): a layer's FFN projections at h 4096, 8192


def gpu_efficiency(device_name: str, memory_bytes: int, flops: dict) -> dict:
    """The profile's ``"gpu"`` entry from measured bf16 FLOP/s per shape: the best of them over
    the catalogue card's dense bf16 peak (``None`` for a card the catalogue lacks)."""
    card = gpu_for_device(device_name, memory_bytes)
    best = max(flops.values())
    peak = GPUS[card].bf16_flops if card else None
    return {"device": device_name, "catalogue": card, "bf16_flops": flops,
            "peak_bf16_flops": peak, "matmul_efficiency": best / peak if peak else None}


def bf16_matmul_flops(device: torch.device, shapes, repeats: int,
                      dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """FLOP/s of ``tokens × n_in`` by ``n_in × n_out`` products in ``dtype`` (bf16 unless
    told), one per shape."""
    flops = {}
    for tokens, n_in, n_out in shapes:
        a = torch.randn(tokens, n_in, device=device, dtype=dtype)
        w = torch.randn(n_in, n_out, device=device, dtype=dtype)
        seconds = _median_time(lambda: a @ w, None, device, repeats)
        flops[f"{tokens}x{n_in}x{n_out}"] = 2 * tokens * n_in * n_out / seconds
    return flops


def _gpu_matmul_worker(repeats: int) -> dict:
    """:data:`GPU_SHAPES` on this rank's GPU (one rank, ``cuda:0``), as the profile's entry."""
    device = torch.device("cuda", 0)
    props = torch.cuda.get_device_properties(device)
    entry = gpu_efficiency(props.name, props.total_memory,
                           bf16_matmul_flops(device, GPU_SHAPES, repeats))
    # the best rate per dtype (fp16 and fp32 on the first shape only: seconds, not minutes;
    # fp32 without TF32, torch's default for matmuls)
    entry["matmul_flops_by_dtype"] = {"bf16": max(entry["bf16_flops"].values()), **{
        name: max(bf16_matmul_flops(device, GPU_SHAPES[:1], repeats, dtype).values())
        for name, dtype in (("fp16", torch.float16), ("fp32", torch.float32))}}
    return entry


def _collectives_worker(message_bytes, quick: bool, progress: bool) -> dict[str, list]:
    ctx = init_parallel(tp=1)
    group, p = ctx.dp_group, ctx.dp_size
    points: dict[str, list] = {kind: [] for kind in KINDS}
    bar = Progress(len(KINDS) * len(message_bytes), desc=f"collectives p={p}",
                   enabled=progress and ctx.rank == 0)
    with bar:
        for kind in KINDS:
            for nbytes in message_bytes:
                n = message_elements(kind, nbytes, p)
                if points[kind] and points[kind][-1][0] == n * FP32:  # rounded up to p elements
                    bar.update(kind=kind)
                    continue
                op = _collective_op(kind, n, p, group, ctx.device)
                points[kind].append([n * FP32, _median_time(op, group, ctx.device,
                                                            repeats_for(n * FP32, quick))])
                bar.update(kind=kind)
    return points


def _p2p_worker(message_bytes, quick: bool, progress: bool) -> list[list]:
    ctx = init_parallel(tp=1)
    group, peer, dev = ctx.dp_group, 1 - ctx.rank, ctx.device
    points = []
    bar = Progress(len(message_bytes), desc="p2p vs all-gather", enabled=progress and ctx.rank == 0)
    with bar:
        for nbytes in message_bytes:
            n = max(1, nbytes // FP32)
            mine, theirs, both = (torch.zeros(n, device=dev), torch.zeros(n, device=dev),
                                  torch.zeros(2 * n, device=dev))

            def swap():  # one batched send + receive, as the p2p algorithms post it
                for work in C.run_swap(mine, theirs, peer, group, "calibrate.p2p"):
                    work.wait()

            reps = repeats_for(n * FP32, quick)
            t_p2p = _median_time(swap, group, dev, reps)
            t_ag = _median_time(lambda: C.all_gather_into(both, mine, group), group, dev, reps)
            points.append([n * FP32, t_p2p, t_ag])
            bar.update()
    return points


def _fit_kinds(per_rank: list[dict], p: int) -> dict:
    """Per kind: the slowest rank's median at each size, and the α–β fit on wire bytes.

    When the times do not grow with the size (noise above every transfer time, e.g. ``--quick``
    on a busy machine) the fit is replaced by bounds, ``"fit": "bounds"``: ``α = median t`` and
    ``β = max x/t``, the lowest bandwidth the points allow (since ``t ≥ x/β``)."""
    out = {}
    for kind in KINDS:
        points = [[b, max(r[kind][i][1] for r in per_rank)]
                  for i, (b, _) in enumerate(per_rank[0][kind])]
        wire = [(wire_elements(kind, b // FP32, p) * FP32, t) for b, t in points]
        try:
            (alpha, beta), how = fit_alpha_beta(wire), "least squares"
        except ValueError:
            alpha, beta = statistics.median(t for _, t in wire), max(x / t for x, t in wire)
            how = "bounds"
        out[kind] = {"alpha_s": alpha, "bandwidth": beta, "fit": how,
                     "fit_rel_error": fit_rel_error(wire, alpha, beta), "points": points}
    return out


def machine_info() -> dict:
    topology = detect_topology()
    return {"hostname": platform.node(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "python": platform.python_version(), "torch": torch.__version__,
            "backend": "nccl" if torch.cuda.is_available() else "gloo", "threads_per_rank": 1,
            "topology": topology.to_dict(with_matrix=topology.kind == "gpu")}


def calibrate(world_sizes=(2, 4), *, quick: bool = False, progress: bool = True,
              timeout: float = 900.0) -> dict:
    """Measure this machine; returns the profile (module docstring). ``quick``: fewer sizes and
    runs (seconds, for tests). ``timeout`` bounds each local job."""
    sizes = tuple(world_sizes)
    if not sizes or any(not isinstance(p, int) or p < 2 for p in sizes):
        raise ValueError(f"world sizes must be integers of at least 2, got {list(sizes)}")
    if torch.cuda.is_available() and max(sizes) > torch.cuda.device_count():
        raise ValueError(f"world size {max(sizes)} needs as many GPUs (one rank per GPU with "
                         f"nccl); this machine has {torch.cuda.device_count()}")
    machine = machine_info()
    messages = QUICK_MESSAGE_BYTES if quick else MESSAGE_BYTES
    matmul_sizes = QUICK_MATMUL_SIZES if quick else MATMUL_SIZES
    flops = launch(_matmul_worker, 1, matmul_sizes, 3 if quick else 7, progress,
                   timeout=timeout)[0]
    collectives = {str(p): _fit_kinds(launch(_collectives_worker, p, messages, quick, progress,
                                             timeout=timeout), p) for p in sorted(set(sizes))}
    per_rank = launch(_p2p_worker, 2, messages, quick, progress, timeout=timeout)
    p2p = [[b, max(r[i][1] for r in per_rank), max(r[i][2] for r in per_rank)]
           for i, (b, _, _) in enumerate(per_rank[0])]
    threshold, small = crossover(p2p)
    created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    profile = {"name": f"calibrated {machine['hostname']} ({machine['backend']})",
               "created": created, "machine": machine,
               "matmul_flops": {str(n): f for n, f in flops.items()},
               "matmul_flops_best": max(flops.values()), "collectives": collectives,
               "p2p_threshold_bytes": threshold, "p2p": {"small_messages": small, "points": p2p}}
    if torch.cuda.is_available():
        profile["gpu"] = launch(_gpu_matmul_worker, 1, 3 if quick else 10, timeout=timeout)[0]
    else:  # (NCCL runs on engines of its own; a GPU profile keeps η = 1)
        profile["overlap"] = measure_overlap(launch, quick=quick, timeout=timeout)
        # the step-time model of this machine's CPU ranks (sweep, bench, train --plan)
        base = collectives[str(min(sizes))]["all_reduce"]["bandwidth"]
        with Progress(fit_runs(quick), desc="step-time model", enabled=progress) as bar:
            model = fit_local_model(base, quick=quick, timeout=timeout, tick=bar.update)
        profile["local_model"] = model.to_dict()
    return profile
