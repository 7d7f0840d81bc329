"""The Hugging Face model zoo: a tiny random model of every family that ships a tensor-parallel
plan, and the check that ``parallelize`` computes exactly what the unsharded model computes.

``zoo_families()`` lists every model type of the installed ``transformers`` whose config carries a
``base_model_tp_plan``; :func:`tiny_config` shrinks its default config (hidden 64, 2 layers — one
per distinct layer type when the family mixes them —, 4 heads, 2 KV heads, vocabulary 99 so it
is padded at tp 2); :func:`check_family`, run on every rank of a job, builds the model from one
seed, runs it unsharded (forward, a mean-square loss, one SGD step) and parallelised the same way,
and returns the relative errors of the outputs (logits, or the last hidden states of a base model)
and of the gathered weights after the step. ``tools/hf_zoo.py`` runs it per family and writes the
coverage table of ``docs/huggingface.md``; ``tests/testing/test_hf_zoo.py`` runs it in forked ranks.
"""

from __future__ import annotations

import copy
import inspect

import torch

from ..parallel.sharding import gather_full_state_dict
from ..parallelize import parallelize
from ..parallelize.hf_plans import has_family_plan
from ..parallelize.hf_translate import check_styles, hf_tp_plan

SMALL = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=99, max_position_embeddings=128,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=16, rotary_dim=8,
    # mixture of experts
    moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
    n_routed_experts=4, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    num_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
    router_jitter_noise=0.0, num_nextn_predict_layers=0,
    # multi-head latent attention (MLA)
    q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    qk_head_dim=16,
    # linear attention
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16,
)
FAMILY = {  # what a family needs beyond SMALL (checked with transformers 5.24)
    # DSA indexer; MLA expands its keys to every head (no GQA: as many KV heads as heads)
    **dict.fromkeys(["axk2", "deepseek_v32", "glm_moe_dsa", "mistral_large4_text"],
                    {"index_head_dim": 16, "index_n_heads": 4, "index_topk": 8,
                     "num_key_value_heads": 4}),
    "neomme": {"embedding_rank": 16, "embedding_dim": 32},
    # M-RoPE sections must sum to head_dim / 2 = 8
    # half the head rotates (partial_rotary_factor 0.5): sections sum to 4
    "glm4v_moe_text": {"head_dim": 16, "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
        "partial_rotary_factor": 0.5}},
    **dict.fromkeys(["glm4v_text", "glm_image_text", "glm_ocr_text",
                     "qwen2_vl_text", "qwen2_5_vl_text", "hunyuan_vl_text"],
                    {"head_dim": 16, "rope_parameters": {"rope_type": "default",
                                                         "rope_theta": 10000.0,
                                                         "mrope_section": [2, 3, 3]}}),
    "cohere_compass_text": {"rope_parameters": {"full_attention": {
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}},
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
                       "indexer_budget": 8, "indexer_compress_ratio": 2, "hc_lowrank": 16,
                       "ple_embed_dim": 16},
    # MoE layers in the tiny model too (the defaults keep the first layers, or all, dense)
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "flint": {"mlp_only_layers": [0]},
    # one layer holds two attention + MLP sublayers; 2 identity ("zero") experts beside 4 routed
    "longcat_flash": {"num_layers": 1, "zero_expert_num": 2},
    # their configs want as many KV heads as query heads
    # its sliding-window layers take their own sizes (swa_*)
    "dots3_note_text": {"num_key_value_heads": 4, "index_topk": 8, "index_head_dim": 16,
                        "index_n_heads": 4, "shared_experts_intermediate_size": 32,
                        **{f"swa_{k}": v for k, v in dict(
                            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                            kv_lora_rank=32, head_dim=16, qk_nope_head_dim=8,
                            v_head_dim=16).items()}},
    # DSA attention without RoPE; linear-attention layers of 4 heads
    "glm5_next_text": {"num_key_value_heads": 4, "qk_rope_head_dim": 0, "qk_nope_head_dim": 16,
                       "index_topk": 8, "index_kpool": 2, "index_head_dim": 16,
                       "index_n_heads": 4, "linear_head_dim": 16, "linear_num_heads": 4},
    "cosmos3_edge_text": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                              "mrope_section": [2, 3, 3]}},
    "hy_v4_vl_text": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 1, 1]}},
    "esmc": {"num_key_value_heads": 4},
    "dory": {"layer_types": None, "num_hidden_layers": 4, "n_input_layers": 1,
             "n_output_layers": 1},
    "gemma3n_text": {"num_kv_shared_layers": 0, "vocab_size_per_layer_input": 99,
                     "hidden_size_per_layer_input": 16},
    "gemma4_text": {"vocab_size_per_layer_input": 99, "hidden_size_per_layer_input": 16,
                    "enable_moe_block": True, "top_k_experts": 2, "moe_intermediate_size": 32},
    # its global layers differ (wider heads, fewer KV heads): one of each kind, KV heads divisible
    "embedding_gemma2_text": {"hidden_size_per_layer_input": 16, "embedding_dim": 64,
                              "per_layer_config": {"01": {"head_dim": 32,
                                                          "num_key_value_heads": 2}}},
    "muse_spark_text": {"moe_hidden_size": 32},
    **dict.fromkeys(["inkling2_text", "inkling2_loop_text"], {"unpadded_vocab_size": 99}),
    "phi4_multimodal": {
        "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                          "num_attention_heads": 2},
        "audio_config": {"hidden_size": 32, "intermediate_size": 64, "num_blocks": 1,
                         "num_attention_heads": 2}},
}
MAX_PARAMETERS = 3_000_000  # a tiny model; a larger one means SMALL missed a size
# fp32 relative errors a family must stay within. Gradients get 1e-4: through the tiny random
# models' softcapped, rescaled logits fp32 summation order alone moves them by up to ~2e-5
# (gemma4_unified_text; exact to ~1e-15 in float64), while a partial gradient is off by O(1).
TOLERANCE = {"output": 1e-5, "weights": 1e-5, "grads": 1e-4}
LR = 0.1


def zoo_families() -> dict[str, str | None]:
    """Every model type whose config carries a ``base_model_tp_plan``: ``None`` for those the zoo
    checks (a causal-LM or base-model class taking ``input_ids``), else why it does not."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    out = {}
    for model_type in sorted(CONFIG_MAPPING.keys()):
        try:
            config = CONFIG_MAPPING[model_type]()
        except Exception:  # a config that cannot be built with its defaults
            continue
        if getattr(config, "base_model_tp_plan", None):
            out[model_type] = not_applicable(model_type, config)
    return out


def not_applicable(model_type: str, config) -> str | None:
    name = model_class_name(model_type)
    if name is None:
        return "no causal-LM or base-model class"
    text = getattr(config, "text_config", None)
    if text is not None:
        return (f"a multimodal wrapper; its text model is the "
                f"`{getattr(text, 'model_type', '?')}` family")
    try:
        cls = model_class(model_type)
    except LookupError as exc:
        return str(exc)
    if "input_ids" not in inspect.signature(cls.forward).parameters:
        return f"`{cls.__name__}` takes no `input_ids` (not a text model)"
    return None


def model_class_name(model_type: str) -> str | None:
    from transformers.models.auto import modeling_auto as auto

    return (auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
            or auto.MODEL_MAPPING_NAMES.get(model_type))


def model_class(model_type: str):
    import transformers

    name = model_class_name(model_type)
    cls = getattr(transformers, name, None) if name else None
    if cls is None:
        raise LookupError(f"{model_type}: transformers exports no class {name!r}")
    return cls


def tiny_config(model_type: str):
    """The family's default config, shrunk (only the sizes its default config has)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default = cls().to_dict()
    alias = getattr(cls, "attribute_map", {}) or {}
    kw = {alias.get(k, k): v for k, v in SMALL.items() if alias.get(k, k) in default}
    for key, value in default.items():
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            kw[key] = 0.0  # training must be deterministic to compare with dense
    for key in ("layer_types", "mlp_layer_types"):  # one layer of each kind the family mixes
        kinds = list(dict.fromkeys(default.get(key) or []))
        if kinds:
            n = max(2, len(kinds))
            kw[key] = (kinds * n)[:n]
            kw["num_hidden_layers"] = max(n, kw.get("num_hidden_layers", 2))
    if "qk_rope_head_dim" in default and "head_dim" in kw:  # MLA: head_dim is the rope part
        partial = (default.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
        kw["head_dim"] = int(SMALL["qk_rope_head_dim"] / partial)
    kw.update(copy.deepcopy(FAMILY.get(model_type, {})))  # a config may edit the dicts it gets
    return cls(**kw)


def _output(out) -> torch.Tensor:
    for name in ("logits", "last_hidden_state"):
        value = getattr(out, name, None)
        if isinstance(value, torch.Tensor):
            return value
    return out[0]


def _step(model, ids, ctx=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward, loss, backward, one SGD step: ``(output, dense gradients by state-dict key)``
    (gathered over ``ctx``'s TP group when the model is parallelised). The loss is the
    mean-square distance to a fixed random target: unlike the output's own mean square, which a
    final RMSNorm makes nearly constant, its gradient is not rounding noise."""
    model.train()
    out = _output(model(input_ids=ids, use_cache=False))
    target = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.device)
    (out.float() - target).square().mean().backward()
    grads = _gradients(model, ctx)
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return out.detach(), grads


@torch.no_grad()
def _gradients(model, ctx) -> dict[str, torch.Tensor]:
    """The gradients under the dense model's state-dict keys: each parameter briefly holds its
    gradient while ``gather_full_state_dict`` (which knows every layer's sharding and renaming)
    gathers it."""
    params = dict(model.named_parameters())
    data = {name: p.data for name, p in params.items()}
    try:
        for p in params.values():
            p.data = p.grad if p.grad is not None else torch.zeros_like(p)
        if ctx is None:
            full = {k: v.detach().clone() for k, v in model.state_dict().items()}
        else:
            full = gather_full_state_dict(model, ctx)
    finally:
        for name, p in params.items():
            p.data = data[name]
    return {k: v for k, v in full.items() if v.is_floating_point()}


def prepare(model_type: str):
    """``(model class, tiny config)``, after every check that needs no weights: the family's plan
    styles (a style we lack fails here) and the tiny model's size. Call it in the parent before
    forking ranks: the family's code is then imported once."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = model_class(model_type)
    translated = not has_family_plan(model_type)
    if translated:  # the styles first: a family waiting for a feature says so even where its
        # tiny config cannot be built yet (the default config's plan, the class's head rules)
        styles = {**(CONFIG_MAPPING[model_type]().base_model_tp_plan or {}),
                  **(getattr(cls, "_tp_plan", None) or {})}
        check_styles(styles, model_type)
    config = tiny_config(model_type)
    with torch.device("meta"):
        meta = cls(config)
    if translated:
        check_styles(hf_tp_plan(meta), model_type)
    n = sum(p.numel() for p in meta.parameters())
    if n > MAX_PARAMETERS:
        raise ValueError(f"the tiny {model_type} still has {n} parameters: a size it needs is "
                         f"missing from SMALL/FAMILY")
    return cls, config


def build(model_type: str, dtype=torch.float32):
    """The tiny model (same weights on every rank: one seed)."""
    cls, config = prepare(model_type)
    torch.manual_seed(0)
    model = cls(config).to(dtype)
    # Zero-initialised parameters (output projections, gates) would make whole layers identities
    # and the comparison vacuous: draw them at the config's initializer scale instead.
    scale = getattr(config.get_text_config(), "initializer_range", 0.02)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and not p.any():
                p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * scale)
    return model


def check_family(model_type: str, ctx, **parallelize_options) -> dict[str, float]:
    """On every rank: the relative errors of the parallelised model against the unsharded one —
    ``output`` (logits or last hidden states, relative to their largest value), ``grads`` (each
    parameter's gathered gradient, relative to its largest entry or to 0.1% of the largest
    gradient of the model, whichever is larger) and ``weights`` (each gathered parameter after
    one SGD step, relative to its largest entry); and ``split``, the number of plan rules beyond
    the embedding and LM head (0: the family's plan splits nothing else)."""
    model = build(model_type).to(ctx.device)  # drawn on the CPU: the same weights anywhere
    dense = copy.deepcopy(model)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (2, 10), generator=torch.Generator().manual_seed(1))
    ids = ids.to(ctx.device)
    ref_out, ref_grads = _step(dense, ids)
    parallelize(model, ctx, **parallelize_options)
    split = sum(r["style"] not in ("vocab", "vocab_logits")
                for r in model.parallel_plan.rules.values())
    out, grads = _step(model, ids, ctx)
    full = gather_full_state_dict(model, ctx)
    buffers = {name for name, _ in dense.named_buffers()}
    ref_grads = {k: g for k, g in ref_grads.items() if k not in buffers}
    if not set(ref_grads) <= set(grads):
        raise AssertionError(f"no gathered gradient for {sorted(set(ref_grads) - set(grads))}")
    scale = 1e-2 * max(float(g.abs().max()) for g in ref_grads.values())
    errors = {"split": split, "output": _rel(out, ref_out),
              "grads": max((_rel(grads[k], g, scale) for k, g in ref_grads.items()), default=0),
              "weights": 0.0}
    weights = {k: v for k, v in dense.state_dict().items() if v.is_floating_point()}
    floor = 1e-2 * max(float(v.abs().max()) for v in weights.values())
    for name, value in weights.items():
        errors["weights"] = max(errors["weights"], _rel(full[name], value, floor))
    return errors


def _rel(actual: torch.Tensor, expected: torch.Tensor, floor: float = 1e-12) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    scale = expected.abs().max().clamp_min(max(floor, 1e-12))
    return float((actual - expected).abs().max() / scale)


def status(exc: BaseException | None, errors: dict | None = None) -> str:
    """The coverage table's word for a family's outcome."""
    if exc is None:
        over = [f"{k} error {errors[k]:.1e}" for k, tol in TOLERANCE.items() if errors[k] > tol]
        return f"fails: {', '.join(over)}" if over else "works"
    message = str(exc).split("\n")[0]
    return f"fails: {type(exc).__name__}: {message}"
