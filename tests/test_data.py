"""Byte-level data: the default corpus, file and directory corpora, batches, data-parallel slices."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from ops_transformer.training.data import (VOCAB_SIZE, ByteBatches, check_corpus, decode,
                                  default_corpus_files, encode, get_batch, load_corpus,
                                  slice_for_rank)


def _digest(data: torch.Tensor) -> str:
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


def test_default_corpus_files_are_stdlib_sources_without_tests():
    files = default_corpus_files()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert len(files) > 100
    assert files == default_corpus_files()
    rel = [f.relative_to(stdlib).as_posix() for f in files]
    assert rel == sorted(rel)
    assert all(r.endswith(".py") for r in rel)
    skipped = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    assert not any(skipped & set(r.split("/")[:-1]) for r in rel)
    assert "argparse.py" in rel


def test_default_corpus_is_uint8_bounded_and_deterministic():
    data = load_corpus(max_bytes=1_000_000)
    assert data.dtype == torch.uint8 and data.dim() == 1
    assert 0 < data.numel() <= 1_000_000
    assert torch.equal(data, load_corpus(max_bytes=1_000_000))
    # a prefix of the larger default corpus: files are concatenated in the same order
    assert torch.equal(data, load_corpus()[: data.numel()])


def test_default_corpus_is_identical_in_another_process():
    code = ("import hashlib; from ops_transformer.training.data import load_corpus; "
            "print(hashlib.sha256(load_corpus(max_bytes=500_000).numpy().tobytes()).hexdigest())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == _digest(load_corpus(max_bytes=500_000))


def test_load_corpus_returns_a_fresh_tensor():
    a = load_corpus(max_bytes=1000)
    a.zero_()
    assert load_corpus(max_bytes=1000).sum() > 0


def test_load_corpus_file_and_directory(tmp_path):
    (tmp_path / "b.txt").write_text("world\n")
    (tmp_path / "a.txt").write_text("hello ")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("!")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01binary")
    (tmp_path / ".hidden").write_text("secret")
    assert decode(load_corpus(tmp_path / "a.txt")) == "hello "
    assert decode(load_corpus(str(tmp_path))) == "hello world\n!"
    assert decode(load_corpus(tmp_path, max_bytes=8)) == "hello wo"


def test_load_corpus_errors(tmp_path):
    with pytest.raises(ValueError, match="corpus path .*nope.* does not exist"):
        load_corpus(tmp_path / "nope")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="corpus is empty"):
        load_corpus(tmp_path / "empty.txt")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.bin").write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError, match="corpus is empty: directory"):
        load_corpus(tmp_path / "d")
    with pytest.raises(ValueError, match="max_bytes must be a positive integer, got 0"):
        load_corpus(max_bytes=0)


def test_encode_decode_roundtrip():
    text = "tensor parallel — Σ ✓"
    ids = encode(text)
    assert all(0 <= i < VOCAB_SIZE for i in ids) and len(ids) > len(text)
    assert decode(ids) == text
    assert decode(torch.tensor(ids)) == text
    assert decode([0xFF]) == "\ufffd"


def test_get_batch_shapes_shift_and_determinism():
    data = load_corpus(max_bytes=200_000)
    x, y = get_batch(data, 3, batch=4, seq=16, seed=7)
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.min()) >= 0 and int(x.max()) < VOCAB_SIZE
    x2, y2 = get_batch(data, 3, batch=4, seq=16, seed=7)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, get_batch(data, 4, batch=4, seq=16, seed=7)[0])
    assert not torch.equal(x, get_batch(data, 3, batch=4, seq=16, seed=8)[0])


def test_get_batch_rows_are_windows_of_the_corpus():
    data = torch.arange(100, dtype=torch.uint8)
    x, y = get_batch(data, 0, batch=8, seq=10, seed=0)
    for row_x, row_y in zip(x, y):
        start = int(row_x[0])
        assert torch.equal(row_x, torch.arange(start, start + 10))
        assert torch.equal(row_y, torch.arange(start + 1, start + 11))
        assert start + 10 < 100


def test_get_batch_ignores_global_rng_state():
    data = load_corpus(max_bytes=50_000)
    torch.manual_seed(0)
    a = get_batch(data, 1, batch=2, seq=8, seed=0)[0]
    torch.manual_seed(123)
    torch.rand(10)
    assert torch.equal(a, get_batch(data, 1, batch=2, seq=8, seed=0)[0])


def test_get_batch_smallest_corpus():
    data = torch.arange(6, dtype=torch.uint8)  # seq + 2 bytes: two possible windows
    x, y = get_batch(data, 0, batch=16, seq=4, seed=0)
    assert set(x[:, 0].tolist()) <= {0, 1}


def test_check_corpus_names_the_values():
    with pytest.raises(ValueError, match=r"corpus has 10 bytes, needs at least seq\+2 = 18 "
                                         r"for --seq 16"):
        check_corpus(torch.zeros(10, dtype=torch.uint8), 16)
    with pytest.raises(ValueError, match="seq must be a positive integer, got 0"):
        check_corpus(torch.zeros(10, dtype=torch.uint8), 0)
    with pytest.raises(ValueError, match="corpus has 10 bytes"):
        get_batch(torch.zeros(10, dtype=torch.uint8), 0, batch=1, seq=16, seed=0)
    with pytest.raises(ValueError, match="batch must be a positive integer, got 0"):
        get_batch(torch.zeros(100, dtype=torch.uint8), 0, batch=0, seq=16, seed=0)
    check_corpus(torch.zeros(18, dtype=torch.uint8), 16)


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_slice_for_rank_covers_the_global_batch(dp):
    data = load_corpus(max_bytes=50_000)
    x, y = get_batch(data, 5, batch=8, seq=12, seed=1)
    parts = [slice_for_rank(x, y, r, dp) for r in range(dp)]
    assert all(px.shape == (8 // dp, 12) for px, _ in parts)
    assert torch.equal(torch.cat([px for px, _ in parts]), x)
    assert torch.equal(torch.cat([py for _, py in parts]), y)


def test_slice_for_rank_errors():
    x = y = torch.zeros(6, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"batch \(6\) must be divisible by dp \(4\)"):
        slice_for_rank(x, y, 0, 4)
    with pytest.raises(ValueError, match=r"dp_rank must be in 0\.\.2 for dp 3, got 3"):
        slice_for_rank(x, y, 3, 3)
    with pytest.raises(ValueError, match="dp must be a positive integer, got 0"):
        slice_for_rank(x, y, 0, 0)


def test_byte_batches_matches_functions():
    data = load_corpus(max_bytes=50_000)
    batches = ByteBatches(data, batch=4, seq=8, seed=3)
    x, y = batches.get(2)
    assert torch.equal(x, get_batch(data, 2, batch=4, seq=8, seed=3)[0])
    assert torch.equal(batches.for_rank(2, 1, 2)[1], y[2:])
    with pytest.raises(ValueError, match="corpus has 5 bytes"):
        ByteBatches(data[:5], batch=4, seq=8)
