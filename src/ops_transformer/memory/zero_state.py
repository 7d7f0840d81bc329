"""A ZeRO optimizer's state across data-parallel sizes: consolidate the shards, cut them anew.

``ZeroOptimizer.state_dict()`` on data-parallel rank ``r`` holds the inner optimizer's state of
chunk ``r`` of every bucket, and the layout (``state_dict["zero"]``)::

    {"stage", "dp_size", "dp_rank", "tp_size", "tp_rank",
     "buckets": [{"dtype", "numel", "padded_numel", "shard_offset", "shard_numel",
                  "params": [{"name", "shape", "offset", "numel"}, ...]}, ...]}

Bucket ``i``'s chunk is inner state key ``i``. Element-wise state (Adam's moments: 1-D, one value per
chunk element) is reassembled per parameter by concatenating the chunks of ranks ``0..dp-1`` and
slicing ``[offset, offset + numel)``; 0-D state (Adam's ``step``) is the same on every rank and is
kept once. Each tensor-parallel rank has its own shapes: consolidate the ``dp`` shards of one TP
rank at a time.

>>> full = consolidate_zero_state([sd_rank0, sd_rank1])       # saved at dp = 2
>>> opt.load_state_dict(shard_zero_state(full, opt.layout()))  # any dp, same parameters
"""

from __future__ import annotations

import copy

import torch


def _check_complete(state_dicts: list[dict]) -> list[dict]:
    if not state_dicts or any("zero" not in sd for sd in state_dicts):
        raise ValueError("consolidate_zero_state needs the ZeroOptimizer state dicts of every "
                         "data-parallel rank")
    dp = state_dicts[0]["zero"]["dp_size"]
    ordered = sorted(state_dicts, key=lambda sd: sd["zero"]["dp_rank"])
    ranks = [sd["zero"]["dp_rank"] for sd in ordered]
    tp_ranks = {sd["zero"]["tp_rank"] for sd in ordered}
    if ranks != list(range(dp)) or len(tp_ranks) != 1:
        raise ValueError(f"consolidate_zero_state needs one state dict per dp rank 0..{dp - 1} of "
                         f"one tp rank; got dp ranks {ranks} of tp ranks {sorted(tp_ranks)}")
    return ordered


def consolidate_zero_state(state_dicts: list[dict]) -> dict:
    """Per-parameter optimizer state from the state dicts of all ``dp`` ranks (one TP rank):
    ``{"param_groups": [...], "params": {name: {key: tensor or 0-D value}}}``."""
    ordered = _check_complete(state_dicts)
    params: dict[str, dict] = {}
    for index, bucket in enumerate(ordered[0]["zero"]["buckets"]):
        shards = [sd["state"].get(index, {}) for sd in ordered]
        for key in shards[0]:
            values = [s[key] for s in shards]
            for p in bucket["params"]:
                entry = params.setdefault(p["name"], {})
                if torch.is_tensor(values[0]) and values[0].dim() > 0:
                    flat = torch.cat(values)
                    entry[key] = flat[p["offset"]:p["offset"] + p["numel"]].view(p["shape"]).clone()
                else:
                    entry[key] = copy.deepcopy(values[0])
    return {"param_groups": copy.deepcopy(ordered[0]["param_groups"]), "params": params}


def shard_zero_state(consolidated: dict, layout: dict) -> dict:
    """The state dict a :class:`~ops_transformer.memory.zero.ZeroOptimizer` with ``layout``
    (``opt.layout()``, any ``dp``) loads, from :func:`consolidate_zero_state`'s output."""
    params = consolidated["params"]
    state = {}
    for index, bucket in enumerate(layout["buckets"]):
        names = [p["name"] for p in bucket["params"]]
        missing = [n for n in names if n not in params]
        if len(missing) == len(names):
            continue  # never stepped
        if missing:
            raise ValueError(f"shard_zero_state: no saved state for parameters {missing}")
        chunk = {}
        for key, value in params[names[0]].items():
            if not (torch.is_tensor(value) and value.dim() > 0):
                chunk[key] = copy.deepcopy(value)
                continue
            flat = value.new_zeros(bucket["padded_numel"])
            for p in bucket["params"]:
                saved = params[p["name"]][key]
                if list(saved.shape) != p["shape"]:
                    raise ValueError(f"shard_zero_state: {p['name']} has shape {p['shape']} but "
                                     f"its saved {key!r} has {list(saved.shape)}")
                flat[p["offset"]:p["offset"] + p["numel"]] = saved.reshape(-1)
            start = bucket["shard_offset"]
            chunk[key] = flat[start:start + bucket["shard_numel"]].clone()
        state[index] = chunk
    groups = copy.deepcopy(consolidated["param_groups"])
    if len(groups) != 1:
        raise ValueError(f"shard_zero_state: expected one parameter group, got {len(groups)}")
    groups[0]["params"] = list(range(len(layout["buckets"])))
    return {"state": state, "param_groups": groups, "zero": copy.deepcopy(layout)}
