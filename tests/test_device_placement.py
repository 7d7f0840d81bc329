"""Every tensor on ``ctx.device`` (issue 28), checked without a GPU and, where one is, on it.

Without a GPU, ``meta`` stands in for CUDA: a context whose ``device`` is ``meta`` is not the CPU
default, so a parameter, batch, mask or communication buffer made without ``device=`` (or never
moved) lands on the CPU and :class:`~ops_transformer.testing.devices.DeviceCheck` — a forward
pre-hook on every module and a wrapper around every ``torch.distributed`` collective — names it.
``meta`` tensors carry no values: a run stops at its first host read (``float(loss)``), after the
forward, the backward and the step's collective, which is what is checked. Multi-rank runs fake
their collectives (the check still sees each input).

The ``ot_device`` tests run once on the CPU and once on CUDA (skipped with the reason here).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from helpers import assert_rel
from ops_transformer import ParallelContext, init_parallel, parallelize
from ops_transformer.checkpoint.rng import set_rng_state
from ops_transformer.cli.main import main as cli_main
from ops_transformer.models.gpt import GPT, preset
from ops_transformer.parallel import context as context_mod
from ops_transformer.precision import optimizer_step
from ops_transformer.testing.devices import DeviceCheck, WrongDevice
from ops_transformer.training.loop import TrainConfig, setup_training

META = torch.device("meta")
launch_mod = importlib.import_module("ops_transformer.launch.local")  # (the package exports
# the function `launch` under the module's name)


def _meta_readback(exc: BaseException) -> bool:
    """The run stopped where a value is read on the host (``float(loss)``; an MoE layer's
    dispatch, whose split sizes are the experts' token counts)."""
    return "meta" in str(exc).lower()


# --- meta standing in for CUDA -----------------------------------------------------------------

@pytest.mark.parametrize("name,extra", [("tiny", {}), ("llama-tiny", {}), ("moe-tiny", {}),
                                        ("llama-tiny", {"lora_rank": 4}),
                                        ("tiny", {"grad_accum": 2})],
                         ids=["tiny", "llama-tiny", "moe-tiny", "lora", "grad-accum"])
def test_train_step_keeps_everything_on_ctx_device(name, extra):
    """``train``'s set-up and step on a ``meta`` context: parameters, buffers, the batch and every
    module input on ``meta``; the step stops only at its host read of the loss (an MoE model at
    its dispatch, whose split sizes are read on the host)."""
    ctx = ParallelContext.single(META)
    state = setup_training(TrainConfig(preset=name, batch=2, seq=16, steps=1, **extra), ctx)
    assert {p.device for p in state.model.parameters()} == {META}
    x, y = state.batch(0)
    assert x.device == y.device == META
    with DeviceCheck(META) as check, pytest.raises((RuntimeError, NotImplementedError)) as err:
        state.step(x, y)
    assert not isinstance(err.value, WrongDevice), err.value
    assert _meta_readback(err.value), err.value
    assert check.seen["parameter"] > 0 and check.seen["input"] > 0
    if name.startswith("moe"):
        return  # stopped in the forward: the dispatch reads its split sizes on the host
    assert all(p.grad is not None and p.grad.device == META
               for p in state.model.parameters() if p.requires_grad)


def _tp2_on_meta(name):
    ctx = dataclasses.replace(init_parallel(tp=2), device=META)
    with DeviceCheck(META, fake_collectives=True) as check:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = GPT(preset(name).with_(max_seq_len=16))
        model = parallelize(model, ctx)
        x = torch.zeros(2, 16, dtype=torch.long, device=META)
        _, loss = model(x, x)
        loss.backward()
    return check.collectives, check.seen


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_tp2_collective_inputs_on_ctx_device(run_ranks, name):
    """At tp = 2 every collective of the forward and backward gets ``ctx.device`` tensors."""
    for collectives, seen in run_ranks(_tp2_on_meta, 2, name):
        assert collectives, "the TP forward and backward must communicate"
        assert {device for _, device in collectives} == {"meta"}
        assert seen["collective"] >= len(collectives)


def _dp2_step_metrics():
    ctx = dataclasses.replace(init_parallel(tp=1, dp=2), device=META)
    model = torch.nn.Linear(4, 4, device=META)
    model.weight.grad = torch.zeros_like(model.weight)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with DeviceCheck(META, fake_collectives=True) as check:
        try:  # a Python-float metric (the MoE statistics are floats) beside a device loss
            optimizer_step(model, opt, ctx, metrics={"loss": torch.zeros((), device=META),
                                                     "aux": 0.5})
        except WrongDevice as exc:
            return f"wrong device: {exc}"
        except (RuntimeError, NotImplementedError) as exc:
            if not _meta_readback(exc):
                raise
    return check.collectives


def test_step_metrics_join_the_collective_on_ctx_device(run_ranks):
    """``optimizer_step`` averages its metrics over dp in one all-reduce: a float metric must be
    made on ``ctx.device`` (on the CPU it broke ``train --ep 2`` / ``--dp 2`` with NCCL)."""
    for result in run_ranks(_dp2_step_metrics, 2):
        assert not isinstance(result, str), result
        assert result and {device for _, device in result} == {"meta"}


def test_parallelize_rejects_a_model_on_another_device():
    """A CPU model under a context on another device is named at once, not inside a
    collective; ``meta`` (materialised later) is accepted."""
    with pytest.raises(ValueError, match=r"tok_emb.*is on cpu, but ctx.device is meta"):
        parallelize(GPT(preset("tiny")), ParallelContext.single(META))
    with torch.device("meta"):
        model = GPT(preset("tiny"))
    parallelize(model, ParallelContext.single("cpu"))  # meta: placed by materialize


def test_device_check_names_a_tensor_on_the_wrong_device():
    """The check itself can fail: a CPU input into a meta module."""
    layer = torch.nn.Linear(2, 2, device=META)
    with DeviceCheck(META), pytest.raises(WrongDevice, match="input of Linear.*on cpu"):
        layer(torch.zeros(1, 2))


# --- launcher and checkpoints: GPU counts and devices -------------------------------------------

def test_more_local_ranks_than_gpus_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"--nproc 4: NCCL needs one GPU per local rank, but 2"):
        context_mod.check_local_ranks(4, "--nproc")
    context_mod.check_local_ranks(2, "--nproc")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="4 ranks on this node"):
        context_mod._local_rank(3)
    assert cli_main(["train", "--nproc", "4", "--steps", "1"]) == 2
    assert "--nproc 4: NCCL needs one GPU per local rank" in capsys.readouterr().err


def test_launch_spawns_where_a_gpu_is_visible(monkeypatch):
    """``torch.cuda.is_available()`` initialises the driver without ``is_initialized()``
    saying so; a rank forked after it cannot use CUDA: fork only where no GPU is visible."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert launch_mod._fork_is_safe() == sys.platform.startswith("linux")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert not launch_mod._fork_is_safe()


def test_cuda_generator_state_of_a_missing_device_is_not_restored():
    state = {"torch": torch.get_rng_state(), "python": __import__("random").getstate(),
             "cuda": [torch.zeros(8, dtype=torch.uint8)]}  # saved with one visible GPU
    with pytest.warns(UserWarning, match="none for cuda:1"):
        set_rng_state(state, torch.device("cuda", 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        set_rng_state(state, torch.device("cpu"))  # a CPU rank: no CUDA generator


def test_gpu_check_without_a_gpu_says_so(tmp_path):
    out = tmp_path / "gpu.json"
    done = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--out", str(out)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2
    assert "gpu-check: no GPU is visible" in done.stderr
    assert not out.exists()


# --- the CUDA variants (skipped with the reason where no GPU runs them) ------------------------

def test_tp1_step_exact_on_device(ot_device):
    """The parallelised GPT at tp = 1 on ``ot_device`` against the dense CPU model: loss, input
    and weight gradients (fp32; TF32 is off by default for matmuls)."""
    torch.manual_seed(0)
    dense = GPT(preset("llama-tiny"))
    model = parallelize(GPT(preset("llama-tiny")).to(ot_device),
                        ParallelContext.single(ot_device))
    model.load_state_dict({k: v.to(ot_device) for k, v in dense.state_dict().items()})
    x = torch.randint(0, dense.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    _, ref = dense(x, x)
    ref.backward()
    with DeviceCheck(ot_device) as check:
        _, loss = model(x.to(ot_device), x.to(ot_device))
        loss.backward()
    assert check.seen["parameter"] > 0
    assert_rel(loss.cpu(), ref, what="loss")
    for (name, p), q in zip(model.named_parameters(), dense.parameters()):
        assert p.grad.device.type == torch.device(ot_device).type
        assert_rel(p.grad.cpu(), q.grad, what=name)


def test_train_and_checkpoint_across_devices(ot_device, tmp_path, capsys):
    """``train`` with a checkpoint on ``ot_device``, resumed there, then exported by a process
    that sees no GPU (a CUDA checkpoint loads on the CPU)."""
    args = ["train", "--preset", "tiny", "--batch", "2", "--seq", "16", "--no-progress",
            "--json", "--ckpt-dir", str(tmp_path / "ckpt"), "--save-every", "2"]
    device = torch.device("cuda", 0) if ot_device == "cuda" else torch.device("cpu")
    with DeviceCheck(device) as check:
        assert cli_main(args + ["--steps", "2", "--out", str(tmp_path / "run")]) == 0
        capsys.readouterr()
        assert cli_main(args + ["--steps", "4", "--resume", "--out", str(tmp_path / "again")]) == 0
    assert check.seen["parameter"] > 0
    resumed = json.loads(capsys.readouterr().out)
    assert len(resumed["losses"]) == 4  # two saved, two run after the resume
    done = subprocess.run([sys.executable, "-m", "ops_transformer", "checkpoint", "export",
                           str(tmp_path / "ckpt"), "--out", str(tmp_path / "x.safetensors")],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "x.safetensors").stat().st_size > 0


def test_activation_memory_reports_the_allocator_on_cuda(ot_device):
    from ops_transformer import activation_memory

    model = parallelize(GPT(preset("tiny")).to(ot_device), ParallelContext.single(ot_device))
    x = torch.zeros(2, 16, dtype=torch.long, device=ot_device)
    report = activation_memory(model, x, x)
    assert report["total_bytes"] > 0
    if ot_device == "cuda":
        assert report["cuda_forward_peak_bytes"] >= report["total_bytes"] > 0
    else:
        assert "cuda_max_memory_allocated" not in report
