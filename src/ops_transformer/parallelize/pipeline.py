"""Pipeline parallelism for the reference GPT and Hugging Face decoders (:mod:`.pipeline_hf`) on
``torch.distributed.pipelining`` (no scheduler of our own): :func:`pipeline` splits the model into
stages by layers over ``ctx``'s ``pp`` axis.

Each rank keeps the **dense** model object with only its stages' parts in it: the other layers
become parameter-less ``nn.Identity`` entries of ``model.layers`` (so ``layers.5.attn.wq.weight``
keeps its name on the rank that holds it), the embedding is kept on stage 0 only, the final norm
and the head on the last stage only. Checkpoints and ``gather_full_state_dict`` see dense names.
Whatever ``parallelize`` did inside a stage (TP layers, the data-parallel gradient reducers over
that stage's ``dp``) stays as it is; the reducers are rebuilt over the parameters the rank kept.

One step (:meth:`Pipeline.step`), ``m`` micro-batches of ``b`` rows::

    schedule (pipelining)  : m forwards and m backwards per stage, in the schedule's order;
                             stage boundaries: one send/recv of (b, s, h) per micro-batch and
                             direction (activations forward, their gradients backward)
    loss (last stage)      : Σ_i CE_i / m — each micro-batch's mean token loss over m, so the
                             summed gradient is the dense mean (scale_grads=False: pipelining's
                             default would divide the gradients by m once more)
    accumulation (n)       : n schedules per step, each piece's loss CE_i / (n·m)
    dropout                : each stage's forward of a micro-batch seeks the seeds one device
                             draws before its first site (_DropoutStream), its rows' masks
    MoE (reference GPT)    : each micro-batch routed by itself (as one device with grad_accum
                             n·m); each stage adds c · its layers' aux loss / (n·m) through its
                             output's backward (:mod:`.pipeline_moe`), ``ep`` inside the stage
    after the schedule     : a tied embedding's gradient summed between the first and the last
                             stage (``ctx.pp_ends_group()``), then the stage's gradient reducers
                             (dp averaging or ZeRO-2's reduce-scatter, partial sums over tp): the
                             sum comes first because ZeRO-2 keeps only a chunk of the gradient

The boundary transfers are recorded in the communication ledger as ``send``/``recv`` records
(label ``pp_boundary``) when pipelining posts them: its schedules run the ops in their own
``batch_isend_irecv``, so :class:`RecordedStage` builds each op through
:func:`~ops_transformer.comm.collectives.p2p_op`. (The schedule's one-time warm-up vote between
neighbours, on the first step, is not recorded.)
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import pipelining as _pp

from ..comm import collectives as C
from ..layers.loss import vocab_parallel_cross_entropy
from ..layers.dropout import ParallelDropout, draw_seed, micro_batch_masks
from ..models.gpt import GPT, Attention, rope_tables
from ..models.hf import is_hf
from ..parallel.state import no_sync, parallel_state_of
from .moe_plan import n_experts_of
from .dropout import hf_dropout_sites
from .options import ParallelOptions
from .pipeline_hf import FAMILIES as HF_FAMILIES
from .pipeline_hf import HFStage, n_layers_of, prune_hf, tied_names
from .pipeline_moe import StageAux
from .pipeline_split import SCHEDULES, check_pipeline, rank_stages, stage_layers
from .reducers import gradient_reducers

log = logging.getLogger("ops_transformer")
BOUNDARY_LABEL = "pp_boundary"


class GPTStage(nn.Module):
    """Layers ``layers`` of a GPT as one pipeline stage: ``idx (B, T)`` → hidden ``(B, T, d)`` on
    the first stage, hidden → hidden in the middle, hidden → logits ``(B, T, V)`` on the last.
    It holds the GPT's own modules (shared, not copied). ``autocast``: the context its forward
    runs in (``Pipeline.step(policy=)``: the precision policy's ``torch.autocast``), so the
    backward runs outside it, as in the dense training loop."""

    def __init__(self, model: GPT, layers: range, *, first: bool, last: bool):
        super().__init__()
        self.cfg, self.first, self.last = model.cfg, first, last
        self.autocast = contextlib.nullcontext
        self.seq_len = None  # the whole sequence (Pipeline.step): under sequence parallelism a
        # later stage receives (B, T/tp, d), but its attention's RoPE spans all T positions
        self.layer_ids = layers
        self.tok_emb = model.tok_emb if first else None
        self.pos_emb = model.pos_emb if first else None
        self.drop = model.drop if first else None
        self.blocks = nn.ModuleList(model.layers[i] for i in layers)
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        # MoE: the stage's load-balancing loss into the backward (pipeline_moe)
        self.aux = StageAux(model.cfg.moe_aux_loss_coef) if model.cfg.n_experts else None

    def forward(self, x):
        with self.autocast():
            return self._forward(x)

    def _forward(self, x):
        if self.first:
            T = x.shape[1]
            h = self.tok_emb(x)  # (B, T, d)
            if self.pos_emb is not None:
                h = h + self.pos_emb(torch.arange(T, device=x.device))
            x = self.drop(h)
        rope = None
        if self.cfg.pos == "rope":
            rope = rope_tables(self.cfg.head_dim, self.seq_len or x.shape[1], self.cfg.rope_theta,
                               x.device)
        for block in self.blocks:
            x = block(x, rope)
        if self.last:
            x = self.lm_head(self.norm(x))[0]  # (B, T, V): full logits
        return x if self.aux is None else self.aux.add(self, x)

    def extra_repr(self) -> str:
        ends = "embedding, " if self.first else ""
        return (f"{ends}layers {self.layer_ids.start}..{self.layer_ids.stop - 1}"
                f"{', norm, head' if self.last else ''}")


class RecordedStage(_pp.PipelineStage):
    """pipelining's ``PipelineStage`` whose boundary sends and receives are built through
    :func:`~ops_transformer.comm.collectives.p2p_op`, which records each in the ledger. While
    ``busy_s`` is not ``None`` (``Pipeline.measure``) it adds up the wall time of this stage's
    forwards and backwards (on a GPU after synchronising the device): the stage's busy time, the
    rest of a schedule's time is its bubble and its transfers."""

    busy_s: float | None = None
    dropout = None  # _DropoutStream of the pipeline when the model has dropout, else None
    stage_draws_before = 0  # dropout seeds one device draws before this stage's first site

    def _masked(self, run, chunk: int, *args, forward: bool = False, **kwargs):
        """``run`` with the dropout sites drawing the one-device masks of micro-batch ``chunk``
        (its rows of the batch) and, for a forward, the seeds one device draws at these sites."""
        stream = self.dropout
        if stream is None:
            return run(chunk, *args, **kwargs)
        index, count = stream.piece * stream.microbatches + chunk, stream.count
        if forward:
            stream.seek(self.stage_draws_before)
        with micro_batch_masks(self.submod, index, count):
            return run(chunk, *args, **kwargs)

    def _timed(self, run, *args, **kwargs):
        if self.busy_s is None:
            return run(*args, **kwargs)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        try:
            return run(*args, **kwargs)
        finally:
            sync()
            self.busy_s += time.perf_counter() - start

    def forward_one_chunk(self, chunk, *args, **kwargs):
        aux = getattr(self.submod, "aux", None)  # MoE: a micro-batch's statistics count (the
        with aux.counting() if aux is not None else contextlib.nullcontext():  # first step's
            return self._timed(self._masked, super().forward_one_chunk, chunk, *args,  # shape
                               forward=True, **kwargs)  # inference forward does not)

    def backward_one_chunk(self, chunk, *args, **kwargs):  # (a full recompute replays the
        return self._timed(self._masked, super().backward_one_chunk, chunk, *args, **kwargs)
        # forward with the checkpoint's saved random state: the masks' rows must match too)

    def backward_weight_one_chunk(self, *args, **kwargs):
        return self._timed(super().backward_weight_one_chunk, *args, **kwargs)

    def _recorded(self, ops):
        return [C.p2p_op("send" if op.op is dist.isend else "recv", op.tensor, op.peer, op.group,
                         label=BOUNDARY_LABEL) for op in ops]

    def get_fwd_recv_ops(self, fwd_chunk_id):
        return self._recorded(super().get_fwd_recv_ops(fwd_chunk_id))

    def get_fwd_send_ops(self, fwd_chunk_id):
        return self._recorded(super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_recv_ops(self, bwd_chunk_id):
        return self._recorded(super().get_bwd_recv_ops(bwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id):
        return self._recorded(super().get_bwd_send_ops(bwd_chunk_id))


class _DropoutStream:
    """Dropout under pp, exactly as one device: every dropout site draws one seed from the
    device's default generator in forward order (``layers.dropout``), so the one-device step
    draws ``K`` seeds for the whole batch. Each stage's forward of a micro-batch starts from the
    step's random state advanced by the seeds one device draws before the stage's first site
    (:meth:`seek`), and its sites take the micro-batch's rows (``micro_batch_masks``); after the
    step every rank's generator is where one device's is (:meth:`finish`: ``K`` seeds on)."""

    def __init__(self, device: torch.device, total: int, microbatches: int):
        self.device, self.total, self.microbatches = device, total, microbatches
        self.piece, self.count, self.start = 0, microbatches, None

    def _state(self):
        return (torch.get_rng_state(), torch.cuda.get_rng_state(self.device)
                if self.device.type == "cuda" else None)

    def _restore(self, state) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], self.device)

    def begin(self, grad_accum: int) -> None:
        self.start, self.count, self.piece = self._state(), grad_accum * self.microbatches, 0

    def seek(self, draws: int) -> None:
        self._restore(self.start)
        for _ in range(draws):
            draw_seed(self.device)

    def finish(self) -> None:
        self.seek(self.total)


def _dropout_draws(model: GPT) -> list[int] | None:
    """The dropout seeds one forward of each layer of a parallelised reference GPT draws (its
    attention core once, its residual dropout twice), after the embedding's one (``[emb, layer
    0, ...]``); ``None`` without dropout. A site these do not describe is a ``ValueError``."""
    if model.cfg.dropout == 0.0:
        return None
    if not isinstance(model.drop, ParallelDropout):
        raise ValueError("pipeline with dropout draws the one-device masks of parallelize's "
                         "dropout: call parallelize(model, ctx) first (at tp 1 too)")
    draws = [1]
    for i, block in enumerate(model.layers):
        if not isinstance(getattr(block, "drop", None), ParallelDropout) or not isinstance(
                getattr(block, "attn", None), Attention):
            raise ValueError(f"pipeline with dropout splits the reference attention; layer {i} "
                             f"has {type(getattr(block, 'attn', None)).__name__} (attention "
                             f"kv_split draws its own masks: use heads)")
        draws.append(3)
    return draws


class MicroBatchLoss:
    """The last stage's loss function: ``scale · CE_i / (n · m)`` for micro-batch ``i`` (its mean
    token loss over the ``m`` micro-batches of each of the ``n = accumulate`` schedules of a step,
    ``Pipeline.step(grad_accum=)``; ``scale``: the fp16 loss scale of this step, else 1).
    ``sharded``: ``(ctx, vocabulary size)`` when the logits are this TP rank's vocabulary columns
    (a Hugging Face head under ``loss_parallel``): the vocab-parallel cross-entropy."""

    def __init__(self, microbatches: int, sharded=None):
        self.microbatches, self.scale, self.sharded = microbatches, 1.0, sharded
        self.accumulate = 1
        self.per_target = None  # Pipeline.step(target_weight=): the loss a target contributes

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        reduction = "mean" if self.per_target is None else "sum"
        if self.sharded is not None:
            ctx, vocab = self.sharded
            loss = vocab_parallel_cross_entropy(logits.float(), targets, ctx, vocab_size=vocab,
                                                reduction=reduction)
        else:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                                   reduction=reduction)
        if self.per_target is not None:  # targets of ignore_index (-100) count nothing
            return loss * (self.scale * self.per_target)
        return loss * (self.scale / (self.microbatches * self.accumulate))


@dataclass
class Pipeline:
    """A GPT split over ``ctx``'s ``pp`` axis: ``model`` (this rank's parts, dense names),
    ``stages`` (this rank's :class:`GPTStage` s), ``schedule`` (pipelining's). :meth:`step`
    runs one step's forwards and backwards."""

    model: nn.Module
    ctx: object
    schedule_name: str
    microbatches: int
    stages_per_rank: int
    stages: list[nn.Module]  # GPTStage or HFStage
    schedule: object = field(repr=False)
    tied: nn.Parameter | None = field(default=None, repr=False)
    loss_fn: MicroBatchLoss | None = field(default=None, repr=False)
    tied_name: str | None = None  # its name here: ZeRO-3 (FSDP2) registers a new parameter
    runtime: list = field(default_factory=list, repr=False)  # this rank's RecordedStage s
    measure: bool = False  # time each step's schedule and this rank's busy part (timings)
    timings: list = field(default_factory=list, repr=False)

    @property
    def has_first(self) -> bool:
        return any(s.first for s in self.stages)

    @property
    def has_last(self) -> bool:
        return any(s.last for s in self.stages)

    def step(self, idx: torch.Tensor, targets: torch.Tensor, *, scaler=None, policy=None,
             grad_accum: int = 1, position_ids: torch.Tensor | None = None,
             target_weight: float | None = None) -> torch.Tensor | None:
        """Forward and backward of one batch ``idx, targets (B, T)`` in ``microbatches`` pieces of
        ``B / microbatches`` rows; gradients accumulate into ``.grad`` (zero them between steps),
        reduced over the stage's data-parallel ranks and between tied stages. Returns the loss
        (the dense model's: the mean over the batch) on the ranks holding the last stage, else
        ``None``. Every rank of the job calls it with its own rows (``idx`` is read on the first
        stage, ``targets`` on the last). ``scaler``: a
        :class:`~ops_transformer.precision.DynamicLossScaler` whose scale multiplies the backward's
        loss (``optimizer_step(scaler=)`` unscales and agrees on an overflow over every stage).
        ``policy``: a :class:`~ops_transformer.precision.PrecisionPolicy` whose autocast every
        stage's forward runs in (bf16, fp16), ``None``: fp32; the loss is taken in float32.

        ``grad_accum`` (``n``): the batch runs as ``n`` schedules one after the other, each of
        ``B / n`` rows in ``microbatches`` pieces — micro-batches of micro-batches, ``n · m``
        forwards and backwards per stage. Each piece's loss is ``CE / (n · m)``, so the
        accumulated gradient is the mean loss's; the tied embedding's sum and the gradient
        reducers run once, after the last schedule.

        ``position_ids`` ``(B, T)`` (a Hugging Face model, ``train --pack docs``): each token's
        place in its packed document, given to every stage. ``target_weight``: the loss of a
        micro-batch is then ``target_weight · Σ`` its targets' cross-entropies (the targets of
        ``-100`` count nothing) instead of ``CE / (n·m)`` — e.g. ``readers / (targets of the
        global batch)``, so that the step's gradient is the mean over every target."""
        n, m = grad_accum, self.microbatches
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"grad_accum must be a positive integer, got {n!r}")
        if idx.shape[0] % (n * m):
            what = f"grad_accum ({n}) × microbatches ({m})" if n > 1 else f"microbatches ({m})"
            raise ValueError(f"the batch ({idx.shape[0]} rows) is not divisible by {what}")
        losses: list[torch.Tensor] = []
        self.loss_fn.scale = 1.0 if scaler is None else scaler.scale_value
        self.loss_fn.accumulate = n
        self.loss_fn.per_target = target_weight
        aux_weight = self.loss_fn.scale / (n * m)  # × the coefficient: one device's CE / (n·m)
        for stage in self.stages:
            if getattr(stage, "aux", None) is not None:
                stage.aux.begin(stage.aux.coef * aux_weight)
            stage.seq_len = idx.shape[1]
            stage.autocast = (contextlib.nullcontext if policy is None else
                              lambda: policy.autocast(self.ctx.device))
        for stage in self.runtime:
            stage.busy_s = 0.0 if self.measure else None
        stream = self.runtime[0].dropout if self.runtime else None
        if stream is not None:
            stream.begin(n)
        start = time.perf_counter()
        with no_sync(self.model):  # the reducers run once, after every micro-batch
            positions = position_ids.chunk(n) if position_ids is not None else [None] * n
            for i, (x, y, pos) in enumerate(zip(idx.chunk(n), targets.chunk(n), positions)):
                if stream is not None:
                    stream.piece = i
                piece: list[torch.Tensor] = []  # (pipelining refills the list it is given)
                more = {} if pos is None else {"position_ids": pos}  # (to every stage)
                self.schedule.step(*((x,) if self.has_first else ()), target=y, losses=piece,
                                   **more)
                losses += piece
        if stream is not None:
            stream.finish()
        if self.measure:
            if self.ctx.device.type == "cuda":
                torch.cuda.synchronize(self.ctx.device)
            self._timing(time.perf_counter() - start)
        if self.tied_name is not None:  # sharded by ZeRO-3 after the split: its new parameter
            self.tied = self.model.get_parameter(self.tied_name)
        if self.tied is not None and self.tied.grad is not None:  # before the reducers: ZeRO-2's
            grad = self.tied.grad  # reduce-scatter frees it. ZeRO-3: each end's dp shard, the
            grad = grad.to_local() if hasattr(grad, "to_local") else grad  # same rows on both
            C.all_reduce(grad, self.ctx.pp_ends_group(), label="pp_tied_embedding")
        state = parallel_state_of(self.model)
        for reducer in (state.reducers if state is not None else ()):
            reducer.finish()
        if not losses:
            return None
        return torch.stack(losses).sum().detach() / self.loss_fn.scale

    def _timing(self, schedule_s: float) -> None:
        busy = sum(stage.busy_s for stage in self.runtime)
        self.timings.append({"schedule_s": schedule_s, "busy_s": busy,
                             "bubble": (schedule_s - busy) / busy if busy > 0 else None})

    def step_metrics(self, idx: torch.Tensor, targets: torch.Tensor, *, scaler=None,
                     policy=None, grad_accum: int = 1, **more) -> dict:
        """:meth:`step` for ``optimizer_step(metrics=...)``, which averages each metric over the
        ``pp × dp × ep`` ranks of a TP position: the last stage's loss counts ``pp`` times, the
        other stages' 0, so the average is the dense loss on every rank (no extra collective).
        MoE: each rank adds ``c ·`` its stages' mean aux loss to the loss and reports their
        statistics (``moe_aux_loss``, ``moe_dropped``, ``moe_slots``), ``pp`` times too, so the
        average is their sum over the stages: one device's micro-batch means."""
        loss = self.step(idx, targets, scaler=scaler, policy=policy, grad_accum=grad_accum,
                         **more)
        weight = float(self.ctx.pp_size) if loss is not None else 0.0
        auxes = [s.aux for s in self.stages if getattr(s, "aux", None) is not None]
        if not auxes:
            return {"loss": (loss if loss is not None else torch.zeros(())) * weight}
        weight, loss = float(self.ctx.pp_size), (loss if loss is not None else
                                                 torch.zeros((), device=self.ctx.device))
        # MoE: every stage adds its layers' micro-batch means (each rank's share × pp)
        pieces = grad_accum * self.microbatches
        moe = [a.metrics(pieces) for a in auxes]
        metrics = {k: sum(part[k].to(loss.device) for part in moe).float() * weight
                   for k in moe[0]}
        aux = metrics["moe_aux_loss"] * auxes[0].coef
        metrics["loss"] = aux + loss * weight
        return metrics


def pipeline(model: nn.Module, ctx, schedule: str = "1f1b", *, microbatches: int = 1,
             stages_per_rank: int = 1) -> Pipeline:
    """Split the reference GPT, or a Hugging Face causal LM of the families
    :data:`~.pipeline_hf.FAMILIES` (GPT-2, Llama, Mistral, Qwen2, Qwen3), over ``ctx``'s ``pp``
    axis by layers and return its :class:`Pipeline` (module docstring). Call it after
    ``parallelize`` (TP and dp inside each stage stay as they are) and ``lora`` (its factors are
    drawn in the dense model's order), or on a plain model. ``schedule``: one of
    :data:`~.pipeline_split.SCHEDULES` (``gpipe``, ``1f1b``, ``interleaved``, ``looped_bfs``,
    ``zero_bubble``, ``zbv``); ``microbatches`` per step; ``stages_per_rank`` (``v``) for the
    interleaved, looped and zero-bubble schedules. A split the layers do not divide is a
    ``ValueError`` here, on every rank alike, before any stage communicates."""
    hf = is_hf(model)
    if not hf and not isinstance(model, GPT):
        raise ValueError(f"pipeline splits the reference GPT (ops_transformer.GPT) and Hugging "
                         f"Face causal LMs ({', '.join(HF_FAMILIES)}); got {type(model).__name__}")
    n_layers = n_layers_of(model) if hf else model.cfg.n_layers
    if hf and n_experts_of(model):
        raise ValueError(f"pipeline does not split Hugging Face MoE models yet (n_experts "
                         f"{n_experts_of(model)}): their routers keep their own auxiliary loss; "
                         f"the reference GPT's MoE presets split")
    if ctx.pp_size < 2:
        raise ValueError(f"pipeline needs a pp axis of 2 or more stages, but ctx has pp "
                         f"{ctx.pp_size}: use init_parallel(pp=2, ...) (pp 1 is the model itself)")
    check_pipeline(n_layers, ctx.pp_size, schedule=schedule, microbatches=microbatches,
                   stages_per_rank=stages_per_rank)
    state = parallel_state_of(model)
    options = state.options if state is not None and state.options else ParallelOptions()
    if options.loss_parallel and not hf:
        raise ValueError("pipeline computes the loss from the last stage's full logits; "
                         "loss_parallel=True is not supported with pp yet")
    if getattr(model, "sequence_split", None) is not None:
        raise ValueError("pipeline does not split a context-parallel model (cp > 1) yet")
    if hf and hf_dropout_sites(model):
        raise ValueError("pipeline does not split a Hugging Face model with dropout above 0 yet "
                         "(its stages would not seek the seeds one device draws before them): "
                         "set its dropout to 0 (train --dropout 0)")
    cls_name, _, placement = SCHEDULES[schedule]
    n_stages = ctx.pp_size * stages_per_rank
    mine = rank_stages(ctx.pp_rank, ctx.pp_size, stages_per_rank, placement)
    first, last = 0 in mine, n_stages - 1 in mine
    draws = None if hf else _dropout_draws(model)  # before the split: every layer's sites
    tied_name = _tied_weight(model, first, last, ctx)
    tied = None if tied_name is None else model.get_parameter(tied_name)
    stage_cls = HFStage if hf else GPTStage
    stages = [stage_cls(model, stage_layers(n_layers, n_stages, s), first=s == 0,
                        last=s == n_stages - 1) for s in mine]
    (prune_hf if hf else _prune)(model, {i for s in stages for i in s.layer_ids}, first=first,
                                 last=last)
    if state is not None:  # the reducers over what this rank kept (LoRA's adapters, if any)
        for reducer in state.reducers:
            reducer.remove()
        state.reducers = gradient_reducers(model, ctx, options)
        state.pipeline_stages = tuple(mine)
        state.pipeline_modules = tuple(stages)
    runtime = [RecordedStage(stage, s, n_stages, ctx.device, group=ctx.pp_group)
               for stage, s in zip(stages, mine)]
    if draws is not None:  # one stream per rank: each stage seeks the seeds before its sites
        stream = _DropoutStream(ctx.device, sum(draws), microbatches)
        for stage, s in zip(runtime, mine):
            stage.dropout = stream
            first_layer = stage_layers(n_layers, n_stages, s).start
            stage.stage_draws_before = 0 if s == 0 else sum(draws[:1 + first_layer])
    m = microbatches
    loss_fn = MicroBatchLoss(m, _sharded_vocab(model, ctx, options) if hf else None)
    cls = getattr(_pp, cls_name)
    sched = (cls(runtime[0], m, loss_fn=loss_fn, scale_grads=False) if len(runtime) == 1
             and SCHEDULES[schedule][1] == "one" else
             cls(runtime, m, loss_fn=loss_fn, scale_grads=False))
    log.info("pipeline: pp=%d schedule=%s microbatches=%d stages %s on pp rank %d", ctx.pp_size,
             schedule, m, mine, ctx.pp_rank)
    return Pipeline(model, ctx, schedule, m, stages_per_rank, stages, sched, tied, loss_fn,
                    tied_name, runtime)


def _sharded_vocab(model: nn.Module, ctx, options: ParallelOptions):
    """``(ctx, vocabulary size)`` when a Hugging Face model's head hands on its rank's vocabulary
    columns (``loss_parallel`` with a vocab-parallel plan: the loss is
    :func:`~ops_transformer.layers.loss.vocab_parallel_cross_entropy`), else ``None``."""
    plan = getattr(model, "parallel_plan", None)
    if ctx.tp_size == 1 or not options.loss_parallel or getattr(plan, "vocab", None) != "parallel":
        return None
    return ctx, model.config.get_text_config().vocab_size


def _tied_weight(model: nn.Module, first: bool, last: bool, ctx) -> str | None:
    """The name of the tied embedding whose two halves live on different ranks (first xor last
    stage here), else ``None``: with both on this rank the one parameter already sums both
    gradients."""
    if is_hf(model):
        names = tied_names(model)
        embed, head = names if names else (None, None)
    else:
        embed, head = ("tok_emb.weight", "lm_head.weight") if model.cfg.tie_embeddings else \
            (None, None)
    if embed is None or ctx.pp_size == 1:
        return None
    ctx.pp_ends_group()  # made on every rank alike (new_group is collective)
    if first == last:
        return None
    if last:  # the gradient norm counts the tied weight once, on the first stage, and a
        # checkpoint holds it once, under the dense name (checkpoint/contents.py)
        model.get_parameter(head).pipeline_tied_copy = embed
        return head
    return embed


def _prune(model: GPT, layers: set[int], *, first: bool, last: bool) -> None:
    """Drop what this rank's stages do not hold, keeping the dense names of the rest."""
    for i in range(len(model.layers)):
        if i not in layers:
            model.layers[i] = nn.Identity()
    if not first:
        model.tok_emb = model.pos_emb = None
    if not last:
        model.norm = model.lm_head = None
