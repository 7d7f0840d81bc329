"""ops-transformer: exact, low-overhead tensor parallelism for Transformers on PyTorch."""

from .comm import (CommLedger, all_gather_along, all_to_all, copy_to_tp_region,
                   gather_from_tp_region, reduce_from_tp_region, reduce_scatter_along,
                   scatter_to_tp_region)
from .layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                     vocab_parallel_cross_entropy)
from .models import GPT, GPTConfig
from .parallel.state import no_sync
from .parallelize import ParallelOptions, Plan, parallelize
from .parallelize.linear_split import parallel_linear
from .parallelize.lora import LoRAConfig, lora
from .parallel import (ParallelContext, RankError, ShardSpec, gather_full, gather_full_state_dict,
                       init_parallel, launch)

from ._version import __version__  # noqa: E402, F401

__all__ = [
    "ParallelContext", "init_parallel", "launch", "RankError",
    "CommLedger", "copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region",
    "gather_from_tp_region", "all_gather_along", "reduce_scatter_along", "all_to_all",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy", "ShardSpec", "gather_full", "gather_full_state_dict",
    "GPT", "GPTConfig", "Plan", "ParallelOptions", "parallelize", "no_sync", "parallel_linear",
    "lora", "LoRAConfig",
]
from .comm.bucketing import all_reduce_coalesced, mark_partial_grad
from .parallel.grad_reduce import GradSums
from .precision import DynamicLossScaler, clip_grad_norm_, optimizer_step, precision_policy
__all__ += ["DynamicLossScaler", "clip_grad_norm_", "optimizer_step", "precision_policy",
            "GradSums", "all_reduce_coalesced", "mark_partial_grad"]
from .layers.embedding import ColumnParallelEmbedding
from .layers.linear_variants import (PackedRowParallelLinear, PaddedColumnParallelLinear,
                                     PaddedRowParallelLinear)
__all__ += ["ColumnParallelEmbedding", "PackedRowParallelLinear", "PaddedColumnParallelLinear",
            "PaddedRowParallelLinear"]
from .layers.moe import ParallelExperts, ParallelMoE  # noqa: E402
from .models.moe import MoE, moe_stats  # noqa: E402

__all__ += ["ParallelExperts", "ParallelMoE", "MoE", "moe_stats"]
from .profiler import Diagnostic, Profile, diagnose, profile_step
__all__ += ["Diagnostic", "Profile", "diagnose", "profile_step"]
from .memory import (Int8ActivationCache, activation_memory, shard_parameters,  # noqa: E402
                     zero_optimizer)
__all__ += ["Int8ActivationCache", "activation_memory", "zero_optimizer", "shard_parameters"]

from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint  # noqa: E402

__all__ += ["save_checkpoint", "load_checkpoint", "CheckpointError"]
from .loading import from_pretrained  # noqa: E402

__all__ += ["from_pretrained"]

from .parity import ParityReport, check_parity  # noqa: E402

__all__ += ["check_parity", "ParityReport"]
from .parallelize.pipeline import Pipeline, pipeline  # noqa: E402

__all__ += ["pipeline", "Pipeline"]
