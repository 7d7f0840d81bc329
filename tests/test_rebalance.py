"""Resuming on another number of ranks (``train --resume`` with another ``--nproc``, layout not
restated): the layout re-planned for the ranks there are, the accumulation set so that the
micro-batch and the global batch stay the run's, the checkpoint resharded — and the losses those
of the run that never stopped (≤ 1e-5 per step, fp32, dropout 0; the matmuls and all-reduces sum
in another order, so not bit for bit). The reference GPT 4 → 2 and 2 → 4 ranks, MoE with experts
over ranks, an elastic local job that loses a node, the sizes that cannot hold the batch or the
model, and ``--rebalance off``."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from ops_transformer.checkpoint.store import LATEST, list_steps, step_dirname
from ops_transformer.cli.main import main
from ops_transformer.planner.catalogue import GPU
from ops_transformer.planner.specs import ClusterSpec
from ops_transformer.training.rebalance import rebalance, saved_split
from ops_transformer.training.loop import TrainConfig

STEPS = 6
COMMON = ["train", "--steps", str(STEPS), "--batch", "8", "--seq", "16", "--save-every", "3",
          "--no-progress", "--json"]


def _train(tmp_path: Path, name: str, *argv: str, ckpt: Path | None = None) -> dict:
    ckpt = ckpt or tmp_path / f"{name}-ckpt"
    assert main(COMMON + ["--ckpt-dir", str(ckpt), "--out", str(tmp_path / name), *argv]) == 0
    return json.loads((tmp_path / name / "metrics.json").read_text())


def _interrupted_at(ckpt: Path, step: int, into: Path) -> Path:
    """A copy of ``ckpt`` as the job left it when it died after saving ``step``."""
    shutil.copytree(ckpt, into)
    for later in [s for s in list_steps(into) if s > step]:
        shutil.rmtree(into / step_dirname(later))
    (into / LATEST).write_text(step_dirname(step))
    return into


def _assert_same_losses(got: dict, ref: dict, tol: float = 1e-5) -> None:
    assert len(got["losses"]) == len(ref["losses"]) == STEPS
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
        assert abs(a - b) <= tol * abs(b), f"step {step}: {a} vs {b} (uninterrupted)"


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """The uninterrupted run on 4 ranks, dp 2 × tp 2, checkpointed at steps 3 and 6."""
    root = tmp_path_factory.mktemp("four")
    return root, _train(root, "ref", "--nproc", "4", "--tp", "2")


def test_4_to_2_ranks_keeps_the_run(four_ranks, tmp_path, capsys):
    root, ref = four_ranks
    ckpt = _interrupted_at(root / "ref-ckpt", 3, tmp_path / "ckpt")
    capsys.readouterr()
    got = _train(tmp_path, "resumed", "--nproc", "2", "--resume", ckpt=ckpt)
    err = capsys.readouterr().err
    assert "accumulation 1 → 2" in err and "dp 2 × tp 2 → dp 1 × tp 2" in err, err
    assert (got["dp"], got["tp"], got["grad_accum"], got["micro_batch"]) == (1, 2, 2, 4)
    assert (ref["dp"], ref["tp"], ref["grad_accum"], ref["micro_batch"]) == (2, 2, 1, 4)
    assert got["resumed_from"] == 3 and got["rebalanced"]["from"]["world_size"] == 4
    _assert_same_losses(got, ref)


@pytest.mark.slow
def test_2_to_4_ranks_keeps_the_run(tmp_path, capsys):
    """dp 1 × tp 2 with accumulation 2 on 2 ranks, resumed on 4: dp 2 × tp 2, accumulation 1."""
    ref = _train(tmp_path, "ref", "--nproc", "2", "--tp", "2", "--grad-accum", "2")
    ckpt = _interrupted_at(tmp_path / "ref-ckpt", 3, tmp_path / "ckpt")
    capsys.readouterr()
    got = _train(tmp_path, "resumed", "--nproc", "4", "--resume", ckpt=ckpt)
    assert "dp 1 × tp 2 → dp 2 × tp 2, accumulation 2 → 1" in capsys.readouterr().err
    assert (got["dp"], got["tp"], got["grad_accum"], got["micro_batch"]) == (2, 2, 1, 4)
    _assert_same_losses(got, ref)


MOE = ["--preset", "moe-tiny", "--ep", "2"]


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [
    (4, 2),  # dp 2 × ep 2 → dp 1 × ep 2, accumulation 2
    (2, 4),  # dp 1 × ep 2, accumulation 2 → dp 2 × ep 2
])
def test_moe_with_experts_over_ranks_keeps_the_run(tmp_path, capsys, before, after):
    """The capacity and the load-balancing loss are per micro-batch: with the micro-batch kept,
    they are the run's (a dp 2 → 1 resume without accumulation doubles the micro-batch; the
    issue measured 6e-4 off)."""
    accum = ["--grad-accum", "2"] if before == 2 else []
    ref = _train(tmp_path, "ref", "--nproc", str(before), *MOE, *accum)
    ckpt = _interrupted_at(tmp_path / "ref-ckpt", 3, tmp_path / "ckpt")
    capsys.readouterr()
    got = _train(tmp_path, "resumed", "--nproc", str(after), "--resume", *MOE[:2], ckpt=ckpt)
    err = capsys.readouterr().err
    assert "accumulation" in err and "ep 2" in err, err
    assert got["micro_batch"] == ref["micro_batch"] == 2 and got["ep"] == 2
    _assert_same_losses(got, ref)
    for key in ("aux_loss", "dropped_fraction"):
        for a, b in zip(got["moe"][key], ref["moe"][key]):
            assert abs(a - b) <= 1e-5 * max(abs(b), 1e-3), (key, got["moe"][key], ref["moe"][key])


@pytest.mark.slow
def test_elastic_local_job_drops_the_node_that_died(four_ranks, tmp_path, monkeypatch, capsys,
                                                    caplog):
    """``--nproc 4 --ranks-per-node 2 --max-restarts 1 --elastic``: rank 2 (node 1) is killed in
    its 5th step; the job goes on with node 0's two ranks, rebalanced from the step-3 checkpoint,
    and ends with the losses of the 4-rank run."""
    _, ref = four_ranks
    killed = tmp_path / "killed"
    original = torch.optim.AdamW.step

    def step(self, *args, **kwargs):  # forked ranks inherit it
        self._test_steps = getattr(self, "_test_steps", 0) + 1
        if os.environ.get("RANK") == "2" and self._test_steps == 5 and not killed.exists():
            killed.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    got = _train(tmp_path, "elastic", "--nproc", "4", "--tp", "2", "--ranks-per-node", "2",
                 "--max-restarts", "1", "--elastic", "--resume")
    assert killed.exists()
    assert "node 1 lost: continuing on the 2 ranks of the other nodes" in caplog.text
    assert "dp 2 × tp 2 → dp 1 × tp 2" in capsys.readouterr().err
    assert (got["dp"], got["tp"], got["grad_accum"], got["resumed_from"]) == (1, 2, 2, 3)
    _assert_same_losses(got, ref)


# --- sizes that cannot hold the run, and --rebalance off -------------------------------------


def test_a_size_that_cannot_hold_the_batch_and_the_model_is_one_line(four_ranks, tmp_path,
                                                                     capsys):
    """8 sequences in 2 micro-batches of 4: dp 3 does not split them, and tp 3 (dp 1) does not
    divide the model."""
    root, _ = four_ranks
    ckpt = _interrupted_at(root / "ref-ckpt", 3, tmp_path / "ckpt")
    capsys.readouterr()
    code = main(COMMON + ["--nproc", "3", "--resume", "--ckpt-dir", str(ckpt),
                          "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "on 3 ranks" in err[0] and "global batch of 8 sequences" in err[0], err[0]
    assert "2 micro-batches of 4" in err[0] and "the model (tiny)" in err[0]
    assert "tp 1: 2 micro-batches do not divide over dp × ep = 3" in err[0]
    assert "tp 3: d_ff (256) is not divisible by tp (3)" in err[0]


def _small_cluster(ranks: int, memory_bytes: int) -> ClusterSpec:
    gpu = GPU("tiny-memory", bf16_flops=1e12, fp16_flops=1e12, fp32_flops=1e12,
              memory_bytes=memory_bytes, memory_bandwidth=1e10, intra_link="loopback",
              gpus_per_node=ranks, vendor="cpu")
    from ops_transformer.planner.catalogue import Link

    link = Link("loopback", bandwidth=1e9, latency_s=1e-5)
    return ClusterSpec(gpu=gpu, count=ranks, gpus_per_node=ranks, intra_link=link,
                       inter_link=None)


def test_a_size_that_cannot_hold_the_model_names_both(four_ranks, tmp_path):
    """Resumed on 1 rank of 1 MB, the tiny model (0.1 M parameters, AdamW: 16 B each, plus the
    activations) fits no layout."""
    root, _ = four_ranks
    cfg = TrainConfig(batch=8, seq=16, steps=STEPS, resume=True, ckpt_dir=str(root / "ref-ckpt"))
    with pytest.raises(ValueError) as info:
        rebalance(cfg, 1, cluster=_small_cluster(1, 1 << 20))
    message = str(info.value)
    assert "\n" not in message and "on 1 ranks" in message and "the model (tiny)" in message
    assert "GiB per rank" in message
    fits = rebalance(cfg, 2, cluster=_small_cluster(2, 1 << 30))
    assert (fits.cfg.tp, fits.cfg.grad_accum) == (2, 2)


def test_saved_split_reads_the_manifest(four_ranks):
    root, _ = four_ranks
    assert saved_split(root / "ref-ckpt", 8) == {
        "step": 6, "world_size": 4, "dp": 2, "ep": 1, "tp": 2, "global_batch": 8,
        "micro_batch": 4, "grad_accum": 1}


@pytest.mark.slow
def test_rebalance_off_runs_the_layout_given(four_ranks, tmp_path, capsys):
    """Today's behaviour: the layout as given (--tp 2 on 2 ranks: dp 1), no accumulation, so the
    micro-batch doubles (4 → 8); nothing is said about accumulation."""
    root, ref = four_ranks
    ckpt = _interrupted_at(root / "ref-ckpt", 3, tmp_path / "ckpt")
    capsys.readouterr()
    got = _train(tmp_path, "off", "--nproc", "2", "--tp", "2", "--resume", "--rebalance", "off",
                 ckpt=ckpt)
    assert "accumulation" not in capsys.readouterr().err
    assert (got["dp"], got["tp"], got["grad_accum"], got["micro_batch"]) == (1, 2, 1, 8)
    assert "rebalanced" not in got
    assert got["losses"][:3] == ref["losses"][:3]


@pytest.mark.parametrize("argv,message", [
    (["--nproc", "4", "--max-restarts", "1", "--elastic"],
     "--elastic drops the node whose ranks die: it needs --ranks-per-node smaller than --nproc "
     "(4) and dividing it (none given)"),
    (["--nproc", "4", "--ranks-per-node", "3", "--max-restarts", "1", "--elastic"],
     "and dividing it (got 3)"),
    (["--nproc", "4", "--ranks-per-node", "2", "--elastic"],
     "--elastic continues on the nodes left after a failure: it needs --max-restarts 1 or more"),
    (["--nproc", "2", "--grad-accum", "3", "--max-restarts", "0"],
     r"--batch (8) must be divisible by dp (2) × --grad-accum (3)"),
    (["--grad-accum", "0"], "--grad-accum must be at least 1, got 0"),
])
def test_bad_elastic_and_accumulation_settings_are_one_line(tmp_path, capsys, argv, message):
    code = main(COMMON + ["--resume", "--ckpt-dir", str(tmp_path / "ckpt"),
                          "--out", str(tmp_path / "run"), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err


# --- context parallelism: cp is a layout degree like tp and ep ------------------------------------

CP = ["--cp", "2", "--grad-accum", "2"]


@pytest.fixture(scope="module")
def cp_run(tmp_path_factory):
    """The uninterrupted run on 2 ranks, dp 1 × cp 2 with accumulation 2 (micro-batch 4)."""
    root = tmp_path_factory.mktemp("cp")
    return root, _train(root, "ref", "--nproc", "2", *CP)


@pytest.mark.slow
def test_cp_run_resumed_on_4_ranks_keeps_cp_and_the_run(cp_run, tmp_path, capsys):
    """Saved at dp 1 × cp 2, resumed on 4 ranks with no layout stated: the rebalancer keeps the
    checkpoint's cp (and its micro-batch): dp 2 × cp 2, accumulation 1, the same losses."""
    root, ref = cp_run
    ckpt = _interrupted_at(root / "ref-ckpt", 3, tmp_path / "ckpt")
    capsys.readouterr()
    got = _train(tmp_path, "resumed", "--nproc", "4", "--resume", ckpt=ckpt)
    err = capsys.readouterr().err
    assert "dp 1 × cp 2 × tp 1 → dp 2 × cp 2 × tp 1, accumulation 2 → 1" in err, err
    assert (got["dp"], got["cp"], got["grad_accum"], got["micro_batch"]) == (2, 2, 1, 4)
    _assert_same_losses(got, ref)


@pytest.mark.slow
def test_rebalancer_chooses_cp(cp_run):
    """On 1 rank cp 2 cannot be kept: the planner chooses cp 1 (said); a stated --cp 4 on 4 ranks
    is kept (2·4 divides the sequence of 16): dp 1 × cp 4, the micro-batch kept by accumulation 2;
    a stated --cp 3 on 3 ranks (2·3 does not divide 16) is tried and named in the one-line
    error."""
    root, _ = cp_run
    cfg = TrainConfig(batch=8, seq=16, steps=STEPS, resume=True, ckpt_dir=str(root / "ref-ckpt"),
                      cp=2)
    one = rebalance(cfg, 1)
    assert (one.cfg.tp, one.cfg.cp, one.cfg.grad_accum) == (1, 1, 2)
    assert "tp 1 × cp 2 does not fit 1 ranks (tp × ep × cp = 2 does not divide 1 ranks)" in \
        one.message()
    import dataclasses

    four = rebalance(dataclasses.replace(cfg, cp=4), 4, stated={"cp"})
    assert (four.cfg.tp, four.cfg.cp, four.cfg.grad_accum) == (1, 4, 2), four.message()
    with pytest.raises(ValueError) as info:  # 3 ranks: nothing holds the batch and the model
        rebalance(dataclasses.replace(cfg, cp=3), 3, stated={"cp"})
    assert "\n" not in str(info.value)
    assert "tp 1 × cp 3: context parallelism splits the sequence into 2·cp = 6 chunks" in \
        str(info.value)


# --- pipeline parallelism: the rebalancer re-plans pp, dp and the accumulation ---------------------

@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    """The uninterrupted run on 4 ranks, pp 2 × dp 2 (1f1b, 2 micro-batches), checkpointed."""
    root = tmp_path_factory.mktemp("pp")
    return root, _train(root, "ref", "--nproc", "4", "--pp", "2", "--microbatches", "2")


PP = ("--pp", "2", "--microbatches", "2")


@pytest.mark.slow
def test_pp_resume_keeps_pp_and_the_micro_batch(pipelined, tmp_path, capsys):
    """pp 2 × dp 2 on 4 ranks resumed on 2 with the same --pp: pp 2 × dp 1 with accumulation 2
    (each accumulated micro-batch one schedule of 2 micro-batches): the run's losses."""
    root, ref = pipelined
    ckpt = _interrupted_at(root / "ref-ckpt", 3, tmp_path / "ckpt")
    capsys.readouterr()
    got = _train(tmp_path, "resumed", "--nproc", "2", *PP, "--resume", ckpt=ckpt)
    err = capsys.readouterr().err
    assert "pp 2 × dp 2 × tp 1 → pp 2 × dp 1 × tp 1, accumulation 1 → 2" in err, err
    assert (got["pp"], got["dp"], got["grad_accum"], got["micro_batch"]) == (2, 1, 2, 4)
    _assert_same_losses(got, ref)


@pytest.mark.slow
def test_pp_resume_chooses_a_pp_that_fits(pipelined, tmp_path, capsys):
    """On 1 rank pp 2 does not fit: the rebalancer chooses pp 1 (accumulation 2), and says so;
    the unit: a 3-rank resume has no pp × tp layout for micro-batches of 4 and 8 sequences."""
    root, ref = pipelined
    ckpt = _interrupted_at(root / "ref-ckpt", 3, tmp_path / "ckpt")
    cfg = TrainConfig(pp=2, microbatches=2, batch=8, seq=16, steps=STEPS, ckpt_dir=str(ckpt),
                      resume=True)
    plan = rebalance(cfg, 1)
    assert (plan.cfg.pp, plan.cfg.tp, plan.cfg.grad_accum) == (1, 1, 2)
    assert plan.notes[0].startswith("pp 2 does not fit 1 ranks (")
    with pytest.raises(ValueError, match="cannot resume .* on 3 ranks: no pp × tp layout"):
        rebalance(cfg, 3)
    capsys.readouterr()
    got = _train(tmp_path, "resumed", "--nproc", "1", *PP, "--resume", ckpt=ckpt)
    assert "pp 2 × dp 2 × tp 1 → dp 1 × tp 1, accumulation 1 → 2" in capsys.readouterr().err
    assert (got["pp"], got["grad_accum"]) == (1, 2)
    _assert_same_losses(got, ref)
