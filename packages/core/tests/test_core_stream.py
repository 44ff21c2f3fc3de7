"""A ``datasets`` stream as packed rows (data.streaming), without processes: each rank
reads its own stream shards, the global batches do not depend on the layout, a resume
continues at the same global batches or is refused with the reason, and a rank's memory
does not grow with the corpus."""

import json
import random
import tracemalloc

import pytest
import torch

from paraxis.config.run import RunConfig
from paraxis.train.data import ByteTokenizer, check_data
from paraxis.train.stream import StreamBatches

datasets = pytest.importorskip("datasets")

SEQ, BATCH = 16, 8


def _corpus(path, files=4, docs=40, seed=0, long=30):
    rng = random.Random(seed)
    path.mkdir(parents=True, exist_ok=True)
    for k in range(files):
        (path / f"part{k:03d}.jsonl").write_text("".join(
            json.dumps({"text": f"{k}.{i} " + "ab" * rng.randint(1, long)}) + "\n"
            for i in range(docs)))
    return path


def _streams(source, ranks, shards=None, **kw):
    return [StreamBatches(str(source), tokenizer=ByteTokenizer(), text_field="text",
                          seq_length=SEQ, global_batch=BATCH, rank=r, ranks=ranks,
                          shards=shards, **kw) for r in range(ranks)]


def _global(streams):
    return torch.cat([s.next_batch() for s in streams])


def _state(streams):
    """What a checkpoint holds: every rank's shard positions (gathered_state's merge)."""
    state = streams[0].state_dict()
    for s in streams[1:]:
        state["positions"].update(s.state_dict()["positions"])
    return json.loads(json.dumps(state))  # as it comes back from the index (JSON)


def test_ranks_read_their_own_shards_and_the_batches_do_not_depend_on_the_layout(tmp_path):
    """Four ranks and one rank over the same 4 shards serve the same global batches; no
    document is read by two ranks; every shard's rows are its documents in order."""
    source = _corpus(tmp_path / "c")
    four, one = _streams(source, 4), _streams(source, 1, shards=4)
    seen = [[] for _ in range(4)]
    for _ in range(6):
        parts = [s.next_batch() for s in four]
        assert all(p.shape == (BATCH // 4, SEQ) for p in parts)
        assert torch.equal(torch.cat(parts), one[0].next_batch())
        for rank, part in enumerate(parts):
            seen[rank].append(part.flatten())
    texts = [bytes(torch.cat(s).tolist()).decode() for s in seen]
    for rank, text in enumerate(texts):  # four files, four shards: a file each
        docs = [d for d in text.split("\0")[:-1] if d and d[0].isdigit()]
        assert docs and all(d.startswith(f"{rank}.") for d in docs), (rank, docs[:3])
        first = [int(d.split(" ")[0].split(".")[1]) for d in docs]
        assert first == sorted(first)


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_resume_continues_at_the_same_batches_across_epochs_and_layouts(tmp_path,
                                                                           shuffle):
    """Saved on 2 ranks (2 shards) after 30 batches (past an epoch of the smaller
    shards); resumed on 2 and on 1: the next global batches are the ones an unbroken run
    reads. Shards that do not divide the files split by documents, as exactly; with
    ``shuffle`` the files' order changes each epoch, and the resume follows it."""
    source = _corpus(tmp_path / "c", files=3, docs=15)
    unbroken = _streams(source, 2, shuffle=shuffle, seed=4)
    reference = [_global(unbroken) for _ in range(45)]
    if shuffle:  # the order really differs from the files' own
        plain = _streams(source, 2)
        assert any(not torch.equal(_global(plain), r) for r in reference)
    saved = _streams(source, 2, shuffle=shuffle, seed=4)
    for _ in range(30):
        _global(saved)
    assert any(p["epoch"] > 0 for p in _state(saved)["positions"].values())
    for ranks in (2, 1):
        resumed = _streams(source, ranks, shuffle=shuffle, seed=4)
        for s in resumed:
            s.load_state_dict(_state(saved))
        for b in range(30, 45):
            assert torch.equal(_global(resumed), reference[b]), (ranks, b)


def test_a_layout_that_cannot_resume_exactly_is_refused_with_the_reason(tmp_path):
    source = _corpus(tmp_path / "c")
    saved = _streams(source, 2)
    _global(saved)
    resumed = _streams(source, 4, shards=4)[0]
    with pytest.raises(ValueError, match=r"cut into 2 shards.*4 sample-splitting ranks"):
        resumed.load_state_dict(_state(saved))
    with pytest.raises(ValueError, match="not a stream's"):
        resumed.load_state_dict({"position": 8, "seed": 0})


def test_parquet_and_arrow_stream_the_same_rows_as_jsonl(tmp_path):
    source = _corpus(tmp_path / "c", files=1)
    rows = [json.loads(line) for line in (source / "part000.jsonl").read_text().splitlines()]
    ds = datasets.Dataset.from_list(rows)
    (tmp_path / "p").mkdir()
    ds.to_parquet(str(tmp_path / "p" / "a.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))  # .arrow beside .json metadata
    jsonl = _streams(source, 1)
    want = [_global(jsonl) for _ in range(4)]
    for other in (tmp_path / "p", tmp_path / "saved"):
        stream = _streams(other, 1)
        assert all(torch.equal(_global(stream), w) for w in want), other


def test_bad_streams_are_named_before_anything_is_tokenized(tmp_path):
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.jsonl").write_text('{"text": "x"}\n')
    datasets.Dataset.from_dict({"text": ["y"]}).to_parquet(str(tmp_path / "mixed" / "b.parquet"))
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "other.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "prepared").mkdir()
    (tmp_path / "prepared" / "meta.json").write_text("{}")
    cases = {"prepared": "written by paraxis data prepare", "nope": "does not exist",
             "mixed": "mixes .jsonl, .parquet",
             "empty.jsonl": "only empty files", "other.jsonl": "has no column 'text'",
             "notes.txt": "has no .parquet"}
    for name, says in cases.items():
        cfg = RunConfig.from_dict({"data": {"source": str(tmp_path / name),
                                            "streaming": True}})
        problems = check_data(cfg, ByteTokenizer())
        assert [p.field for p in problems] == ["data.source"], (name, problems)
        assert says in problems[0].rule, (name, problems)


def test_modes_a_stream_cannot_honour_are_refused():
    cfg = RunConfig.from_dict({"parallelism": {"data": 2},
                               "data": {"streaming": True, "stream_shards": 3,
                                        "eval": {"fraction": 0.1}, "packing": False}})
    fields = {p.field for p in check_data(cfg, ByteTokenizer())}
    assert {"data.streaming", "data.eval.fraction", "data.stream_shards",
            "data.packing"} <= fields, fields


def _peak_reading(source, batches=20):
    """Peak Python allocations, plus Arrow's, while a rank reads ``batches`` batches."""
    import pyarrow as pa

    stream = _streams(source, 1)[0]
    tracemalloc.start()
    arrow = 0
    for _ in range(batches):
        stream.next_batch()
        arrow = max(arrow, pa.total_allocated_bytes())
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak + arrow


def test_memory_while_streaming_does_not_grow_with_the_corpus(tmp_path):
    """Four times the files, or one file of four times the size, cost what the smaller
    corpus costs to read the same batches: a rank holds the 1 MB block being read (and
    its parsed table), not the corpus (16 MB and more here)."""
    small = _corpus(tmp_path / "small", files=4, docs=900, long=1500)
    wide = _corpus(tmp_path / "wide", files=16, docs=900, long=1500)
    deep = _corpus(tmp_path / "deep", files=1, docs=14400, long=1500)
    size = sum(p.stat().st_size for p in deep.iterdir())
    assert size > 20e6
    base = _peak_reading(small)
    assert base < 8e6, base
    for large in (wide, deep):
        assert _peak_reading(large) < 1.2 * base + 100_000, (large, base)


def test_train_names_a_bad_stream_before_any_process_group(tmp_path):
    from paraxis.config.errors import ConfigError
    from paraxis.train.loop import train

    cfg = RunConfig.from_dict({"data": {"source": str(tmp_path / "nope"), "streaming": True,
                                        "eval": {"fraction": 0.1}}})
    with pytest.raises(ConfigError) as err:
        train(cfg)
    assert "does not exist" in str(err.value) and "data.eval.fraction" in str(err.value)
    assert not torch.distributed.is_initialized()


def test_an_eval_source_beside_a_stream_is_packed_from_its_own_stream(tmp_path):
    from paraxis.train.sources import open_stream

    source, held = _corpus(tmp_path / "c"), _corpus(tmp_path / "held", files=1, seed=1)
    datasets.Dataset.from_list([json.loads(line) for line in (
        held / "part000.jsonl").read_text().splitlines()]).to_parquet(str(tmp_path / "h.parquet"))
    cfg = RunConfig.from_dict({"train": {"seq_length": SEQ, "global_batch": BATCH},
                               "data": {"source": str(source), "streaming": True,
                                        "eval": {"source": str(tmp_path / "h.parquet")}}})
    stream, rows = open_stream(cfg, ByteTokenizer(), rank=0, ranks=1)
    assert isinstance(stream, StreamBatches) and rows.shape[1] == SEQ
    text = bytes(rows.flatten().tolist()).decode()
    assert text.startswith("0.0 ab") and "0.1 ab" in text  # the held-out file, in order
