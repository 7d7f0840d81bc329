"""``ot.from_pretrained``: a ``save_pretrained`` directory loaded into its parallel layout, each rank
reading only its shards. Logits equal ``transformers``' ``from_pretrained`` followed by
``parallelize`` (fp32), no rank creates a full-size tensor of a split layer, and broken
directories are one-line errors naming the file and the key."""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter

import pytest
import torch

import hf_tiny
from helpers import assert_rel
from ops_transformer.memory.allocations import AllocationTracker
from ops_transformer import (CheckpointError, ParallelContext, from_pretrained, init_parallel,
                            parallelize)

tr = pytest.importorskip("transformers")
tr.logging.set_verbosity_error()
_ = (tr.AutoModelForCausalLM, tr.LlamaForCausalLM, tr.Qwen2ForCausalLM, tr.GPT2LMHeadModel,
     tr.MixtralForCausalLM, tr.GenerationMixin)  # imported in the parent: forked ranks inherit them


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    return lambda family: hf_tiny.checkpoint(tmp_path_factory, family)


def _ids():
    return torch.randint(0, hf_tiny.VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


def _ctx(ep=1):
    world = int(os.environ["WORLD_SIZE"])
    return init_parallel(tp=world // ep, ep=ep)


def _logits_both(path, ep):
    """This rank's logits from transformers + parallelize and from from_pretrained (fp32)."""
    ctx = _ctx(ep)
    reference = tr.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if ctx.tp_size * ctx.ep_size > 1:
        reference = parallelize(reference, ctx, vocab="parallel")
    model = from_pretrained(path, ctx, dtype=torch.float32, vocab="parallel")
    with torch.no_grad():
        return reference(input_ids=_ids()).logits, model(input_ids=_ids()).logits


@pytest.mark.parametrize("family,world,ep", [
    ("llama_sharded", 2, 1), ("llama_sharded", 4, 1), ("qwen2", 2, 1), ("qwen2", 4, 1),
    ("gpt2", 2, 1), ("gpt2", 4, 1), ("mixtral", 2, 1), ("mixtral", 4, 1), ("mixtral", 2, 2),
    ("mixtral", 4, 2),
])
def test_logits_equal_transformers_then_parallelize(run_ranks, tiny, family, world, ep):
    for reference, logits in run_ranks(_logits_both, world, str(tiny(family)), ep):
        assert logits.shape == (2, 12, hf_tiny.VOCAB)
        assert_rel(logits, reference, what=f"{family} logits at world {world}, ep {ep}")


def _loaded_state(path, dtype):
    ctx = _ctx()
    model = from_pretrained(path, ctx, dtype=dtype)
    plain = tr.AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto").eval()
    with torch.no_grad():
        same = torch.equal(model(input_ids=_ids()).logits, plain(input_ids=_ids()).logits)
    devices = {t.device for t in [*model.parameters(), *model.buffers()]}
    inv_freq = dict(model.named_buffers())["model.rotary_emb.inv_freq"]
    return {"dtypes": {p.dtype for p in model.parameters()}, "devices": devices,
            "training": model.training, "same_logits": same,
            "inv_freq": torch.equal(inv_freq, dict(plain.named_buffers())[
                "model.rotary_emb.inv_freq"]),
            "eos": model.generation_config.eos_token_id,
            "name": model.config.name_or_path}


@pytest.mark.parametrize("dtype", [None, "float32"])
def test_one_rank_is_plain_transformers_in_the_checkpoint_dtype(run_ranks, tiny, dtype):
    path = tiny("llama")
    (state,) = run_ranks(_loaded_state, 1, str(path), dtype)
    assert state["dtypes"] == {torch.bfloat16 if dtype is None else torch.float32}
    assert state["devices"] == {torch.device("cpu")} and not state["training"]
    assert state["same_logits"] and state["inv_freq"]
    assert state["eos"] == json.loads((path / "generation_config.json").read_text())["eos_token_id"]
    assert state["name"] == str(path.resolve())


# --- what each rank materialises ------------------------------------------------------------------

def _full_shapes_of_split(model) -> set[tuple]:
    """The dense shapes (in either orientation) of the tensors split over this rank's TP group."""
    shapes = set()
    for p in model.parameters():
        spec = getattr(p, "shard_spec", None)
        if spec is not None and spec.num_shards > 1:
            shapes |= {tuple(spec.full_shape), tuple(reversed(spec.full_shape))}
    return shapes


def _created(path, whole_model):
    ctx = _ctx()
    with AllocationTracker(ctx.device) as counter:  # storages the ops create, in order
        if whole_model:  # the path generate/embed used to take: whole model, then slices
            os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"  # its reads on this thread, counted
            model = tr.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            model = parallelize(model, ctx, vocab="parallel")
        else:
            model = from_pretrained(path, ctx, dtype=torch.float32, vocab="parallel")
    kept = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
    torch.distributed.barrier()  # rank 0 (the store) must not leave while others make KV groups
    return (counter.allocations, [(tuple(t.shape), t.numel() * t.element_size()) for t in kept],
            _full_shapes_of_split(model), counter.peak)


def _full_size_copies(created, kept, split_shapes) -> list[tuple]:
    """Created tensors shaped like a whole split weight, beyond the kept tensors of that shape
    (a shard of one weight may have the dense shape of another)."""
    made = Counter(shape for shape, _ in created if shape in split_shapes)
    have = Counter(shape for shape, _ in kept)
    return [shape for shape, n in made.items() if n > have[shape]]


@pytest.mark.parametrize("tp", [2, 4])
def test_no_rank_creates_a_full_size_weight_of_a_split_layer(run_ranks, tiny, tp):
    path = str(tiny("llama_sharded"))
    for created, kept, split_shapes, peak in run_ranks(_created, tp, path, False):
        assert not _full_size_copies(created, kept, split_shapes)
        assert max(size for _, size in created) <= max(size for _, size in kept)
        assert sum(size for _, size in created) <= 1.25 * sum(size for _, size in kept)
        assert peak <= 1.25 * sum(size for _, size in kept)
    # The counter sees what the whole-model path creates: dense fp32 copies of split weights.
    for created, kept, split_shapes, _ in run_ranks(_created, tp, path, True):
        assert _full_size_copies(created, kept, split_shapes)


# --- broken directories ---------------------------------------------------------------------------

def _rewrite(src, dst, change):
    """A copy of the single-file checkpoint ``src`` whose tensors ``change(dict)`` edited."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    change(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _one_line_error(run_ranks, path, *needles):
    with pytest.raises(CheckpointError) as info:
        from_pretrained(path, ParallelContext.single())
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message
    return message


def test_missing_key_names_the_file_and_the_key(run_ranks, tiny, tmp_path):
    key = "model.layers.1.mlp.up_proj.weight"
    path = _rewrite(tiny("qwen2"), tmp_path / "m", lambda t: t.pop(key))
    _one_line_error(run_ranks, path, "model.safetensors", key, "missing")


def test_unexpected_key_names_the_file_and_the_key(run_ranks, tiny, tmp_path):
    path = _rewrite(tiny("qwen2"), tmp_path / "m",
                    lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    _one_line_error(run_ranks, path, "model.safetensors", "model.layers.0.extra.weight",
                    "unexpected")


def test_shape_that_does_not_match_the_config(run_ranks, tiny, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(tiny("qwen2"), path)
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(config))
    _one_line_error(run_ranks, path, "model.safetensors", "mlp.gate_proj.weight", "(128, 64)",
                    "(96, 64)")


def test_index_naming_a_missing_file(run_ranks, tiny, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(tiny("llama_sharded"), path)
    victim = sorted(path.glob("model-*.safetensors"))[1]
    victim.unlink()
    _one_line_error(run_ranks, path, "model.safetensors.index.json", victim.name)


def test_truncated_file(run_ranks, tiny, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(tiny("qwen2"), path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:len(data) // 2])
    _one_line_error(run_ranks, path, "model.safetensors")


def test_no_config(run_ranks, tmp_path):
    _one_line_error(run_ranks, tmp_path, "no config.json")


def _bin_logits(path):
    ctx = _ctx()
    with pytest.warns(UserWarning, match=r"only pytorch_model\.bin.*whole model \(.* MiB\)"):
        model = from_pretrained(path, ctx, dtype=torch.float32, vocab="parallel")
    with torch.no_grad():
        return model(input_ids=_ids()).logits


def test_bin_only_directory_falls_back_to_the_whole_model_with_a_warning(run_ranks, tiny,
                                                                          tmp_path):
    from safetensors.torch import load_file

    path = tmp_path / "m"
    shutil.copytree(tiny("qwen2"), path)
    torch.save(load_file(path / "model.safetensors"), path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()
    reference = run_ranks(_logits_both, 2, str(tiny("qwen2")), 1)
    for (expected, _), logits in zip(reference, run_ranks(_bin_logits, 2, str(path))):
        assert_rel(logits, expected, what="logits from pytorch_model.bin")


def test_unexpected_key_is_a_warning_when_not_strict(tiny, tmp_path):
    path = _rewrite(tiny("qwen2"), tmp_path / "m",
                    lambda t: t.update({"lm_head.extra": torch.zeros(2)}))
    with pytest.warns(UserWarning, match=r"'lm_head.extra' is not a tensor .* not loaded"):
        model = from_pretrained(path, ParallelContext.single(), strict=False)
    assert "lm_head.extra" not in model.state_dict()


def _logits_warned(path, ep):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reference, logits = _logits_both(path, ep)
    return reference, logits, [str(w.message) for w in caught]


def test_a_conversion_transformers_runs_itself_gives_the_same_logits(run_ranks, tiny,
                                                                     monkeypatch):
    from ops_transformer.loading import keys

    def not_lazy(*args, **kwargs):  # as for an operation the lazy sources do not express
        raise keys._NotLazy

    monkeypatch.setattr(keys, "_apply", not_lazy)  # forked ranks inherit the patch
    for reference, logits, warned in run_ranks(_logits_warned, 2, str(tiny("mixtral")), 2):
        assert_rel(logits, reference, what="Mixtral experts converted by transformers, ep 2")
        assert any("transformers converts it" in w and "experts.gate_up_proj" in w
                   for w in warned), warned


def _two_steps(path, ours):
    """Losses of two SGD steps, and whether the padding of the FFN weights stayed zero."""
    ctx = _ctx()
    if ours:
        model = from_pretrained(path, ctx, dtype=torch.float32)
    else:
        model = parallelize(tr.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                            ctx)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(2):
        loss = model(input_ids=_ids(), labels=_ids()).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    up = model.model.layers[0].mlp.up_proj
    spec = up.weight_spec
    start, n = spec.slices()[0]
    padding = up.weight[max(spec.full_shape[0] - start, 0):]
    return losses, bool((padding == 0).all())


def test_padded_ffn_loaded_on_meta_trains_as_transformers_then_parallelize(run_ranks, tiny):
    path = str(tiny("llama_padded"))  # 130 = 4 · 33 − 2: the last rank holds 2 padding rows
    for (expected, _), (losses, padding_zero) in zip(run_ranks(_two_steps, 4, path, False),
                                                     run_ranks(_two_steps, 4, path, True)):
        assert_rel(torch.tensor(losses), torch.tensor(expected), what="losses, padded FFN")
        assert padding_zero
