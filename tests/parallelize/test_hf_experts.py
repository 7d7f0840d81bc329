"""Hugging Face's ``moe_tp_experts`` on our MoE layers (parallelize/hf_experts.py): each kind of
``transformers`` experts module — [gate; up] experts, transposed weights (Aria), no gate
(Nemotron-H, ReLU²), a class's own clamped or softcapped gate (DeepSeek-V4, Inkling 2), identity
("zero") experts and their unused rows (LongCat-Flash), every token through every expert (Llama
4) — as an :class:`HFExperts` at tp 2 (tp 4 and ep 2: slow) against the dense module: output,
input gradient, routing-weight gradient, every weight gradient, and the collectives."""

from __future__ import annotations

import os

import pytest
import torch

from helpers import assert_rel
from ops_transformer import CommLedger, gather_full_state_dict, init_parallel

tr = pytest.importorskip("transformers")
tr.logging.set_verbosity_error()
hf_zoo = pytest.importorskip("ops_transformer.testing.zoo")
from ops_transformer.parallelize.hf_experts import HFExperts  # noqa: E402

FAMILIES = {  # model type -> the name of its experts module in the tiny model
    "deepseek_v3": "mlp.experts", "aria_text": "mlp.experts", "nemotron_h": "mixer.experts",
    "deepseek_v4": "mlp.experts", "inkling2_text": "mlp.experts",
    "longcat_flash": "mlp.experts", "llama4_text": "feed_forward.experts",
    "gpt_oss": "mlp.experts", "muse_spark_text": "mlp.experts",
}
TOKENS = 12


def _experts_class(model_type):
    """The family's experts class and its tiny config (the class found on a meta model)."""
    cls, config = hf_zoo.prepare(model_type)
    with torch.device("meta"):
        model = cls(config)
    suffix = FAMILIES[model_type]
    module = next(m for n, m in model.named_modules() if n.endswith(suffix)
                  and any(p.dim() == 3 for p in m.parameters(recurse=False)))
    return type(module), config.get_text_config()


CLASSES = {}


def _dense(model_type):
    cls, config = CLASSES[model_type]
    torch.manual_seed(0)
    module = cls(config)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape) * 0.2)
    return module


def _inputs(module):
    g = torch.Generator().manual_seed(1)
    h = next(p for p in module.parameters() if p.dim() == 3)
    hidden = getattr(module, "hidden_dim", None) or getattr(module, "hidden_size", None) or 64
    if type(module).__name__ == "Llama4TextExperts":  # every token for every expert, weighted
        x = torch.randn(h.shape[0] * TOKENS, hidden, generator=g)
        return (x.requires_grad_(),)
    x = torch.randn(TOKENS, hidden, generator=g).requires_grad_()
    n = getattr(module, "total_experts", None) or h.shape[0]  # identity experts included
    index = torch.stack([torch.randperm(n, generator=g)[:2] for _ in range(TOKENS)])
    weights = torch.rand(TOKENS, 2, generator=g).requires_grad_()
    return x, index, weights


def _run(model_type, tp, ep):
    parallel = int(os.environ["WORLD_SIZE"]) > 1
    ctx = init_parallel(tp=tp, ep=ep) if parallel else init_parallel()
    module = _dense(model_type)
    keys, inputs = list(module.state_dict()), _inputs(module)
    if parallel:
        module = HFExperts.from_dense(module, ctx)
    target = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(2))
    with CommLedger() as ledger:
        out = module(*inputs)
        ((out - target) ** 2).sum().backward()
    params = dict(module.named_parameters())
    data = {n: p.data for n, p in params.items()}
    for p in params.values():  # the gradients, gathered under the dense keys
        p.data = p.grad if p.grad is not None else torch.zeros_like(p)
    grads = gather_full_state_dict(module, ctx) if parallel else module.state_dict()
    for n, p in params.items():
        p.data = data[n]
    return {"out": out.detach(), "grads": {k: grads[k].clone() for k in keys},
            "inputs": [t.grad for t in inputs if t.is_floating_point()],
            "calls": {k: v["calls"] for k, v in ledger.summary().items()}}


def _check(run_ranks, model_type, tp, ep=1):
    if model_type not in CLASSES:
        CLASSES[model_type] = _experts_class(model_type)  # imported before the fork
    ref = run_ranks(_run, 1, model_type, tp, ep)[0]
    for got in run_ranks(_run, tp * ep, model_type, tp, ep):
        assert_rel(got["out"], ref["out"], what=f"{model_type} output")
        for a, b in zip(got["inputs"], ref["inputs"]):
            assert_rel(a, b, what=f"{model_type} input gradient")
        assert set(got["grads"]) == set(ref["grads"])
        for key, g in ref["grads"].items():  # every EP rank routes the same tokens here: the
            # experts see ep copies of them (parallelize divides by ep: scale_expert_grads)
            assert_rel(got["grads"][key], g * ep, what=f"{model_type} gradient of {key}")
        calls = got["calls"]
        # over TP: one all-reduce of the experts' output, one of their input gradient
        assert calls.get("all_reduce", 0) == 2 * (tp > 1), calls
        if ep > 1:  # the expert counts (all-gather), dispatch + combine both ways (all-to-all)
            assert calls.get("all_to_all", 0) == 4, calls


@pytest.mark.parametrize("model_type", [
    "deepseek_v3", "aria_text", "nemotron_h",
    pytest.param("deepseek_v4", marks=pytest.mark.slow), "inkling2_text",
    "longcat_flash", "llama4_text",
    "gpt_oss",  # gate and up rows interleaved (is_concatenated=False), transposed, biased
    "muse_spark_text"])  # a norm after each expert (has_post_expert_norm)
def test_experts_at_tp2_equal_dense(run_ranks, model_type):
    _check(run_ranks, model_type, 2)


@pytest.mark.slow
# (muse_spark_text's post-expert norm is replicated over ep: its per-rank gradient is a partial
# sum that training reduces over dp × ep, so this harness checks it at tp only)
@pytest.mark.parametrize("model_type", ["deepseek_v3", "longcat_flash", "llama4_text", "gpt_oss"])
@pytest.mark.parametrize("tp,ep", [(4, 1), (2, 2), (1, 2)])
def test_experts_over_tp_and_ep_equal_dense(run_ranks, model_type, tp, ep):
    _check(run_ranks, model_type, tp, ep)


def test_untranslated_experts_are_refused():
    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(2, 8, 4))

    with pytest.raises(ValueError, match=r"moe_tp_experts on Experts: its forward follows "
                                         r"neither transformers' experts contract"):
        HFExperts.from_dense(Experts(), init_parallel())


# --- checkpoints: the Hugging Face module's own keys (an export loads in plain transformers) ----

def _save_experts(model_type, tp, ep, root):
    from ops_transformer import save_checkpoint
    ctx = init_parallel(tp=tp, ep=ep)
    save_checkpoint(root, HFExperts.from_dense(_dense(model_type), ctx), None, ctx, 1)


def _load_into_dense(model_type, root):
    from ops_transformer import load_checkpoint
    ctx = init_parallel()
    module = _dense(model_type)
    with torch.no_grad():
        for p in module.parameters():
            p.zero_()
    load_checkpoint(root, module, None, ctx)
    return module.state_dict()


@pytest.mark.parametrize("model_type,tp,ep", [
    ("deepseek_v3", 2, 1),
    ("gpt_oss", 2, 1),  # interleaved rows: whole (gate, up) pairs per TP chunk
    ("muse_spark_text", 2, 1),  # the post-expert norm saved under its dense key
    pytest.param("llama4_text", 1, 2, marks=pytest.mark.slow),  # stored [E, in, out]
    pytest.param("deepseek_v3", 2, 2, marks=pytest.mark.slow),
])
def test_checkpoint_of_hf_experts_loads_into_the_dense_module(run_ranks, tmp_path, model_type,
                                                              tp, ep):
    if model_type not in CLASSES:
        CLASSES[model_type] = _experts_class(model_type)
    run_ranks(_save_experts, tp * ep, model_type, tp, ep, tmp_path)
    got = run_ranks(_load_into_dense, 1, model_type, tmp_path)[0]
    ref = _dense(model_type).state_dict()
    assert set(got) == set(ref)  # gate_up_proj, not experts.gate_up_proj
    for key, value in ref.items():
        assert torch.equal(got[key], value), key
