"""``parallelize(..., compile=True)``: each Transformer block compiles with 0 graph breaks at tp 2
under each option; compiled training equals eager (losses and gradients, 5 steps); the ledger
counts the same compiled and eager (3 steps). ``aot_eager`` here; ``inductor`` in the slow set."""

from __future__ import annotations

import os

import pytest
import torch

from helpers import assert_rel
from ops_transformer import GPT, CommLedger, init_parallel, parallelize
from ops_transformer.models.gpt import preset

B, T = 4, 16
CONFIGS = {"gpt2": preset("tiny", vocab_size=250, max_seq_len=T),
           "llama": preset("llama-tiny", vocab_size=250, max_seq_len=T)}
OPTIONS = {  # a test per option: the block compiled at tp 2 under it
    "plain": {},
    "sequence_parallel": {"sequence_parallel": True},
    "recompute_selective": {"recompute": "selective"},
    "recompute_full": {"recompute": "full"},
    "attention_heads_allgather": {"attention": "heads_allgather"},
    "attention_kv_split": {"attention": "kv_split"},
    "vocab_replicated": {"vocab": "replicated"},
}


def _batches(steps):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 250, (B, T + 1), generator=g) for _ in range(steps)]


def _model(config, compile, backend="aot_eager", **options):
    options.setdefault("overlap", "none")  # what compile=True runs with: eager and compiled alike
    ctx = init_parallel(tp=int(os.environ["WORLD_SIZE"]))
    torch.manual_seed(0)
    model = parallelize(GPT(CONFIGS[config]), ctx, compile=compile, compile_backend=backend,
                        **options)
    return ctx, model


def _block_input(model, ctx, options):
    """The block's input as the model passes it (under sequence parallelism the first region's
    entry takes the whole sequence and scatters it)."""
    x = torch.randn(B, T, model.cfg.d_model, generator=torch.Generator().manual_seed(1))
    return x.requires_grad_()


def _graph_breaks(config, options):
    ctx, model = _model(config, False, **options)
    block = model.layers[0]
    x = _block_input(model, ctx, options)
    rope = None
    if model.pos_emb is None:
        from ops_transformer.models.gpt import rope_tables
        rope = rope_tables(model.cfg.head_dim, T, model.cfg.rope_theta, x.device)

    def step(x):
        out = block(x, rope) if rope is not None else block(x)
        out.sum().backward()
        return out

    explained = torch._dynamo.explain(lambda x: block(x, rope) if rope is not None
                                      else block(x))(x)
    block.compile(backend="aot_eager", fullgraph=True)  # and it runs: a break would raise
    step(x)
    return explained.graph_break_count, [str(r) for r in explained.break_reasons]


# ~10 s each on 2 cores: SP (the TP block plus the sequence-parallel regions) in the default suite,
# plain TP and the other options in the slow set
QUICK_OPTIONS = ("sequence_parallel",)


@pytest.mark.parametrize("name", [n if n in QUICK_OPTIONS else pytest.param(n, marks=pytest.mark.slow)
                                  for n in OPTIONS])
def test_block_compiles_without_graph_breaks(run_ranks, name):
    for config in ("gpt2", "llama"):
        for breaks, reasons in run_ranks(_graph_breaks, 2, config, OPTIONS[name]):
            assert breaks == 0, f"{config} {name}: {breaks} graph breaks: {reasons}"


def _train(config, compile, steps, backend="aot_eager", **options):
    ctx, model = _model(config, compile, backend, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, grads, ledgers = [], [], []
    for batch in _batches(steps):
        with CommLedger() as ledger:
            loss = model(batch[:, :-1], batch[:, 1:])[1]
            loss.backward()
        ledgers.append(ledger.summary())
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return torch.stack(losses), grads, ledgers


@pytest.mark.parametrize("config,options", [
    ("llama", {}), pytest.param("gpt2", {"sequence_parallel": True}, marks=pytest.mark.slow)])
def test_compiled_training_equals_eager(run_ranks, config, options):
    eager = run_ranks(_train, 2, config, False, 5, **options)
    compiled = run_ranks(_train, 2, config, True, 5, **options)
    for rank, ((el, eg, e_ledgers), (cl, cg, c_ledgers)) in enumerate(zip(eager, compiled)):
        assert e_ledgers[0] and c_ledgers == e_ledgers, f"rank {rank}: the compiled run's ledger"
        assert_rel(cl, el, 1e-6, what=f"rank {rank} losses")
        for step, (e, c) in enumerate(zip(eg, cg)):
            assert list(e) == list(c)
            for n in e:
                assert_rel(c[n], e[n], 1e-6, what=f"rank {rank} step {step} grad {n}",
                           floor=0.02)


@pytest.mark.slow  # the ledgers of plain TP are compared in test_compiled_training_equals_eager
def test_ledger_counts_equal_compiled_and_eager(run_ranks):
    eager = run_ranks(_train, 2, "llama", False, 3, sequence_parallel=True)
    compiled = run_ranks(_train, 2, "llama", True, 3, sequence_parallel=True)
    for (_, _, e), (_, _, c) in zip(eager, compiled):
        assert e[0]  # something was recorded
        assert c == e


@pytest.mark.slow
def test_inductor_training_equals_eager(run_ranks):
    eager = run_ranks(_train, 2, "llama", False, 3)
    compiled = run_ranks(_train, 2, "llama", True, 3, "inductor")
    for (el, _, ele), (cl, _, cle) in zip(eager, compiled):
        assert_rel(cl, el, 1e-5, what="losses")  # inductor fuses: reordered fp32 sums
        assert cle == ele


def test_bad_backend_is_one_clear_error():
    with pytest.raises(ValueError, match="compile_backend must be one of"):
        parallelize(GPT(CONFIGS["gpt2"]), init_parallel(tp=1), compile=True,
                    compile_backend="tensorrt")


@pytest.mark.parametrize("options,match", [
    ({"overlap": "chunked"}, "overlap='chunked'"),
    ({"sequence_parallel": "regather"}, "sequence_parallel='regather'"),
    ({"activation_cache": "int8"}, "activation_cache='int8'")])
def test_unsupported_combinations_are_refused(options, match):
    from ops_transformer.parallelize import ParallelOptions
    with pytest.raises(ValueError, match=match):
        ParallelOptions(compile=True, **options)
    assert ParallelOptions(compile=True).overlap == "none"  # auto runs as none under compile
