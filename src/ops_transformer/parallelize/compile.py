"""``parallelize(..., compile=True)``: every Transformer block compiled on its own, as torchtitan's
``apply_compile`` does — ``fullgraph=True`` (a graph break is an error, not a silent slow path),
one compiled graph per block, the embedding, final norm and head left eager.

Each block is compiled in place (``nn.Module.compile``), so parameter names, ``state_dict`` keys,
checkpoints and the parallel layers' attributes are those of the eager model. The backend is
``compile_backend``: ``inductor`` (the default: generated kernels), ``aot_eager`` (the same
traced forward and backward graphs run by eager kernels: fast to compile, what the test suite
uses) or ``eager`` (Dynamo's graph only). The communication ledger stays true under compile: the
collectives report through a custom op that runs on every call of the graph
(:func:`ops_transformer.comm.ledger.record_compiled`).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..schema.choices import COMPILE_BACKENDS

log = logging.getLogger("ops_transformer")
_BLOCKS_COMPILED = [0]  # blocks compiled in this process (each may be a graph of its own)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's Transformer blocks: the reference GPT's ``layers``, a Hugging Face decoder's
    ``model.layers`` / ``transformer.h`` (the first ``ModuleList`` of blocks found)."""
    for name in ("layers", "model.layers", "transformer.h", "h", "encoder.layer",
                 "bert.encoder.layer", "gpt_neox.layers"):
        module = model
        for part in name.split("."):
            module = getattr(module, part, None)
            if module is None:
                break
        if isinstance(module, nn.ModuleList) and len(module):
            return list(module)
    raise ValueError(f"compile=True: found no Transformer blocks (a ModuleList named layers, "
                     f"model.layers or transformer.h) in {type(model).__name__}")


def check_compile(compile: bool, *, cp: int = 1, moe: bool = False) -> None:
    """A one-line ``ValueError`` for what ``compile`` does not combine with yet: context
    parallelism (its ring posts async point-to-point exchanges) and MoE layers (their routing
    reads the token counts on the host, ``.tolist()``, a graph break)."""
    if compile and cp > 1:
        raise ValueError(f"--compile does not combine with --cp {cp} yet (the ring's async "
                         f"exchanges cannot be traced); drop one of them")
    if compile and moe:
        raise ValueError("--compile does not combine with an MoE preset yet (expert routing "
                         "reads token counts on the host, a graph break); drop one of them")


def apply_compile(model: nn.Module, backend: str = "inductor") -> list[nn.Module]:
    """Compile each Transformer block of ``model`` in place with ``fullgraph=True``; returns
    the blocks."""
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"compile_backend must be one of {COMPILE_BACKENDS}, got {backend!r}")
    if getattr(getattr(model, "cfg", None), "n_experts", 0):
        check_compile(True, moe=True)
    blocks = transformer_blocks(model)
    allow_a_graph_per_block(len(blocks))
    for block in blocks:
        block.compile(backend=backend, fullgraph=True)
    return blocks


def allow_a_graph_per_block(n_blocks: int) -> None:
    """Raise Dynamo's recompile limits so that every block compiled in this process may be a
    graph of its own. The blocks share one code object (``Module._call_impl``), and a block with an
    integer attribute its forward reads (a Hugging Face decoder layer's ``layer_idx``) specialises
    on it: one cache entry per layer, and with ``fullgraph=True`` the 9th layer of a model would
    be a hard failure at the default limit of 8 (measured: a 4-layer Llama compiled twice in one
    process hit it). Limits already higher are kept."""
    _BLOCKS_COMPILED[0] += n_blocks
    config = torch._dynamo.config
    wanted = 8 + _BLOCKS_COMPILED[0]
    for name in ("recompile_limit", "accumulated_recompile_limit"):
        if getattr(config, name) < wanted:
            log.info("compile: torch._dynamo.config.%s %d -> %d (a graph per block)", name,
                     getattr(config, name), wanted)
            setattr(config, name, wanted)
