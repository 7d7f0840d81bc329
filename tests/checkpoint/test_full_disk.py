"""A full disk, for checkpoints and for ``--out`` (issue #30 items 2 and 3).

On a small tmpfs (mounted here: skipped, with the reason, where mounting is not allowed) and with
a simulated ``ENOSPC``: one line naming the device, the step and the size needed; no partial
``.tmp-`` directory left; every earlier checkpoint kept and loadable; training goes on after a
failed save only with ``--on-save-error continue``; ``--out`` is checked before any rank starts,
and a late failure to write it keeps the metrics (printed) and names where they could not go.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import uuid

import pytest

from ops_transformer.checkpoint import list_steps, latest_step, space
from ops_transformer.cli.main import main

TRAIN = ["train", "--nproc", "2", "--tp", "2", "--batch", "4", "--seq", "32", "--no-progress"]


@pytest.fixture
def tmpfs(tmp_path):
    """``mount(size)`` → a fresh tmpfs of ``size`` (e.g. ``"4m"``), unmounted afterwards."""
    mounted = []

    def mount(size: str):
        where = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}); "
                        f"the simulated-ENOSPC tests cover the same paths")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _one_line(err: str, *needles) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert all(n in lines[0] for n in needles), lines[0]
    return lines[0]


def _leftovers(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def _fail_rank1_writes_at(step_dir_name: str, monkeypatch):
    """DCP's item writer raises ENOSPC on rank 1 while it writes into ``step_dir_name``."""
    from torch.distributed.checkpoint import filesystem

    original = filesystem._write_item

    def write_item(*args, **kwargs):
        stream = args[1] if len(args) > 1 else kwargs.get("stream")
        name = getattr(stream, "name", "") or ""
        if os.environ.get("RANK") == "1" and step_dir_name in str(name):
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(*args, **kwargs)

    monkeypatch.setattr(filesystem, "_write_item", write_item)


def test_a_save_larger_than_the_free_space_stops_before_writing(tmpfs, tmp_path, capfd):
    disk = tmpfs("4m")  # a tiny checkpoint at tp 2 is ~1.8 MB: the third does not fit
    root = disk / "ckpt"
    argv = TRAIN + ["--steps", "3", "--save-every", "1", "--ckpt-dir", str(root),
                    "--out", str(tmp_path / "run")]
    assert main(argv) == 2
    line = _one_line(capfd.readouterr().err, f"no space left on {disk}", "while saving step 3",
                     "needs ~", "MiB free", "earlier checkpoints are kept")
    assert re.search(r"no space left on \S+ while saving step 3 \(needs ~[\d.,]+ MiB\)", line)
    assert list_steps(root) == [1, 2] and latest_step(root) == 2 and _leftovers(root) == []
    assert main(["checkpoint", "inspect", str(root)]) == 0  # both verify
    assert capfd.readouterr().out.count(" ok") == 2


def test_a_disk_that_fills_during_the_write(tmpfs, tmp_path, capfd, monkeypatch):
    """The real ENOSPC mid-write (torch's zip writer says "unexpected pos"): the free-space check
    before writing is switched off to get there."""
    disk = tmpfs("4m")
    root = disk / "ckpt"
    monkeypatch.setattr(space, "check_free", lambda *args, **kwargs: None)
    argv = TRAIN + ["--steps", "3", "--save-every", "1", "--ckpt-dir", str(root),
                    "--out", str(tmp_path / "run")]
    assert main(argv) == 2
    _one_line(capfd.readouterr().err, f"no space left on {disk}", "while saving step 3",
              "needs ~", "the partial checkpoint was removed, earlier checkpoints are kept")
    assert list_steps(root) == [1, 2] and latest_step(root) == 2 and _leftovers(root) == []
    # --resume is not tripped by leftovers: it loads step 2 and trains on
    argv = TRAIN + ["--steps", "3", "--ckpt-dir", str(root), "--resume", "--on-save-error",
                    "continue", "--out", str(tmp_path / "resumed"), "--json"]
    assert main(argv) == 0
    captured = capfd.readouterr()
    assert json.loads(captured.out)["resumed_from"] == 2
    assert "no space left on" in captured.err and "training goes on" in captured.err
    assert list_steps(root) == [1, 2] and _leftovers(root) == []


def test_simulated_enospc_on_one_rank(tmp_path, capfd, monkeypatch):
    root = tmp_path / "ckpt"
    _fail_rank1_writes_at("step-00000002", monkeypatch)
    argv = TRAIN + ["--steps", "3", "--save-every", "1", "--ckpt-dir", str(root),
                    "--out", str(tmp_path / "run")]
    assert main(argv) == 2
    _one_line(capfd.readouterr().err, "no space left on", "while saving step 2", "needs ~",
              "earlier checkpoints are kept")
    assert list_steps(root) == [1] and latest_step(root) == 1 and _leftovers(root) == []


def test_on_save_error_continue_trains_on(tmp_path, capfd, monkeypatch):
    root = tmp_path / "ckpt"
    _fail_rank1_writes_at("step-00000002", monkeypatch)
    argv = TRAIN + ["--steps", "3", "--save-every", "1", "--ckpt-dir", str(root),
                    "--on-save-error", "continue", "--out", str(tmp_path / "run"), "--json"]
    assert main(argv) == 0
    captured = capfd.readouterr()
    assert len(json.loads(captured.out)["losses"]) == 3
    warning = [line for line in captured.err.splitlines() if "no space left" in line]
    assert len(warning) == 1 and "while saving step 2" in warning[0]
    assert list_steps(root) == [1, 3] and _leftovers(root) == []


def test_out_without_space_is_refused_before_any_rank_starts(tmpfs, monkeypatch, capfd):
    disk = tmpfs("64k")
    started = []
    monkeypatch.setattr("ops_transformer.cli.train.launch_with_restarts",
                        lambda *a, **k: started.append(1))
    assert main(TRAIN + ["--steps", "2", "--out", str(disk / "run")]) == 2
    _one_line(capfd.readouterr().err, f"no space left on {disk}", "while writing metrics.json",
              "free in --out", "nothing was run")
    assert not started


def test_ckpt_dir_without_space_is_refused_before_any_rank_starts(tmpfs, tmp_path, monkeypatch,
                                                                  capfd):
    disk = tmpfs("1m")  # one tiny checkpoint needs ~2 MB
    started = []
    monkeypatch.setattr("ops_transformer.cli.train.launch_with_restarts",
                        lambda *a, **k: started.append(1))
    argv = TRAIN + ["--steps", "2", "--ckpt-dir", str(disk / "ckpt"), "--out",
                    str(tmp_path / "run")]
    assert main(argv) == 2
    _one_line(capfd.readouterr().err, f"no space left on {disk}", "first checkpoint")
    assert not started


def test_out_that_fills_late_keeps_the_metrics(tmp_path, capfd, monkeypatch):
    """metrics.json fails with ENOSPC after training (simulated, one process): the metrics are
    printed, the error names where they could not go, no truncated metrics.json is left."""
    import pathlib

    original = pathlib.Path.write_text

    def write_text(self, *args, **kwargs):
        if self.name == ".metrics.json.tmp":
            original(self, "{\"trunc", **kwargs)
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", write_text)
    out = tmp_path / "run"
    argv = ["train", "--steps", "2", "--batch", "2", "--seq", "16", "--no-progress", "--json",
            "--out", str(out)]
    assert main(argv) == 1
    captured = capfd.readouterr()
    metrics = json.loads(captured.out)
    assert len(metrics["losses"]) == 2 and "No space left" in metrics["outputs_not_written"]
    _one_line(captured.err, "could not be written to", str(out), "No space left on device")
    assert not (out / "metrics.json").exists() and not (out / ".metrics.json.tmp").exists()
