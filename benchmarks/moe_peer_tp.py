"""moe_vs_peer.py at expert x tensor (``--tensor 2``, 4 ranks): paraxis's expert 2 x
tensor 2 + SP, once per ``--chunks`` value, against transformers' own composition of its
tensor and expert plans. Why that peer and how it is installed: moe_vs_peer.py's
docstring. Section ``moe_vs_peer_e<expert>t<tensor>``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from common import (
    build_mixtral,
    machine,
    median,
    ratio_line,
    rounds,
    summary,
    write_section,
)
from local_step import local_grad
from torch.distributed.tensor import DTensor

import paraxis
from paraxis import shutdown


def transformers_tp_ep(args: argparse.Namespace, world: int, *, fsdp: bool):
    """transformers' tensor x expert plans on the tensor ranks, and over the batches FSDP2
    replicating (``fsdp``: all of ``DistributedConfig``'s composition) or one flat
    all-reduce of every local gradient (the same plans; what the expert-only peer does).
    Returns a step (this rank's language-model loss and loss, detached)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed import DistributedConfig
    from transformers.distributed.expert_parallel import apply_expert_parallelism
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    model, tp, dp = build_mixtral(args), args.tensor, world // args.tensor
    if fsdp:
        config = DistributedConfig(tp_size=tp, ep_size=tp, dp_replicate_size=dp)
        config, _, meshes = type(model).prepare_distribute_model(config)
        model = type(model).maybe_distribute_model(model, config, meshes)
        tp_group, dp_group = meshes.get_mesh("tp").get_group(), None
    else:
        tp_plan, ep_plan, _ = model._resolve_parallel_plans(
            DistributedConfig(tp_size=tp, ep_size=tp))
        dense = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        experts = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "ep"))
        apply_tensor_parallelism(model, dense["tp"], tp_plan)
        apply_expert_parallelism(model, experts["ep"], dense["tp"], ep_plan)
        tp_group, dp_group = dense["tp"].get_group(), dense["dp"].get_group()
    params = list(model.parameters())
    # AdamW on the local shards (plain tensors, foreach): the same update without DTensor's
    # per-op dispatch on every parameter (the peer's optimizer step took about 2x longer).
    with torch.no_grad():  # leaves aliasing the shards' storage
        local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    opt = torch.optim.AdamW(local, lr=1e-4, foreach=True)

    def step(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
        out.loss.backward()
        grads = [local_grad(p) for p in params]
        if dp_group is not None:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=dp_group)
            flat /= dp
            torch._foreach_copy_(grads, [f.view_as(g) for f, g in zip(
                flat.split([g.numel() for g in grads]), grads, strict=True)])
        norm = clip(params, grads, tp_group)
        for t, g in zip(local, grads, strict=True):
            t.grad = g
        opt.step()
        lm = out.loss - model.config.router_aux_loss_coef * out.aux_loss
        return lm.detach(), out.loss.detach(), norm

    return step


def clip(params, grads, group) -> torch.Tensor:
    """Global-norm clipping to 1 with one all-reduce; returns the norm before clipping. A
    parameter sharded over a mesh dim of size > 1 (tensor-sharded dense, or experts over
    ep: the same ranks as tp here) adds its shard's squares, summed over the group; a
    replicated one is counted once. (torch's ``clip_grad_norm_`` refuses DTensors on
    different meshes, and a DTensor norm per mesh costs two all-reduces each.)"""
    def sharded(p) -> bool:
        return isinstance(p, DTensor) and any(
            pl.is_shard() and p.device_mesh.size(i) > 1 for i, pl in enumerate(p.placements))

    sq = [sum((g.square().sum() for p, g in zip(params, grads, strict=True)
               if sharded(p) == s), torch.zeros(())) for s in (True, False)]
    dist.all_reduce(sq[0], group=group)
    norm = (sq[0] + sq[1]).sqrt()
    torch._foreach_mul_(grads, torch.clamp(1.0 / (norm + 1e-6), max=1.0))
    return norm


PEERS = ("transformers DistributedConfig", "transformers plans + flat all-reduce")


def main_tp(args: argparse.Namespace, world: int) -> None:
    rank, tensor = dist.get_rank(), args.tensor
    expert = world // tensor
    if expert * tensor != world or expert != tensor:
        raise SystemExit(f"--tensor {tensor} on {world} ranks: the peer's expert group is its "
                         "tensor group, so compare at expert = tensor (e.g. 4 ranks, --tensor 2)")
    engines = {c: paraxis.parallelize(
        build_mixtral(args), expert=expert, tensor=tensor, sequence_parallel=True,
        verify=False, moe={"dispatch_chunks": c},
        train={"steps": 10**6, "lr": 1e-4, "warmup_steps": 0, "seq_length": args.seq})
        for c in args.chunks}
    peers = {name: transformers_tp_ep(args, world, fsdp=name == PEERS[0]) for name in PEERS}
    # The ranks of a tensor group (tensor fastest, in both layouts) share one batch.
    g = torch.Generator().manual_seed(rank // tensor)

    def batch() -> torch.Tensor:
        return torch.randint(0, 256, (args.batch, args.seq), generator=g)

    # Parity: two steps on one batch; the second step's loss checks the first update
    # (gradient average, clip, AdamW) as well, and the gradient norm its scale (Adam's
    # first update hardly depends on it). (LM loss, with load-balancing, 2nd LM loss, norm)
    fixed, first = batch(), {}
    for c, e in engines.items():
        m, m2 = e.train_step(fixed), e.train_step(fixed)
        first[f"paraxis chunks {c}"] = (m["loss"], m["loss"] + m["moe/aux_loss"], m2["loss"],
                                        m["grad_norm"])
    for name, peer in peers.items():
        (lm, total, norm), (lm2, _, _) = peer(fixed), peer(fixed)
        losses = torch.stack([lm, total, lm2, norm]).double()
        dist.all_reduce(losses)
        first[name] = tuple((losses / world).tolist())  # the mean over the batches
    seen: dict[str, list[dict[str, float]]] = {str(c): [] for c in args.chunks}

    def stepper(c: int):
        def step() -> float:
            m = engines[c].train_step(batch())
            seen[str(c)].append(m)
            return m["moe/dispatch_s"]
        return step

    variants = {str(c): stepper(c) for c in args.chunks}
    for name, peer in peers.items():
        variants[name] = lambda peer=peer: (peer(batch()), None)[1]
    load = os.getloadavg()[0]
    run = rounds(variants, rounds=args.rounds, steps_per_round=args.steps,
                 warmup=args.warmup)
    load = (load, os.getloadavg()[0])
    if rank == 0:
        report_tp(args, world, expert, run, first,
                  {c: ms[args.warmup:] for c, ms in seen.items()}, load)
    for e in engines.values():
        e.close()
    shutdown()


def per_round(xs: list[float], n: int) -> list[float]:
    return [median(xs[i:i + n]) for i in range(0, len(xs), n)]


def report_tp(args, world, expert, run, first, seen, load) -> None:
    base = str(args.chunks[0])
    cmd = (f"torchrun --nproc-per-node {world} benchmarks/moe_vs_peer.py --tensor "
           f"{args.tensor} --chunks {' '.join(map(str, args.chunks))} --hidden {args.hidden} "
           f"--seq {args.seq} --batch {args.batch} --rounds {args.rounds} --steps "
           f"{args.steps} --warmup {args.warmup}")
    rows, payload = [], {"args": vars(args), "first_loss": first, "load": load}
    for c, ms in seen.items():
        share = median([m["moe/a2a_exposed_share"] for m in ms])
        exposed = median([m["moe/dispatch_s"] for m in ms])
        payload[f"chunks_{c}"] = {"median_step_s": run.median(c), "a2a_exposed_share": share,
                                  "dispatch_s": exposed, "dispatch_bytes": median(
                                      [m["moe/dispatch_bytes"] for m in ms])}
        rows.append(f"| paraxis `parallelize(model, expert={expert}, tensor={args.tensor}, "
                    f"sequence_parallel=True)`, `moe.dispatch_chunks={c}` | "
                    f"{run.median(c) * 1e3:.1f} | {exposed * 1e3:.1f} | {share:.3f} |")
    how = {PEERS[0]: f"`DistributedConfig(tp_size={args.tensor}, ep_size={args.tensor}, "
                     f"dp_replicate_size={world // args.tensor})`: TP plan + AllToAllEP + "
                     "FSDP2 replicating",
           PEERS[1]: "the same TP and EP plans, the batch axis by one flat all-reduce"}
    rows += [f"| `{name}`: {how[name]} | {run.median(name) * 1e3:.1f} | - | - |"
             for name in PEERS]
    best = min(PEERS, key=run.median)  # the faster peer is the one to beat
    payload["best_peer"] = best
    lines = []
    for c in seen:
        for name in (best, *(n for n in PEERS if n != best)):
            s = summary(run.ratios(c, name), 1.0)
            payload[f"ratio_chunks_{c}_vs_{name}"] = s
            lines.append(ratio_line(f"Ratio paraxis (chunks {c}) / {name} (median step "
                                    "time)", s, bold=c == base and name == best))
    exposed = {c: per_round(run.blocked[c], args.steps) for c in seen}
    for c in list(seen)[1:]:
        s = summary([a / b for a, b in zip(exposed[c], exposed[base], strict=True)], 1.0)
        payload[f"exposed_chunks_{c}"] = s
        lines.append(ratio_line(f"Exposed all-to-all time (`moe/dispatch_s`), chunks {c} / "
                                f"{base}", s, bold=False))
    tokens = args.batch * args.seq // args.tensor
    theory = 2 * tokens * args.top_k * args.hidden * (expert - 1) / expert * 4 * args.layers * 2
    measured = payload[f"chunks_{base}"]["dispatch_bytes"]
    gap = max(max(v[i] for v in first.values()) - min(v[i] for v in first.values())
              for i in (0, 2))
    norms = [v[3] for v in first.values()]
    norm_gap = (max(norms) - min(norms)) / min(norms)
    payload["lm_loss_gap"], payload["grad_norm_rel_gap"] = gap, norm_gap
    # The load-balancing term's batch (above) moves the norm by ~1e-5; a wrong gradient
    # average or clip moves it by far more.
    fair = "equal" if gap < 1e-5 and norm_gap < 1e-3 else "DIFFERENT: not a fair pairing"
    losses = "; ".join(f"{k}: LM {v[0]:.6f}, with load-balancing {v[1]:.6f}, second step "
                       f"LM {v[2]:.6f}, gradient norm {v[3]:.6f}" for k, v in first.items())
    overlap = []
    if len(seen) > 1:
        one, more = payload[f"chunks_{base}"], payload[f"chunks_{list(seen)[-1]}"]
        span = [x["dispatch_s"] / x["a2a_exposed_share"] for x in (one, more)]
        overlap = [f"Overlap: at chunks {list(seen)[-1]} the exposed share is "
                   f"{more['a2a_exposed_share']:.3f} (chunks {base}: "
                   f"{one['a2a_exposed_share']:.3f}): the exchanges' lifetime went from "
                   f"{span[0] * 1e3:.1f} to {span[1] * 1e3:.1f} ms, the blocked time from "
                   f"{one['dispatch_s'] * 1e3:.1f} to {more['dispatch_s'] * 1e3:.1f} ms"]
        if more["dispatch_s"] > 0.9 * one["dispatch_s"]:
            overlap[0] += (f"; the exposed time did not fall, likely because {world} ranks "
                           f"on {os.cpu_count()} shared cores leave no idle core to move the "
                           "bytes beside the expert compute")
        overlap[0] += "."
    md = "\n".join([
        f"## Expert {expert} x tensor {args.tensor}: paraxis vs transformers' tensor + "
        "expert plans", "",
        f"`{cmd}` (Mixtral from config: hidden {args.hidden}, FFN {2 * args.hidden}, "
        f"{args.layers} layers, {args.experts} experts top-{args.top_k}, vocab 256, seq "
        f"{args.seq}, batch {args.batch} per tensor group (the two ranks of a tensor group "
        f"share it); {world} ranks, gloo; {machine()}; the machine's 2 cores are shared "
        f"with other work (helpers and the lead), load average {load[0]:.1f} at the start, "
        f"{load[1]:.1f} at the end; {args.rounds} rounds of {args.steps} alternating steps "
        f"after {args.warmup} warm-up; all: forward with the load-balancing loss, backward, "
        "gradient average over the batches, global-norm clip, AdamW)", "",
        "Why this peer: transformers composes its own plans (tensor plan on `tp`, expert "
        "plan on `ep`, FSDP2 on the batch axes) and runs on CPU with gloo (run twice: as "
        "`DistributedConfig` installs it, and with FSDP2's per-module hooks replaced by one "
        f"flat gradient all-reduce; the faster, `{best}`, is the headline; both clip with "
        "one all-reduce and run AdamW on their local shards, foreach, as paraxis does); it "
        "cannot place "
        "the expert group across batches (`ep_size` a multiple of `tp_size` dividing "
        "`fsdp_size * tp_size`), so its expert group of 2 is the tensor group: the same "
        f"{args.experts // expert} experts per rank, its tp ranks each dispatching half of "
        "their batch (paraxis: each tensor rank its half of the sequence, under SP). Its TP "
        "has no sequence parallelism (`enable_sequence_parallel`: not wired up yet). "
        f"Parity, two steps on one batch (losses: mean over the batches): {losses}. The "
        f"language-model losses agree within {gap:.1e} (both steps), the first step's "
        f"gradient norms within {norm_gap:.1e} (relative); the totals and the norms "
        "differ by transformers' load-balancing term over each batch against paraxis's "
        f"over the global batch. Parity: **{fair}**.", "",
        "| variant | median step (ms) | median exposed all-to-all (ms) | median "
        "`moe/a2a_exposed_share` |", "| --- | ---: | ---: | ---: |", *rows, "",
        f"Dispatch bytes per rank per step (paraxis `moe/dispatch_bytes`, chunks {base}): "
        f"{measured / 2**20:.3f} MiB; 2·T·k·h·(N-1)/N x 4 B x 2 (backward) x {args.layers} "
        f"layers with T = {tokens} tokens per rank (batch x seq / tensor) = "
        f"{theory / 2**20:.3f} MiB (ratio {measured / theory:.3f}).", "", *overlap, "",
        *(x + "\n" for x in lines)])
    print(md)
    if not args.no_write:
        write_section(f"moe_vs_peer_e{expert}t{args.tensor}", md, payload)
    print(lines[0])
    print(f"best peer: {best}; parity: {fair}")
