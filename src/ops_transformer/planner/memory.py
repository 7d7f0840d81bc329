"""Memory per GPU: model states (parameters, gradients, optimizer) and activations.

Model states, mixed-precision Adam (Rajbhandari et al. 2020, ZeRO §3): ``Ψ`` parameters cost
``2Ψ`` (16-bit weights) + ``2Ψ`` (16-bit gradients) + ``12Ψ`` (fp32 master weights, momentum and
variance) = ``16Ψ`` bytes. ZeRO stage 1 shards the optimizer over ``N_d`` data-parallel ranks
(``4Ψ + 12Ψ/N_d``), stage 2 also the gradients (``2Ψ + 14Ψ/N_d``), stage 3 also the parameters
(``16Ψ/N_d``).

Activations per Transformer layer, 16-bit (Korthikanti et al. 2022, Table 2; ``s`` sequence,
``b`` micro-batch, ``h`` hidden, ``a`` heads, ``t`` tensor-parallel degree):

=====================================  =========================
no parallelism                         ``sbh(34 + 5as/h)``
tensor parallel                        ``sbh(10 + 24/t + 5as/(ht))``
tensor + sequence parallel             ``sbh/t · (34 + 5as/h)``
+ selective recompute (attention core)  ``34·sbh/t`` (with sequence parallel),
                                       ``sbh(10 + 24/t)`` (without)
full recompute                         ``2sbh`` (each layer's input only)
=====================================  =========================
"""

from __future__ import annotations

RECOMPUTE = ("none", "selective", "full")
ADAM_BYTES = {"params": 2, "grads": 2, "optimizer": 12}  # mixed-precision Adam, per parameter


def model_state_bytes(params: float, zero_stage: int, dp: int) -> dict[str, float]:
    """``{"params", "grads", "optimizer"}`` bytes on one GPU for ``params`` parameters held by
    this GPU's tensor/expert shard, with ZeRO ``zero_stage`` over ``dp`` ranks."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    sharded = {0: (), 1: ("optimizer",), 2: ("optimizer", "grads"),
               3: ("optimizer", "grads", "params")}[zero_stage]
    return {k: ADAM_BYTES[k] * params / (dp if k in sharded else 1) for k in ADAM_BYTES}


def activation_bytes_per_layer(s: int, b: int, h: int, a: int, t: int, *,
                               sequence_parallel: bool = False, recompute: str = "none",
                               bytes_per_element: int = 2) -> float:
    """Korthikanti et al. (2022) per-layer activation memory, scaled from 16-bit to
    ``bytes_per_element``."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    sbh, scale = s * b * h, bytes_per_element / 2
    if recompute == "full":
        return scale * 2 * sbh / (t if sequence_parallel else 1)
    attention_core = 5 * a * s / h
    if sequence_parallel:
        per = 34 / t if recompute == "selective" else (34 + attention_core) / t
    else:
        per = 10 + 24 / t + (0 if recompute == "selective" else attention_core / t)
    return scale * sbh * per


def fused_activation_bytes_per_layer(s: int, b: int, h: int, a: int, t: int, *,
                                     sequence_parallel: bool = False, recompute: str = "none",
                                     bytes_per_element: int = 2) -> float:
    """What this library's reference layer keeps for backward, per layer and rank: Korthikanti et
    al.'s terms for fused attention (``scaled_dot_product_attention`` keeps Q, K, V, its output
    and a log-sum-exp — no ``as²`` scores, softmax or attention-dropout tensors) and no dropout
    masks (dropout 0), LayerNorm + GELU with a ``4h`` FFN. Checked byte for byte against
    :func:`ops_transformer.memory.activation_memory`; derivation in ``docs/memory.md``.

    * replicated over TP (divided by ``t`` with sequence parallelism): the two LayerNorm inputs
      (``2sbh``) and their mean and 1/std (fp32, ``4sb``);
    * kept whole even with sequence parallelism: the inputs of Q/K/V and of the first FFN matmul
      (``2sbh``; they are all-gathered in forward and kept, so backward needs no second gather);
    * split over TP: Q, K, V and the attention output (``4sbh``), the GELU input and output
      (``8sbh``), the log-sum-exp (fp32, ``abs``).

    ``recompute="full"`` keeps each layer's input (``sbh``, ``/t`` with sequence parallelism);
    ``"selective"`` drops only the log-sum-exp (the attention output is also the output
    projection's saved input).
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    e, sbh, split = bytes_per_element, s * b * h, t if sequence_parallel else 1
    if recompute == "full":
        return e * sbh / split
    norms = (2 * e * sbh + 2 * 2 * 4 * s * b) / split
    gathered = 2 * e * sbh
    sharded = (4 + 8) * e * sbh / t
    lse = 0 if recompute == "selective" else 4 * a * s * b / t
    return norms + gathered + sharded + lse
