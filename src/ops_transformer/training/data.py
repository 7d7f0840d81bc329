"""Byte-level language-model data: a corpus as a ``uint8`` tensor, and batches drawn from it.

Tokens are bytes (``VOCAB_SIZE = 256``), so there is no tokenizer to download or version. The
default corpus is the Python standard library's own ``.py`` sources on the running interpreter:
real text present on every machine, read in sorted order so that every process of a run sees the
same bytes.

A batch is a pure function of ``(seed, step)``::

    starts ~ U[0, n - seq)              # batch offsets, from a generator seeded by (seed, step)
    x[b] = data[starts[b] : starts[b] + seq]
    y[b] = data[starts[b] + 1 : starts[b] + seq + 1]      # next-token targets

It never depends on the parallel layout: every rank draws the same global batch, and a
data-parallel rank keeps its contiguous block of rows (:func:`slice_for_rank`). Runs at different
``tp``/``dp`` therefore train on identical tokens, which is what makes their losses comparable.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB_SIZE = 256
DEFAULT_MAX_BYTES = 8_000_000

# Directory names never entered when collecting the default corpus: installed third-party
# packages (they differ between machines) and the standard library's own test suites (large,
# repetitive, and absent from some distributions' builds).
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests",
                        "idle_test"})
_TEXT_SNIFF_BYTES = 1024


def encode(text: str) -> list[int]:
    """Token ids of ``text``: its UTF-8 bytes."""
    return list(text.encode("utf-8"))


def decode(ids) -> str:
    """Text of token ids (a list or tensor of ints in 0..255); invalid UTF-8 becomes U+FFFD."""
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def default_corpus_files() -> list[Path]:
    """The standard library's ``.py`` files on this interpreter, sorted by relative path.

    Third-party packages and test directories are skipped, so the list depends only on the
    Python version, not on what else is installed.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath, name)
                files.append((path.relative_to(root).as_posix(), path))
    files.sort()
    return [path for _, path in files]


def _is_text(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" not in f.read(_TEXT_SNIFF_BYTES)


def _directory_files(root: Path) -> list[Path]:
    """Text-like files under ``root``, recursively, sorted; hidden files and folders skipped."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            path = Path(dirpath, name)
            if not name.startswith(".") and path.is_file() and _is_text(path):
                files.append((path.relative_to(root).as_posix(), path))
    files.sort()
    return [path for _, path in files]


def _concat(files: list[Path], max_bytes: int) -> bytes:
    parts, size = [], 0
    for path in files:
        chunk = path.read_bytes()[: max_bytes - size]
        parts.append(chunk)
        size += len(chunk)
        if size >= max_bytes:
            break
    return b"".join(parts)


@functools.lru_cache(maxsize=4)
def _default_corpus_bytes(max_bytes: int) -> bytes:
    return _concat(default_corpus_files(), max_bytes)


def load_corpus(path: str | Path | None = None, *,
                max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    """The corpus as a 1-D ``torch.uint8`` tensor of at most ``max_bytes`` bytes.

    ``None`` reads the default corpus (:func:`default_corpus_files`, cached per process); a file
    is read as bytes; a directory contributes every text-like file under it (no NUL byte in the
    first KiB; hidden entries skipped), concatenated in sorted relative-path order. Each call
    returns a fresh tensor, so callers may modify it.
    """
    if not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"max_bytes must be a positive integer, got {max_bytes!r}")
    if path is None:
        raw, source = _default_corpus_bytes(max_bytes), "the default corpus (Python stdlib)"
    else:
        p = Path(path)
        if not p.exists():
            raise ValueError(f"corpus path {str(path)!r} does not exist")
        if p.is_dir():
            raw, source = _concat(_directory_files(p), max_bytes), f"directory {str(path)!r}"
        else:
            raw, source = p.read_bytes()[:max_bytes], f"file {str(path)!r}"
    if not raw:
        raise ValueError(f"corpus is empty: {source} holds no text bytes")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def check_corpus(data: torch.Tensor, seq: int) -> None:
    """Raise ``ValueError`` unless ``data`` is a 1-D corpus with at least two windows of ``seq``.

    A window needs ``seq + 1`` bytes (inputs plus the shifted target); asking for ``seq + 2``
    guarantees more than one distinct starting offset.
    """
    if not isinstance(seq, int) or seq < 1:
        raise ValueError(f"seq must be a positive integer, got {seq!r}")
    if data.dim() != 1:
        raise ValueError(f"corpus must be a 1-D tensor of bytes, got shape {tuple(data.shape)}")
    n = data.numel()
    if n < seq + 2:
        raise ValueError(f"corpus has {n} bytes, needs at least seq+2 = {seq + 2} for --seq {seq}")


def _batch_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed from ``(seed, step)`` alone, identical in every process."""
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def get_batch(data: torch.Tensor, step: int, *, batch: int, seq: int,
              seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch for ``step``: ``(x, y)``, int64 of shape ``(batch, seq)``, ``y`` = ``x``
    shifted one byte ahead. Depends only on ``(data, seed, step, batch, seq)``; the tensors are on
    ``data``'s device."""
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive integer, got {batch!r}")
    check_corpus(data, seq)
    gen = torch.Generator().manual_seed(_batch_seed(seed, step))
    starts = torch.randint(0, data.numel() - seq, (batch,), generator=gen)  # (batch,)
    idx = starts[:, None] + torch.arange(seq + 1)                            # (batch, seq+1)
    window = data[idx.to(data.device)].long()                                # (batch, seq+1)
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def slice_for_rank(x: torch.Tensor, y: torch.Tensor, dp_rank: int,
                   dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the global batch fed by data-parallel rank ``dp_rank``: the contiguous block
    ``[dp_rank·b, (dp_rank+1)·b)`` with ``b = batch // dp_size``."""
    batch = x.shape[0]
    if y.shape[0] != batch:
        raise ValueError(f"x and y must have the same batch size, got {batch} and {y.shape[0]}")
    if dp_size < 1:
        raise ValueError(f"dp must be a positive integer, got {dp_size}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in 0..{dp_size - 1} for dp {dp_size}, got {dp_rank}")
    if batch % dp_size:
        raise ValueError(f"batch ({batch}) must be divisible by dp ({dp_size})")
    rows = batch // dp_size
    block = slice(dp_rank * rows, (dp_rank + 1) * rows)
    return x[block], y[block]


@dataclass(frozen=True, eq=False)
class ByteBatches:
    """Batches of one corpus at a fixed shape and seed, validated once at construction.

    ``batches.get(step)`` is the global batch; ``batches.for_rank(step, dp_rank, dp_size)`` the
    rows one data-parallel rank feeds.
    """

    data: torch.Tensor
    batch: int
    seq: int
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"batch must be a positive integer, got {self.batch!r}")
        check_corpus(self.data, self.seq)

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return get_batch(self.data, step, batch=self.batch, seq=self.seq, seed=self.seed)

    def for_rank(self, step: int, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return slice_for_rank(*self.get(step), dp_rank, dp_size)
