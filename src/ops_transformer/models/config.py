"""The reference GPT's configuration: :class:`GPTConfig` (global sizes, checked when built) and
its named :data:`PRESETS` — torch-free, so that the command line and a run's file can check a model's
sizes before any rank (or torch) starts. The model itself is :mod:`ops_transformer.models.gpt`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace


def check_moe_config(cfg) -> None:
    """The MoE fields of a :class:`~ops_transformer.models.GPTConfig`, each named when invalid."""
    if cfg.n_experts < 0:
        raise ValueError(f"n_experts must be 0 (dense FFN) or positive, got {cfg.n_experts}")
    if cfg.moe_every < 1:
        raise ValueError(f"moe_every must be at least 1, got {cfg.moe_every}")
    if cfg.moe_aux_loss_coef < 0:
        raise ValueError(f"moe_aux_loss_coef must be non-negative, got {cfg.moe_aux_loss_coef}")
    if cfg.moe_capacity_factor is not None and not cfg.moe_capacity_factor > 0:
        raise ValueError(f"moe_capacity_factor must be positive or None (dropless), got "
                         f"{cfg.moe_capacity_factor}")
    if cfg.n_experts and not 1 <= cfg.top_k <= cfg.n_experts:
        raise ValueError(f"top_k ({cfg.top_k}) must be between 1 and n_experts "
                         f"({cfg.n_experts})")


@dataclass(frozen=True)
class GPTConfig:
    """Global sizes of the whole model (never per-rank sizes)."""

    vocab_size: int = 256
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: same as n_heads (MHA); 1: MQA; else GQA
    d_ff: int = 256
    max_seq_len: int = 64
    norm: str = "layernorm"  # "layernorm" | "rmsnorm"
    pos: str = "learned"  # "learned" | "rope"
    mlp: str = "gelu"  # "gelu" | "swiglu"
    bias: bool = True
    tie_embeddings: bool = True
    dropout: float = 0.0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # Mixture of experts (models/moe.py): n_experts 0 is the dense FFN; every moe_every-th layer
    # (layers moe_every-1, 2·moe_every-1, ...) routes each token to top_k of n_experts FFNs.
    n_experts: int = 0
    top_k: int = 2
    moe_capacity_factor: float | None = None  # None: dropless
    moe_aux_loss_coef: float = 0.01
    moe_every: int = 1

    def __post_init__(self):
        kv = self.n_heads if self.n_kv_heads is None else self.n_kv_heads
        object.__setattr__(self, "n_kv_heads", kv)
        choices = {"norm": ("layernorm", "rmsnorm"), "pos": ("learned", "rope"),
                   "mlp": ("gelu", "swiglu")}
        for name, valid in choices.items():
            if getattr(self, name) not in valid:
                raise ValueError(f"{name} must be one of {valid}, got {getattr(self, name)!r}")
        for name in ("vocab_size", "n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff",
                     "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads "
                             f"({self.n_heads})")
        if self.n_heads % kv:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({kv})")
        if self.pos == "rope" and self.head_dim % 2:
            raise ValueError(f"rope needs an even head dimension, got {self.head_dim}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        check_moe_config(self)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_experts > 0 and (layer + 1) % self.moe_every == 0

    def to_dict(self) -> dict:
        return asdict(self)

    def with_(self, **changes) -> GPTConfig:
        """A copy with ``changes``; a multi-head config stays multi-head when ``n_heads`` changes."""
        if "n_heads" in changes and "n_kv_heads" not in changes and self.n_kv_heads == self.n_heads:
            changes["n_kv_heads"] = None
        return replace(self, **changes)


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=256, n_layers=2, d_model=64, n_heads=4, d_ff=256,
                      max_seq_len=128),
    "small": GPTConfig(vocab_size=256, n_layers=4, d_model=256, n_heads=8, d_ff=1024,
                       max_seq_len=256),
    "llama-tiny": GPTConfig(vocab_size=256, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2,
                            d_ff=176, max_seq_len=128, norm="rmsnorm", pos="rope", mlp="swiglu",
                            bias=False, tie_embeddings=False),
    "llama-style": GPTConfig(vocab_size=256, n_layers=4, d_model=256, n_heads=8, n_kv_heads=2,
                             d_ff=688, max_seq_len=256, norm="rmsnorm", pos="rope", mlp="swiglu",
                             bias=False, tie_embeddings=False),
    "moe-tiny": GPTConfig(vocab_size=256, n_layers=2, d_model=64, n_heads=4, d_ff=128,
                          max_seq_len=128, n_experts=4, top_k=2, moe_capacity_factor=1.25),
    "moe-small": GPTConfig(vocab_size=256, n_layers=4, d_model=256, n_heads=8, d_ff=512,
                           max_seq_len=256, n_experts=8, top_k=2, moe_capacity_factor=1.25),
    "gpt2-124m": GPTConfig(vocab_size=50257, n_layers=12, d_model=768, n_heads=12, d_ff=3072,
                           max_seq_len=1024),
}


def preset(name: str, **overrides) -> GPTConfig:
    """A named configuration (``tiny``, ``small``, ``llama-tiny``, ``llama-style``, ``moe-tiny``,
    ``moe-small``, ``gpt2-124m``), optionally with some fields changed."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].with_(**overrides)


def check_ffn_split(cfg: GPTConfig, tp: int) -> None:
    """The FFN's hidden size splits over ``tp`` ranks (column → row, every plan)."""
    if cfg.d_ff % tp:
        raise ValueError(f"d_ff ({cfg.d_ff}) is not divisible by tp ({tp})")
