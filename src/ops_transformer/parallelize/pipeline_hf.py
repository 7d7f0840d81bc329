"""Pipeline stages of Hugging Face decoders (GPT-2, Llama, Mistral, Qwen2, Qwen3): the model's own
modules run stage by stage, as its base model's ``forward`` runs them.

Where the parts are (under the base model, ``model.model`` or ``model.transformer``)::

    family                       first stage                last stage       layers
    llama, mistral, qwen2/3      embed_tokens               norm, lm_head    layers.*
    gpt2                         wte, wpe, drop             ln_f, lm_head    h.*

Every stage builds what each layer takes from the whole sequence length (positions ``0..T−1``,
the causal mask(s) with ``transformers``' own ``create_causal_mask`` /
``create_sliding_window_causal_mask``, the rotary tables with the base model's parameter-less
``rotary_emb``), so a later stage needs only the hidden states it receives. Training only: no
key/value cache, no padding mask (every row is a full sequence of tokens).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from ..models.hf import base_prefix, model_type

FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class DecoderParts:
    """Module names of a decoder's parts: ``base`` (the base model's prefix, ``"model."``),
    ``first`` (under the base: what the first stage holds), ``layers`` (the ``ModuleList`` under
    the base), ``norm`` (under the base) and the head (``lm_head``, on the model)."""

    base: str
    first: tuple[str, ...]
    layers: str
    norm: str
    head: str = "lm_head"


def decoder_parts(model: nn.Module) -> DecoderParts:
    """The parts of a Hugging Face causal LM of the families :data:`FAMILIES`; a one-line
    ``ValueError`` for any other model."""
    kind = model_type(model)
    if kind not in FAMILIES or not isinstance(getattr(model, "lm_head", None), nn.Module):
        raise ValueError(f"pipeline splits the reference GPT and Hugging Face causal LMs of the "
                         f"families {', '.join(FAMILIES)}; got {type(model).__name__}"
                         + (f" (model_type {kind!r})" if kind else ""))
    base = base_prefix(model)
    if kind == "gpt2":
        return DecoderParts(base, ("wte", "wpe", "drop"), "h", "ln_f")
    return DecoderParts(base, ("embed_tokens",), "layers", "norm")


def n_layers_of(model: nn.Module) -> int:
    parts = decoder_parts(model)
    return len(model.get_submodule(parts.base + parts.layers))


def tied_names(model: nn.Module) -> tuple[str, str] | None:
    """``(embedding weight, head weight)`` dense names when the head shares the embedding's
    weight (GPT-2, ``tie_word_embeddings``), else ``None``."""
    parts = decoder_parts(model)
    embed = model.get_submodule(parts.base + parts.first[0])
    head = model.get_submodule(parts.head)
    if getattr(head, "weight", None) is None or head.weight is not embed.weight:
        return None
    return parts.base + parts.first[0] + ".weight", parts.head + ".weight"


class HFStage(nn.Module):
    """Layers ``layers`` of a Hugging Face decoder as one pipeline stage: ``input_ids (B, T)`` →
    hidden ``(B, T, d)`` on the first stage, hidden → hidden in the middle, hidden → logits on the
    last (full, or this rank's vocabulary columns under ``loss_parallel``). It holds the model's
    own modules (shared, not copied). ``autocast`` and ``seq_len``: as ``GPTStage``'s."""

    def __init__(self, model: nn.Module, layers: range, *, first: bool, last: bool):
        super().__init__()
        parts = decoder_parts(model)
        base = model.get_submodule(parts.base.rstrip(".")) if parts.base else model
        self.config, self.gpt2 = base.config, model_type(model) == "gpt2"
        self.first, self.last, self.layer_ids = first, last, layers
        self.autocast = contextlib.nullcontext
        self.seq_len = None
        self.embed = nn.ModuleList(getattr(base, n) for n in parts.first) if first else None
        self.rotary = getattr(base, "rotary_emb", None)  # no parameters: on every stage
        self.blocks = nn.ModuleList(base.get_submodule(parts.layers)[i] for i in layers)
        self.norm = base.get_submodule(parts.norm) if last else None
        self.lm_head = model.get_submodule(parts.head) if last else None

    def forward(self, x, position_ids=None):
        with self.autocast():
            return self._forward(x, position_ids)

    def _forward(self, x, position_ids=None):
        """``position_ids`` ``(B, T)``: each token's place in its packed document (``train
        --pack docs``): the masks keep attention inside each document, as the model's own
        forward makes them from restarting positions; ``None``: ``0..T−1``."""
        positions = (position_ids if position_ids is not None else
                     torch.arange(self.seq_len or x.shape[1], device=x.device).unsqueeze(0))
        if self.first:
            h = self.embed[0](x)
            if self.gpt2:  # learned positions, then the embedding dropout
                h = self.embed[2](h + self.embed[1](positions))
            x = h
        # what the masks and rotary tables read of the hidden states: batch, length, dtype,
        # device (under sequence parallelism a later stage holds T/tp of the T positions)
        like = x.new_zeros(()).expand(x.shape[0], positions.shape[1], 1)
        masks = self._masks(like, positions)
        rope = self.rotary(like, positions) if self.rotary is not None else None
        types = getattr(self.config, "layer_types", None)
        for i, block in zip(self.layer_ids, self.blocks):
            mask = masks[types[i] if types else "full_attention"]
            if self.gpt2:
                x = block(x, None, mask, None, use_cache=False, position_ids=positions)
            else:
                x = block(x, attention_mask=mask, position_embeddings=rope,
                          position_ids=positions, use_cache=False)
        if self.last:
            return self.lm_head(self.norm(x))
        return x

    def _masks(self, like: torch.Tensor, positions: torch.Tensor) -> dict:
        """The causal masks by layer type, as the base model builds them without padding."""
        from transformers.masking_utils import (create_causal_mask,
                                                create_sliding_window_causal_mask)

        kwargs = dict(config=self.config, inputs_embeds=like, attention_mask=None, cache=None,
                      position_ids=positions)
        types = set(getattr(self.config, "layer_types", None) or ())
        sliding = "sliding_attention" in types or (
            not types and getattr(self.config, "sliding_window", None) is not None
            and self.config.model_type == "mistral")
        full = create_causal_mask(**kwargs)
        masks = {"full_attention": full}
        if sliding:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
            if not types:  # Mistral: every layer slides
                masks["full_attention"] = masks["sliding_attention"]
        return masks

    def extra_repr(self) -> str:
        return (f"{'embedding, ' if self.first else ''}layers {self.layer_ids.start}.."
                f"{self.layer_ids.stop - 1}{', norm, head' if self.last else ''}")


def prune_hf(model: nn.Module, layers: set[int], *, first: bool, last: bool) -> None:
    """Drop what this rank's stages do not hold, keeping the dense names of the rest."""
    parts = decoder_parts(model)
    base = model.get_submodule(parts.base.rstrip(".")) if parts.base else model
    blocks = base.get_submodule(parts.layers)
    for i in range(len(blocks)):
        if i not in layers:
            blocks[i] = nn.Identity()
    if not first:
        for name in parts.first:
            setattr(base, name, None)
    if not last:
        setattr(base, parts.norm, None)
        setattr(model, parts.head, None)
