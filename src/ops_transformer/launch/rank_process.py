"""The rank side of :func:`~ops_transformer.parallel.launch.launch`: what each local process does.

A rank sets up the ``torchrun`` environment, ties its life to the launcher's (it is killed when the
launcher dies, whatever signal ended it), runs ``fn``, sends one message back (its result, or its
exception with the traceback as text) and tears its process group down, with a time bound.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
import traceback


from .teardown import destroy_process_groups

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_POLL_S = 1.0  # outside Linux: how often a rank checks that its launcher still lives


class RankError(RuntimeError):
    """A rank of a :func:`launch` job failed. ``rank`` names it; ``type_name`` is the type of the
    exception raised there, ``remote_traceback`` its traceback as text, ``dead_ranks`` the
    ranks of the job that died rather than raised."""

    rank: int = -1
    type_name: str = ""
    remote_traceback: str = ""
    dead_ranks: tuple = ()  # the ranks that died (a signal, or an exit without a result)


def set_rank_threads() -> None:
    """The thread policy of a rank: one intra-op thread. Ranks share the machine's cores, and
    several multi-threaded ranks on the same cores run far slower than one thread each (the
    launcher's ranks, a single-process ``train`` and ``torchrun``'s ``OMP_NUM_THREADS=1`` agree)."""
    import torch  # (here: importing the launcher imports no torch)

    torch.set_num_threads(1)


def die_with_parent(parent_pid: int | None) -> None:
    """Make this process end when the process that started it ends, even by SIGKILL.

    Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, then a check that the parent did not die before
    the call. Elsewhere: a daemon thread that polls the parent's pid. ``parent_pid=None`` (the
    forkserver, whose parent is not the launcher) skips the check but keeps the death signal.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            _watch_parent(os.getppid())  # no prctl (a sandbox): fall back to polling
        elif parent_pid is not None and os.getppid() != parent_pid:
            os._exit(1)
        return
    _watch_parent(os.getppid() if parent_pid is None else parent_pid)


def _watch_parent(parent_pid: int) -> None:
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="ops-transformer-parent-watch", daemon=True).start()


def serve_store(rank: int, nprocs: int, endpoint: tuple[int, int | None]):
    """Rank 0 serves the job's store on the socket the launcher bound (``endpoint``: its port and
    file descriptor, inherited through the fork); the other ranks close their copy. Returns the
    server (kept alive by the caller) or ``None``."""
    port, listen_fd = endpoint
    if listen_fd is None:
        return None
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # every rank connects as a client
    if rank != 0:
        os.close(listen_fd)
        return None
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, nprocs, is_master=True, wait_for_workers=False,
                         master_listen_fd=listen_fd, timeout=timedelta(minutes=10))


def rank_main(rank, nprocs, endpoint, parent_pid, conn, stack_conn, fn, args, kwargs) -> None:
    """The body of each rank process started by ``launch``."""
    die_with_parent(parent_pid)
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None:  # not the launcher's handlers: a rank told to stop stops
            signal.signal(sig, signal.SIG_DFL)
    for key in [k for k in os.environ if k.startswith("TORCHELASTIC_")]:
        del os.environ[key]  # an enclosing torchrun's agent store serves no one here
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(nprocs), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(endpoint[0]))
    server = serve_store(rank, nprocs, endpoint)  # noqa: F841 - serves until this rank ends
    set_rank_threads()  # before any compute: a fork after a threaded matmul can hang
    if hasattr(signal, "SIGUSR1"):
        import faulthandler

        faulthandler.register(signal.SIGUSR1, file=stack_conn.fileno(), all_threads=False)
    try:
        payload = ("ok", fn(*args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        payload = ("error", (transportable(exc, rank), traceback.format_exc(), time.time()))
    try:
        data = pickle.dumps(payload)
    except Exception as exc:
        error = TypeError(f"the return value of rank {rank} cannot be pickled: {exc}")
        data = pickle.dumps(("error", (error, "", time.time())))
    conn.send_bytes(data)  # before tearing down: peers then fail after the parent knows why
    conn.close()
    destroy_process_groups()


def transportable(exc: BaseException, rank: int) -> BaseException:
    """``exc`` if the launcher can rebuild it from a pickle, else a :class:`RankError` carrying
    the rank, the type name and the message (an exception whose constructor takes other
    arguments than its ``args`` pickles fine but fails to unpickle)."""
    try:
        rebuilt = pickle.loads(pickle.dumps(exc))
        if type(rebuilt) is type(exc):
            return exc
    except Exception:
        pass
    fallback = RankError(f"{type(exc).__name__}: {exc}")
    fallback.rank = rank
    fallback.type_name = f"{type(exc).__module__}.{type(exc).__qualname__}"
    return fallback
