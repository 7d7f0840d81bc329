"""Sharded checkpoints: bit-identical resumption, resharding to other layouts, verification before
anything is loaded, atomicity under a killed rank, retention."""

from __future__ import annotations

import os
import re
import shutil
import signal

import pytest
import torch
import torch._dynamo  # noqa: F401 - meta-device init imports it lazily: once here, not per rank

import ops_transformer as ot
from ops_transformer.checkpoint import store
from ops_transformer.models.gpt import preset
from ops_transformer.parallelize.gpt_plan import gpt_plan

from helpers import assert_rel

# GQA (KV heads replicated at tp 4), SwiGLU (fused gate/up sub-blocks), RoPE, untied head, and a
# vocabulary of 250: split evenly at tp 2, padded to 252 at tp 4.
CFG = preset("llama-tiny", vocab_size=250)
BATCH, SEQ = 4, 16


def _job(tp, dp, *, seed, optimizer="adamw", cfg=CFG, attention="heads", ep=1):
    ctx = ot.init_parallel(tp=tp, dp=dp, ep=ep)
    torch.manual_seed(seed)
    model = ot.parallelize(ot.GPT(cfg), ctx, gpt_plan(cfg, tp, attention, vocab="parallel"))
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return ctx, model, opt


def _batch(step, ctx=None):
    tokens = torch.randint(0, CFG.vocab_size, (BATCH, SEQ + 1),
                           generator=torch.Generator().manual_seed(step))
    if ctx is not None and ctx.dp_ep_size > 1:  # data-parallel and EP ranks read their own rows
        tokens = tokens.chunk(ctx.dp_ep_size)[ctx.dp_ep_rank]
    return tokens[:, :-1], tokens[:, 1:]


def _train(ctx, model, opt, steps) -> list[float]:
    losses = []
    for step in steps:
        loss = model(*_batch(step, ctx))[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@torch.no_grad()
def _eval_loss(model) -> torch.Tensor:
    model.eval()
    loss = model(*_batch(1000))[1]  # the whole batch on every rank
    model.train()
    return loss


# --- resumption ---------------------------------------------------------------------------------

def _save_and_continue(root, tp, dp, optimizer, cfg):
    ctx, model, opt = _job(tp, dp, seed=0, optimizer=optimizer, cfg=cfg)
    _train(ctx, model, opt, range(3))
    ot.save_checkpoint(root, model, opt, ctx, 3, extra={"data_position": 3})
    return _train(ctx, model, opt, range(3, 6)), ot.gather_full_state_dict(model, ctx)


def _load_and_continue(root, tp, dp, optimizer, cfg):
    ctx, model, opt = _job(tp, dp, seed=1, optimizer=optimizer, cfg=cfg)  # other weights...
    torch.manual_seed(7)  # ...and another RNG state: all must come from the checkpoint
    info = ot.load_checkpoint(root, model, opt, ctx)
    losses = _train(ctx, model, opt, range(info["extra"]["data_position"], 6))
    return losses, ot.gather_full_state_dict(model, ctx), info


@pytest.mark.parametrize("tp,dp,optimizer", [
    (2, 1, "adamw"),
    pytest.param(2, 2, "adamw", marks=pytest.mark.slow),
    pytest.param(2, 1, "sgd", marks=pytest.mark.slow),
])
def test_resumed_run_is_bit_identical(run_ranks, tmp_path, tp, dp, optimizer):
    cfg = CFG.with_(dropout=0.1)  # dropout draws from the RNG: its state must be restored too
    n = tp * dp
    ref_losses, ref_state = run_ranks(_save_and_continue, n, tmp_path, tp, dp, optimizer, cfg)[0]
    losses, state, info = run_ranks(_load_and_continue, n, tmp_path, tp, dp, optimizer, cfg)[0]
    assert info["step"] == 3 and not info["resharded"]
    assert losses == ref_losses
    assert state.keys() == ref_state.keys()
    assert all(torch.equal(state[k], ref_state[k]) for k in state)


# --- resharding ---------------------------------------------------------------------------------

def _save_for_reshard(root, tp, dp, attention="heads", ep=1, cfg=CFG):
    ctx, model, opt = _job(tp, dp, seed=0, attention=attention, ep=ep, cfg=cfg)
    _train(ctx, model, opt, range(2))
    ot.save_checkpoint(root, model, opt, ctx, 2)
    before = _eval_loss(model)
    _train(ctx, model, opt, range(2, 4))
    return before, _eval_loss(model)


def _load_resharded(root, tp, dp, ep=1, cfg=CFG):
    ctx, model, opt = _job(tp, dp, seed=1, ep=ep, cfg=cfg)
    info = ot.load_checkpoint(root, model, opt, ctx)
    before = _eval_loss(model)
    _train(ctx, model, opt, range(2, 4))  # the optimizer state was resharded too
    return before, _eval_loss(model), info


@pytest.mark.parametrize("saved,loaded,attention", [
    ((2, 1), (4, 1), "heads"),
    pytest.param((4, 1), (2, 1), "heads", marks=pytest.mark.slow),
    # every head's features split in sub-blocks (strategy B)
    pytest.param((2, 1), (1, 1), "kv_split", marks=pytest.mark.slow),
    pytest.param((2, 2), (4, 1), "heads", marks=pytest.mark.slow),
], ids=["tp2-tp4", "tp4-tp2", "tp2kv_split-tp1", "dp2xtp2-tp4"])
def test_checkpoint_loads_at_another_layout(run_ranks, tmp_path, saved, loaded, attention):
    before, trained = run_ranks(_save_for_reshard, saved[0] * saved[1], tmp_path, *saved,
                                attention)[0]
    got_before, got_trained, info = run_ranks(_load_resharded, loaded[0] * loaded[1], tmp_path,
                                              *loaded)[0]
    assert info["resharded"] and info["saved_layout"]["tp"] == saved[0]
    assert_rel(got_before, before, 1e-6, "loss of the loaded model")
    # Two more AdamW steps at the new layout: the sums of each matmul and all-reduce are ordered
    # differently, so the updates agree to a few float32 ulps, not bit for bit.
    assert_rel(got_trained, trained, 1e-5, "loss after two more steps")


# --- verification -------------------------------------------------------------------------------

def _single(seed=0, optimizer="adamw", cfg=CFG):
    ctx, model, opt = _job(1, 1, seed=seed, optimizer=optimizer, cfg=cfg)
    _train(ctx, model, opt, range(1))
    return ctx, model, opt


def _snapshot(model, opt):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {i: {k: v.clone() for k, v in s.items()} for i, s in
             opt.state_dict()["state"].items()})


def _same(a, b) -> bool:
    (ma, oa), (mb, ob) = a, b
    return (all(torch.equal(ma[k], mb[k]) for k in ma) and oa.keys() == ob.keys()
            and all(torch.equal(oa[i][k], ob[i][k]) for i in oa for k in oa[i]))


def _shard_file(path):
    return sorted(p for p in path.iterdir() if p.suffix == ".distcp")[0]


def _truncate(path):
    victim = _shard_file(path)
    victim.write_bytes(victim.read_bytes()[:-100])
    return rf"file '{victim.name}' is truncated"


def _delete(path):
    victim = _shard_file(path)
    victim.unlink()
    return rf"file '{victim.name}' is missing"


def _flip(name):
    def damage(path):
        victim = path / name if name else _shard_file(path)
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x01
        victim.write_bytes(bytes(data))
        return rf"file '{re.escape(victim.name)}' is corrupted"
    return damage


def _edit_manifest(path):
    manifest = path / "checkpoint.json"
    manifest.write_text(manifest.read_text().replace('"step": 1', '"step": 2'))
    return r"checkpoint\.json: corrupted"


@pytest.fixture(scope="module")
def one_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("one_checkpoint")
    ctx, model, opt = _single()
    ot.save_checkpoint(root, model, opt, ctx, 1)
    return root


@pytest.mark.parametrize("damage", [_truncate, _delete, _flip(None), _flip(".metadata"),
                                    _edit_manifest],
                         ids=["truncated", "deleted", "flipped-byte", "flipped-metadata",
                              "edited-manifest"])
def test_damaged_file_is_named_and_nothing_is_loaded(tmp_path, one_checkpoint, damage):
    shutil.copytree(one_checkpoint, tmp_path, dirs_exist_ok=True)
    message = damage(tmp_path / "step-00000001")
    ctx2, model2, opt2 = _single(seed=1)
    before = _snapshot(model2, opt2)
    with pytest.raises(ot.CheckpointError, match=message):
        ot.load_checkpoint(tmp_path, model2, opt2, ctx2)
    assert _same(_snapshot(model2, opt2), before)


def _load_damaged(root):
    ctx, model, opt = _job(2, 1, seed=1)
    try:
        ot.load_checkpoint(root, model, opt, ctx)
    except ot.CheckpointError as exc:
        return str(exc)
    return None


def test_ranks_share_the_verification_and_all_report_the_bad_file(run_ranks, tmp_path):
    run_ranks(_save_for_reshard, 2, tmp_path, 2, 1)
    step_dir = tmp_path / "step-00000002"
    victim = sorted(step_dir.glob("*.distcp"))[-1]  # hashed by the last rank, not rank 0
    _flip(victim.name)(step_dir)
    messages = run_ranks(_load_damaged, 2, tmp_path)
    assert all(m and f"file {victim.name!r} is corrupted" in m for m in messages), messages


def test_checkpoint_that_does_not_fit_the_model(tmp_path):
    ctx, model, opt = _single()
    ot.save_checkpoint(tmp_path, model, None, ctx, 1)
    with pytest.raises(ot.CheckpointError, match="holds no optimizer state"):
        ot.load_checkpoint(tmp_path, model, opt, ctx)
    other = CFG.with_(d_model=128)
    ctx2, model2, opt2 = _single(cfg=other)
    with pytest.raises(ot.CheckpointError, match=r"model tensor 'tok_emb.weight': the checkpoint's "
                                                 r"dense shape is \(250, 64\), this model's is "
                                                 r"\(250, 128\)"):
        ot.load_checkpoint(tmp_path, model2, None, ctx2)
    with pytest.raises(ot.CheckpointError, match=r"no checkpoint for step 5 .* available steps: "
                                                 r"\[1\]"):
        ot.load_checkpoint(tmp_path, model, None, ctx, step=5)
    with pytest.raises(ot.CheckpointError, match="no checkpoint to load"):
        ot.load_checkpoint(tmp_path / "empty", model, None, ctx)


def test_extra_must_load_safely(tmp_path):
    ctx, model, opt = _single()
    with pytest.raises(ValueError, match="extra must hold only tensors"):
        ot.save_checkpoint(tmp_path, model, opt, ctx, 1, extra={"fn": _single})
    assert store.list_steps(tmp_path) == []


# --- atomicity and retention --------------------------------------------------------------------

def test_keep_deletes_old_checkpoints_after_the_new_one_is_complete(tmp_path):
    ctx, model, opt = _single()
    for step in range(1, 5):
        ot.save_checkpoint(tmp_path, model, opt, ctx, step, keep=2)
    assert store.list_steps(tmp_path) == [3, 4]
    assert (tmp_path / "latest").read_text().strip() == "step-00000004"
    ot.save_checkpoint(tmp_path, model, opt, ctx, 4, keep=2)  # the same step again: replaced
    assert store.list_steps(tmp_path) == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000003",
                                                          "step-00000004"]


def _kill_while_saving(root, victim, where):
    ctx, model, opt = _job(2, 1, seed=0)
    _train(ctx, model, opt, range(2))
    ot.save_checkpoint(root, model, opt, ctx, 2)
    _train(ctx, model, opt, range(2, 3))
    if ctx.rank == victim:
        _die_at(where)
    ot.save_checkpoint(root, model, opt, ctx, 3)
    return "saved"


def _die_at(where):
    """SIGKILL this rank at a point of the save (patched in this forked rank only)."""
    import torch.distributed.checkpoint.filesystem as fs

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    if where == "writing_shards":
        original = fs._write_item

        def write_then_die(*args, **kwargs):  # the first tensor of this rank's file, then death
            original(*args, **kwargs)
            die()
        fs._write_item = write_then_die
    else:  # after every file, the manifest included, was written: just before the rename
        store.publish = die


def _state_after_two_steps(root):
    ctx, model, opt = _job(2, 1, seed=1)
    info = ot.load_checkpoint(root, model, opt, ctx)
    return info["step"], _eval_loss(model)


@pytest.mark.parametrize("victim,where", [
    (1, "writing_shards"),
    pytest.param(0, "before_rename", marks=pytest.mark.slow),
])
def test_rank_killed_while_saving_leaves_the_previous_checkpoint(run_ranks, tmp_path, victim,
                                                                 where):
    with pytest.raises(ot.RankError):  # the victim, or its peer losing the connection first
        run_ranks(_kill_while_saving, 2, tmp_path, victim, where)
    assert (tmp_path / "latest").read_text().strip() == "step-00000002"
    assert store.list_steps(tmp_path) == [2]
    step, loss = run_ranks(_state_after_two_steps, 2, tmp_path)[0]
    expected = run_ranks(_save_for_reshard, 2, tmp_path / "ref", 2, 1)[0][0]
    assert step == 2 and torch.equal(loss, expected)


# --- extension points ---------------------------------------------------------------------------

class _Counting(torch.optim.SGD):
    pass


class _RecordingAdapter(ot.checkpoint.TorchOptimizerAdapter):
    calls: list = []

    def save_state(self, optimizer, model, ctx):
        self.calls.append("save")
        return super().save_state(optimizer, model, ctx)

    def commit(self, optimizer, model, loaded, ctx):
        self.calls.append("commit")
        super().commit(optimizer, model, loaded, ctx)


def test_registered_optimizer_adapter_and_stateful_objects(tmp_path, monkeypatch):
    monkeypatch.setattr(ot.checkpoint.optim, "_REGISTRY", {})
    ot.checkpoint.register_optimizer_adapter(_Counting, _RecordingAdapter())

    class Scaler:
        def __init__(self, scale):
            self.scale = scale

        def state_dict(self):
            return {"scale": self.scale}

        def load_state_dict(self, state):
            self.scale = state["scale"]

    ctx, model, _ = _single()
    opt = _Counting(model.parameters(), lr=0.1, momentum=0.9)
    _train(ctx, model, opt, range(1))
    ot.save_checkpoint(tmp_path, model, opt, ctx, 1, scaler=Scaler(1024.0),
                       stateful={"sampler": Scaler(7)})
    ctx2, model2, _ = _single(seed=1)
    opt2 = _Counting(model2.parameters(), lr=0.5, momentum=0.9)
    scaler, sampler = Scaler(1.0), Scaler(0)
    ot.load_checkpoint(tmp_path, model2, opt2, ctx2, scaler=scaler, stateful={"sampler": sampler})
    assert _RecordingAdapter.calls == ["save", "commit"]
    assert scaler.scale == 1024.0 and sampler.scale == 7
    assert opt2.param_groups[0]["lr"] == 0.1  # hyperparameters come from the checkpoint
    assert _same(_snapshot(model2, opt2), _snapshot(model, opt))


# --- mixture of experts: experts over ep, each split over tp -----------------------------------

# Dropless, and no load-balancing loss: that loss is nonlinear in the batch, so a mean over the
# ep micro-batches differs from the loss of the whole batch — training would differ by layout.
MOE = preset("moe-tiny", moe_capacity_factor=None, moe_aux_loss_coef=0.0)


@pytest.mark.parametrize("saved,loaded", [
    ((1, 2), (1, 1)),  # experts over ep → the unparallelised reference MoE (one MLP per expert)
    pytest.param((2, 1), (1, 2), marks=pytest.mark.slow),
    pytest.param((1, 2), (2, 2), marks=pytest.mark.slow),
], ids=["ep2-dense", "tp2-ep2", "ep2-tp2xep2"])
def test_moe_checkpoint_loads_at_another_tp_and_ep(run_ranks, tmp_path, saved, loaded):
    (tp, ep), (tp2, ep2) = saved, loaded
    before, trained = run_ranks(_save_for_reshard, tp * ep, tmp_path, tp, 1, "heads", ep,
                                MOE)[0]
    got_before, got_trained, info = run_ranks(_load_resharded, tp2 * ep2, tmp_path, tp2, 1, ep2,
                                              MOE)[0]
    assert info["saved_layout"]["ep"] == saved[1]
    assert_rel(got_before, before, 1e-6, "loss of the loaded MoE model")
    assert_rel(got_trained, trained, 1e-5, "loss after two more steps")


def _moe_resume(root, save):
    ctx, model, opt = _job(1, 1, seed=0 if save else 1, ep=2, cfg=MOE)
    if save:
        _train(ctx, model, opt, range(2))
        ot.save_checkpoint(root, model, opt, ctx, 2)
    else:
        ot.load_checkpoint(root, model, opt, ctx)
    _train(ctx, model, opt, range(2, 4))
    return ot.gather_full_state_dict(model, ctx)


@pytest.mark.slow
def test_moe_resume_at_the_same_layout_is_bit_identical(run_ranks, tmp_path):
    ref = run_ranks(_moe_resume, 2, tmp_path, True)[0]
    got = run_ranks(_moe_resume, 2, tmp_path, False)[0]
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
