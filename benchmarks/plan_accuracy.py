"""The plan against measurement on this machine (issue 15): model-state bytes, activation
bytes of one microbatch, and bytes moved per axis, planned vs measured.

    torchrun --nproc-per-node 2 benchmarks/plan_accuracy.py --axis data
    torchrun --nproc-per-node 2 benchmarks/plan_accuracy.py --axis tensor   # + SP
    torchrun --nproc-per-node 2 benchmarks/plan_accuracy.py --axis pipeline

A small Llama built from config goes through ``paraxis.parallelize``; the planner
evaluates the same layout (fp32 training: paraxis keeps fp32 weights, ``bf16`` only
autocasts). Measured: model state from ``paraxis.metrics.memory_stats`` after one step
(parameters and optimizer state; gradients are freed by ``zero_grad``), activations with
:class:`paraxis.planner.measure.SavedActivations` around one microbatch's forward, bytes
from the grid's collective counters (``grid.comm``) over one step. Rank 0 writes
``benchmarks/out/plan_accuracy_<axis>.json``.

Skeleton, finished when the engine's metrics land on main:
TODO(issue 15): gradient bytes (buckets persist; count them before zero_grad), the
pipeline stage's activations (its forward needs the previous stage's output), and the
generated docs/plan-accuracy.md table with the 10% bound.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from common import OUT, build_llama

import paraxis
from paraxis import ParallelConfig
from paraxis.metrics import memory_stats
from paraxis.planner import Hardware, Workload, count_model, evaluate
from paraxis.planner.measure import SavedActivations

LAYOUTS = {"data": {}, "tensor": {"sequence_parallel": True}, "pipeline": {}}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--axis", choices=sorted(LAYOUTS), default="data")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--microbatches", type=int, default=2)
    return p.parse_args()


def planned(args: argparse.Namespace, config: ParallelConfig) -> dict[str, object]:
    with torch.device("meta"):
        counts = count_model(build_llama(args), "llama", args.seq)
    replicas = config.parallelism.data * config.parallelism.expert
    work = Workload(seq=args.seq, global_batch=args.batch, precision="fp32",
                    micro_batch=args.batch // (replicas * args.microbatches))
    plan = evaluate(counts, config, work, Hardware(gpus_per_node=os.cpu_count() or 1))
    worst = plan.worst
    return {"model_state_bytes": worst.parameters + worst.optimizer,
            "activation_bytes_per_microbatch": worst.activations
            / worst.notes["alive_microbatches"],
            "comm_bytes": {a.axis: a.bytes for a in plan.comm}}


def main() -> None:
    args = parse()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = ParallelConfig.from_kwargs(**{args.axis: world}, **LAYOUTS[args.axis],
                                        microbatches=args.microbatches)
    torch.manual_seed(0)
    engine = paraxis.parallelize(build_llama(args), config=config,
                                 train={"seq_length": args.seq, "steps": 2})
    local = args.batch // (config.parallelism.data * config.parallelism.expert)
    ids = torch.randint(0, 256, (local, args.seq), generator=torch.Generator().manual_seed(1))
    mark = engine.grid.comm.mark()
    engine.train_step(ids)
    measured: dict[str, object] = {
        "model_state_bytes": memory_stats(engine.model, engine.optimizer,
                                          engine.device).get("model_state_bytes"),
        "comm_bytes": engine.grid.comm.bytes_by_axis(mark)}
    if args.axis != "pipeline":  # TODO(issue 15): a stage's forward needs its inputs
        with SavedActivations(exclude=engine.model.parameters()) as saved:
            engine.model(ids[: local // args.microbatches])
        measured["activation_bytes_per_microbatch"] = saved.bytes
    row = {"axis": args.axis, "rank": dist.get_rank(), "planned": planned(args, config),
           "measured": measured}
    rows: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        OUT.mkdir(exist_ok=True)
        path = OUT / f"plan_accuracy_{args.axis}.json"
        path.write_text(json.dumps(rows, indent=2))
        print(json.dumps(rows[0], indent=2))
    engine.close()
    paraxis.shutdown(engine.grid)


if __name__ == "__main__":
    main()
