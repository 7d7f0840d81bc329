"""``train --pp``: the losses and the clipped gradient norm of a pipelined run equal the run on
one process (the dense norm over every stage, the tied embedding counted once), and a split the
layers do not divide is a one-line error before any rank starts."""

from __future__ import annotations

import json

import pytest

from ops_transformer.cli.main import main

ARGS = ["--preset", "tiny", "--steps", "3", "--batch", "4", "--seq", "32", "--clip-grad", "0.05",
        "--no-progress"]


def _run(tmp_path, name, *flags):
    out = tmp_path / name
    assert main(["train", *flags, *ARGS, "--out", str(out)]) == 0
    return json.loads((out / "metrics.json").read_text())


@pytest.mark.parametrize("flags", [
    ("--nproc", "2", "--pp", "2", "--pp-schedule", "gpipe", "--microbatches", "4"),
    ("--nproc", "4", "--pp", "2", "--tp", "2", "--pp-schedule", "1f1b", "--microbatches", "2"),
    ("--nproc", "4", "--pp", "2", "--zero", "2", "--pp-schedule", "1f1b", "--microbatches", "2"),
])
def test_train_pp_equals_one_process(tmp_path, flags):
    one = _run(tmp_path, "one", "--nproc", "1")
    piped = _run(tmp_path, "pp", *flags)
    assert piped["pp"] == 2 and piped["microbatches"] == int(flags[-1])
    # fp32, Adam over 3 steps: the stages sum the same terms in another order
    assert piped["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert piped["grad_norm_last"] == pytest.approx(one["grad_norm_last"], rel=1e-5)  # clipped


@pytest.mark.parametrize("flags, match", [
    (["--nproc", "2", "--pp", "2", "--pp-schedule", "interleaved", "--stages-per-rank", "2"],
     "--pp 2: pp \\(2\\) × stages_per_rank \\(2\\) = 4 stages, more than the model's 2 layers"),
    (["--nproc", "3", "--pp", "3"], "--pp 3: pp \\(3\\) × stages_per_rank \\(1\\) = 3 stages, "
                                    "more than the model's 2 layers"),
    (["--nproc", "2", "--pp", "2", "--microbatches", "3"],
     "--batch 4 over 1 data-parallel rank\\(s\\) does not split into --microbatches 3"),
    (["--nproc", "4", "--pp", "2", "--microbatches", "2", "--zero", "3"],
     "does not combine with --zero 3"),
])
def test_train_pp_bad_split_is_one_line(capsys, flags, match):
    import re

    assert main(["train", *flags, *ARGS]) == 2
    err = capsys.readouterr().err.strip()
    assert re.search(match, err), err
    assert len(err.splitlines()) == 1


@pytest.mark.slow  # ~3 s each: two train runs (the unit tests: tests/parallelize/test_pipeline.py)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_train_pp_16bit_equals_one_process(tmp_path, precision):
    """``--pp 2 --precision bf16|fp16``: the stages' forwards under autocast, fp16's loss scale
    and overflow skips agreed over both stages: the losses equal one process within ``check``'s
    16-bit loss bound, and fp16 skips the same steps."""
    from ops_transformer.parity.tolerance import tolerance_for

    flags = ("--precision", precision)
    one = _run(tmp_path, "one", "--nproc", "1", *flags)
    piped = _run(tmp_path, "pp", "--nproc", "2", "--pp", "2", "--microbatches", "2", *flags)
    assert piped["losses"] == pytest.approx(one["losses"], rel=tolerance_for(precision).loss)
    assert ("skipped_steps" in piped) == (precision == "fp16")
    assert piped.get("skipped_steps") == one.get("skipped_steps")
