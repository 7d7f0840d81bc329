"""Decisions made once: ranks given different calibrated profiles (or a profile file on some ranks
only) still agree on the attention strategy, the vocabulary split and the collective algorithms —
rank 0's profile is broadcast at ``init_parallel`` — and train together."""

from __future__ import annotations

import json

import pytest
import torch

from ops_transformer import GPT, init_parallel, parallelize
from ops_transformer.comm.engine import lookup
from ops_transformer.models.gpt import preset
from ops_transformer.planner.choose import choose_attention, choose_vocab
from ops_transformer.planner.hardware import HardwareProfile
from ops_transformer.planner.calibrated import CalibratedProfile

CFG = preset("tiny")
# Rank 0: latency-bound links, fast matmuls, a measured swap faster than any collective.
FAST_COMPUTE = CalibratedProfile("rank 0's profile", 1e15, 1e-2, 1e12,
                                 p2p_threshold_bytes=1 << 30, p2p_small_messages="send_recv")
# Rank 1: bandwidth-bound links, slow matmuls, no point-to-point measurement.
SLOW_COMPUTE = HardwareProfile("rank 1's profile", 1e6, 1e-9, 1e6)


def _choices(profile):
    return (choose_attention(CFG, 2, batch=8, seq=CFG.max_seq_len, profile=profile)[0],
            choose_vocab(CFG, 2, batch=8, seq=CFG.max_seq_len, profile=profile)[0])


def test_the_two_profiles_disagree_on_their_own():
    assert _choices(FAST_COMPUTE) == ("heads_allgather", "replicated")
    assert _choices(SLOW_COMPUTE) == ("heads", "parallel")


def _worker(profiles):
    import torch.distributed as dist

    rank = int(__import__("os").environ["RANK"])
    ctx = init_parallel(tp=2, profile=profiles[rank])
    torch.manual_seed(0)
    model = parallelize(GPT(CFG), ctx)
    algorithm = lookup(ctx.tp_group).choose("all_reduce", 4096, torch.float32)
    x = torch.randint(0, CFG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    loss = model(x[:, :-1], x[:, 1:])[1]
    loss.backward()  # the ranks run the same collectives, or this would hang or fail
    assert dist.get_world_size() == 2
    return (ctx.profile.name, model.parallel_plan.attention, model.parallel_plan.vocab,
            algorithm, float(loss))


def test_ranks_with_different_profiles_agree(run_ranks):
    out = run_ranks(_worker, 2, [FAST_COMPUTE, SLOW_COMPUTE])
    assert out[0] == out[1]
    assert out[0][:4] == ("rank 0's profile", "heads_allgather", "replicated", "p2p")


def _profile_json(path, name):
    path.write_text(json.dumps({
        "name": name, "matmul_flops_best": 1e15,
        "collectives": {"2": {"all_reduce": {"alpha_s": 1e-2, "bandwidth": 1e12}}}}))
    return str(path)


def test_profile_file_on_rank_0_only(run_ranks, tmp_path):
    """Rank 1 names a file that does not exist on its "node": only rank 0 reads."""
    path = _profile_json(tmp_path / "profile.json", "the file on rank 0")
    out = run_ranks(_worker, 2, [path, str(tmp_path / "absent" / "profile.json")])
    assert out[0] == out[1] and out[0][0] == "the file on rank 0"
    assert out[0][1:3] == ("heads_allgather", "replicated")


def test_corrupt_profile_on_rank_0_fails_every_rank(run_ranks, tmp_path):
    bad = tmp_path / "profile.json"
    bad.write_text("{truncated")
    with pytest.raises(ValueError, match="ops-transformer calibrate") as info:
        run_ranks(_worker, 2, [str(bad), None], timeout=60)
    assert str(bad) in str(info.value)
