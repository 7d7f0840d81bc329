"""ParallelContext.close(): process groups are torn down at the end of a job, explicitly, by a
``with`` block or at interpreter exit, and never hang on a peer that is gone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from ops_transformer import ParallelContext, init_parallel
from ops_transformer.comm import collectives as C
from ops_transformer.launch.teardown import destroy_process_groups, settle_native_threads


def _close_twice():
    ctx = init_parallel(tp=2)
    C.all_reduce(torch.ones(2), ctx.tp_group)
    ctx.close()
    closed = not dist.is_initialized()
    ctx.close()  # idempotent
    return closed


def _with_block():
    with init_parallel(tp=2) as ctx:
        t = torch.ones(2)
        C.all_reduce(t, ctx.tp_group)
    return not dist.is_initialized(), t.tolist()


def test_close_is_idempotent_and_a_context_manager(run_ranks):
    assert run_ranks(_close_twice, 2) == [True, True]
    assert run_ranks(_with_block, 2) == [(True, [2.0, 2.0])] * 2


def _close_leaves_a_borrowed_group():
    dist.init_process_group("gloo")  # the user's group: init_parallel only borrows it
    ctx = init_parallel(tp=2)
    ctx.close()
    return dist.is_initialized()


def test_close_leaves_a_group_it_did_not_create(run_ranks):
    assert run_ranks(_close_leaves_a_borrowed_group, 2) == [True, True]


def _close_after_the_peer_left():
    ctx = init_parallel(tp=2)
    C.all_reduce(torch.ones(2), ctx.tp_group)
    if ctx.rank == 1:
        return "left"  # this process exits at once
    time.sleep(1.0)
    ctx.close()
    return not dist.is_initialized()


def test_close_after_the_peer_is_gone(run_ranks):
    assert run_ranks(_close_after_the_peer_left, 2, timeout=60) == [True, "left"]


def _stuck_backend():
    init_parallel(tp=1)
    dist.destroy_process_group = lambda *a: time.sleep(60)  # a backend that never returns
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        done = destroy_process_groups(timeout=0.5)
    return done, [str(w.message) for w in caught]


def test_teardown_is_bounded_by_its_timeout(run_ranks):
    done, messages = run_ranks(_stuck_backend, 1, timeout=60)[0]
    assert done is False and any("did not finish within 0.5 s" in m for m in messages)


def test_single_process_context_closes_as_a_no_op():
    with ParallelContext.single() as ctx:
        assert ctx.world_size == 1
    ctx.close()


SCRIPT = textwrap.dedent("""
    import atexit
    import torch.distributed as dist
    import ops_transformer as ot

    # atexit runs hooks last-in first-out: this one runs after the context's own hook
    atexit.register(lambda: print("initialised at exit:", dist.is_initialized(), flush=True))
    ctx = ot.init_parallel(tp=1)
    print("initialised:", dist.is_initialized(), flush=True)
""")


@pytest.mark.slow  # a fresh interpreter importing torch (~7 s on 2 cores)
def test_a_script_that_simply_returns_tears_its_group_down(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()))
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "initialised: True" in out.stdout and "initialised at exit: False" in out.stdout


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def _no_leftover_group():
    yield
    assert not dist.is_initialized(), "a test left a process group in the test process"


def _rank0_returns_at_once():
    import torch.distributed.device_mesh as dm

    original = dm.new_group
    rank = int(os.environ["RANK"])

    def slow_new_group(*args, ranks=None, **kwargs):
        if rank != 0 and ranks == [rank]:  # a slower peer, still building its own groups
            time.sleep(1.0)
        return original(*args, ranks=ranks, **kwargs)

    dm.new_group = slow_new_group
    ctx = init_parallel(tp=2)  # rank 0 hosts the store every rank's groups rendezvous through
    return ctx.tp_size


def test_a_rank_that_returns_at_once_does_not_break_slower_peers(run_ranks):
    assert run_ranks(_rank0_returns_at_once, 2, timeout=60) == [2, 2]


def _spin(stop: threading.Event, until: float) -> None:
    while not stop.is_set() and time.monotonic() < until:
        pass  # runnable the whole time (it holds the GIL whenever the caller sleeps)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread states come from /proc")
def test_settle_waits_for_a_runnable_thread_and_is_bounded():
    assert settle_native_threads(1.0)  # nothing else runs: settles at once
    stop = threading.Event()
    spinner = threading.Thread(target=_spin, args=(stop, time.monotonic() + 30), daemon=True)
    spinner.start()
    try:
        started = time.monotonic()
        assert settle_native_threads(0.3) is False  # still runnable at the deadline
        assert 0.3 <= time.monotonic() - started < 5
        ends = time.monotonic() + 0.3
        late = threading.Thread(target=_spin, args=(threading.Event(), ends), daemon=True)
        stop.set()
        spinner.join()
        late.start()
        assert settle_native_threads(10.0)  # waits for the late one to finish, no longer
        assert time.monotonic() >= ends and not late.is_alive()
    finally:
        stop.set()


def test_settle_without_thread_states_only_sleeps(tmp_path):
    started = time.monotonic()
    assert settle_native_threads(5.0, task_dir=str(tmp_path / "absent")) is False
    assert time.monotonic() - started < 1
