"""Cost model: what each strategy communicates and computes, hardware profiles, and choices."""

from .choose import attention_options, attention_problem, choose_attention, choose_vocab
from .hardware import A100_NVLINK, CPU_GLOO, HardwareProfile
from .strategies import (ATTENTION_STRATEGIES, VOCAB_MODES, LayerCost, attention_cost, ffn_cost,
                         layer_cost, vocab_cost)

__all__ = ["A100_NVLINK", "ATTENTION_STRATEGIES", "CPU_GLOO", "HardwareProfile", "LayerCost", "attention_cost",
           "attention_options", "attention_problem", "choose_attention", "ffn_cost", "layer_cost", "VOCAB_MODES", "vocab_cost", "choose_vocab"]
