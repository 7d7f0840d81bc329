"""Training the reference GPT — or fine-tuning a Hugging Face causal LM (``model``, see
:mod:`ops_transformer.finetune`) — with ``dp × ep × tp`` parallelism: the loop behind ``train`` and
``demo``.

:func:`validate` checks a :class:`TrainConfig` before any process starts; :func:`train_worker` runs on
every rank (under ``launch`` or ``torchrun``) and returns the metrics on rank 0. The loop is the plain
one a user writes — ``loss = model(x, y)[1]; loss.backward(); opt.step()`` — on a model that
:func:`parallelize` prepared; each data-parallel rank feeds its rows of the global batch, which
depends only on ``(seed, step)``, in ``grad_accum`` micro-batches (gradient accumulation: the
data-parallel reductions run once per step, on the accumulated gradients).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import asdict, dataclass

import torch

from . import checkpoints as ckpt
from . import finetune
from .config import PACKS, RunConfig, from_train_fields
from ..comm.engine import NodeLayout
from ..comm.ledger import CommLedger
from ..layers.dropout import micro_batch_masks
from .optimizer import check_memory_flags, make_optimizer, measured_state_bytes, shard_for_zero
from .data import VOCAB_SIZE, check_corpus, get_batch, load_corpus, slice_for_rank
from ..models.gpt import GPT, GPTConfig, preset
from ..parallel.context import check_mesh_degrees, init_parallel
from ..parallel.state import no_sync
from ..parallelize import ParallelOptions, parallelize
from ..parallelize.compile import check_compile
from ..parallelize.gpt_plan import gpt_plan
from ..parallelize.moe_plan import n_experts_of
from ..planner.context_parallel import CP_CHOICES, ULYSSES, check_sequence, check_ulysses
from ..parallelize.pipeline import Pipeline, pipeline
from ..parallelize.pipeline_hf import n_layers_of
from ..parallelize.pipeline_split import SCHEDULES, check_pipeline
from ..precision import DynamicLossScaler, optimizer_step, precision_policy, read_reports
from .metrics import (  # the run's reports: their home is .metrics; these names stay here too
    micro_batch,
    expected_comm_per_step,
    trainable_params,
    _n_experts,
    _moe_metrics,
    _moe_report,
    cp_metrics,
    data_position,
    _precision_stats,
    _sample,
    _metrics,
    _model_metrics,
    _dense_param_count,
    write_outputs,
    loss_series)
from .preflight import check_batch, check_train_ep
from .schedule import check_schedule, lr_at, set_lr
from ..utils.progress import Progress
from ..utils.tensorboard import ScalarLog, check_log_dir


_D = RunConfig().train_fields()  # every default, from the run's sections


@dataclass(frozen=True)
class TrainConfig:
    """One training run. ``batch`` is the global batch in sequences: each of the ``dp × ep``
    ranks that read data runs its rows in ``grad_accum`` micro-batches of
    ``batch / (grad_accum · dp · ep)`` sequences (:func:`micro_batch`). Every default is the
    run's sections' (:mod:`~ops_transformer.training.config`), defined there once."""

    preset: str = _D["preset"]
    tp: int = _D["tp"]
    dp: int | None = _D["dp"]
    steps: int = _D["steps"]
    batch: int = _D["batch"]
    seq: int = _D["seq"]
    lr: float = _D["lr"]
    seed: int = _D["seed"]
    attention: str = _D["attention"]
    data: str | None = _D["data"]
    out: str | None = _D["out"]
    sample_tokens: int = _D["sample_tokens"]
    sample_prompt: str = _D["sample_prompt"]
    progress: bool = _D["progress"]
    log_every: int = _D["log_every"]  # read the loss and metrics from the device once per N steps
    layers: int | None = _D["layers"]  # overrides the preset's n_layers
    # None: torchrun's LOCAL_WORLD_SIZE (one node without it)
    ranks_per_node: int | None = _D["ranks_per_node"]
    # PCIe islands in a node; None: detected (GPU) or one
    ranks_per_island: int | None = _D["ranks_per_island"]
    # "fp32" | "bf16" | "fp16" (with a dynamic loss scaler) | "fp8"
    precision: str = _D["precision"]
    clip_grad: float | None = _D["clip_grad"]  # clip the dense model's gradient norm to this
    ep: int = _D["ep"]  # expert-parallel degree (MoE presets): n_experts / ep experts per rank
    # log loss, tokens/s and communication there (rank 0)
    tensorboard: str | None = _D["tensorboard"]
    sequence_parallel: bool | str = _D["sequence_parallel"]  # True, or "regather"
    recompute: str = _D["recompute"]
    activation_cache: str = _D["activation_cache"]
    overlap: str = _D["overlap"]  # collectives in chunks pipelined with their matmuls
    chunks: int = _D["chunks"]
    zero: int = _D["zero"]  # ZeRO stage over dp: 0 (off), 1, 2 or 3 (parameters sharded, FSDP2)
    ckpt_dir: str | None = _D["ckpt_dir"]  # sharded checkpoints (docs/checkpoints.md)
    save_every: int = _D["save_every"]  # checkpoint every N steps (0: only after the last step)
    # continue from the newest good checkpoint in ckpt_dir, if any ("strict": from the latest
    # one, or fail)
    resume: bool | str = _D["resume"]
    # local ranks (--nproc): restart the job after a failure, this often
    max_restarts: int = _D["max_restarts"]
    keep_checkpoints: int = _D["keep_checkpoints"]  # the newest checkpoints kept in ckpt_dir
    # a failed save (full disk): "stop" the run, or "continue" it
    on_save_error: str = _D["on_save_error"]
    # a Hugging Face save_pretrained directory to fine-tune (no preset)
    model: str | None = _D["model"]
    lr_schedule: str = _D["lr_schedule"]  # or "cosine" (ops_transformer.schedule)
    warmup: int = _D["warmup"]  # linear warmup steps
    # micro-batches per step and rank; gradients reduced once per step
    grad_accum: int = _D["grad_accum"]
    # resume on another size: "auto" re-plans (rebalance.py), "off"
    rebalance: str = _D["rebalance"]
    # local ranks (--nproc): a restart drops the node whose ranks died
    elastic: bool = _D["elastic"]
    # LoRA adapters of this rank; every other weight frozen
    lora_rank: int | None = _D["lora_rank"]
    lora_alpha: float | None = _D["lora_alpha"]  # None: the rank (scaling 1)
    # module names / fnmatch patterns; None: default
    lora_targets: tuple[str, ...] | None = _D["lora_targets"]
    lora_dropout: float = _D["lora_dropout"]
    # the preset's dropout probability (None: the preset's own)
    dropout: float | None = _D["dropout"]
    # MoE capacity / aux loss: "local" per rank, or over the "global" batch
    moe_statistics: str = _D["moe_statistics"]
    cp: int = _D["cp"]  # context-parallel degree: each sequence split over cp ranks (SPEC F18)
    cp_strategy: str = _D["cp_strategy"]  # "auto", "ring" or "allgather_kv"
    # train --model: "docs" (attention inside each packed document), "naive"
    pack: str = _D["pack"]
    pp: int = _D["pp"]  # pipeline stages (outermost axis): parallelize.pipeline over the layers
    # gpipe | 1f1b | interleaved | looped_bfs | zero_bubble | zbv
    pp_schedule: str = _D["pp_schedule"]
    # pipeline micro-batches per step and data-parallel rank
    microbatches: int = _D["microbatches"]
    # None: 1, or 2 for the multi-stage schedules
    stages_per_rank: int | None = _D["stages_per_rank"]
    compile: bool = _D["compile"]  # each Transformer block through torch.compile
    compile_backend: str = _D["compile_backend"]  # "inductor", "aot_eager", "eager"
    fp8_backward: str = _D["fp8_backward"]  # --precision fp8: "e5m2" or "fp32" grads

    @classmethod
    def from_run_config(cls, run: RunConfig) -> TrainConfig:
        """The flat form of a :class:`~ops_transformer.training.config.RunConfig` (its sections'
        fields, one keyword each)."""
        return cls(**run.train_fields())

    def run_config(self) -> RunConfig:
        """This run in typed sections (each checked: a ``ValueError`` names the flag)."""
        return from_train_fields(asdict(self))

    def parallel_options(self, **more) -> ParallelOptions:
        """The options ``parallelize`` runs this training with (``more``: e.g. the precision
        policy's ``grad_reduce_dtype``)."""
        attention = "heads" if self.cp > 1 and self.attention == "auto" else self.attention
        return ParallelOptions(attention=attention, sequence_parallel=self.sequence_parallel,
                               recompute=self.recompute, activation_cache=self.activation_cache,
                               overlap=self.overlap_mode, chunks=self.chunks,
                               moe_statistics=self.moe_statistics,
                               context_parallel=self.cp_strategy, compile=self.compile,
                               compile_backend=self.compile_backend,
                               precision="fp8" if self.precision == "fp8" else "fp32",
                               fp8_backward=self.fp8_backward, **more)

    @property
    def overlap_mode(self) -> str:
        """``overlap`` (kept as a name for earlier readers: LoRA adapters now run inside the
        chunked collective matmuls, so every mode combines with ``--lora-rank``)."""
        return self.overlap

    @property
    def pp_stages_per_rank(self) -> int:
        """``stages_per_rank``, or its default for the schedule (2 where it runs several)."""
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return 2 if SCHEDULES.get(self.pp_schedule, ("", "one"))[1] == "many" else 1

    def model_config(self) -> GPTConfig:
        base = preset(self.preset)
        changes = {"max_seq_len": max(base.max_seq_len, self.seq)}
        if self.layers is not None:
            changes["n_layers"] = self.layers
        if self.dropout is not None:
            changes["dropout"] = self.dropout
        return base.with_(**changes)


def validate(cfg: TrainConfig, world_size: int, say=None) -> tuple[int, int]:
    """Every check that needs no process group; returns ``(dp, tp)``. ``say(line)``: where a
    note and the tokenizer's progress go (``train --model``), ``None`` for silence."""
    for name in ("steps", "batch", "seq", "grad_accum", "log_every"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got "
                             f"{getattr(cfg, name)}")
    if cfg.lr <= 0:
        raise ValueError(f"--lr must be positive, got {cfg.lr}")
    precision_policy(cfg.precision)  # names the valid choices
    if cfg.dropout is not None and not (isinstance(cfg.dropout, (int, float))
                                        and 0.0 <= cfg.dropout < 1.0):
        raise ValueError(f"--dropout must be in [0, 1), got {cfg.dropout!r}")
    if cfg.dropout and cfg.model and cfg.pp > 1:
        raise ValueError(f"--pp {cfg.pp} does not split a Hugging Face model (--model) with "
                         f"--dropout {cfg.dropout} yet (its stages would not seek the seeds one "
                         f"device draws before them): drop one of them")
    if cfg.clip_grad is not None and not cfg.clip_grad > 0:
        raise ValueError(f"--clip-grad must be positive, got {cfg.clip_grad}")
    ckpt.check_options(cfg)
    check_schedule(cfg.lr_schedule, cfg.warmup, cfg.steps)
    if cfg.tp > world_size:
        raise ValueError(f"--tp ({cfg.tp}) is larger than the number of processes ({world_size})")
    dp, ep, cp, tp = check_mesh_degrees(world_size, tp=cfg.tp, dp=cfg.dp, ep=cfg.ep, cp=cfg.cp,
                                        pp=cfg.pp)
    check_train_cp(cfg)
    if cfg.pp > 1:
        check_train_pipeline(cfg, dp * ep)
    if cfg.ranks_per_node is not None or cfg.ranks_per_island is not None:
        # divide the number of processes, and the ranks per node
        NodeLayout(world_size, cfg.ranks_per_node or world_size, cfg.ranks_per_island)
    if cfg.model:  # a Hugging Face checkpoint: its plan on a meta copy
        model_cfg = finetune.check_model(cfg, tp, ep)
    else:
        model_cfg = cfg.model_config()
        check_train_ep(model_cfg, cfg.preset, ep)
        if model_cfg.vocab_size < VOCAB_SIZE:
            raise ValueError(f"preset {cfg.preset!r} has vocab_size {model_cfg.vocab_size}; "
                             f"byte-level data needs at least {VOCAB_SIZE}")
    check_batch(cfg.batch, dp, ep, cfg.grad_accum)
    check_compile(cfg.compile, cp=cfg.cp, moe=bool(getattr(model_cfg, "n_experts", 0)))
    check_memory_flags(cfg, dp, tp)
    check_fp8(cfg, model_cfg)
    try:
        cfg.parallel_options()  # every option checked once (--overlap, --chunks)
    except ValueError as exc:  # "chunks must be ..." → "--chunks must be ..."
        name, _, rest = str(exc).partition(" ")
        raise ValueError(f"--{name.replace('_', '-')} {rest}") from None
    finetune.check_lora(cfg, model_cfg)
    if cfg.model:
        finetune.check_data(cfg, model_cfg, say=say)
    else:
        gpt_plan(model_cfg, tp, cfg.attention, batch=micro_batch(cfg, dp * ep), seq=cfg.seq)
        check_corpus(load_corpus(cfg.data), cfg.seq)
    check_log_dir(cfg.tensorboard)
    # each section checks its fields' types and ranges, naming the flag (after the checks above,
    # whose messages say more about the option itself)
    cfg.run_config()
    return dp, tp


def check_fp8(cfg: TrainConfig, model_cfg) -> None:
    """``--precision fp8``: what it does not combine with yet (the rest: ``ParallelOptions``)."""
    if cfg.precision != "fp8":
        return
    for flag, on in (("--cp", cfg.cp > 1),
                     # a micro-batch's activation amax is not the batch's: other scales
                     ("--pp", cfg.pp > 1),
                     ("an MoE preset", bool(getattr(model_cfg, "n_experts", 0)))):
        if on:
            raise ValueError(f"--precision fp8 does not combine with {flag} yet: drop one of them")



def check_train_cp(cfg: TrainConfig) -> None:
    """``--cp``: the sequences (``--seq``) split into ``2·cp`` chunks; ``--pack``."""
    if cfg.cp_strategy not in CP_CHOICES:
        raise ValueError(f"--cp-strategy must be one of {', '.join(CP_CHOICES)}, got "
                         f"{cfg.cp_strategy!r}")
    if cfg.pack not in PACKS:
        raise ValueError(f"--pack must be one of {', '.join(PACKS)}, got {cfg.pack!r}")
    if cfg.cp == 1:
        return
    check_sequence(cfg.seq, cfg.cp)
    if cfg.cp_strategy == ULYSSES and not cfg.model:  # --model: parallelize checks it
        m = cfg.model_config()
        try:
            check_ulysses(m.n_heads // cfg.tp, max(1, m.n_kv_heads // cfg.tp), cfg.cp)
        except ValueError as exc:
            raise ValueError(f"--cp-strategy ulysses --cp {cfg.cp}: {exc}") from None
    if cfg.sequence_parallel and (cfg.seq // cfg.cp) % cfg.tp:
        raise ValueError(f"--sequence-parallel with --cp splits each rank's s/cp = "
                         f"{cfg.seq // cfg.cp} tokens over tp ({cfg.tp}): --seq ({cfg.seq}) must "
                         f"be divisible by cp × tp ({cfg.cp * cfg.tp})")


def check_train_pipeline(cfg: TrainConfig, dp_ep: int) -> None:
    """``--pp``: the split (:func:`check_pipeline`, flags named) and what it runs with."""
    if cfg.cp > 1:
        raise ValueError(f"--pp {cfg.pp} does not combine with --cp yet: drop one of them")
    if cfg.tp > 1 and not cfg.model and cfg.model_config().n_experts:
        # pp 2 × tp 2 × ep 2 once aborted in gloo (a tp all-reduce of the expert outputs with
        # another size on each rank: docs/pipeline.md); refused until that is understood
        raise ValueError(f"--pp {cfg.pp} does not split an MoE preset at --tp {cfg.tp} yet: use "
                         f"--tp 1 (--ep inside each stage works)")
    if not cfg.model and cfg.model_config().dropout > 0 and cfg.attention == "kv_split":
        raise ValueError(f"--pp {cfg.pp} with --dropout needs --attention heads (or auto): "
                         f"kv_split draws its own masks")
    if cfg.model:
        n_layers = _pipeline_hf_layers(cfg)
    else:
        n_layers = cfg.model_config().n_layers
    try:
        check_pipeline(n_layers, cfg.pp, schedule=cfg.pp_schedule,
                       microbatches=cfg.microbatches, stages_per_rank=cfg.pp_stages_per_rank)
    except ValueError as exc:
        message = str(exc).replace("schedule must", "--pp-schedule must")
        raise ValueError(f"--pp {cfg.pp}: {message}") from None
    rows = cfg.batch // dp_ep if cfg.batch % dp_ep == 0 else None
    if rows is None or rows % (cfg.microbatches * cfg.grad_accum):
        accum = f" × --grad-accum {cfg.grad_accum}" if cfg.grad_accum > 1 else ""
        raise ValueError(f"--batch {cfg.batch} over {dp_ep} data-parallel rank(s) does not split "
                         f"into --microbatches {cfg.microbatches}{accum}")


def _pipeline_hf_layers(cfg: TrainConfig) -> int:
    """``--pp --model``: the layers of a Hugging Face decoder ``pipeline`` splits (GPT-2, Llama,
    Mistral, Qwen2, Qwen3; dense)."""
    model = finetune.meta_model(cfg.model)
    if n_experts_of(model):
        raise ValueError(f"--pp {cfg.pp} does not split {type(model).__name__} yet (MoE): use a "
                         f"dense model or --pp 1")
    try:
        n_layers = n_layers_of(model)
    except ValueError as exc:
        raise ValueError(f"--pp {cfg.pp} --model {cfg.model}: {exc}") from None
    return n_layers


@dataclass
class TrainState:
    """What one rank trains: the model :func:`parallelize` prepared, its optimizer, the precision
    policy (and loss scaler) and the corpus. :meth:`step` is one training step, the unit that
    ``train`` times and ``profile`` / ``sweep`` / ``diagnose`` measure."""

    cfg: TrainConfig
    ctx: object
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    data: object
    policy: object
    scaler: DynamicLossScaler | None
    state_bytes: dict | None = None  # this rank's parameters, gradients, optimizer state (bytes)
    pipe: Pipeline | None = None  # --pp: this rank's stages and the schedule
    read_metrics: bool = True  # False: step() leaves the report's numbers on the device

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the global batch of ``step`` (on the device): data-parallel and
        expert-parallel ranks read their own."""
        if isinstance(self.data, torch.Tensor):  # bytes: random windows
            batch = get_batch(self.data, step, batch=self.cfg.batch, seq=self.cfg.seq,
                              seed=self.cfg.seed)
        else:  # packed token sequences (train --model)
            batch = self.data.get_batch(step, batch=self.cfg.batch, seed=self.cfg.seed)
        x, y = slice_for_rank(*batch, self.ctx.dp_ep_rank, self.ctx.dp_ep_size)  # EP: own rows
        return x.to(self.ctx.device), y.to(self.ctx.device)

    def step(self, x: torch.Tensor, y: torch.Tensor):
        """Forward, backward, clipping and the optimizer step: ``(report, ledger)``, the
        optimizer's report (``report.metrics["loss"]``: the global-batch loss) and the step's
        collectives. ``x, y``: this rank's rows, run as ``cfg.grad_accum`` micro-batches. With
        :attr:`read_metrics` off (``train``'s loop, ``diagnose``) the report's metrics and
        gradient norm stay 0-d device tensors: the step makes no host synchronisation, and the
        caller reads many steps at once (:func:`~ops_transformer.precision.read_reports`)."""
        with CommLedger() as ledger:  # forward, backward, clipping and the optimizer step
            metrics = self.accumulate(x, y) if self.pipe is None else self.pipelined(x, y)
            report = optimizer_step(self.model, self.opt, self.ctx, scaler=self.scaler,
                                    max_norm=self.cfg.clip_grad, metrics=metrics,
                                    read=self.read_metrics)
            # (one all-reduce for what is small; the metrics averaged over dp × ep)
        self.state_bytes = self.state_bytes or measured_state_bytes(self.model, self.opt)
        self.opt.zero_grad(set_to_none=True)
        return report, ledger

    def pipelined(self, x: torch.Tensor, y: torch.Tensor) -> dict:
        """``--pp``: the step's schedules (``cfg.grad_accum`` of them) and their metrics; with
        ``--model --pack docs`` the documents' positions and per-target loss weights."""
        y, more = (finetune.pipeline_pack(self.cfg, self.data, self.ctx, x, y) if self.cfg.model
                   else (y, {}))
        return self.pipe.step_metrics(x, y, scaler=self.scaler, policy=self.policy,
                                      grad_accum=self.cfg.grad_accum, **more)

    def accumulate(self, x: torch.Tensor, y: torch.Tensor) -> dict:
        """Forward and backward of each micro-batch of ``x, y``, the gradients accumulating
        locally (:func:`no_sync`) until the last one's backward reduces their sum; each backward
        of ``loss / grad_accum`` (scaled, with fp16), so the accumulated gradient is the one of
        the mean loss. Every micro-batch starts from the random state the step started with, as
        every data-parallel rank does, and the dropout sites take its rows of the global batch
        (:func:`micro_batch_masks`): each draws the one-device masks of its rows whichever rank
        or micro-step runs it. Returns the step's metrics (loss and MoE statistics: micro-batch means)."""
        n = self.cfg.grad_accum
        if x.shape[0] % n:
            raise ValueError(f"{x.shape[0]} rows do not split into grad_accum ({n}) micro-batches")
        rng = _RandomState(self.ctx.device) if n > 1 else None
        parts = []
        weights = finetune.micro_batch_weights(self.cfg, self.data, self.ctx, x.chunk(n),
                                               y.chunk(n)) if self.cfg.model else None
        for i, (x_micro, y_micro) in enumerate(zip(x.chunk(n), y.chunk(n))):
            if i:
                rng.restore()
            with no_sync(self.model) if i < n - 1 else contextlib.nullcontext(), \
                    micro_batch_masks(self.model, i, n):
                with self.policy.autocast(self.ctx.device):
                    loss = (finetune.causal_lm_loss(
                        self.model, x_micro, y_micro, self.ctx,
                        finetune.pack_document_ids(self.cfg, self.data, x_micro))
                        if self.cfg.model else self.model(x_micro, y_micro)[1])
                if weights is not None:  # --pack docs: the mean over the global batch's targets
                    loss = loss * (weights[i] * n)
                scaled = loss / n if n > 1 else loss
                (scaled if self.scaler is None else self.scaler.scale(scaled)).backward()
            parts.append({"loss": loss.detach(), **_moe_metrics(self.model, self.cfg)})
        return {k: sum(torch.as_tensor(p[k], dtype=torch.float32) for p in parts) / n
                if n > 1 else parts[0][k] for k in parts[0]}


class _RandomState:
    """The default generators' state (CPU, and ``device``'s when it is a GPU), to start each
    micro-batch of a step from."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = torch.get_rng_state()
        self.gpu = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.gpu is not None:
            torch.cuda.set_rng_state(self.gpu, self.device)


def train_worker(cfg: TrainConfig, profile=None, journal=None) -> dict | None:
    """Run on every rank. Returns the metrics on global rank 0 and ``None`` elsewhere. The process
    groups it starts are torn down before it returns.

    ``profile``: the hardware profile (or its path) for the automatic choices and the collective
    algorithms; rank 0's is used by every rank (``init_parallel``). ``None``: the built-in one.
    ``journal``: where rank 0 reports its progress as it goes (anything with ``send(dict)``, e.g.
    a pipe to the launcher): ``{"start": step, "losses": [...]}`` once (the losses a resume
    carries), then ``{"loss": value}`` after each step — what an interrupted run can still
    write (``train`` does)."""
    with join(cfg, profile) as ctx:
        return _train(cfg, ctx, journal)


def _tell(journal, message: dict) -> None:
    """Send ``message`` to the journal; a launcher that is gone is no reason to stop training."""
    if journal is None:
        return
    try:
        journal.send(message)
    except (OSError, EOFError):
        pass


def join(cfg: TrainConfig, profile=None):
    """This rank's :class:`ParallelContext` for ``cfg`` (``with join(cfg) as ctx:`` tears its
    process groups down at the end); ``profile``: see :func:`train_worker`."""
    return init_parallel(tp=cfg.tp, dp=cfg.dp, ep=cfg.ep, ranks_per_node=cfg.ranks_per_node,
                         profile=profile, ranks_per_island=cfg.ranks_per_island, cp=cfg.cp,
                         pp=cfg.pp)


def setup_training(cfg: TrainConfig, ctx, *, with_data: bool = True) -> TrainState:
    """Build the parallel model, its optimizer and loss scaler on this rank of ``ctx``;
    ``with_data=False`` (the dry run, :mod:`.meta_run`): no corpus is read for a preset
    (``data`` is ``None``)."""
    torch.manual_seed(cfg.seed)  # the same dense init on every rank; each keeps its slices
    policy = precision_policy(cfg.precision)
    if cfg.model:
        model, data = finetune.build(cfg, ctx, policy)
        if ctx.pp_size > 1:  # split after parallelize and LoRA, as the reference GPT
            return _pipelined(cfg, ctx, model, data, policy)
        return _with_optimizer(cfg, ctx, model, data, policy)
    model_cfg = cfg.model_config()
    data = load_corpus(cfg.data) if with_data else None
    options = cfg.parallel_options(grad_reduce_dtype=policy.grad_reduce_dtype)
    plan = gpt_plan(model_cfg, ctx.tp_size, options.plan_attention,
                    batch=micro_batch(cfg, ctx.dp_ep_size), seq=cfg.seq,
                    profile=ctx.profile)  # `auto`: for this run's shapes, on the agreed profile
    model = parallelize(GPT(model_cfg).to(ctx.device), ctx, plan, options)
    if ctx.pp_size > 1:
        return _pipelined(cfg, ctx, model, data, policy)
    return _with_optimizer(cfg, ctx, model, data, policy)


def _pipelined(cfg: TrainConfig, ctx, model, data, policy) -> TrainState:
    """Split after parallelize and LoRA (its factors drawn in the dense model's order): TP, dp
    and the adapters inside each stage as they are."""
    model = finetune.with_lora(cfg, ctx, model)
    pipe = pipeline(model, ctx, cfg.pp_schedule, microbatches=cfg.microbatches,
                    stages_per_rank=cfg.pp_stages_per_rank)
    return dataclasses.replace(_with_optimizer(cfg, ctx, model, data, policy, add_lora=False),
                               pipe=pipe)


def _with_optimizer(cfg: TrainConfig, ctx, model, data, policy, *,
                    add_lora: bool = True) -> TrainState:
    if add_lora:  # (under pp: added before the split)
        model = finetune.with_lora(cfg, ctx, model)  # before the optimizer: it sees what trains
    shard_for_zero(model, ctx, cfg.zero, policy)  # ZeRO-3: FSDP2 over dp (× ep)
    opt = make_optimizer(model, ctx, cfg.zero, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    scaler = DynamicLossScaler(ctx) if policy.loss_scaling else None
    return TrainState(cfg, ctx, model, opt, data, policy, scaler)


def _train(cfg: TrainConfig, ctx, journal=None) -> dict | None:
    started = time.perf_counter()
    state = setup_training(cfg, ctx)
    model, opt, scaler = state.model, state.opt, state.scaler
    moe = bool(_n_experts(model))
    lead = ctx.rank == 0
    position = data_position(cfg)
    moved = (rebalanced_from(cfg, ctx) if cfg.resume and cfg.ckpt_dir and cfg.rebalance == "auto"
             else None)
    first, saved = (ckpt.resume(cfg.ckpt_dir, model, opt, ctx, position, steps=cfg.steps,
                                strict=cfg.resume == "strict", scaler=scaler)
                    if cfg.resume else (0, {}))
    losses, moe_history = list(saved.get("losses", [])), list(saved.get("moe", []))
    step_times, last, report = [], None, None
    bar = Progress(cfg.steps, desc="train", enabled=lead and cfg.progress)
    board = ScalarLog(cfg.tensorboard if lead else None)
    journal = journal if lead else None
    _tell(journal, {"start": first, "losses": list(losses)})
    if first:
        bar.write(f"resumed from step {first} of {cfg.ckpt_dir}")
        bar.update(first)
    state.read_metrics = False  # the step's numbers stay on the device until logged
    log = _StepLog(cfg, scaler, bar, board, journal, losses, moe_history if moe and not cfg.model
                   else None)
    try:
        for step in range(first, cfg.steps):
            x, y = state.batch(step)
            set_lr(opt, lr_at(step, lr=cfg.lr, steps=cfg.steps, schedule=cfg.lr_schedule,
                              warmup=cfg.warmup))
            start = time.perf_counter()
            report, ledger = state.step(x, y)
            step_times.append(time.perf_counter() - start)
            last = ledger
            log.add(step, report, ledger, step_times[-1])
            saving = cfg.ckpt_dir and ckpt.should_save(step + 1, cfg.steps, cfg.save_every)
            if saving or (step + 1 - first) % cfg.log_every == 0 or step + 1 == cfg.steps:
                report = log.flush() or report  # one host read for the interval
            if saving:
                ckpt.save(cfg.ckpt_dir, model, opt, ctx, step + 1, position, scaler=scaler,
                          keep=cfg.keep_checkpoints, extra={"losses": losses, "moe": moe_history},
                          on_error=cfg.on_save_error, meta=batch_layout(cfg, ctx))
    except BaseException:  # an interrupt or a failure: what ran still reaches the journal
        log.flush(check=False)
        raise
    bar.close()
    board.close()
    sample = None if cfg.model or ctx.pp_size > 1 else _sample(model, cfg, ctx.device)
    if not lead:
        return None
    last = last or CommLedger()  # resumed from a checkpoint of the last step: no step ran here
    return _metrics(cfg, ctx, model, losses, step_times, last, sample,
                    {"precision": cfg.precision, "clip_grad": cfg.clip_grad,
                     "grad_norm_last": report.grad_norm if report else None,
                     "comm_by_dtype": last.by_dtype(),
                     "resumed_from": first if cfg.resume else None,
                     **({"rebalanced": moved} if first and moved else {}),
                     "model_state_bytes_per_rank": state.state_bytes,
                     "lora": finetune.lora_report(model, opt, state.state_bytes),
                     "trainable_params": trainable_params(model) if cfg.lora_rank else None,
                     "wall_s": time.perf_counter() - started,
                     **({} if scaler is None else {"loss_scale": scaler.scale_value,
                                                   "skipped_steps": scaler.skipped_steps}),
                     **({"moe": {k: [m[k] for m in moe_history]
                                 for k in ("aux_loss", "dropped_fraction")}}
                        if moe_history else {})})


class _StepLog:
    """What the loop reports of each step — the losses, the journal, the progress line,
    TensorBoard, the MoE history — fed from steps whose numbers are still on the device
    (:meth:`add`) and read once per logging interval (:meth:`flush`, ``--log-every``): no host
    synchronisation in the steps between (torchtitan's ``log_freq``). What is reported per step
    is the same as reading every step; only when it is written changes."""

    def __init__(self, cfg, scaler, bar, board, journal, losses: list, moe_history: list | None):
        self.cfg, self.scaler, self.bar, self.board, self.journal = cfg, scaler, bar, board, journal
        self.losses, self.moe_history = losses, moe_history
        self.pending = []  # (step, report, ledger, seconds, loss scale, skipped steps)

    def add(self, step: int, report, ledger, seconds: float) -> None:
        scaler = self.scaler
        self.pending.append((step, report, ledger, seconds,
                             None if scaler is None else scaler.scale_value,
                             None if scaler is None else scaler.skipped_steps))
        self.bar.update()

    def flush(self, check: bool = True):
        """Read the pending steps' numbers (one transfer) and report each; returns the last read
        report (``None``: nothing pending). ``check``: a non-finite loss is an error (with fp16's
        scaler, once the scale is at its floor)."""
        pending, self.pending = self.pending, []
        if not pending:
            return None
        reports = read_reports([p[1] for p in pending])
        for (step, _, ledger, seconds, scale, skipped), report in zip(pending, reports):
            loss = report.metrics["loss"]
            self.losses.append(loss)
            _tell(self.journal, {"loss": loss})
            if check and not math.isfinite(loss) and (scale is None
                                                      or scale <= self.scaler.min_scale):
                raise ValueError(f"the loss became {loss} at step {step}; lower --lr "
                                 f"(now {self.cfg.lr})")
            self._show(step, report, ledger, seconds, scale, skipped)
        return reports[-1]

    def _show(self, step, report, ledger, seconds, scale, skipped) -> None:
        cfg, loss = self.cfg, report.metrics["loss"]
        tokens_per_s = cfg.batch * cfg.seq / seconds
        moe = None
        if self.moe_history is not None:
            moe = _moe_report(report.metrics)
            self.moe_history.append(moe)
        stats = _precision_stats(report, None)  # the scale as it was after that step
        if scale is not None:
            stats.update(scale=scale, skipped=skipped)
        self.bar.update(0, loss=loss, **{"tok/s": tokens_per_s,
                                         "comm": f"{ledger.total_bytes / 2**20:.2f}MiB/step"},
                        **stats, **({"aux": moe["aux_loss"],
                                     "dropped": f"{moe['dropped_fraction']:.1%}"} if moe else {}))
        self.board.log(step, loss=loss, tokens_per_s=tokens_per_s,
                       comm_bytes_per_step=ledger.total_bytes, comm_calls_per_step=ledger.calls,
                       grad_norm=report.grad_norm, loss_scale=scale,
                       moe_aux_loss=moe["aux_loss"] if moe else None)


def batch_layout(cfg: TrainConfig, ctx) -> dict:
    """How the global batch was split (a checkpoint's manifest records it, :mod:`.rebalance`
    reads it): ``{"global_batch", "micro_batch", "grad_accum", "settings"}`` (``settings``: the
    :data:`RESUMED_SETTINGS` of the run)."""
    return {"global_batch": cfg.batch, "micro_batch": micro_batch(cfg, ctx.dp_ep_size),
            "grad_accum": cfg.grad_accum,
            "settings": {k: getattr(cfg, k) for k in RESUMED_SETTINGS}}


# What a resume takes from its checkpoint unless the command line sets it (the LoRA settings
# too, from the manifest's adapters): ``train --resume`` keeps the run's batch, sequence and
# schedule (:func:`ops_transformer.rebalance.resumed_settings`).
RESUMED_SETTINGS = ("batch", "seq", "lr", "lr_schedule", "warmup")


def rebalanced_from(cfg: TrainConfig, ctx) -> dict | None:
    """``{"from", "to"}``: the layout and batch split of the checkpoint a resume starts from and
    of this run, when they differ (``None`` when not, or without a checkpoint)."""
    saved = ckpt.saved_split(cfg.ckpt_dir, cfg.batch)
    now = {"world_size": ctx.world_size, "dp": ctx.dp_size, "ep": ctx.ep_size,
           "tp": ctx.tp_size, "grad_accum": cfg.grad_accum,
           "micro_batch": micro_batch(cfg, ctx.dp_ep_size)}
    old = None if saved is None else {k: saved[k] for k in now}
    return None if old in (None, now) else {"from": old, "to": now}
