"""The planner and cost model: what each strategy communicates and computes, hardware catalogue
and profiles, memory, and the layout search. It is pure: it launches no rank and runs
no training (measuring this machine and checking predictions against runs live in
:mod:`ops_transformer.profiler`)."""

from .catalogue import GPUS, LINKS, gpu, link
from .choose import attention_options, attention_problem, choose_attention, choose_vocab
from .cost import Comm, collective_time, comm_time, hierarchical_time, ring_steps
from .efficiency import default_efficiency
from .hardware import A100_NVLINK, CPU_GLOO, HardwareProfile
from .layout import CostOptions, Layout
from .memory import activation_bytes_per_layer, logits_bytes, model_state_bytes
from .calibrated import CalibratedProfile, load_profile
from .search import Options, evaluate_layout, execution, search
from .timing import Execution, zero_comm
from .specs import MODEL_PRESETS, ClusterSpec, ModelSpec
from .strategies import (ATTENTION_STRATEGIES, VOCAB_MODES, LayerCost, attention_cost, ffn_cost,
                         layer_cost, model_comm_per_step, vocab_cost)
from .strategies import moe_cost
from .cp_exchange import CP_STRATEGIES, cp_layer_comm, exposed_cp_time
from .pipeline import SCHEDULES, bubble_fraction, in_flight_micro_batches
from .roofline import gemm_time, wave_efficiency

__all__ = [
    "A100_NVLINK", "ATTENTION_STRATEGIES", "CPU_GLOO", "CalibratedProfile", "ClusterSpec", "GPUS",
    "HardwareProfile", "LINKS", "LayerCost", "MODEL_PRESETS", "ModelSpec",
    "VOCAB_MODES", "activation_bytes_per_layer", "attention_cost", "attention_options",
    "attention_problem", "choose_attention", "choose_vocab", "ffn_cost", "gpu",
    "layer_cost", "link", "load_profile", "model_state_bytes", "search", "vocab_cost",
    "Comm", "Execution", "Options", "collective_time", "comm_time", "default_efficiency",
    "evaluate_layout", "execution", "hierarchical_time", "logits_bytes", "model_comm_per_step",
    "ring_steps", "zero_comm",
]
__all__ += ["CostOptions", "Layout", "moe_cost", "CP_STRATEGIES", "SCHEDULES", "bubble_fraction", "cp_layer_comm",
            "exposed_cp_time", "gemm_time", "in_flight_micro_batches", "wave_efficiency"]
