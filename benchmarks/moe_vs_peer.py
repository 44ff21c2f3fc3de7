"""paraxis expert parallelism against transformers' own expert-parallel plan, paired.

    torchrun --nproc-per-node 2 benchmarks/moe_vs_peer.py
    torchrun --nproc-per-node 4 benchmarks/moe_vs_peer.py --tensor 2 --chunks 1 2

The same tiny Mixtral (built from config) is laid out twice over expert=N (N ranks,
each its own tokens): paraxis through ``parallelize(model, expert=N)``, and transformers'
``apply_expert_parallelism`` with the model's ``base_model_ep_plan`` (``grouped_gemm``
expert shards and the ``ep_dispatch_experts`` all-to-all, what
``DistributedConfig(ep_size=N)`` installs; it runs on CPU with gloo, so DeepSpeed's MoE
layer is not needed). Both steps do forward with the load-balancing loss, backward, the
gradient average of dense parameters over the ranks (expert gradients scaled to the
one-process mean), global-norm clipping and AdamW; they alternate in rounds, and the
last line is the ratio paraxis / transformers (median of per-round ratios, spread,
verdict against the target; :mod:`common`).

Dispatch bytes per rank per step (paraxis's ``moe/dispatch_bytes``: the busiest rank per
layer, summed over layers) are compared with 2·T·k·h·(N-1)/N elements per all-to-all
pair (dispatch + combine) under uniform routing, times 4 bytes, layers, and 2 (backward
repeats both exchanges): T tokens per rank, k experts per token, h hidden, N expert ranks
((N-1)/N is the fraction of a rank's pairs whose expert lives elsewhere; with one
expert per rank it is the issue's (E-1)/E).

``--tensor 2`` (4 ranks: expert 2 x tensor 2, section ``moe_vs_peer_e2t2``): paraxis
``parallelize(model, expert=2, tensor=2, sequence_parallel=True)`` (Megatron-Core's rule:
expert x tensor needs SP; each tensor rank routes its half of the sequence; experts whole,
E/2 per rank) once per ``--chunks`` value (``moe.dispatch_chunks``; 1 first), against
transformers' own composition of its tensor and expert plans, twice:

- as ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=2, ep_size=2,
  dp_replicate_size=2))`` installs it, through the same ``prepare_distribute_model`` and
  ``maybe_distribute_model`` called directly (``from_pretrained`` with a
  ``distributed_config`` refuses to run without ``accelerate``, not installed here):
  ``base_model_tp_plan`` as DTensors on ``tp`` (attention column/row-wise; no SP:
  ``enable_sequence_parallel`` is "not wired up yet"), ``base_model_ep_plan`` (E/2 experts
  per rank, ``AllToAllEP``: each tp rank dispatches its half of the batch's tokens), and
  FSDP2 replicating over ``dp_replicate`` for the gradient average (fsdp_size 1: nothing
  sharded, as in paraxis's layout);
- the same plans (``apply_tensor_parallelism``, ``apply_expert_parallelism``) with one
  flat all-reduce of the gradients over the batches instead of FSDP2's per-module hooks,
  as the expert-only peer above does.

The faster of the two is the headline peer. transformers cannot lay its expert group
across batches as paraxis does (``ep_size`` must be a multiple of ``tp_size`` and divide
``fsdp_size * tp_size``), so at tp 2 its expert group of 2 is the tensor group: same
model, tokens, experts per rank and arithmetic, other ranks in the exchange. Parity: two
steps on one batch, each variant; the language-model losses must agree (transformers'
load-balancing term is over its own batch, paraxis's ``moe/aux_loss`` over the global
batch, so the totals differ by ~1e-5). The peers clip with one all-reduce (torch's
``clip_grad_norm_`` refuses DTensors on different meshes). Reported also: each chunk
count's ``moe/a2a_exposed_share`` (exposed all-to-all / its lifetime; 1 at one chunk).
The code is in moe_peer_tp.py (not named ``*_vs_*``: nox's bench session runs those on 2
ranks).
"""

from __future__ import annotations

import argparse
import fnmatch
import os

import torch
import torch.distributed as dist
from common import (
    build_mixtral,
    machine,
    median,
    ratio_line,
    round_args,
    rounds,
    summary,
    write_section,
)
from moe_peer_tp import main_tp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import paraxis
from paraxis import shutdown


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    round_args(p, steps=8, warmup=5)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--tensor", type=int, default=1, help="tensor degree (2: expert 2 x tensor 2)")
    p.add_argument("--chunks", type=int, nargs="+", default=[1],
                   help="paraxis moe.dispatch_chunks values to run (--tensor 2 only)")
    return p.parse_args()


# The last ratio measured with the peer stepping AdamW on its expert DTensors, non-foreach
# (RESULTS.md at fa944ef), kept beside the new one for one release (issue 32).
BEFORE = ("Before issue 32 the peer stepped AdamW on its expert DTensors through DTensor's "
          "dispatch (foreach off): paraxis / transformers was 1.034 [0.981–1.076], inside "
          "the noise of the target 1.0.")


def transformers_ep(args: argparse.Namespace, world: int):
    """The model with transformers' expert-parallel plan applied, and its optimizer."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    model = build_mixtral(args)
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("ep", "tp"))
    names = [*dict(model.named_modules()), *dict(model.named_parameters())]
    plan = {n: style for pattern, style in model.config.base_model_ep_plan.items()
            for n in names if fnmatch.fnmatchcase(n, f"model.{pattern}")}
    apply_expert_parallelism(model, mesh["ep"], mesh["tp"], plan)
    expert = [p for p in model.parameters() if isinstance(p, DTensor)]
    dense = [p for p in model.parameters() if not isinstance(p, DTensor)]
    # AdamW (foreach) on the expert DTensors' local shards, as paraxis steps its own:
    # stepping the DTensors, non-foreach, dispatched each op through DTensor (issue 32).
    with torch.no_grad():  # leaves aliasing the shards' storage
        shards = [p.to_local() for p in expert]
    opt = torch.optim.AdamW([*dense, *shards], lr=1e-4, foreach=True)
    return model, dense, expert, (opt, shards)


def peer_step(model, dense, expert, stepper, ids: torch.Tensor, world: int) -> None:
    opt, shards = stepper
    opt.zero_grad(set_to_none=True)
    for p in expert:
        p.grad = None
    out = model(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
    out.loss.backward()
    # Dense gradients: the mean over ranks (one flat all-reduce). Expert gradients hold
    # every rank's tokens already (the all-to-all's backward): scale to the mean.
    flat = torch.cat([p.grad.reshape(-1) for p in dense])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for p in dense:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    local = [p.grad.to_local() for p in expert]
    for g in local:
        g /= world
    sq = torch.stack([g.square().sum() for g in local]).sum()
    dist.all_reduce(sq)
    norm = (sq + flat.square().sum()).sqrt()
    scale = torch.clamp(1.0 / (norm + 1e-6), max=1.0)
    for g in [p.grad for p in dense] + local:
        g.mul_(scale)
    for t, g in zip(shards, local, strict=True):
        t.grad = g
    opt.step()


def main() -> None:
    args = parse()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if args.tensor > 1:
        main_tp(args, world)
        return
    engine = paraxis.parallelize(build_mixtral(args), expert=world, verify=False,
                                 train={"steps": 10**6, "lr": 1e-4, "warmup_steps": 0,
                                        "seq_length": args.seq})
    peer = transformers_ep(args, world)
    g = torch.Generator().manual_seed(dist.get_rank())

    def batch() -> torch.Tensor:
        return torch.randint(0, 256, (args.batch, args.seq), generator=g)

    seen: list[dict[str, float]] = []

    def paraxis_step() -> None:
        seen.append(engine.train_step(batch()))

    variants = {"paraxis": paraxis_step,
                "transformers": lambda: peer_step(*peer, batch(), world)}
    run = rounds(variants, rounds=args.rounds, steps_per_round=args.steps,
                 warmup=args.warmup)
    measured = [m["moe/dispatch_bytes"] for m in seen[args.warmup:]]
    on_wire = [m.get("comm/expert_bytes", 0.0) for m in seen[args.warmup:]]
    tokens = args.batch * args.seq
    pair = 2 * tokens * args.top_k * args.hidden * (world - 1) / world * 4
    theory = pair * args.layers * 2
    if dist.get_rank() == 0:
        report(args, world, run, median(measured), median(on_wire), pair, theory)
    engine.close()
    shutdown()


def report(args, world, run, measured, on_wire, pair, theory) -> None:
    med = {k: run.median(k) for k in run.walls}
    ratio = summary(run.ratios("paraxis", "transformers"), 1.0)
    table = "\n".join([
        "## Expert parallel: paraxis vs transformers' expert-parallel plan",
        "",
        f"`torchrun --nproc-per-node {world} benchmarks/moe_vs_peer.py` (Mixtral from config: "
        f"hidden {args.hidden}, {args.layers} layers, {args.experts} experts, top-{args.top_k}, "
        f"vocab 256, seq {args.seq}, batch {args.batch} per rank; expert={world}, gloo; "
        f"{machine()}; {args.rounds} rounds of {args.steps} alternating steps after "
        f"{args.warmup} warm-up; both: forward with the load-balancing loss, backward, "
        "dense-gradient average, clip, AdamW)",
        "",
        "| variant | median step (ms) |",
        "| --- | ---: |",
        f"| paraxis `parallelize(model, expert={world})` | {med['paraxis'] * 1e3:.1f} |",
        f"| transformers `apply_expert_parallelism` (AllToAllEP) | "
        f"{med['transformers'] * 1e3:.1f} |",
        "",
        f"Dispatch bytes per rank per step (paraxis `moe/dispatch_bytes`, forward + "
        f"backward, {args.layers} layers): {measured / 2**20:.3f} MiB; analytic "
        f"2·T·k·h·(N-1)/N x 4 B = {pair / 2**20:.3f} MiB per all-to-all pair, x 2 pairs "
        f"(forward, backward) x {args.layers} layers = {theory / 2**20:.3f} MiB (ratio "
        f"{measured / theory:.3f}: routing is not uniform, and each layer counts its "
        f"busiest rank). All expert-axis traffic incl. the split-size exchange: "
        f"{on_wire / 2**20:.3f} MiB.",
        "",
        ratio_line("Ratio paraxis / transformers (median step time)", ratio),
        "",
        BEFORE,
    ])
    if not args.no_write:
        write_section("moe_vs_peer", table, {"median_step_s": med, "ratio": ratio,
                                             "round_medians_s": {
                                                 k: run.medians(k) for k in run.walls},
                                             "dispatch_bytes_per_step": measured,
                                             "expert_axis_bytes_per_step": on_wire,
                                             "theory_bytes_per_step": theory,
                                             "theory_bytes_per_pair": pair})
    print(f"paraxis: {med['paraxis'] * 1e3:.1f} ms  transformers: "
          f"{med['transformers'] * 1e3:.1f} ms")
    print(f"dispatch bytes/step/rank: measured {measured / 2**20:.3f} MiB, "
          f"2*T*k*h*(N-1)/N*4B = {pair / 2**20:.3f} MiB per pair, x2x{args.layers} = "
          f"{theory / 2**20:.3f} MiB")
    print(ratio_line("ratio paraxis/transformers (median step time)", ratio, bold=False))


if __name__ == "__main__":
    main()
