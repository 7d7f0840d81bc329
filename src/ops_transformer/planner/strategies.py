"""What each attention strategy and the FFN cost per Transformer layer: collectives, FLOPs, memory.

Pure functions of the shapes — ``b`` micro-batch, ``s`` sequence, ``h`` hidden, ``heads``,
``kv_heads``, ``ffn`` (the FFN width), ``tp`` — that count exactly what the layers in this package
issue, in the communication ledger's convention (``all_reduce``: the tensor; ``all_gather``: the
gathered output; ``reduce_scatter``: the unscattered input). ``tests/planner/test_strategy_costs.py``
checks every formula against the ledger of real runs.

FLOPs count multiply-adds as 2 and a training step as forward + backward = 3 × forward (Narayanan et
al. 2021, eq. 2). Activation memory follows Korthikanti et al. 2022 (Table 2, 16-bit activations:
per layer ``sbh(10 + 24/t + 5as/(ht))`` bytes for Megatron TP), rescaled here by ``dtype`` bytes / 2
and adapted per strategy as each docstring says.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .cost import Comm
from .layout import CostOptions, Layout, degree, is_legacy, legacy_arguments, positional_of
from .overlap import decoder_overlap_calls, moe_chunk_calls

from ..schema.choices import ATTENTION_STRATEGIES


@dataclass(frozen=True)
class LayerCost:
    """Per layer and per rank: collectives in forward and backward, FLOPs of a training step
    (forward + backward) and the activation bytes kept for backward."""

    fwd: Comm = field(default_factory=Comm)
    bwd: Comm = field(default_factory=Comm)
    flops: float = 0.0
    activation_bytes: float = 0.0
    group_size: int = 1  # the TP group the collectives run on
    subgroup: Comm = field(default_factory=Comm)  # the part of fwd + bwd on a smaller group
    subgroup_size: int = 1  # (replicated KV heads: tp / n_kv_heads ranks)

    def priced(self) -> list[tuple[int, Comm]]:
        """``(group size, collectives)`` pairs, for pricing each on its own group."""
        main = self.total().minus(self.subgroup)
        return [(p, comm) for p, comm in ((self.group_size, main),
                                          (self.subgroup_size, self.subgroup)) if comm]

    def total(self) -> Comm:
        return Comm.total((self.fwd, self.bwd))

    def __add__(self, other: LayerCost) -> LayerCost:
        return LayerCost(self.fwd + other.fwd, self.bwd + other.bwd,
                         self.flops + other.flops, self.activation_bytes + other.activation_bytes,
                         max(self.group_size, other.group_size), self.subgroup + other.subgroup,
                         max(self.subgroup_size, other.subgroup_size))


def _summed_per_step(kind: str, elements: int) -> Comm:
    """Gradient sums of replicated parameters: their elements count per layer, but all layers'
    go in one coalesced all-reduce per step (:mod:`ops_transformer.comm.bucketing`), so no call is
    counted per layer (see :func:`grad_sum_calls_per_step`)."""
    return Comm().add(kind, elements, calls=0)


def grad_sum_calls_per_step(strategy: str, kv_heads: int, tp: int) -> int:
    """Calls of the coalesced end-of-backward gradient sums per step (one per bucket of
    ``GradSums``; the reference models' fit one): the replicated K/V weights with ``tp >
    kv_heads`` (strategy A, on the replicas' group), strategy B's output projection (TP group)."""
    if tp == 1:
        return 0
    return int(strategy == "kv_split" or (strategy in ("heads", "heads_allgather")
                                          and kv_replicas(kv_heads, tp) > 1))


def kv_problem(kv_heads: int, tp: int, name: str = "n_kv_heads") -> str | None:
    """Why ``kv_heads`` KV heads cannot be laid out over ``tp`` ranks, or ``None`` (the one
    KV-replication rule, see :func:`kv_replicas`)."""
    if kv_heads % tp and tp % kv_heads:
        return (f"{name} ({kv_heads}) and tp ({tp}): KV heads can be split when tp divides "
                f"{name} or replicated when {name} divides tp; neither holds")
    return None


def kv_replicas(kv_heads: int, tp: int, name: str = "n_kv_heads") -> int:
    """The ranks that hold each KV head (SPEC F5): 1 when ``tp`` divides ``kv_heads`` (split with
    the query heads); ``tp // kv_heads`` when ``kv_heads`` divides ``tp`` (each KV head replicated
    on that many consecutive TP ranks, whose partial gradients are summed); otherwise a
    ``ValueError`` naming both. Plans, layers and cost formulas all read this rule."""
    problem = kv_problem(kv_heads, tp, name)
    if problem:
        raise ValueError(problem)
    return max(tp // kv_heads, 1)


def _bytes(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _attention_flops(b, s, h, kv_dim, tp, replicated_core=False, replicated_out=False) -> float:
    """Training FLOPs of one attention layer on one rank: projections ``2bsh(2h + 2·kv_dim)``,
    scores and weighted values ``4bs²h`` (causal masking not subtracted), times 3 for a step."""
    proj_qkv = 2 * b * s * h * (h + 2 * kv_dim)
    proj_out = 2 * b * s * h * h
    core = 4 * b * s * s * h
    per_rank = proj_qkv / tp + proj_out / (1 if replicated_out else tp) + core / (
        1 if replicated_core else tp)
    return 3.0 * per_rank


def _attention_activations(b, s, h, heads, tp, dtype, scores_divisor, extra_scores=0.0) -> float:
    """The attention block of Korthikanti et al. (2022, §4.1) in 16-bit bytes: its replicated input
    ``2sbh``; Q, K, V and the output-projection input ``8sbh``, divided by ``t``; scores, softmax
    output and dropout mask ``5as²b``, divided by ``scores_divisor`` (``t`` when heads or rows are
    split, 1 when the core is replicated); plus ``extra_scores``; scaled to ``dtype``."""
    scale = _bytes(dtype) / 2
    return scale * (2 * s * b * h + 8 * s * b * h / tp
                    + (5 * heads * s * s * b) / scores_divisor + extra_scores)


def attention_cost(strategy: str, b: int, s: int, h: int, heads: int, kv_heads: int, tp: int,
                   dtype=torch.float32, *, bias: bool = True) -> LayerCost:
    """The attention block of one layer under ``strategy`` (see :data:`ATTENTION_STRATEGIES`).

    * ``heads`` (Megatron): Q/K/V column-parallel behind one ``copy_to_tp_region``, output
      projection row-parallel. fwd: all-reduce ``bsh``; bwd: all-reduce ``bsh``. When
      ``tp > kv_heads`` the replicated K/V weights (and V bias) are summed over their replicas'
      group in backward (``head_dim·h`` elements each; coalesced for all layers into one call
      per step, :func:`grad_sum_calls_per_step`).
    * ``heads_allgather``: the output projection replicated after an all-gather of the head outputs.
      fwd: all-gather ``bsh``; bwd: all-reduce ``bsh`` (+ the same KV-replica sums). The output
      projection's FLOPs are not divided by ``tp``.
    * ``kv_split`` (strategy B, :mod:`ops_transformer.layers.attention`): fwd reduce-scatter of the
      partial scores ``b·heads·s²``, all-gather of V ``b·s·kv_dim`` and of the output ``bsh``;
      bwd all-gather of the score gradient ``b·heads·s²``, reduce-scatter of the V gradient, all-reduce
      of the input gradient ``bsh`` and of the replicated output projection's gradient
      (``h²``, and ``h`` with a bias; coalesced, no call per layer). Every rank also holds the full partial scores before the
      reduce-scatter (``b·heads·s²`` more activation elements).
    * ``naive``: each of Q, K, V and the output projection an isolated column-parallel linear with
      its output gathered; attention computed replicated. fwd: all-gathers ``bsh``, ``b·s·kv_dim``
      twice, ``bsh``; bwd: 4 all-reduces of ``bsh`` (each linear's input gradient).
    """
    if strategy not in ATTENTION_STRATEGIES:
        raise ValueError(f"strategy must be one of {ATTENTION_STRATEGIES}, got {strategy!r}")
    head_dim, bsh = h // heads, b * s * h
    kv_dim = kv_heads * head_dim
    if tp == 1:
        return LayerCost(flops=_attention_flops(b, s, h, kv_dim, 1),
                         activation_bytes=_attention_activations(b, s, h, heads, 1, dtype, 1))
    head_parallel = strategy in ("heads", "heads_allgather")
    replica, replicas = Comm(), kv_replicas(kv_heads, tp) if head_parallel else 1
    if replicas > 1:  # wk.weight, wv.weight, wv.bias
        replica = _summed_per_step("all_reduce", 2 * head_dim * h + (head_dim if bias else 0))
    groups = {"group_size": tp, "subgroup": replica, "subgroup_size": replicas if replica else 1}
    if strategy == "heads":
        return LayerCost(Comm.of(("all_reduce", bsh)), Comm.of(("all_reduce", bsh)) + replica,
                         _attention_flops(b, s, h, kv_dim, tp),
                         _attention_activations(b, s, h, heads, tp, dtype, tp), **groups)
    if strategy == "heads_allgather":
        return LayerCost(Comm.of(("all_gather", bsh)), Comm.of(("all_reduce", bsh)) + replica,
                         _attention_flops(b, s, h, kv_dim, tp, replicated_out=True),
                         _attention_activations(b, s, h, heads, tp, dtype, tp), **groups)
    if strategy == "kv_split":
        scores, v = b * heads * s * s, b * s * kv_dim
        return LayerCost(
            Comm.of(("reduce_scatter", scores), ("all_gather", v), ("all_gather", bsh)),
            Comm.of(("all_gather", scores), ("reduce_scatter", v), ("all_reduce", bsh))
            + _summed_per_step("all_reduce", h * h + (h if bias else 0)),
            _attention_flops(b, s, h, kv_dim, tp),
            _attention_activations(b, s, h, heads, tp, dtype, tp, extra_scores=2 * scores), tp)
    kv = b * s * kv_dim  # naive
    return LayerCost(
        Comm.of(("all_gather", bsh), ("all_gather", kv), ("all_gather", kv), ("all_gather", bsh)),
        Comm.of(*[("all_reduce", bsh)] * 4),
        _attention_flops(b, s, h, kv_dim, tp, replicated_core=True),
        _attention_activations(b, s, h, heads, tp, dtype, 1), tp)


def ffn_cost(b: int, s: int, h: int, ffn: int, tp: int, dtype=torch.float32, *,
             swiglu: bool = False) -> LayerCost:
    """Column→row FFN (Megatron). fwd: all-reduce ``bsh`` (after the row-parallel projection);
    bwd: all-reduce ``bsh`` (the column-parallel input gradient). FLOPs ``2bsh·ffn·(2 or 3)``
    per forward (3 matrices with SwiGLU), divided by ``tp``; activations (Korthikanti et al.
    2022, MLP block) ``sbh(2 + 16/t)`` 16-bit bytes for ``ffn = 4h``, generalised to
    ``2sbh + 4·sb·ffn/t``."""
    bsh = b * s * h
    mats = 3 if swiglu else 2
    flops = 3.0 * 2 * b * s * h * ffn * mats / tp
    act = (_bytes(dtype) / 2) * (2 * bsh + 4 * b * s * ffn * (mats - 1) / tp)
    if tp == 1:
        return LayerCost(flops=flops, activation_bytes=act)
    return LayerCost(Comm.of(("all_reduce", bsh)), Comm.of(("all_reduce", bsh)), flops, act, tp)


def layer_cost(strategy: str, b: int, s: int, h: int, heads: int, kv_heads: int, ffn: int,
               tp: int, dtype=torch.float32, *, bias: bool = True,
               swiglu: bool = False) -> LayerCost:
    """One Transformer layer: attention under ``strategy`` plus the column→row FFN."""
    return (attention_cost(strategy, b, s, h, heads, kv_heads, tp, dtype, bias=bias)
            + ffn_cost(b, s, h, ffn, tp, dtype, swiglu=swiglu))


LINEAR_LAYOUTS = ("replicated", "sharded")


def split_comm(split: str, tokens: int, in_features: int, out_features: int,
               input_layout: str, output_layout: str) -> dict[str, Comm]:
    """The collectives of a standalone linear split by ``column`` or ``row`` (SPEC F3; the table
    is in :mod:`ops_transformer.parallelize.linear_split`): ``{"fwd": Comm, "bwd": Comm}`` in the
    ledger's convention, for ``tokens`` rows and the given input and output layouts."""
    n_in, n_out = tokens * in_features, tokens * out_features
    fwd, bwd = [], []
    if split == "column":
        if input_layout == "sharded":
            fwd.append(("all_gather", n_in))
            bwd.append(("reduce_scatter", n_in))
        else:
            bwd.append(("all_reduce", n_in))
        if output_layout == "replicated":
            fwd.append(("all_gather", n_out))
    else:
        fwd.append(("all_reduce", n_out))
        if input_layout == "replicated":
            bwd.append(("all_gather", n_in))
        if output_layout == "sharded":
            bwd.append(("all_gather", n_out))
    return {"fwd": Comm.of(*fwd), "bwd": Comm.of(*bwd)}


from ..schema.choices import VOCAB_MODES
VOCAB_HEADS = ("loss", "logits", "none")  # what follows the embedding (see vocab_cost)


def vocab_cost(mode: str, b: int, s: int, h: int, vocab: int, tp: int,
               dtype=torch.float32, head: str = "loss") -> LayerCost:
    """The embedding, LM head and loss of one step on one rank.

    * ``parallel``: vocab-parallel embedding (fwd all-reduce ``bsh``), vocab-parallel head and loss
      (fwd one all-gather of 3 statistics per token from every rank, ``tp·3N`` elements,
      ``N = bs``; bwd all-reduce ``bsh`` of the head's input gradient); head FLOPs ``3·2·bsh·V``
      divided by ``tp``, logits ``bs·V/tp``.
    * ``replicated``: embedding and head dense on every rank: no communication (their input and
      its gradient are already replicated), the head's full FLOPs and logits on every rank.

    ``head`` is what follows the embedding: ``loss`` (the above), ``logits`` (a Hugging Face head
    that returns the full logits: its all-gather moves ``N·V_padded`` elements instead of the
    loss statistics) or ``none`` (a base model: the embedding alone, no head FLOPs).
    """
    if mode not in VOCAB_MODES:
        raise ValueError(f"vocab must be one of {VOCAB_MODES}, got {mode!r}")
    if head not in VOCAB_HEADS:
        raise ValueError(f"head must be one of {VOCAB_HEADS}, got {head!r}")
    bsh, tokens = b * s * h, b * s
    split = tp if mode == "parallel" else 1
    flops = 3.0 * 2 * bsh * vocab / split if head != "none" else 0.0
    logits = _bytes(dtype) * tokens * vocab / split if head != "none" else 0.0
    if mode == "replicated" or tp == 1:
        return LayerCost(flops=flops, activation_bytes=logits)
    if head == "none":
        return LayerCost(Comm.of(("all_reduce", bsh)), Comm(), flops, logits, tp)
    gathered = tp * 3 * tokens if head == "loss" else tokens * -(-vocab // tp) * tp
    return LayerCost(Comm.of(("all_reduce", bsh), ("all_gather", gathered)),
                     Comm.of(("all_reduce", bsh)), flops, logits, tp)


LEGACY_COMM = ("tp", "attention", "batch", "seq", "vocab")  # the older form's positions
LEGACY_COMM_KEYWORDS = LEGACY_COMM + ("sequence_parallel", "recompute", "overlap", "chunks", "ep")


def model_comm_per_step(spec, layout=None, options=None, *legacy, batch: int | None = None,
                        seq: int | None = None, grad_accum: int = 1, partial_elements: int = 0,
                        profile=None, **legacy_keywords) -> Comm:
    """The tensor-parallel collectives of one training step of the reference decoder on one rank:
    ``spec`` the model (a :class:`~ops_transformer.models.GPTConfig`, the description the planner
    and the model share), ``layout`` the rank grid (:class:`~.layout.Layout`, or any object with
    ``tp``, ``ep``, ``cp``: a run configuration's ``layout`` section), ``options`` what
    ``parallelize`` applies (a ``ParallelOptions`` with its attention and vocabulary chosen, or a
    :class:`~.layout.CostOptions`), for a micro-batch of ``batch`` sequences of ``seq`` tokens
    (``seq / cp`` of them on this rank). The older form ``model_comm_per_step(cfg, tp, attention,
    batch, seq, vocab="parallel", *, sequence_parallel=, recompute=, overlap=, chunks=, ep=, …)``
    builds the two objects (:func:`legacy_comm_arguments`) and gives the same numbers."""
    if is_legacy(layout, legacy_keywords):
        given = {k: v for k, v in (("batch", batch), ("seq", seq)) if v is not None}
        layout, options, batch, seq = legacy_comm_arguments(
            positional_of(layout, options, *legacy), {**legacy_keywords, **given})
    elif legacy or legacy_keywords:
        raise TypeError(f"model_comm_per_step(spec, layout, options, *, batch, seq, grad_accum, "
                        f"partial_elements, profile) got unexpected arguments: "
                        f"{list(legacy) + sorted(legacy_keywords)}")
    if batch is None or seq is None:
        raise TypeError("model_comm_per_step() needs batch= and seq= (the micro-batch's "
                        "sequences and their length)")
    options = CostOptions.of(options)
    cp = degree(layout, "cp")
    if seq % cp:
        raise ValueError(f"cp ({cp}) must divide the sequence length ({seq})")
    return _model_comm(spec, degree(layout, "tp"), options.attention, batch, seq // cp,
                       options.vocab, sequence_parallel=options.sequence_parallel,
                       recompute=options.recompute, partial_elements=partial_elements,
                       overlap=options.overlap, chunks=options.chunks, profile=profile,
                       ep=degree(layout, "ep"), grad_accum=grad_accum)


def legacy_comm_arguments(positional: tuple, keywords: dict):
    """``(Layout, CostOptions, batch, seq)`` from :func:`model_comm_per_step`'s older loose
    arguments (``tp``, ``attention``, ``batch``, ``seq``, ``vocab`` by position or name;
    ``sequence_parallel``, ``recompute``, ``overlap``, ``chunks``, ``ep`` by name)."""
    old = legacy_arguments("model_comm_per_step", LEGACY_COMM, positional, keywords,
                           LEGACY_COMM_KEYWORDS)
    for name in ("tp", "attention", "batch", "seq"):
        if name not in old:
            raise TypeError(f"model_comm_per_step() missing required argument {name!r}")
    layout = Layout(tp=old["tp"], ep=old.get("ep", 1))
    options = CostOptions(attention=old["attention"], vocab=old.get("vocab", "parallel"),
                          sequence_parallel=old.get("sequence_parallel", False),
                          recompute=old.get("recompute", "none"),
                          overlap=old.get("overlap", "none"), chunks=old.get("chunks", 2))
    return layout, options, old["batch"], old["seq"]


def _model_comm(cfg, tp: int, attention: str, batch: int, seq: int, vocab: str, *,
                sequence_parallel: bool | str, recompute: str, partial_elements: int,
                overlap: str, chunks: int, profile, ep: int, grad_accum: int) -> Comm:
    """:func:`model_comm_per_step` on loose sizes: ``n_layers`` ×
    :func:`layer_cost`, plus :func:`vocab_cost` of the embedding, LM head and loss, plus the one
    coalesced call of strategy B's output-projection gradient sums (on the TP group; replicated
    KV heads sum on their replicas' smaller group). An MoE layer's FFN pair is counted on
    ``batch·seq·top_k`` routed slots (:func:`moe_cost`): exact in calls, in elements only for a
    balanced routing.

    With ``sequence_parallel`` each layer is :func:`sequence_parallel_cost`, and around the layers
    come the entry's backward and the exit's forward all-gather (``b·s·h`` each) and the one
    coalesced all-reduce of the ``partial_elements`` norm (and row-bias) gradients;
    ``sequence_parallel="regather"`` adds each layer's :func:`regather_cost` (not with
    ``recompute="full"``, under which ``parallelize`` runs plain sequence parallelism);
    ``recompute="full"`` adds each layer's :func:`full_recompute_replay`. ``overlap`` /
    ``chunks`` (``profile``: the one ``auto`` decides on) add the calls of the chunked regions
    (:func:`~.overlap.decoder_overlap_calls`; the elements stay; the re-gathering entries stay
    whole; over ``ep > 1`` ranks an MoE layer's chunks add TP all-reduces too,
    :func:`~.overlap.moe_chunk_calls`). With ``grad_accum``
    micro-batches per step, what a forward and backward issue repeats ``grad_accum`` times; the
    gradient sums run once, on the accumulated gradients."""
    if tp == 1:
        return Comm()
    swiglu = cfg.mlp == "swiglu"
    cost = layer_cost(attention, batch, seq, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff,
                      tp, bias=cfg.bias, swiglu=swiglu)
    cost = sequence_parallel_cost(cost) if sequence_parallel else cost
    layer = cost.total()
    if sequence_parallel == "regather" and recompute != "full":
        layer = layer + regather_cost(batch, seq, cfg.d_model)
    if recompute == "full":
        layer = layer + full_recompute_replay(cost, batch, seq, cfg.d_model)
    micro = layer.scaled(cfg.n_layers) + vocab_cost(vocab, batch, seq, cfg.d_model,
                                                    cfg.vocab_size, tp).total()
    if sequence_parallel:
        bsh = batch * seq * cfg.d_model
        micro = micro + Comm.of(("all_gather", bsh), ("all_gather", bsh))
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    if overlap != "none":
        kv_local = cfg.n_kv_heads * cfg.head_dim * (
            kv_replicas(cfg.n_kv_heads, tp) if attention.startswith("heads") else 1) // tp
        micro = micro + decoder_overlap_calls(
            b=batch, s=seq, h=cfg.d_model, qkv_out=cfg.d_model // tp + 2 * kv_local,
            ffn_in=(2 if swiglu else 1) * cfg.d_ff // tp, ffn=cfg.d_ff, tp=tp,
            layers=cfg.n_layers, attention=attention, sequence_parallel=bool(sequence_parallel),
            regather=sequence_parallel == "regather" and recompute != "full",
            recompute=recompute, overlap=overlap, chunks=chunks, profile=profile,
            ffn_layers=cfg.n_layers - n_moe)
    if n_moe:  # the routed FFN pair in place of the dense one
        dense = ffn_cost(batch, seq, cfg.d_model, cfg.d_ff, tp, swiglu=swiglu).total()
        routed = moe_cost(batch, seq, cfg.d_model, cfg.d_ff, cfg.n_experts, cfg.top_k, 1, tp,
                          swiglu=swiglu).total()
        micro = micro.minus(dense.scaled(n_moe)) + routed.scaled(n_moe)
        width = (3 if swiglu else 2) * cfg.d_ff // tp
        _, extra = moe_chunk_calls(slots=batch * seq * cfg.top_k, h=cfg.d_model,
                                   expert_width=width, ep=ep, tp=tp, overlap=overlap,
                                   chunks=chunks, profile=profile, recompute=recompute)
        micro = micro + Comm({k: v for k, v in extra.items() if k == "all_reduce"}).scaled(n_moe)
    out = micro.scaled(grad_accum)
    if sequence_parallel:
        out = out + Comm.of(("all_reduce", partial_elements))
    if attention == "kv_split":
        out.add("all_reduce", 0, grad_sum_calls_per_step(attention, cfg.n_kv_heads, tp))
    return out


def sequence_parallel_cost(cost: LayerCost) -> LayerCost:
    """The same layer under sequence parallelism (Korthikanti et al. 2022, §4.2.2; SPEC F4): each
    all-reduce on the TP group becomes a reduce-scatter plus an all-gather of the same elements;
    those on a smaller group (replicated KV heads' gradient sums) stay."""

    def convert(comm: Comm, keep: Comm) -> Comm:
        moved = Comm({k: v for k, v in comm.items() if k == "all_reduce"}).minus(keep)
        out = Comm({k: dict(v) for k, v in comm.items() if k != "all_reduce"})
        out = out + Comm({k: v for k, v in comm.items() if k == "all_reduce"}).minus(moved)
        for kind in ("reduce_scatter", "all_gather"):
            for c in moved.values():
                out.add(kind, c["elements"], c["calls"])
        return out

    keep = Comm({k: v for k, v in cost.subgroup.items() if k == "all_reduce"})
    return LayerCost(convert(cost.fwd, Comm()), convert(cost.bwd, keep), cost.flops,
                     cost.activation_bytes, cost.group_size, cost.subgroup, cost.subgroup_size)


def regather_cost(b: int, s: int, h: int, regions: int = 2) -> Comm:
    """What re-gathering sequence parallelism adds to a layer
    (:mod:`ops_transformer.layers.sequence_regather`; Korthikanti et al. 2022, §4.2.2): in
    backward, one all-gather of ``b·s·h`` per region entry (attention and FFN) — the share each
    rank kept, gathered again for the column-parallel weight gradients — for ``sbh·(1 − 1/t)``
    fewer values kept per region."""
    return Comm.of(*[("all_gather", b * s * h)] * regions)


def full_recompute_replay(cost: LayerCost, b: int, s: int, h: int) -> Comm:
    """The collectives full recompute replays in backward: the layer's forward ones up to the last
    tensor backward needs (torch's checkpoint stops early) — all but the FFN's closing all-reduce
    (reduce-scatter under sequence parallelism) of ``bsh``, whose output only feeds the residual."""
    last = "reduce_scatter" if "reduce_scatter" in cost.fwd else "all_reduce"
    return cost.fwd.minus(Comm.of((last, b * s * h))) if last in cost.fwd else Comm(cost.fwd)


def moe_cost(b: int, s: int, h: int, ffn: int, experts: int, top_k: int, ep: int, tp: int,
             dtype=torch.float32, *, swiglu: bool = False) -> LayerCost:
    """One MoE FFN (:mod:`ops_transformer.layers.moe`) on one rank, dropless, with balanced
    routing: this rank routes ``S = b·s·top_k`` token-slots and receives as many for its
    ``experts/ep`` experts (summed over an EP group, what ranks receive is what they send, for
    any routing).

    * EP group (``ep > 1``; the cost's ``subgroup``, priced on ``ep`` ranks): fwd one all-gather of
      the per-expert slot counts (``ep·experts`` integers, the uneven all-to-all's split sizes),
      the dispatch all-to-all ``S·h`` and the combine all-to-all ``S·h``; bwd the same two
      all-to-alls, ``S·h`` each.
    * TP group (``tp > 1``): fwd all-reduce ``S·h`` of the experts' partial outputs, bwd
      all-reduce ``S·h`` of their input gradient — the dense FFN's pair, on routed slots.
    * FLOPs: the router ``2·bsh·experts`` (replicated) and the experts ``2·S·h·ffn·(2 or 3)``
      divided by ``tp``, times 3 for a step.
    * Activations (16-bit bytes as in :func:`ffn_cost`, scaled to ``dtype``): the FFN input
      ``2bsh``; per routed slot its row dispatched, received and returned ``3·2·S·h``; the
      experts' intermediates ``4·S·ffn·(mats−1)/tp``.
    """
    slots, bsh = b * s * top_k, b * s * h
    mats = 3 if swiglu else 2
    flops = 3.0 * (2 * bsh * experts + 2 * slots * h * ffn * mats / tp)
    act = (_bytes(dtype) / 2) * (2 * bsh + 6 * slots * h + 4 * slots * ffn * (mats - 1) / tp)
    ep_fwd = Comm.of(("all_gather", ep * experts), ("all_to_all", slots * h),
                     ("all_to_all", slots * h)) if ep > 1 else Comm()
    ep_bwd = Comm.of(("all_to_all", slots * h), ("all_to_all", slots * h)) if ep > 1 else Comm()
    tp_pair = Comm.of(("all_reduce", slots * h)) if tp > 1 else Comm()
    return LayerCost(tp_pair + ep_fwd, tp_pair + ep_bwd, flops, act, group_size=tp,
                     subgroup=ep_fwd + ep_bwd, subgroup_size=ep)
