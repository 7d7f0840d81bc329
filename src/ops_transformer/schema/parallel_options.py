"""How :func:`~ops_transformer.parallelize` prepares a model: one frozen, validated options object
(torch-free: importing it, as the command line and a run's file do, imports no torch;
``ops_transformer.parallelize.options`` and ``ops_transformer.parallelize`` export the same
classes).

``parallelize(model, ctx, plan, ParallelOptions(sequence_parallel=True, recompute="selective"))``
is the same call as ``parallelize(model, ctx, plan, sequence_parallel=True,
recompute="selective")``: the keyword arguments build the options (or change the given ones,
:meth:`ParallelOptions.of`). Every field is checked once, when the options are built; a bad value
is a ``ValueError`` naming the field, the value and what is valid.

To add an option: add a field with its default here, its valid values to :data:`CHOICES` (or a
check in :meth:`ParallelOptions.__post_init__`), read it where it takes effect (a style, a
reducer, a memory option), and document it in the class docstring; ``parallelize``'s keyword arguments, ``TrainConfig`` (if ``train`` exposes it) and
``model.parallel_state.options`` follow without further change.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from .choices import (ACTIVATION_CACHES, ATTENTION_CHOICES, COMPILE_BACKENDS, CP_CHOICES,
                      DEFAULT_BUCKET_BYTES, FP8_BACKWARDS, MOE_STATISTICS, OVERLAP_MODES,
                      PRECISIONS, RECOMPUTE, SEQUENCE_PARALLEL_VALUES, VOCAB_CHOICES)

if TYPE_CHECKING:  # annotations only: this module imports no torch
    import torch

log = logging.getLogger("ops_transformer")
ZERO_STAGES = (0, 1, 2, 3)


def check_grad_reduce_dtype(grad_reduce_dtype) -> None:
    """``None`` or a floating-point ``torch.dtype``; otherwise a ``ValueError`` naming it. (A
    ``torch.dtype`` comes from an imported torch: this module imports none.)"""
    torch = sys.modules.get("torch")
    if grad_reduce_dtype is not None and not (
            torch is not None and isinstance(grad_reduce_dtype, torch.dtype)
            and grad_reduce_dtype.is_floating_point):
        raise ValueError(f"grad_reduce_dtype must be a floating-point torch.dtype, got "
                         f"{grad_reduce_dtype!r}")


def check_lora_args(rank, alpha, dropout) -> float:
    """``rank`` ≥ 1, ``alpha`` > 0, ``0 ≤ dropout < 1``; returns ``alpha`` (``None``: ``rank``)."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"lora: rank must be a positive integer, got {rank!r}")
    alpha = rank if alpha is None else alpha
    if not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ValueError(f"lora: alpha must be a positive number (default: the rank), got "
                         f"{alpha!r}")
    if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"lora: dropout must be in [0, 1), got {dropout!r}")
    return alpha


@dataclass(frozen=True)
class LoRAOptions:
    """The LoRA section of :class:`ParallelOptions` (``parallelize(..., lora={"rank": 8})``): the
    arguments of :func:`~ops_transformer.lora`, applied inside ``parallelize`` after the plan and
    before the gradient reducers are built — once, over the adapters."""

    rank: int
    alpha: float | None = None
    targets: tuple[str, ...] | str | None = None
    dropout: float = 0.0
    seed: int = 0

    def __post_init__(self):
        check_lora_args(self.rank, self.alpha, self.dropout)
        if isinstance(self.targets, list):
            object.__setattr__(self, "targets", tuple(self.targets))


@dataclass(frozen=True)
class DataParallelOptions:
    """The data-parallel section of :class:`ParallelOptions` (``parallelize(...,
    data_parallel={"zero": 2})``): how the data-parallel ranks share the training state, laid out
    inside ``parallelize`` after every other option and before the gradient reducers, which are
    built once, in the form that layout needs (:mod:`ops_transformer.parallelize.data_parallel`).

    * ``zero`` — ``0``: each rank holds everything, gradients all-reduced; ``1``: the parameters
      laid out in ZeRO buckets whose optimizer state :func:`~ops_transformer.zero_optimizer`
      shards; ``2``: as 1, the gradients reduce-scattered into the buckets (build the optimizer
      with ``ot.zero_optimizer`` before the first backward: a plain one is refused there);
      ``3``: the parameters sharded with FSDP2 (:func:`~ops_transformer.shard_parameters`), a
      plain ``torch.optim`` optimizer built afterwards holds ``1/n`` of the state.
    * ``reshard_after_forward``, ``mixed_precision`` — those of ``shard_parameters`` (``zero=3``).
    """

    zero: int = 0
    reshard_after_forward: bool = True
    mixed_precision: object = None

    def __post_init__(self):
        if self.zero not in ZERO_STAGES or isinstance(self.zero, bool):
            raise ValueError(f"data_parallel: zero must be one of {ZERO_STAGES}, got "
                             f"{self.zero!r}")
        if not isinstance(self.reshard_after_forward, bool):
            raise ValueError(f"data_parallel: reshard_after_forward must be True or False, got "
                             f"{self.reshard_after_forward!r}")
        if self.zero != 3 and (not self.reshard_after_forward or
                               self.mixed_precision is not None):
            raise ValueError(f"data_parallel: reshard_after_forward and mixed_precision apply "
                             f"to zero=3 (FSDP2), got zero={self.zero!r}")


@dataclass(frozen=True)
class ParallelOptions:
    """What ``parallelize`` does besides applying the plan.

    * ``attention`` — the reference GPT's attention strategy (SPEC F5): ``heads``,
      ``heads_allgather``, ``kv_split``, ``naive`` or ``auto`` (the cost model chooses; with
      ``sequence_parallel``, ``heads``: :attr:`plan_attention`). Hugging Face models: ``heads``.
    * ``vocab`` — embedding and LM head split over the vocabulary (``parallel``), kept whole
      (``replicated``) or chosen by the cost model (``auto``).
    * ``loss_parallel`` — Hugging Face models with a split vocabulary keep their logits sharded and
      compute the loss (``labels=``) as the vocab-parallel cross-entropy.
    * ``sequence_parallel`` — keep ``1/tp`` of the activations between TP regions (SPEC F7; the
      reference GPT with ``heads`` attention, Hugging Face GPT-2/Llama/Mistral/Qwen2): ``True``
      keeps each region's gathered input for backward, ``"regather"`` only this rank's share of
      it, all-gathered again in backward (:attr:`regathers`;
      :mod:`ops_transformer.layers.sequence_regather`).
    * ``recompute`` — ``none``, ``selective`` (the attention core) or ``full`` (every layer)
      recomputed in backward.
    * ``activation_cache`` — ``none`` or ``int8`` (each layer's saved activations as int8).
    * ``grad_reduce_dtype`` — the dtype of every gradient reduction (data-parallel averaging, the
      sums of replicated parameters' partial gradients); ``None``: float32 when a parameter is
      16-bit, else the parameters' own.
    * ``bucket_bytes`` — the size of a gradient-reduction bucket (DDP's ``bucket_cap_mb``).
    * ``overlap`` — each region's entry and exit collective split into chunks pipelined with its
      matmul (SPEC F4; :mod:`ops_transformer.parallelize.overlap_plan`): ``chunked`` (always
      ``chunks``), ``auto`` (per region and size, the chunk count up to ``chunks`` that the cost
      model says pays on the agreed profile, often 1) or ``none`` (the plan's collectives as
      they are). The expert all-to-alls too.
    * ``chunks`` — the chunks of ``overlap`` (at most, for ``auto``): an integer >= 1.
    * ``moe_statistics`` — what the reference MoE layers take their capacity and load-balancing
      loss over: ``local`` (each rank's micro-batch, Megatron-LM's default: ``dp × ep > 1``
      differs from one process) or ``global`` (the global batch, from one all-gather of the
      expert counts per layer over ``dp × ep``: equal to one process;
      :mod:`ops_transformer.layers.moe_stats`).
    * ``lora`` — LoRA adapters added inside ``parallelize`` (a :class:`LoRAOptions` or its
      dict: ``rank``, ``alpha``, ``targets``, ``dropout``, ``seed``), every other weight frozen,
      before the gradient reducers are built; ``None``: none (``ot.lora`` adds them afterwards).
    * ``data_parallel`` — ZeRO 1/2/3 laid out inside ``parallelize``, last before the gradient
      reducers (a :class:`DataParallelOptions` or its dict: ``zero``, ``reshard_after_forward``,
      ``mixed_precision``); the default, ``zero=0``, shards nothing (``ot.zero_optimizer`` and
      ``ot.shard_parameters`` do the same steps afterwards).
    * ``context_parallel`` — with ``cp > 1`` (``init_parallel(cp=)``), how attention spans the
      split sequence (SPEC F18): ``ring``, ``allgather_kv`` or ``auto`` (the cost model chooses,
      the reason recorded in ``model.parallel_state.context_parallel``); ignored at ``cp = 1``.
      :mod:`ops_transformer.parallelize.context_plan`.
    * ``compile`` — each Transformer block compiled with ``torch.compile(fullgraph=True)`` after
      every other option is applied (SPEC F20; :mod:`ops_transformer.parallelize.compile`), with
      ``compile_backend``: ``inductor``, ``aot_eager`` or ``eager``.
    * ``precision`` — ``fp8``: the Transformer blocks' linear layers run their matmuls in fp8
      (tensorwise dynamic scales agreed over the TP group; :mod:`ops_transformer.layers.fp8_linear`);
      ``fp32`` / ``bf16`` / ``fp16`` leave the layers as they are (16 bits: the caller's
      autocast, as ``train`` does). fp8 does not combine with ``sequence_parallel="regather"``,
      chunked overlap (``auto`` runs as ``none``), the int8 cache, or LoRA under
      sequence parallelism yet.
    * ``fp8_backward`` — with ``precision="fp8"``, the backward's matmuls: ``e5m2`` (the output
      gradient cast to e5m2 by its dense amax, torchao's tensorwise recipe) or ``fp32``
      (straight-through fp32 products with the dequantised saved operands);
      :mod:`ops_transformer.precision.fp8`.
    * ``tp_plan`` — Hugging Face style names (``{pattern: style}``, as in ``transformers``) merged
      over a Hugging Face model's own plan and translated (``plan="auto"`` only).
    """

    attention: str = "auto"
    vocab: str = "auto"
    loss_parallel: bool = False
    sequence_parallel: bool | str = False
    recompute: str = "none"
    activation_cache: str = "none"
    grad_reduce_dtype: torch.dtype | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    tp_plan: Mapping[str, str] | None = None
    overlap: str = "auto"
    chunks: int = 2
    moe_statistics: str = "local"
    lora: LoRAOptions | None = None
    data_parallel: DataParallelOptions = DataParallelOptions()
    context_parallel: str = "auto"
    compile: bool = False
    compile_backend: str = "inductor"
    precision: str = "fp32"
    fp8_backward: str = "e5m2"

    def __post_init__(self):
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            if not any(value is c or (type(value) is type(c) and value == c) for c in choices):
                raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        check_grad_reduce_dtype(self.grad_reduce_dtype)
        if self.sequence_parallel == "regather" and self.recompute == "full":
            log.warning("parallelize: sequence_parallel='regather' with recompute='full' runs as "
                        "sequence_parallel=True: full recompute keeps only each layer's input, so "
                        "a re-gather would add an all-gather per region for nothing")
        if isinstance(self.bucket_bytes, bool) or not isinstance(self.bucket_bytes, int) \
                or self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive integer, got {self.bucket_bytes!r}")
        if isinstance(self.chunks, bool) or not isinstance(self.chunks, int) or self.chunks < 1:
            raise ValueError(f"chunks must be an integer >= 1, got {self.chunks!r}")
        if self.compile and self.regathers:
            raise ValueError("compile does not combine with sequence_parallel='regather' yet: "
                             "AOTAutograd places the backward re-gather (it needs no gradient) "
                             "in the forward graph, so the gathered input is saved and gathered "
                             "twice; use sequence_parallel=True")
        if self.compile and self.activation_cache != "none":
            raise ValueError(f"compile does not combine with activation_cache="
                             f"{self.activation_cache!r} yet (Dynamo cannot enter the cache's "
                             f"saved-tensor hooks); use activation_cache='none'")
        if self.precision == "fp8":
            for name, on in (("sequence_parallel='regather'",
                              self.sequence_parallel == "regather"),
                             ("overlap='chunked'", self.overlap == "chunked"),
                             ("activation_cache='int8'", self.activation_cache != "none")):
                if on:
                    raise ValueError(f"precision='fp8' does not combine with {name} yet: drop "
                                     f"one of them")
            if self.sequence_parallel and self.lora is not None:
                raise ValueError("precision='fp8' with sequence_parallel does not combine with "
                                 "lora yet: the regions gather e4m3 tokens, an adapter needs the "
                                 "fp32 ones; drop one of them")
            if self.overlap == "auto":  # the fp8 layers have no chunked form
                object.__setattr__(self, "overlap", "none")
        if self.compile and self.overlap == "auto":  # auto's choice prices eager overlap
            object.__setattr__(self, "overlap", "none")
        if isinstance(self.lora, Mapping):
            object.__setattr__(self, "lora", LoRAOptions(**self.lora))
        if self.lora is not None and not isinstance(self.lora, LoRAOptions):
            raise ValueError(f"lora must be None, a LoRAOptions or its dict (rank=, alpha=, "
                             f"targets=, dropout=, seed=), got {type(self.lora).__name__}")
        if isinstance(self.data_parallel, Mapping):
            unknown = sorted(set(self.data_parallel) - {f.name for f in
                                                        fields(DataParallelOptions)})
            if unknown:
                raise ValueError(f"data_parallel: unknown key(s) {unknown}; valid: zero, "
                                 f"reshard_after_forward, mixed_precision")
            object.__setattr__(self, "data_parallel", DataParallelOptions(**self.data_parallel))
        if not isinstance(self.data_parallel, DataParallelOptions):
            raise ValueError(f"data_parallel must be a DataParallelOptions or its dict (zero=, "
                             f"reshard_after_forward=, mixed_precision=), got "
                             f"{self.data_parallel!r}")
        if self.tp_plan is not None and not isinstance(self.tp_plan, Mapping):
            raise ValueError(f"tp_plan must be a {{pattern: style}} dict, got "
                             f"{type(self.tp_plan).__name__}")

    @property
    def regathers(self) -> bool:
        """Whether the sequence-parallel regions re-gather their input in backward: with
        ``sequence_parallel="regather"``, except under ``recompute="full"`` (a layer then keeps only
        its input: there is nothing to keep less of), which runs as ``True`` (and warns)."""
        return self.sequence_parallel == "regather" and self.recompute != "full"

    @property
    def plan_attention(self) -> str:
        """The strategy the plan is asked for: ``heads`` for ``auto`` under sequence parallelism
        (the one strategy with a sequence-parallel form), else :attr:`attention` as given (``auto``:
        the cost model decides when the plan is made)."""
        return "heads" if self.sequence_parallel and self.attention == "auto" else self.attention

    @classmethod
    def of(cls, options: ParallelOptions | None = None, **changes) -> ParallelOptions:
        """``options`` (default: the defaults) with ``changes``: the keyword arguments of
        ``parallelize``, one per field."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(changes) - set(names))
        if unknown:
            raise TypeError(f"parallelize() got unexpected keyword argument(s) {unknown}; its "
                            f"options are {names}")
        if options is None:
            return cls(**changes)
        if not isinstance(options, cls):
            raise TypeError(f"options must be a ParallelOptions, got {type(options).__name__}")
        return dataclasses.replace(options, **changes) if changes else options


# The fields with a fixed set of values (a new value of one, e.g. sequence_parallel="regather", is
# one more entry here, and a field of that kind one more line).
CHOICES = {"attention": ATTENTION_CHOICES, "vocab": VOCAB_CHOICES,
           "loss_parallel": (False, True), "sequence_parallel": SEQUENCE_PARALLEL_VALUES,
           "recompute": RECOMPUTE, "activation_cache": ACTIVATION_CACHES,
           "overlap": OVERLAP_MODES, "moe_statistics": MOE_STATISTICS,
           "context_parallel": CP_CHOICES, "compile": (False, True),
           "compile_backend": COMPILE_BACKENDS,
           "precision": PRECISIONS, "fp8_backward": FP8_BACKWARDS}
