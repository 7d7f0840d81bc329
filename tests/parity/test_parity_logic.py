"""The parity check's pure pieces, without a process group: which layout a rank's tensor has and
how it goes back to dense (:mod:`ops_transformer.parity.layout`), which module a failure is blamed
on (:mod:`.attribute`), the difference measures and bounds, and the recorder's order of calls."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ops_transformer.parallel.sharding import ShardSpec
from ops_transformer.parity.attribute import attribute
from ops_transformer.parity.layout import infer_layout
from ops_transformer.parity.noise import NOISE_FACTOR, bound
from ops_transformer.parity.record import ROOT, Recorder
from ops_transformer.parity.tolerance import difference, logits_kl, tolerance_for


def _round_trip(dense: torch.Tensor, tp: int, split_dim: int, **spec_kwargs) -> list:
    """Shard ``dense`` as a layer would, infer each rank's layout from the shapes (and the
    layer's hint), and return the layouts and the unsharded tensor."""
    specs = [ShardSpec(tuple(dense.shape), split_dim, r, tp, **spec_kwargs) for r in range(tp)]
    shards = [s.shard(dense) for s in specs]
    layouts = [infer_layout(tuple(shards[r].shape), tuple(dense.shape), r, tp) for r in range(tp)]
    return layouts, shards


def test_equal_shapes_are_replicated_or_partial_inside_a_reduce_out_region():
    assert infer_layout((2, 8, 64), (2, 8, 64), 0, 2).kind == "replicated"
    assert infer_layout((2, 8, 64), (2, 8, 64), 0, 2, partial_region=True).kind == "partial"
    assert infer_layout((2, 8, 64), (2, 8, 64), 0, 1, partial_region=True).kind == "replicated"


def test_a_column_layers_fused_blocks_come_back_in_dense_order():
    dense = torch.arange(2 * 3 * 96, dtype=torch.float32).view(2, 3, 96)  # Q|K|V of 32 each
    weight = [ShardSpec((96, 64), 0, r, 2, sub_blocks=(32, 32, 32)) for r in range(2)]
    out = [ShardSpec((2, 3, 96), 2, r, 2, sub_blocks=(32, 32, 32)) for r in range(2)]
    shards = [s.shard(dense) for s in out]
    layouts = [infer_layout(tuple(shards[r].shape), (2, 3, 96), r, 2, hint=weight[r])
               for r in range(2)]
    assert [layout.spec.sub_blocks for layout in layouts] == [(32, 32, 32)] * 2
    assert torch.equal(layouts[0].spec.unshard(shards), dense)
    assert "blocks [32, 32, 32]" in layouts[0].describe()
    # without the layer's hint the same shapes read as contiguous blocks: a different order
    plain = infer_layout(tuple(shards[0].shape), (2, 3, 96), 0, 2)
    assert not torch.equal(plain.spec.unshard(shards), dense)


def test_replicated_kv_heads_and_a_padded_vocabulary():
    dense = torch.randn(2, 5, 32)  # 2 KV heads of 16 over tp 4: each held by 2 ranks
    specs = [ShardSpec((2, 5, 32), 2, r, 4, replicas=2) for r in range(4)]
    shards = [s.shard(dense) for s in specs]
    layout = infer_layout(tuple(shards[3].shape), (2, 5, 32), 3, 4)
    assert layout.spec.replicas == 2 and torch.equal(layout.spec.unshard(shards), dense)
    logits = torch.randn(2, 5, 99)  # a vocabulary of 99 padded to 100 over tp 2
    specs = [ShardSpec((2, 5, 99), 2, r, 2, padded_size=100) for r in range(2)]
    shards = [s.shard(logits) for s in specs]
    layout = infer_layout((2, 5, 50), (2, 5, 99), 1, 2)
    assert layout.spec.padded_size == 100 and torch.equal(layout.spec.unshard(shards), logits)


def test_sequence_parallel_shares_and_shapes_that_do_not_map():
    assert infer_layout((2, 4, 64), (2, 8, 64), 0, 2, sequence_parallel=True).kind == "tokens"
    # the same shapes without sequence parallelism: query rows split per batch row (kv_split)
    assert infer_layout((2, 4, 64), (2, 8, 64), 0, 2).kind == "split"
    assert infer_layout((2, 4, 32), (2, 8, 64), 0, 2).kind == "unknown"
    assert infer_layout((2, 3, 64), (2, 8, 64), 0, 2).kind == "unknown"
    assert infer_layout((4, 64), (2, 8, 64), 0, 2).kind == "unknown"


def test_difference_is_relative_to_the_largest_reference_entry():
    ref = torch.tensor([1.0, -4.0, 0.0])
    assert difference(ref + torch.tensor([0.0, 0.0, 0.004]), ref) == pytest.approx((0.004, 1e-3))
    assert difference(ref * 1e-6, ref * 0, floor=0.5)[1] == pytest.approx(8e-6)
    assert difference(torch.tensor([1.0, math.nan, 0.0]), ref)[1] == math.inf
    with pytest.raises(ValueError, match="shape"):
        difference(ref[:2], ref)
    logits = torch.randn(3, 7)
    assert logits_kl(logits, logits) == pytest.approx(0.0, abs=1e-12)
    assert logits_kl(logits + torch.randn(3, 7), logits) > 1e-3


def test_tolerances_and_16_bit_bounds_from_measured_noise():
    assert tolerance_for("fp32").output == 1e-5
    assert tolerance_for("bf16", 1e-3).grad == pytest.approx(1e-3 * tolerance_for("bf16").grad
                                                             / tolerance_for("bf16").output)
    with pytest.raises(ValueError, match="precision must be one of"):
        tolerance_for("int8")
    noise = {("output", "a"): 1e-2, "kl": 1e-6}
    assert bound(noise, ("output", "a"), 2e-2) == NOISE_FACTOR * 1e-2
    assert bound(noise, ("output", "b"), 2e-2) == 2e-2
    assert bound(noise, "kl", 1e-9) == pytest.approx(NOISE_FACTOR ** 2 * 1e-6)


def _row(name, rel=0.0, input_rel=0.0, grad_rel=0.0, grad_order=None, inputs_from=(),
         style=None):
    return {"kind": "module", "name": name, "module": name, "style": style, "max_rel": rel,
            "input_rel": input_rel, "grad_rel": grad_rel, "bound": 1e-5, "input_bound": 1e-5,
            "grad_bound": 1e-4, "grad_order": grad_order, "inputs_from": list(inputs_from),
            "ok": rel <= 1e-5 and grad_rel <= 1e-4}


def test_the_module_whose_inputs_match_is_blamed_for_a_forward_difference():
    rows = [_row("a.q"), _row("a.o", rel=0.3, input_rel=0.2), _row("a", rel=0.3, style="region"),
            _row(ROOT, rel=0.3, input_rel=None)]
    module, style, reason, first = attribute(rows, [], [])
    assert (module, style, first) == ("a", "region", "a.o")
    assert "the input of a.o already differs" in reason
    rows[1]["input_rel"] = 0.0  # its inputs match: the module itself
    assert attribute(rows, [], [])[0] == "a.o"


def test_a_backward_difference_is_blamed_on_the_consumer_whose_backward_made_it():
    rows = [_row("norm", grad_rel=0.5, grad_order=3), _row("attn.q", grad_order=1,
                                                           inputs_from=["norm"]),
            _row("attn", grad_order=0, inputs_from=["norm"]), _row(ROOT, grad_order=None)]
    module, _, reason, first = attribute(rows, [], [])
    assert (module, first) == ("attn.q", "norm")  # the innermost consumer
    assert "by the backward of attn.q" in reason
    params = [{"kind": "parameter", "name": "attn.q.weight", "module": "attn.q", "ok": False,
               "max_rel": 0.1, "bound": 1e-4}]
    rows[0]["grad_rel"] = 0.0  # output gradients all match: the parameter's own gradient
    module, _, reason, _ = attribute(rows, params, [])
    assert module == "attn.q" and "while its output's gradient matches" in reason


def test_errors_and_initial_weights_come_first():
    rows = [_row("x", rel=1.0)]
    error = {"module": "x.y", "style": "colwise", "phase": "forward", "type": "RuntimeError",
             "message": "shapes"}
    assert attribute(rows, [], [], error)[:2] == ("x.y", "colwise")
    weights = [{"name": "x.weight", "module": "x", "ok": False}]
    assert "seed it" in attribute(rows, [], weights)[2]


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.act = nn.Linear(4, 4), nn.Linear(4, 4), nn.Tanh()

    def forward(self, x, fail=False):
        h = self.act(self.a(x))
        if fail:
            return self.b(h[..., :3])
        return checkpoint(lambda t: self.act(self.b(t)), h, use_reentrant=False)


def test_the_recorder_lists_calls_in_finish_order_and_names_the_module_that_raised():
    net = _Net()
    recorder = Recorder(net)
    with recorder.recording():
        out = net(torch.randn(2, 4, requires_grad=True))
    out.sum().backward()  # the checkpoint's replay in backward is not recorded
    assert [c.key for c in recorder.calls] == ["a", "act", "b", "act#2", ROOT]
    assert all(c.grads for c in recorder.calls)
    assert recorder.calls[2].producers == [1]  # b read act's output
    with pytest.raises(RuntimeError), recorder.recording():
        net(torch.randn(2, 4), fail=True)
    assert recorder.innermost == "b"
    recorder.remove()


def test_a_gathered_lm_head_keeps_the_linear_sizes_models_read():
    """Found by ``check --preset hf:apertus1p5_text``: its causal-LM loss reads
    ``lm_head.out_features``, which the vocab-parallel head it became lacked."""
    from ops_transformer import ParallelContext
    from ops_transformer.layers.head import GatheredLMHead

    head = GatheredLMHead.from_dense(nn.Linear(8, 10, bias=False), ParallelContext.single())
    assert (head.in_features, head.out_features) == (8, 10)
