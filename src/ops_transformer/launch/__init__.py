"""Process management: the local launcher (``launch``, one process per rank), the rank processes,
the job's rendezvous store, restarts after a failure and the teardown of a job's process groups.
The runtime those processes run (the rank grid, gradient reduction, sharding) is ``parallel/``."""

from .local import DEFAULT_LAUNCH_TIMEOUT, RankError, launch
from .restart import launch_with_restarts

__all__ = ["launch", "launch_with_restarts", "RankError", "DEFAULT_LAUNCH_TIMEOUT"]
