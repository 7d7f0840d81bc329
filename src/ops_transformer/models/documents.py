"""Packed documents: which tokens of a row belong together, as a ``document_ids`` tensor.

A packed row holds several documents back to back. ``document_ids`` ``(batch, seq)`` gives each
token's document; a document is a maximal run of equal ids (so ``[0 0 1 1 0]`` is three
documents). From it follow, as torchtune, torchtitan and Hugging Face's flattening collator do:

* **positions** that restart at 0 in every document (:func:`document_positions`), for the learned
  or rotary position embedding;
* the **mask**: a token attends to the earlier tokens of its own document only
  (:func:`document_mask`);
* the **targets**: the last token of a document does not predict the first of the next
  (:func:`document_targets`).

With all three, the loss and the gradients of a packed row are those of its documents run one by
one (``tests/models/test_documents.py``).
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def document_runs(document_ids: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` int64: the index of each token's document in its row (0, 1, …)."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts.long().cumsum(1) - 1


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """``(B, T)``: each token's position inside its document."""
    T = document_ids.shape[1]
    index = torch.arange(T, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(1).values
    return index - first


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """``(B, 1, T, T)`` bool, True where query ``i`` may attend to key ``j``: ``j ≤ i`` in the
    same document."""
    runs = document_runs(document_ids)
    T = runs.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=runs.device).tril()
    return (causal & (runs.unsqueeze(2) == runs.unsqueeze(1))).unsqueeze(1)


def document_targets(targets: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """``targets`` with the prediction across each document boundary ignored (``-100``): the
    last token of a document has no next token in it."""
    last = torch.zeros_like(document_ids, dtype=torch.bool)
    last[:, :-1] = document_ids[:, 1:] != document_ids[:, :-1]
    return targets.masked_fill(last, IGNORE_INDEX)


def check_document_ids(document_ids: torch.Tensor, idx: torch.Tensor) -> None:
    if document_ids.shape != idx.shape:
        raise ValueError(f"document_ids has shape {tuple(document_ids.shape)}; it must match the "
                         f"tokens' {tuple(idx.shape)} (batch, seq)")
    if document_ids.dtype.is_floating_point:
        raise ValueError(f"document_ids must be an integer tensor, got {document_ids.dtype}")
