"""``diagnose``'s ``implicit_broadcast`` (SPEC F12, issue 29 item 3): a statistic of this rank's
slice broadcast back over a dimension the plan shards is found, with the module, both shapes and
the fix, on planted modules; the reference GPT and the Hugging Face zoo's families are silent."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ops_transformer import GPT, init_parallel, parallelize, reduce_from_tp_region
from ops_transformer.models.gpt import MLP, preset
from ops_transformer.profiler.broadcasts import implicit_broadcasts
from ops_transformer.profiler.diagnose import CODES, diagnose
from ops_transformer.profiler.shards import remap

B, S = 2, 16
SLOW = pytest.mark.slow


# ---------------------------------------------------------------- planted modules

class LocalRMS(MLP):
    """An FFN that normalises its hidden activation per token: on one device over all d_ff
    features; inside the TP region only over this rank's d_ff/tp."""

    def forward(self, x):
        h = self.w_in(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.w_out(F.gelu(h))


class GlobalRMS(MLP):
    """The fix: the sum of squares reduced over the TP group before it is broadcast."""

    group = None

    def forward(self, x):
        h = self.w_in(x)
        squares = reduce_from_tp_region(h.pow(2).sum(-1, keepdim=True), self.group)
        return self.w_out(F.gelu(h * torch.rsqrt(squares / (h.shape[-1] * 2) + 1e-6)))


class LocalLayerNorm(MLP):
    def forward(self, x):
        h = self.w_in(x)
        return self.w_out(F.gelu(F.layer_norm(h, h.shape[-1:])))


class LocalNormalize(MLP):
    def forward(self, x):
        return self.w_out(F.gelu(F.normalize(self.w_in(x), dim=-1)))


class LocalNormDivision(MLP):
    """The same as an explicit division by the norm, expanded first."""

    def forward(self, x):
        h = self.w_in(x)
        return self.w_out(F.gelu(h / h.norm(2, -1, True).clamp_min(1e-6).expand_as(h)))


class LocalMaxShift(MLP):
    def forward(self, x):
        h = self.w_in(x)
        return self.w_out(F.gelu(h - h.max(dim=-1, keepdim=True).values))


class LocalSoftmax(MLP):
    def forward(self, x):
        return self.w_out(torch.softmax(self.w_in(x), dim=-1))


class TokenCentering(torch.nn.Module):
    """In place of the residual dropout: subtracts the mean over the sequence (dim 1) — which
    sequence parallelism shards."""

    def forward(self, x):
        return x - x.mean(1, keepdim=True)


def _findings(tp, planted=None, sp=False, name="tiny", attention="auto", centering=False):
    ctx = init_parallel(tp=tp)
    torch.manual_seed(0)
    model = GPT(preset(name))
    for block in model.layers:
        if planted is not None:
            block.mlp.__class__ = planted
            block.mlp.group = ctx.tp_group
        if centering:
            block.drop = TokenCentering()
    parallelize(model, ctx, sequence_parallel=sp, attention=attention)
    idx = torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(1))

    def step():
        model(idx, idx)[1].backward()

    return implicit_broadcasts(model, ctx, step)


def test_found_on_a_planted_local_statistic(run_ranks):
    for rank in run_ranks(_findings, 2, 2, LocalRMS):
        (d,) = rank  # both layers: one finding
        assert d["code"] == "implicit_broadcast" and d["severity"] == "error"
        assert d["where"] == "layers.0.mlp, layers.1.mlp"
        assert "(2, 16, 128)" in d["message"] and "(2, 16, 1)" in d["message"]  # both shapes
        assert "dim 2" in d["message"] and "128 of 256" in d["message"]
        assert "reduce_from_tp_region" in d["suggestion"] and "layers.*.mlp" in d["suggestion"]


def test_fused_norm_and_softmax_over_a_sharded_dimension(run_ranks):
    (norm,) = run_ranks(_findings, 2, 2, LocalLayerNorm)[0]
    assert norm["message"].startswith("layer_norm over dim 2 of a tensor of shape (2, 16, 128)")
    assert "(2, 16, 1)" in norm["message"]
    (soft,) = run_ranks(_findings, 2, 2, LocalSoftmax)[0]
    assert soft["message"].startswith("softmax over dim 2")
    (unit,) = run_ranks(_findings, 2, 2, LocalNormalize)[0]
    assert unit["message"].startswith("normalize over dim 2")


@pytest.mark.parametrize("planted,op", [(LocalNormDivision, "div"), (LocalMaxShift, "sub")])
def test_other_spellings_of_a_local_statistic(run_ranks, planted, op):
    (d,) = run_ranks(_findings, 2, 2, planted)[0]
    assert d["message"].startswith(op) and "(2, 16, 128)" in d["message"]


def test_sequence_dimension_under_sequence_parallelism(run_ranks):
    (d,) = run_ranks(_findings, 2, 2, None, True, "tiny", "auto", True)[0]
    assert d["where"].startswith("layers.0.drop") and "along dim 1" in d["message"]
    assert "(2, 8, 64)" in d["message"] and "(2, 1, 64)" in d["message"]
    # without SP the tokens are not sharded: the same module is no finding
    assert run_ranks(_findings, 2, 2, None, False, "tiny", "auto", True)[0] == []


def test_silent_when_reduced_or_not_sharded(run_ranks):
    assert run_ranks(_findings, 2, 2, GlobalRMS) == [[], []]  # all-reduced first: the global one
    assert run_ranks(_findings, 1, 1, LocalRMS) == [[]]  # tp 1: nothing is sharded


@pytest.mark.parametrize("name,sp,attention,tp", [
    ("tiny", False, "auto", 2), ("tiny", True, "auto", 2), ("llama-tiny", True, "auto", 2),
    pytest.param("llama-tiny", False, "auto", 2, marks=SLOW),
    pytest.param("tiny", False, "kv_split", 2, marks=SLOW),
    pytest.param("tiny", False, "heads_allgather", 4, marks=SLOW),
    pytest.param("moe-tiny", False, "auto", 2, marks=SLOW)])
def test_silent_on_the_reference_gpt(run_ranks, name, sp, attention, tp):
    assert run_ranks(_findings, tp, tp, None, sp, name, attention) == [[]] * tp


def _diagnosed():
    ctx = init_parallel(tp=2)
    torch.manual_seed(0)
    model = GPT(preset("tiny"))
    for block in model.layers:
        block.mlp.__class__ = LocalRMS
    parallelize(model, ctx)
    idx = torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(1))
    found = diagnose(model, ctx, lambda: model(idx, idx)[1].backward())
    return [d.to_dict() for d in found if d.code == "implicit_broadcast"]


def test_diagnose_reports_it_the_same_on_every_rank(run_ranks):
    assert "implicit_broadcast" in CODES
    ranks = run_ranks(_diagnosed, 2)
    assert len(ranks[0]) == 1 and ranks[0] == ranks[1]


# ---------------------------------------------------------------- the Hugging Face zoo

tr = pytest.importorskip("transformers")
hf_zoo = pytest.importorskip("ops_transformer.testing.zoo")
# per-head q/k norms on a rank holding one KV head (qwen3), xIELU's size-1 parameters (apertus),
# gathered q/k norms (olmo2), MLA (deepseek_v3), Conv1D (gpt2), an encoder (bert), MoE (mixtral)
SAMPLE = ["llama", "qwen3", "apertus", "olmo2", "deepseek_v3", "gpt2", "bert", "mixtral"]
QUICK = ["qwen3", "apertus", "gpt2"]  # the default suite; the others in the slow one


def _zoo(model_type):
    ctx = init_parallel(tp=2)
    model = hf_zoo.build(model_type)
    vocab = model.config.get_text_config().vocab_size
    parallelize(model, ctx)
    ids = torch.randint(3, vocab, (2, 10), generator=torch.Generator().manual_seed(1))

    def step():
        out = hf_zoo._output(model(input_ids=ids, use_cache=False))
        out.float().square().mean().backward()

    return implicit_broadcasts(model, ctx, step)


def _silent(run_ranks, model_type):
    hf_zoo.prepare(model_type)  # imports the family's code before the fork
    assert run_ranks(_zoo, 2, model_type, timeout=900) == [[], []], model_type


@pytest.mark.parametrize("model_type", [m if m in QUICK else pytest.param(m, marks=SLOW)
                                        for m in SAMPLE])
def test_silent_on_sampled_zoo_families(run_ranks, model_type):
    _silent(run_ranks, model_type)


def _working_families() -> list[str]:
    """The families the committed coverage table of docs/huggingface.md says work."""
    doc = Path(__file__).resolve().parents[2] / "docs" / "huggingface.md"
    zoo = doc.read_text().split("<!-- zoo table: start -->")[1].split("<!-- zoo table: end -->")[0]
    return sorted(m for m, status in re.findall(r"^\| `([\w.-]+)` \| ([^|]+) \|", zoo, re.M)
                  if status.strip() == "works")


@pytest.mark.slow  # every family of the coverage table that works (~2 min)
def test_silent_on_the_whole_zoo(run_ranks):
    for model_type in _working_families():
        _silent(run_ranks, model_type)


# ---------------------------------------------------------------- the tracking rules

def test_reshapes_carry_the_shard():
    assert remap((2, 10, 32), 2, (2, 10, 2, 16)) == 2  # h/tp → (heads/tp, head_dim): the heads
    assert remap((2, 10, 16), 2, (2, 10, 1, 16)) == 2  # one head on this rank: still the heads
    assert remap((2, 10, 2, 16), 2, (2, 10, 32)) == 2  # merged back
    assert remap((2, 8, 64), 1, (16, 64)) == 0  # the token shard merged with the batch
    assert remap((2, 10, 32), 2, (2, 10, 32, 1)) == 2


def test_the_diagnose_command_runs_the_extra_watched_step(capsys):
    """diagnose calls the step once more for implicit_broadcast: the command must have a batch
    for it (it ran out before); with re-gathering SP nothing is beyond the plan's minimum."""
    import json

    from ops_transformer.cli.main import main

    assert main(["diagnose", "--nproc", "2", "--tp", "2", "--sequence-parallel", "regather",
                 "--seq", "32", "--batch", "2", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)["diagnostics"]
    assert {d["code"] for d in found} <= {"exposed_comm", "load_imbalance"}
