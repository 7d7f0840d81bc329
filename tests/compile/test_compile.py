"""``parallelize(..., compile=True)``: each Transformer block compiles with 0 graph breaks at tp 2
under each option; compiled training equals eager (losses and gradients, 5 steps); the ledger
counts the same compiled and eager (3 steps). ``aot_eager`` here; ``inductor`` in the slow set."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from helpers import assert_rel
from ops_transformer import GPT, CommLedger, init_parallel, parallelize
from ops_transformer.models.gpt import preset
from ops_transformer.training.optimizer import shard_for_zero

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
    "lora": {"lora": {"rank": 4}},
    "lora_dropout": {"lora": {"rank": 4, "dropout": 0.1}},
    "dropout": {"_dropout": 0.1},
    "bf16_autocast": {"_autocast": torch.bfloat16},
    "zero3": {"_zero": 3},  # FSDP2 fully_shard over dp 2 after the blocks are compiled
    # the collective matmuls in chunks: under compile their async collectives run in order
    # inside the graph (comm.collectives), the ledger through record_compiled
    "overlap_chunked": {"overlap": "chunked"},
    "overlap_chunked_sp": {"overlap": "chunked", "sequence_parallel": True},
    # fp8 linear layers: the amax all-reduces (MAX) and torch._scaled_mm inside the graph
    "fp8": {"precision": "fp8"},
    "fp8_sp": {"precision": "fp8", "sequence_parallel": True},
    "fp8_fp32_backward": {"precision": "fp8", "fp8_backward": "fp32"},
}


def _ranks(options) -> int:
    return 4 if options.get("_zero") else 2  # ZeRO-3 shards over dp = 2 at tp = 2


def _autocast(options):
    dtype = options.get("_autocast")
    return (torch.autocast("cpu", dtype) if dtype is not None else contextlib.nullcontext())


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t  # ZeRO-3: this rank's shard


def _batches(steps, dp_rank=0):
    g = torch.Generator().manual_seed(dp_rank)
    return [torch.randint(0, 250, (B, T + 1), generator=g) for _ in range(steps)]


def _model(config, compile, backend="aot_eager", **options):
    """The model at tp 2 (× dp 2 with ``_zero``); the ``_`` options are the training loop's, not
    ``parallelize``'s: ``_dropout`` (the preset's dropout), ``_autocast`` (a 16-bit autocast around
    the step), ``_zero`` (ZeRO-3: FSDP2 over dp, as train applies it after ``parallelize``)."""
    torch.set_num_threads(1)
    dropout = options.get("_dropout")
    options = {k: v for k, v in options.items() if not k.startswith("_")} | \
        {"overlap": options.get("overlap", "none")}  # compile's: eager and compiled alike
    zero = int(os.environ["WORLD_SIZE"]) // 2 > 1
    ctx = init_parallel(tp=2, dp=2 if zero else 1)
    torch.manual_seed(0)
    config = CONFIGS[config]
    model = parallelize(GPT(config.with_(dropout=dropout) if dropout else config), ctx,
                        compile=compile, compile_backend=backend, **options)
    if zero:
        shard_for_zero(model, ctx, 3)
    return ctx, model


def _block_input(model, ctx, options):
    """The block's input as the model passes it (under sequence parallelism the first region's
    entry takes the whole sequence and scatters it)."""
    x = torch.randn(B, T, model.cfg.d_model, generator=torch.Generator().manual_seed(1))
    return x.requires_grad_()


def _graph_breaks(config, options):
    ctx, model = _model(config, True, **options)
    block = model.layers[0]
    x = _block_input(model, ctx, options)
    rope = None
    if model.pos_emb is None:
        from ops_transformer.models.gpt import rope_tables
        rope = rope_tables(model.cfg.head_dim, T, model.cfg.rope_theta, x.device)

    def forward(x, call=block):  # block._call_impl: the block without its compiled wrapper
        with _autocast(options):
            return call(x, rope) if rope is not None else call(x)

    explained = torch._dynamo.explain(forward)(x, block._call_impl)
    forward(x).float().sum().backward()  # compiled with fullgraph=True: a break would raise
    return explained.graph_break_count, [str(r) for r in explained.break_reasons]


# ~10 s each on 2 cores: SP (the TP block plus the sequence-parallel regions) in the default suite,
# plain TP and the other options in the slow set
QUICK_OPTIONS = ("sequence_parallel",)


@pytest.mark.parametrize("name", [n if n in QUICK_OPTIONS else pytest.param(n, marks=pytest.mark.slow)
                                  for n in OPTIONS])
def test_block_compiles_without_graph_breaks(run_ranks, name):
    for config in ("gpt2", "llama"):
        for breaks, reasons in run_ranks(_graph_breaks, _ranks(OPTIONS[name]), config,
                                         OPTIONS[name]):
            assert breaks == 0, f"{config} {name}: {breaks} graph breaks: {reasons}"


def _train(config, compile, steps, backend="aot_eager", **options):
    ctx, model = _model(config, compile, backend, **options)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1,
                          momentum=0.9)
    losses, grads, ledgers = [], [], []
    for batch in _batches(steps, ctx.dp_rank):
        with CommLedger() as ledger:
            with _autocast(options):
                loss = model(batch[:, :-1], batch[:, 1:])[1]
            loss.backward()
        ledgers.append(ledger.summary())
        losses.append(loss.detach())
        grads.append({n: _local(p.grad).clone() for n, p in model.named_parameters()
                      if p.grad is not None})
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
    ({"sequence_parallel": "regather"}, "sequence_parallel='regather'"),
    ({"sequence_parallel": "regather", "overlap": "chunked"}, "sequence_parallel='regather'"),
    ({"activation_cache": "int8"}, "activation_cache='int8'")])
def test_unsupported_combinations_are_refused(options, match):
    from ops_transformer.parallelize import ParallelOptions
    with pytest.raises(ValueError, match=match):
        ParallelOptions(compile=True, **options)
    assert ParallelOptions(compile=True).overlap == "none"  # auto runs as none under compile


LIFTED = ("lora", "lora_dropout", "dropout", "bf16_autocast", "zero3", "overlap_chunked",
          "overlap_chunked_sp", "fp8", "fp8_sp", "fp8_fp32_backward")  # asserted one by one


@pytest.mark.slow
@pytest.mark.parametrize("name", LIFTED)
def test_each_option_compiled_equals_eager(run_ranks, name):
    """Compiled (``aot_eager``) equals eager over 5 steps under the option — losses and every
    gradient (1e-6; bf16 autocast: the same bf16 kernels in the same order, so the same bound) —
    and the ledger's counts, elements and bytes are equal over the first 3 steps."""
    options, ranks = OPTIONS[name], _ranks(OPTIONS[name])
    eager = run_ranks(_train, ranks, "llama", False, 5, **options)
    compiled = run_ranks(_train, ranks, "llama", True, 5, **options)
    for rank, ((el, eg, ele), (cl, cg, cle)) in enumerate(zip(eager, compiled)):
        assert_rel(cl, el, 1e-6, what=f"{name}: rank {rank} losses")
        assert cle[:3] == ele[:3] and ele[0], f"{name}: rank {rank} ledgers"
        for step, (e, c) in enumerate(zip(eg, cg)):
            assert list(e) == list(c) and e
            for n in e:
                assert_rel(c[n], e[n], 1e-6, what=f"{name}: rank {rank} step {step} grad {n}",
                           floor=0.02)


@pytest.mark.slow
def test_gpu_block_eager_and_compiled_run_on_a_cpu():
    """``make gpu-check``'s ``block_compile`` section (benchmarks/gpu_block.py) at a tiny size on
    a CPU: eager, compiled and compiled + fp8 time the block and report their figures."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "benchmarks/gpu_block.py", "--device", "cpu",
                           "--hidden", "64", "--heads", "4", "--seq", "32", "--steps", "1",
                           "--warmup", "1", "--methods", "eager,compiled,compiled_fp8", "--backend",
                           "aot_eager"], cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(result["methods"]) == {"eager", "compiled", "compiled_fp8"}
    assert result["compiled/eager"] > 0 and result["compiled_fp8/eager"] > 0
    assert all(m["tokens_per_s"] > 0 and m["achieved_tflops"] > 0
               for m in result["methods"].values())


def _losses_over_lengths(compile):
    ctx, model = _model("llama", compile)
    losses = []
    for t in (16, 8, 12):  # a new length recompiles with dynamic shapes (Dynamo's automatic dynamic)
        ids = torch.randint(0, 250, (2, t + 1), generator=torch.Generator().manual_seed(t))
        loss = model(ids[:, :-1], ids[:, 1:])[1]
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses)


@pytest.mark.slow
def test_a_new_sequence_length_recompiles_dynamic_and_equals_eager(run_ranks):
    """The second length makes Dynamo trace the blocks with symbolic sizes (the chunk arithmetic
    of the regions once failed there: ``divmod`` of a SymInt)."""
    eager = run_ranks(_losses_over_lengths, 2, False)
    compiled = run_ranks(_losses_over_lengths, 2, True)
    for e, c in zip(eager, compiled):
        assert_rel(c, e, 1e-6, what="losses over lengths 16, 8, 12")
