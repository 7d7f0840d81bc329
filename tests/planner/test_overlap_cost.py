"""The overlap formula (pure): the gain of chunks, the choice it drives, and the plan transform
that asks for them — no process group."""

from __future__ import annotations

import pytest

from ops_transformer import GPT
from ops_transformer.models import preset
from ops_transformer.parallelize import gpt_plan
from ops_transformer.parallelize.overlap_plan import overlap_plan, region_columns
from ops_transformer.planner import CPU_GLOO, HardwareProfile
from ops_transformer.planner.overlap import (Pipelined, choose_chunks, chunk_gain, chunk_times,
                                             region_chunks, region_pieces, size_bucket)
from ops_transformer.planner.strategies import model_comm_per_step

PROFILE = HardwareProfile("test", matmul_flops=1e10, alpha_s=1e-4, bandwidth=1e9)


def test_gain_is_one_latency_more_per_chunk_against_the_shorter_stage():
    piece = Pipelined("all_reduce", 1 << 20, 2, 4e7)  # 4 MiB; 4 ms of compute
    t_comm, t_comp = chunk_times(piece, 4, PROFILE)
    assert t_comm == pytest.approx(1e-4 + (1 << 20) / 4 * 4 / 1e9)  # α + 2(p-1)/p·n/c·4 B / β
    assert t_comp == pytest.approx(4e7 / 4 / 1e10)
    assert chunk_gain(piece, 4, PROFILE) == pytest.approx(3 * (min(t_comm, t_comp) - 1e-4))
    assert chunk_gain(piece, 1, PROFILE) == 0.0
    assert chunk_gain(Pipelined("all_reduce", 1 << 20, 1, 4e7), 4, PROFILE) == 0.0  # one rank


def test_overlap_efficiency_scales_what_is_hidden():
    piece = Pipelined("all_gather", 1 << 20, 2, 4e8)
    half = HardwareProfile("half", 1e10, 1e-4, 1e9, overlap_efficiency=0.5)
    none = HardwareProfile("none", 1e10, 1e-4, 1e9, overlap_efficiency=0.0)
    t_comm, t_comp = chunk_times(piece, 2, PROFILE)
    assert chunk_gain(piece, 2, half) == pytest.approx(0.5 * min(t_comm, t_comp) - 1e-4)
    assert chunk_gain(piece, 2, none) == pytest.approx(-1e-4)  # chunks then only cost latency
    assert choose_chunks([piece], 4, none).chunks == 1


def test_the_choice_follows_the_latency():
    pieces = region_pieces("sp_entry", 4096, 512, 1536, 2)
    cheap = HardwareProfile("cheap calls", 1e10, 1e-6, 1e9)
    dear = HardwareProfile("dear calls", 1e10, 10.0, 1e9)
    assert choose_chunks(pieces, 4, cheap).chunks == 4
    choice = choose_chunks(pieces, 4, dear)
    assert choice.chunks == 1 and choice.reason.startswith("not chunked") and "dear" in choice.reason
    assert choose_chunks(pieces, 1, cheap).chunks == 1  # never more than asked


def test_region_pieces_name_each_collective_and_its_compute():
    mm = 2.0 * 8 * 4 * 6
    assert region_pieces("tp_exit", 8, 4, 6, 2) == [Pipelined("all_reduce", 48, 2, mm)]
    assert region_pieces("tp_entry", 8, 4, 6, 2) == [Pipelined("all_reduce", 32, 2, mm)]
    assert [p.kind for p in region_pieces("sp_exit", 8, 4, 6, 2)] == ["reduce_scatter",
                                                                     "all_gather"]
    assert [p.kind for p in region_pieces("experts", 8, 4, 6, 2)] == ["all_to_all"] * 4
    with pytest.raises(ValueError, match="region must be one of"):
        region_pieces("exit", 8, 4, 6, 2)


def test_region_chunks_are_capped_by_the_rows_and_bucketed():
    assert region_chunks("tp_exit", 10, 4, 4, 2, 3, overlap="chunked", chunks=4) == 3
    assert region_chunks("tp_exit", 10, 4, 4, 2, 10, overlap="none", chunks=4) == 1
    assert region_chunks("tp_exit", 10, 4, 4, 1, 10, overlap="chunked", chunks=4) == 1
    assert [size_bucket(n) for n in (1, 2, 3, 1000, 1024)] == [1, 2, 2, 512, 1024]
    with pytest.raises(ValueError, match="overlap must be one of"):
        region_chunks("tp_exit", 10, 4, 4, 2, 10, overlap="yes", chunks=4)


def test_chunks_add_calls_not_elements_to_the_step():
    cfg = preset("tiny")
    none = model_comm_per_step(cfg, 2, "heads", 4, 64)
    chunked = model_comm_per_step(cfg, 2, "heads", 4, 64, overlap="chunked", chunks=3)
    # four chunked all-reduces per layer (two exits forward, two entries backward), 2 more each
    assert chunked["all_reduce"]["calls"] == none["all_reduce"]["calls"] + 2 * 4 * cfg.n_layers
    assert {k: v["elements"] for k, v in chunked.items()} == \
        {k: v["elements"] for k, v in none.items()}
    sp = model_comm_per_step(cfg, 2, "heads", 4, 64, sequence_parallel=True, recompute="full",
                             overlap="chunked", chunks=2)
    sp_none = model_comm_per_step(cfg, 2, "heads", 4, 64, sequence_parallel=True,
                                  recompute="full")
    # per layer 4 all-gathers + 4 reduce-scatters, and the replay's forward ones but the last
    assert sp["all_gather"]["calls"] - sp_none["all_gather"]["calls"] == (4 + 2) * cfg.n_layers
    assert sp["reduce_scatter"]["calls"] - sp_none["reduce_scatter"]["calls"] == \
        (4 + 1) * cfg.n_layers
    assert model_comm_per_step(cfg, 2, "heads", 4, 64, overlap="auto", profile=CPU_GLOO) == none


def test_the_plan_transform_names_what_each_region_overlaps():
    model = GPT(preset("llama-tiny"))
    plan = gpt_plan(model.cfg, 2, "heads", vocab="parallel")
    assert region_columns(plan.rules) == {"layers.*.attn": ["wq", "wk", "wv"]}
    chunked = overlap_plan(plan, "auto", 4)
    rules = chunked.rules
    # (issue 33: overlap sets options on the rules' kinds instead of renaming their styles)
    assert rules["layers.*.attn"] == {"style": "region", "columns": ["wq", "wk", "wv"],
                                      "overlap": "auto", "chunks": 4}
    assert rules["layers.*.attn.wq"] == {"style": "colwise", "fed": True}
    assert rules["layers.*.attn.wk"] == {"style": "colwise", "fed": True, "kv_heads": 2}
    for name in ("layers.*.attn.wo", "layers.*.mlp.w_in", "layers.*.mlp.w_out"):
        assert (rules[name]["overlap"], rules[name]["chunks"]) == ("auto", 4), name
    assert rules["tok_emb"] == plan.rules["tok_emb"]  # the embedding keeps its rule
    assert "overlap auto: up to 4 chunks" in chunked.reason
    with pytest.raises(ValueError, match="overlap must be 'chunked' or 'auto'"):
        overlap_plan(plan, "none", 2)
