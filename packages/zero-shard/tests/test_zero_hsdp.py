"""Hybrid sharding (``parallelism.zero_shard``, issue 36, item 3): ZeRO over groups of 2
of the 4 data ranks, the two groups holding replicas of the same shards.

* Parity: ZeRO-3 and ZeRO-2 at data 4, zero_shard 2, two microbatches, 20 steps of
  core's tiny model against one process (losses, gradient norms, an evaluation loss,
  the final weights: test_zero_parity's check).
* Memory: each rank's model state is twice full sharding's (ZeRO-3 over all 4 ranks,
  the same model) within 5% (the norms ZeRO keeps whole are the same in both), and
  the planner's.
* Links: what each rank sends inside its shard group (reduce-scatter and gathers, over
  2 consecutive ranks: one node at 2 GPUs a node) and across the groups (the all-reduce
  of the gradient shards) is what the planner says for each link class, within
  plan-accuracy's 10%; it puts the first inside a node and the second across nodes.
* Checkpoints: the ZeRO-3 zero_shard 2 run saves after 10 steps; the checkpoint resumes
  at zero_shard 4 (full sharding) and at ZeRO-0 (plain data parallelism), both ending
  with the HSDP run's losses and weights at the shared tolerance.
"""

import dataclasses

from test_zero_parity import check, reference
from zero_tiny import CFG, LR, STEPS, TRAIN, batches, build

import paraxis
from paraxis import ParallelConfig
from paraxis.engine.plugins import make_plugin_manager
from paraxis.planner import Hardware, Workload, count_model, evaluate
from paraxis.planner.accuracy import BOUND
from paraxis.planner.model import ModelSource, build_on_meta
from paraxis.testing.parity import assemble, local_shards
from paraxis.testing.tolerance import assert_losses_close, assert_weights_close

HSDP = {"data": 4, "zero": 3, "zero_shard": 2, "microbatches": 2}
SAVE, BATCH, STATE_BOUND = 10, 16, 0.05


def _share(engine, ids, labels):
    index, count = engine.grid.sample_shard()
    part = slice(index * BATCH // count, (index + 1) * BATCH // count)
    return {"input_ids": ids[part], "labels": labels[part]}


def run(options, save=None, load=None):
    """Steps [0, STEPS) (from SAVE when loading ``load``; saving to ``save`` after SAVE):
    per-step (loss, grad norm), an eval loss, the shards, and the last step's model
    state and bytes by (group, op)."""
    engine = paraxis.parallelize(build(), config=ParallelConfig.from_kwargs(**options),
                                 train=TRAIN)
    if load:
        engine.load(load)
    ids, labels = batches()
    history = []
    for step in range(SAVE if load else 0, STEPS):
        if step == SAVE and save:
            engine.save(save)
        mark = engine.grid.comm.mark()
        m = engine.train_step(_share(engine, ids[step], labels[step]))
        history.append((m["loss"], m["grad_norm"]))
    moved = engine.grid.comm.since(mark)["bytes"]
    eval_loss = engine.eval_step(_share(engine, *(t[0] for t in batches(1))))
    shards = local_shards(engine.model)
    engine.close()
    return history, eval_loss, shards, m["model_state_bytes"], moved


def planned(options):
    """The planner's plan of ``options`` on 2 GPUs a node, fp32, this model."""
    source = ModelSource("tiny", dataclasses.asdict(CFG), "test_zero_hsdp", {})
    counts = count_model(build_on_meta(source, make_plugin_manager()), "tiny",
                         CFG.seq_length)
    layout = ParallelConfig.from_kwargs(**options)
    work = Workload(seq=CFG.seq_length, global_batch=BATCH, precision="fp32",
                    micro_batch=BATCH // (layout.sample_shards * layout.schedule.microbatches))
    return evaluate(counts, layout, work, Hardware(gpus_per_node=2))


def by_link(moved):
    """Bytes inside the shard groups (every data group but the replicas') and across."""
    across = sum(n for (axes, _), n in moved.items() if axes == "data_replica")
    inside = sum(n for (axes, _), n in moved.items()
                 if axes.startswith("data") and axes != "data_replica")
    return inside, across


def test_hsdp_parity_memory_links_and_checkpoints(worlds, tmp_path):
    ref = reference(worlds)
    ckpt = str(tmp_path / "hsdp")
    out = worlds.run(4, run, HSDP, ckpt)
    check([o[:3] for o in out], ref)
    zero2 = worlds.run(4, run, {**HSDP, "zero": 2})
    check([o[:3] for o in zero2], ref)

    plan = planned(HSDP)
    links = {a.axis: (a.bytes, a.link) for a in plan.comm}
    assert links["data"][1] == "intra" and links["data_replica"][1] == "inter"
    (mem,) = plan.memory
    for *_, state, moved in out:
        inside, across = by_link(moved)
        print(f"inside {inside / links['data'][0]:.4f}, across "
              f"{across / links['data_replica'][0]:.4f} of the plan; model state "
              f"{state / (mem.parameters + mem.gradients + mem.optimizer):.4f}")
        assert abs(inside / links["data"][0] - 1) <= BOUND, (inside, links)
        assert abs(across / links["data_replica"][0] - 1) <= BOUND, (across, links)
        assert abs(state / (mem.parameters + mem.gradients + mem.optimizer) - 1) <= STATE_BOUND

    want = [h[0] for h in out[0][0][SAVE:]]
    weights = assemble([o[2] for o in out])
    for options in ({**HSDP, "zero_shard": 4}, {"data": 4, "microbatches": 2}):
        resumed = worlds.run(4, run, options, None, ckpt)
        for history, *_ in resumed:
            assert_losses_close([h[0] for h in history], want)
        got = assemble([o[2] for o in resumed])
        for name, w in weights.items():
            assert_weights_close(got[name], w, lr=LR, steps=STEPS, what=name)
        if options.get("zero_shard") == 4:  # full sharding: half the HSDP state
            for (*_, hsdp_state, _), (*_, full_state, _) in zip(out, resumed, strict=True):
                print(f"model state {hsdp_state / full_state:.4f} of full sharding's")
                assert abs(hsdp_state / full_state / 2 - 1) <= STATE_BOUND
