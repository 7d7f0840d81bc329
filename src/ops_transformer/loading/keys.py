"""Which stored tensors make each tensor of the model, by ``transformers``' own rules.

``transformers`` (≥ 5) does not always store a model under its own state-dict names: Mixtral's
``save_pretrained`` writes one ``w1``/``w2``/``w3`` weight per expert where the model holds stacked
``experts.gate_up_proj`` and ``experts.down_proj``; old checkpoints say ``LayerNorm.gamma``; a
``*ForCausalLM`` checkpoint may lack or carry the base model's prefix. Its conversion mapping
(``get_model_conversion_mapping``: renamings, and converters made of operations such as
``MergeModulelist`` and ``Concatenate``) says how; :func:`model_sources` applies the same mapping,
keyword by keyword, but builds a lazy :class:`~.sources.Source` for every model tensor instead of
reading anything — so a rank later reads only its block of each.

Operations it expresses lazily: ``MergeModulelist`` (stack), ``Concatenate``, ``Chunk``,
``Transpose``. A converter with any other operation is run by ``transformers`` itself on the whole
stored tensors (each such model tensor is then read whole once, with a warning naming it).
"""

from __future__ import annotations

import copy
import re
import warnings

import torch

from ..checkpoint.errors import CheckpointError
from .sources import Concatenated, Narrowed, Source, Stacked, Transposed


def _conversions(model):
    """``(renamings, converters, rename_source_key, natural_key)`` of ``transformers`` ≥ 5, or
    ``None`` for a version without conversion mappings (keys are then taken as they are)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (WeightConverter, WeightRenaming,
                                                     dot_natural_key, rename_source_key)
    except ImportError:
        return None
    mapping = get_model_conversion_mapping(model)
    return ([m for m in mapping if isinstance(m, WeightRenaming)],
            [m for m in mapping if isinstance(m, WeightConverter)], rename_source_key,
            dot_natural_key)


def model_sources(model, stored: dict[str, Source], described: str, *,
                  strict: bool = True) -> dict[str, Source]:
    """The :class:`Source` of every tensor of ``model``'s state dict (the dense model, on the
    ``meta`` device) that the checkpoint provides. Stored tensors that feed none of them, model
    tensors that none provides (tied weights aside) and shapes that differ from the model's are a
    :class:`CheckpointError` naming the file and the key (``described``: the weight file or
    index, for keys that are missing); with ``strict=False`` the stored tensors the model does not
    have are a warning."""
    dense = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    sources, unexpected = _match(model, stored, dense)
    unexpected = [k for k in unexpected if not _ignored(k, _ignore_unexpected(model))]
    if unexpected:
        key = unexpected[0]
        message = (f"{stored[key].name} is not a tensor of {type(model).__name__} (unexpected "
                   f"key{_more(unexpected)})")
        if strict:
            raise CheckpointError(message)
        warnings.warn(message + ": not loaded", stacklevel=3)
    _share_tied(model, sources)
    missing = [k for k in dense if k not in sources
               and not _ignored(k, getattr(model, "_keys_to_ignore_on_load_missing", None))]
    if missing:
        raise CheckpointError(f"{described} has no tensor {missing[0]!r}, which "
                              f"{type(model).__name__} needs (missing key{_more(missing)})")
    for key, shape in dense.items():
        source = sources.get(key)
        if source is not None and source.shape != shape:
            where = "" if source.name.endswith(f"{key!r}") else f" as {key!r}"
            raise CheckpointError(f"{source.name} has shape {source.shape}, but "
                                  f"{type(model).__name__} built from config.json needs "
                                  f"{shape}{where}")
    return sources


def _match(model, stored: dict[str, Source], dense: dict) -> tuple[dict, list[str]]:
    conversions = _conversions(model)
    if conversions is None:
        return ({k: s for k, s in stored.items() if k in dense},
                [k for k in stored if k not in dense])
    renamings, converters, rename, natural = conversions
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = getattr(model, "base_model_prefix", None)
    sources, groups, unexpected = {}, {}, []
    for key in sorted(stored, key=natural):  # experts 0, 1, …, 10 in order, as transformers
        target, pattern = rename(key, renamings, converters, prefix, dense)
        if target not in dense and key in dense:  # a key that only needed its prefix
            target, pattern = rename(key, [], [], prefix, dense)
        if target not in dense:
            unexpected.append(key)
        elif pattern is None:
            sources[target] = stored[key]
        else:
            converter, collected = groups.setdefault(target, (by_pattern[pattern], {}))
            collected.setdefault(pattern, []).append(key)
    for target, (converter, collected) in groups.items():
        sources.update(_converted(model, target, converter, collected, stored, dense))
    return sources, unexpected


def _converted(model, target: str, converter, collected: dict[str, list[str]],
               stored: dict[str, Source], dense: dict) -> dict[str, Source]:
    """The model tensors one converter makes from its stored tensors, lazily where its
    operations allow, else by running it (on the whole tensors)."""
    values = {p: [stored[k] for k in keys] for p, keys in collected.items()}
    try:
        for op in converter.operations:
            values = _apply(op, values, converter, model, target, dense)
    except _NotLazy:
        return _eager(model, target, converter, collected, stored)
    return _full_names(target, values)


class _NotLazy(Exception):
    pass


def _apply(op, values: dict, converter, model, target: str, dense: dict) -> dict:
    name, patterns = type(op).__name__, converter.target_patterns
    if name == "MergeModulelist":
        if len(values) == 1 and len(patterns) == 1:
            return {patterns[0]: Stacked(_one_list(values), op.dim)}
        return {p: Stacked(parts, op.dim) for p, parts in values.items()}
    if name == "Concatenate":
        parts = [s for p in converter.source_patterns if p in values for s in _listed(values[p])]
        return {patterns[0]: Concatenated(parts, op.dim)}
    if name == "Chunk" and len(values) == 1:
        base = _one_list(values)[0]
        targets = op.get_target_patterns(patterns, config=model.config)
        size = base.shape[op.dim] // len(targets)
        if size * len(targets) != base.shape[op.dim]:
            raise _NotLazy  # torch.chunk's uneven last chunk: let transformers do it
        return {t: Narrowed(base, op.dim, i * size, size) for i, t in enumerate(targets)}
    if name == "Transpose" and len(values) == 1:
        (key, parts), = values.items()
        base = _listed(parts)[0]
        out_key = patterns[0] if len(patterns) == 1 else key
        if op.check_dims and base.shape == dense.get(target):
            return {out_key: base}
        return {out_key: Transposed(base, op.dim0, op.dim1)}
    raise _NotLazy


def _listed(value) -> list[Source]:
    return value if isinstance(value, list) else [value]


def _one_list(values: dict) -> list[Source]:
    return _listed(next(iter(values.values())))


def _full_names(target: str, values: dict) -> dict[str, Source]:
    """Target patterns (``mlp.experts.gate_up_proj``) → full keys, as ``transformers`` names them:
    the prefix and suffix of the first target's full key around its pattern."""
    full = target.replace("*.", "0.")
    hit = next((k for k in values if k in full), None)
    if hit is None:
        return dict(values)
    prefix, _, suffix = full.partition(hit)
    return {prefix + k + suffix: v for k, v in values.items()}


class _Eager(Source):
    """One tensor of a converter ``transformers`` runs itself, on the whole stored tensors."""

    def __init__(self, produce, key: str, shape, dtype, name: str):
        self.produce, self.key, self.shape, self.dtype, self.name = produce, key, shape, dtype, name

    def read(self, index):
        return self.produce()[self.key][index]


def _eager(model, target, converter, collected, stored) -> dict[str, Source]:
    cache = {}

    def produce():
        if not cache:
            conv = copy.deepcopy(converter)
            for pattern, keys in collected.items():
                conv.collected_tensors[pattern] = [stored[k].read_all for k in keys]
            out = conv.convert(target, model=model, config=model.config)
            cache.update({k: (v[0] if isinstance(v, list) else v) for k, v in out.items()})
        return cache

    with torch.device("meta"):  # shapes only: run the operations on meta stand-ins
        conv = copy.deepcopy(converter)
        for pattern, keys in collected.items():
            conv.collected_tensors[pattern] = [
                (lambda s=stored[k]: torch.empty(s.shape, dtype=s.dtype)) for k in keys]
        shapes = conv.convert(target, model=model, config=model.config)
    first = stored[next(iter(collected.values()))[0]]
    ops = ", ".join(type(op).__name__ for op in converter.operations)
    warnings.warn(f"{first.name}: transformers converts it ({ops}) into {target!r}; each rank reads "
                  f"the stored tensors of that conversion whole", stacklevel=4)
    return {k: _Eager(produce, k, tuple((v[0] if isinstance(v, list) else v).shape), first.dtype,
                      f"{first.name} (converted into {k!r})")
            for k, v in shapes.items()}


def _share_tied(model, sources: dict) -> None:
    """Tied parameters (an LM head sharing the embedding) are stored once: every name of a tied
    tensor gets the source of whichever name the checkpoint has."""
    names: dict[int, list[str]] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(key)
    for keys in names.values():
        found = next((sources[k] for k in keys if k in sources), None)
        if found is not None:
            for k in keys:
                sources.setdefault(k, found)


def _ignore_unexpected(model) -> list[str]:
    """``transformers``' patterns for stored tensors it drops without a word: the model's own, and
    the rotary ``inv_freq`` / ``position_ids`` buffers older versions saved."""
    patterns = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
    buffers = [name for name, _ in model.named_buffers()]
    if any(b.endswith("rotary_emb.inv_freq") for b in buffers):
        patterns.append(r"rotary_emb\.inv_freq")
    if any(b.endswith("position_ids") for b in buffers):
        patterns.append(r"(^|\.)position_ids$")
    return patterns


def _ignored(key: str, patterns) -> bool:
    return any(re.search(p, key) for p in (patterns or ()))


def _more(keys: list) -> str:
    return f"; {len(keys)} in all" if len(keys) > 1 else ""
