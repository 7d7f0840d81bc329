"""One-device dropout for Hugging Face decoders (issue 33 item 5, SPEC F7): with dropout above 0
a tiny Llama (attention-probability dropout) and GPT-2 (its embedding, attention and residual
dropout too) at tp 2 — with and without sequence parallelism — train with tp 1's masks: losses
and every gradient equal over 3 steps (fp32, 1e-5 relative); the attention function is the
model's own when dropout is 0 or in eval mode."""

from __future__ import annotations

import pytest
import torch

import hf_tiny
from helpers import assert_rel, local_part, rel_err
from ops_transformer import init_parallel, parallelize
from ops_transformer.parallelize.dropout import set_hf_dropout

pytest.importorskip("transformers")
B, T, P = 4, 16, 0.1


def _train(family, tp, steps=3, ref_grads=None, **options):
    torch.set_num_threads(1)
    ctx = init_parallel(tp=tp)
    model = hf_tiny.build(family).float()
    assert set_hf_dropout(model, P) > 0
    model = parallelize(model, ctx, overlap="none", **options).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    losses, grads = [], []
    for step in range(steps):
        ids = torch.randint(0, hf_tiny.VOCAB, (B, T), generator=g)
        torch.manual_seed(100 + step)  # the stream the sites draw their seeds from
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        if ref_grads is None:  # GPT-2's Conv1D weights are (in, out): as (out, in), like tp 2's
            conv = {f"{m}.weight" for m, mod in model.named_modules()
                    if type(mod).__name__ == "Conv1D"}
            grads.append({n: p.grad.t().clone() if n in conv else p.grad.clone()
                          for n, p in model.named_parameters()})
        else:  # this rank's gradients against its part of tp 1's, each step
            for n, p in model.named_parameters():
                grads.append(((step, n), rel_err(p.grad, local_part(p, ref_grads[step][n]),
                                                 floor=0.02)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return torch.stack(losses), (grads if ref_grads is None else dict(grads))


CASES = [("llama", {}), ("llama", {"sequence_parallel": True}), ("gpt2", {}),
         ("gpt2", {"sequence_parallel": True})]


QUICK = (("llama", {}), ("gpt2", {"sequence_parallel": True}))  # the others in the slow set


@pytest.mark.parametrize("family,options", [
    pytest.param(*c, id=f"{c[0]}-{'sp' if c[1] else 'tp'}",
                 marks=() if c in QUICK else pytest.mark.slow) for c in CASES])
def test_hf_dropout_at_tp2_equals_tp1(run_ranks, family, options):
    (ref_losses, ref_grads), = run_ranks(_train, 1, family, 1)
    for rank, (losses, errors) in enumerate(run_ranks(_train, 2, family, 2, ref_grads=ref_grads,
                                                      **options)):
        assert_rel(losses, ref_losses, 1e-5, what=f"{family} rank {rank} losses")
        assert errors and max(errors.values()) <= 1e-5, \
            f"{family} rank {rank}: {max(errors, key=errors.get)} {max(errors.values()):.1e}"


def test_eval_mode_and_zero_dropout_run_the_models_own_attention():
    """In eval mode (or with dropout 0) the attention function is the model's own: the logits of
    the parallelised tp 1 model equal the unparallelised model's bit for bit."""
    from ops_transformer.parallel.context import ParallelContext

    dense = hf_tiny.build("llama").float()
    set_hf_dropout(dense, P)
    model = hf_tiny.build("llama").float()
    set_hf_dropout(model, P)
    model = parallelize(model, ParallelContext.single(torch.device("cpu")), overlap="none")
    assert model.config._attn_implementation == "ops_transformer_dropout_sdpa"
    ids = torch.randint(0, hf_tiny.VOCAB, (2, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=ids).logits, dense.eval()(input_ids=ids).logits)


def test_bad_dropout_is_one_clear_error():
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got 1.5"):
        set_hf_dropout(hf_tiny.build("llama"), 1.5)


def test_pipeline_of_a_hugging_face_model_with_dropout_is_refused():
    from ops_transformer.training.loop import TrainConfig, validate

    cfg = TrainConfig(model="/nonexistent", pp=2, dropout=0.1, batch=4, seq=16)
    with pytest.raises(ValueError, match="--pp 2 does not split a Hugging Face model") as err:
        validate(cfg, 2)
    assert "\n" not in str(err.value)
