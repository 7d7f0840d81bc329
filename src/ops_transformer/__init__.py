"""ops-transformer: exact, low-overhead tensor parallelism for Transformers on PyTorch.

The public names, one table: each is imported from its module when first used (PEP 562), so
``import ops_transformer`` — and ``ops-transformer train --help`` — import no torch."""

from __future__ import annotations

import importlib
import sys
import types

from ._version import __version__
from .launch import launch  # the function: bound after the subpackage of that name (torch-free)
from .utils.aliases import install

EXPORTS = {  # public name → the module that defines it
    "ParallelContext": "parallel.context", "init_parallel": "parallel.context",
    "ShardSpec": "parallel.sharding", "gather_full": "parallel.sharding",
    "gather_full_state_dict": "parallel.sharding", "no_sync": "parallel.state",
    "GradSums": "parallel.grad_reduce",
    "launch": "launch", "RankError": "launch", "launch_with_restarts": "launch",
    "CommLedger": "comm", "copy_to_tp_region": "comm", "reduce_from_tp_region": "comm",
    "scatter_to_tp_region": "comm", "gather_from_tp_region": "comm",
    "all_gather_along": "comm", "reduce_scatter_along": "comm", "all_to_all": "comm",
    "all_reduce_coalesced": "comm.bucketing", "mark_partial_grad": "comm.bucketing",
    "ColumnParallelLinear": "layers", "RowParallelLinear": "layers",
    "VocabParallelEmbedding": "layers", "vocab_parallel_cross_entropy": "layers",
    "ColumnParallelEmbedding": "layers.embedding",
    "PackedRowParallelLinear": "layers.linear_variants",
    "PaddedColumnParallelLinear": "layers.linear_variants",
    "PaddedRowParallelLinear": "layers.linear_variants",
    "ParallelExperts": "layers.moe", "ParallelMoE": "layers.moe",
    "GPT": "models", "GPTConfig": "models", "MoE": "models.moe", "moe_stats": "models.moe",
    "Plan": "parallelize", "ParallelOptions": "parallelize", "parallelize": "parallelize",
    "parallel_linear": "parallelize.linear_split", "lora": "parallelize.lora",
    "LoRAConfig": "parallelize.lora", "pipeline": "parallelize.pipeline",
    "Pipeline": "parallelize.pipeline",
    "DynamicLossScaler": "precision", "clip_grad_norm_": "precision",
    "optimizer_step": "precision", "precision_policy": "precision",
    "Diagnostic": "profiler", "Profile": "profiler", "diagnose": "profiler",
    "profile_step": "profiler",
    "Int8ActivationCache": "memory", "activation_memory": "memory",
    "zero_optimizer": "memory", "shard_parameters": "memory",
    "save_checkpoint": "checkpoint", "load_checkpoint": "checkpoint",
    "CheckpointError": "checkpoint",
    "from_pretrained": "loading",
    "check_parity": "parity", "ParityReport": "parity",
    "TrainConfig": "training.loop", "dry_run": "training.meta_run",
}
__all__ = list(EXPORTS)

# module names of earlier versions (the top-level modules and parallel/'s process management)
install({f"{__name__}.{old}": f"{__name__}.{new}" for old, new in {
    "train": "training.loop", "finetune": "training.finetune",
    "rebalance": "training.rebalance", "schedule": "training.schedule",
    "data": "training.data", "corpus": "training.corpus",
    "memory.train_flags": "training.optimizer", "checkpoint.training": "training.checkpoints",
    "parallel.launch": "launch.local", "parallel.rank_process": "launch.rank_process",
    "parallel.rendezvous": "launch.rendezvous", "parallel.restart": "launch.restart",
    "parallel.teardown": "launch.teardown"}.items()})


def __getattr__(name: str):
    module = EXPORTS.get(name)
    if module is None:  # a subpackage, or a module of earlier versions (``ot.train``)
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
        globals()[name] = value
        return value
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    """Keeps a public name that is also a subpackage (``parallelize``, ``launch``) the function:
    importing the subpackage does not rebind it, as it did not in earlier versions."""

    def __setattr__(self, name, value):
        if isinstance(value, types.ModuleType) and name in EXPORTS and EXPORTS[name] == name:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __dir__() -> list[str]:
    return sorted({*globals(), *EXPORTS})
