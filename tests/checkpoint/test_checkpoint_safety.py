"""A checkpoint from someone else never runs code here (issue #30 item 1).

Two crafted checkpoints, both with a manifest whose SHA-256 records match (whoever writes the
directory can recompute them): one whose DCP ``.metadata`` is a pickle calling ``os.system``, one
whose shard holds such a pickle as a saved value. ``load_checkpoint``, ``checkpoint inspect`` and
``train --resume`` each refuse both in one line naming the file, and the payload (which would
create a marker file) never runs.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest

import ops_transformer as ot
from ops_transformer.checkpoint import store, writer
from ops_transformer.checkpoint.reader import UnsafeCheckpointError
from ops_transformer.cli.main import main
from ops_transformer.training.loop import TrainConfig, setup_training

TRAIN = ["train", "--steps", "2", "--batch", "2", "--seq", "16", "--no-progress", "--json"]


class Payload:
    """Pickles as a call of ``os.system`` that creates ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _rehash(step_dir) -> None:
    """Recompute the manifest's records, as whoever crafted the directory can."""
    manifest = store.read_manifest(step_dir)
    manifest["files"] = {name: store.file_record(step_dir / name) for name in manifest["files"]}
    manifest["total_bytes"] = sum(f["size"] for f in manifest["files"].values())
    store.write_manifest(step_dir, manifest)


def _trained(tmp_path):
    """A checkpoint of `train` (one process, tiny preset) at step 2, its directory and config."""
    root = tmp_path / "ckpt"
    assert main(TRAIN + ["--ckpt-dir", str(root), "--out", str(tmp_path / "run")]) == 0
    return root, TrainConfig(steps=2, batch=2, seq=16, ckpt_dir=str(root), progress=False)


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    """Both crafted checkpoints, made once: ``{kind: (root, marker)}``; tests use copies."""
    made = {}
    mp = pytest.MonkeyPatch()
    try:
        for kind in ("metadata", "shard"):
            base = tmp_path_factory.mktemp(kind)
            marker = base / "payload-ran"
            root, cfg = _trained(base)
            step_dir = root / store.step_dirname(2)
            if kind == "metadata":
                (step_dir / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
                _rehash(step_dir)
            else:
                ctx = ot.init_parallel()
                state = setup_training(cfg, ctx)
                info = ot.load_checkpoint(root, state.model, state.opt, ctx)
                # saving refuses such a value (it would not load with weights_only=True): skip
                mp.setattr(writer, "check_picklable", lambda value, what: None)
                ot.save_checkpoint(root, state.model, state.opt, ctx, 2,
                                   extra={**info["extra"], "payload": Payload(marker)})
                mp.undo()
            made[kind] = (root, marker)
    finally:
        mp.undo()
    return made


@pytest.fixture(params=["metadata", "shard"])
def crafted(request, originals, tmp_path, capsys):
    """``(root, marker, file named in the error, config)`` of a copy of a crafted checkpoint."""
    source, marker = originals[request.param]
    root = tmp_path / "ckpt"
    shutil.copytree(source, root)
    capsys.readouterr()
    assert not marker.exists()
    name = ".metadata" if request.param == "metadata" else "__0_0.distcp"
    return root, marker, name, TrainConfig(steps=2, batch=2, seq=16, ckpt_dir=str(root),
                                           progress=False)


def _one_line(text: str, *needles) -> None:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    assert "Traceback" not in text and all(n in lines[0] for n in needles), text


def test_load_checkpoint_refuses_a_crafted_checkpoint(crafted):
    root, marker, name, cfg = crafted
    ctx = ot.init_parallel()
    state = setup_training(cfg, ctx)
    with pytest.raises(UnsafeCheckpointError) as info:
        ot.load_checkpoint(root, state.model, state.opt, ctx)
    assert isinstance(info.value, ot.CheckpointError)
    assert name in str(info.value) and "\n" not in str(info.value)
    assert not marker.exists()


def test_inspect_refuses_a_crafted_checkpoint(crafted, capsys):
    root, marker, name, _ = crafted
    assert main(["checkpoint", "inspect", str(root)]) == 2
    _one_line(capsys.readouterr().err, "checkpoint: error", name, "refused")
    assert main(["checkpoint", "inspect", str(root), "--json"]) == 2
    captured = capsys.readouterr()
    assert json.loads(captured.out)["checkpoints"][0]["unsafe"] is True
    _one_line(captured.err, name)
    assert not marker.exists()


def test_train_resume_refuses_a_crafted_checkpoint(crafted, tmp_path, capsys):
    root, marker, name, _ = crafted
    argv = ["train", "--steps", "4", "--batch", "2", "--seq", "16", "--no-progress",
            "--ckpt-dir", str(root), "--resume", "--out", str(tmp_path / "resumed")]
    assert main(argv) == 2
    _one_line(capsys.readouterr().err, "train: error", name, "refused")
    assert not marker.exists()


def test_export_refuses_a_crafted_checkpoint(crafted, tmp_path, capsys):
    root, marker, name, _ = crafted
    assert main(["checkpoint", "export", str(root), "--out", str(tmp_path / "m.safetensors")]) == 2
    _one_line(capsys.readouterr().err, name)
    assert not marker.exists()


def test_the_real_metadata_reads_through_the_allow_list(tmp_path, capsys):
    root, _ = _trained(tmp_path)
    assert main(["checkpoint", "inspect", str(root)]) == 0
    assert " ok" in capsys.readouterr().out
