"""The rank grid, the local launcher and sharding metadata."""

from .context import ParallelContext, init_parallel
from .launch import RankError, launch
from .restart import launch_with_restarts
from .sharding import ShardSpec, gather_full, gather_full_state_dict

__all__ = ["ParallelContext", "init_parallel", "RankError", "launch", "launch_with_restarts", "ShardSpec", "gather_full",
           "gather_full_state_dict"]
