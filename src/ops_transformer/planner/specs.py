"""What the planner plans for: a model (:class:`ModelSpec`) and a cluster (:class:`ClusterSpec`).

Both are frozen dataclasses with global sizes only, validated at construction, that print and
round-trip through JSON (``to_dict`` / ``from_dict``). A model spec comes from a preset below, from
our :class:`~ops_transformer.models.GPTConfig`, or from a Hugging Face config
(:meth:`ModelSpec.load` takes any of them); a cluster spec (:mod:`.cluster`) from the hardware
catalogue.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from ..models.gpt import PRESETS as GPT_PRESETS
from ..models.gpt import GPTConfig
from .cluster import ClusterSpec

FFN_TYPES = ("gelu", "swiglu")
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
_ARCH_CHOICES = {"norm": ("layernorm", "rmsnorm"), "pos": ("learned", "rope")}


@dataclass(frozen=True)
class ModelSpec:
    """A decoder (or encoder) stack, whole-model sizes, and the run's sequence, batch and dtype.

    The architecture fields are those of :class:`~ops_transformer.models.GPTConfig` under the
    planner's names: :meth:`gpt_config` and :meth:`from_gpt_config` convert both ways without
    loss, and the cost formulas that the model and the planner share read a ``GPTConfig``.
    ``ffn`` is the FFN width of one expert; ``kv_heads < heads`` is GQA; ``experts > 1`` is a
    top-``top_k`` MoE FFN in every layer; ``tie_embeddings``: the LM head reuses the input
    embedding; ``dropout > 0`` keeps dropout masks for backward (activation memory)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    ffn_type: str  # "gelu" (two matrices) | "swiglu" (three)
    vocab: int
    seq: int
    global_batch: int  # sequences per optimizer step
    micro_batch: int = 1  # sequences per forward pass on one data-parallel rank
    experts: int = 1
    top_k: int = 1
    dtype: str = "bf16"
    tie_embeddings: bool = False
    norm: str = "layernorm"
    pos: str = "learned"
    bias: bool = False
    dropout: float = 0.0

    def __post_init__(self):
        for f in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq", "global_batch",
                  "micro_batch", "experts", "top_k"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f} must be a positive integer, got {value!r}")
        if self.ffn_type not in FFN_TYPES:
            raise ValueError(f"ffn_type must be one of {FFN_TYPES}, got {self.ffn_type!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {tuple(DTYPE_BYTES)}, got {self.dtype!r}")
        for f, valid in _ARCH_CHOICES.items():
            if getattr(self, f) not in valid:
                raise ValueError(f"{f} must be one of {valid}, got {getattr(self, f)!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be divisible by kv_heads "
                             f"({self.kv_heads})")
        if self.top_k > self.experts:
            raise ValueError(f"top_k ({self.top_k}) must be at most experts ({self.experts})")
        if self.global_batch % self.micro_batch:
            raise ValueError(f"global_batch ({self.global_batch}) must be a multiple of "
                             f"micro_batch ({self.micro_batch})")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def _params(self, experts_used: int) -> int:
        h, v = self.hidden, self.vocab
        attention = h * (h + 2 * self.kv_dim) + h * h  # fused QKV, then the output projection
        ffn = (2 if self.ffn_type == "gelu" else 3) * h * self.ffn * experts_used
        router = h * self.experts if self.experts > 1 else 0
        per_layer = attention + ffn + router + 2 * h  # two norms (weights only, no biases)
        head = 0 if self.tie_embeddings else v * h
        return v * h + self.layers * per_layer + h + head  # embedding, layers, final norm, head

    def params(self) -> int:
        """Parameters, all experts counted: embedding ``V·h``; per layer attention
        ``h·(h + 2·kv_dim) + h·h``, FFN ``2·h·ffn`` (gelu) or ``3·h·ffn`` (swiglu) per expert, the
        router ``h·experts`` when there are experts, two norms ``2h``; a final norm ``h``; the LM
        head ``V·h`` unless tied. Biases and learned position embeddings are not counted (GPT-2's
        add 0.8 M to 124 M)."""
        return self._params(self.experts)

    def active_params(self) -> int:
        """Parameters one token passes through: ``top_k`` experts instead of all of them."""
        return self._params(self.top_k)

    def flops_per_token(self) -> float:
        """Training FLOPs (forward + backward) per token: 6 per parameter a token multiplies
        (Kaplan et al. 2020, §2.1: C ≈ 6N) plus attention scores and values, ``12·layers·h·seq``
        (Narayanan et al. 2021, eq. 3). The LM head counts, the embedding lookup does not, so for
        a dense MHA model this is Narayanan's count without recomputation, per token
        ``72·l·h² + 12·l·h·s + 6·V·h`` (their eq. 3, ``96·B·s·l·h²·(1 + s/6h + V/16lh)``, adds a
        recomputed forward pass of the layers), up to the norms."""
        matmul_params = self.active_params() - (0 if self.tie_embeddings else
                                                self.vocab * self.hidden)
        return 6.0 * matmul_params + 12.0 * self.layers * self.hidden * self.seq

    def bytes_per_element(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelSpec:
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown ModelSpec fields {sorted(unknown)}")
        return cls(**d)

    def with_(self, **changes) -> ModelSpec:
        return replace(self, **changes)

    def gpt_config(self) -> GPTConfig:
        """The architecture as our reference decoder's config (``max_seq_len`` = ``seq``)."""
        return GPTConfig(vocab_size=self.vocab, n_layers=self.layers, d_model=self.hidden,
                         n_heads=self.heads, n_kv_heads=self.kv_heads, d_ff=self.ffn,
                         max_seq_len=self.seq, norm=self.norm, pos=self.pos, mlp=self.ffn_type,
                         bias=self.bias, tie_embeddings=self.tie_embeddings,
                         dropout=self.dropout,
                         **({"n_experts": self.experts, "top_k": self.top_k}  # MoE in every layer
                            if self.experts > 1 else {}))

    @classmethod
    def from_gpt_config(cls, cfg: GPTConfig, *, seq: int | None = None, global_batch: int = 8,
                        micro_batch: int = 1, dtype: str = "fp32",
                        name: str | None = None) -> ModelSpec:
        """The spec of our reference decoder; ``seq`` defaults to ``cfg.max_seq_len``."""
        return cls(name=name or f"gpt-{cfg.n_layers}x{cfg.d_model}", layers=cfg.n_layers,
                   hidden=cfg.d_model, heads=cfg.n_heads, kv_heads=cfg.n_kv_heads, ffn=cfg.d_ff,
                   ffn_type=cfg.mlp, vocab=cfg.vocab_size, seq=seq or cfg.max_seq_len,
                   global_batch=global_batch, micro_batch=micro_batch, dtype=dtype,
                   tie_embeddings=cfg.tie_embeddings, norm=cfg.norm, pos=cfg.pos, bias=cfg.bias,
                   dropout=cfg.dropout, experts=max(cfg.n_experts, 1),
                   top_k=cfg.top_k if cfg.n_experts > 1 else 1)

    @classmethod
    def from_hf_config(cls, config, *, seq: int | None = None, global_batch: int = 8,
                       micro_batch: int = 1, dtype: str = "bf16",
                       name: str | None = None) -> ModelSpec:
        """The spec of a Hugging Face config: GPT-2 (``n_embd``, ``n_inner``), Llama / Mistral /
        Qwen2 (``num_key_value_heads``), Mixtral (``num_local_experts``, ``num_experts_per_tok``),
        BERT. A ``silu`` activation means a gated (SwiGLU) FFN, as in all of those families.
        ``seq`` defaults to the config's maximum positions — pass the training length."""
        hidden = _hf_attr(config, "hidden_size", "n_embd", "d_model")
        heads = _hf_attr(config, "num_attention_heads", "n_head")
        act = getattr(config, "hidden_act", None) or getattr(config, "activation_function", "")
        return cls(
            name=name or getattr(config, "_name_or_path", "") or config.model_type,
            layers=_hf_attr(config, "num_hidden_layers", "n_layer"), hidden=hidden, heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            ffn=_hf_attr(config, "intermediate_size", "n_inner", default=4 * hidden),
            ffn_type="swiglu" if str(act) in ("silu", "swish") else "gelu",
            vocab=_hf_attr(config, "vocab_size"),
            seq=seq or _hf_attr(config, "max_position_embeddings", "n_positions"),
            global_batch=global_batch, micro_batch=micro_batch,
            experts=getattr(config, "num_local_experts", None) or 1,
            top_k=getattr(config, "num_experts_per_tok", None) or 1, dtype=dtype,
            tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            **_hf_architecture(config))

    @classmethod
    def load(cls, arg, **changes) -> ModelSpec:
        """A spec from a preset name (``MODEL_PRESETS``, then ``models.PRESETS``), a directory
        holding a Hugging Face ``config.json``, or a JSON file: a ``ModelSpec.to_dict()``, a
        Hugging Face config (it has ``model_type``) or :class:`GPTConfig` fields (planned in bf16,
        as a Hugging Face config is; the reference presets keep fp32, what ``train`` runs).
        ``changes`` (``seq=…``, ``global_batch=…``) are applied last."""
        return _load(arg).with_(**changes) if changes else _load(arg)


def _hf_architecture(config) -> dict:
    """Positions, norm, biases and dropout as the config states them: rotary when it has a
    ``rope_theta`` (Llama, Mistral, Qwen2, Mixtral), RMSNorm when it has ``rms_norm_eps``,
    biases when ``attention_bias``/``mlp_bias`` say so or the family always has them (GPT-2,
    BERT: no such flag), dropout from the hidden/residual dropout probability."""
    rope = getattr(config, "rope_theta", None) is not None
    rms = getattr(config, "rms_norm_eps", None) is not None
    flags = [getattr(config, f, None) for f in ("attention_bias", "mlp_bias")]
    bias = any(bool(f) for f in flags) if any(f is not None for f in flags) else not rope
    dropout = next((float(v) for v in (getattr(config, f, None) for f in
                                       ("resid_pdrop", "hidden_dropout_prob", "hidden_dropout"))
                    if isinstance(v, (int, float))), 0.0)
    return {"pos": "rope" if rope else "learned", "norm": "rmsnorm" if rms else "layernorm",
            "bias": bias, "dropout": dropout}


def _hf_attr(config, *names, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    if default is not None:
        return default
    raise ValueError(f"{type(config).__name__} has none of {names}; pass a supported config "
                     f"(GPT-2, Llama, Mistral, Qwen2, Mixtral, BERT)")


def _hf_config(path: Path, file: Path):
    """``AutoConfig.from_pretrained(path)``, or a one-line ``ValueError`` naming ``file``: not
    JSON, not a model config ``transformers`` knows, a field of the wrong type."""
    try:
        json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file} is not a readable JSON config: {exc}") from None
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ValueError(f"reading {file} needs the Hugging Face `transformers` package: install "
                         f"the `hf` extra (pip install 'ops-transformer[hf]')") from None
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types; report in one line
        detail = " ".join(str(exc).split()) or type(exc).__name__
        cut = detail.find(". ", 80)
        raise ValueError(f"{file} is not a valid model config: "
                         f"{detail[:cut + 1] if cut > 0 else detail[:300]}") from None


def _load(arg) -> ModelSpec:
    if isinstance(arg, ModelSpec):
        return arg
    if isinstance(arg, GPTConfig):
        return ModelSpec.from_gpt_config(arg)
    key = str(arg)
    if key in MODEL_PRESETS:
        return MODEL_PRESETS[key]
    if key in GPT_PRESETS:
        return ModelSpec.from_gpt_config(GPT_PRESETS[key], name=key)
    path = Path(key)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"directory {key!r} has no config.json")
        return ModelSpec.from_hf_config(_hf_config(path, path / "config.json"), name=path.name)
    if path.is_file():
        try:
            d = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{key!r} is not a readable JSON file: {e}") from e
        if not isinstance(d, dict):
            raise ValueError(f"{key!r} must hold a JSON object, got {type(d).__name__}")
        if "layers" in d and "hidden" in d:
            return ModelSpec.from_dict(d)
        if "model_type" in d:
            return ModelSpec.from_hf_config(_hf_config(path, path), name=path.stem)
        unknown = set(d) - {f.name for f in fields(GPTConfig)}
        if unknown:
            raise ValueError(f"{key!r} is neither a ModelSpec, a Hugging Face config nor GPTConfig "
                             f"fields: unknown keys {sorted(unknown)}")
        return ModelSpec.from_gpt_config(GPTConfig(**d), name=path.stem, dtype="bf16")
    raise ValueError(f"{key!r} is not a model preset ({', '.join(sorted(MODEL_PRESETS))}; "
                     f"{', '.join(sorted(GPT_PRESETS))}), a directory with config.json or a JSON "
                     f"file")


def _llama(name, layers, hidden, heads, kv_heads, ffn, vocab, seq, global_batch) -> ModelSpec:
    return ModelSpec(name, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn,
                     ffn_type="swiglu", vocab=vocab, seq=seq, global_batch=global_batch,
                     norm="rmsnorm", pos="rope")


MODEL_PRESETS: dict[str, ModelSpec] = {
    # Brown et al. 2020 (GPT-3), Table 2.1: 96 layers, d_model 12288, 96 heads, context 2048, batch
    # 3.2M tokens (1536 sequences); ffn 4·d_model and the GPT-2 vocabulary and tied embeddings
    # (GPT-3 keeps GPT-2's architecture, Radford et al. 2019). 175B published.
    "gpt3-175b": ModelSpec("gpt3-175b", layers=96, hidden=12288, heads=96, kv_heads=96,
                           ffn=4 * 12288, ffn_type="gelu", vocab=50257, seq=2048,
                           global_batch=1536, tie_embeddings=True, bias=True),
    # Radford et al. 2019 (GPT-2), smallest model: 12 layers, 768, 12 heads, context 1024, batch
    # 512, tied embeddings. Published as 117M; 124M counting as Hugging Face's "gpt2" does.
    "gpt2-124m": ModelSpec("gpt2-124m", layers=12, hidden=768, heads=12, kv_heads=12, ffn=3072,
                           ffn_type="gelu", vocab=50257, seq=1024, global_batch=512,
                           tie_embeddings=True, bias=True),
    # Touvron et al. 2023 (Llama 2), Table 1 and the released configs: context 4096, batch 4M
    # tokens (1024 sequences), vocab 32000, untied head; 70B uses GQA with 8 KV heads.
    # Published 6.7B, 13B, 69B (the "70B" counts 68.98B).
    "llama2-7b": _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096, 1024),
    "llama2-13b": _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096, 1024),
    "llama2-70b": _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096, 1024),
    # Dubey et al. 2024 (The Llama 3 Herd of Models), Table 3, and the Meta Llama 3 / 3.1 model
    # cards: vocab 128256, 8 KV heads, untied head, sequence 8192. Batch: 405B ends pre-training
    # at 16M tokens (2048 sequences, §3.4.1); for 8B/70B 4M tokens (512 sequences) is assumed.
    # Published 8.0B, 70.6B, 405B.
    "llama3-8b": _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, 512),
    "llama3-70b": _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, 512),
    "llama3-405b": _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192, 2048),
    # Jiang et al. 2024 (Mixtral of Experts), Table 1: 32 layers, dim 4096, 32 heads, 8 KV heads,
    # hidden_dim 14336, 8 experts top-2, vocab 32000, untied head. Training sequence and batch are
    # not published: 4096 and 1024 sequences assumed. 46.7B total, 12.9B active published.
    "mixtral-8x7b": ModelSpec("mixtral-8x7b", layers=32, hidden=4096, heads=32, kv_heads=8,
                              ffn=14336, ffn_type="swiglu", vocab=32000, seq=4096,
                              global_batch=1024, experts=8, top_k=2, norm="rmsnorm", pos="rope"),
}

__all__ = ["ClusterSpec", "DTYPE_BYTES", "FFN_TYPES", "MODEL_PRESETS", "ModelSpec"]
