"""``train --model DIR``: a Hugging Face causal LM fine-tuned through the ``train`` loop. Losses at
tp 2, dp 2 × tp 2 and ep 2 (Mixtral) equal tp 1 (fp32); a killed job resumes bit for bit; the
checkpoint exports to a directory plain ``transformers`` loads with the parallel model's logits."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

import hf_tiny
from helpers import assert_rel
from ops_transformer import from_pretrained, init_parallel, load_checkpoint
from ops_transformer.training import corpus
from ops_transformer.checkpoint import export as ex
from ops_transformer.cli.main import main

tr = pytest.importorskip("transformers")
tr.logging.set_verbosity_error()
_ = (tr.AutoModelForCausalLM, tr.AutoTokenizer, tr.LlamaForCausalLM, tr.MixtralForCausalLM)

STEPS = ["--steps", "6", "--batch", "4", "--seq", "32", "--lr", "1e-3", "--lr-schedule", "cosine",
         "--warmup", "2", "--no-progress", "--json"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    lines = [json.dumps({"text": f"{hf_tiny.TEXT} #{i}"}) for i in range(12)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _train(model_dir, data, *layout, extra=()):
    argv = ["train", "--model", str(model_dir), "--data", str(data), *layout, *STEPS, *extra]
    assert main(argv) == 0


def _metrics(capsys) -> dict:
    out = capsys.readouterr().out
    return json.loads(out[out.index("{"):])


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data):
    """The tp 1 losses of each model (one process)."""
    losses = {}
    for family in ("llama", "mixtral"):
        path = hf_tiny.checkpoint(tmp_path_factory, family, tokenizer=family == "llama")
        out = tmp_path_factory.mktemp(f"ref-{family}")
        _train(path, data, "--nproc", "1", extra=["--out", str(out)])
        losses[family] = json.loads((out / "metrics.json").read_text())["losses"]
    return losses


@pytest.mark.parametrize("family,layout", [
    ("llama", ["--nproc", "2", "--tp", "2"]),
    ("llama", ["--nproc", "4", "--tp", "2", "--dp", "2"]),
    ("mixtral", ["--nproc", "2", "--ep", "2"]),
])
def test_losses_equal_one_rank(tmp_path_factory, data, reference, capsys, family, layout):
    path = hf_tiny.checkpoint(tmp_path_factory, family, tokenizer=family == "llama")
    capsys.readouterr()
    _train(path, data, *layout, extra=["--out", str(tmp_path_factory.mktemp("run"))])
    metrics = _metrics(capsys)
    assert metrics["model_dir"] == str(path) and metrics["preset"] is None
    assert_rel(torch.tensor(metrics["losses"]), torch.tensor(reference[family]),
               what=f"{family} {' '.join(layout)} losses")
    assert metrics["losses"][-1] < metrics["losses"][0]


def test_bytes_without_a_tokenizer_are_said_once(tmp_path_factory, data, capsys):
    path = hf_tiny.checkpoint(tmp_path_factory, "mixtral")
    corpus._TOKENS.clear()  # tokenised again, as by a new command
    _train(path, data, "--nproc", "2", "--ep", "2",
           extra=["--out", str(tmp_path_factory.mktemp("run"))])
    assert capsys.readouterr().err.count("has no tokenizer files") == 1


# --- checkpoints: kill, resume, export ------------------------------------------------------------

@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data):
    path = hf_tiny.checkpoint(tmp_path_factory, "llama", tokenizer=True)
    root = tmp_path_factory.mktemp("uninterrupted")
    _train(path, data, "--nproc", "2", "--tp", "2",
           extra=["--ckpt-dir", str(root / "ckpt"), "--save-every", "3", "--out", str(root / "run")])
    return path, root, json.loads((root / "run" / "metrics.json").read_text())


def test_killed_job_resumes_bit_for_bit(uninterrupted, data, tmp_path, monkeypatch, capsys):
    path, ref_root, ref = uninterrupted
    original = torch.optim.AdamW.step

    def step(self, *args, **kwargs):  # rank 1 dies at its 5th step (forked ranks inherit this)
        self._test_steps = getattr(self, "_test_steps", 0) + 1
        if os.environ.get("RANK") == "1" and self._test_steps == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, *args, **kwargs)

    argv = ["--nproc", "2", "--tp", "2"]
    extra = ["--ckpt-dir", str(tmp_path / "ckpt"), "--save-every", "3", "--resume",
             "--out", str(tmp_path / "run")]
    with monkeypatch.context() as patch:
        patch.setattr(torch.optim.AdamW, "step", step)
        killed = ["train", "--model", str(path), "--data", str(data), *argv, *STEPS, *extra]
        assert main(killed) == 1  # the cause in one line (a rank is not a user error)
    assert "rank 1 exited" in capsys.readouterr().err
    _train(path, data, *argv, extra=extra)  # the same command again: continues from step 3
    metrics = _metrics(capsys)
    assert metrics["resumed_from"] == 3 and metrics["losses"] == ref["losses"]
    ours, _ = ex.dense_state_dict(tmp_path / "ckpt")
    theirs, _ = ex.dense_state_dict(ref_root / "ckpt")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def _parallel_logits(model_dir, ckpt_dir, ids):
    ctx = init_parallel(tp=2)
    model = from_pretrained(model_dir, ctx, dtype=torch.float32)
    load_checkpoint(ckpt_dir, model, None, ctx)
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_export_loads_in_plain_transformers_with_the_parallel_logits(run_ranks, uninterrupted,
                                                                     tmp_path, capsys):
    path, root, _ = uninterrupted
    out = tmp_path / "exported"
    assert main(["checkpoint", "export", str(root / "ckpt"), "--out", str(out)]) == 0
    assert "tokenizer.json" in capsys.readouterr().out
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    plain = tr.AutoModelForCausalLM.from_pretrained(out).eval()
    assert plain.dtype == torch.float32
    ids = tr.AutoTokenizer.from_pretrained(out)(["def fib(n): return"],
                                                return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = plain(input_ids=ids).logits
    for logits in run_ranks(_parallel_logits, 2, str(path), str(root / "ckpt"), ids):
        assert_rel(logits, expected, what="exported model's logits")
    original = tr.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():  # the fine-tuning changed the weights
        assert not torch.allclose(original(input_ids=ids).logits, expected)


# --- the other train options, and mistakes ---------------------------------------------------------

def test_memory_precision_and_logging_options_run(tmp_path_factory, data, tmp_path, capsys):
    path = hf_tiny.checkpoint(tmp_path_factory, "llama", tokenizer=True)
    _train(path, data, "--nproc", "4", "--tp", "2", "--dp", "2",
           extra=["--zero", "1", "--sequence-parallel", "--recompute", "selective",
                  "--activation-cache", "int8", "--precision", "bf16", "--clip-grad", "1.0",
                  "--tensorboard", str(tmp_path / "tb"), "--out", str(tmp_path / "run")])
    metrics = _metrics(capsys)
    assert all(torch.isfinite(torch.tensor(metrics["losses"])))
    config = metrics["config"]
    assert (config["zero"], config["sequence_parallel"], config["precision"]) == (1, True, "bf16")
    assert metrics["param_bytes_per_rank"] % 4 == 0  # fp32 master weights under bf16 autocast
    assert any((tmp_path / "tb").iterdir())


@pytest.mark.parametrize("argv,needle", [
    (["--preset", "small"], "--model"),
    (["--attention", "kv_split"], "head-parallel"),
    (["--nproc", "4", "--tp", "4", "--sequence-parallel", "--seq", "30"], "divisible by tp"),
    (["--ep", "2", "--nproc", "2"], "mixture-of-experts"),
    (["--lr-schedule", "cosine", "--warmup", "9"], "--warmup (9)"),
    (["--seq", "100000"], "beyond the 128 positions"),  # before the corpus is tokenised
])
def test_mistakes_are_one_line_errors(tmp_path_factory, data, capsys, argv, needle):
    path = hf_tiny.checkpoint(tmp_path_factory, "llama", tokenizer=True)
    base = ["train", "--model", str(path), "--data", str(data), "--steps", "6", "--no-progress"]
    assert main(base + argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err, err


def test_a_directory_without_a_model(tmp_path, capsys):
    assert main(["train", "--model", str(tmp_path), "--steps", "1"]) == 2
    assert "no config.json" in capsys.readouterr().err


# --- heavier variants (make test-all) ----------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("family,layout", [
    ("mixtral", ["--nproc", "4", "--ep", "2", "--tp", "2"]),
    ("mixtral", ["--nproc", "4", "--tp", "4"]),
    ("llama", ["--nproc", "4", "--tp", "4"]),
])
def test_losses_equal_one_rank_more_layouts(tmp_path_factory, data, reference, capsys, family,
                                            layout):
    test_losses_equal_one_rank(tmp_path_factory, data, reference, capsys, family, layout)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "gpt2", "llama_sharded"])
def test_other_families_train_as_on_one_rank(tmp_path_factory, data, capsys, family):
    path = hf_tiny.checkpoint(tmp_path_factory, family)
    runs = []
    for layout in (["--nproc", "1"], ["--nproc", "4", "--tp", "2", "--dp", "2"]):
        capsys.readouterr()
        _train(path, data, *layout, extra=["--out", str(tmp_path_factory.mktemp("run"))])
        runs.append(_metrics(capsys)["losses"])
    assert_rel(torch.tensor(runs[1]), torch.tensor(runs[0]), what=f"{family} losses")


@pytest.mark.slow
def test_killed_rank_is_restarted_and_finishes_bit_for_bit(uninterrupted, data, tmp_path,
                                                          monkeypatch, capsys):
    path, ref_root, ref = uninterrupted
    killed = tmp_path / "killed-once"
    original = torch.optim.AdamW.step

    def step(self, *args, **kwargs):  # rank 1 dies at its 5th step, once; the launcher restarts
        self._test_steps = getattr(self, "_test_steps", 0) + 1
        if os.environ.get("RANK") == "1" and self._test_steps == 5 and not killed.exists():
            killed.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    _train(path, data, "--nproc", "2", "--tp", "2",
           extra=["--ckpt-dir", str(tmp_path / "ckpt"), "--save-every", "3", "--resume",
                  "--max-restarts", "1", "--out", str(tmp_path / "run")])
    metrics = _metrics(capsys)
    assert killed.exists() and metrics["resumed_from"] == 3
    assert metrics["losses"] == ref["losses"]
