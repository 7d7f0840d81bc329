"""The planner's data layer (ops_transformer.planner.catalogue and .specs): the hardware catalogue,
model specs (parameter counts against the published ones, Hugging Face configs, loading) and
cluster specs. Pure logic: no process group."""

from __future__ import annotations

import json

import pytest
import transformers

from ops_transformer.models import preset
from ops_transformer.planner.catalogue import GPUS, LINKS, GPU, Link, gpu, link
from ops_transformer.planner.specs import MODEL_PRESETS, ClusterSpec, ModelSpec

GPU_NAMES = {"v100", "a100-40gb", "a100-80gb", "h100-sxm", "h100-sxm-96gb", "h100-pcie", "h200", "b200",
             "mi300x"}
LINK_NAMES = {"nvlink2", "nvlink3", "nvlink4", "nvlink5", "pcie4", "pcie5", "infinity-fabric",
              "ib-hdr", "ib-ndr", "loopback"}

# Published parameter counts (papers / model cards) and the tolerance of our formula.
PUBLISHED = {"gpt3-175b": 175e9, "gpt2-124m": 124e6, "llama2-7b": 6.7e9, "llama2-13b": 13e9,
             "llama2-70b": 69e9, "llama3-8b": 8.0e9, "llama3-70b": 70.6e9, "llama3-405b": 405e9,
             "mixtral-8x7b": 46.7e9}
TOLERANCE = 0.03


# --- catalogue ------------------------------------------------------------------------------------

def test_catalogue_names():
    assert set(GPUS) == GPU_NAMES
    assert set(LINKS) == LINK_NAMES


@pytest.mark.parametrize("name", sorted(GPU_NAMES))
def test_gpu_numbers_are_sane(name):
    g = GPUS[name]
    assert g.name == name
    for f in ("bf16_flops", "fp16_flops", "fp32_flops", "memory_bandwidth"):
        assert getattr(g, f) > 0, f
    assert g.bf16_flops >= g.fp32_flops and g.fp16_flops >= g.fp32_flops
    assert 16 * 2**30 <= g.memory_bytes <= 256 * 2**30
    assert 1e12 <= g.memory_bandwidth <= 1e13 or name == "v100"
    assert g.intra_link in LINKS and g.gpus_per_node >= 1
    assert g.vendor in ("nvidia", "amd")


@pytest.mark.parametrize("name", sorted(LINK_NAMES))
def test_link_numbers_are_sane(name):
    ln = LINKS[name]
    assert ln.name == name and ln.bandwidth > 0 and 0 < ln.latency_s < 1e-3


def test_links_order_as_generations():
    bw = {n: ln.bandwidth for n, ln in LINKS.items()}
    assert bw["nvlink2"] < bw["nvlink3"] < bw["nvlink4"] < bw["nvlink5"]
    assert bw["pcie4"] < bw["pcie5"] < bw["nvlink3"]
    assert bw["ib-hdr"] < bw["ib-ndr"] < bw["nvlink4"]
    assert bw["loopback"] < bw["pcie4"]


def test_dense_peaks_not_sparse():
    assert GPUS["a100-80gb"].bf16_flops == 312e12
    assert GPUS["h100-sxm"].bf16_flops == pytest.approx(989.5e12)


@pytest.mark.parametrize("spelling", ["A100-80GB", "a100_80gb", " a100-80gb "])
def test_gpu_lookup_is_forgiving(spelling):
    assert gpu(spelling) is GPUS["a100-80gb"]


def test_link_lookup_is_forgiving():
    assert link("IB_NDR") is LINKS["ib-ndr"]
    assert link("Infinity_Fabric") is LINKS["infinity-fabric"]


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(ValueError, match="unknown GPU 'tpu-v5'.*a100-40gb.*mi300x"):
        gpu("tpu-v5")
    with pytest.raises(ValueError, match="unknown link 'nvlink9'.*ib-hdr.*pcie5"):
        link("nvlink9")


# --- model specs: presets and counts --------------------------------------------------------------

def test_model_preset_names():
    assert set(MODEL_PRESETS) == set(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_params_match_published_counts(name):
    spec = MODEL_PRESETS[name]
    assert spec.name == name
    assert spec.params() == pytest.approx(PUBLISHED[name], rel=TOLERANCE)


def test_exact_counts_of_released_checkpoints():
    # The Hugging Face checkpoints have no biases: the formula is exact there.
    assert MODEL_PRESETS["llama2-7b"].params() == 6_738_415_616
    assert MODEL_PRESETS["llama3-8b"].params() == 8_030_261_248
    assert MODEL_PRESETS["mixtral-8x7b"].params() == 46_702_792_704


def test_moe_active_params():
    mixtral = MODEL_PRESETS["mixtral-8x7b"]
    assert mixtral.active_params() == pytest.approx(12.9e9, rel=TOLERANCE)
    dense = MODEL_PRESETS["llama3-8b"]
    assert dense.active_params() == dense.params()


def test_params_by_hand():
    spec = ModelSpec("t", layers=2, hidden=8, heads=2, kv_heads=1, ffn=16, ffn_type="swiglu",
                     vocab=10, seq=4, global_batch=2, experts=4, top_k=2)
    kv_dim = 4
    layer = 8 * (8 + 2 * kv_dim) + 8 * 8 + 4 * 3 * 8 * 16 + 8 * 4 + 2 * 8
    assert spec.params() == 10 * 8 + 2 * layer + 8 + 10 * 8
    active_layer = layer - 2 * 3 * 8 * 16
    assert spec.active_params() == 10 * 8 + 2 * active_layer + 8 + 10 * 8
    assert spec.with_(tie_embeddings=True).params() == spec.params() - 10 * 8


def test_flops_per_token_matches_narayanan():
    # Narayanan et al. 2021 without recomputation, per token: 72lh² + 12lhs + 6Vh.
    spec = MODEL_PRESETS["gpt3-175b"]
    l, h, s, v = spec.layers, spec.hidden, spec.seq, spec.vocab
    assert spec.flops_per_token() == pytest.approx(72 * l * h * h + 12 * l * h * s + 6 * v * h,
                                                   rel=1e-4)
    # Untied head: the embedding lookup is not a matmul.
    llama = MODEL_PRESETS["llama2-7b"]
    assert llama.flops_per_token() == pytest.approx(
        6 * (llama.params() - llama.vocab * llama.hidden) + 12 * 32 * 4096 * 4096)


def test_bytes_per_element():
    spec = MODEL_PRESETS["gpt2-124m"]
    assert spec.bytes_per_element() == 2
    assert spec.with_(dtype="fp32").bytes_per_element() == 4


@pytest.mark.parametrize("change, message", [
    ({"layers": 0}, r"layers must be a positive integer, got 0"),
    ({"hidden": 100}, r"hidden \(100\) must be divisible by heads \(12\)"),
    ({"kv_heads": 5}, r"heads \(12\) must be divisible by kv_heads \(5\)"),
    ({"ffn_type": "relu"}, r"ffn_type must be one of .*'relu'"),
    ({"dtype": "int8"}, r"dtype must be one of .*'int8'"),
    ({"top_k": 2}, r"top_k \(2\) must be at most experts \(1\)"),
    ({"micro_batch": 3}, r"global_batch \(512\) must be a multiple of micro_batch \(3\)"),
    ({"seq": 1.5}, r"seq must be a positive integer, got 1.5"),
])
def test_model_spec_validation(change, message):
    with pytest.raises(ValueError, match=message):
        MODEL_PRESETS["gpt2-124m"].with_(**change)


def test_model_spec_json_round_trip():
    for spec in MODEL_PRESETS.values():
        assert ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    with pytest.raises(ValueError, match="unknown ModelSpec fields.*'depth'"):
        ModelSpec.from_dict({**MODEL_PRESETS["gpt2-124m"].to_dict(), "depth": 3})


# --- model specs from configs ---------------------------------------------------------------------

def test_from_gpt_config():
    cfg = preset("llama-tiny")
    spec = ModelSpec.from_gpt_config(cfg)
    assert (spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.ffn) == (2, 64, 4, 2, 176)
    assert spec.ffn_type == "swiglu" and spec.seq == 128 and spec.dtype == "fp32"
    assert spec.global_batch == 8 and not spec.tie_embeddings
    assert ModelSpec.from_gpt_config(preset("tiny"), seq=16).seq == 16


def test_from_gpt_config_counts_the_reference_model():
    from ops_transformer import GPT

    for name in ("llama-tiny", "tiny"):
        cfg = preset(name, bias=False)
        model_params = sum(p.numel() for p in GPT(cfg).parameters())
        spec = ModelSpec.from_gpt_config(cfg)
        # Learned positions are the only parameters the spec leaves out.
        positions = cfg.max_seq_len * cfg.d_model if cfg.pos == "learned" else 0
        assert spec.params() == model_params - positions


def test_from_hf_gpt2():
    cfg = transformers.GPT2Config(n_embd=64, n_layer=3, n_head=4, vocab_size=100, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    spec = ModelSpec.from_hf_config(cfg)
    assert (spec.layers, spec.hidden, spec.heads, spec.kv_heads) == (3, 64, 4, 4)
    assert spec.ffn == 256 and spec.ffn_type == "gelu" and spec.seq == 32
    assert spec.tie_embeddings and spec.dtype == "bf16" and spec.name == "gpt2"
    wide = transformers.GPT2Config(n_embd=64, n_head=4, n_inner=100)
    assert ModelSpec.from_hf_config(wide).ffn == 100


def test_from_hf_llama_counts_the_model():
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, vocab_size=128,
                                   max_position_embeddings=64)
    spec = ModelSpec.from_hf_config(cfg, seq=16, global_batch=4, micro_batch=2)
    assert (spec.kv_heads, spec.ffn, spec.ffn_type, spec.seq) == (2, 96, "swiglu", 16)
    assert (spec.global_batch, spec.micro_batch, spec.experts) == (4, 2, 1)
    model = transformers.LlamaForCausalLM(cfg)
    assert spec.params() == sum(p.numel() for p in model.parameters())


def test_from_hf_mixtral_counts_the_model():
    cfg = transformers.MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                     num_local_experts=4, num_experts_per_tok=2)
    spec = ModelSpec.from_hf_config(cfg, seq=8)
    assert (spec.experts, spec.top_k, spec.ffn_type) == (4, 2, "swiglu")
    model = transformers.MixtralForCausalLM(cfg)
    assert spec.params() == sum(p.numel() for p in model.parameters())


def test_from_hf_bert():
    cfg = transformers.BertConfig(hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=192, vocab_size=100)
    spec = ModelSpec.from_hf_config(cfg)
    assert (spec.ffn, spec.ffn_type, spec.kv_heads, spec.seq) == (192, "gelu", 4, 512)


def test_from_hf_config_names_missing_fields():
    with pytest.raises(ValueError, match=r"has none of \('hidden_size', 'n_embd', 'd_model'\)"):
        ModelSpec.from_hf_config(transformers.PretrainedConfig())


# --- ModelSpec.load -------------------------------------------------------------------------------

def test_load_presets():
    assert ModelSpec.load("llama3-8b") is MODEL_PRESETS["llama3-8b"]
    assert ModelSpec.load("llama3-8b", seq=2048).seq == 2048
    tiny = ModelSpec.load("llama-tiny")  # a reference-model preset
    assert tiny == ModelSpec.from_gpt_config(preset("llama-tiny"), name="llama-tiny")


def test_load_hf_directory(tmp_path):
    transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=8, num_key_value_heads=2,
                             vocab_size=128).save_pretrained(tmp_path / "tiny-llama")
    spec = ModelSpec.load(tmp_path / "tiny-llama", seq=32)
    assert (spec.name, spec.hidden, spec.kv_heads, spec.ffn_type, spec.seq) == \
        ("tiny-llama", 64, 2, "swiglu", 32)


def test_load_json_files(tmp_path):
    gpt = tmp_path / "mine.json"
    gpt.write_text(json.dumps({"n_layers": 3, "d_model": 32, "n_heads": 4, "d_ff": 64,
                               "mlp": "swiglu"}))
    spec = ModelSpec.load(gpt)
    assert (spec.name, spec.layers, spec.hidden, spec.ffn_type) == ("mine", 3, 32, "swiglu")

    ours = tmp_path / "spec.json"
    ours.write_text(json.dumps(MODEL_PRESETS["mixtral-8x7b"].to_dict()))
    assert ModelSpec.load(str(ours)) == MODEL_PRESETS["mixtral-8x7b"]

    hf = tmp_path / "gpt2.json"
    hf.write_text(transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4).to_json_string())
    assert ModelSpec.load(hf).hidden == 64


def test_load_errors(tmp_path):
    with pytest.raises(ValueError, match=r"'nope' is not a model preset \(gpt2-124m.*a JSON file"):
        ModelSpec.load("nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        ModelSpec.load(tmp_path / "empty")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a readable JSON file"):
        ModelSpec.load(bad)
    bad.write_text(json.dumps({"depth": 3}))
    with pytest.raises(ValueError, match=r"unknown keys \['depth'\]"):
        ModelSpec.load(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        ModelSpec.load(bad)


# --- cluster specs --------------------------------------------------------------------------------

def test_cluster_make_defaults():
    c = ClusterSpec.make("H100_SXM", 16)
    assert c.gpu is GPUS["h100-sxm"] and c.gpus_per_node == 8 and c.nodes == 2
    assert c.intra_link is LINKS["nvlink4"] and c.inter_link is LINKS["ib-ndr"]
    assert ClusterSpec.make("mi300x", 8).intra_link is LINKS["infinity-fabric"]
    small = ClusterSpec.make("a100-80gb", 4, inter=None)
    assert (small.nodes, small.gpus_in_node, small.inter_link) == (1, 4, None)
    custom = ClusterSpec.make("h100-pcie", 8, gpus_per_node=4, intra="pcie5", inter="ib-hdr")
    assert (custom.nodes, custom.intra_link.name, custom.inter_link.name) == (2, "pcie5", "ib-hdr")
    assert "16× h100-sxm" in str(c)


def test_cluster_errors():
    with pytest.raises(ValueError, match="count must be a positive integer, got 0"):
        ClusterSpec.make("a100-80gb", 0)
    with pytest.raises(ValueError, match="gpus_per_node must be a positive integer, got 0"):
        ClusterSpec.make("a100-80gb", 8, gpus_per_node=0)
    with pytest.raises(ValueError, match=r"count \(12\) must be a multiple of gpus_per_node \(8\)"):
        ClusterSpec.make("a100-80gb", 12)
    with pytest.raises(ValueError, match=r"count \(16\) spans 2 nodes of 8: give an inter_link"):
        ClusterSpec.make("a100-80gb", 16, inter=None)
    with pytest.raises(ValueError, match="unknown GPU 'a100'"):
        ClusterSpec.make("a100", 8)
    with pytest.raises(ValueError, match="unknown link 'nvlink9'"):
        ClusterSpec.make("a100-80gb", 8, intra="nvlink9")
    with pytest.raises(ValueError, match="ClusterSpec.make takes names"):
        ClusterSpec("a100-80gb", 8, 8, LINKS["nvlink3"], None)


def test_cluster_json_round_trip():
    for c in (ClusterSpec.make("b200", 64), ClusterSpec.make("v100", 2, inter=None)):
        d = json.loads(json.dumps(c.to_dict()))
        assert d["gpu"]["name"] == c.gpu.name
        assert ClusterSpec.from_dict(d) == c
    assert isinstance(GPU(**GPUS["h200"].to_dict()), GPU)
    assert isinstance(Link(**LINKS["loopback"].to_dict()), Link)


@pytest.mark.parametrize("text,needle", [
    ('{"model_type": "llama", "hidden_size": ', "is not a readable JSON config"),
    ('{"model_type": "no_such_family"}', "is not a valid model config"),
    ('{"model_type": "llama", "hidden_size": "abc"}', "'hidden_size'"),
    ("[1, 2]", "is not a valid model config"),
])
def test_plan_with_a_corrupt_config_json_is_one_line(tmp_path, capsys, text, needle):
    """Issue #30 item 7: `plan --model DIR` printed a 40-54-line traceback (rc 1) for these."""
    from ops_transformer.cli.main import main

    (tmp_path / "config.json").write_text(text)
    assert main(["plan", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "config.json" in lines[0] and needle in lines[0]
