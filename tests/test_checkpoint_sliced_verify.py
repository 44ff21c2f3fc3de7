"""Checksums checked on what a rank reads (format 4), not on every whole file it opens.

A rank that restores its slices of a checkpoint saved on another grid hashes each file's
safetensors header and, of each tensor it reads, the blocks its ranges touch
(``paraxis.checkpoint.files.BLOCK`` bytes from the tensor's start; smaller here, so that
debug-sized tensors span many). Still
caught and named: a flipped byte in the data a rank reads, a flipped header byte. A
checkpoint without block digests (format 3 and older) is hashed whole, as before.
``_byte_runs`` (the byte ranges of a block of a row-major tensor) is checked against
brute force without processes.
"""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch

import paraxis
from paraxis import ParallelConfig
from paraxis.checkpoint import files
from paraxis.checkpoint.files import CheckpointError, _byte_runs, read_index
from paraxis.checkpoint.format import resolve
from paraxis.checkpoint.read import Reader

pytest.importorskip("transformers")

SMALL_BLOCK, SEQ = 512, 16


def test_byte_runs_cover_exactly_the_elements_read():
    rng = random.Random(0)
    for _ in range(300):
        shape = [rng.randint(1, 5) for _ in range(rng.randint(0, 4))]
        block = []
        for n in shape[:rng.randint(0, len(shape))]:
            a = rng.randint(0, n - 1)
            block.append(slice(a, rng.randint(a + 1, n)))
        elem = rng.choice([1, 2, 4])
        strides = [elem * int(torch.tensor(shape[d + 1:]).prod()) for d in range(len(shape))]
        ranges = [range(s.start, s.stop) for s in block] + [range(n) for n in shape[len(block):]]
        want = {sum(i * st for i, st in zip(combo, strides, strict=True)) + b
                for combo in itertools.product(*ranges) for b in range(elem)}
        got = {b for a, z in _byte_runs(shape, tuple(block), elem) for b in range(a, z)}
        assert got == want, (shape, block)


def _hashed(reader_files: list) -> int:
    return sum(f.hashed_bytes for f in reader_files)


def save_then_load(ckpt, save_on, load_on, block=SMALL_BLOCK, strip=False):
    """Train one step on ``save_on`` and save (digest blocks of ``block`` bytes); then a
    fresh model loads it on ``load_on`` (``strip``: its index without block digests, as
    format 3 wrote it). Returns the bytes this rank hashed while loading and the step."""
    import torch.distributed as dist

    from paraxis_hf import build_debug_model

    if save_on is not None:
        files.BLOCK, default = block, files.BLOCK
        try:
            model = build_debug_model("llama", seed=0, vocab_size=128)
            engine = paraxis.parallelize(model, config=ParallelConfig.from_kwargs(**save_on),
                                         train={"seq_length": SEQ})
            index, count = engine.grid.sample_shard()
            ids = torch.randint(0, 128, (4, SEQ), generator=torch.Generator().manual_seed(0))
            engine.train_step(ids[index * 4 // count:(index + 1) * 4 // count])
            engine.save(ckpt)
            engine.close()
        finally:
            files.BLOCK = default
        return None
    if strip and dist.get_rank() == 0:
        _strip_blocks(resolve(ckpt))
    dist.barrier()
    opened = []
    init = files.CheckedFiles.__init__

    def counted(self, *args, **kwargs):
        init(self, *args, **kwargs)
        opened.append(self)

    files.CheckedFiles.__init__ = counted
    try:
        model = build_debug_model("llama", seed=1, vocab_size=128)
        engine = paraxis.parallelize(model, config=ParallelConfig.from_kwargs(**load_on),
                                     train={"seq_length": SEQ})
        engine.load(ckpt)
        step = engine.step
        engine.close()
    finally:
        files.CheckedFiles.__init__ = init
    return _hashed(opened), step


def _strip_blocks(step_dir):
    index = json.loads((step_dir / "index.json").read_text())
    index["format_version"] = 3
    for record in index["files"].values():
        record.pop("blocks"), record.pop("block_bytes"), record.pop("header_sha256")
    (step_dir / "index.json").write_text(json.dumps(index))


@pytest.fixture
def saved(worlds, tmp_path):
    """A debug Llama saved on tensor 2 (two files, blocks of 512 bytes)."""
    ckpt = tmp_path / "ckpt"
    worlds.run(2, save_then_load, str(ckpt), {"tensor": 2}, None)
    step_dir = resolve(ckpt)
    total = sum(r["bytes"] for r in read_index(step_dir)["files"].values())
    return ckpt, step_dir, total


def test_each_rank_hashes_about_what_it_reads(worlds, saved):
    """Tensor 2 -> ZeRO-3 over data 2: each rank reads half of every tensor's rows and
    hashes well under the checkpoint; a format-3 index makes it hash every whole file."""
    ckpt, _, total = saved
    out = worlds.run(2, save_then_load, str(ckpt), None, {"data": 2, "zero": 3})
    print(f"tensor 2 -> ZeRO-3 data 2: checkpoint {total} bytes; hashed per rank "
          + ", ".join(str(h) for h, _ in out))
    for hashed, step in out:
        assert step == 1 and hashed < 0.75 * total
    whole = worlds.run(2, save_then_load, str(ckpt), None, {"data": 2, "zero": 3},
                       SMALL_BLOCK, True)
    for hashed, step in whole:
        assert step == 1 and hashed == total  # format 3: every file it opens, whole


def _flip(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _data_range(path, key):
    """[first, last) file bytes of tensor ``key`` in safetensors file ``path``."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    begin, end = json.loads(raw[8:8 + length])[key]["data_offsets"]
    return 8 + length + begin, 8 + length + end


def test_a_flipped_byte_is_caught_where_it_is_read(saved):
    """In one process, no process group: the second half of a tensor's rows read from a
    file whose first half has a flipped byte loads, and hashes little; the first half
    is refused, naming the file and the tensor."""
    _, step_dir, _ = saved
    index = read_index(step_dir)
    key = "model/model.layers.0.mlp.down_proj.weight"
    shard = index["tensors"][key]["shards"][0]
    path = step_dir / shard["file"]
    first, last = _data_range(path, shard["key"])
    assert last - first >= 4 * SMALL_BLOCK
    _flip(path, first + 5)
    rows, cols = (n for _, n in shard["offsets"])
    (r0, _), (c0, _) = shard["offsets"]
    reader = Reader(step_dir, index)
    tail = reader.read(key, [[r0 + rows // 2, rows - rows // 2], [c0, cols]])
    assert tail.shape == (rows - rows // 2, cols)
    assert reader.files.hashed_bytes < 0.5 * path.stat().st_size
    with pytest.raises(CheckpointError, match="is corrupted: its SHA-256") as caught:
        reader.read(key, [[r0, rows // 2], [c0, cols]])
    assert shard["file"] in str(caught.value) and shard["key"] in str(caught.value)


def test_a_flipped_header_byte_is_caught(saved):
    _, step_dir, _ = saved
    _flip(step_dir / "rank00001.safetensors", 40)
    reader = Reader(step_dir, read_index(step_dir))
    with pytest.raises(CheckpointError, match=r"rank00001\.safetensors is corrupted"):
        reader.files.open("rank00001.safetensors")


def test_a_format_3_checkpoint_is_hashed_whole(saved):
    """Without block digests the whole file is checked when it is opened: a flipped byte
    in a tensor nobody reads is still caught."""
    _, step_dir, _ = saved
    _strip_blocks(step_dir)
    _flip(step_dir / "rank00000.safetensors", -3)
    reader = Reader(step_dir, read_index(step_dir))
    with pytest.raises(CheckpointError, match="is corrupted: its SHA-256"):
        reader.files.open("rank00000.safetensors")
