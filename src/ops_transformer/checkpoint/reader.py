"""Reading a checkpoint never runs code from it.

A checkpoint directory is as trustworthy as whoever could write it: the manifest's SHA-256 records
catch accidents (a truncated or flipped file), not an attacker, who can recompute them. What DCP
reads besides raw tensor bytes is pickled, and a pickle can call any function (``os.system``) while
it loads. So every pickle of a checkpoint is read with an allow-list of what it may build:

=========================  ====================================================================
what                       read with
=========================  ====================================================================
``.metadata`` (DCP's       :class:`MetadataUnpickler`: only DCP's metadata types
global metadata)           (:data:`METADATA_TYPES`), ``torch.Size``, dtypes, layouts, paths
tensors in ``*.distcp``    ``torch.load(weights_only=True)`` (DCP's own reader)
other values (``extra``,   ``torch.load(weights_only=True)`` (:class:`~.chunked.LoadPlanner`):
RNG states, optimizer      tensors, numbers, strings, ``None``, lists, tuples, dicts
hyperparameters, scaler)
=========================  ====================================================================

Anything else is an :class:`UnsafeCheckpointError` (a :class:`CheckpointError`) naming the file
and what it asked for; nothing from the checkpoint is loaded then. :class:`SafeReader` is DCP's
``FileSystemReader`` with these rules, used by every load, ``inspect`` and ``export``.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import re
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from .errors import CheckpointError, DamagedCheckpointError

_DCP = "torch.distributed.checkpoint"
METADATA_TYPES = frozenset({
    (f"{_DCP}.metadata", "Metadata"), (f"{_DCP}.metadata", "MetadataIndex"),
    (f"{_DCP}.metadata", "ChunkStorageMetadata"), (f"{_DCP}.metadata", "TensorStorageMetadata"),
    (f"{_DCP}.metadata", "BytesStorageMetadata"), (f"{_DCP}.metadata", "TensorProperties"),
    (f"{_DCP}.metadata", "StorageMeta"), (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),  # a layout by its name
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict"),
})


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds a pickle that asks for more than checkpoints hold (it could run
    code): refused, nothing loaded."""


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that builds DCP's metadata types and nothing else (no function, no class
    outside :data:`METADATA_TYPES` besides torch's dtypes)."""

    def find_class(self, module: str, name: str):
        if (module, name) in METADATA_TYPES or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def refused(path: Path, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(f"checkpoint {path}: file {what}; refused (loading a checkpoint "
                                 f"never runs code from it, see docs/checkpoints.md)")


def read_metadata(path: Path) -> Metadata:
    """DCP's ``.metadata`` of the checkpoint at ``path``, through :class:`MetadataUnpickler`."""
    file = Path(path) / ".metadata"
    try:
        with open(file, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except pickle.UnpicklingError as exc:
        if re.fullmatch(r"[\w.]+\.[\w]+", str(exc)):
            raise refused(path, f"'.metadata' asks to load {exc}, which DCP metadata never "
                                f"holds") from None
        raise DamagedCheckpointError(f"checkpoint {path}: file '.metadata' is not DCP metadata "
                              f"({exc})") from None
    except (OSError, EOFError, ValueError, TypeError, AttributeError, IndexError) as exc:
        raise DamagedCheckpointError(f"checkpoint {path}: file '.metadata' is unreadable "
                              f"({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise DamagedCheckpointError(f"checkpoint {path}: file '.metadata' is not DCP metadata (it "
                              f"holds a {type(metadata).__name__})")
    return metadata


def weights_only_problem(exc: BaseException) -> str | None:
    """What ``torch.load(weights_only=True)`` refused, from its error, or ``None`` when ``exc``
    is another error."""
    if not isinstance(exc, pickle.UnpicklingError):
        return None
    text = str(exc)
    found = re.search(r"WeightsUnpickler error: ([^\n]*)", text)
    reason = (found.group(1) if found else text.splitlines()[0] if text else "refused")
    return reason.split(" was not an allowed global")[0].strip().rstrip(".")


class SafeReader(FileSystemReader):
    """DCP's file-system reader, reading ``.metadata`` with :class:`MetadataUnpickler` and
    naming the file of any value it cannot read (a refused pickle: :class:`UnsafeCheckpointError`)."""

    def __init__(self, path):
        super().__init__(path)
        self.directory = Path(path)

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_metadata(self.directory)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path,
                                []).append(item)
        for name, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except CheckpointError:
                raise
            except Exception as exc:  # noqa: BLE001 - named, in one line
                problem = weights_only_problem(exc)
                if problem is not None:
                    raise refused(self.directory, f"{name!r} holds a pickled value that asks "
                                                  f"for more than tensors and plain data "
                                                  f"({problem})") from None
                first = str(exc).splitlines()[0] if str(exc) else ""
                raise DamagedCheckpointError(f"checkpoint {self.directory}: file {name!r} could not be "
                                      f"read ({type(exc).__name__}: {first})") from None
        return _done()


def _done():
    from torch.futures import Future

    future: Future = Future()
    future.set_result(None)
    return future


def check_pickled_values(path: Path, metadata: Metadata) -> int:
    """Load every pickled value (not the tensors) of the checkpoint at ``path`` the way a load
    does, ``weights_only=True``, and discard it: what ``inspect`` does to refuse a crafted value
    before anyone loads it. Returns how many were checked."""
    checked = 0
    for index, info in metadata.storage_data.items():
        md = metadata.state_dict_metadata.get(index.fqn)
        if not isinstance(md, BytesStorageMetadata):
            continue
        try:
            with open(path / info.relative_path, "rb") as f:
                f.seek(info.offset)
                data = f.read(info.length)
            torch.load(io.BytesIO(data), weights_only=True)
        except Exception as exc:  # noqa: BLE001 - named, in one line
            problem = weights_only_problem(exc)
            if problem is not None:
                raise refused(path, f"{info.relative_path!r} holds a pickled value "
                                    f"({index.fqn!r}) that asks for more than tensors and plain "
                                    f"data ({problem})") from None
            raise DamagedCheckpointError(f"checkpoint {path}: value {index.fqn!r} in file "
                                  f"{info.relative_path!r} is unreadable "
                                  f"({type(exc).__name__})") from None
        checked += 1
    return checked


def rank_failures(exc: BaseException) -> list[tuple[int, BaseException]]:
    """``[(rank, exception)]`` that a DCP ``CheckpointException`` carries (by rank), or
    ``[]`` for another exception."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return []
    return [(rank, value[0] if isinstance(value, tuple) else value)
            for rank, value in sorted(failures.items())]
