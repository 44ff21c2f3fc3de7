"""What context parallelism does to memory, balance and the wire, measured (issue 12).

    python benchmarks/cp_measure.py            # spawns its own gloo ranks (1, 2 and 4)

Three sections of ``benchmarks/RESULTS.md``:

* **cp_activations**: bytes autograd holds for backward per rank (unique storages, with
  :class:`paraxis.planner.measure.SavedActivations`, i.e.
  ``torch.autograd.graph.saved_tensors_hooks``) over one forward and loss of a small
  Llama at sequence 4096 through ``paraxis.parallelize(context=C)``, C = 1, 2, 4, ring
  and Ulysses, against the expectation bytes(1)/C.
* **cp_ring_balance**: one causal ring-attention layer, forward and backward, on C = 2
  and 4 ranks, zigzag against contiguous shards: per rank the CPU time of its thread
  (the attention compute: gloo moves bytes on its own threads and a rank waiting for a
  receive sleeps), the seconds it sat blocked on the ring's receives (exposed
  communication) and the step's wall time.
* **cp_hybrid_activations**: the same bytes for a hybrid of Mamba-2 and attention layers
  (Bamba from config, the Llama's sizes), whose Mamba layers pass their state across the
  context ranks (issue 35: :mod:`paraxis_seq.recurrent`).
* **cp_bytes**: the engine's ``comm/context_bytes`` metric per rank per training step,
  ring and Ulysses, against the analytic volumes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from common import build_llama, machine, write_section

import paraxis
from paraxis.engine.loss import causal_lm_loss_sum
from paraxis.parallel.batch import Batch
from paraxis.planner.measure import SavedActivations
from paraxis.runtime.grid import Grid
from paraxis.testing import DistributedWorld
from paraxis_seq import ring_attention, shard
from paraxis_seq.ulysses import kv_replication

HEADS, KV_HEADS = 8, 4  # common.build_llama's
SECTIONS = ("cp_activations", "cp_bytes", "cp_ring_balance", "cp_hybrid_activations")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--ring-seq", type=int, default=4096)
    p.add_argument("--head-dim", type=int, default=64, help="ring balance layer")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS),
                   help="which sections to measure (and rewrite)")
    p.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    return p.parse_args()


# ---- on every rank ---------------------------------------------------------------------


def engine_run(args: argparse.Namespace, context: int, mode: str) -> dict[str, float]:
    """Saved bytes of one forward + loss, then two training steps' context bytes."""
    args.batch = 1
    engine = paraxis.parallelize(build_llama(args), context=context, context_mode=mode,
                                 train={"seq_length": args.seq, "steps": 10, "lr": 1e-4})
    ids = torch.randint(0, 256, (1, args.seq), generator=torch.Generator().manual_seed(0))
    saved = saved_bytes(engine, ids)
    metrics = [engine.train_step(ids) for _ in range(2)][-1]
    result = {"saved_bytes": saved,
              "context_bytes": metrics.get("comm/context_bytes", 0.0),
              "step_s": metrics["step_time_s"], "exposed_s": metrics["exposed_comm_s"]}
    engine.close()
    return result


def build_hybrid(args: argparse.Namespace) -> torch.nn.Module:
    """Bamba at the Llama's sizes: Mamba-2 layers (heads of 32 channels, state 16,
    expand 1, scan chunks of 64) and attention as the last layer."""
    from paraxis_hf import build_debug_model

    heads = args.hidden // 32
    return build_debug_model(
        "bamba", hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 8 * 8,
        num_hidden_layers=args.layers, attn_layer_indices=[args.layers - 1],
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=args.hidden // HEADS,
        vocab_size=256, max_position_embeddings=args.seq, mamba_n_heads=heads,
        mamba_d_head=32, mamba_d_state=16, mamba_expand=1, mamba_chunk_size=64)


def hybrid_run(args: argparse.Namespace, context: int, mode: str) -> dict[str, float]:
    """Saved bytes of one forward + loss of the hybrid (no training steps)."""
    engine = paraxis.parallelize(build_hybrid(args), context=context, context_mode=mode,
                                 train={"seq_length": args.seq})
    passed = engine.ctx.extras["context"].recurrent if context > 1 else ()
    ids = torch.randint(0, 256, (1, args.seq), generator=torch.Generator().manual_seed(0))
    saved = saved_bytes(engine, ids)
    engine.close()
    return {"saved_bytes": saved, "passed": len(passed)}


def saved_bytes(engine, ids: torch.Tensor) -> float:
    """Bytes saved for backward by one forward + loss of ``ids`` as the engine shards
    them (its batch transforms); the graph is dropped after, and nothing collective
    happens in the forward's hooks, so the engine can go on training."""
    batch = Batch.from_user(ids)
    for transform in engine.ctx.batch_transforms:
        batch = transform(batch)
    with SavedActivations(exclude=engine.model.parameters()) as saved:
        out = engine.model(batch.input_ids, **batch.model_kwargs(), use_cache=False)
        loss, _ = causal_lm_loss_sum(out.logits, batch.targets)
    del out, loss
    return float(saved.bytes)


def ring_run(args: argparse.Namespace, layout: str) -> dict[str, float]:
    """Median per-rank wall, thread CPU and blocked seconds of one ring layer fwd+bwd."""
    size = dist.get_world_size()
    grid = Grid.build({"context": size})
    group = grid.group("context")
    g = torch.Generator().manual_seed(0)
    shapes = [(1, args.ring_seq, n, args.head_dim) for n in (HEADS, KV_HEADS, KV_HEADS, HEADS)]
    q, k, v, dout = (shard(torch.randn(s, generator=g), size=size, rank=group.rank,
                           layout=layout) for s in shapes)
    walls, cpus, blocked = [], [], []
    for i in range(args.repeats + 1):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        dist.barrier()
        mark, wall, cpu = grid.comm.mark(), time.perf_counter(), time.thread_time()
        ring_attention(*leaves, group=group, causal=True, layout=layout).backward(dout)
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
        if i:  # the first is a warm-up
            walls.append(wall)
            cpus.append(cpu)
            blocked.append(grid.comm.since(mark)["seconds"].get(("context", "p2p"), 0.0))
        dist.barrier()
    grid.destroy()
    med = statistics.median
    return {"wall_s": med(walls), "cpu_s": med(cpus), "blocked_s": med(blocked)}


# ---- the parent: run, tabulate, write ----------------------------------------------


def measure_engines(args: argparse.Namespace) -> dict[tuple[int, str], list[dict]]:
    runs: dict[tuple[int, str], list[dict]] = {}
    for context in (1, 2, 4):
        with DistributedWorld(context, timeout=1800) as world:
            for mode in ("ring", "ulysses") if context > 1 else ("ring",):
                runs[context, mode] = world.run(engine_run, args, context, mode)
    return runs


def measure_hybrid(args: argparse.Namespace) -> dict[tuple[int, str], list[dict]]:
    runs: dict[tuple[int, str], list[dict]] = {}
    for context in (1, 2, 4):
        with DistributedWorld(context, timeout=1800) as world:
            for mode in ("ring", "ulysses") if context > 1 else ("ring",):
                runs[context, mode] = world.run(hybrid_run, args, context, mode)
    return runs


def hybrid_table(args: argparse.Namespace, runs: dict) -> tuple[str, dict]:
    base = max(r["saved_bytes"] for r in runs[1, "ring"])
    lines, payload = [], {}
    for (c, mode), ranks in runs.items():
        worst = max(r["saved_bytes"] for r in ranks)
        label = "one process" if c == 1 else f"{mode}, {ranks[0]['passed']} Mamba passing"
        lines.append(f"| {c} | {label} | {worst / 2**20:.1f} | {worst / base:.3f} | "
                     f"{1 / c:.3f} |")
        payload[f"{c}/{mode}"] = [r["saved_bytes"] for r in ranks]
    mamba = args.layers - 1
    table = f"""## Context parallel: activation bytes per rank, hybrid (Mamba-2 + attention)

`python benchmarks/cp_measure.py --sections cp_hybrid_activations` (Bamba from config:
hidden {args.hidden}, {mamba} Mamba-2 layer(s) (heads of 32 channels, state 16, scan
chunks of 64) and 1 attention layer ({HEADS} heads / {KV_HEADS} kv heads), vocab 256;
one sequence of {args.seq} tokens; fp32, transformers' torch scan and convolution; bytes
autograd saves for backward over one forward and the loss, as above; the largest rank;
{machine()})

| context | mixers | MiB per rank | vs context 1 | expected 1/C |
| ---: | --- | ---: | ---: | ---: |
""" + "\n".join(lines) + """

Each rank scans its shard's chunks from a zero state and keeps what the scan keeps for
them; the transitions and the corrections by the entering state are recomputed in
backward (checkpointed: they keep only inputs the chunk's own scan keeps; run without
the checkpoints, context 4 holds 0.350 of context 1). What crosses ranks per layer is
each chunk's state and transition (2·heads·32·16·4 bytes: 32 KiB per chunk here) and the
convolution's last 3 inputs, all-gathered over the 2C zigzag chunks (C for Ulysses)."""
    return table, payload


def analytic_bytes(args: argparse.Namespace, c: int, mode: str) -> float:
    """Per rank per step, fp32: ring sends (C-1) K/V shards forward, as many K/V plus
    the travelling dK/dV backward; Ulysses sends (C-1)/C of q, k, v (kv heads repeated
    when they do not split over C) and out, forward and backward."""
    d = args.hidden // HEADS
    tokens = args.seq // c
    if mode == "ring":
        return args.layers * 3 * (c - 1) * 2 * tokens * KV_HEADS * d * 4
    heads = 2 * HEADS + 2 * KV_HEADS * kv_replication(HEADS, KV_HEADS, c)
    return args.layers * 2 * (c - 1) / c * tokens * d * heads * 4


def activation_table(args: argparse.Namespace, runs: dict) -> tuple[str, dict]:
    base = max(r["saved_bytes"] for r in runs[1, "ring"])
    lines, payload = [], {}
    for (c, mode), ranks in runs.items():
        worst = max(r["saved_bytes"] for r in ranks)
        label = "one process (SDPA)" if c == 1 else mode
        lines.append(f"| {c} | {label} | {worst / 2**20:.1f} | {worst / base:.3f} | "
                     f"{1 / c:.3f} |")
        payload[f"{c}/{mode}"] = [r["saved_bytes"] for r in ranks]
    table = f"""## Context parallel: activation bytes held for backward per rank

`python benchmarks/cp_measure.py` (Llama from config: hidden {args.hidden}, {args.layers}
layers, {HEADS} heads / {KV_HEADS} kv heads, vocab 256; one sequence of {args.seq} tokens;
fp32; bytes autograd saves for backward over one forward and the loss, unique storages,
parameters excluded (`saved_tensors_hooks`); the largest rank; {machine()})

| context | attention | MiB per rank | vs context 1 | expected 1/C |
| ---: | --- | ---: | ---: | ---: |
""" + "\n".join(lines) + """

Ring keeps q, k, v, its output and the log-sum-exp of the rank's shard (its output is
also the output projection's saved input: one storage). Ulysses keeps the attention
output twice, head-sharded for SDPA's backward and sequence-sharded as the output
projection's input (DeepSpeed-Ulysses does the same): one (N/C)·h·4 bytes per layer
above 1/C."""
    return table, payload


def bytes_table(args: argparse.Namespace, runs: dict) -> tuple[str, dict]:
    lines, payload = [], {}
    for (c, mode), ranks in runs.items():
        if c == 1:
            continue
        got = statistics.mean(r["context_bytes"] for r in ranks)
        want = analytic_bytes(args, c, mode)
        lines.append(f"| {c} | {mode} | {got / 2**20:.2f} | {want / 2**20:.2f} | "
                     f"{got / want:.3f} |")
        payload[f"{c}/{mode}"] = {"measured": got, "analytic": want}
    table = """## Context parallel: bytes per rank per training step

`python benchmarks/cp_measure.py` (the same Llama and sequence; the engine's
`comm/context_bytes` metric of a training step: every byte the ring's point-to-point
exchange and Ulysses' all-to-alls put on the wire over the `context` group, mean over
ranks). Analytic, fp32, L layers, N tokens, d head dim: ring 3·(C-1)·2·(N/C)·H_kv·d·4·L
(forward K/V, backward K/V and dK/dV; (C-1)/C of the layer's K/V each); Ulysses
2·(C-1)/C·(N/C)·d·(2H + 2·H_kv·rep)·4·L (q, k, v, out each way: about 4·N·h/C per
all-to-all set for MHA; rep repeats kv heads that do not split over C).

| context | mode | measured MiB | analytic MiB | ratio |
| ---: | --- | ---: | ---: | ---: |
""" + "\n".join(lines)
    return table, payload


def balance_table(args: argparse.Namespace) -> tuple[str, dict]:
    lines, payload = [], {}
    load = os.getloadavg()[0]  # other sessions' processes share the 2 cores too
    for c in (2, 4):
        with DistributedWorld(c, timeout=1800) as world:
            for layout in ("zigzag", "contiguous"):
                ranks = world.run(ring_run, args, layout)
                cpu = [r["cpu_s"] for r in ranks]
                exposed = statistics.mean(r["blocked_s"] / r["wall_s"] for r in ranks)
                lines.append(f"| {c} | {layout} | {' / '.join(f'{t * 1e3:.0f}' for t in cpu)}"
                             f" | {max(cpu) / min(cpu):.3f} | "
                             f"{max(r['wall_s'] for r in ranks) * 1e3:.0f} | {exposed:.3f} |")
                payload[f"{c}/{layout}"] = ranks
    table = f"""## Context parallel: ring balance and exposed communication

`python benchmarks/cp_measure.py` (one causal ring-attention layer, forward and
backward: sequence {args.ring_seq}, {HEADS} heads / {KV_HEADS} kv heads, head dim
{args.head_dim}, fp32; median of {args.repeats} after a warm-up; {machine()}; load
average {load:.1f} when it started).
Compute: CPU time of each rank's thread in the layer (gloo moves the bytes on its own
threads; a rank blocked on a receive sleeps). Exposed: seconds blocked on the ring's
receives over the layer's wall time, mean over ranks. Ranks share 2 cores: at C = 4
two ranks contend for each core, so wall times (and what is exposed) include waiting
for a core; the compute column does not.

| context | shards | compute per rank (ms) | max/min | wall (ms) | exposed / wall |
| ---: | --- | --- | ---: | ---: | ---: |
""" + "\n".join(lines)
    return table, payload


def main() -> None:
    args = parse()
    torch.set_num_threads(1)  # as every spawned rank runs (machine() reports it)
    sections = {}
    if {"cp_activations", "cp_bytes"} & set(args.sections):
        runs = measure_engines(args)
        sections["cp_activations"] = activation_table(args, runs)
        sections["cp_bytes"] = bytes_table(args, runs)
    if "cp_hybrid_activations" in args.sections:
        sections["cp_hybrid_activations"] = hybrid_table(args, measure_hybrid(args))
    if "cp_ring_balance" in args.sections:
        sections["cp_ring_balance"] = balance_table(args)
    for name, (table, payload) in sections.items():
        if name not in args.sections:
            continue
        print(table, "\n")
        if not args.no_write:
            write_section(name, table, {"args": vars(args), "per_rank": payload})


if __name__ == "__main__":
    main()
