"""Multi-node launch: two ``torchrun --nnodes 2 --nproc-per-node 2`` agents on this machine (two
"nodes" meeting at a c10d rendezvous) train the ``tiny`` preset for 5 steps at dp 2 × tp 2, with the
losses of the same run under the local launcher (``train --nproc 4``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from ops_transformer.cli.main import main

ARGS = ["train", "--tp", "2", "--dp", "2", "--steps", "5", "--preset", "tiny", "--batch", "8",
        "--seq", "64", "--no-progress", "--json"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_torchrun_nodes_match_the_local_launcher(tmp_path, capsys):
    port, out = _free_port(), tmp_path / "torchrun"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
               f"127.0.0.1:{port}", "--rdzv-id", f"ops-transformer-test-{port}",
               "--max-restarts", "0", "-m", "ops_transformer.cli.main", *ARGS, "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True) for _ in range(2)]
    try:
        results = [a.communicate(timeout=600) for a in agents]
    finally:
        for a in agents:
            a.kill()
    for agent, (_, err) in zip(agents, results):
        assert agent.returncode == 0, err[-3000:]
    multi = json.loads((out / "metrics.json").read_text())
    assert (multi["dp"], multi["tp"], multi["ranks_per_node"]) == (2, 2, 2)
    # tensor parallelism stayed inside each node; the data-parallel gradients crossed nodes
    intra = {k: {"calls": v["calls"], "elements": v["elements"]}
             for k, v in multi["comm_by_level"]["intra"].items()}
    assert intra == multi["expected_tp_comm_per_step"]
    # across nodes: the data-parallel gradient bucket, and the step's metrics over all ranks
    assert set(multi["comm_by_level"]["inter"]) == {"all_reduce"}
    assert multi["comm_by_level"]["inter"]["all_reduce"]["calls"] == 2

    assert main(ARGS + ["--nproc", "4", "--out", str(tmp_path / "local")]) == 0
    local = json.loads(capsys.readouterr().out)
    assert local["ranks_per_node"] == 4
    assert len(multi["losses"]) == 5
    assert multi["losses"] == pytest.approx(local["losses"], rel=1e-6, abs=0)
