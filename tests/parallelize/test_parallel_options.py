"""parallelize's one options object and what it leaves on the model: ``ParallelOptions`` is
validated when built and equals the keyword arguments; ``model.parallel_state`` holds the plan, the
options and the gradient reducers in order, which ZeRO-2 swaps in place; ``print(model)`` names the
collective of every region the plan made."""

from __future__ import annotations

import pytest
import torch

from ops_transformer import GPT, ParallelOptions, init_parallel, parallelize, zero_optimizer
from ops_transformer.models import preset


def test_options_are_checked_once_and_name_the_bad_value():
    assert ParallelOptions(sequence_parallel=True).plan_attention == "heads"
    assert ParallelOptions(attention="kv_split").plan_attention == "kv_split"
    assert ParallelOptions.of(ParallelOptions(recompute="full"), vocab="parallel") == \
        ParallelOptions(recompute="full", vocab="parallel")
    with pytest.raises(ValueError, match=r"recompute must be one of \('none', 'selective', "
                                         r"'full'\), got 'everything'"):
        ParallelOptions(recompute="everything")
    with pytest.raises(ValueError, match=r"sequence_parallel must be one of \(False, True, "
                                         r"'regather'\), got 1"):
        ParallelOptions(sequence_parallel=1)
    assert ParallelOptions(sequence_parallel="regather").regathers
    assert not ParallelOptions(sequence_parallel="regather", recompute="full").regathers
    with pytest.raises(ValueError, match="bucket_bytes must be a positive integer, got 0"):
        ParallelOptions(bucket_bytes=0)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['recomput'\]"):
        ParallelOptions.of(recomput="full")


def _prepared(options_as_object: bool):
    ctx = init_parallel(tp=2)
    torch.manual_seed(0)
    chosen = {"attention": "heads", "sequence_parallel": True, "recompute": "full"}
    model = GPT(preset("tiny", n_layers=2))
    if options_as_object:
        model = parallelize(model, ctx, "auto", ParallelOptions(**chosen))
    else:
        model = parallelize(model, ctx, **chosen)
    state = model.parallel_state
    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    model(x[:, :-1], x[:, 1:])[1].backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return (state.options, state.plan.to_dict(), model.parallel_plan is state.plan,
            [r.name for r in state.reducers], repr(model), grads)


def test_keyword_arguments_build_the_same_options_and_state(run_ranks):
    (options, plan, alias, reducers, text, grads), = run_ranks(_prepared, 2, True)[:1]
    (options2, plan2, _, reducers2, _, grads2), = run_ranks(_prepared, 2, False)[:1]
    assert options == options2 == ParallelOptions(attention="heads", sequence_parallel=True,
                                                  recompute="full")
    assert plan == plan2 and alias and reducers == reducers2 == ["partial_sums"]
    assert all(torch.equal(a, b) for a, b in zip(grads, grads2))
    for shown in ("ScatterSequence[Block](", "input: scatter_sequence over tp=2",
                  "GatherSequenceRegion[Attention](", "input: gather_sequence_region over tp=2",
                  "GatherSequenceOutput[LayerNorm](output: gather_sequence over tp=2"):
        assert shown in text, shown


def _zero_chain():
    ctx = init_parallel(tp=2, dp=2)
    torch.manual_seed(0)
    model = parallelize(GPT(preset("tiny", n_layers=1)), ctx, attention="heads",
                        sequence_parallel=True)
    before = [(r.name, type(r).__name__) for r in model.parallel_state.reducers]
    zero_optimizer(model, ctx, torch.optim.SGD, stage=2, lr=0.1)
    after = [(r.name, type(r).__name__) for r in model.parallel_state.reducers]
    return before, after, "CopyToTPRegion" in repr(GPT(preset("tiny", n_layers=1)))


def test_zero2_swaps_the_averaging_in_the_reducer_chain(run_ranks):
    before, after, dense_has_regions = run_ranks(_zero_chain, 4)[0]
    assert before == [("dp", "GradSync"), ("partial_sums", "GradSums")]
    assert after == [("dp", "ReduceScatterGradSync"), ("dp_partial", "GradSync"),
                     ("partial_sums", "GradSums")]
    assert not dense_has_regions  # the reference model itself knows nothing of parallelism
