"""ZeRO-sharded optimizer state in checkpoints: bit-identical resumption, and state that reshards
element for element between ZeRO at any dp × tp and a plain torch optimizer."""

from __future__ import annotations

import pytest
import torch

import ops_transformer as ot
from ops_transformer.checkpoint import Entry, SpecLayout
from ops_transformer.checkpoint.zero_adapter import entry_pieces, flat_view, range_boxes

from ops_transformer.memory.zero import zero_optimizer
from ops_transformer.memory.zero_state import consolidate_zero_state
from ops_transformer.parallelize.gpt_plan import gpt_plan

from helpers import assert_rel
from test_checkpoint import CFG, _eval_loss, _train
from test_checkpoint_layout import SPECS, _specs

BUCKET = 64 * 1024  # several buckets for the tiny model: parameters cut at bucket and chunk edges


def _job(tp, dp, *, seed, zero, cfg=CFG):
    ctx = ot.init_parallel(tp=tp, dp=dp)
    torch.manual_seed(seed)
    model = ot.parallelize(ot.GPT(cfg), ctx, gpt_plan(cfg, tp, "heads", vocab="parallel"))
    kwargs = dict(lr=1e-2, weight_decay=0.1)
    if zero:
        opt = zero_optimizer(model, ctx, torch.optim.AdamW, stage=zero, bucket_bytes=BUCKET,
                             **kwargs)
    else:
        opt = torch.optim.AdamW(model.parameters(), **kwargs)
    return ctx, model, opt


def test_range_boxes_cover_the_run_exactly():
    shape = (3, 4, 5)
    for start, stop in [(0, 60), (7, 8), (3, 57), (20, 40), (19, 41), (0, 1), (59, 60)]:
        mark = torch.zeros(shape, dtype=torch.int32)
        for off, size in range_boxes(shape, start, stop):
            region = mark
            for d, (o, s) in enumerate(zip(off, size)):
                region = region.narrow(d, o, s)
            region += 1
        expected = torch.zeros(60, dtype=torch.int32)
        expected[start:stop] = 1
        assert torch.equal(mark.reshape(-1), expected), (start, stop)
    assert len(range_boxes((10, 10), 13, 87)) == 3  # partial row, whole rows, partial row


@pytest.mark.parametrize("name", sorted(SPECS))
def test_flat_runs_of_every_layout_land_on_their_dense_elements(name):
    """Every run [a, b) of a local shard (a ZeRO chunk's share of it): its rectangles hold exactly
    the dense elements of local elements a … b-1, read through views of a flat chunk."""
    shape, options = SPECS[name]
    dense = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    expected_dense = dense.t() if options.get("transposed") else dense
    for spec in _specs(shape, 2, **options) + _specs(shape, 4, **options):  # tp 4: padding
        entry = Entry("w", SpecLayout(spec))
        local = spec.shard(dense)
        kept = torch.zeros(local.shape, dtype=torch.bool)  # the real elements (no padding)
        for _, piece in entry.chunks(kept):
            piece.fill_(True)
        n = local.numel()
        for a, b in [(0, n), (1, n - 1), (n // 3, 2 * n // 3), (5, 6), (n - 7, n)]:
            shift = 3  # local element j at flat[j + 3]
            flat = torch.full((n + 5,), float("nan"))
            flat[shift + a:shift + b] = local.reshape(-1)[a:b]
            seen = 0
            for offsets, part in entry_pieces(entry, local.shape, a, b):
                got = flat_view(flat, part, shift)
                region = tuple(slice(o, o + k) for o, k in zip(offsets, got.shape))
                assert torch.equal(got, expected_dense[region]), (spec, a, b, offsets)
                seen += got.numel()
            in_run = torch.zeros(n, dtype=torch.bool)
            in_run[a:b] = True
            assert seen == int((in_run & kept.reshape(-1)).sum()), (spec, a, b)


# --- resumption ---------------------------------------------------------------------------------

def _zero_run(root, tp, dp, zero, save):
    cfg = CFG.with_(dropout=0.1)
    ctx, model, opt = _job(tp, dp, seed=0 if save else 1, zero=zero, cfg=cfg)
    if save:
        _train(ctx, model, opt, range(3))
        ot.save_checkpoint(root, model, opt, ctx, 3)
    else:
        torch.manual_seed(7)
        ot.load_checkpoint(root, model, opt, ctx)
    return _train(ctx, model, opt, range(3, 5)), ot.gather_full_state_dict(model, ctx)


@pytest.mark.parametrize("tp,dp,zero", [
    (1, 2, 1),
    pytest.param(2, 2, 2, marks=pytest.mark.slow),
])
def test_zero_resume_is_bit_identical(run_ranks, tmp_path, tp, dp, zero):
    ref_losses, ref = run_ranks(_zero_run, tp * dp, tmp_path, tp, dp, zero, True)[0]
    losses, got = run_ranks(_zero_run, tp * dp, tmp_path, tp, dp, zero, False)[0]
    assert losses == ref_losses
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


# --- resharding: the state itself, element for element ------------------------------------------

def _zero_state_saved(root, dp):
    ctx, model, opt = _job(1, dp, seed=0, zero=1)
    _train(ctx, model, opt, range(2))
    ot.save_checkpoint(root, model, opt, ctx, 2)
    return opt.state_dict(), _eval_loss(model)


def _plain_state(root, load):
    ctx, model, opt = _job(1, 1, seed=1, zero=0)
    if load:
        ot.load_checkpoint(root, model, opt, ctx)
    else:
        _train(ctx, model, opt, range(2))
        ot.save_checkpoint(root, model, opt, ctx, 2)
    names = {id(p): n for n, p in model.named_parameters()}
    return ({names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()},
            _eval_loss(model))


def _zero_state_loaded(root, dp):
    ctx, model, opt = _job(1, dp, seed=1, zero=1)
    ot.load_checkpoint(root, model, opt, ctx)
    return opt.state_dict(), _eval_loss(model)


def _assert_same_state(zero_params, plain):
    assert zero_params.keys() == plain.keys()
    for name, state in plain.items():
        assert state.keys() == zero_params[name].keys(), name
        for key, value in state.items():
            assert torch.equal(zero_params[name][key], value), (name, key)


def test_zero_state_loads_into_a_plain_optimizer_and_back(run_ranks, tmp_path):
    saved = run_ranks(_zero_state_saved, 2, tmp_path / "zero", 2)
    plain, loss = run_ranks(_plain_state, 1, tmp_path / "zero", True)[0]
    _assert_same_state(consolidate_zero_state([sd for sd, _ in saved])["params"], plain)
    assert torch.equal(loss, saved[0][1])

    plain, loss = run_ranks(_plain_state, 1, tmp_path / "plain", False)[0]
    loaded = run_ranks(_zero_state_loaded, 2, tmp_path / "plain", 2)
    _assert_same_state(consolidate_zero_state([sd for sd, _ in loaded])["params"], plain)
    assert torch.equal(loaded[0][1], loss)


# --- resharding: training continues at another layout -------------------------------------------

def _save_zero(root, tp, dp, zero):
    ctx, model, opt = _job(tp, dp, seed=0, zero=zero)
    _train(ctx, model, opt, range(2))
    ot.save_checkpoint(root, model, opt, ctx, 2)
    before = _eval_loss(model)
    _train(ctx, model, opt, range(2, 4))
    return before, _eval_loss(model)


def _load_zero(root, tp, dp, zero):
    ctx, model, opt = _job(tp, dp, seed=1, zero=zero)
    info = ot.load_checkpoint(root, model, opt, ctx)
    before = _eval_loss(model)
    _train(ctx, model, opt, range(2, 4))
    return before, _eval_loss(model), info


@pytest.mark.slow
@pytest.mark.parametrize("saved,loaded", [
    ((2, 2, 1), (4, 1, 0)),  # ZeRO at dp 2 × tp 2 → plain AdamW at tp 4
    ((2, 1, 0), (1, 4, 2)),  # plain AdamW at tp 2 → ZeRO-2 at dp 4
    ((1, 4, 1), (2, 2, 1)),  # ZeRO at dp 4 → ZeRO at dp 2 × tp 2
], ids=["zero-dp2xtp2-tp4", "tp2-zero2-dp4", "zero-dp4-zero-dp2xtp2"])
def test_zero_checkpoint_trains_on_at_another_layout(run_ranks, tmp_path, saved, loaded):
    before, trained = run_ranks(_save_zero, saved[0] * saved[1], tmp_path, *saved)[0]
    got_before, got_trained, info = run_ranks(_load_zero, loaded[0] * loaded[1], tmp_path,
                                              *loaded)[0]
    assert info["resharded"]
    assert_rel(got_before, before, 1e-6, "loss of the loaded model")
    assert_rel(got_trained, trained, 1e-5, "loss after two more steps")


# --- the train command --------------------------------------------------------------------------

@pytest.mark.slow
def test_train_zero2_resume_is_bit_identical(tmp_path, capsys):
    import json

    from ops_transformer.checkpoint import export as ex
    from ops_transformer.cli.main import main

    base = ["train", "--nproc", "2", "--dp", "2", "--zero", "2", "--clip-grad", "1.0", "--batch",
            "4", "--seq", "32", "--save-every", "2", "--no-progress", "--json"]

    def run(name, steps, *more):
        assert main(base + ["--steps", str(steps), "--ckpt-dir", str(tmp_path / name),
                            "--out", str(tmp_path / f"{name}-{steps}"), *more]) == 0
        capsys.readouterr()
        return json.loads((tmp_path / f"{name}-{steps}" / "metrics.json").read_text())

    whole = run("whole", 4)
    run("parts", 2)
    resumed = run("parts", 4, "--resume")
    assert resumed["resumed_from"] == 2 and resumed["losses"] == whole["losses"]
    ref, _ = ex.dense_state_dict(tmp_path / "whole")
    got, _ = ex.dense_state_dict(tmp_path / "parts")
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
