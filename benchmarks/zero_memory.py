"""ZeRO's memory and traffic per rank, measured against its equations (issue 10).

    python benchmarks/zero_memory.py          # spawns worlds of 2 and 4 ranks itself

The benchmarks' Llama (built from config) trains 2 steps under ``paraxis.parallelize``
with data=N and zero=0 (plain data parallel, when paraxis-dp-core is installed), 1, 2
and 3, fp32 with AdamW. Measured: the engine's ``model_state_bytes`` (every storage
behind parameters, gradients, the optimizer's shards and state, counted once, after the
step and before ``zero_grad``) and the bytes this rank put on the data axes in the
last step (core's collective counters). Formulas (Rajbhandari et al.,
arXiv:1910.02054, fp32 + Adam: 4 + 4 + 8 bytes per parameter; the planner's
``model_state_bytes``): 16Ψ, 8Ψ+8Ψ/N, 4Ψ+12Ψ/N, 16Ψ/N; bytes 2Ψ(N-1)/N x 4 for
stages 0-2 and 3Ψ(N-1)/N x 4 for stage 3. Rank 0's figures; every rank's are equal up
to padding.
"""

from __future__ import annotations

import argparse
import importlib.util

import torch
from common import build_llama, machine, write_section

import paraxis
from paraxis.planner.memory import model_state_bytes
from paraxis.testing import DistributedWorld

# The groups over the data axis (issue 38's names: data, and the replica groups
# data x expert x context, data x context and with tensor the sequence shards).
DATA_SIDE = ("comm/data", "comm/replicas", "comm/expert_replicas", "comm/sequence_shards")

MiB = 2**20


def measure(args: argparse.Namespace, zero: int) -> tuple[int, float, float]:
    model = build_llama(args)
    psi = sum(p.numel() for p in model.parameters())
    world = torch.distributed.get_world_size()
    engine = paraxis.parallelize(model, data=world, zero=zero,
                                 train={"steps": 2, "lr": 1e-4, "seq_length": args.seq})
    ids = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    metrics = [engine.train_step(ids) for _ in range(2)][-1]
    engine.close()
    return psi, metrics["model_state_bytes"], sum(
        v for k, v in metrics.items() if k.startswith(DATA_SIDE))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2, help="per-rank batch")
    p.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = p.parse_args()
    torch.set_num_threads(1)  # as each rank runs (the harness sets it)
    stages = [0, 1, 2, 3] if importlib.util.find_spec("paraxis_dp") else [1, 2, 3]
    rows = []
    for n in (2, 4):
        with DistributedWorld(n, timeout=600) as world:
            for zero in stages:
                psi, state, moved = world.run(measure, args, zero)[0]
                want = sum(model_state_bytes(psi, zero=zero, n_dense=n, precision="fp32"))
                volume = (3 if zero == 3 else 2) * psi * (n - 1) / n * 4
                rows.append({"zero": zero, "n": n, "psi": psi, "state": state,
                             "state_formula": want, "bytes": moved, "bytes_formula": volume})
                print(f"zero={zero} N={n}: model state {state / MiB:.3f} MiB "
                      f"(formula {want / MiB:.3f}, x{state / want:.3f}); bytes/step "
                      f"{moved / MiB:.3f} MiB (formula {volume / MiB:.3f}, x{moved / volume:.3f})")
    write(args, rows)


def write(args: argparse.Namespace, rows: list[dict]) -> None:
    names = {0: "16Ψ", 1: "8Ψ+8Ψ/N", 2: "4Ψ+12Ψ/N", 3: "16Ψ/N"}
    lines = [
        "## ZeRO: model-state bytes and bytes moved per rank, formula against measured",
        "",
        f"`python benchmarks/zero_memory.py` (Llama from config: Ψ = {rows[0]['psi']:,} "
        f"parameters, hidden {args.hidden}, {args.layers} layers, seq {args.seq}, batch "
        f"{args.batch}/rank; fp32 + AdamW; gloo; {machine()}). Model state: the engine's "
        "`model_state_bytes` after the step (parameters, gradients, the optimizer's shards "
        "and Adam state, each storage once). Bytes: this rank's `comm/data...` bytes of one "
        "step (bus convention). Stage 0 is plain data parallel (paraxis-dp-core).",
        "",
        "| stage | N | formula | model state (MiB) | formula (MiB) | ratio | bytes/step (MiB) "
        "| formula (MiB) | ratio |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        bytes_f = "3Ψ(N-1)/N" if r["zero"] == 3 else "2Ψ(N-1)/N"
        lines.append(
            f"| {r['zero']} | {r['n']} | {names[r['zero']]}, {bytes_f} | "
            f"{r['state'] / MiB:.3f} | {r['state_formula'] / MiB:.3f} | "
            f"{r['state'] / r['state_formula']:.3f} | {r['bytes'] / MiB:.3f} | "
            f"{r['bytes_formula'] / MiB:.3f} | {r['bytes'] / r['bytes_formula']:.3f} |")
    lines += ["", "Measured exceeds the state formula by the padding rows (at most N-1 per "
              "parameter) and the vectors kept whole (norms: 16 bytes per element on every "
              "rank); they are all-reduced (2 instead of stage 3's 3), so stage 3 moves a "
              "little less than its formula. The token-count all-reduce adds 8 bytes."]
    if not args.no_write:
        write_section("zero_memory", "\n".join(lines), {"rows": rows})


if __name__ == "__main__":
    main()
