"""paraxis tensor parallelism against torch DTensor with torchtitan's Llama plan, paired.

    torchrun --nproc-per-node 2 benchmarks/tp_vs_dtensor.py

The same Hugging Face Llama (built from config) is laid out four times over tensor=2,
two pairs that alternate step by step:

* ``tp``: paraxis from the model's own plan against DTensor ``parallelize_module`` with
  torchtitan's plan (``torchtitan/models/llama3/infra/parallelize.py``, ``apply_tp``):
  embedding RowwiseParallel, ``PrepareModuleInput`` on the attention and MLP inputs (so
  q, k, v share one backward all-reduce, and gate, up another), q/k/v and gate/up
  ColwiseParallel, o/down RowwiseParallel, lm_head ColwiseParallel with sharded logits
  under ``loss_parallel``;
* ``sp``: paraxis ``sequence_parallel`` against the same plan with torchtitan's sequence
  parallelism: ``SequenceParallel`` on every norm, the attention and MLP inputs
  all-gathered from Shard(1) by ``PrepareModuleInput``, o/down reduce-scattering to
  Shard(1), lm_head gathering its input. One departure from torchtitan, shared with
  paraxis: Hugging Face's Llama builds the rotary positions and the causal mask from the
  embedding output's length, so the embedding all-reduces and the sequence is split at
  the first layer's input (``PrepareModuleInput`` Replicate -> Shard(1)) instead of the
  embedding reduce-scattering.

Every step does forward, loss, backward, global-norm clipping at 1.0 and AdamW with
paraxis's settings (betas 0.9/0.95, weight decay 0.1 on matrices only, lr 1e-4); the
DTensor peers step their parameters' local tensors as paraxis does
(:class:`local_step.LocalAdamW`; they stepped every DTensor parameter through DTensor's
dispatch until issue 32). A first
unmeasured step checks that all four train the same model (equal first-step loss) and
counts bytes sent per rank: paraxis's ``comm/tensor_bytes``, the DTensor peer's at its
collectives (:class:`wire_bytes.WireBytes`, the same bus convention). Both are compared
with Narayanan et al.'s 8·b·s·h·(t-1)/t per layer (arXiv:2104.04473).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import build_llama, llama_parser, machine, ratio_line, rounds, summary, write_section
from local_step import LocalAdamW
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from wire_bytes import WireBytes

import paraxis
from paraxis import shutdown

PAIRS = ("tp", "sp")
# The last ratios measured with peers that stepped AdamW and clipped through DTensor's
# dispatch (RESULTS.md at fa944ef), kept beside the new ones for one release (issue 32).
BEFORE = ("Before issue 32 the DTensor peers stepped AdamW and clipped on every DTensor "
          "parameter (DTensor's per-op dispatch, foreach off): paraxis / DTensor was 0.738 "
          "[0.704–0.749] (tensor parallel) and 0.585 [0.572–0.615] (+ sequence parallel), "
          "both met; those ratios flattered paraxis by the peer's optimizer overhead.")
LR, BETAS, DECAY = 1e-4, (0.9, 0.95), 0.1


def layer_plan(sp: bool) -> dict:
    """torchtitan's per-block plan on Hugging Face Llama's module names."""
    outer = Shard(1) if sp else Replicate()  # the residual stream between blocks
    plan = {
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": outer},
                                        desired_input_kwarg_layouts={
                                            "hidden_states": Replicate()}),
        "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=outer),
        "mlp": PrepareModuleInput(input_layouts=(outer,), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=outer),
    }
    if sp:
        plan |= {"input_layernorm": SequenceParallel(),
                 "post_attention_layernorm": SequenceParallel()}
    return plan


def dtensor_model(args, mesh, *, sp: bool) -> torch.nn.Module:
    model = build_llama(args)
    for layer in model.model.layers:
        parallelize_module(layer, mesh, layer_plan(sp))
    top = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
           "lm_head": ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                                      output_layouts=Shard(-1), use_local_output=False)}
    if sp:
        # Split the (whole) embedding output at the first layer; see the module docstring.
        top |= {"model.layers.0": PrepareModuleInput(input_layouts=(Replicate(),),
                                                     desired_input_layouts=(Shard(1),),
                                                     use_local_output=True),
                "model.norm": SequenceParallel(use_local_output=True)}
    parallelize_module(model, mesh, top)
    return model


def dtensor_stepper(model: torch.nn.Module):
    """forward, vocab-parallel loss, backward, clip, AdamW; returns the loss. The
    optimizer steps the parameters' local tensors (:class:`local_step.LocalAdamW`), as
    paraxis does: AdamW on every DTensor parameter dispatched each op through DTensor
    one parameter at a time and cost the peer about twice the optimizer time (issue 32;
    the ratio before the change is kept beside the new one in RESULTS.md)."""
    opt = LocalAdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=DECAY)

    def step(ids: torch.Tensor) -> float:
        opt.zero_grad()
        logits = model(ids, use_cache=False).logits
        with loss_parallel():
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
        opt.step(1.0)
        return float((loss.full_tensor() if isinstance(loss, DTensor) else loss).detach())
    return step


def paraxis_engine(args, world: int, *, sp: bool):
    return paraxis.parallelize(build_llama(args), tensor=world, sequence_parallel=sp,
                               train={"steps": 10**6, "lr": LR, "warmup_steps": 0,
                                      "betas": BETAS, "weight_decay": DECAY,
                                      "grad_clip": 1.0, "seq_length": args.seq})


def first_step(args, engines: dict, peers: dict) -> dict[str, dict]:
    """One unmeasured step of every variant on the same batch: loss and bytes per op."""
    ids = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    out = {}
    for pair in PAIRS:
        engine = engines[pair]
        mark = engine.grid.comm.mark()
        loss = engine.train_step(ids)["loss"]
        ops = {op: b for (axes, op), b in engine.grid.comm.since(mark)["bytes"].items()
               if axes == "tensor"}
        out[f"paraxis {pair}"] = {"loss": loss, "bytes": ops}
        with WireBytes() as wire:
            loss = peers[pair](ids)
        out[f"dtensor {pair}"] = {"loss": loss, "bytes": dict(wire.bytes)}
    return out


def check_same_model(first: dict[str, dict]) -> None:
    losses = {k: v["loss"] for k, v in first.items()}
    if dist.get_rank() == 0:
        print("first-step loss: " + ", ".join(f"{k} {v:.6f}" for k, v in losses.items()))
    spread = max(losses.values()) - min(losses.values())
    if spread > 1e-4 * max(losses.values()):
        raise RuntimeError(f"the four layouts do not train the same model: first-step "
                           f"losses {losses} differ by {spread:.2e}")


def on_batches(args, step):
    g = torch.Generator().manual_seed(1)

    def run() -> None:
        step(torch.randint(0, 256, (args.batch, args.seq), generator=g))
    return run


def main() -> None:
    args = llama_parser(__doc__, steps=6, warmup=5, layers=4, batch=4).parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    engines = {pair: paraxis_engine(args, world, sp=pair == "sp") for pair in PAIRS}
    peers = {pair: dtensor_stepper(dtensor_model(args, mesh, sp=pair == "sp"))
             for pair in PAIRS}
    first = first_step(args, engines, peers)
    check_same_model(first)
    variants = {}
    for pair in PAIRS:  # every variant draws the same batches from its own generator
        variants[f"paraxis {pair}"] = on_batches(args, engines[pair].train_step)
        variants[f"dtensor {pair}"] = on_batches(args, peers[pair])
    run = rounds(variants, rounds=args.rounds, steps_per_round=args.steps,
                 warmup=args.warmup)
    ratios = {pair: summary(run.ratios(f"paraxis {pair}", f"dtensor {pair}"), 0.9)
              for pair in PAIRS}
    if dist.get_rank() == 0:
        write_result(args, world, run, ratios, first)
    for engine in engines.values():
        engine.close()
    shutdown()


def write_result(args, world, run, ratios, first) -> None:
    b, s, h, t, layers = args.batch, args.seq, args.hidden, world, args.layers
    theory = 8 * b * s * h * (t - 1) / t * 4 * layers  # fp32 bytes, transformer layers only
    mib = {k: sum(v["bytes"].values()) / 2**20 for k, v in first.items()}
    names = {"paraxis tp": "paraxis tensor parallel",
             "dtensor tp": "DTensor, torchtitan's plan (+ loss_parallel)",
             "paraxis sp": "paraxis tensor parallel + sequence_parallel",
             "dtensor sp": "DTensor, torchtitan's plan + SequenceParallel"}
    rows = [f"| {names[k]} | {run.median(k) * 1e3:.1f} | {mib[k]:.2f} | "
            + ", ".join(f"{op} {n / 2**20:.2f}" for op, n in sorted(v["bytes"].items()))
            + " |" for k, v in first.items()]
    table = "\n".join([
        "## Tensor parallel: paraxis vs torch DTensor (torchtitan's plan)",
        "",
        f"`torchrun --nproc-per-node {world} benchmarks/tp_vs_dtensor.py` (Llama from "
        f"config: hidden {h}, {layers} layers, 8 heads / 4 kv heads, vocab 256, seq {s}, "
        f"batch {b}; tensor={world}, gloo; {machine()}; {args.rounds} rounds of "
        f"{args.steps} alternating steps after {args.warmup} warm-up; all four: forward, "
        "loss, backward, clip, AdamW; first-step loss "
        + ", ".join(f"{k} {v['loss']:.5f}" for k, v in first.items()) + ")",
        "",
        "| variant | median step (ms) | bytes/step/rank (MiB) | by op (MiB) |",
        "| --- | ---: | ---: | --- |",
        *rows,
        "",
        "Bytes: one step, this rank, bus convention (all-reduce 2(t-1)/t, all-gather and "
        "reduce-scatter (t-1)/t of the full tensor); paraxis's own counters, the DTensor "
        "peer's counted at its collectives under a dispatch mode. 8·b·s·h·(t-1)/t x "
        f"{layers} layers x 4 bytes = {theory / 2**20:.2f} MiB; the rest is the embedding "
        "all-reduce, the lm-head entry, the vocab-parallel loss and (DTensor) clipping.",
        "",
        ratio_line("Ratio paraxis / DTensor, tensor parallel (median step time)",
                   ratios["tp"]),
        "",
        ratio_line("Ratio paraxis / DTensor, + sequence parallel (median step time)",
                   ratios["sp"]),
        "",
        BEFORE,
    ])
    if not args.no_write:
        write_section("tp_vs_dtensor", table, {
            "args": vars(args), "median_step_s": {k: run.median(k) for k in run.walls},
            "round_medians_s": {k: run.medians(k) for k in run.walls},
            "ratios": ratios, "first_step": first, "theory_bytes": theory})
    print("\n".join(rows))
    for pair in PAIRS:
        print(ratio_line(f"ratio paraxis/dtensor {pair}", ratios[pair], bold=False))


if __name__ == "__main__":
    main()
