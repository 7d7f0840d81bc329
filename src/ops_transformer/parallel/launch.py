"""Run a function on several local processes: the single-machine stand-in for ``torchrun``.

``launch(fn, nprocs, *args, **kwargs)`` starts ``nprocs`` processes with the ``torchrun`` environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``)
already set, so the same ``fn`` runs unchanged under ``torchrun``. Each rank runs with one intra-op
thread. Processes are forked when that is safe (Linux, CUDA not initialised in the parent: ~0.1 s a
start) and spawned otherwise (every child then imports torch, 3–10 s).

The first rank to fail ends the job: its exception is re-raised in the caller, still an instance of
its original type and also of :class:`RankError`, with the rank in the message and the remote
traceback attached as ``__cause__``. A job that runs past ``timeout`` seconds is ended with the
Python stacks of the ranks still running. No child process survives ``launch``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait

import torch

DEFAULT_LAUNCH_TIMEOUT = 600.0
_GRACE_S = 1.0  # after a failure, how long other ranks get to report their own errors


class RankError(RuntimeError):
    """A rank of a :func:`launch` job failed. ``rank`` names it; ``remote_traceback`` is its
    traceback as text."""

    rank: int = -1
    remote_traceback: str = ""


class RemoteTraceback(Exception):
    """Carries the traceback text of a rank as the ``__cause__`` of the re-raised exception."""

    def __str__(self) -> str:
        return "\n" + self.args[0]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fork_is_safe() -> bool:
    return (sys.platform.startswith("linux") and not torch.cuda.is_initialized())


def _child(rank, nprocs, port, conn, stack_file, fn, args, kwargs):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(nprocs), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)  # before any compute: a fork after a threaded matmul can hang
    if hasattr(signal, "SIGUSR1"):
        import faulthandler

        faulthandler.register(signal.SIGUSR1, file=open(stack_file, "w"), all_threads=False)
    try:
        payload = ("ok", fn(*args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        failed_at, tb = time.time(), traceback.format_exc()
        try:
            pickle.dumps(exc)
        except Exception:  # unpicklable exception: send its text
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        payload = ("error", (exc, tb, failed_at))
    try:
        data = pickle.dumps(payload)
    except Exception as exc:
        error = TypeError(f"the return value of rank {rank} cannot be pickled: {exc}")
        data = pickle.dumps(("error", (error, "", time.time())))
    conn.send_bytes(data)  # before tearing down: peers then fail after the parent knows why
    conn.close()
    _destroy_process_group()


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def _as_rank_error(exc: BaseException, rank: int, nprocs: int, tb: str) -> BaseException:
    """The rank's exception, re-typed to also be a RankError, with the rank in its message."""
    message = f"[rank {rank}/{nprocs}] {exc}"
    if isinstance(exc, RankError) or type(exc) is RuntimeError:
        err = RankError(message)
    else:
        try:
            cls = type(type(exc).__name__, (type(exc), RankError),
                       {"__module__": type(exc).__module__})
            err = cls(message)
        except Exception:
            err = RankError(f"[rank {rank}/{nprocs}] {type(exc).__name__}: {exc}")
    err.rank = rank
    err.remote_traceback = tb
    err.__cause__ = RemoteTraceback(tb) if tb else None
    return err


def launch(fn, nprocs: int, *args, timeout: float = DEFAULT_LAUNCH_TIMEOUT,
           start_method: str | None = None, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` local ranks; return the results ordered by rank.

    ``timeout`` (seconds) bounds the whole job; ``start_method`` forces ``"fork"`` or ``"spawn"``
    (default: fork when safe). Both are consumed by ``launch`` itself; pass ``fn`` a
    ``functools.partial`` if it needs arguments with those names. With ``spawn``, ``fn``, its
    arguments and its results must be picklable.
    """
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive integer, got {nprocs!r}")
    method = start_method or ("fork" if _fork_is_safe() else "spawn")
    if method not in ("fork", "spawn", "forkserver"):
        raise ValueError(f"start_method must be 'fork', 'spawn' or 'forkserver', got {method!r}")
    mp_ctx = mp.get_context(method)
    port = _free_port()
    stack_dir = tempfile.mkdtemp(prefix="ops-transformer-launch-")
    procs, conns = [], []
    try:
        for rank in range(nprocs):
            reader, writer = mp_ctx.Pipe(duplex=False)
            stack_file = os.path.join(stack_dir, f"rank{rank}.txt")
            p = mp_ctx.Process(target=_child, name=f"ops-transformer-rank{rank}", daemon=True,
                               args=(rank, nprocs, port, writer, stack_file, fn, args, kwargs))
            p.start()
            writer.close()
            procs.append(p)
            conns.append(reader)
        return _collect(procs, conns, nprocs, timeout, stack_dir)
    finally:
        _reap(procs)
        for c in conns:
            c.close()
        _rmtree(stack_dir)


def _collect(procs, conns, nprocs, timeout, stack_dir) -> list:
    results: dict[int, object] = {}
    errors: list[tuple[int, BaseException, str, float]] = []  # (rank, exception, traceback, time)
    pending = {conns[r]: r for r in range(nprocs)}
    sentinels = {procs[r].sentinel: r for r in range(nprocs)}
    deadline = time.monotonic() + timeout
    fail_deadline = None
    while pending:
        now = time.monotonic()
        limit = deadline if fail_deadline is None else min(deadline, fail_deadline)
        if now >= limit:
            break
        ready = wait(list(pending) + list(sentinels), timeout=limit - now)
        for obj in ready:
            if obj in pending:
                rank = pending.pop(obj)
                sentinels = {s: r for s, r in sentinels.items() if r != rank}
                try:
                    status, value = pickle.loads(obj.recv_bytes())
                except EOFError:  # the process ended without a word
                    errors.append((rank, _died(procs[rank], rank), "", time.time()))
                    continue
                if status == "ok":
                    results[rank] = value
                else:
                    errors.append((rank, *value))
            elif obj in sentinels:
                rank = sentinels.pop(obj)
                conn = conns[rank]
                if conn in pending and not conn.poll():
                    pending.pop(conn)
                    errors.append((rank, _died(procs[rank], rank), "", time.time()))
        if errors and fail_deadline is None:
            fail_deadline = time.monotonic() + _GRACE_S
    if errors:
        errors.sort(key=lambda e: e[3])  # the first to fail is the cause; the others follow it
        rank, exc, tb, _ = errors[0]
        others = [e[0] for e in errors[1:]]
        err = _as_rank_error(exc, rank, nprocs, tb)
        if others:
            err.add_note(f"ranks {others} failed after it") if hasattr(err, "add_note") else None
        raise err
    if pending:
        hung = sorted(pending.values())
        stacks = _dump_stacks(procs, hung, stack_dir)
        raise RankError(f"launch timed out after {timeout:.0f} s: ranks {hung} of {nprocs} did not "
                        f"finish (deadlock, a missing collective on some rank, or too little "
                        f"time).{stacks}")
    return [results[r] for r in range(nprocs)]


def _died(proc, rank: int) -> RuntimeError:
    proc.join(1.0)
    code = proc.exitcode
    how = f" (killed by signal {-code})" if code is not None and code < 0 else ""
    return RuntimeError(f"rank {rank} exited with code {code}{how} without reporting a result")


def _dump_stacks(procs, ranks, stack_dir) -> str:
    if not hasattr(signal, "SIGUSR1"):
        return ""
    for r in ranks:
        if procs[r].is_alive():
            os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(0.3)
    parts = []
    for r in ranks:
        try:
            with open(os.path.join(stack_dir, f"rank{r}.txt")) as f:
                text = f.read().strip()
        except OSError:
            text = ""
        if text:
            parts.append(f"\n--- rank {r} stack ---\n{text}")
    return "".join(parts)


def _reap(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 2.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


def _rmtree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
