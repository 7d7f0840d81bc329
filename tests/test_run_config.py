"""Issue 34: a run as a file — ``RunConfig``'s typed sections, their flag-named checks, the TOML
file (``train --config``, ``--print-config``, ``OUT/config.toml``) and the flat ``TrainConfig`` the
loop runs from it."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from ops_transformer.cli.main import main
from ops_transformer.parallelize import ParallelOptions
from ops_transformer.training.config import (SECTION_ORDER, LayoutSection, OptimSection,
                                             RunConfig, RunSection, load_toml, to_toml)
from ops_transformer.training.loop import TrainConfig, validate

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
EXAMPLE = EXAMPLES / "tiny_tp2.toml"
WORLD = {"tiny_tp2": 2, "dp2_tp2_zero2_sp": 4, "moe_ep2": 2,  # each example's local ranks
         "lora_finetune": 2}
HF = {"lora_finetune"}  # examples of a --model fine-tune: a tiny Llama and .jsonl data stand in
ODD = TrainConfig(preset="moe-tiny", tp=2, dp=2, ep=2, steps=7, batch=16, seq=32, lr=1e-4,
                  seed=3, attention="heads", data="corpus.txt", out="runs/x", progress=False,
                  layers=1, ranks_per_node=2, precision="bf16", clip_grad=0.5, zero=2,
                  sequence_parallel="regather", recompute="selective", overlap="chunked",
                  chunks=3, ckpt_dir="ck", save_every=2, resume="strict", keep_checkpoints=2,
                  on_save_error="continue", lr_schedule="cosine", warmup=2, grad_accum=2,
                  lora_rank=4, lora_alpha=8.0, lora_targets=("*.q", "*.v"), dropout=0.1,
                  moe_statistics="global", cp_strategy="ring", pack="naive", pp_schedule="gpipe",
                  microbatches=2, compile_backend="eager", sample_prompt='say "hi"\n')


def test_every_train_config_field_is_one_section_field():
    assert set(RunConfig().train_fields()) == {f.name for f in dataclasses.fields(TrainConfig)}
    assert TrainConfig.from_run_config(RunConfig()) == TrainConfig()  # defaults defined once


def test_train_config_round_trips_through_sections_and_toml(tmp_path):
    run = ODD.run_config()
    assert isinstance(run.parallel, ParallelOptions) and run.parallel.chunks == 3
    assert run.layout.tp == 2 and run.optim.clip == 0.5 and run.model.dir is None
    assert TrainConfig.from_run_config(run) == ODD
    (tmp_path / "run.toml").write_text(to_toml(run))
    loaded, in_file = load_toml(tmp_path / "run.toml")
    assert loaded == run and TrainConfig.from_run_config(loaded) == ODD
    assert {"tp", "clip_grad", "lora_targets", "cp_strategy"} <= in_file
    assert "dp" not in to_toml(RunConfig())  # unset (None) fields are left out


def test_sections_are_frozen_and_name_their_flag():
    with pytest.raises(dataclasses.FrozenInstanceError):
        RunConfig().run.steps = 3
    for build, message in ((lambda: RunSection(steps=0), "--steps must be at least 1, got 0"),
                           (lambda: LayoutSection(tp=True), "--tp must be an integer, got True"),
                           (lambda: OptimSection(lr=-1), "--lr must be positive, got -1.0"),
                           (lambda: OptimSection(schedule="linear"),
                            "--lr-schedule must be one of constant, cosine, got 'linear'"),
                           (lambda: OptimSection(clip=0), "--clip-grad must be positive"),
                           (lambda: RunSection(progress="no"), "--no-progress must be true/false"),
                           (lambda: RunSection(sample_tokens=-1),  # a field with no flag
                            "[run] sample_tokens must be at least 0")):
        with pytest.raises(ValueError, match="^" + re.escape(message)):
            build()
    assert OptimSection(lr=1).lr == 1.0 and isinstance(OptimSection(lr=1).lr, float)


def test_parallel_precision_follows_optim():
    run = RunConfig(optim=OptimSection(precision="fp8"))
    assert run.parallel.precision == "fp8"
    assert RunConfig(optim=OptimSection(precision="bf16")).parallel.precision == "fp32"


@pytest.mark.parametrize("text, says", [
    ("[run]\nstepz = 1\n", "unknown key 'stepz' in [run]; valid keys: steps, batch,"),
    ("[runs]\nsteps = 1\n", "unknown section [runs]; the sections are [model], [layout]"),
    ('[optim]\nlr = "fast"\n', '[optim] lr = "fast": --lr must be a number, got \'fast\''),
    ("[run]\nbatch = 0\n", "[run] batch = 0: --batch must be at least 1, got 0"),
    ("[parallel]\nchunks = 0\n", "[parallel] chunks = 0: --chunks must be an integer >= 1"),
    ("[parallel]\nattention = \"wide\"\n", "--attention must be one of"),
    ("[optim]\nzero = 4\n", "[optim] zero = 4: --zero must be one of 0, 1, 2, 3, got 4"),
    ("steps = = 2\n", "is not a TOML file"),
])
def test_bad_file_is_one_line_naming_file_key_and_what_is_valid(tmp_path, text, says):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        load_toml(path)
    assert says in str(err.value) and f"--config {str(path)!r}" in str(err.value)
    assert "\n" not in str(err.value)


def _resolved(capsys, *argv) -> str:
    assert main(["train", *argv, "--print-config"]) == 0
    return capsys.readouterr().out


def test_print_config_flags_over_file_over_defaults(tmp_path, capsys):
    out = _resolved(capsys, "--config", str(EXAMPLE), "--steps", "3", "--no-prog",
                    "--out", str(tmp_path / "o"))
    (tmp_path / "resolved.toml").write_text(out)
    run, _ = load_toml(tmp_path / "resolved.toml")
    assert run.run.steps == 3 and run.run.progress is False  # flags (abbreviated too)
    assert run.layout.tp == 2 and run.optim.schedule == "cosine"  # the file
    assert run.run.sample_tokens == TrainConfig.sample_tokens  # the defaults
    assert run.parallel.attention == "heads"
    assert not (tmp_path / "o").exists()  # no rank started, nothing written
    assert [line.strip("[]") for line in out.splitlines() if line.startswith("[")] == \
        list(SECTION_ORDER)


def test_model_flag_replaces_the_files_model(tmp_path, capsys):
    (tmp_path / "m.toml").write_text('[model]\ndir = "some-hf-dir"\n')
    out = _resolved(capsys, "--config", str(tmp_path / "m.toml"), "--preset", "small")
    assert 'preset = "small"' in out and "dir =" not in out.split("[layout]")[0]


def test_bad_config_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys):
    (tmp_path / "bad.toml").write_text(f'[run]\nout = "{tmp_path / "o"}"\nseq = "long"\n')
    assert main(["train", "--config", str(tmp_path / "bad.toml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "[run] seq = \"long\": --seq must be an integer" in err
    assert not (tmp_path / "o").exists()


def _train(tmp_path, capsys, name, *argv) -> dict:
    out = tmp_path / name
    assert main(["train", *argv, "--out", str(out), "--json"]) == 0
    capsys.readouterr()
    return json.loads((out / "metrics.json").read_text())


def test_example_runs_two_steps_and_its_resolved_file_reproduces_it(tmp_path, capsys):
    (tmp_path / "data.txt").write_text("def add(x, y):\n    return x + y\n" * 200)
    first = _train(tmp_path, capsys, "a", "--config", str(EXAMPLE), "--tp", "1", "--steps",
                   "2", "--seq", "16", "--batch", "2",
                   "--data", str(tmp_path / "data.txt"), "--no-progress")
    resolved = tmp_path / "a" / "config.toml"
    run, _ = load_toml(resolved)
    assert run.run.steps == 2 and run.optim.schedule == "cosine" and run.layout.tp == 1
    again = _train(tmp_path, capsys, "b", "--config", str(resolved))
    assert len(first["losses"]) == 2 and again["losses"] == first["losses"]  # bit for bit


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    """The flags that give an example a model and data of this machine: a text file, and for a
    ``--model`` example a tiny Llama (with its tokenizer) and ``.jsonl`` documents."""
    import hf_tiny

    root = tmp_path_factory.mktemp("stand-ins")
    (root / "data.txt").write_text("def add(x, y):\n    return x + y\n" * 400)
    (root / "data.jsonl").write_text("\n".join(json.dumps({"text": f"{hf_tiny.TEXT} #{i}"})
                                               for i in range(40)))
    pytest.importorskip("transformers")
    llama = hf_tiny.checkpoint(tmp_path_factory, "llama", tokenizer=True)
    return {False: ["--data", str(root / "data.txt")],
            True: ["--model", str(llama), "--data", str(root / "data.jsonl")]}


@pytest.mark.parametrize("name", sorted(WORLD))
def test_every_example_prints_and_validates_at_its_size(name, tmp_path, capsys, stand_ins):
    assert sorted(p.stem for p in EXAMPLES.glob("*.toml")) == sorted(WORLD)
    given = stand_ins[name in HF]
    (tmp_path / "r.toml").write_text(_resolved(capsys, "--config", str(EXAMPLES / f"{name}.toml"),
                                               "--out", str(tmp_path / "o"), *given))
    run, _ = load_toml(tmp_path / "r.toml")
    written, _ = load_toml(EXAMPLES / f"{name}.toml")
    model = dataclasses.replace(written.model, dir=given[1]) if name in HF else written.model
    assert run == dataclasses.replace(written, model=model, data=dataclasses.replace(
        written.data, path=given[-1]), run=dataclasses.replace(written.run, out=str(tmp_path / "o")))
    dp, tp = validate(TrainConfig.from_run_config(run), WORLD[name])
    assert dp * tp * run.layout.ep == WORLD[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(WORLD))
def test_example_runs_as_written(name, tmp_path, capsys, stand_ins):
    metrics = _train(tmp_path, capsys, "a", "--config", str(EXAMPLES / f"{name}.toml"),
                     "--steps", "3", *stand_ins[name in HF], "--no-progress",
                     "--ckpt-dir", str(tmp_path / "ckpt"))
    run, _ = load_toml(EXAMPLES / f"{name}.toml")
    assert (metrics["tp"], metrics["dp"], metrics.get("ep", 1)) == \
        (run.layout.tp, WORLD[name] // (run.layout.tp * run.layout.ep), run.layout.ep)
    assert len(metrics["losses"]) == 3  # 3 steps: the LoRA example warms up over 2


def test_without_argv_the_flags_that_differ_from_the_defaults_override(tmp_path, capsys):
    from ops_transformer.cli import train
    from ops_transformer.cli.main import build_parser

    args = build_parser().parse_args(["train", "--config", str(EXAMPLE), "--steps", "3",
                                      "--print-config"])
    assert train.run(args) == 0  # no args.argv: as a caller of run() builds it
    run = load_toml_text(tmp_path, capsys.readouterr().out)
    assert run.run.steps == 3 and run.layout.tp == 2 and run.run.out.startswith("runs/train-")


def load_toml_text(tmp_path, text: str) -> RunConfig:
    (tmp_path / "t.toml").write_text(text)
    return load_toml(tmp_path / "t.toml")[0]


# --config for the commands that measure a run (profile, diagnose, sweep): flags > file > defaults
def test_diagnose_takes_a_config_file_under_its_flags(tmp_path, capsys):
    (tmp_path / "tp3.toml").write_text("[layout]\ntp = 3\n[run]\nbatch = 6\n")
    assert main(["diagnose", "--config", str(tmp_path / "tp3.toml"), "--static", "--json"]) == 1
    found = json.loads(capsys.readouterr().out)["diagnostics"]
    assert any(d["code"] == "not_divisible" for d in found)  # the file's tp 3: FFN 256 over 3
    assert main(["diagnose", "--config", str(tmp_path / "tp3.toml"), "--tp", "2", "--static",
                 "--json"]) == 0  # the flag over the file
    assert not any(d["code"] == "not_divisible"
                   for d in json.loads(capsys.readouterr().out)["diagnostics"])


def test_profile_takes_a_config_file_and_keeps_its_own_steps(tmp_path, capsys, monkeypatch):
    from ops_transformer.cli import train as train_cli

    seen = []
    monkeypatch.setattr(train_cli, "run_training", lambda cfg, *a, **k: seen.append(cfg))
    assert main(["profile", "--config", str(EXAMPLE), "--seq", "32", "--warmup", "1",
                 "--out", str(tmp_path / "p")]) == 0
    cfg = seen[0]
    assert (cfg.tp, cfg.lr_schedule, cfg.warmup, cfg.clip_grad) == (2, "cosine", 1, 1.0)  # file
    assert cfg.seq == 32 and cfg.steps == 5  # the flag; profile's own (profiled) steps
    assert cfg.attention == "heads" and cfg.batch == 8


def test_sweep_takes_a_config_file_as_every_configurations_base(tmp_path, capsys,
                                                                 monkeypatch):
    from ops_transformer.cli import sweep

    seen = []

    def fake(base, axes, nproc, warmup, **_):
        seen.append((base, axes, nproc))
        return {"axes": axes, "unavailable": {}, "nproc": nproc, "prediction_model": "-",
                "steps": base.steps, "warmup": warmup, "preset": base.preset, "model": None,
                "batch": base.batch, "seq": base.seq, "rows": []}

    monkeypatch.setattr(sweep, "run_sweep", fake)
    assert main(["sweep", "--config", str(EXAMPLE), "--tp", "1,2", "--lr", "1e-4", "--steps",
                 "2", "--json", "--no-progress", "--out", str(tmp_path / "s")]) == 0
    base, axes, nproc = seen[0]
    assert axes == {"tp": [1, 2]} and nproc == 2
    assert (base.lr, base.steps) == (1e-4, 2)  # the flags
    assert (base.lr_schedule, base.clip_grad, base.attention, base.seq) == \
        ("cosine", 1.0, "heads", 64)  # the file


# the command line and the sections: a field cannot exist without its flag, nor a flag without
# its field (but the launcher's and the output's), and train --help shows them by section
CLI_ONLY = {"--help", "--debug", "--config", "--print-config", "--dry-run", "--nproc", "--plan",
            "--json", "--launch-timeout"}


def _train_parser():
    from ops_transformer.cli.main import build_parser

    parser = build_parser(("train",))
    return next(a for a in parser._actions if a.dest == "command").choices["train"]


def test_every_section_field_has_its_flag_and_every_flag_its_field():
    from ops_transformer.training.config import PARALLEL_FIELDS, SECTIONS, flag_of, section_flags

    train = _train_parser()
    options = {s for a in train._actions for s in a.option_strings if s.startswith("--")}
    fields_with_flags = set(section_flags())
    assert fields_with_flags <= options, sorted(fields_with_flags - options)
    assert options - fields_with_flags == CLI_ONLY
    file_only = {(name, f.name) for name, kind in SECTIONS.items()
                 for f in dataclasses.fields(kind) if not flag_of(f).startswith("--")}
    assert file_only == {("model", "layers"), ("run", "sample_tokens"), ("run", "sample_prompt")}
    assert len(fields_with_flags) == sum(len(dataclasses.fields(k)) for k in SECTIONS.values()) \
        - len(file_only) + len(PARALLEL_FIELDS)


def test_train_help_groups_the_flags_by_section():
    from ops_transformer.training.config import section_flags

    train = _train_parser()
    groups = {g.title: {s for a in g._group_actions for s in a.option_strings}
              for g in train._action_groups}
    for flag, section in section_flags().items():
        assert flag in groups[section], (flag, section)
    text = train.format_help()
    heads = [line.rstrip(":") for line in text.splitlines() if line.rstrip(":") in groups]
    assert heads == ["options", *SECTION_ORDER, "launch and output"]
    assert "  [layout] The rank grid" in text


def test_each_flags_choices_and_default_are_its_fields():
    """The flags take their choices and defaults from the sections (defined once): an argparse
    default is the field's, or unset (``None``: the field's default applies, and the flag counts
    as not given)."""
    from ops_transformer.training.config import PARALLEL_FIELDS, SECTIONS, flag_of

    by_flag = {a.option_strings[0]: a for a in _train_parser()._actions if a.option_strings}
    defaults = RunConfig().train_fields()
    checked = 0
    for name, kind in SECTIONS.items():
        for f in dataclasses.fields(kind):
            action = by_flag.get(flag_of(f))
            if action is None or flag_of(f) == "--no-progress":  # the inverted store_true
                continue
            train = f.metadata.get("train_field") or f.name
            assert action.default in (None, defaults[train]), (flag_of(f), action.default)
            if action.choices is not None and f.metadata.get("choices") is not None:
                assert set(action.choices) <= set(f.metadata["choices"]), flag_of(f)
            checked += 1
    for option, train in PARALLEL_FIELDS.items():
        action = by_flag["--" + train.replace("_", "-")]
        assert action.default in (None, getattr(ParallelOptions(), option)), train
        if action.choices is not None:
            from ops_transformer.schema.parallel_options import CHOICES

            assert set(action.choices) <= set(CHOICES[option]), train
        checked += 1
    assert checked > 40


def test_a_field_without_its_flag_stops_the_parser(monkeypatch):
    from ops_transformer.cli import train_flags

    monkeypatch.setitem(train_flags.FLAGS, "run", {k: v for k, v in train_flags.FLAGS["run"].items()
                                                   if k != "seed"})
    with pytest.raises(RuntimeError, match=r"fields without a flag \[\('run', 'seed'\)\]"):
        _train_parser()
    monkeypatch.setitem(train_flags.FLAGS, "run", {**train_flags.FLAGS["run"], "seed": {"help": ""},
                                                   "nope": {"help": ""}})
    with pytest.raises(RuntimeError, match=r"flags without a field \[\('run', 'nope'\)\]"):
        _train_parser()


# --- YAML: the same sections, read by PyYAML's safe_load -------------------------------------------

def _as_yaml(run_toml: Path) -> str:
    """The YAML form of a TOML run configuration (each section a mapping, each value plain)."""
    import tomllib

    import yaml

    return yaml.safe_dump(tomllib.loads(run_toml.read_text()), sort_keys=False)


def test_a_yaml_file_is_the_same_run_as_its_toml(tmp_path, capsys):
    """``--config run.yaml`` resolves to exactly the run of the TOML file it was written from:
    the same ``RunConfig``, the same fields set, the same ``--print-config``."""
    path = tmp_path / "run.yaml"
    path.write_text(_as_yaml(EXAMPLE))
    assert load_toml(path) == load_toml(EXAMPLE)
    assert _resolved(capsys, "--config", str(path)) == _resolved(capsys, "--config", str(EXAMPLE))


@pytest.mark.parametrize("text, says", [
    ("run:\n  stepz: 1\n", "unknown key 'stepz' in [run]"),
    ("run:\n  batch: 0\n", "[run] batch = 0: --batch must be at least 1, got 0"),
    ("- 1\n- 2\n", "a YAML run configuration is a mapping of sections"),
    ("run: [1, 2\n", "is not a YAML file"),
])
def test_bad_yaml_is_one_line_naming_the_file(tmp_path, text, says):
    path = tmp_path / "run.yml"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        load_toml(path)
    assert says in str(err.value) and f"--config {str(path)!r}" in str(err.value)
    assert "\n" not in str(err.value)
