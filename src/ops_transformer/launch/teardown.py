"""Tearing process groups down at the end of a job, without ever hanging on a peer that is gone.

A gloo or NCCL process group left alive until the interpreter exits is destroyed while Python tears
down its threads; under ``torchrun`` that sometimes ends a rank with ``terminate called without an
active exception`` (SIGABRT) after every step succeeded. Destroying the groups explicitly, while
the interpreter is whole, avoids it. ``destroy_process_group`` needs no peer, but a backend stuck in
a collective with a dead peer may not return: it runs in a daemon thread joined with a timeout.

Destroying the groups is not the whole story. ``destroy_process_group`` unregisters a gloo group but
its two worker threads live on while anything (a context, a layer) still refers to the group, and a
worker drops its last collective's tensors only *after* the caller's ``wait`` has returned. Dropping
a tensor that Python also refers to takes the GIL; a worker that gets there once the interpreter is
finalising is ended by Python mid-C++ (``pthread_exit`` through a ``noexcept`` frame), and the rank
dies with SIGABRT (seen under torchrun on a loaded 2-core machine, about one exit in 60; the core's
stack: ``ProcessGroupGloo::runLoop`` → ``~AsyncWork`` → ``decref_pyobject`` → ``take_gil``).
:func:`settle_native_threads` closes that window: it releases the GIL and waits, bounded, until no
other thread of the process is runnable.
"""

from __future__ import annotations

import os
import threading
import time
import warnings


DEFAULT_TEARDOWN_TIMEOUT_S = 10.0
SETTLE_TIMEOUT_S = 2.0  # the most the end of a job waits for other threads to go idle
SETTLE_POLL_S = 0.002  # between two looks at the threads (the GIL is released meanwhile)
SETTLE_CALM_LOOKS = 3  # consecutive looks that found no other runnable thread


def destroy_process_groups(group=None, timeout: float = DEFAULT_TEARDOWN_TIMEOUT_S) -> bool:
    """Destroy the default process group (and every group made from it) if ``group`` is ``None``,
    else only when the default group is ``group``. Returns ``True`` when a group was destroyed,
    ``False`` when there was nothing to do or the backend did not finish within ``timeout``
    seconds (it is then abandoned: the process can still exit)."""
    import torch.distributed as dist  # (here: importing the launcher imports no torch)

    if not (dist.is_available() and dist.is_initialized()):
        return False
    if group is not None and dist.group.WORLD is not group:
        return False  # another group took its place: not ours to destroy
    errors: list[BaseException] = []

    def destroy():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    worker = threading.Thread(target=destroy, name="ops-transformer-teardown", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        warnings.warn(f"destroying the process group did not finish within {timeout:g} s (a peer "
                      f"is probably gone); abandoning it", RuntimeWarning, stacklevel=2)
        return False
    settle_native_threads(min(timeout, SETTLE_TIMEOUT_S))
    if errors:
        warnings.warn(f"destroying the process group failed: {errors[0]}", RuntimeWarning,
                      stacklevel=2)
        return False
    return True


def settle_native_threads(timeout: float = SETTLE_TIMEOUT_S, *,
                          task_dir: str | None = None) -> bool:
    """Wait, with the GIL released, until no thread of this process but the caller is runnable
    on ``SETTLE_CALM_LOOKS`` looks in a row ``SETTLE_POLL_S`` apart, or ``timeout`` seconds have
    passed. A backend thread that still has to drop a tensor (it waits for the GIL, or for a CPU)
    is runnable, or becomes so as soon as the caller sleeps; idle ones sleep in the kernel.
    Returns ``True`` when the threads settled, ``False`` on timeout or where the thread states
    cannot be read (``task_dir``, default ``/proc/<pid>/task``, is Linux's); it then has only slept
    ``SETTLE_POLL_S`` times ``SETTLE_CALM_LOOKS``."""
    task_dir = task_dir or f"/proc/{os.getpid()}/task"
    me = str(threading.get_native_id())
    deadline = time.monotonic() + timeout
    calm = 0
    while calm < SETTLE_CALM_LOOKS:
        time.sleep(SETTLE_POLL_S)
        states = _thread_states(task_dir)
        if states is None:
            time.sleep(SETTLE_POLL_S * (SETTLE_CALM_LOOKS - 1))
            return False
        calm = 0 if any(state == "R" for tid, state in states.items() if tid != me) else calm + 1
        if calm < SETTLE_CALM_LOOKS and time.monotonic() > deadline:
            return False
    return True


def _thread_states(task_dir: str) -> dict[str, str] | None:
    """``{thread id: state letter}`` from ``task_dir/<tid>/stat`` (``R`` runnable, ``S`` asleep,
    ...); ``None`` where there is no such directory. A thread that ends while being read is left
    out."""
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return None
    states = {}
    for tid in tids:
        try:
            with open(os.path.join(task_dir, tid, "stat"), encoding="ascii",
                      errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 1:].split()  # the name in parentheses may hold spaces
        if fields:
            states[tid] = fields[0]
    return states
