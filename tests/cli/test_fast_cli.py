"""Issue 35 item 9: ``train --help`` and an argument error import no torch (torch's import alone
is about 2 s on the 2-core machine; with it ``--help`` took ~5 s and ``--tp 3`` ~4 s). Each check
runs in a fresh interpreter and asserts what it imported, not how long it took (the measured times
are in docs/run_config.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")
TORCH_FREE_HELP = ("train", "profile", "diagnose", "bench", "checkpoint")  # the rest still import it for --help


def _fresh(code: str) -> dict:
    """Run ``code`` in a new interpreter; it leaves its result in ``out`` (a dict), to which is
    added whether torch (or transformers) was imported."""
    script = (f"import sys\nsys.path.insert(0, {SRC!r})\nout = {{}}\n{code}\n"
              "out['torch'] = 'torch' in sys.modules\n"
              "out['transformers'] = 'transformers' in sys.modules\n"
              "print('RESULT ' + __import__('json').dumps(out))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):]) | {"stderr": done.stderr}


def test_the_parser_and_the_run_configuration_import_no_torch():
    out = _fresh("import ops_transformer.cli.main, ops_transformer.cli.train_args\n"
                 "import ops_transformer.training.config, ops_transformer.training.preflight\n"
                 "import ops_transformer.schema.parallel_options, ops_transformer.models.config\n"
                 "from ops_transformer.training.config import RunConfig, to_toml\n"
                 "out['toml'] = to_toml(RunConfig())[:7]")
    assert out["toml"] == "[model]"
    assert not out["torch"] and not out["transformers"]


@pytest.mark.parametrize("command", TORCH_FREE_HELP)
def test_help_exits_0_without_torch(command):
    out = _fresh("from ops_transformer.cli.main import main\n"
                 "import contextlib, io\n"
                 "buf = io.StringIO()\n"
                 "try:\n"
                 "    with contextlib.redirect_stdout(buf):\n"
                 f"        main([{command!r}, '--help'])\n"
                 "except SystemExit as exc:\n"
                 "    out['code'] = exc.code\n"
                 "out['help'] = buf.getvalue()")
    assert out["code"] == 0 and f"usage: ops-transformer {command}" in out["help"]
    assert not out["torch"], f"{command} --help imported torch"


@pytest.mark.parametrize("argv,message", [
    (["train", "--preset", "tiny", "--tp", "3"], "d_ff (256) is not divisible by tp (3)"),
    (["train", "--tp", "2", "--nproc", "3"], "world size 3 is not divisible by tp (2)"),
    (["train", "--tp", "2", "--batch", "3", "--nproc", "4"],
     "--batch (3) must be divisible by dp (2)"),
    (["train", "--preset", "nope"], "unknown preset 'nope'"),
    (["profile", "--tp", "3", "--nproc", "3"], "d_ff (256) is not divisible by tp (3)"),
])
def test_an_argument_error_is_one_line_exit_2_without_torch(argv, message):
    out = _fresh("from ops_transformer.cli.main import main\n"
                 f"out['code'] = main({argv!r})")
    assert out["code"] == 2
    assert out["stderr"].count("\n") == 1 and message in out["stderr"], out["stderr"]
    assert not out["torch"]


def test_seq_beyond_a_model_directorys_positions_is_refused_without_torch(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama",
                                                      "max_position_embeddings": 128}))
    out = _fresh("from ops_transformer.cli.main import main\n"
                 f"out['code'] = main(['train', '--model', {str(tmp_path)!r}, '--seq', '512'])")
    assert out["code"] == 2 and "--seq 512 is beyond the 128 positions" in out["stderr"]
    assert not out["torch"] and not out["transformers"]


def test_version_names_torch_without_importing_it():
    out = _fresh("from ops_transformer.cli.main import main\n"
                 "import contextlib, io\n"
                 "buf = io.StringIO()\n"
                 "try:\n"
                 "    with contextlib.redirect_stdout(buf):\n"
                 "        main(['--version'])\n"
                 "except SystemExit as exc:\n"
                 "    out['code'] = exc.code\n"
                 "out['text'] = buf.getvalue()")
    assert out["code"] == 0 and "(torch 2." in out["text"] and not out["torch"]


def test_the_checks_before_torch_are_the_checks_validate_makes():
    """preflight runs the functions validate runs (one message each), and lets every run that
    validate accepts through."""
    from ops_transformer.training.config import LayoutSection, RunConfig, RunSection
    from ops_transformer.training.loop import TrainConfig, validate
    from ops_transformer.training.preflight import preflight

    for layout, ranks in ((LayoutSection(tp=3), 3), (LayoutSection(tp=2, dp=2), 3)):
        run = RunConfig(layout=layout)
        with pytest.raises(ValueError) as early:
            preflight(run, ranks)
        with pytest.raises(ValueError) as late:
            validate(TrainConfig.from_run_config(run), ranks)
        assert str(early.value) == str(late.value)
    fine = RunConfig(layout=LayoutSection(tp=2), run=RunSection(batch=4))
    assert preflight(fine, 4) == (2, 1, 1, 2)
    assert validate(TrainConfig.from_run_config(fine), 4) == (2, 2)
