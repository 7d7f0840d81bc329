"""``train --model DIR --lora-rank R``: LoRA fine-tuning of a Hugging Face checkpoint through the
``train`` loop at tp 2 — only the adapters train and are saved (memory per rank reported against
full fine-tuning), ``--resume`` continues bit for bit, the PEFT export loads onto the plain base
with the parallel model's logits, ``--merge`` writes a directory with the base's tokenizer."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import hf_tiny
from helpers import BF16_RTOL, assert_rel
from ops_transformer import from_pretrained, init_parallel, load_checkpoint, lora
from ops_transformer.checkpoint import export as ex
from ops_transformer.cli.main import main

tr = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
tr.logging.set_verbosity_error()

LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "*.q_proj,*.v_proj,*.down_proj"]
ARGS = ["--nproc", "2", "--tp", "2", "--steps", "4", "--batch", "4", "--seq", "32", "--lr", "1e-2",
        "--save-every", "2", "--no-progress", "--json", *LORA]
IDS = torch.randint(0, 400, (2, 12), generator=torch.Generator().manual_seed(4))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """4 steps saving after 2 and 4, then the run resumed from its step 2."""
    path = hf_tiny.checkpoint(tmp_path_factory, "llama", tokenizer=True)
    root = tmp_path_factory.mktemp("lora-finetune")
    data = root / "train.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"{hf_tiny.TEXT} #{i}"}) for i in range(12)))
    common = ["train", "--model", str(path), "--data", str(data), *ARGS]
    assert main(common + ["--ckpt-dir", str(root / "a"), "--out", str(root / "ra")]) == 0
    (root / "b").mkdir()
    shutil.copytree(root / "a" / "step-00000002", root / "b" / "step-00000002")
    (root / "b" / "latest").write_text("step-00000002\n")
    assert main(common + ["--ckpt-dir", str(root / "b"), "--resume", "--out", str(root / "rb")]) == 0
    return path, root


def test_only_adapters_train_resume_and_memory(run, capsys):
    path, root = run
    capsys.readouterr()
    ref = json.loads((root / "ra" / "metrics.json").read_text())
    got = json.loads((root / "rb" / "metrics.json").read_text())
    assert got["resumed_from"] == 2 and got["losses"] == ref["losses"]
    report = ref["lora"]
    assert report["targets"] == [f"model.layers.{i}.{m}" for i in (0, 1)
                                 for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")]
    assert report["base"] == {"model_dir": str(path.resolve())}
    state, measured = ex.dense_state_dict(root / "a")[0], report["state_bytes_per_rank"]
    assert sorted(state) == sorted(f"{t}.lora_{r}.weight" for t in report["targets"] for r in "AB")
    trainable = 4 * report["trainable_params_per_rank"]  # fp32 bytes
    assert measured["grads"] == trainable  # gradients: the adapters' only
    assert 2 * trainable <= measured["optimizer"] <= 2 * trainable + 4 * 64
    full = report["full_finetune_state_bytes_per_rank"]
    assert full["params"] == measured["params"] and full["grads"] > 20 * measured["grads"]
    assert ref["losses"][-1] < ref["losses"][0]


def _logits(path, root):
    ctx = init_parallel(tp=2)
    model = lora(from_pretrained(str(path), ctx, dtype=torch.float32, overlap="none"), ctx, rank=4, alpha=8,
                 targets=["*.q_proj", "*.v_proj", "*.down_proj"],
                 base={"model_dir": str(path.resolve())})
    load_checkpoint(root / "a", model, None, ctx)
    with torch.no_grad():
        return model.eval()(input_ids=IDS).logits


def test_exports_load_onto_the_plain_base(run, run_ranks, tmp_path, capsys):
    path, root = run
    logits = run_ranks(_logits, 2, path, root)[0]
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert main(["checkpoint", "export", str(root / "a"), "--adapter", "--out", str(adapter)]) == 0
    assert main(["checkpoint", "export", str(root / "a"), "--merge", "--out", str(merged)]) == 0
    base = tr.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(base, str(adapter)).eval()
    with torch.no_grad():
        assert_rel(peft_model(input_ids=IDS).logits, logits, what="PEFT vs tp=2 logits")
    assert (merged / "tokenizer.json").is_file()  # the base's tokenizer comes along
    plain = tr.AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
    assert plain.dtype == torch.float32 and next(
        tr.AutoModelForCausalLM.from_pretrained(str(merged)).parameters()).dtype == torch.bfloat16
    with torch.no_grad():  # merged in fp32, stored in the base's bf16
        assert_rel(plain(input_ids=IDS).logits, logits, rtol=BF16_RTOL, what="merged logits")
