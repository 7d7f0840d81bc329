"""Under ``torchrun``: ``launch`` runs on the job's own ranks, every rank exits cleanly (no SIGABRT at
interpreter exit), and the commands print their result once.

Each ``torchrun`` start costs 3–10 s here, so all but one representative check are ``slow``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "GROUP_RANK")
RUN_TIMEOUT_S = 240


def torchrun(nproc: int, *argv: str, cwd=None) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node N ARGV`` (a free port: other jobs may run), killed
    with its ranks if it outlives ``RUN_TIMEOUT_S``."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    cmd = [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", *argv]
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun {' '.join(argv)} still ran after {RUN_TIMEOUT_S} s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def assert_clean_exit(run: subprocess.CompletedProcess) -> None:
    assert run.returncode == 0, run.stderr[-3000:]
    for needle in ("terminate called", "SIGABRT", "Signal 6"):
        assert needle not in run.stderr, run.stderr[-3000:]


LAUNCH_SCRIPT = textwrap.dedent("""
    import torch
    import ops_transformer as ot
    from ops_transformer.comm import collectives as C

    def main(scale):
        ctx = ot.init_parallel(tp=2)
        t = torch.full((2,), float(ctx.rank + 1) * scale)
        C.all_reduce(t, ctx.tp_group)
        return ctx.rank, t.tolist()

    if __name__ == "__main__":                # the pattern of the docs: works both ways
        results = ot.launch(main, 2, 10.0)   # under torchrun: this rank's result at its index
        # one write per line: two ranks share torchrun's stdout pipe, and print() with several
        # arguments writes piecewise when unbuffered (lines interleaved in CI)
        import sys
        sys.stdout.write(f"results {results}\\n"); sys.stdout.flush()
""")


@pytest.mark.slow  # a torchrun job (~10 s on 2 cores)
def test_launch_inside_torchrun_runs_on_the_jobs_ranks(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(LAUNCH_SCRIPT)
    run = torchrun(2, str(script))
    assert_clean_exit(run)
    lines = sorted(line for line in run.stdout.splitlines() if line.startswith("results"))
    assert lines == ["results [(0, [30.0, 30.0]), None]", "results [None, (1, [30.0, 30.0])]"]


COLLECTIVES_SCRIPT = textwrap.dedent("""
    import torch
    import ops_transformer as ot
    from ops_transformer.comm import collectives as C

    ctx = ot.init_parallel(tp=int(__import__("sys").argv[1]))
    for _ in range(3):
        t = torch.ones(8)
        C.all_reduce(t, ctx.tp_group)
    assert t[0].item() == ctx.tp_size
""")


@pytest.mark.slow
@pytest.mark.parametrize("nproc,repeats", [(2, 10), (4, 3)])
def test_script_that_simply_returns_exits_cleanly(tmp_path, nproc, repeats):
    script = tmp_path / "script.py"
    script.write_text(COLLECTIVES_SCRIPT)
    for _ in range(repeats):
        assert_clean_exit(torchrun(nproc, str(script), str(nproc)))


@pytest.mark.slow
@pytest.mark.parametrize("nproc,repeats", [(2, 10), (4, 3)])
def test_train_under_torchrun_exits_cleanly(tmp_path, nproc, repeats):
    for i in range(repeats):
        out = tmp_path / f"run{i}"
        run = torchrun(nproc, "-m", "ops_transformer.cli.main", "train", "--tp", "2", "--steps",
                       "2", "--batch", "4", "--seq", "32", "--no-progress", "--json", "--out",
                       str(out))
        assert_clean_exit(run)
        metrics = json.loads(run.stdout)  # one document: rank 0's
        assert metrics["tp"] == 2 and metrics["dp"] == nproc // 2 and len(metrics["losses"]) == 2


def _tiny_llama(path: Path) -> None:
    import torch
    import transformers as tr

    torch.manual_seed(0)
    tr.LlamaForCausalLM(tr.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2,
                                       max_position_embeddings=64, vocab_size=300)
                        ).save_pretrained(path)


@pytest.mark.slow
def test_generate_and_embed_print_one_json_document_under_torchrun(tmp_path):
    pytest.importorskip("transformers")
    _tiny_llama(tmp_path)
    gen = torchrun(2, "-m", "ops_transformer.cli.main", "generate", "--model", str(tmp_path),
                   "--tp", "2", "--prompt", "def f(", "--max-new-tokens", "4", "--json")
    assert_clean_exit(gen)
    assert len(json.loads(gen.stdout)["new_token_ids"]) == 4
    emb = torchrun(2, "-m", "ops_transformer.cli.main", "embed", "--model", str(tmp_path),
                   "--tp", "2", "--text", "a b", "--text", "c d", "--json")
    assert_clean_exit(emb)
    assert json.loads(emb.stdout)["tp"] == 2
