"""The store through which a job's ranks meet, when the process that started them hosts it.

``torchrun`` (by default, with its c10d rendezvous) and :func:`~.launch.launch` host the key-value
store themselves and tell the ranks so (``TORCHELASTIC_USE_AGENT_STORE=True``); the ranks then
connect to it as clients. Under ``torchrun --max-restarts`` that store outlives a failed attempt:
its keys (each rank's gloo address, among them) are still there when the restarted ranks look
for them, and a rank that reads its peer's address before the peer rewrote it connects to a
process that is gone (``Gloo connectFullMesh failed … Connection refused``; measured here: 2 of
3 restarts failed). So the ranks use the store through a prefix of the attempt,
``ops_transformer/attempt-<TORCHELASTIC_RESTART_COUNT>/``, where no earlier attempt wrote.

The attempt number is per agent: on several nodes an agent restarted because another node's
worker failed does not count it, so the numbers can differ between nodes. There, with restarts
and gloo, :func:`job_store` refuses before any rank connects and says what to set instead
(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: torchrun then makes a fresh store per attempt).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Mapping

import torch.distributed as dist

AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
FIX = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"


def job_store(env: Mapping[str, str], backend: str, world_size: int,
              timeout: timedelta) -> dist.Store | None:
    """The store for ``init_process_group(store=…)`` when the launcher hosts one (``env`` is the
    ``torchrun`` environment), namespaced by the attempt; ``None`` otherwise (``env://``: rank 0
    hosts a fresh store, as with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``)."""
    if env.get(AGENT_STORE) != str(True):
        return None
    nodes = int(env.get("GROUP_WORLD_SIZE") or 1)
    restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS") or 0)
    if nodes > 1 and restarts > 0 and backend == "gloo":
        raise ValueError(f"torchrun --max-restarts {restarts} over {nodes} nodes with gloo shares "
                         f"its rendezvous store with the ranks, whose keys outlive a restart, and "
                         f"the attempts are not numbered alike on every node: set {FIX} in "
                         f"torchrun's environment on every node (e.g. `{FIX} torchrun ...`)")
    attempt = env.get("TORCHELASTIC_RESTART_COUNT") or "0"
    client = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size,
                           is_master=False, timeout=timeout)
    return dist.PrefixStore(f"ops_transformer/attempt-{attempt}/", client)
