"""The ring step of context parallelism: each rank passes a block to the next rank of its group
and receives the previous rank's, with the transfer posted before the caller computes.

=================== ============================================ ==============================
call                what moves                                   ledger
=================== ============================================ ==============================
``ring_shift``      ``x`` to the next rank, the previous rank's   one ``send_recv`` of
                    block (same shape) back                      ``x.numel()`` elements
=================== ============================================ ==============================

It is not an autograd function: ring attention
(:mod:`ops_transformer.layers.context_attention`) runs the mirror-image ring in its own backward.
On a group of one the block comes back unchanged.
"""

from __future__ import annotations

import torch

from . import collectives as C
from .collectives import ProcessGroup, group_size


class PendingShift:
    """A posted :func:`ring_shift`; :meth:`wait` returns the block that arrived."""

    def __init__(self, work, received: torch.Tensor):
        self._work, self._received = work, received

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._received


def ring_shift(x: torch.Tensor, group: ProcessGroup | None, *, label: str) -> PendingShift:
    """Post the send of ``x`` to the next rank of ``group`` and the receive of the previous rank's
    block; returns at once (the caller computes on ``x`` meanwhile, and must not write to it
    before :meth:`PendingShift.wait`)."""
    if group_size(group) == 1:
        return PendingShift(None, x)
    x = x.contiguous()
    received = torch.empty_like(x)
    nxt, prev = C.ring_neighbours(group)
    return PendingShift(C.send_recv(x, received, nxt, prev, group, label=label), received)
