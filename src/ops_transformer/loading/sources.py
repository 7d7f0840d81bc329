"""The tensors of a ``save_pretrained`` directory, read lazily: only the rectangle a rank asks for.

A :class:`Source` is a dense tensor of the model (its shape, the checkpoint's dtype) that has not
been read; ``source.read(index)`` reads the block ``index`` (one ``slice`` per dimension) of it and
nothing else. A tensor stored as such is a :class:`FileTensor` (``safe_open(...).get_slice``); a
tensor ``transformers`` assembles from several stored ones when it loads the checkpoint (Mixtral's
experts stacked and their gate and up projections concatenated) is a small expression over them —
:class:`Stacked`, :class:`Concatenated`, :class:`Narrowed`, :class:`Transposed` — whose ``read``
reads only the stored pieces the block overlaps::

    gate_up_proj [E, 2F, h] = cat(stack(w1 of experts 0…E−1), stack(w3 of experts 0…E−1), dim=1)
    read[e0:e1, F:2F, :]    = stack(w3 of experts e0…e1−1)          (no w1, no other expert read)

The safetensors files are memory-mapped: a block is a view of the page cache until the caller
copies it (onto its device, into its own parameter).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch

from ..checkpoint.errors import CheckpointError

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


class Source:
    """A dense tensor of ``shape`` not read yet; ``name`` says where it comes from."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    name: str

    def read(self, index: tuple[slice, ...]) -> torch.Tensor:
        raise NotImplementedError

    def read_all(self) -> torch.Tensor:
        return self.read(tuple(slice(0, n) for n in self.shape))


class FileTensor(Source):
    """Tensor ``key`` of one safetensors file (``handle``: its ``safe_open``)."""

    def __init__(self, handle, file: Path, key: str):
        piece = handle.get_slice(key)
        self.handle, self.file, self.key = handle, file, key
        self.shape = tuple(piece.get_shape())
        self.dtype = _DTYPES.get(piece.get_dtype())
        self.name = f"{file.name}: {key!r}"

    def read(self, index):
        if not self.shape:
            return self.handle.get_tensor(self.key)
        return self.handle.get_slice(self.key)[index]


class Stacked(Source):
    """``torch.stack(parts, dim)``."""

    def __init__(self, parts: list[Source], dim: int):
        first = parts[0]
        _same_shapes(parts, "stacked")
        self.parts, self.dim, self.dtype = parts, dim, first.dtype
        self.shape = (*first.shape[:dim], len(parts), *first.shape[dim:])
        self.name = f"stack of {len(parts)} ({first.name}, …)"

    def read(self, index):
        wanted, rest = index[self.dim], index[:self.dim] + index[self.dim + 1:]
        return torch.stack([p.read(rest) for p in self.parts[wanted]], self.dim)


class Concatenated(Source):
    """``torch.cat(parts, dim)``."""

    def __init__(self, parts: list[Source], dim: int):
        self.parts, self.dim, self.dtype = parts, dim, parts[0].dtype
        shape = list(parts[0].shape)
        shape[dim] = sum(p.shape[dim] for p in parts)
        self.shape = tuple(shape)
        self.name = f"concatenation of {len(parts)} ({parts[0].name}, …)"

    def read(self, index):
        start, stop = index[self.dim].start, index[self.dim].stop
        pieces, offset = [], 0
        for part in self.parts:
            size = part.shape[self.dim]
            lo, hi = max(start, offset), min(stop, offset + size)
            if lo < hi:
                sub = list(index)
                sub[self.dim] = slice(lo - offset, hi - offset)
                pieces.append(part.read(tuple(sub)))
            offset += size
        return torch.cat(pieces, self.dim) if len(pieces) > 1 else pieces[0]


class Narrowed(Source):
    """``base.narrow(dim, start, length)`` (one of the chunks ``torch.chunk`` makes)."""

    def __init__(self, base: Source, dim: int, start: int, length: int):
        self.base, self.dim, self.start, self.dtype = base, dim, start, base.dtype
        shape = list(base.shape)
        shape[dim] = length
        self.shape = tuple(shape)
        self.name = f"{base.name}[{start}:{start + length} along dim {dim}]"

    def read(self, index):
        sub = list(index)
        sub[self.dim] = slice(index[self.dim].start + self.start, index[self.dim].stop + self.start)
        return self.base.read(tuple(sub))


class Transposed(Source):
    """``base.transpose(dim0, dim1)``."""

    def __init__(self, base: Source, dim0: int, dim1: int):
        self.base, self.dims, self.dtype = base, (dim0, dim1), base.dtype
        shape = list(base.shape)
        shape[dim0], shape[dim1] = shape[dim1], shape[dim0]
        self.shape = tuple(shape)
        self.name = f"{base.name} transposed"

    def read(self, index):
        a, b = self.dims
        sub = list(index)
        sub[a], sub[b] = sub[b], sub[a]
        return self.base.read(tuple(sub)).transpose(a, b)


def _same_shapes(parts: list[Source], what: str) -> None:
    shapes = {p.shape for p in parts}
    if len(shapes) > 1:
        odd = next(p for p in parts if p.shape != parts[0].shape)
        raise CheckpointError(f"{odd.name} has shape {odd.shape}, but the tensors {what} with it "
                              f"have {parts[0].shape}")


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
           "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
           "F8_E5M2": getattr(torch, "float8_e5m2", None)}


def weight_files(root: Path) -> tuple[Path, list[Path]]:
    """``(what to name in errors, the safetensors files)`` of a model directory: the index and the
    files it names, or ``model.safetensors``. ``CheckpointError`` when there is neither or a file
    the index names is missing."""
    index = root / INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index} is not a readable weight index: {exc}") from None
        missing = [n for n in names if not (root / n).is_file()]
        if missing:
            raise CheckpointError(f"{index} names weight files that are missing: "
                                  f"{', '.join(missing)}")
        return index, [root / n for n in names]
    if (root / SINGLE).is_file():
        return root / SINGLE, [root / SINGLE]
    raise CheckpointError(f"{root} has no safetensors weights ({SINGLE} or {INDEX})")


class CheckpointFiles:
    """The open safetensors files of a model directory and their tensors (``with`` closes them)."""

    def __init__(self, root: Path):
        from safetensors import safe_open

        self.described, files = weight_files(Path(root))
        self._handles, self.tensors = [], {}
        try:
            for file in files:
                handle = safe_open(str(file), framework="pt", device="cpu")
                self._handles.append(handle)
                for key in handle.keys():
                    if key in self.tensors:
                        raise CheckpointError(f"{file.name} and {self.tensors[key].file.name} both "
                                              f"hold tensor {key!r}")
                    self.tensors[key] = FileTensor(handle, file, key)
        except CheckpointError:
            self.close()
            raise
        except Exception as exc:  # safetensors' own error: a truncated or corrupt file
            self.close()
            raise CheckpointError(f"{file} is not a readable safetensors file: "
                                  f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                                  ) from None

    def floating_dtype(self) -> torch.dtype | None:
        """The dtype of most of the floating-point bytes: the checkpoint's dtype."""
        weight = Counter()
        for t in self.tensors.values():
            if t.dtype is not None and t.dtype.is_floating_point:
                weight[t.dtype] += _numel(t.shape) * t.dtype.itemsize
        return weight.most_common(1)[0][0] if weight else None

    def nbytes(self) -> int:
        return sum(_numel(t.shape) * (t.dtype.itemsize if t.dtype else 1)
                   for t in self.tensors.values())

    def close(self) -> None:
        self._handles.clear()  # safe_open handles release their mapping when collected

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
