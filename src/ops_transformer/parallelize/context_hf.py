"""Context parallelism for Hugging Face decoders (Llama, Mistral, Qwen2): the sequence split over
``ctx.cp_group`` as for the reference GPT (:mod:`.context_plan`).

* **Entry and exit** — the model's class becomes ``ContextParallel<Family>ForCausalLM`` (a
  subclass: the same parameters and names), whose ``forward(input_ids, labels=,
  document_ids=)`` takes whole sequences, keeps this rank's two chunks of the tokens, passes their
  ``position_ids`` (per document with ``document_ids``), shifts the labels *before* splitting
  (``shift_labels``: the next token of a chunk's last token lives on another rank) and returns
  the loss over the global token count (:class:`~.context_plan.SequenceSplit`).
* **Attention** — the attention function ``ops_transformer_cp`` in ``transformers``'
  ``AttentionInterface`` calls each layer's ``cp_core``
  (:class:`~ops_transformer.layers.context_attention.ContextParallelCore`) on the rotated Q, K and
  V of this rank's heads; ``document_ids`` reach it through the model's keyword arguments, as
  ``transformers`` passes them to every attention call. Hugging Face's own mask (built for the
  local tokens) is not used.
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers.context_attention import ContextParallelCore, shard_sequence
from ..models.documents import check_document_ids, document_positions, document_targets
from ..models.hf import model_type
from ..planner.context_parallel import check_sequence

CP_FAMILIES = ("llama", "mistral", "qwen2")
ATTENTION = "ops_transformer_cp"
IGNORE_INDEX = -100


def supports_context_parallel(model: nn.Module) -> bool:
    return model_type(model) in CP_FAMILIES


def apply_hf_context_parallel(model: nn.Module, ctx, choice, split) -> None:
    """Give every attention layer its ``cp_core``, route attention through it and swap the
    model's class for its context-parallel subclass."""
    _register_attention()
    for layer in model.model.layers:
        layer.self_attn.cp_core = ContextParallelCore(ctx, choice.strategy, choice.reason,
                                                      switch=split.switch)
    model.sequence_split = split
    model.cp_whole_attention = model.config._attn_implementation or "sdpa"
    model.config._attn_implementation = ATTENTION
    model.__class__ = _context_parallel_class(type(model))


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if ATTENTION in AttentionInterface._global_mapping:
        return

    def attention(module, query, key, value, attention_mask, document_ids=None, **kwargs):
        out = module.cp_core(query, key, value, document_ids)  # (B, nh, S, d)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(ATTENTION, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)  # built, not read


_CLASSES: dict[type, type] = {}


def _context_parallel_class(base: type) -> type:
    """``ContextParallel<base>``: made once per class (picklable by name within the process)."""
    if base not in _CLASSES:
        _CLASSES[base] = type(f"ContextParallel{base.__name__}", (ContextParallelCausalLM, base),
                              {"__module__": __name__})
    return _CLASSES[base]


class ContextParallelCausalLM:
    """The ``forward`` of a Hugging Face causal LM fed whole sequences split over ``cp`` ranks."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None,
                document_ids=None, shift_labels=None, **kwargs):
        split = self.sequence_split
        if not split.switch.on:  # generate(): the whole sequence, the model's own attention
            return super().forward(input_ids=input_ids, attention_mask=attention_mask,
                                   position_ids=position_ids, labels=labels, **kwargs)
        if input_ids is None or position_ids is not None or kwargs.get("inputs_embeds") is not None:
            raise ValueError("a context-parallel model takes whole sequences as input_ids: it "
                             "places their positions itself (no position_ids, no inputs_embeds)")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("context parallelism takes unpadded rows: pack documents and pass "
                             "document_ids instead of a padding attention_mask")
        seq = input_ids.shape[1]
        check_sequence(seq, split.cp)
        positions = torch.arange(seq, device=input_ids.device).expand_as(input_ids)
        shifted = shift_labels  # the next token of each position (given, or from labels)
        if shifted is None and labels is not None:
            shifted = nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
        if document_ids is not None:
            check_document_ids(document_ids, input_ids)
            positions = document_positions(document_ids)
            kwargs["document_ids"] = document_ids  # to every attention call
            if shifted is not None:
                shifted = document_targets(shifted, document_ids)
        local = shard_sequence(input_ids, split.rank, split.cp)
        local_labels = None if shifted is None else shard_sequence(shifted, split.rank, split.cp)
        total = None if shifted is None else split.targets_in(shifted)
        out = super().forward(input_ids=local, position_ids=shard_sequence(positions, split.rank,
                                                                           split.cp),
                              labels=local_labels, shift_labels=local_labels, **kwargs)
        if out.loss is not None:
            out.loss = split.exit(out.loss, local_labels, total)
        return out

    @torch.no_grad()
    def generate(self, *args, **kwargs):
        """Unsplit, with the model's own attention (every rank the whole sequence)."""
        self.sequence_split.switch.on = False
        saved, self.config._attn_implementation = self.config._attn_implementation, \
            self.cp_whole_attention
        try:
            return super().generate(*args, **kwargs)
        finally:
            self.sequence_split.switch.on = True
            self.config._attn_implementation = saved
