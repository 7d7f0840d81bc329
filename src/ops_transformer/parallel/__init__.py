"""The rank grid, the local launcher and sharding metadata."""

from .context import ParallelContext, init_parallel
from .launch import RankError, launch
from .sharding import ShardSpec, gather_full, gather_full_state_dict

__all__ = ["ParallelContext", "init_parallel", "RankError", "launch", "ShardSpec", "gather_full",
           "gather_full_state_dict"]
