"""The command line: the demo is exact, and user errors exit with code 2 and one clear line."""

from __future__ import annotations

import json

from ops_transformer.cli.main import main


def test_demo_is_exact_and_counts_its_communication(capsys):
    assert main(["demo", "--tp", "2", "--steps", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.split("...\n", 1)[1])
    assert result["max_rel_loss_diff_vs_dense"] <= 1e-5
    assert result["comm_per_step"]["all_reduce"]["calls"] == result["expected_allreduce_per_step"]
    assert set(result["comm_per_step"]) == {"all_reduce"}


def test_bad_argument_exits_2_with_a_clear_message(capsys):
    assert main(["demo", "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert "--tp (3) must divide" in err and "Traceback" not in err
