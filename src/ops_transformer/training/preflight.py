"""The checks of a run that need neither a rank nor torch, made before anything heavy is imported:
``ops-transformer train``'s argument errors in well under two seconds. :func:`preflight` checks
the layout against the processes, the batch's split, a reference preset's sizes against ``tp``
and ``--seq`` against a ``--model`` directory's positions (its ``config.json`` read as JSON) —
with the functions, and so the messages, that
:func:`~ops_transformer.training.loop.validate` runs again among every other check once torch is
there."""

from __future__ import annotations

import json
from pathlib import Path

from ..models.config import GPTConfig, check_ffn_split, preset
from ..schema.mesh import check_mesh_degrees
from .config import RunConfig


def preflight(run: RunConfig, world_size: int) -> tuple[int, int, int, int]:
    """``run`` on ``world_size`` processes: ``--tp`` at most the processes, the degrees' product
    the world size, ``--batch`` split over the ranks that read data and ``--grad-accum``, a
    preset's FFN split over ``tp``; returns ``(dp, ep, cp, tp)``. A ``ValueError`` names the
    flag."""
    layout = run.layout
    if layout.tp > world_size:
        raise ValueError(f"--tp ({layout.tp}) is larger than the number of processes "
                         f"({world_size})")
    dp, ep, cp, tp = check_mesh_degrees(world_size, tp=layout.tp, dp=layout.dp, ep=layout.ep,
                                        cp=layout.cp, pp=layout.pp)
    if run.model.dir is None:  # the experts before the batch: --ep's own message first
        check_train_ep(preset(run.model.preset), run.model.preset, ep)
    check_batch(run.run.batch, dp, ep, run.run.grad_accum)
    if run.model.dir is None:
        check_ffn_split(preset(run.model.preset), tp)
    else:  # the rest of a --model directory's checks need its meta copy (torch)
        limit = position_limit(json_config(run.model.dir))
        check_positions(run.run.seq, limit, run.model.dir)
    return dp, ep, cp, tp


def check_train_ep(model_cfg: GPTConfig, preset_name: str, ep: int) -> None:
    """``--ep`` needs an MoE preset whose experts divide by it."""
    if ep > 1 and not model_cfg.n_experts:
        raise ValueError(f"--ep ({ep}) needs a mixture-of-experts preset (moe-tiny, moe-small); "
                         f"{preset_name!r} has a dense FFN")
    if model_cfg.n_experts and model_cfg.n_experts % ep:
        raise ValueError(f"--ep ({ep}) must divide the preset's n_experts "
                         f"({model_cfg.n_experts})")


def json_config(model_dir: str) -> dict:
    """A Hugging Face directory's ``config.json`` as a dict (its text model's, for a multimodal
    one); ``{}`` where there is none to read (the model's own checks say why, later)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    text = config.get("text_config") if isinstance(config, dict) else None
    return text if isinstance(text, dict) else (config if isinstance(config, dict) else {})


def position_limit(config) -> int | None:
    """The positions a model was built for: ``max_position_embeddings``, or GPT-2's
    ``n_positions`` (``config``: a dict, or a ``transformers`` config)."""
    get = config.get if isinstance(config, dict) else (lambda k: getattr(config, k, None))
    return get("max_position_embeddings") or get("n_positions")


def check_positions(seq: int, limit: int | None, model_dir: str) -> None:
    """``--seq`` within the ``limit`` positions of the model in ``model_dir``: beyond them a
    learned table has no row and rotary positions were never trained."""
    if limit and seq > limit:
        raise ValueError(f"--seq {seq} is beyond the {limit} positions of the model in "
                         f"{model_dir} (max_position_embeddings in its config.json): pass "
                         f"--seq {limit} or less")


def check_batch(batch: int, dp: int, ep: int, grad_accum: int) -> None:
    """The global batch splits into ``grad_accum`` micro-batches on each of the ``dp × ep``
    ranks that read data."""
    readers = ("dp ({dp})" if ep == 1 else "dp ({dp}) × ep ({ep})").format(dp=dp, ep=ep)
    if batch % (dp * ep):
        raise ValueError(f"--batch ({batch}) must be divisible by {readers}" if ep == 1 else
                         f"--batch ({batch}) must be divisible by {readers}: each of the "
                         f"{dp * ep} ranks reads its own rows")
    if batch % (dp * ep * grad_accum):
        raise ValueError(f"--batch ({batch}) must be divisible by {readers} × --grad-accum "
                         f"({grad_accum}): each rank runs {batch // (dp * ep)} rows in "
                         f"{grad_accum} equal micro-batches")
