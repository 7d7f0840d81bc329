"""Host synchronisations out of ``train``'s step (issue 38, item 3): its loss and metrics stay on
the device and are read once per ``--log-every`` steps, in one transfer; ``diagnose``'s
``host_sync`` finding is silent on the default training step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import ops_transformer
from ops_transformer.precision import StepReport, read_reports
from ops_transformer.profiler.watch import SYNC_METHODS
from ops_transformer.training.loop import TrainConfig, join, setup_training

PACKAGE = str(Path(ops_transformer.__file__).parent)
DISPATCH = ("overrides.py", "_tensor.py", "_tensor_str.py", "_python_dispatch.py")


class _LibrarySyncs(TorchFunctionMode):
    """Every host read of a tensor (``.item()``, ``.tolist()``, ``float(t)`` …) made by the
    library's own code, with the file and line that made it, whatever device the tensor is on
    (on a CPU no read waits for anything, so ``diagnose`` reports only accelerator tensors'; this
    counts what would wait on a GPU). Reads made inside PyTorch (the optimizer's ``.item()`` of
    its CPU step counters) are not the library's."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in SYNC_METHODS:
            frame = sys._getframe(1)  # the code that called the method (past torch's dispatch)
            while frame is not None and Path(frame.f_code.co_filename).name in DISPATCH:
                frame = frame.f_back
            if frame is not None and frame.f_code.co_filename.startswith(PACKAGE):
                self.seen.append(f"{SYNC_METHODS[func.__name__]} at "
                                 f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}")
        return func(*args, **(kwargs or {}))


def _step_syncs(**fields):
    cfg = TrainConfig(**{"preset": "tiny", "steps": 3, "batch": 4, "seq": 32, "progress": False,
                         **fields})
    with join(cfg) as ctx:
        state = setup_training(cfg, ctx)
        state.read_metrics = False  # as train's loop runs it
        state.step(*state.batch(0))  # the first step builds the optimizer's state
        with _LibrarySyncs() as watch:
            report, _ = state.step(*state.batch(1))
        read = report.read()
        return watch.seen, isinstance(report.metrics["loss"], torch.Tensor), read.metrics["loss"]


@pytest.mark.parametrize("fields", [{}, {"clip_grad": 1.0, "tp": 2}])
def test_train_step_reads_nothing_on_the_host(run_ranks, fields):
    ranks = fields.get("tp", 1)
    for seen, lazy, loss in run_ranks(_step_syncs, ranks, **fields):
        assert seen == [], seen  # the library's code makes no host read in the step
        assert lazy and 0 < loss < 10  # the loss is a device tensor until read


def test_read_reports_reads_every_value_once():
    lazy = [StepReport(True, torch.tensor(2.0), None, {"loss": torch.tensor(float(i)),
                                                       "slots": 4.0}) for i in range(3)]
    read = read_reports(lazy)
    assert [r.metrics for r in read] == [{"loss": float(i), "slots": 4.0} for i in range(3)]
    assert all(type(r.grad_norm) is float and r.grad_norm == 2.0 for r in read)
    assert read_reports([StepReport(True)]) == [StepReport(True)]


def _diagnosed(cfg):
    from ops_transformer.profiler.run import diagnose_worker

    return diagnose_worker(cfg)


def test_diagnose_host_sync_is_silent_on_the_default_train_step(run_ranks):
    cfg = TrainConfig(preset="tiny", tp=2, steps=3, batch=4, seq=32, progress=False)
    found = run_ranks(_diagnosed, 2, cfg)[0]
    assert not [d for d in found if d["code"] == "host_sync"], found


def test_log_every_is_checked():
    from ops_transformer.training.loop import validate

    with pytest.raises(ValueError, match="--log-every must be at least 1, got 0"):
        validate(TrainConfig(log_every=0), 1)


class _Journal:
    def __init__(self):
        self.messages = []

    def send(self, message):
        self.messages.append(message)


def _trained(log_every):
    from ops_transformer.training.loop import train_worker

    journal = _Journal()
    cfg = TrainConfig(preset="tiny", steps=5, batch=4, seq=32, progress=False,
                      sample_tokens=0, log_every=log_every)
    metrics = train_worker(cfg, journal=journal)
    return metrics["losses"], [m["loss"] for m in journal.messages if "loss" in m]


def test_every_steps_loss_is_reported_whatever_the_interval(run_ranks):
    """Read once per 3 steps (at steps 3 and 5), the losses are every step's, in order, the same
    as read every step — in the metrics and in the journal."""
    (every, every_journal), = run_ranks(_trained, 1, 1)
    (third, third_journal), = run_ranks(_trained, 1, 3)
    assert len(every) == 5 and third == every and third_journal == every_journal == every
