"""Tiny ``save_pretrained`` checkpoints for the loading and fine-tuning tests, written once per test
session under pytest's temporary directory: random weights in bf16 (as real checkpoints are
stored), some split into several files with an index, and a small BPE tokenizer trained here with
``tokenizers`` (nothing is downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 1001  # divides by neither 2 nor 4: padded internally
TEXT = ("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
        "The quick brown fox jumps over the lazy dog. " * 3
        + "for i in range(10):\n    print(i, fib(i))\n")


def _small(**extra) -> dict:
    return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, vocab_size=VOCAB, **extra)


def build(family: str):
    """The model (seed 0). ``llama_sharded`` is Llama written as several files with an index."""
    import transformers as tr

    torch.manual_seed(0)
    if family in ("llama", "llama_sharded"):
        return tr.LlamaForCausalLM(tr.LlamaConfig(**_small()))
    if family == "llama_padded":  # an FFN width that divides by neither 2 nor 4: padded
        return tr.LlamaForCausalLM(tr.LlamaConfig(**{**_small(), "intermediate_size": 130}))
    if family == "qwen2":  # Q/K/V biases
        return tr.Qwen2ForCausalLM(tr.Qwen2Config(**_small()))
    if family == "mistral":
        return tr.MistralForCausalLM(tr.MistralConfig(**_small()))
    if family == "qwen3":  # Q/K norms over each head
        return tr.Qwen3ForCausalLM(tr.Qwen3Config(**_small(), head_dim=16))
    if family == "gpt2":  # Conv1D weights, fused QKV, tied embeddings; no dropout
        return tr.GPT2LMHeadModel(tr.GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=64,
                                                n_layer=2, n_head=4, resid_pdrop=0.0,
                                                embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                                eos_token_id=0))
    if family == "mixtral":  # experts stored per expert (w1/w2/w3), stacked by transformers
        return tr.MixtralForCausalLM(tr.MixtralConfig(**_small(), num_local_experts=4,
                                                      num_experts_per_tok=2))
    raise ValueError(family)


def write(root: Path, family: str, *, tokenizer: bool = False) -> Path:
    """``root`` as a ``save_pretrained`` directory of ``family`` in bf16 (written once)."""
    if (root / "config.json").is_file():
        return root
    shard = "40KB" if family == "llama_sharded" else "50MB"
    build(family).to(torch.bfloat16).save_pretrained(root, max_shard_size=shard)
    if tokenizer:
        write_tokenizer(root)
    return root


def write_tokenizer(root: Path) -> None:
    """A byte-level BPE tokenizer of at most ``VOCAB`` tokens (EOS ``</s>``) saved in ``root``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([TEXT] * 4, trainer)
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>").save_pretrained(root)
    config = json.loads((root / "config.json").read_text())
    config["eos_token_id"] = bpe.token_to_id("</s>")
    (root / "config.json").write_text(json.dumps(config, indent=2))


def checkpoint(tmp_path_factory, family: str, **kwargs) -> Path:
    """The session's checkpoint of ``family`` (shared by every test module)."""
    name = family + ("-tok" if kwargs.get("tokenizer") else "")
    return write(tmp_path_factory.getbasetemp() / "hf-tiny" / name, family, **kwargs)
