"""activation_memory: saved storages counted once, parameters excluded; the reference layer's bytes
equal the fused-attention formula exactly at tp 1 and 2 with every technique; full recompute equals
Korthikanti et al.'s; with dropout (eager attention) every mode equals Korthikanti et al.'s
formula plus the differences docs/memory.md lists; the ordering full < selective < none and
SP < no SP."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from ops_transformer import GPT, init_parallel, parallelize
from ops_transformer.memory import activation_memory
from ops_transformer.models import preset
from ops_transformer.planner.memory import (activation_bytes_per_layer,
                                            fused_activation_bytes_per_layer)

B, T = 2, 32


class _Toy(nn.Module):
    """Two "layers": a linear (saves its input) then exp (saves its output) and sin (saves the same
    tensor again)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Identity()])

    def forward(self, x, targets=None):
        y = self.layers[0](x * 2)  # saves x * 2 (8·4·4 bytes) and the weight (excluded)
        z = self.layers[1](y).exp()  # exp saves its result
        return z.sin() + z.chunk(2, -1)[0].cos().repeat(1, 2)  # the same storage, twice more


def test_storages_are_counted_once_and_parameters_not_at_all():
    x = torch.randn(4, 8, requires_grad=True)
    out = activation_memory(_Toy(), x)
    assert out == {"total_bytes": 2 * 4 * 8 * 4, "per_layer": [4 * 8 * 4, 0]}


def _measure(config, combinations):
    ctx = init_parallel(tp=int(os.environ["WORLD_SIZE"]))
    idx = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(0))
    out = []
    for options in combinations:
        torch.manual_seed(0)
        model = parallelize(GPT(preset(config, max_seq_len=T, n_layers=2)), ctx,
                            attention="heads", **options)
        out.append(activation_memory(model, idx, idx)["per_layer"][-1])  # (the first layer also
    return out  # holds what all layers share, e.g. RoPE tables)


COMBINATIONS = [{}, {"recompute": "selective"}, {"recompute": "full"},
                {"sequence_parallel": True}, {"sequence_parallel": True, "recompute": "selective"},
                {"sequence_parallel": True, "recompute": "full"}, {"activation_cache": "int8"}]
REGATHER = [{"sequence_parallel": "regather"},
            {"sequence_parallel": "regather", "recompute": "selective"}]


def test_the_reference_layer_keeps_what_the_formula_says(run_ranks):
    cfg = preset("tiny")
    s, h, a = T, cfg.d_model, cfg.n_heads
    for tp in (1, 2):
        combinations = [c for c in COMBINATIONS[:-1] + REGATHER
                        if tp > 1 or not c.get("sequence_parallel")]
        for options, measured in zip(combinations, run_ranks(_measure, tp, "tiny",
                                                             combinations)[0]):
            expected = fused_activation_bytes_per_layer(s, B, h, a, tp, bytes_per_element=4,
                                                        **options)
            assert measured == expected, (tp, options)
            if options.get("recompute") == "full":  # Korthikanti's 2sbh (2sbh/t with SP), fp32
                assert measured == activation_bytes_per_layer(s, B, h, a, tp,
                                                              bytes_per_element=4, **options)


@pytest.mark.parametrize("config", ["tiny", pytest.param("llama-tiny", marks=pytest.mark.slow)])
def test_memory_is_ordered(run_ranks, config):
    measured = run_ranks(_measure, 2, config, COMBINATIONS)[0]
    none, selective, full, sp, sp_selective, sp_full, int8 = measured
    assert full < selective < none and sp_full < sp_selective < sp
    assert sp < none and sp_selective < selective and sp_full < full
    assert int8 < 0.5 * none


def korthikanti_fp32_with_our_differences(s, b, h, a, tp, sequence_parallel=False,
                                          recompute="none"):
    """Korthikanti et al.'s eager-attention bytes (16-bit, doubled for fp32) plus the differences
    docs/memory.md lists for dropout > 0: the dropout masks are kept as booleans (1 byte per
    element, Korthikanti's count, where the doubled formula has 2: −1 byte each for the
    attention-probability mask, split over TP, and the two residual masks, replicated or on the
    share with SP), LayerNorm's fp32 mean and 1/std (4sb each, per norm), and under plain SP the
    all-gathered inputs of the QKV and first FFN matmuls kept whole (+2·4sbh·(1−1/t));
    re-gathering SP keeps their share, as the formula does.
    """
    split = tp if sequence_parallel else 1
    extra = -2 * s * b * h / split + 2 * 2 * 4 * s * b / split
    if recompute != "selective":
        extra -= a * s * s * b / tp
    if sequence_parallel is True:
        extra += 2 * 4 * s * b * h * (1 - 1 / tp)
    return activation_bytes_per_layer(s, b, h, a, tp, bytes_per_element=4,
                                      sequence_parallel=sequence_parallel,
                                      recompute=recompute) + extra


def _measure_with_dropout(combinations):
    ctx = init_parallel(tp=int(os.environ["WORLD_SIZE"]))
    idx = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(0))
    out = []
    for options in combinations:
        torch.manual_seed(0)
        model = parallelize(GPT(preset("tiny", max_seq_len=T, n_layers=2, dropout=0.1)), ctx,
                            attention="heads", **options)
        out.append(activation_memory(model, idx, idx)["per_layer"][-1])
    return out


@pytest.mark.slow
def test_with_dropout_the_layer_keeps_korthikantis_bytes_and_the_documented_differences(
        run_ranks):
    """With dropout > 0 attention runs the math path, which stores the as² tensors that
    Korthikanti et al. count; what differs is only what docs/memory.md lists (exactly)."""
    cfg = preset("tiny")
    s, h, a = T, cfg.d_model, cfg.n_heads
    for tp in (1, 2):
        combinations = [c for c in COMBINATIONS[:-1] + REGATHER
                        if tp > 1 or not c.get("sequence_parallel")]
        for options, measured in zip(combinations,
                                     run_ranks(_measure_with_dropout, tp, combinations)[0]):
            if options.get("recompute") == "full":
                expected = activation_bytes_per_layer(s, B, h, a, tp, bytes_per_element=4,
                                                      **options)
            else:
                expected = korthikanti_fp32_with_our_differences(s, B, h, a, tp, **options)
            assert measured == expected, (tp, options, measured, expected)
