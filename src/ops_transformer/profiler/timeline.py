r"""Where a rank's step time goes, from its profiler events: pure functions over time intervals.

A rank's events fall on two kinds of threads. **Step threads** run the step: the Python thread
and, on GPUs, autograd's device threads; there, ``ops_transformer::<kind>`` ranges are collective
calls and ``ops_transformer::wait:<kind>`` ranges waits on async handles
(:mod:`ops_transformer.comm.collectives`), every other event an operator. **Communication threads** are gloo's workers (``gloo:<op>`` events),
which move the data of every collective, also while the step threads compute.

Within one step ``[s0, s1]`` of length ``T``::

    exposed comm   E = |calls ∪ waits|                    (step threads blocked on communication)
    operators      O = |operators \ (calls ∪ waits)|      (matmul: the GEMM operators, M ⊆ O)
    host           H = T − O − E                          (Python between operators)
    compute        C = O + H
    comm           K = |calls ∪ waits ∪ gloo events|       (communication in flight)
    overlapped     K − E                                  (hidden behind compute)

On a CPU the host is the device: the Python between operators is work of the step, so it counts
as compute (reported apart as ``host``), and ``C + E = T``; nothing is idle that the profiler can
see. On a GPU the device's kernels replace the operators (NCCL kernels are the communication),
``C`` is the kernels' time, ``E`` the NCCL time no kernel hides, and ``idle = T − C − E`` is the
time the device waits for the host.
"""

from __future__ import annotations

from dataclasses import dataclass

# Operators that are matrix products (the "matmul" share of compute). Attention kernels are
# batched products of Q·Kᵀ and P·V.
GEMM_OPS = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::matmul",
    "aten::linear", "aten::_scaled_mm", "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention", "aten::_flash_attention_forward",
    "aten::_flash_attention_backward", "aten::_efficient_attention_forward",
    "aten::_efficient_attention_backward",
})
COMM_PREFIX = "ops_transformer::"
WAIT_PREFIX = "ops_transformer::wait:"
STEP_PREFIX = "ops_transformer::step#"
GLOO_PREFIX = "gloo:"
# gloo's event names per ledger kind (torch 2.x: gloo:all_reduce, gloo:all_gather_into_tensor, ...)
GLOO_KINDS = (("all_reduce", "all_reduce"), ("allreduce", "all_reduce"),
              ("all_gather", "all_gather"), ("allgather", "all_gather"),
              ("reduce_scatter", "reduce_scatter"), ("all_to_all", "all_to_all"),
              ("alltoall", "all_to_all"), ("broadcast", "broadcast"), ("send", "send"),
              ("recv", "recv"))
NCCL_KINDS = (("AllReduce", "all_reduce"), ("AllGather", "all_gather"),
              ("ReduceScatter", "reduce_scatter"), ("SendRecv", "all_to_all"),
              ("Broadcast", "broadcast"), ("Send", "send"), ("Recv", "recv"))


@dataclass(frozen=True)
class Event:
    """One profiler event: name, thread (or device stream), start and end in µs (one clock for
    all ranks of a node), and whether it ran on the device."""

    name: str
    thread: int
    start: float
    end: float
    device: bool = False

    @property
    def dur(self) -> float:
        return self.end - self.start


def union(intervals) -> list[tuple[float, float]]:
    """The sorted, disjoint union of ``(start, end)`` intervals."""
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        elif b > a:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def length(intervals) -> float:
    return sum(b - a for a, b in union(intervals))


def intersect(x, y) -> list[tuple[float, float]]:
    """``x ∩ y`` (each a union)."""
    x, y, out, i, j = union(x), union(y), [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if b > a:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(x, y) -> list[tuple[float, float]]:
    """``x \\ y``."""
    x = union(x)
    return union(_cut(x, union(y)))


def _cut(x, y):
    for a, b in x:
        for c, d in y:
            if d <= a or c >= b:
                continue
            if c > a:
                yield a, c
            a = max(a, d)
            if a >= b:
                break
        if b > a:
            yield a, b


def clip(intervals, lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def comm_kind(name: str) -> str | None:
    """The ledger kind of a communication event (our range, a wait, gloo's or NCCL's), else
    ``None``."""
    if name.startswith(WAIT_PREFIX):
        return name[len(WAIT_PREFIX):]
    if name.startswith(COMM_PREFIX) and not name.startswith(STEP_PREFIX):
        # a step of a multi-step algorithm is named <kind>.<where>.<step>: it belongs to <kind>
        return name[len(COMM_PREFIX):].split(".", 1)[0]
    if name.startswith(GLOO_PREFIX):
        op = name[len(GLOO_PREFIX):].lower()
        return next((kind for key, kind in GLOO_KINDS if op.startswith(key)), "other")
    if "nccl" in name.lower():
        return next((kind for key, kind in NCCL_KINDS if key in name), "other")
    return None


def is_background_comm(e: Event) -> bool:
    """An event of a communication thread (gloo's workers) or an NCCL kernel."""
    return e.name.startswith(GLOO_PREFIX) or (e.device and "nccl" in e.name.lower())


@dataclass
class StepTimes:
    """The split of one step on one rank (seconds)."""

    step: float
    compute: float
    matmul: float
    host: float
    exposed_comm: float
    comm: float
    idle: float

    @property
    def overlapped_comm(self) -> float:
        return max(self.comm - self.exposed_comm, 0.0)


def split_step(events: list[Event], s0: float, s1: float) -> StepTimes:
    """The split of the step ``[s0, s1]`` (µs) from this rank's events (module docstring)."""
    on_device = any(e.device for e in events)
    blocked, background, ops, gemm = [], [], [], []
    for e in events:
        if e.end <= s0 or e.start >= s1 or e.name.startswith(STEP_PREFIX):
            continue
        span = (e.start, e.end)
        if on_device:  # the device's kernels are the timeline; host events only bound the step
            if not e.device:
                continue
            if comm_kind(e.name) is not None:
                background.append(span)
            else:
                ops.append(span)
                if _is_gemm_kernel(e.name):
                    gemm.append(span)
        elif is_background_comm(e):
            background.append(span)
        elif comm_kind(e.name) is not None:
            blocked.append(span)
        else:
            ops.append(span)
            if e.name in GEMM_OPS:
                gemm.append(span)
    if on_device:  # communication not hidden behind a kernel is exposed
        blocked = subtract(background, ops)
    blocked = clip(union(blocked), s0, s1)
    ops = subtract(clip(ops, s0, s1), blocked)
    comm = union(blocked + clip(background, s0, s1))
    T = (s1 - s0) * 1e-6
    E, O = length(blocked) * 1e-6, length(ops) * 1e-6
    H = 0.0 if on_device else max(T - O - E, 0.0)
    return StepTimes(step=T, compute=O + H, host=H,
                     matmul=length(subtract(clip(gemm, s0, s1), blocked)) * 1e-6,
                     exposed_comm=E, comm=length(comm) * 1e-6, idle=max(T - O - H - E, 0.0))


def _is_gemm_kernel(name: str) -> bool:
    low = name.lower()
    return any(k in low for k in ("gemm", "sm80_xmma", "sm90_xmma", "cutlass", "flash", "fmha",
                                  "ampere_", "hopper_", "cublas"))


def kind_latencies(events: list[Event], steps: list[tuple[float, float]],
                   transfers: bool = True) -> dict[str, list[float]]:
    """Per ledger kind, the durations (s) of its collectives in the steps: gloo's worker events or
    NCCL's kernels (the transfer itself) when ``transfers`` and there are any, else the
    outermost of our call and wait ranges (a multi-step algorithm's steps nest in its call or its
    wait, and their transfers are other kinds: pass ``transfers=False`` when any ran)."""
    inside = [e for e in events if any(e.start < b and e.end > a for a, b in steps)]
    transfer: dict[str, list[float]] = {}
    calls: dict[str, list[float]] = {}
    ends: dict[int, float] = {}  # per thread: the end of the last outermost call range
    for e in sorted(inside, key=lambda e: (e.start, -e.end)):
        kind = comm_kind(e.name)
        if kind is None:
            continue
        if is_background_comm(e):
            transfer.setdefault(kind, []).append(e.dur * 1e-6)
        elif e.start >= ends.get(e.thread, float("-inf")):
            calls.setdefault(kind, []).append(e.dur * 1e-6)
            ends[e.thread] = e.end
    if not transfers:
        return calls
    return {kind: transfer.get(kind) or calls.get(kind, []) for kind in set(transfer) | set(calls)}


def comm_calls(events: list[Event], s0: float, s1: float) -> list[Event]:
    """The collective calls and waits of the step threads inside ``[s0, s1]``, outermost first."""
    return sorted((e for e in events if e.start >= s0 and e.end <= s1 and not e.device
                   and not is_background_comm(e) and comm_kind(e.name) is not None),
                  key=lambda e: (e.start, -e.end))


def top_level(events: list[Event], s0: float, s1: float) -> list[Event]:
    """The outermost step-thread events inside ``[s0, s1]``, in time order (host view)."""
    inner = sorted((e for e in events if e.start >= s0 and e.end <= s1 and not e.device
                    and not is_background_comm(e) and not e.name.startswith(STEP_PREFIX)),
                   key=lambda e: (e.start, -e.end))
    out: list[Event] = []
    ends: dict[int, float] = {}
    for e in inner:
        if e.start >= ends.get(e.thread, -1.0):
            out.append(e)
            ends[e.thread] = e.end
    return sorted(out, key=lambda e: e.start)


def segment_type(e: Event) -> str:
    """``"comm"`` (a collective call or wait), ``"matmul"`` or ``"compute"``."""
    if comm_kind(e.name) is not None:
        return "comm"
    if e.name in GEMM_OPS or any(f"{k}Backward" in e.name for k in _GEMM_GRADS):
        return "matmul"
    return "compute"


_GEMM_GRADS = ("Mm", "Addmm", "Bmm", "Baddbmm", "ScaledDotProductFlashAttentionForCpu",
               "ScaledDotProductFlashAttention", "ScaledDotProductEfficientAttention")
