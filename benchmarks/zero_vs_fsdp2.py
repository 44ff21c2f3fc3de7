"""paraxis ZeRO-3 against torch FSDP2 (``fully_shard``), paired in one run.

    torchrun --nproc-per-node 2 benchmarks/zero_vs_fsdp2.py

The same Hugging Face Llama (built from config) is sharded twice over data=2: paraxis
``zero=3`` through ``paraxis.parallelize``, and FSDP2 with ``fully_shard`` on the same
units (the embedding, each decoder layer, the LM head, and the root for what is left,
the final norm), resharding after forward, with the same prefetch depth: one unit ahead
in forward and one behind in backward (``set_modules_to_forward_prefetch`` /
``set_modules_to_backward_prefetch``). Both steps do forward, loss, backward, global-norm
clipping and AdamW; they alternate in rounds, and the last line is the ratio paraxis /
FSDP2 (median of per-round ratios, spread, verdict; :mod:`common`). paraxis's bytes per
step per rank are reported against ZeRO's 3Ψ(N-1)/N (all-gather in forward and in
backward, reduce-scatter of gradients).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import (
    build_llama,
    llama_parser,
    machine,
    median,
    ratio_line,
    rounds,
    summary,
    write_section,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import paraxis
from paraxis import shutdown


def fsdp2_model(args, mesh) -> torch.nn.Module:
    """FSDP2 on the units paraxis uses, each prefetching its neighbour both ways."""
    model = build_llama(args)
    units = [model.model.embed_tokens, *model.model.layers, model.lm_head]
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh)
    model.set_modules_to_forward_prefetch([units[0]])
    for i, unit in enumerate(units):
        if i + 1 < len(units):
            unit.set_modules_to_forward_prefetch([units[i + 1]])
        if i > 0:
            unit.set_modules_to_backward_prefetch([units[i - 1]])
    return model


def main() -> None:
    args = llama_parser(__doc__, steps=6, warmup=5, layers=4, batch=4).parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    engine = paraxis.parallelize(build_llama(args), data=world, zero=3,
                                 train={"steps": 10**6, "lr": 1e-4, "warmup_steps": 0,
                                        "seq_length": args.seq, "grad_clip": 1.0})
    psi = sum(p.numel() for p in build_llama(args).parameters())
    fsdp = fsdp2_model(args, init_device_mesh("cpu", (world,)))
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(rank)

    def batch() -> torch.Tensor:
        return torch.randint(0, 256, (args.batch, args.seq), generator=g)

    bytes_per_step: list[float] = []

    def paraxis_step() -> None:
        metrics = engine.train_step(batch())
        bytes_per_step.append(sum(v for k, v in metrics.items()
                                  if k.startswith("comm/data")))

    variants = {"paraxis": paraxis_step, "fsdp2": fsdp2_stepper(fsdp, opt, batch)}
    run = rounds(variants, rounds=args.rounds, steps_per_round=args.steps,
                 warmup=args.warmup)
    med = {k: run.median(k) for k in run.walls}
    ratio = summary(run.ratios("paraxis", "fsdp2"), 1.0)
    ratio["round_medians_s"] = {k: run.medians(k) for k in run.walls}
    theory = 3 * psi * (world - 1) / world * 4
    if rank == 0:
        write_result(args, world, psi, med, ratio, median(bytes_per_step), theory)
    engine.close()
    del fsdp, opt, variants
    shutdown()


def fsdp2_stepper(model, opt, batch):
    def step() -> None:
        ids = batch()
        opt.zero_grad(set_to_none=True)
        logits = model(ids, use_cache=False).logits
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return step


def write_result(args, world, psi, med, ratio, measured, theory) -> None:
    table = "\n".join([
        "## ZeRO-3: paraxis vs torch FSDP2",
        "",
        f"`torchrun --nproc-per-node {world} benchmarks/zero_vs_fsdp2.py` (Llama from "
        f"config: {psi / 1e6:.2f}M parameters, hidden {args.hidden}, {args.layers} layers, "
        f"8 heads / 4 kv heads, vocab 256, seq {args.seq}, batch {args.batch}/rank; "
        f"data={world}, gloo; {machine()}; {args.rounds} rounds of {args.steps} "
        "alternating steps; both: units embedding / each layer / head, reshard after "
        "forward, prefetch one unit both ways, forward, loss, backward, clip, AdamW)",
        "",
        "| variant | median step (ms) |",
        "| --- | ---: |",
        f"| paraxis zero=3 | {med['paraxis'] * 1e3:.1f} |",
        f"| FSDP2 fully_shard | {med['fsdp2'] * 1e3:.1f} |",
        "",
        f"Bytes sent per step per rank (paraxis, data axis): {measured / 2**20:.3f} MiB; "
        f"3Ψ(N-1)/N x 4 bytes = {theory / 2**20:.3f} MiB (ratio {measured / theory:.3f}; "
        "norms stay whole and are all-reduced, 2 instead of 3; the token count adds "
        "8 bytes).",
        "",
        ratio_line("Ratio paraxis / FSDP2 (median step time)", ratio),
    ])
    if not args.no_write:
        write_section("zero_vs_fsdp2", table, {"median_step_s": med, "ratio": ratio,
                                               "bytes_per_step": measured,
                                               "theory_bytes": theory, "params": psi})
    print(f"paraxis: {med['paraxis'] * 1e3:.1f} ms  fsdp2: {med['fsdp2'] * 1e3:.1f} ms")
    print(f"bytes/step/rank: measured {measured / 2**20:.3f} MiB, "
          f"3Ψ(N-1)/N {theory / 2**20:.3f} MiB")
    print(ratio_line("ratio paraxis/fsdp2 (median step time)", ratio, bold=False))


if __name__ == "__main__":
    main()
