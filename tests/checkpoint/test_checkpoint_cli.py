"""Checkpoints from the command line: ``train --ckpt-dir/--save-every/--resume/--max-restarts``
(a rank killed mid-run; the restarted job finishes bit-identical to an uninterrupted one),
``checkpoint inspect`` and ``checkpoint export`` (safetensors; save_pretrained for Hugging Face)."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
import torch._dynamo  # noqa: F401 - meta-device init imports it lazily: once here, not per rank

import ops_transformer as ot
from ops_transformer.checkpoint import export as ex
from ops_transformer.cli.main import main

from helpers import assert_rel

TRAIN = ["train", "--nproc", "2", "--tp", "2", "--steps", "6", "--batch", "4", "--seq", "32",
         "--save-every", "3", "--no-progress", "--json"]


def _json_tail(text: str) -> dict:
    return json.loads(text[text.index("\n{") + 1:] if not text.startswith("{") else text)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    argv = TRAIN + ["--ckpt-dir", str(root / "ckpt"), "--out", str(root / "run")]
    assert main(argv) == 0
    return root, json.loads((root / "run" / "metrics.json").read_text())


@pytest.mark.slow
def test_killed_rank_restarts_and_finishes_bit_identical(uninterrupted, tmp_path, monkeypatch,
                                                         capsys, caplog):
    ref_root, ref = uninterrupted
    killed = tmp_path / "killed-once"
    original = torch.optim.AdamW.step

    def step(self, *args, **kwargs):  # rank 1 dies at its 5th step, once (forked ranks inherit it)
        self._test_steps = getattr(self, "_test_steps", 0) + 1
        if os.environ.get("RANK") == "1" and self._test_steps == 5 and not killed.exists():
            killed.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    argv = TRAIN + ["--ckpt-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "run"),
                    "--resume", "--max-restarts", "1"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert killed.exists() and "restarting all 2 ranks (restart 1 of 1)" in caplog.text
    metrics = _json_tail(captured.out)
    assert metrics["resumed_from"] == 3
    assert metrics["losses"] == ref["losses"] and metrics["sample"] == ref["sample"]
    ours, _ = ex.dense_state_dict(tmp_path / "ckpt")
    theirs, _ = ex.dense_state_dict(ref_root / "ckpt")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def _save_tp2(root):
    ctx = ot.init_parallel(tp=2)
    torch.manual_seed(0)
    model = ot.parallelize(ot.GPT(ot.GPTConfig()), ctx)
    opt = torch.optim.AdamW(model.parameters())
    for step in (3, 6):
        x = torch.randint(0, 256, (2, 9))
        model(x[:, :-1], x[:, 1:])[1].backward()
        opt.step()
        ot.save_checkpoint(root, model, opt, ctx, step)


def test_inspect_lists_steps_layout_and_verification(run_ranks, tmp_path, capsys):
    root = tmp_path / "ckpt"
    run_ranks(_save_tp2, 2, root)
    assert main(["checkpoint", "inspect", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[2:]]
    assert [r[0] for r in rows] == ["3", "6"] and rows[1][1] == "*"
    assert all("dp=1" in line and "tp=2" in line and line.endswith("ok") for line in lines[2:])
    assert main(["checkpoint", "inspect", str(root / "step-00000006"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)["checkpoints"][0]
    assert info["status"] == "ok" and info["layout"]["tp"] == 2 and info["optimizer"] == "AdamW"
    n = info["model_tensors"]  # AdamW: exp_avg and exp_avg_sq like the parameter, a scalar step
    assert info["optimizer_tensors"] == 3 * n
    assert info["optimizer_elements"] == 2 * info["model_elements"] + n


def test_inspect_reports_a_corrupted_file(tmp_path, capsys):
    ctx = ot.ParallelContext.single()
    ot.save_checkpoint(tmp_path, ot.GPT(ot.GPTConfig()), None, ctx, 1)
    shard = tmp_path / "step-00000001" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1])
    assert main(["checkpoint", "inspect", str(tmp_path)]) == 1
    assert "file '__0_0.distcp' is truncated" in capsys.readouterr().out


def test_export_safetensors_loads_into_the_dense_model(tmp_path, capsys):
    from safetensors.torch import load_model

    torch.manual_seed(0)
    model = ot.GPT(ot.GPTConfig())  # tied embeddings: stored once
    ot.save_checkpoint(tmp_path / "ckpt", model, None, ot.ParallelContext.single(), 4)
    out = tmp_path / "model.safetensors"
    assert main(["checkpoint", "export", str(tmp_path / "ckpt"), "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    torch.manual_seed(1)
    fresh = ot.GPT(ot.GPTConfig())
    load_model(fresh, str(out))
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                 model.state_dict().values()))
    assert fresh.lm_head.weight is fresh.tok_emb.weight


def test_train_checkpoint_flags_need_a_directory(capsys):
    assert main(["train", "--steps", "2", "--save-every", "1"]) == 2
    assert "--save-every need --ckpt-dir" in capsys.readouterr().err
    assert main(["train", "--steps", "2", "--ckpt-dir", "x", "--max-restarts", "1",
                 "--nproc", "1"]) == 2
    assert "--max-restarts needs --resume" in capsys.readouterr().err


def test_output_locations_are_checked_before_any_work(tmp_path, capsys, monkeypatch):
    from ops_transformer.cli import train as cli_train

    def work(*args, **kwargs):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(cli_train, "train_worker", work)
    monkeypatch.setattr(ex, "dense_state_dict", work)
    blocker = tmp_path / "file"
    blocker.write_text("keep me")
    assert main(["train", "--steps", "2", "--ckpt-dir", str(blocker), "--out",
                 str(tmp_path / "run")]) == 2
    assert "--ckpt-dir" in capsys.readouterr().err and blocker.read_text() == "keep me"
    ot.save_checkpoint(tmp_path / "ckpt", ot.GPT(ot.GPTConfig()), None,
                       ot.ParallelContext.single(), 1)
    assert main(["checkpoint", "export", str(tmp_path / "ckpt"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--out {str(tmp_path)!r} is a directory" in err, err


# --- Hugging Face GPT-2: Conv1D weights (transposed), fused c_attn, tied and padded vocabulary ----

tr = pytest.importorskip("transformers")
_ = (tr.GPT2LMHeadModel, tr.GPT2Config, tr.MixtralForCausalLM, tr.MixtralConfig,
     tr.GenerationMixin)  # resolved in the parent, not in every forked rank


def _gpt2():
    torch.manual_seed(0)
    return tr.GPT2LMHeadModel(tr.GPT2Config(vocab_size=1001, n_positions=32, n_embd=64, n_layer=2,
                                            n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                            attn_pdrop=0.0))


IDS = torch.arange(24).reshape(2, 12) * 37 % 1001


def _save_gpt2(root, tp):
    ctx = ot.init_parallel(tp=tp)
    model = ot.parallelize(_gpt2(), ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(IDS, labels=IDS).loss.backward()
    opt.step()
    ot.save_checkpoint(root, model, opt, ctx, 1)
    with torch.no_grad():
        return model(IDS).logits


def test_gpt2_checkpoint_reshards_and_exports_for_plain_transformers(run_ranks, tmp_path, capsys):
    logits = run_ranks(_save_gpt2, 2, tmp_path / "ckpt", 2)[0]
    dense = _gpt2()  # tp 1: plain Conv1D weights [in, out], loaded from the tp 2 shards
    opt = torch.optim.AdamW(dense.parameters(), lr=1e-2)
    info = ot.load_checkpoint(tmp_path / "ckpt", dense, opt, ot.ParallelContext.single())
    assert info["resharded"]
    with torch.no_grad():
        assert_rel(dense(IDS).logits, logits, 1e-5, "tp 1 model loaded from tp 2")
    out = tmp_path / "exported"
    assert main(["checkpoint", "export", str(tmp_path / "ckpt"), "--out", str(out)]) == 0
    assert "save_pretrained directory (GPT2LMHeadModel)" in capsys.readouterr().out
    plain = tr.AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        assert_rel(plain(IDS).logits, logits, 1e-5, "plain transformers from the export")


@pytest.mark.slow
def test_fp16_resume_restores_the_loss_scaler(tmp_path, capsys):
    base = ["train", "--nproc", "2", "--tp", "2", "--batch", "2", "--seq", "16", "--precision",
            "fp16", "--save-every", "2", "--no-progress", "--json"]
    assert main(base + ["--steps", "4", "--ckpt-dir", str(tmp_path / "a"),
                        "--out", str(tmp_path / "ra")]) == 0
    assert main(base + ["--steps", "2", "--ckpt-dir", str(tmp_path / "b"),
                        "--out", str(tmp_path / "rb")]) == 0
    assert main(base + ["--steps", "4", "--ckpt-dir", str(tmp_path / "b"), "--resume",
                        "--out", str(tmp_path / "rb")]) == 0
    capsys.readouterr()
    ref = json.loads((tmp_path / "ra" / "metrics.json").read_text())
    got = json.loads((tmp_path / "rb" / "metrics.json").read_text())
    assert got["resumed_from"] == 2 and got["losses"] == ref["losses"]
    assert got["loss_scale"] == ref["loss_scale"] and got["skipped_steps"] == ref["skipped_steps"]
    a, _ = ex.dense_state_dict(tmp_path / "a")
    b, manifest = ex.dense_state_dict(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert manifest["scaler"] is True  # DynamicLossScaler.state_dict() went into the checkpoint


def _mixtral():
    torch.manual_seed(0)
    return tr.MixtralForCausalLM(tr.MixtralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, vocab_size=1001, num_local_experts=4,
        num_experts_per_tok=2))


def _save_mixtral(root):
    ctx = ot.init_parallel(tp=1, ep=2)  # experts 0-1 on rank 0, 2-3 on rank 1
    model = ot.parallelize(_mixtral(), ctx)
    ot.save_checkpoint(root, model, None, ctx, 1)
    with torch.no_grad():
        return model(IDS).logits  # every EP rank runs the same tokens here


def test_mixtral_experts_over_ep_export_for_plain_transformers(run_ranks, tmp_path, capsys):
    logits = run_ranks(_save_mixtral, 2, tmp_path / "ckpt")[0]
    out = tmp_path / "exported"
    assert main(["checkpoint", "export", str(tmp_path / "ckpt"), "--out", str(out)]) == 0
    capsys.readouterr()
    plain = tr.AutoModelForCausalLM.from_pretrained(out)  # gate_up_proj [4, 256, 64] again
    with torch.no_grad():
        assert_rel(plain(IDS).logits, logits, 1e-5, "plain transformers from the ep=2 export")
