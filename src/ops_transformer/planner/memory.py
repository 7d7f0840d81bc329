"""Memory per GPU: model states (parameters, gradients, optimizer) and activations.

Model states, mixed-precision Adam (Rajbhandari et al. 2020, ZeRO §3): ``Ψ`` parameters cost
``2Ψ`` (16-bit weights) + ``2Ψ`` (16-bit gradients) + ``12Ψ`` (fp32 master weights, momentum and
variance) = ``16Ψ`` bytes. ZeRO stage 1 shards the optimizer over ``N_d`` data-parallel ranks
(``4Ψ + 12Ψ/N_d``), stage 2 also the gradients (``2Ψ + 14Ψ/N_d``), stage 3 also the parameters
(``16Ψ/N_d``). Training in fp32 keeps ``4Ψ + 4Ψ + 8Ψ`` (no master copy: the weights are fp32).

Activations per Transformer layer, 16-bit (Korthikanti et al. 2022, Table 2; ``s`` sequence,
``b`` micro-batch, ``h`` hidden, ``a`` heads, ``t`` tensor-parallel degree), with the attention
core stored as an eager kernel does it (``5as²b``: softmax output, dropout mask and output):

=====================================  =========================
no parallelism                         ``sbh(34 + 5as/h)``
tensor parallel                        ``sbh(10 + 24/t + 5as/(ht))``
tensor + sequence parallel             ``sbh/t · (34 + 5as/h)``
+ selective recompute (attention core)  ``34·sbh/t`` (with sequence parallel),
                                       ``sbh(10 + 24/t)`` (without)
full recompute                         ``2sbh`` (each layer's input only)
=====================================  =========================

:func:`activation_bytes_per_layer` counts the same tensors for any layer: the ``34`` is ``10``
replicated (the two norms' inputs ``4``, the inputs of the QKV and FFN projections ``4``, two
dropout masks ``2``) plus ``24`` split over ``t`` (Q, K, V ``6``, the output projection's input
``2``, the FFN's two ``4h``-wide tensors ``16``). It follows GQA (K and V ``2·kv/h`` each), the
FFN width ``f`` (``4f/h``; ``8f/h`` gated: gate, up, their activation and product), no dropout
(no masks), and the **attention kernel**: ``eager`` stores the ``a·s²`` scores (``5as/h``; ``2as/h``
without dropout); ``fused`` (flash / memory-efficient SDPA) stores only the log-sum-exp statistics,
``a·s·b`` fp32 values, and recomputes the scores in backward (Dao et al. 2022, §3.1).
"""

from __future__ import annotations

from .layout import RECOMPUTE, CostOptions, degree, legacy_arguments, positional_of, shape_of

ATTENTION_KERNELS = ("fused", "eager")
ADAM_BYTES = {"params": 2, "grads": 2, "optimizer": 12}  # mixed-precision Adam, per parameter
FP32_ADAM_BYTES = {"params": 4, "grads": 4, "optimizer": 8}  # fp32 Adam: no master copy
LSE_BYTES = 4  # the fused kernel's log-sum-exp statistics are fp32


def model_state_bytes(params: float, zero_stage: int, dp: int,
                      bytes_per_element: int = 2) -> dict[str, float]:
    """``{"params", "grads", "optimizer"}`` bytes on one GPU for ``params`` parameters held by
    this GPU's tensor/expert shard, with ZeRO ``zero_stage`` over ``dp`` ranks. 16-bit training
    (``bytes_per_element`` 2): mixed-precision Adam, ``2 + 2 + 12`` bytes per parameter; fp32
    training (4) needs no master copy: fp32 weights and gradients and Adam's two fp32 moments,
    ``4 + 4 + 8`` (:data:`FP32_ADAM_BYTES`) — the same 16 bytes, sharded differently by ZeRO."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    sharded = {0: (), 1: ("optimizer",), 2: ("optimizer", "grads"),
               3: ("optimizer", "grads", "params")}[zero_stage]
    per = FP32_ADAM_BYTES if bytes_per_element == 4 else ADAM_BYTES
    return {k: per[k] * params / (dp if k in sharded else 1) for k in per}


def layer_matmuls(h: int, kv_dim: int, ffn: int, gated: bool) -> list[tuple[str, int]]:
    """The projections of one layer in forward order, ``(name, output width)``; each takes ``h``
    inputs except the FFN's output projection (``ffn``). Separate Q, K, V as in Llama-style code."""
    mlp = [("w1", ffn), ("w3", ffn), ("w2", h)] if gated else [("fc1", ffn), ("fc2", h)]
    return [("q", h), ("k", kv_dim), ("v", kv_dim), ("o", h)] + mlp


def ops_saved(h: int, kv_dim: int, ffn: int, gated: bool) -> list[str]:
    """The projections whose outputs the ``ops`` policy keeps: every other one, starting with the
    first (torchtitan's op-level selective checkpointing, which also keeps the attention output)."""
    return [name for i, (name, _) in enumerate(layer_matmuls(h, kv_dim, ffn, gated)) if i % 2 == 0]


def effective_recompute(recompute: str, attention_kernel: str) -> str:
    """What ``selective`` recomputes depends on the kernel: with an eager kernel the attention
    core (Korthikanti et al. 2022), whose scores are the bulk of a layer's memory; a fused kernel
    stores no scores and already recomputes them, so ``selective`` is then the op-level policy
    ``ops`` of stacks built on fused attention (torchtitan's default selective checkpointing)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    return "ops" if recompute == "selective" and attention_kernel == "fused" else recompute


LEGACY_ACTIVATIONS = ("s", "b", "h", "a", "t")  # the older form's positions (the paper's)
LEGACY_ACTIVATION_KEYWORDS = LEGACY_ACTIVATIONS + (
    "sequence_parallel", "recompute", "kv_heads", "ffn", "gated", "dropout")


def activation_bytes_per_layer(spec=None, layout=None, options=None, *legacy,
                               batch: int | None = None, seq: int | None = None,
                               bytes_per_element: int = 2, attention_kernel: str = "eager",
                               **legacy_keywords) -> float:
    """Bytes one rank keeps for backward per layer (module docstring) of model ``spec`` (a
    ``GPTConfig`` or a :class:`~.specs.ModelSpec`: hidden size, heads, KV heads, FFN width and
    kind, dropout) on ``layout`` (``tp``; ``cp`` splits the sequence: ``seq / cp`` tokens per
    rank) with ``options`` (``sequence_parallel``, ``recompute``: a ``ParallelOptions``, the
    search's ``Options`` or a :class:`~.layout.CostOptions`), for a micro-batch of ``batch``
    sequences of ``seq`` tokens; 16-bit values scaled to ``bytes_per_element``.

    The older form ``activation_bytes_per_layer(s, b, h, a, t, *, sequence_parallel=,
    recompute=, bytes_per_element=, attention_kernel=, kv_heads=, ffn=, gated=, dropout=)``
    (Korthikanti et al.'s notation; its defaults are their GPT: MHA, ``ffn = 4h``, dropout)
    gives the same numbers (:func:`layer_activation_bytes`)."""
    if isinstance(spec, int) and not isinstance(spec, bool) or (
            spec is None and "s" in legacy_keywords):
        old = legacy_arguments("activation_bytes_per_layer", LEGACY_ACTIVATIONS,
                               positional_of(spec, layout, options, *legacy),
                               {**legacy_keywords,
                                **{k: v for k, v in (("b", batch), ("s", seq)) if v is not None}},
                               LEGACY_ACTIVATION_KEYWORDS)
        return layer_activation_bytes(**old, bytes_per_element=bytes_per_element,
                                      attention_kernel=attention_kernel)
    if legacy or legacy_keywords:
        raise TypeError(f"activation_bytes_per_layer(spec, layout, options, *, batch, seq, "
                        f"bytes_per_element, attention_kernel) got unexpected arguments: "
                        f"{list(legacy) + sorted(legacy_keywords)}")
    if batch is None or seq is None:
        raise TypeError("activation_bytes_per_layer() needs batch= and seq= (the micro-batch's "
                        "sequences and their length)")
    shape, options, cp = shape_of(spec), CostOptions.of(options), degree(layout, "cp")
    if seq % cp:
        raise ValueError(f"cp ({cp}) must divide the sequence length ({seq})")
    return layer_activation_bytes(
        seq // cp, batch, shape.hidden, shape.heads, degree(layout, "tp"),
        sequence_parallel=options.sequence_parallel, recompute=options.recompute,
        bytes_per_element=bytes_per_element, attention_kernel=attention_kernel,
        kv_heads=shape.kv_heads, ffn=shape.ffn, gated=shape.gated, dropout=shape.dropout)


def layer_activation_bytes(s: int, b: int, h: int, a: int, t: int, *,
                           sequence_parallel: bool | str = False, recompute: str = "none",
                           bytes_per_element: int = 2, attention_kernel: str = "eager",
                           kv_heads: int | None = None, ffn: int | None = None,
                           gated: bool = False, dropout: bool = True) -> float:
    """:func:`activation_bytes_per_layer` on the sizes, in Korthikanti et al.'s notation (``s``
    sequence on this rank, ``b`` micro-batch, ``h`` hidden, ``a`` heads, ``t`` tensor-parallel
    degree); the defaults are their GPT (MHA, ``ffn = 4h``, dropout, eager attention).

    ``recompute``: ``none``; ``selective`` (eager kernel: the attention core is recomputed, nothing
    of it kept; fused kernel: as ``ops``, :func:`effective_recompute`); ``full`` (only the layer's
    input); ``ops`` (torchtitan's op-level policy: the layer's input, the outputs of every other
    projection of :func:`layer_matmuls` and the attention output)."""
    if attention_kernel not in ATTENTION_KERNELS:
        raise ValueError(f"attention_kernel must be one of {ATTENTION_KERNELS}, got "
                         f"{attention_kernel!r}")
    recompute = effective_recompute(recompute, attention_kernel)
    kv, f = (kv_heads or a) / a, (ffn or 4 * h) / h  # K/V and FFN widths in units of h
    sbh, scale = s * b * h, bytes_per_element / 2
    rep_div = t if sequence_parallel else 1
    if recompute == "full":
        return scale * 2 * sbh / rep_div
    core = lse = 0.0
    if recompute != "selective":
        if attention_kernel == "eager":
            core = (5 if dropout else 2) * a * s / h / t  # 16-bit units of sbh
        else:
            lse = LSE_BYTES * a * s * b / t  # bytes
    if recompute == "ops":
        widths = dict(layer_matmuls(1, kv, f, gated))
        kept = ops_saved(1, kv, f, gated)
        split = 2 * sum(widths[n] for n in kept if n not in ("o", "w2", "fc2"))
        partial = 2 * sum(1 for n in kept if n in ("o", "w2", "fc2"))  # full-size partial sums
        return scale * sbh * (2 / rep_div + (split + 2 + core) / t + partial) + lse
    replicated = 8 + (2 if dropout else 0)
    split = 2 + 4 * kv + 2 + (8 if gated else 4) * f
    return scale * sbh * (replicated / rep_div + (split / t) + core) + lse


LOSS_KERNELS = ("fused", "fp32")


def logits_bytes(tokens: int, vocab: int, vocab_split: int, bytes_per_element: int,
                 loss_kernel: str = "fused") -> float:
    """The LM head's output and the loss's working set for ``tokens`` tokens on one rank, ``V /
    vocab_split`` columns: ``fused`` (a cross-entropy kernel that reads the 16-bit logits, e.g.
    flash-attn's or a fused vocab-parallel one) keeps the logits and their gradient; ``fp32``
    (up-cast, then ``cross_entropy``, as Hugging Face, torchtitan and Megatron without loss fusion
    do) also has, at the backward peak, the fp32 log-softmax it saved, its incoming and its
    outgoing gradient."""
    if loss_kernel not in LOSS_KERNELS:
        raise ValueError(f"loss_kernel must be one of {LOSS_KERNELS}, got {loss_kernel!r}")
    per_logit = 2 * bytes_per_element if loss_kernel == "fused" else bytes_per_element + 12
    return tokens * vocab / vocab_split * per_logit


def fused_activation_bytes_per_layer(s: int, b: int, h: int, a: int, t: int, *,
                                     sequence_parallel: bool | str = False,
                                     recompute: str = "none",
                                     bytes_per_element: int = 2) -> float:
    """What this library's reference layer keeps for backward, per layer and rank, byte for byte:
    fused attention (``scaled_dot_product_attention`` keeps Q, K, V, its output and a log-sum-exp),
    dropout 0 (no masks), LayerNorm + GELU with a ``4h`` FFN. Checked against
    :func:`ops_transformer.memory.activation_memory`; derivation in ``docs/memory.md``. It differs
    from :func:`activation_bytes_per_layer` (``attention_kernel="fused", dropout=False``) in three
    places: LayerNorm's fp32 mean and 1/std (``4sb`` each) are counted; with sequence parallelism
    the inputs of Q/K/V and of the first FFN matmul stay whole (``2sbh``: they are all-gathered in
    forward and kept, so backward needs no second gather); and ``selective`` recomputes the
    attention core only, which with a fused kernel drops just the log-sum-exp (the attention
    output is also the output projection's saved input).

    * replicated over TP (divided by ``t`` with sequence parallelism): the two LayerNorm inputs
      (``2sbh``) and their statistics;
    * whole: the two all-gathered matmul inputs (``2sbh``) — with
      ``sequence_parallel="regather"`` only this rank's share of them (``2sbh/t``, Korthikanti's
      layout: all-gathered again in backward);
    * split over TP: Q, K, V and the attention output (``4sbh``), the GELU input and output
      (``8sbh``), the log-sum-exp (fp32, ``abs``).

    ``recompute="full"`` keeps each layer's input (``sbh``, ``/t`` with sequence parallelism).
    """
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
    e, sbh, split = bytes_per_element, s * b * h, t if sequence_parallel else 1
    if recompute == "full":
        return e * sbh / split
    norms = (2 * e * sbh + 2 * 2 * 4 * s * b) / split
    gathered = 2 * e * sbh / (t if sequence_parallel == "regather" else 1)
    sharded = (4 + 8) * e * sbh / t
    lse = 0 if recompute == "selective" else LSE_BYTES * a * s * b / t
    return norms + gathered + sharded + lse
