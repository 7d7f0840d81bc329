"""Fine-tuning data (``train --model``): documents tokenised by the model's own tokenizer, joined by
its EOS token and packed into sequences; batches that depend only on ``(seed, step)``.

Documents come from ``--data``: a text file (one document), a directory (each text file under it
one document, in sorted path order, as :mod:`ops_transformer.data` reads it) or a ``.jsonl`` file
(each line a JSON object whose ``text`` field is one document). Packing::

    tokens = doc₀ EOS doc₁ EOS doc₂ EOS …                    (one stream, int32)
    sample i = tokens[i·seq : i·seq + seq + 1]               (inputs, and targets shifted by one)

so every token but the first is predicted exactly once per epoch. The global batch of step ``s``
holds samples ``s·batch … s·batch + batch − 1`` of an endless sequence of epochs, each epoch a
permutation of all samples drawn from ``(seed, epoch)`` alone — never from the parallel layout:
data-parallel ranks then keep their rows (:func:`~ops_transformer.data.slice_for_rank`), so runs at
any ``dp × tp`` (and a resumed run) train on the same tokens in the same order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .data import _batch_seed, _directory_files, default_corpus_files
from ..utils.progress import Progress

PROGRESS_BYTES = 4 * 2**20  # tokenising more text than this shows a progress bar
DEFAULT_MAX_BYTES = 8_000_000  # the default corpus (no --data), as for the byte-level presets


def read_documents(path: str | Path | None) -> list[str]:
    """The documents of ``--data`` (see the module docstring); ``None``: the Python standard
    library's sources, one document per file, up to 8 MB."""
    if path is None:
        docs, size = [], 0
        for file in default_corpus_files():
            docs.append(file.read_text(errors="replace"))
            size += len(docs[-1])
            if size >= DEFAULT_MAX_BYTES:
                break
        return docs
    p = Path(path)
    if not p.exists():
        raise ValueError(f"--data {str(path)!r} does not exist")
    if p.is_dir():
        docs = [f.read_text(errors="replace") for f in _directory_files(p)]
    elif p.suffix == ".jsonl":
        docs = _jsonl_documents(p)
    else:
        docs = [p.read_text(errors="replace")]
    docs = [d for d in docs if d]
    if not docs:
        raise ValueError(f"--data {str(path)!r} holds no text")
    return docs


def _jsonl_documents(path: Path) -> list[str]:
    docs = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number} is not a JSON object: {exc}") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"{path}:{number} has no string field 'text' (a .jsonl file for "
                                 f"--data holds one {{\"text\": ...}} object per line)")
            docs.append(record["text"])
    return docs


def tokenize(docs: list[str], encode, eos: int | None, *, progress: bool = True) -> torch.Tensor:
    """``doc₀ EOS doc₁ EOS …`` as one int32 tensor; ``encode(list of texts)`` → lists of token
    ids. A bar shows the progress over more than a few MB of text (``progress``)."""
    total = sum(len(d) for d in docs)
    bar = Progress(total, desc="tokenize", enabled=progress and total > PROGRESS_BYTES)
    parts, start = [], 0
    with bar:
        while start < len(docs):
            batch, size = [], 0  # ~1 MB of documents per call of the (batched, Rust) tokenizer
            while start < len(docs) and (not batch or size < 2**20):
                batch.append(docs[start])
                size += len(docs[start])
                start += 1
            for ids in encode(batch):
                parts.append(torch.tensor(list(ids) + ([] if eos is None else [eos]),
                                          dtype=torch.int32))
            bar.update(size)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)


@dataclass(frozen=True, eq=False)
class PackedTokens:
    """A token stream cut into samples of ``seq + 1`` tokens, served in a seeded order."""

    tokens: torch.Tensor  # (n,) int32
    seq: int
    eos: int | None = None  # the separator of the documents (None: one document)
    _perm: dict = field(default_factory=dict, repr=False)  # (epoch, seed) → its order

    def __post_init__(self):
        if self.samples < 1:
            raise ValueError(f"the data has {self.tokens.numel()} tokens, too few for one sequence "
                             f"of --seq {self.seq} (it needs {self.seq + 1}): give more text or a "
                             f"shorter --seq")

    @property
    def samples(self) -> int:
        return (self.tokens.numel() - 1) // self.seq

    def order(self, epoch: int, seed: int) -> torch.Tensor:
        """The samples of ``epoch`` in the order they are served."""
        if (epoch, seed) not in self._perm:
            self._perm.clear()
            gen = torch.Generator().manual_seed(_batch_seed(seed, -1 - epoch))
            self._perm[epoch, seed] = torch.randperm(self.samples, generator=gen)
        return self._perm[epoch, seed]

    def get_batch(self, step: int, *, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of ``step``: ``(x, y)``, int64 ``(batch, seq)``, ``y`` = ``x``
        shifted one token ahead."""
        rows = []
        for g in range(step * batch, (step + 1) * batch):
            epoch, pos = divmod(g, self.samples)
            start = int(self.order(epoch, seed)[pos]) * self.seq
            rows.append(self.tokens[start:start + self.seq + 1])
        window = torch.stack(rows).long()  # (batch, seq + 1)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def document_ids(self, x: torch.Tensor) -> torch.Tensor:
        """``(batch, seq)``: each token's document in its row, from the EOS tokens (an EOS
        belongs to the document it ends; :mod:`ops_transformer.models.documents`)."""
        if self.eos is None:
            return torch.zeros_like(x)
        ends = x == self.eos
        return ends.long().cumsum(1) - ends.long()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt",
                   "tokenizer.model")
_TOKENS: dict[tuple, tuple] = {}  # (data, model_dir) → (tokens, eos), for this process


def packed_corpus(data: str | None, model_dir: str, seq: int, vocab: int,
                  say=None) -> PackedTokens:
    """``--data`` tokenised by the tokenizer in ``model_dir`` and packed into ``--seq`` samples;
    without tokenizer files the UTF-8 bytes are the token ids (``say(line)``, if given, tells it
    and shows the progress bar). The tokens are kept in the process, so local ranks forked after
    the launcher checked the data reuse them."""
    key = (data, str(model_dir))
    if key not in _TOKENS:
        encode, eos, note = model_tokenizer(Path(model_dir))
        if eos is not None and not 0 <= eos < vocab:
            raise ValueError(f"--model {str(model_dir)!r}: its EOS token id ({eos}) is outside "
                             f"the model's vocabulary of {vocab}")
        if note and say is not None:
            say(note)
        tokens = tokenize(read_documents(data), encode, eos, progress=say is not None)
        if tokens.numel() and int(tokens.max()) >= vocab:
            raise ValueError(f"the tokenizer of --model {str(model_dir)!r} makes token id "
                             f"{int(tokens.max())}, outside the model's vocabulary of {vocab}")
        _TOKENS.clear()
        _TOKENS[key] = tokens, eos
    tokens, eos = _TOKENS[key]
    return PackedTokens(tokens, seq, eos)


def model_tokenizer(root: Path):
    """``(encode, eos, note)``: the directory's own tokenizer (``AutoTokenizer``) and its EOS id,
    or — without tokenizer files — UTF-8 bytes as token ids and the config's EOS id, with a
    ``note`` saying so."""
    import transformers

    config = json.loads((root / "config.json").read_text())
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if any((root / f).is_file() for f in TOKENIZER_FILES):
        tokenizer = transformers.AutoTokenizer.from_pretrained(root)
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else eos

        def encode(texts):
            return tokenizer(texts, add_special_tokens=False)["input_ids"]

        return encode, eos, None if eos is not None else (
            f"--model {str(root)!r}: neither its tokenizer nor its config names an EOS token; "
            f"documents are joined without a separator")
    joined = f"joined by token {eos} (the config's eos_token_id)" if eos is not None else \
        "joined without a separator (the config has no eos_token_id)"
    note = (f"--model {str(root)!r} has no tokenizer files: --data is tokenised as UTF-8 bytes "
            f"(token id = byte value), documents {joined}")
    return (lambda texts: [list(t.encode("utf-8")) for t in texts]), eos, note
