"""Packed token sequences and the batch stream, without processes."""

import json

import numpy as np
import pytest
import torch

from paraxis.config.run import DataSection
from paraxis.train.data import BatchStream, ByteTokenizer, iter_documents, pack


def test_default_corpus_is_the_stdlib_and_offline():
    docs = list(iter_documents(DataSection(max_bytes=200_000)))
    assert len(docs) > 3 and "import" in "".join(docs)
    assert sum(len(d.encode()) for d in docs) <= 200_000


def test_text_and_jsonl_sources_pack_with_separators(tmp_path):
    (tmp_path / "a.txt").write_text("hello world")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "abc"}) + "\n" +
                                      json.dumps({"text": "de"}) + "\n")
    rows = pack(DataSection(source=str(tmp_path)), 4, ByteTokenizer())
    flat = rows.flatten().tolist()
    want = [*b"hello world", 0, *b"abc", 0, *b"de", 0]
    assert flat == want[: len(flat)] and rows.shape == (len(want) // 4, 4)


def test_hf_dataset_saved_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"body": ["first doc", "second"]}).save_to_disk(tmp_path / "ds")
    docs = list(iter_documents(DataSection(source=str(tmp_path / "ds"), text_field="body")))
    assert docs == ["first doc", "second"]


def test_ranks_read_disjoint_slices_and_position_resumes():
    rows = torch.arange(64 * 3).view(64, 3)
    streams = [BatchStream(rows, global_batch=8, rank=r, ranks=4, seed=5) for r in range(4)]
    seen = []
    for _ in range(3):
        parts = [s.next_batch() for s in streams]
        assert all(p.shape == (2, 3) for p in parts)
        seen.append(torch.cat(parts))
    firsts = torch.cat(seen)[:, 0].tolist()
    assert len(set(firsts)) == len(firsts)  # no sample served twice within an epoch
    resumed = BatchStream(rows, global_batch=8, rank=1, ranks=4, seed=5)
    resumed.load_state_dict(streams[1].state_dict())
    assert resumed.position == 24
    assert torch.equal(resumed.next_batch(), streams[1].next_batch())


def test_epochs_wrap_with_a_new_order():
    rows = torch.arange(16).view(16, 1)
    s = BatchStream(rows, global_batch=8, rank=0, ranks=1, seed=0)
    epoch0 = torch.cat([s.next_batch(), s.next_batch()]).flatten()
    epoch1 = torch.cat([s.next_batch(), s.next_batch()]).flatten()
    assert sorted(epoch0.tolist()) == sorted(epoch1.tolist()) == list(range(16))
    assert not torch.equal(epoch0, epoch1)


def test_too_little_data_is_a_clear_error(tmp_path):
    (tmp_path / "t.txt").write_text("ab")
    with pytest.raises(ValueError, match="fewer than one sequence"):
        pack(DataSection(source=str(tmp_path / "t.txt")), 64, ByteTokenizer())
    with pytest.raises(ValueError, match="only 2 sequences"):
        BatchStream(torch.zeros(2, 4), global_batch=4, rank=0, ranks=1)


def test_local_hugging_face_tokenizer(tmp_path):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # Train a tiny BPE in memory and save it: a local tokenizer, nothing downloaded.
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["def f(x): return x", "import os"] * 20,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>",
                            unk_token="<unk>").save_pretrained(tmp_path / "tok")
    (tmp_path / "corpus.txt").write_text("def f(x): return x\n" * 50)
    from paraxis.train.data import load_tokenizer

    tokenizer = load_tokenizer(str(tmp_path / "tok"))
    rows = pack(DataSection(source=str(tmp_path / "corpus.txt")), 8, tokenizer)
    assert rows.max() < tokenizer.vocab_size and rows.shape[1] == 8
    assert tokenizer.separator == tokenizer.tok.eos_token_id


def _problems(tmp_path, **data):
    from paraxis.config.run import RunConfig
    from paraxis.train.data import check_data

    cfg = RunConfig.from_dict({"model": {"family": "llama", "config": {"vocab_size": 128}},
                               "data": data})
    return {(p.field, p.rule) for p in check_data(cfg, ByteTokenizer())}


def test_bad_data_is_named_before_anything_is_tokenized(tmp_path):
    """Each is one Problem (the CLI reports them with the configuration's, before any
    process starts; train() raises them before any process group)."""
    datasets = pytest.importorskip("datasets")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "rows.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    datasets.Dataset.from_dict({"body": ["a"]}).save_to_disk(tmp_path / "ds")
    datasets.Dataset.from_dict({"text": []}).save_to_disk(tmp_path / "none")
    cases = {
        "missing": (dict(source=str(tmp_path / "nope.txt")), "does not exist"),
        "empty file": (dict(source=str(tmp_path / "empty.txt")), "holds no text"),
        "jsonl field": (dict(source=str(tmp_path / "rows.jsonl")), "no field 'text'"),
        "dataset column": (dict(source=str(tmp_path / "ds")), "has no column 'text'"),
        # datasets cannot open an empty save: said so, with its error
        "empty dataset": (dict(source=str(tmp_path / "none")), "cannot be opened"),
        "eval source": (dict(eval={"source": str(tmp_path / "gone")}), "does not exist"),
    }
    for name, (data, says) in cases.items():
        found = _problems(tmp_path, **data)
        rules = [rule for _, rule in found]
        # a byte tokenizer (256 tokens) against a 128-token model is always wrong too
        assert len(found) == 2 and any(says in r for r in rules), (name, found)
        assert any("has 256 tokens but model.config.vocab_size is 128" in r for r in rules)
    assert _problems(tmp_path, source=str(tmp_path / "ds"), text_field="body") == {
        ("data.tokenizer", "has 256 tokens but model.config.vocab_size is 128: ids past "
                           "the embedding would index out of range")}


def _corpus(tmp_path, n=400):
    import random

    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(
        2, 40)))}) + "\n" for _ in range(n)))
    return path


def _prepared(tmp_path, workers=1):
    from paraxis.train.data import load_tokenizer
    from paraxis.train.shards import prepare

    source = _corpus(tmp_path)
    out = tmp_path / "shards"
    prepare(iter_documents(DataSection(source=str(source))), out,
            load_tokenizer=load_tokenizer, tokenizer_name="bytes", source=str(source),
            workers=workers)
    return source, out


def test_prepared_shards_hold_the_same_rows_memory_mapped(tmp_path):
    """Two tokenizing processes write what one process packs, in order; the rows are
    read from the memory map (not loaded), a batch's rows only."""
    from paraxis.train.shards import TokenRows

    source, out = _prepared(tmp_path, workers=2)
    whole = pack(DataSection(source=str(source)), 16, ByteTokenizer())
    rows = pack(DataSection(source=str(out)), 16, ByteTokenizer())
    assert isinstance(rows, TokenRows) and len(rows) == len(whole)
    assert torch.equal(rows[torch.arange(len(rows))], whole)
    assert isinstance(rows.grid, np.memmap)
    stream = BatchStream(rows, global_batch=4, rank=1, ranks=2, seed=3)
    again = BatchStream(whole, global_batch=4, rank=1, ranks=2, seed=3)
    for _ in range(5):
        assert torch.equal(stream.next_batch(), again.next_batch())
    meta = json.loads((out / "meta.json").read_text())
    assert meta["documents"] == 400 and meta["dtype"] == "uint16"


def test_damaged_shards_are_named_before_training(tmp_path):
    from paraxis.config.run import RunConfig
    from paraxis.train.data import check_data

    _, out = _prepared(tmp_path)
    cfg = RunConfig.from_dict({"data": {"source": str(out)}})
    assert check_data(cfg, ByteTokenizer()) == []
    meta = json.loads((out / "meta.json").read_text())
    tokens = (out / "tokens.bin").read_bytes()
    cases = [
        (lambda: (out / "tokens.bin").write_bytes(tokens[:-10]), "holds"),
        (lambda: (out / "meta.json").write_text(json.dumps({**meta, "dtype": "int8"})),
         "names dtype 'int8'"),
        (lambda: (out / "meta.json").write_text("{trunc"), "cannot be read"),
        (lambda: (out / "meta.json").write_text(json.dumps({**meta, "documents": 3})),
         "indexes 400 documents"),
        (lambda: (out / "meta.json").write_text(json.dumps({**meta, "tokenizer": "x"})),
         "was prepared with tokenizer 'x'"),
    ]
    for damage, says in cases:
        damage()
        problems = check_data(cfg, ByteTokenizer())
        assert len(problems) == 1 and says in problems[0].rule, (says, problems)
        (out / "tokens.bin").write_bytes(tokens)
        (out / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("n", [1, 2, 3, 7, 100, 4097, 65_536, 100_003])
def test_the_shuffle_is_a_permutation(n):
    from paraxis.train.order import permute

    assert sorted(permute(torch.arange(n), n, seed=5).tolist()) == list(range(n))


def test_the_order_costs_no_memory_per_row():
    """A billion rows (randperm would hold 8 GB): a batch computes only its own."""

    class Rows:
        def __len__(self):
            return 10**9

        def __getitem__(self, index):
            return index

    stream = BatchStream(Rows(), global_batch=8, rank=1, ranks=2, seed=0)
    first, second = stream.next_batch(), stream.next_batch()
    assert first.shape == (4,) and len(set(first.tolist() + second.tolist())) == 8
    assert all(0 <= i < 10**9 for i in first.tolist())


def test_a_resume_on_another_layout_continues_at_the_same_samples():
    """The position counts the whole run's samples and the order depends on the seed and
    the epoch only: 2 sample-splitting ranks saved, 4 resume, and the next global batches
    are the ones the 2 would have read."""
    rows = torch.arange(40 * 2).view(40, 2)
    two = [BatchStream(rows, global_batch=8, rank=r, ranks=2, seed=9) for r in range(2)]
    for _ in range(7):  # into the second epoch (5 batches per epoch)
        for s in two:
            s.next_batch()
    state = two[0].state_dict()
    four = [BatchStream(rows, global_batch=8, rank=r, ranks=4, seed=9) for r in range(4)]
    for s in four:
        s.load_state_dict(state)
    for _ in range(4):
        assert torch.equal(torch.cat([s.next_batch() for s in four]),
                           torch.cat([s.next_batch() for s in two]))
