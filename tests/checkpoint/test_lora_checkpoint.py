"""LoRA checkpoints: they hold the adapters and a reference to the base; ``train --lora-rank``
on a preset resumes bit-identically (slow); ``checkpoint export --adapter`` is a PEFT adapter directory that
``PeftModel.from_pretrained`` loads onto the plain base with equal logits; ``--merge`` is the base
with the adapters merged, equal to PEFT's ``merge_and_unload``."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import ops_transformer as ot
from ops_transformer.checkpoint import export as ex
from ops_transformer.cli.main import main
from ops_transformer.models import preset
from ops_transformer.parallel.sharding import shard_spec

from helpers import assert_rel

tr = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TRAIN = ["train", "--nproc", "2", "--tp", "2", "--preset", "tiny", "--batch", "4", "--seq", "32",
         "--lora-rank", "4", "--lora-alpha", "8", "--save-every", "2", "--no-progress", "--json"]
IDS = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def preset_runs(tmp_path_factory):
    """4 steps, saving after 2 and 4."""
    root = tmp_path_factory.mktemp("lora-train")
    assert main(TRAIN + ["--steps", "4", "--ckpt-dir", str(root / "a"),
                         "--out", str(root / "ra")]) == 0
    return root


@pytest.mark.slow  # (the default suite resumes a LoRA run of train --model: test_lora_finetune)
def test_preset_lora_training_resumes_bit_identically(preset_runs, capsys):
    root = preset_runs
    (root / "b").mkdir()
    shutil.copytree(root / "a" / "step-00000002", root / "b" / "step-00000002")
    (root / "b" / "latest").write_text("step-00000002\n")
    assert main(TRAIN + ["--steps", "4", "--ckpt-dir", str(root / "b"), "--resume",
                         "--out", str(root / "rb")]) == 0
    capsys.readouterr()
    ref = json.loads((root / "ra" / "metrics.json").read_text())
    got = json.loads((root / "rb" / "metrics.json").read_text())
    assert got["resumed_from"] == 2 and got["losses"] == ref["losses"]
    a, _ = ex.dense_state_dict(root / "a")
    b, _ = ex.dense_state_dict(root / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_lora_training_saves_only_the_adapters(preset_runs, capsys):
    capsys.readouterr()
    ref = json.loads((preset_runs / "ra" / "metrics.json").read_text())
    a, manifest = ex.dense_state_dict(preset_runs / "a")
    report = ref["lora"]
    assert sorted(a) == sorted(f"{t}.lora_{r}.weight" for t in report["targets"] for r in "AB")
    assert len(report["targets"]) == 12 and report["scaling"] == 2.0
    assert manifest["model"]["lora"]["base"] == {"preset": "tiny", "seed": 0}
    dense = sum(v.numel() for v in a.values())  # at tp 2 each rank holds half of each split
    assert dense // 2 < report["trainable_params_per_rank"] < dense  # factor, all of the other
    adam = 2 * 4 * report["trainable_params_per_rank"]  # exp_avg, exp_avg_sq in fp32
    assert adam <= report["optimizer_state_bytes_per_rank"] <= adam + 4 * 64  # + the step counts
    assert report["frozen_params_per_rank"] > 10 * report["trainable_params_per_rank"]
    assert all(torch.count_nonzero(v) for k, v in a.items() if "lora_B" in k)  # B trained


def test_preset_export_adapter_loads_in_peft_and_merge_equals_it(preset_runs, tmp_path, capsys):
    adapter, merged = tmp_path / "adapter", tmp_path / "merged.safetensors"
    assert main(["checkpoint", "export", str(preset_runs / "a"), "--adapter",
                 "--out", str(adapter)]) == 0
    assert main(["checkpoint", "export", str(preset_runs / "a"), "--merge",
                 "--out", str(merged)]) == 0
    assert "PEFT adapter directory" in capsys.readouterr().out
    config = preset("tiny", max_seq_len=128)

    def base():
        torch.manual_seed(0)  # the base train built: its seed
        return ot.GPT(config)

    peft_model = peft.PeftModel.from_pretrained(base(), str(adapter)).eval()
    from safetensors.torch import load_model

    ours = base().eval()
    load_model(ours, str(merged))
    ids = IDS % config.vocab_size
    with torch.no_grad():
        assert_rel(ours(ids)[0], peft_model(ids)[0], what="merged vs PEFT logits")
        reference = peft_model.merge_and_unload().state_dict()
    for key, value in ours.state_dict().items():
        assert_rel(value, reference[key], what=key)


def make(family: str):
    torch.manual_seed(0)
    if family == "llama":
        return tr.LlamaForCausalLM(tr.LlamaConfig(
            vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    return tr.GPT2LMHeadModel(tr.GPT2Config(vocab_size=96, n_positions=64, n_embd=64, n_layer=2,
                                            n_head=4, bos_token_id=0, eos_token_id=0))


def _train_and_save(base_dir, root, family):
    """Adapters on the model loaded from ``base_dir`` at tp 2, B set to non-zero values (as after
    training), saved; returns the logits."""
    ctx = ot.init_parallel(tp=2)
    model = getattr(tr, type(make(family)).__name__).from_pretrained(str(base_dir)).eval()
    model = ot.lora(ot.parallelize(model, ctx, overlap="none"), ctx, rank=4, alpha=16, dropout=0.05)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name in model.parallel_state.lora.targets:
            factor = model.get_submodule(name).lora_B.weight
            dense = torch.randn(shard_spec(factor).full_shape if shard_spec(factor)
                                else factor.shape, generator=g) * 0.05
            factor.copy_(dense if shard_spec(factor) is None else shard_spec(factor).shard(dense))
        ot.save_checkpoint(root, model, None, ctx, 1)
        return model(input_ids=IDS).logits


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hf_export_adapter_loads_in_peft_with_equal_logits(run_ranks, tmp_path, capsys, family):
    base_dir, root = tmp_path / "base", tmp_path / "ckpt"
    make(family).save_pretrained(base_dir)
    logits = run_ranks(_train_and_save, 2, base_dir, root, family)[0]
    _, manifest = ex.dense_state_dict(root)
    assert manifest["model"]["lora"]["base"] == {"model_dir": str(base_dir.resolve())}
    assert main(["checkpoint", "export", str(root), "--adapter", "--out",
                 str(tmp_path / "adapter")]) == 0
    assert main(["checkpoint", "export", str(root), "--merge", "--out",
                 str(tmp_path / "merged")]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 16 and config["peft_type"] == "LORA"
    assert config["fan_in_fan_out"] == (family == "gpt2")
    cls = getattr(tr, type(make(family)).__name__)
    peft_model = peft.PeftModel.from_pretrained(cls.from_pretrained(str(base_dir)),
                                                str(tmp_path / "adapter")).eval()
    merged = cls.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        assert_rel(peft_model(input_ids=IDS).logits, logits, what="PEFT vs tp=2 logits")
        assert_rel(merged(input_ids=IDS).logits, logits, what="merged vs tp=2 logits")
        reference = peft_model.merge_and_unload().state_dict()
    for key, value in merged.state_dict().items():
        assert_rel(value, reference[key], what=key)


def test_lora_checkpoint_errors(preset_runs, tmp_path, capsys):
    capsys.readouterr()
    assert main(["checkpoint", "export", str(preset_runs / "a"), "--out",
                 str(tmp_path / "x.safetensors")]) == 2
    assert "holds LoRA adapters only" in capsys.readouterr().err
    assert main(["train", "--steps", "2", "--lora-alpha", "8"]) == 2
    assert "--lora-alpha configures LoRA adapters: add --lora-rank R" in capsys.readouterr().err
    assert main(["train", "--steps", "2", "--lora-rank", "0"]) == 2
    assert "rank must be a positive integer, got 0" in capsys.readouterr().err
    assert main(["train", "--steps", "2", "--lora-rank", "4", "--lora-targets", "*.q_proj"]) == 2
    assert "target pattern '*.q_proj' matches no module of GPT" in capsys.readouterr().err
    assert main(["train", "--steps", "2", "--lora-rank", "65"]) == 2
    err = capsys.readouterr().err
    assert "rank (65) exceeds the smaller dimension of layers.0.attn.wq" in err
    assert len(err.strip().splitlines()) == 1
