"""Tearing process groups down at the end of a job, without ever hanging on a peer that is gone.

A gloo or NCCL process group left alive until the interpreter exits is destroyed while Python tears
down its threads; under ``torchrun`` that sometimes ends a rank with ``terminate called without an
active exception`` (SIGABRT) after every step succeeded. Destroying the groups explicitly, while
the interpreter is whole, avoids it. ``destroy_process_group`` needs no peer, but a backend stuck in
a collective with a dead peer may not return: it runs in a daemon thread joined with a timeout.
"""

from __future__ import annotations

import threading
import warnings

import torch.distributed as dist

DEFAULT_TEARDOWN_TIMEOUT_S = 10.0


def destroy_process_groups(group=None, timeout: float = DEFAULT_TEARDOWN_TIMEOUT_S) -> bool:
    """Destroy the default process group (and every group made from it) if ``group`` is ``None``,
    else only when the default group is ``group``. Returns ``True`` when a group was destroyed,
    ``False`` when there was nothing to do or the backend did not finish within ``timeout``
    seconds (it is then abandoned: the process can still exit)."""
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
    if errors:
        warnings.warn(f"destroying the process group failed: {errors[0]}", RuntimeWarning,
                      stacklevel=2)
        return False
    return True
