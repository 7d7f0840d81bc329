"""Sharded checkpoints and recovery (SPEC F13): atomic, verified, resumable bit-exactly,
reshardable to another layout. See ``docs/checkpoints.md``."""

from ..layers.moe import ParallelExperts
from ..memory.zero import ZeroOptimizer
from ..parallelize.hf_experts import HFExperts
from .api import load_checkpoint, verify
from .writer import save_checkpoint
from .contents import ModelTensors, register_module_entries
from .experts import expert_entries, hf_expert_entries
from .errors import CheckpointError, DamagedCheckpointError, NoSpaceError
from .reader import UnsafeCheckpointError
from .layout import Entry, Layout, Replicated, SpecLayout, layout_of
from .optim import OptimizerAdapter, TorchOptimizerAdapter, register_optimizer_adapter
from ..launch.restart import launch_with_restarts
from .store import latest_step, list_steps
from .zero_adapter import ZERO_ADAPTER, ZeroOptimizerAdapter

register_module_entries(ParallelExperts, expert_entries)
register_module_entries(HFExperts, hf_expert_entries)
register_optimizer_adapter(ZeroOptimizer, ZERO_ADAPTER)

__all__ = ["save_checkpoint", "load_checkpoint", "verify", "CheckpointError", "Layout",
           "Replicated", "SpecLayout", "layout_of", "OptimizerAdapter", "TorchOptimizerAdapter",
           "register_optimizer_adapter", "latest_step", "list_steps", "launch_with_restarts", "Entry",
           "ModelTensors", "register_module_entries", "ZeroOptimizerAdapter",
           "DamagedCheckpointError", "NoSpaceError", "UnsafeCheckpointError"]
