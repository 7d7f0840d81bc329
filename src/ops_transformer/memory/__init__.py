"""Memory (SPEC F7): activation recompute, the 8-bit activation cache, TP-aware ZeRO and measured
activation memory, parameters sharded over data parallelism through FSDP2 (ZeRO-3). Sequence parallelism lives with the layers
(:mod:`ops_transformer.layers.sequence_parallel`) and plans
(:mod:`ops_transformer.parallelize.sequence_plan`)."""

from .int8_cache import Int8ActivationCache
from ..models.hf import transformer_layers
from .apply import apply_memory_options
from .measure import activation_memory
from .recompute import RECOMPUTE, apply_recompute, checkpointed
from .fsdp import shard_parameters
from .zero import ZeroOptimizer, zero_optimizer

__all__ = ["Int8ActivationCache", "activation_memory", "apply_memory_options", "apply_recompute",
           "checkpointed", "transformer_layers", "RECOMPUTE", "ZeroOptimizer", "zero_optimizer",
           "shard_parameters"]
