"""A ZeRO optimizer's state across data-parallel sizes: consolidate the shards, cut them anew.

``ZeroOptimizer.state_dict()`` on a data-parallel rank holds the inner optimizer's state of this
rank's pieces (each parameter's run of elements inside the rank's chunk of its bucket) and the
layout (``state_dict["zero"]``)::

    {"stage", "dp_size", "dp_rank", "ep_size", "ep_rank", "tp_size", "tp_rank",
     "buckets": [{"dtype", "numel", "padded_numel", "shard_offset", "shard_numel",
                  "group_size", "group_rank",
                  "params": [{"name", "shape", "offset", "numel"}, ...]}, ...],
     "pieces": [{"bucket", "name", "start", "stop"}, ...]}

Inner state key ``j`` is piece ``j``. Element-wise state (Adam's moments: 1-D, one value per
element of the piece) is reassembled per parameter by concatenating its pieces in element order;
0-D state (Adam's ``step``) is the same in every piece of a parameter and is kept once. A
parameter that was never stepped (frozen, unused) has no state in any piece; a rank whose chunk
is only padding has no piece at all. Each tensor-parallel rank has its own shapes: consolidate the
``dp`` shards of one TP rank at a time (with experts over ``ep``, use the sharded checkpoint,
:func:`~ops_transformer.save_checkpoint`, which stores ZeRO state in dense coordinates).

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
    if any(sd["zero"].get("ep_size", 1) > 1 for sd in state_dicts):
        raise ValueError("consolidate_zero_state works on one expert-parallel rank (ep 1); with "
                         "experts over ep, save a sharded checkpoint (save_checkpoint), which "
                         "holds the ZeRO state in dense coordinates and loads at any layout")
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
    ``{"param_groups": [...], "params": {name: {key: tensor or 0-D value}}}``; a parameter that
    was never stepped has no entry."""
    ordered = _check_complete(state_dicts)
    shapes = {p["name"]: p for b in ordered[0]["zero"]["buckets"] for p in b["params"]}
    runs: dict[str, list[tuple[int, int, dict]]] = {}
    for sd in ordered:
        for j, piece in enumerate(sd["zero"]["pieces"]):
            state = sd["state"].get(j)
            if state:
                runs.setdefault(piece["name"], []).append((piece["start"], piece["stop"], state))
    params: dict[str, dict] = {}
    for name, pieces in runs.items():
        pieces.sort(key=lambda run: run[0])
        info = shapes[name]
        covered = [(a, b) for a, b, _ in pieces]
        expected = [a for a, _, _ in pieces] == [0] + [b for _, b, _ in pieces[:-1]]
        if not expected or covered[-1][1] != info["numel"]:
            raise ValueError(f"consolidate_zero_state: the saved pieces of {name!r} cover "
                             f"{covered} of its {info['numel']} elements (some ranks stepped it, "
                             f"others did not)")
        entry = {}
        for key, value in pieces[0][2].items():
            if torch.is_tensor(value) and value.dim() > 0:
                flat = torch.cat([state[key] for _, _, state in pieces])
                entry[key] = flat.view(info["shape"]).clone()
            else:
                entry[key] = copy.deepcopy(value)
        params[name] = entry
    return {"param_groups": copy.deepcopy(ordered[0]["param_groups"]), "params": params}


def shard_zero_state(consolidated: dict, layout: dict) -> dict:
    """The state dict a :class:`~ops_transformer.memory.zero.ZeroOptimizer` with ``layout``
    (``opt.layout()``, any ``dp``) loads, from :func:`consolidate_zero_state`'s output."""
    params = consolidated["params"]
    shapes = {p["name"]: p["shape"] for b in layout["buckets"] for p in b["params"]}
    state = {}
    for j, piece in enumerate(layout["pieces"]):
        saved = params.get(piece["name"])
        if saved is None:
            continue  # never stepped
        chunk = {}
        for key, value in saved.items():
            if not (torch.is_tensor(value) and value.dim() > 0):
                chunk[key] = copy.deepcopy(value)
                continue
            if list(value.shape) != list(shapes[piece["name"]]):
                raise ValueError(f"shard_zero_state: {piece['name']} has shape "
                                 f"{shapes[piece['name']]} but its saved {key!r} has "
                                 f"{list(value.shape)}")
            chunk[key] = value.reshape(-1)[piece["start"]:piece["stop"]].clone()
        state[j] = chunk
    groups = copy.deepcopy(consolidated["param_groups"])
    if len(groups) != 1:
        raise ValueError(f"shard_zero_state: expected one parameter group, got {len(groups)}")
    groups[0]["params"] = list(range(max(1, len(layout["pieces"]))))  # (1: the placeholder)
    return {"state": state, "param_groups": groups, "zero": copy.deepcopy(layout)}
