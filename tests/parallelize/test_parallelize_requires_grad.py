"""``parallelize`` keeps ``requires_grad`` of every parameter it splits or replaces (issue #30
item 10): a layer frozen before ``parallelize`` stays frozen at tp 2 and 4, and gets no gradient."""

from __future__ import annotations

import pytest
import torch

from ops_transformer import GPT, init_parallel, parallelize
from ops_transformer.models import preset


def _frozen(name: str) -> bool:
    return name.startswith(("layers.0.", "tok_emb")) or name.endswith("mlp.w_out.bias")


def _train_frozen(tp: int, preset_name: str):
    ctx = init_parallel(tp=tp)
    torch.manual_seed(0)
    model = GPT(preset(preset_name))
    for name, p in model.named_parameters():
        p.requires_grad_(not _frozen(name))
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    model = parallelize(model, ctx, attention="heads")
    after = {n: p.requires_grad for n, p in model.named_parameters()}
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    model(idx, idx)[1].backward()
    graded = {n for n, p in model.named_parameters() if p.grad is not None}
    return before, after, graded


@pytest.mark.parametrize("tp,preset_name", [(2, "tiny"), (2, "llama-tiny"), (4, "tiny")])
def test_frozen_parameters_stay_frozen(run_ranks, tp, preset_name):
    for before, after, graded in run_ranks(_train_frozen, tp, tp, preset_name):
        assert after == before  # the same names: every split layer keeps its parameter names
        assert graded == {n for n, on in after.items() if on}


def _mixed_experts():
    ctx = init_parallel(tp=1, ep=2)
    torch.manual_seed(0)
    model = GPT(preset("moe-tiny"))
    name = next(n for n, _ in model.named_parameters() if ".experts.0." in n)
    model.get_parameter(name).requires_grad_(False)
    try:
        parallelize(model, ctx)
    except ValueError as exc:
        return str(exc)
    return None


def test_fusing_differently_frozen_parameters_is_an_error(run_ranks):
    message = run_ranks(_mixed_experts, 2)[0]
    assert message is not None and "only some are frozen" in message and "experts.0." in message
