"""Run a function on several local processes: the single-machine stand-in for ``torchrun``.

``launch(fn, nprocs, *args, **kwargs)`` starts ``nprocs`` processes with the ``torchrun`` environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``)
already set, so the same ``fn`` runs unchanged under ``torchrun``. Forked ranks meet in a store
that rank 0 serves on a socket the launcher bound before any rank started (the ranks connect to
it as torchrun's workers do to the agent's, ``TORCHELASTIC_USE_AGENT_STORE=True``), so no other
job can take the port in between; spawned ranks (no socket to inherit) get a port found free.
Each rank runs with one intra-op thread. Processes are forked when that is safe (Linux, no GPU
visible: ~0.1 s a start) and spawned otherwise (every child then imports torch, 3–10 s).

Called inside a job that already has its ranks (a ``torchrun`` worker, or a process with an
initialised default process group), ``launch`` starts nothing: it runs ``fn`` on the current rank
and returns a list of ``nprocs`` entries holding this rank's result at its index (``None`` at the
others); ``nprocs`` must then equal the job's world size.

A rank that dies (a signal, or an exit without a result) is the cause of the failure, ahead of the
errors its peers then get; otherwise the first rank to fail is. Its exception is re-raised in the
caller, still an instance of its original type and also of :class:`RankError`, with the rank in the
message and the remote traceback attached as ``__cause__`` (an exception that cannot be rebuilt in
the caller arrives as a plain :class:`RankError` with its type name and message). A job that runs
past ``timeout`` seconds is ended with the Python stacks of the ranks still running.

No rank outlives ``launch``, nor the launcher process: ranks are killed when it dies (any signal,
SIGKILL included), and SIGTERM or SIGHUP to the launcher first reaps them, then ends it as the
signal would have. Nothing is written to disk.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import threading
import time
from multiprocessing.connection import wait

from .rank_process import RankError, rank_main

__all__ = ["launch", "RankError", "DEFAULT_LAUNCH_TIMEOUT"]

DEFAULT_LAUNCH_TIMEOUT = 600.0
_GRACE_S = 1.0  # after a failure, how long other ranks get to report their own errors
_POLL_S = 0.5  # how often pending ranks are checked for an exit their pipes do not show


class RemoteTraceback(Exception):
    """Carries the traceback text of a rank as the ``__cause__`` of the re-raised exception."""

    def __str__(self) -> str:
        return "\n" + self.args[0]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listener() -> socket.socket:
    """A socket listening on a port the system picks. Forked ranks inherit it and rank 0 serves
    the job's store on it (``TCPStore(master_listen_fd=…)``): the port is bound from before any
    rank starts, so no other job can take it in between (a port found free, closed, and bound
    later by rank 0 could be taken by another job in between)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(128)
    return s


def _fork_is_safe() -> bool:
    """Fork only where no GPU is visible: ``torch.cuda.is_available()`` (in the caller, or in a
    library it used) initialises the CUDA driver without ``is_initialized()`` saying so, and a rank
    forked after that cannot use CUDA. ``device_count`` asks NVML, which is fork-safe."""
    import torch  # (here: importing the launcher imports no torch)

    return (sys.platform.startswith("linux") and not torch.cuda.is_initialized()
            and torch.cuda.device_count() == 0)


def _as_rank_error(exc: BaseException, rank: int, nprocs: int, tb: str) -> BaseException:
    """The rank's exception, re-typed to also be a RankError, with the rank in its message."""
    message = f"[rank {rank}/{nprocs}] {exc}"
    type_name = getattr(exc, "type_name", "") or type(exc).__name__
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
    err.type_name = type_name
    err.remote_traceback = tb
    err.__cause__ = RemoteTraceback(tb) if tb else None
    return err


def _current_job() -> tuple[int, int] | None:
    """``(rank, world_size)`` when this process is already a rank of a job, else ``None``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, world = os.environ.get("RANK", ""), os.environ.get("WORLD_SIZE", "")
    return (int(rank), int(world)) if rank and world else None


def _run_in_place(fn, nprocs: int, job: tuple[int, int], args, kwargs) -> list:
    rank, world = job
    if nprocs != world:
        raise ValueError(
            f"launch(fn, {nprocs}) was called inside a job that already has {world} ranks "
            f"(torchrun, or an initialised process group): there it runs fn on the current rank, "
            f"so nprocs must equal the world size; start torchrun with --nproc-per-node {nprocs}, "
            f"or run the script with plain `python` to launch {nprocs} local ranks")
    results = [None] * nprocs
    results[rank] = fn(*args, **kwargs)
    return results


def launch(fn, nprocs: int, *args, timeout: float = DEFAULT_LAUNCH_TIMEOUT,
           start_method: str | None = None, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` local ranks; return the results ordered by rank.

    ``timeout`` (seconds) bounds the whole job; ``start_method`` forces ``"fork"`` or ``"spawn"``
    (default: fork when safe). Both are consumed by ``launch`` itself; pass ``fn`` a
    ``functools.partial`` if it needs arguments with those names. With ``spawn``, ``fn``, its
    arguments and its results must be picklable. Inside a running job (``torchrun``) ``fn`` runs on
    the current rank instead (see the module docstring); ``timeout`` then does not apply.
    """
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive integer, got {nprocs!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    job = _current_job()
    if job is not None:
        return _run_in_place(fn, nprocs, job, args, kwargs)
    method = start_method or ("fork" if _fork_is_safe() else "spawn")
    if method not in ("fork", "spawn", "forkserver"):
        raise ValueError(f"start_method must be 'fork', 'spawn' or 'forkserver', got {method!r}")
    mp_ctx = mp.get_context(method)
    listener = _listener() if method == "fork" else None  # spawned ranks inherit no socket
    port = listener.getsockname()[1] if listener is not None else _free_port()
    endpoint = (port, None if listener is None else listener.fileno())
    parent_pid = None if method == "forkserver" else os.getpid()
    procs, conns, stacks = [], [], []
    with _stop_on_signals():
        try:
            for rank in range(nprocs):
                reader, writer = mp_ctx.Pipe(duplex=False)
                stack_reader, stack_writer = mp_ctx.Pipe(duplex=False)
                p = mp_ctx.Process(target=rank_main, name=f"ops-transformer-rank{rank}",
                                   daemon=True, args=(rank, nprocs, endpoint, parent_pid, writer,
                                                      stack_writer, fn, args, kwargs))
                p.start()
                writer.close()
                stack_writer.close()
                procs.append(p)
                conns.append(reader)
                stacks.append(stack_reader)
            if listener is not None:  # the ranks hold it now
                listener.close()
            return _collect(procs, conns, stacks, nprocs, timeout)
        finally:
            _reap(procs)
            for c in conns + stacks:
                c.close()
            if listener is not None:
                listener.close()


class _Stopped(BaseException):
    """Raised in the launcher by SIGTERM or SIGHUP, so that ``launch`` reaps its ranks."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _stop_on_signals():
    """While the ranks run, SIGTERM and SIGHUP raise :class:`_Stopped` in the launcher; once the
    ranks are reaped, the signal is delivered again under the handler that was there before (by
    default: the process ends). An ignored signal (``nohup``) stays ignored. Only the main thread
    can install handlers; elsewhere the ranks still die with the process (PR_SET_PDEATHSIG)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stopped: list[int] = []

    def handler(signum, frame):
        if not stopped:  # a second signal during the clean-up does not interrupt it
            stopped.append(signum)
            raise _Stopped(signum)

    previous = {}
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None and signal.getsignal(sig) not in (signal.SIG_IGN, None):
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    except _Stopped as stop:
        for sig, old in previous.items():
            signal.signal(sig, old)
        previous.clear()
        os.kill(os.getpid(), stop.signum)  # the previous handler decides (default: exit)
        raise RankError(f"launch was stopped by {signal.Signals(stop.signum).name}") from None
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _collect(procs, conns, stacks, nprocs, timeout) -> list:
    results: dict[int, object] = {}
    errors: list[tuple[int, BaseException, str, float, bool]] = []  # (..., time, died)
    pending = {conns[r]: r for r in range(nprocs)}
    sentinels = {procs[r].sentinel: r for r in range(nprocs)}
    deadline = time.monotonic() + timeout
    fail_deadline = None
    while pending:
        now = time.monotonic()
        limit = deadline if fail_deadline is None else min(deadline, fail_deadline)
        if now >= limit:
            break
        ready = wait(list(pending) + list(sentinels), timeout=min(limit - now, _POLL_S))
        for obj in ready:
            if obj in pending:
                rank = pending.pop(obj)
                sentinels = {s: r for s, r in sentinels.items() if r != rank}
                errors += _receive(obj, procs[rank], rank, nprocs, results)
            elif obj in sentinels:
                sentinels.pop(obj)
        # A rank whose process ended with nothing to read died: its pipes may still be held open
        # by a process it started, so its exit status is checked too, not only its sentinel.
        for conn, rank in list(pending.items()):
            if procs[rank].exitcode is not None and not conn.poll():
                pending.pop(conn)
                errors.append((rank, _died(procs[rank], rank), "", time.time(), True))
        if errors and fail_deadline is None:
            fail_deadline = time.monotonic() + _GRACE_S
    if errors:
        # A rank that died caused the failure: its peers' connection errors follow from it.
        # Otherwise the first to fail is the cause and the others follow it.
        errors.sort(key=lambda e: (not e[4], e[3]))
        rank, exc, tb, _, _ = errors[0]
        err = _as_rank_error(exc, rank, nprocs, tb)
        err.dead_ranks = tuple(sorted({e[0] for e in errors if e[4]}))  # elastic restarts
        others = [e[0] for e in errors[1:]]
        if others and hasattr(err, "add_note"):
            err.add_note(f"ranks {others} failed after it")
        raise err
    if pending:
        hung = sorted(pending.values())
        text = _dump_stacks(procs, stacks, hung)
        raise RankError(f"launch timed out after {timeout:.0f} s: ranks {hung} of {nprocs} did not "
                        f"finish (deadlock, a missing collective on some rank, or too little "
                        f"time).{text}")
    return [results[r] for r in range(nprocs)]


def _receive(conn, proc, rank: int, nprocs: int, results: dict) -> list:
    """Read rank ``rank``'s message: stores a result, or returns its error entry."""
    try:
        data = conn.recv_bytes()
    except (EOFError, OSError):  # the process ended without a word
        return [(rank, _died(proc, rank), "", time.time(), True)]
    try:
        status, value = pickle.loads(data)
    except Exception as exc:  # noqa: BLE001 - a result the caller cannot rebuild
        return [(rank, RankError(f"the message of rank {rank} cannot be unpickled in the "
                                 f"launcher: {type(exc).__name__}: {exc}"), "", time.time(), False)]
    if status == "ok":
        results[rank] = value
        return []
    return [(rank, *value, False)]


def _died(proc, rank: int) -> RankError:
    proc.join(1.0)
    code = proc.exitcode
    how = ""
    if code is not None and code < 0:
        try:
            how = f" (killed by signal {-code}, {signal.Signals(-code).name})"
        except ValueError:
            how = f" (killed by signal {-code})"
    return RankError(f"rank {rank} exited with code {code}{how} without reporting a result")


def _dump_stacks(procs, stacks, ranks) -> str:
    if not hasattr(signal, "SIGUSR1"):
        return ""
    for r in ranks:
        if procs[r].is_alive():
            os.kill(procs[r].pid, signal.SIGUSR1)
    deadline = time.monotonic() + 1.0
    parts = []
    for r in ranks:
        chunks = []
        while stacks[r].poll(max(0.0, deadline - time.monotonic()) if not chunks else 0.1):
            chunk = os.read(stacks[r].fileno(), 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        text = b"".join(chunks).decode(errors="replace").strip()
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
