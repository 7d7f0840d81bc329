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
    pytest.param(("--nproc", "4", "--pp", "2", "--zero", "3", "--pp-schedule", "gpipe",
                  "--microbatches", "2"), marks=pytest.mark.slow),
])
def test_train_pp_equals_one_process(tmp_path, flags):
    one = _run(tmp_path, "one", "--nproc", "1")
    piped = _run(tmp_path, "pp", *flags)
    assert piped["pp"] == 2 and piped["microbatches"] == int(flags[-1])
    # fp32, Adam over 3 steps: the stages sum the same terms in another order
    assert piped["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert piped["grad_norm_last"] == pytest.approx(one["grad_norm_last"], rel=1e-5)  # clipped


MOE = ["--preset", "moe-tiny", "--steps", "3", "--batch", "4", "--seq", "32", "--clip-grad",
       "0.05", "--no-progress"]


@pytest.mark.parametrize("one_flags, pp_flags", [
    (("--nproc", "1", "--grad-accum", "2"), ("--nproc", "2", "--pp", "2", "--microbatches", "2")),
    pytest.param(("--nproc", "2", "--ep", "2", "--grad-accum", "2"),
                 ("--nproc", "4", "--pp", "2", "--ep", "2", "--microbatches", "2"),
                 marks=pytest.mark.slow),
])
def test_train_pp_moe_equals_the_same_micro_batches(tmp_path, one_flags, pp_flags):
    """``--pp 2 --microbatches m`` on the MoE preset (``--ep 2`` inside each stage too) equals
    one stage with ``--grad-accum m``: each micro-batch routed by itself, every stage's
    load-balancing loss in the loss and the gradients (the clipped norm), the MoE statistics."""
    def run(name, flags):
        out = tmp_path / name
        assert main(["train", *flags, *MOE, "--out", str(out)]) == 0
        return json.loads((out / "metrics.json").read_text())

    one, piped = run("one", one_flags), run("pp", pp_flags)
    assert piped["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert piped["grad_norm_last"] == pytest.approx(one["grad_norm_last"], rel=1e-5)  # clipped
    for key in ("aux_loss", "dropped_fraction"):
        assert piped["moe"][key] == pytest.approx(one["moe"][key], rel=1e-5)


@pytest.mark.parametrize("flags, match", [
    (["--nproc", "2", "--pp", "2", "--pp-schedule", "interleaved", "--stages-per-rank", "2"],
     "--pp 2: pp \\(2\\) × stages_per_rank \\(2\\) = 4 stages, more than the model's 2 layers"),
    (["--nproc", "3", "--pp", "3"], "--pp 3: pp \\(3\\) × stages_per_rank \\(1\\) = 3 stages, "
                                    "more than the model's 2 layers"),
    (["--nproc", "2", "--pp", "2", "--microbatches", "3"],
     "--batch 4 over 1 data-parallel rank\\(s\\) does not split into --microbatches 3"),
    (["--nproc", "4", "--pp", "2", "--microbatches", "2", "--cp", "2"], "--pp 2 does not "
     "combine with --cp yet"),
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


def _hf_data(tmp_path):
    import hf_tiny

    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"{hf_tiny.TEXT} #{i}"}) for i in range(12))
                    + "\n")
    return path


HF_ARGS = ["--steps", "3", "--batch", "4", "--seq", "32", "--lr", "1e-3", "--clip-grad", "0.5",
           "--no-progress"]  # --pack docs (the default), except where a case says naive


def _run_hf(tmp_path, model_dir, data, name, *flags):
    out = tmp_path / name
    assert main(["train", "--model", str(model_dir), "--data", str(data), *flags, *HF_ARGS,
                 "--out", str(out)]) == 0
    return json.loads((out / "metrics.json").read_text())


@pytest.mark.parametrize("family,flags", [
    ("llama", ("--nproc", "2", "--pp", "2", "--microbatches", "2")),
    ("gpt2", ("--nproc", "2", "--pp", "2", "--pp-schedule", "gpipe", "--microbatches", "2",
              "--grad-accum", "2", "--pack", "naive")),
    pytest.param("llama", ("--nproc", "4", "--pp", "2", "--tp", "2", "--microbatches", "2"),
                 marks=pytest.mark.slow),
    pytest.param("qwen2", ("--nproc", "4", "--pp", "2", "--zero", "3", "--microbatches", "2"),
                 marks=pytest.mark.slow),
    pytest.param("llama", ("--nproc", "2", "--pp", "2", "--microbatches", "2", "--lora-rank", "4"),
                 marks=pytest.mark.slow),
])
def test_train_hf_model_pp_equals_one_process(tmp_path_factory, tmp_path, family, flags):
    """``train --model DIR --pp 2`` (GPT-2: tied embeddings between the end stages, 2 accumulated
    schedules of 2 micro-batches; Llama at
    pp 2 × tp 2: the vocab-parallel loss on the last stage; Qwen2 with ZeRO-3; Llama with LoRA
    adapters added before the split): the losses and the clipped norm of one process within 1e-5
    over 3 Adam steps."""
    import hf_tiny

    model_dir = hf_tiny.checkpoint(tmp_path_factory, family, tokenizer=family == "llama")
    data = _hf_data(tmp_path)
    same = [f for pair in (("--lora-rank", "4"), ("--pack", "naive")) if pair[0] in flags
            for f in pair]  # on both runs
    one = _run_hf(tmp_path, model_dir, data, "one", "--nproc", "1", *same)
    piped = _run_hf(tmp_path, model_dir, data, "pp", *flags)
    assert piped["pp"] == 2 and piped["model_dir"] == str(model_dir)
    assert piped["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert piped["grad_norm_last"] == pytest.approx(one["grad_norm_last"], rel=1e-5)


def test_train_hf_model_pp_refusals_are_one_line(tmp_path_factory, tmp_path, capsys):
    import re

    import hf_tiny

    data = _hf_data(tmp_path)
    for family, extra, match in (
            ("mixtral", [], "--pp 2 does not split MixtralForCausalLM yet"),
            ("llama", ["--pp-schedule", "interleaved"],
             "--pp 2: pp \\(2\\) × stages_per_rank \\(2\\) = 4 stages, more than the model's 2")):
        model_dir = hf_tiny.checkpoint(tmp_path_factory, family, tokenizer=family == "llama")
        argv = ["train", "--model", str(model_dir), "--data", str(data), "--nproc", "2", "--pp",
                "2", "--microbatches", "2", "--steps", "1", "--batch", "4", "--seq", "32",
                "--no-progress", *extra]
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert re.search(match, err), err
        assert len(err.splitlines()) == 1
