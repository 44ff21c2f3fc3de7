"""The engine against a single-process reference, on real gloo ranks.

The reference is the same engine on a world of one, fed the whole global batch. data=2
with 2 microbatches, uneven ``-100`` labels, active gradient clipping and the
warmup-cosine schedule must give the same per-step losses, gradient norms and final
parameters, at the shared tolerance (paraxis.testing.tolerance).
"""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import paraxis
from paraxis.models.tiny import TinyConfig, TinyTransformer
from paraxis.testing.tolerance import assert_losses_close, assert_weights_close

CFG = TinyConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                 intermediate_size=64, seq_length=16)
STEPS, GLOBAL_BATCH = 8, 8
TRAIN = {"steps": STEPS, "lr": 1e-2, "warmup_steps": 3, "grad_clip": 0.5,
         "seq_length": CFG.seq_length, "peak_flops": 1e12}


def batches():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, CFG.vocab_size, (STEPS, GLOBAL_BATCH, CFG.seq_length), generator=g)
    labels = ids.clone()
    labels[:, 0, :10] = -100  # rank 0's slice has fewer targets than rank 1's
    labels[:, 5, 3:7] = -100
    return ids, labels


def run_engine(microbatches):
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    engine = paraxis.parallelize(TinyTransformer(CFG), data=world, microbatches=microbatches,
                                 train=TRAIN)
    ids, labels = batches()
    per = GLOBAL_BATCH // world
    out = []
    for step in range(STEPS):
        part = slice(rank * per, (rank + 1) * per)
        out.append(engine.train_step({"input_ids": ids[step, part],
                                      "labels": labels[step, part]}))
    eval_loss = engine.eval_step({"input_ids": ids[0, part], "labels": labels[0, part]})
    params = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    engine.close()
    return out, eval_loss, params


@pytest.fixture(scope="module")
def reference(worlds):
    return worlds.run(1, run_engine, 1)[0]


def test_engine_data_parallel_matches_one_process(worlds, reference):
    ref_metrics, ref_eval, ref_params = reference
    for metrics, eval_loss, params in worlds.run(2, run_engine, 2):
        assert_losses_close([m["loss"] for m in metrics], [r["loss"] for r in ref_metrics])
        assert_losses_close([m["grad_norm"] for m in metrics],
                            [r["grad_norm"] for r in ref_metrics], "gradient norms")
        assert [m["lr"] for m in metrics] == [r["lr"] for r in ref_metrics]
        assert_losses_close([eval_loss], [ref_eval], "evaluation loss")
        for name, p in params.items():
            assert_weights_close(p, ref_params[name], lr=TRAIN["lr"], steps=STEPS, what=name)


def traced_step(path):
    torch.manual_seed(0)
    engine = paraxis.parallelize(TinyTransformer(CFG), data=dist.get_world_size(),
                                 train=TRAIN)
    ids = batches()[0][0, : GLOBAL_BATCH // dist.get_world_size()]
    engine.train_step(ids)
    out = engine.tracer.export(f"{path}/rank{dist.get_rank()}.json")
    engine.close()
    return str(out)


def test_chrome_trace_has_compute_and_comm_spans(worlds, tmp_path):
    paths = worlds.run(2, traced_step, str(tmp_path))
    events = json.loads(Path(paths[1]).read_text())["traceEvents"]
    cats = {e["name"]: e.get("cat") for e in events}
    assert cats["forward"] == "compute" and cats["backward"] == "compute"
    assert cats["grad_sync_wait"] == "comm" and cats["metrics_gather"] == "comm"
    assert all(e["pid"] == 1 for e in events)
