"""``ot.check_parity`` on forked ranks: the reference GPT passes in every layout and memory
option, and planted faults are each named at the module that introduces them, with its style."""

from __future__ import annotations

import pytest
import torch

import ops_transformer as ot
from ops_transformer.models.gpt import preset
from ops_transformer.parallelize.gpt_plan import gpt_plan
from ops_transformer.parity.record import ROOT, Recorder

CFG = ot.GPTConfig(vocab_size=256, n_layers=2, d_model=64, n_heads=4, d_ff=256)


def _build(cfg=CFG, seed=0):
    def build():
        torch.manual_seed(seed)
        return ot.GPT(cfg)
    return build


def _tokens(batch=4, seq=16, vocab=256):
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1], ids[:, 1:]


def _check(tp, dp=None, ep=1, cfg=CFG, batch=4, **kw):
    ctx = ot.init_parallel(tp=tp, dp=dp, ep=ep)
    return ot.check_parity(_build(cfg), ctx, _tokens(batch, vocab=cfg.vocab_size), **kw)


def _dense_finish_order(cfg=CFG) -> list[str]:
    model = _build(cfg)()
    recorder = Recorder(model)
    with recorder.recording():
        model(*_tokens())
    return [c.key for c in recorder.calls]


def test_reference_gpt_at_tp2_matches_module_by_module(run_ranks):
    reports = run_ranks(_check, 2, 2, vocab="parallel", steps=3)
    report = reports[0]
    assert report.ok and report.first_mismatch is None, report.table()
    assert reports[1].to_dict() == report.to_dict()  # the same report on every rank
    assert [r["name"] for r in report.modules] == _dense_finish_order()  # execution order
    dense = dict(_build()().named_parameters())
    assert [r["name"] for r in report.parameters] == list(dense)
    assert [r["shape"] for r in report.parameters] == [list(p.shape) for p in dense.values()]
    rows = {r["name"]: r for r in report.modules}
    assert rows["layers.0.attn.wo"]["style"] == "rowwise"
    assert rows["layers.0.mlp.w_in"]["compared"] == "split dim 2"  # sharded features, gathered
    assert rows["lm_head"]["compared"] == "split dim 2, replicated"  # logits shard, loss
    assert all(r["max_rel"] <= 1e-5 and r["grad_rel"] <= 1e-4 for r in report.modules
               if r["max_rel"] is not None and r["grad_rel"] is not None)
    assert report.loss["rel"] <= 1e-5 and report.kl <= 1e-9
    assert report.reference.startswith("the dense model on rank 0, alone")
    # --steps: both losses side by side, the first the compared one, the model trains
    assert [s["step"] for s in report.steps] == [1, 2, 3]
    assert report.steps[0]["reference"] == report.loss["reference"]
    assert report.steps[2]["reference"] < report.steps[0]["reference"]
    assert all(s["rel"] <= 1e-5 * s["step"] for s in report.steps)


@pytest.mark.parametrize("nprocs,kw", [
    (2, {"recompute": "selective", "sequence_parallel": True, "vocab": "parallel"}),
    (2, {"precision": "bf16", "sequence_parallel": True, "recompute": "full"}),
    (2, {"attention": "kv_split"}),
    (2, {"sequence_parallel": "regather", "cfg": CFG.with_(dropout=0.2)}),  # dropout off
    (4, {"dp": 2}),
    (4, {"tp": 4, "cfg": preset("llama-tiny", d_ff=128), "vocab": "parallel"}),  # KV replicas
    (4, {"ep": 2, "cfg": preset("moe-tiny")}),
])
def test_reference_gpt_passes_in_every_layout_and_memory_option(run_ranks, nprocs, kw):
    kw = {"tp": 2, **kw}
    report = run_ranks(_check, nprocs, **kw)[0]
    assert report.ok, report.table()
    tp = kw["tp"]
    assert report.layout["tp"] == tp and report.layout["dp"] * report.layout["ep"] == nprocs // tp
    if kw.get("sequence_parallel"):
        assert any(r["compared"] == "tokens" for r in report.modules)
    if nprocs // tp > 1:
        assert f"{nprocs // tp} micro-batches" in report.reference


def _faulty_plan(fault: str) -> dict:
    plan = gpt_plan(CFG, 2, "heads", vocab="parallel").to_dict()
    rules = plan["rules"]
    if fault == "wrong_style":  # the row-parallel output projection marked column-parallel
        rules["layers.*.attn.wo"] = "colwise"
    elif fault == "skipped_reduction":  # its weight sliced by input features, no all-reduce
        del rules["layers.*.attn.wo"]
        rules["layers.*.attn.wo.weight"] = {"style": "shard_param", "dim": 1}
    elif fault == "wrong_head_split":  # each rank gets half of every query head's features
        rules["layers.*.attn.wq"] = {"style": "colwise", "reduce_input_grad": False,
                                     "sub_blocks": [CFG.head_dim] * CFG.n_heads}
    elif fault == "missing_backward_reduction":  # Q/K/V skip their all-reduce, no region
        del rules["layers.*.attn"]
    return plan


@pytest.mark.parametrize("fault,module,style,why", [
    ("wrong_style", "layers.0.attn.wo", "colwise", "forward raised RuntimeError"),
    ("skipped_reduction", "layers.0.attn.wo", "shard_param(weight)", "its output differs"),
    ("wrong_head_split", "layers.0.attn", "region",
     "the input of layers.0.attn.wo already differs"),
    ("missing_backward_reduction", "layers.1.attn.wv", "colwise(reduce_input_grad=False",
     "the gradient of layers.1.norm1's output differs"),
])
def test_planted_faults_are_named_at_their_module(run_ranks, fault, module, style, why):
    report = run_ranks(_check, 2, 2, plan=_faulty_plan(fault))[0]
    assert not report.ok
    assert report.first_mismatch == module and report.style.startswith(style), report.verdict()
    assert why in report.reason
    if fault == "wrong_style":
        assert report.error["module"] == module and "mat1 and mat2" in report.error["message"]


def _check_unseeded():
    ctx = ot.init_parallel(tp=2)
    return ot.check_parity(_build(seed=ctx.rank), ctx, _tokens())


def test_a_model_built_differently_on_each_rank_is_reported_as_such(run_ranks):
    report = run_ranks(_check_unseeded, 2)[0]
    assert not report.ok and "build_model must return the same model on every rank" in \
        report.reason
    assert report.weights and report.first_mismatch in {ROOT, report.weights[0]["module"]}


def _check_bad_batch():
    ctx = ot.init_parallel(tp=1, dp=2)
    return ot.check_parity(_build(), ctx, _tokens(batch=3))


def test_a_batch_that_does_not_split_over_data_ranks_is_a_clear_error(run_ranks):
    with pytest.raises(ValueError, match=r"the batch \(3\) must divide by .* \(2\)"):
        run_ranks(_check_bad_batch, 2)


def _candidates():
    from ops_transformer.parity.layout import Layout, dense_candidates, infer_layout

    ctx = ot.init_parallel(tp=2)
    r, g = ctx.tp_rank, ctx.tp_group
    dense = torch.arange(2 * 4 * 6, dtype=torch.float32).view(2, 4, 6)
    tokens = dense.reshape(-1, 6).chunk(2)[r].reshape(2, 2, 6)  # this rank's share of the tokens
    out = {"tokens": dense_candidates(tokens, infer_layout((2, 2, 6), (2, 4, 6), r, 2,
                                                           sequence_parallel=True), g)}
    part = dense / 2  # each rank holds half of a sum
    out["partial"] = dense_candidates(part, Layout("partial"), g)
    tail = torch.cat([dense[..., :4], dense[..., 4:] / 2], -1)  # the last 2 features partial
    out["tail"] = dense_candidates(tail, Layout("replicated"), g, gradient=True, partial_tail=2)
    return out, dense


def test_dense_candidates_gather_tokens_and_sum_partial_sums(run_ranks):
    out, dense = run_ranks(_candidates, 2)[0]
    assert torch.equal(out["tokens"][0], dense)
    assert torch.equal(out["partial"][1], dense)  # the sum is the dense tensor
    assert torch.equal(out["tail"][1], dense) and not torch.equal(out["tail"][0], dense)


def _check_cp(tp, cp, name="llama-tiny", strategy="ring", **kw):
    torch.set_num_threads(1)
    cfg = preset(name, n_layers=2, max_seq_len=32)
    ctx = ot.init_parallel(tp=tp, cp=cp)
    return ot.check_parity(_build(cfg), ctx, _tokens(2, 16, cfg.vocab_size),
                           context_parallel=strategy, **kw)


@pytest.mark.parametrize("name,strategy", [("llama-tiny", "ring"), ("tiny", "allgather_kv")])
def test_check_parity_at_cp2_compares_whole_sequences(run_ranks, name, strategy):
    reports = run_ranks(_check_cp, 2, 1, 2, name, strategy, steps=2)
    report = reports[0]
    assert report.ok, report.table()
    assert reports[1].to_dict() == report.to_dict()
    assert report.layout["cp"] == 2
    rows = {r["name"]: r for r in report.modules}
    # the blocks' outputs are this rank's tokens: gathered over cp into the dense (b, s, h)
    assert rows["layers.0"]["shape"] == [2, 16, 64] and rows["layers.0"]["max_rel"] <= 1e-5
    assert rows["layers.0"]["grad_rel"] <= 1e-4
    compared = [r for r in report.modules if r["max_rel"] is not None]
    assert len(compared) >= len(report.modules) - 2  # all but integer-only calls
    assert report.loss["rel"] <= 1e-6 and report.kl <= 1e-9


def test_check_parity_at_tp2_cp2(run_ranks):
    reports = run_ranks(_check_cp, 4, 2, 2, "llama-tiny", "ring")
    assert reports[0].ok, reports[0].table()
    assert reports[0].layout["cp"] == 2 and reports[0].layout["tp"] == 2


def _planted_cp_fault(tp, cp):
    torch.set_num_threads(1)
    cfg = preset("llama-tiny", n_layers=2, max_seq_len=32)
    ctx = ot.init_parallel(tp=tp, cp=cp)

    def build_parallel():
        model = ot.parallelize(_build(cfg)(), ctx, context_parallel="ring")
        with torch.no_grad():  # one rank's copy of a norm drifts: its tokens go wrong
            if ctx.cp_rank == 1:
                model.layers[1].norm2.weight.mul_(1.01)
        return model
    return ot.check_parity(_build(cfg), ctx, _tokens(2, 16, cfg.vocab_size),
                           build_parallel=build_parallel)


def test_check_parity_at_cp2_names_a_fault_on_one_cp_rank(run_ranks):
    report = run_ranks(_planted_cp_fault, 2, 1, 2)[0]
    assert not report.ok and report.first_mismatch.startswith("layers.1"), report.table()
