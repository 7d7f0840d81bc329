"""Fine-tuning data (documents, EOS-joined tokens packed into sequences, a seeded order) and the
learning-rate schedules; no process group."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ops_transformer.training.corpus import PackedTokens, read_documents, tokenize
from ops_transformer.training.data import slice_for_rank
from ops_transformer.training.schedule import check_schedule, lr_at


def test_documents_from_a_file_a_directory_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("second")
    (tmp_path / ".hidden").write_text("never")
    assert read_documents(tmp_path / "a.txt") == ["first"]
    assert read_documents(tmp_path) == ["first", "second"]
    lines = tmp_path / "d.jsonl"
    lines.write_text(json.dumps({"text": "one", "id": 1}) + "\n\n" + json.dumps({"text": "two"}))
    assert read_documents(lines) == ["one", "two"]


@pytest.mark.parametrize("content,needle", [
    ('{"text": "ok"}\nnot json\n', "d.jsonl:2 is not a JSON object"),
    ('{"text": "ok"}\n{"body": "x"}\n', "d.jsonl:2 has no string field 'text'"),
])
def test_bad_jsonl_names_the_line(tmp_path, content, needle):
    (tmp_path / "d.jsonl").write_text(content)
    with pytest.raises(ValueError, match=needle):
        read_documents(tmp_path / "d.jsonl")


def test_missing_or_empty_data(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_documents(tmp_path / "nothing.txt")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="holds no text"):
        read_documents(tmp_path / "empty.txt")


def _bytes(texts):
    return [list(t.encode()) for t in texts]


def test_documents_are_joined_by_eos(monkeypatch, capsys):
    tokens = tokenize(["ab", "c"], _bytes, eos=7, progress=True)
    assert tokens.tolist() == [97, 98, 7, 99, 7] and tokens.dtype == torch.int32
    assert capsys.readouterr().err == ""  # a few bytes: no progress bar
    monkeypatch.setattr("ops_transformer.training.corpus.PROGRESS_BYTES", 2)
    tokenize(["ab", "c"], _bytes, eos=7, progress=True)
    assert "tokenize" in capsys.readouterr().err


def test_packed_samples_follow_the_seed_only():
    packed = PackedTokens(torch.arange(41, dtype=torch.int32), seq=4)  # 10 samples of 4 + 1
    assert packed.samples == 10
    x, y = packed.get_batch(0, batch=5, seed=3)
    assert torch.equal(y[:, :-1], x[:, 1:]) and x.shape == (5, 4)
    starts = [int(row[0]) for step in range(2) for row in packed.get_batch(step, batch=5,
                                                                            seed=3)[0]]
    assert sorted(starts) == list(range(0, 40, 4))  # one epoch: every sample once
    again = PackedTokens(torch.arange(41, dtype=torch.int32), seq=4)
    assert torch.equal(again.get_batch(1, batch=5, seed=3)[0], packed.get_batch(1, batch=5,
                                                                                 seed=3)[0])
    assert not torch.equal(packed.get_batch(0, batch=5, seed=4)[0], x)
    # data-parallel ranks keep their rows of the same global batch
    halves = [slice_for_rank(x, y, r, 5)[0] for r in range(5)]
    assert torch.equal(torch.cat(halves), x)


def test_too_few_tokens_for_one_sequence():
    with pytest.raises(ValueError, match="too few for one sequence of --seq 8"):
        PackedTokens(torch.arange(8, dtype=torch.int32), seq=8)


def test_learning_rate_schedules():
    assert [lr_at(s, lr=1.0, steps=10, warmup=4) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    cosine = [lr_at(s, lr=2.0, steps=10, schedule="cosine", warmup=2) for s in range(10)]
    assert cosine[:3] == [1.0, 2.0, 2.0]
    assert all(a > b for a, b in zip(cosine[2:], cosine[3:]))
    assert math.isclose(cosine[-1], 2.0 * 0.5 * (1 + math.cos(math.pi * 7 / 8)))
    with pytest.raises(ValueError, match="--lr-schedule must be one of constant, cosine"):
        check_schedule("linear", 0, 10)
    with pytest.raises(ValueError, match=r"--warmup \(10\) must be shorter than --steps \(10\)"):
        check_schedule("cosine", 10, 10)
