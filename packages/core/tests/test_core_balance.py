"""Unpacked rows and the token-balanced sampler (data.packing: false,
data.balance_tokens), without processes."""

import json
import random
import statistics

import torch

from paraxis.config.run import DataSection, RunConfig
from paraxis.train.balance import TokenBalancedStream, assign_balanced, padded_rows
from paraxis.train.data import BatchStream, ByteTokenizer, check_data


def long_tailed(n, seed=0, cap=512):
    """Lengths from a log-normal (median e^4.5 = 90 tokens, a tail to ``cap``)."""
    rng = random.Random(seed)
    return [min(cap, max(2, int(rng.lognormvariate(4.5, 1.0)))) for _ in range(n)]


def spread(lengths, groups):
    loads = [sum(lengths[i] for i in g) for g in groups]
    return max(loads) / min(loads)


def test_balanced_shares_are_equal_counts_of_every_row_with_tokens_within_10_percent():
    ratios, contiguous = [], []
    for step in range(200):
        lengths = long_tailed(32, seed=step)
        groups = assign_balanced(lengths, 4)
        assert sorted(i for g in groups for i in g) == list(range(32))
        assert all(len(g) == 8 and g == sorted(g) for g in groups)
        ratios.append(spread(lengths, groups))
        contiguous.append(spread(lengths, [range(r * 8, r * 8 + 8) for r in range(4)]))
    assert statistics.median(ratios) <= 1.01 and sorted(ratios)[179] <= 1.10, ratios
    assert statistics.median(contiguous) > 1.5  # what the sampler is for


def test_every_rank_computes_the_same_assignment():
    lengths = [5, 5, 5, 5, 9, 1, 9, 1]
    assert assign_balanced(lengths, 2) == assign_balanced(list(lengths), 2)
    assert spread(lengths, assign_balanced(lengths, 2)) == 1.0


def _rows(tmp_path, multiple=8):
    lengths = long_tailed(96, cap=60)
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": "x" * n}) + "\n" for n in lengths))
    return padded_rows(DataSection(source=str(path)), 64, ByteTokenizer(), multiple)


def test_unpacked_rows_are_one_document_each_padded_and_cut_to_the_longest(tmp_path):
    rows = _rows(tmp_path)
    batch = rows[torch.tensor([0, 1, 2])]
    lengths = rows.lengths[:3]
    width = batch["input_ids"].shape[1]
    assert width % 8 == 0 and width - 8 < int(lengths.max()) <= width
    assert batch["attention_mask"].sum(1).tolist() == lengths.tolist()
    assert (batch["input_ids"] * (1 - batch["attention_mask"])).sum() == 0
    assert _rows(tmp_path, None)[torch.tensor([0])]["input_ids"].shape[1] == 64


def _real_rows(parts):
    return sorted(tuple(row[mask > 0].tolist()) for part in parts
                  for row, mask in zip(part["input_ids"], part["attention_mask"], strict=True))


def test_the_balanced_stream_serves_the_same_global_batches_and_resumes(tmp_path):
    """Only which rank holds a row changes: the global batch, the position and a resume
    (on another number of ranks too) are BatchStream's."""
    rows = _rows(tmp_path)
    plain = [BatchStream(rows, global_batch=16, rank=r, ranks=2, seed=1) for r in range(2)]
    fair = [TokenBalancedStream(rows, global_batch=16, rank=r, ranks=2, seed=1)
            for r in range(2)]
    for _ in range(8):
        a = [s.next_batch() for s in plain]
        b = [s.next_batch() for s in fair]
        assert _real_rows(a) == _real_rows(b)
        loads = [int(p["attention_mask"].sum()) for p in b]
        assert max(loads) / min(loads) <= 1.5
    four = [TokenBalancedStream(rows, global_batch=16, rank=r, ranks=4, seed=1)
            for r in range(4)]
    for s in four:
        s.load_state_dict(fair[0].state_dict())
    assert four[0].position == fair[0].position == 128


def test_balance_needs_unpacked_rows():
    cfg = RunConfig.from_dict({"data": {"balance_tokens": True}})
    assert [p.field for p in check_data(cfg, ByteTokenizer())] == ["data.balance_tokens"]
    cfg = RunConfig.from_dict({"data": {"balance_tokens": True, "packing": False}})
    assert check_data(cfg, ByteTokenizer()) == []
