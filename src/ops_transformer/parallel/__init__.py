"""The runtime of a parallel job: the rank grid and its process groups, gradient reduction,
sharding metadata. ``launch`` and ``launch_with_restarts`` live in ``launch/`` (re-exported here,
where earlier versions had them)."""

import sys

from .context import ParallelContext, init_parallel
from ..launch import RankError, launch, launch_with_restarts
from ..launch import local as _local

# ``ops_transformer.parallel.launch`` names the module of earlier versions when imported as one,
# while the attribute stays the function (as it was)
sys.modules.setdefault(__name__ + ".launch", _local)
from .sharding import ShardSpec, gather_full, gather_full_state_dict

__all__ = ["ParallelContext", "init_parallel", "RankError", "launch", "launch_with_restarts",
           "ShardSpec", "gather_full", "gather_full_state_dict"]
