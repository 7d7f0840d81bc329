"""Context parallelism's cost: what each strategy moves per layer, its time, and the automatic choice.

A sequence of ``s`` tokens is split over ``cp`` ranks (two chunks each, head-tail balanced for
causal attention: :mod:`ops_transformer.layers.context_attention`). Per Transformer layer and per
rank, with ``b`` rows, ``kv_dim`` = (this rank's KV heads) × head_dim (``h_kv``: ``n_kv_heads ·
head_dim / tp`` under tensor parallelism), and one block ``X = 2·b·(s/cp)·kv_dim`` elements (this
rank's K and V)::

    strategy       forward                                backward
    ring           cp−1 send_recv of X                     cp−1 send_recv of X (K, V) and
                   (each posted before the local block    cp send_recv of X (dK, dV travelling
                   is computed, so it hides behind it)    with their block, back to its owner)
    allgather_kv   one all-gather of cp·X = 2·b·s·kv_dim  one reduce-scatter of 2·b·s·kv_dim
    ulysses        three all-to-alls: Q (b·(s/cp)·q_dim),  the same three, reversed
                   K,V (X) and the output (b·(s/cp)·q_dim)

Elements follow the ledger's convention (:mod:`ops_transformer.comm.ledger`): a ``send_recv`` counts
what one rank sends, an all-gather its gathered output, a reduce-scatter its unscattered input.
Both move the same forward volume on the wire ((cp−1)·X per rank); the ring hides it behind
``cp−1`` blocks of attention, the all-gather does not, but costs one latency-bound collective
instead of ``cp−1`` exchanges and holds no block in flight — Llama 3 chose it (Dubey et al.
2024, §3.3.2: all-gather K/V, then attention on the local queries), cheap with GQA's small
``kv_dim``; Liu et al. 2023 (Ring Attention) and Megatron-LM's ``cp_comm_type="p2p"`` use the ring.

Activations inside a layer scale with the local tokens, ``1/cp`` (:func:`activation_factor`);
``allgather_kv`` also keeps the gathered K/V for backward (:func:`saved_kv_elements`).
:func:`propose_cp` is the smallest degree at which a rank's memory holds a long sequence.
"""

from __future__ import annotations

from .cost import Comm, collective_time

from ..schema.choices import CP_CHOICES, CP_STRATEGIES, ULYSSES
# What context parallelism does not compose with yet, and why (the refusals' one line: train,
# parallelize, the planner's rule; docs/context_parallel.md)
CP_LIMITS = {
    "hf_dropout": "Hugging Face models keep their own attention dropout, whose masks no rank "
                  "can split (the reference GPT's one-device masks: layers/dropout.py)",
}


def check_ulysses(heads: int, kv_heads: int, cp: int) -> None:
    """Ulysses gives each ``cp`` rank ``1/cp`` of the heads: a ``ValueError`` naming the sizes
    when ``cp`` does not divide this rank's query or KV heads (``cp ≤ kv heads``)."""
    for what, n in (("query", heads), ("KV", kv_heads)):
        if n % cp:
            raise ValueError(f"context_parallel='ulysses' splits the heads over cp ({cp}): cp "
                             f"must divide this rank's {what} heads ({n}); use cp ≤ {kv_heads} "
                             f"dividing it, or 'ring' / 'allgather_kv'")


def check_sequence(seq: int, cp: int) -> int:
    """The chunk length ``s / (2·cp)``; a ``ValueError`` naming the sizes when ``2·cp`` does not
    divide the sequence (every rank holds two equal chunks)."""
    if seq % (2 * cp):
        raise ValueError(f"context parallelism splits the sequence into 2·cp = {2 * cp} chunks: "
                         f"sequence length {seq} is not divisible by {2 * cp} (cp={cp})")
    return seq // (2 * cp)


def block_elements(*, batch: int, seq: int, kv_dim: int, cp: int) -> int:
    """``X = 2·b·(s/cp)·kv_dim``: this rank's K and V, the payload of one ring step."""
    return 2 * batch * (seq // cp) * kv_dim


def layer_comm(strategy: str, *, batch: int, seq: int, kv_dim: int,
               cp: int, q_dim: int | None = None) -> dict[str, Comm]:
    """``{"fwd": Comm, "bwd": Comm}``: the collectives one attention layer issues on one rank of a
    ``cp`` group — what :class:`~ops_transformer.comm.ledger.CommLedger` records (labels
    ``cp.ring.*`` / ``cp.allgather_kv.*`` / ``cp.ulysses.*``; ``ulysses`` needs ``q_dim``, this
    rank's query heads × head_dim)."""
    check_strategy(strategy)
    if cp <= 1:
        return {"fwd": Comm(), "bwd": Comm()}
    x = block_elements(batch=batch, seq=seq, kv_dim=kv_dim, cp=cp)
    if strategy == ULYSSES:  # Q, K/V (one message) and the output; backward the same reversed
        q = batch * (seq // cp) * q_dim
        one = Comm({"all_to_all": {"calls": 3, "elements": 2 * q + x}})
        return {"fwd": one, "bwd": Comm({"all_to_all": {"calls": 3, "elements": 2 * q + x}})}
    if strategy == "ring":
        return {"fwd": Comm({"send_recv": {"calls": cp - 1, "elements": (cp - 1) * x}}),
                "bwd": Comm({"send_recv": {"calls": 2 * cp - 1, "elements": (2 * cp - 1) * x}})}
    full = cp * x
    return {"fwd": Comm({"all_gather": {"calls": 1, "elements": full}}),
            "bwd": Comm({"reduce_scatter": {"calls": 1, "elements": full}})}


def check_strategy(strategy: str) -> None:
    if strategy not in CP_CHOICES[1:]:
        raise ValueError(f"context_parallel strategy must be one of {CP_CHOICES}, got "
                         f"{strategy!r}")


def activation_factor(cp: int) -> float:
    """The share of a layer's activations one rank keeps: its ``s/cp`` tokens."""
    return 1.0 / cp


def saved_kv_elements(strategy: str, *, batch: int, seq: int, kv_dim: int, cp: int) -> int:
    """K/V elements one layer keeps for backward beyond the local ones: the gathered sequence for
    ``allgather_kv`` (``(cp−1)·X``), none for ``ring`` (its blocks are in flight only)."""
    check_strategy(strategy)
    if strategy in ("ring", ULYSSES) or cp <= 1:  # ulysses: h/cp heads of the whole sequence
        return 0
    return (cp - 1) * block_elements(batch=batch, seq=seq, kv_dim=kv_dim, cp=cp)


def block_flops(*, batch: int, seq: int, q_dim: int, cp: int, causal: bool = True) -> float:
    """Forward flops of one rank's attention against one K/V block of another rank (scores and
    weighted sum, ``4·b·(s/cp)²·q_dim``); half of it for causal attention, where head-tail
    balancing leaves every such block half masked (the diagonal block costs as much)."""
    full = 4.0 * batch * (seq / cp) ** 2 * q_dim
    return full / 2 if causal else full


def layer_time(strategy: str, *, batch: int, seq: int, kv_dim: int, q_dim: int, cp: int,
               alpha_s: float, bandwidth: float, matmul_flops: float,
               bytes_per_element: int = 4, causal: bool = True) -> float:
    """Exposed communication seconds of one layer's forward and backward (α–β,
    :func:`~ops_transformer.planner.cost.collective_time`). Ring: each step's transfer runs
    behind one block of attention, so a step costs ``max(0, t_x − t_block)`` (backward: twice
    the traffic behind twice the compute, plus the last dK/dV hop home, which nothing hides).
    All-gather K/V: the all-gather and the reduce-scatter in full."""
    check_strategy(strategy)
    if cp <= 1:
        return 0.0
    x = block_elements(batch=batch, seq=seq, kv_dim=kv_dim, cp=cp)
    if strategy == ULYSSES:  # nothing hides the all-to-alls: attention waits for all heads
        c = layer_comm(strategy, batch=batch, seq=seq, kv_dim=kv_dim, cp=cp, q_dim=q_dim)
        return 2 * collective_time("all_to_all", c["fwd"]["all_to_all"]["elements"], cp,
                                   alpha_s=alpha_s, bandwidth=bandwidth,
                                   bytes_per_element=bytes_per_element, calls=3)
    if strategy == "ring":
        t_x = collective_time("send_recv", x, cp, alpha_s=alpha_s, bandwidth=bandwidth,
                              bytes_per_element=bytes_per_element)
        t_block = block_flops(batch=batch, seq=seq, q_dim=q_dim, cp=cp,
                              causal=causal) / matmul_flops
        return (cp - 1) * max(0.0, t_x - t_block) + (cp - 1) * max(0.0, 2 * t_x - 2 * t_block) \
            + t_x
    total = 0.0
    for kind, c in layer_comm(strategy, batch=batch, seq=seq, kv_dim=kv_dim, cp=cp)["fwd"].items():
        total += collective_time(kind, c["elements"], cp, alpha_s=alpha_s, bandwidth=bandwidth,
                                 bytes_per_element=bytes_per_element, calls=c["calls"])
    return 2 * total  # the reduce-scatter of dK/dV moves as much as the all-gather


def choose_strategy(*, batch: int, seq: int, kv_dim: int, q_dim: int, cp: int, alpha_s: float,
                    bandwidth: float, matmul_flops: float, bytes_per_element: int = 4,
                    causal: bool = True) -> tuple[str, str]:
    """``(strategy, reason)``: the strategy of lower :func:`layer_time`, ``allgather_kv`` on a tie
    (one collective, less code in flight); the reason gives both figures."""
    times = {s: layer_time(s, batch=batch, seq=seq, kv_dim=kv_dim, q_dim=q_dim, cp=cp,
                           alpha_s=alpha_s, bandwidth=bandwidth, matmul_flops=matmul_flops,
                           bytes_per_element=bytes_per_element, causal=causal)
             for s in CP_STRATEGIES}
    best = "ring" if times["ring"] < times["allgather_kv"] else "allgather_kv"
    reason = (f"exposed CP communication per layer at b={batch}, s={seq}, cp={cp}, "
              f"kv_dim={kv_dim}: ring {times['ring'] * 1e3:.3g} ms, allgather_kv "
              f"{times['allgather_kv'] * 1e3:.3g} ms")
    return best, reason


def propose_cp(*, activation_bytes: float, other_bytes: float, memory_bytes: float,
               seq: int, ranks: int) -> tuple[int, str]:
    """``(cp, reason)``: the smallest context-parallel degree (a power of two dividing ``ranks``
    and with ``2·cp`` dividing ``seq``) at which one rank's activations at ``cp = 1``
    (``activation_bytes``), scaled by :func:`activation_factor`, plus everything else it holds
    (``other_bytes``: weights, gradients, optimizer state) fit in ``memory_bytes``; ``1`` when
    they fit unsplit. A ``ValueError`` names the sizes when no degree fits — long sequences are
    where the planner proposes CP."""
    cp, tried = 1, []
    while cp <= ranks:
        if ranks % cp == 0 and seq % (2 * cp if cp > 1 else 1) == 0:
            need = other_bytes + activation_bytes * activation_factor(cp)
            tried.append(f"cp {cp}: {need / 2**30:.3g} GiB")
            if need <= memory_bytes:
                reason = ("fits unsplit" if cp == 1 else
                          f"activations at s={seq} need cp {cp} to fit "
                          f"{memory_bytes / 2**30:.3g} GiB per rank")
                return cp, f"{reason} ({'; '.join(tried)})"
        cp *= 2
    raise ValueError(f"no context-parallel degree up to {ranks} ranks fits a sequence of {seq} "
                     f"tokens in {memory_bytes / 2**30:.3g} GiB per rank: {'; '.join(tried)}")


def layer_figures(strategy: str, *, batch: int, seq: int, kv_dim: int, q_dim: int, cp: int,
                  alpha_s: float, bandwidth: float, matmul_flops: float,
                  bytes_per_element: int = 4, causal: bool = True) -> dict[str, float]:
    """What the diagnostics compare, per layer and rank, in seconds: ``transfer`` (one ring
    step's K/V, or the all-gather), ``block`` (the attention one ring step hides it behind),
    ``exposed`` (:func:`layer_time`, forward and backward) and ``attention`` (this rank's whole
    attention work, forward and backward: ``cp`` blocks, backward twice the forward)."""
    check_strategy(strategy)
    x = block_elements(batch=batch, seq=seq, kv_dim=kv_dim, cp=cp)
    kind, elements = {"ring": ("send_recv", x), "allgather_kv": ("all_gather", cp * x),
                      ULYSSES: ("all_to_all", 2 * batch * (seq // cp) * q_dim + x)}[strategy]
    block = block_flops(batch=batch, seq=seq, q_dim=q_dim, cp=cp, causal=causal) / matmul_flops
    return {"transfer": collective_time(kind, elements, cp, alpha_s=alpha_s, bandwidth=bandwidth,
                                        bytes_per_element=bytes_per_element),
            "block": block, "attention": 3 * cp * block,
            "exposed": layer_time(strategy, batch=batch, seq=seq, kv_dim=kv_dim, q_dim=q_dim,
                                  cp=cp, alpha_s=alpha_s, bandwidth=bandwidth,
                                  matmul_flops=matmul_flops, bytes_per_element=bytes_per_element,
                                  causal=causal)}
