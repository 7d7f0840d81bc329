"""Reference models: plain single-device PyTorch with no knowledge of parallelism."""

from .gpt import GPT, PRESETS, GPTConfig, preset

__all__ = ["GPT", "GPTConfig", "PRESETS", "preset"]

from .moe import MoE, Router, moe_stats  # noqa: E402

__all__ += ["MoE", "Router", "moe_stats"]
