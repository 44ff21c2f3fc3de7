"""paraxis tensor parallelism against torch DTensor ``parallelize_module``, paired.

    torchrun --nproc-per-node 2 benchmarks/tp_vs_dtensor.py

The same Hugging Face Llama (built from config) is laid out twice over tensor=2:
paraxis from the model's own plan, and DTensor with torchtitan's recipe (embedding
RowwiseParallel, q/k/v and gate/up ColwiseParallel, o/down RowwiseParallel, lm_head
ColwiseParallel with sharded logits under ``loss_parallel``). Both steps do forward,
loss, backward, global-norm clipping and AdamW; they alternate, and the last line is the
median step-time ratio paraxis / DTensor. paraxis's bytes sent per step per rank are
compared with Narayanan et al.'s 8·b·s·h·(t-1)/t per layer (arXiv:2104.04473).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import alternate, build_llama, llama_parser, machine, median, write_section
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

import paraxis
from paraxis import shutdown


def parse() -> argparse.Namespace:
    p = llama_parser(__doc__, steps=30, warmup=5, layers=4, batch=4)
    return p.parse_args()


def dtensor_model(args: argparse.Namespace, mesh):
    model = build_llama(args)
    layer_plan = {
        "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.model.layers:
        parallelize_module(layer, mesh, layer_plan)
    parallelize_module(model, mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    })
    return model


def clip_mixed(params: list[torch.nn.Parameter], max_norm: float) -> None:
    """clip_grad_norm_ over DTensor (sharded) and plain (replicated norm weights)
    gradients, which torch's foreach kernels refuse to mix under tensor parallelism."""
    sharded = [p for p in params if isinstance(p.grad, DTensor)]
    plain = [p for p in params if p.grad is not None and not isinstance(p.grad, DTensor)]
    norm_sq = torch.nn.utils.get_total_norm([p.grad for p in sharded]).full_tensor() ** 2
    norm_sq = norm_sq + torch.nn.utils.get_total_norm([p.grad for p in plain]) ** 2
    total = norm_sq.sqrt()
    torch.nn.utils.clip_grads_with_norm_(plain, max_norm, total)
    torch.nn.utils.clip_grads_with_norm_(sharded, max_norm, total, foreach=False)


def main() -> None:
    args = parse()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    engine = paraxis.parallelize(build_llama(args), tensor=world,
                                 train={"steps": 10**6, "lr": 1e-4, "warmup_steps": 0,
                                        "seq_length": args.seq})
    mesh = init_device_mesh("cpu", (world,))
    dt = dtensor_model(args, mesh)
    opt = torch.optim.AdamW(dt.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)

    def batch() -> torch.Tensor:
        return torch.randint(0, 256, (args.batch, args.seq), generator=g)

    bytes_per_step: list[float] = []

    def paraxis_step() -> None:
        metrics = engine.train_step(batch())
        bytes_per_step.append(metrics.get("comm/tensor_bytes", 0.0))

    def dtensor_step() -> None:
        ids = batch()
        opt.zero_grad(set_to_none=True)
        logits = dt(ids, use_cache=False).logits
        with loss_parallel():
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
        clip_mixed(list(dt.parameters()), 1.0)
        opt.step()

    variants = {"paraxis": paraxis_step, "dtensor": dtensor_step}
    times, _ = alternate(variants, steps=args.steps, warmup=args.warmup)
    med = {k: median(v) for k, v in times.items()}
    ratio = med["paraxis"] / med["dtensor"]
    b, s, h, t, layers = args.batch, args.seq, args.hidden, world, args.layers
    theory = 8 * b * s * h * (t - 1) / t * 4 * layers  # fp32 bytes, transformer layers only
    measured = median(bytes_per_step)
    if dist.get_rank() == 0:
        by_op = {op: n for (axes, op), n in engine.grid.comm.bytes.items() if axes == "tensor"}
        write_result(args, world, med, ratio, measured, theory, by_op)
    engine.close()
    shutdown()


def write_result(args, world, med, ratio, measured, theory, by_op) -> None:
    table = "\n".join([
        "## Tensor parallel: paraxis vs torch DTensor",
        "",
        f"`torchrun --nproc-per-node {world} benchmarks/tp_vs_dtensor.py` (Llama from "
        f"config: hidden {args.hidden}, {args.layers} layers, 8 heads / 4 kv heads, "
        f"vocab 256, seq {args.seq}, batch {args.batch}; tensor={world}, gloo; {machine()}; "
        f"median of {args.steps} alternating steps; both: forward, loss, backward, "
        "clip, AdamW)",
        "",
        "| variant | median step (ms) |",
        "| --- | ---: |",
        f"| paraxis tensor parallel | {med['paraxis'] * 1e3:.1f} |",
        f"| DTensor parallelize_module (+ loss_parallel) | {med['dtensor'] * 1e3:.1f} |",
        "",
        f"Bytes sent per step per rank (paraxis, bus convention): {measured / 2**20:.2f} MiB; "
        f"8·b·s·h·(t-1)/t x {args.layers} layers x 4 bytes = {theory / 2**20:.2f} MiB "
        f"(ratio {measured / theory:.3f}; the rest is the embedding all-reduce, the "
        "lm-head entry and the vocab-parallel loss's per-token reductions). By op over the "
        f"whole run: {', '.join(f'{k} {v / 2**20:.0f} MiB' for k, v in by_op.items())}.",
        "",
        f"**Ratio paraxis / DTensor (median step time): {ratio:.3f}** (target <= 0.9)",
    ])
    if not args.no_write:
        write_section("tp_vs_dtensor", table, {"median_step_s": med, "ratio": ratio,
                                               "bytes_per_step": measured,
                                               "theory_bytes": theory})
    print(f"paraxis: {med['paraxis'] * 1e3:.1f} ms  dtensor: {med['dtensor'] * 1e3:.1f} ms")
    print(f"bytes/step/rank: measured {measured / 2**20:.2f} MiB, "
          f"theory (layers) {theory / 2**20:.2f} MiB")
    print(f"ratio paraxis/dtensor (median step time): {ratio:.3f}")


if __name__ == "__main__":
    main()
