"""Sharded checkpoints and recovery (SPEC F13): atomic, verified, resumable bit-exactly,
reshardable to another layout. See ``docs/checkpoints.md``."""

from .api import load_checkpoint, save_checkpoint, verify
from .errors import CheckpointError
from .layout import Layout, Replicated, SpecLayout, layout_of
from .training import check_options, resume, save, should_save
from .optim import OptimizerAdapter, TorchOptimizerAdapter, register_optimizer_adapter
from .restart import launch_with_restarts
from .store import latest_step, list_steps

__all__ = ["save_checkpoint", "load_checkpoint", "verify", "CheckpointError", "Layout",
           "Replicated", "SpecLayout", "layout_of", "OptimizerAdapter", "TorchOptimizerAdapter",
           "register_optimizer_adapter", "latest_step", "list_steps", "launch_with_restarts"]
