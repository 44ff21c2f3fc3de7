"""paraxis ZeRO-3 against DeepSpeed ZeRO-3, paired in one run.

    pip install deepspeed==0.19.8
    torchrun --nproc-per-node 2 benchmarks/zero_vs_deepspeed.py

The same Hugging Face Llama (built from config) is sharded twice over data=2: paraxis
``zero=3`` through ``paraxis.parallelize``, and ``deepspeed.initialize`` with ZeRO stage
3 on its CPU accelerator (gloo), given a torch AdamW so that nothing is compiled (nor
the shared-memory kernel its CPU backend builds for inference's all-reduce).
DeepSpeed's settings are matched to paraxis's where it has one: vectors stay whole
(``stage3_param_persistence_threshold`` 1024 elements keeps the norms and nothing else
whole), about one layer prefetched (``stage3_prefetch_bucket_size``), overlapped
reduce-scatter in 25 MiB buckets, clipping at 1.0. Both steps do forward, loss,
backward, clipping and AdamW; they alternate in rounds, and the last line is the ratio
paraxis / DeepSpeed (median of per-round ratios and spread; no target is stated for it).
Without deepspeed installed the script says so and exits.
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
    ratio_line,
    rounds,
    summary,
    write_section,
)

import paraxis
from paraxis import shutdown


def deepspeed_engine(args, layer_params: int):
    import importlib

    import deepspeed

    # Its CPU backend JIT-builds a shared-memory kernel used only by inference's
    # all-reduce; training goes through gloo either way, and nothing is compiled.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    model = build_llama(args)
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": 3, "overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": 25 * 2**20 // 4,
            "stage3_prefetch_bucket_size": layer_params,
            "stage3_param_persistence_threshold": 1024,
        },
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def main() -> None:
    args = llama_parser(__doc__, steps=6, warmup=5, layers=4, batch=4).parse_args()
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        print("deepspeed is not installed (pip install deepspeed==0.19.8); skipped")
        return
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    engine = paraxis.parallelize(build_llama(args), data=world, zero=3,
                                 train={"steps": 10**6, "lr": 1e-4, "warmup_steps": 0,
                                        "seq_length": args.seq, "grad_clip": 1.0})
    reference = build_llama(args)
    psi = sum(p.numel() for p in reference.parameters())
    layer_params = sum(p.numel() for p in reference.model.layers[0].parameters())
    ds = deepspeed_engine(args, layer_params)
    g = torch.Generator().manual_seed(rank)

    def batch() -> torch.Tensor:
        return torch.randint(0, 256, (args.batch, args.seq), generator=g)

    def paraxis_step() -> None:
        engine.train_step(batch())

    variants = {"paraxis": paraxis_step, "deepspeed": deepspeed_stepper(ds, batch)}
    run = rounds(variants, rounds=args.rounds, steps_per_round=args.steps,
                 warmup=args.warmup)
    med = {k: run.median(k) for k in run.walls}
    ratio = summary(run.ratios("paraxis", "deepspeed"), None)
    ratio["round_medians_s"] = {k: run.medians(k) for k in run.walls}
    if rank == 0:
        write_result(args, world, psi, med, ratio)
    engine.close()
    del ds, variants
    shutdown()


def deepspeed_stepper(ds, batch):
    def step() -> None:
        ids = batch()
        logits = ds(ids, use_cache=False).logits
        ds.backward(F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))
        ds.step()
    return step


def write_result(args, world, psi, med, ratio) -> None:
    import deepspeed

    table = "\n".join([
        "## ZeRO-3: paraxis vs DeepSpeed",
        "",
        f"`torchrun --nproc-per-node {world} benchmarks/zero_vs_deepspeed.py` (deepspeed "
        f"{deepspeed.__version__}, CPU accelerator, gloo, torch AdamW; Llama from config: "
        f"{psi / 1e6:.2f}M parameters, hidden {args.hidden}, {args.layers} layers, seq "
        f"{args.seq}, batch {args.batch}/rank; data={world}; {machine()}; {args.rounds} "
        f"rounds of {args.steps} alternating steps; both: forward, loss, backward, clip, "
        "AdamW)",
        "",
        "| variant | median step (ms) |",
        "| --- | ---: |",
        f"| paraxis zero=3 | {med['paraxis'] * 1e3:.1f} |",
        f"| DeepSpeed ZeRO-3 | {med['deepspeed'] * 1e3:.1f} |",
        "",
        ratio_line("Ratio paraxis / DeepSpeed (median step time)", ratio),
    ])
    if not args.no_write:
        write_section("zero_vs_deepspeed", table, {"median_step_s": med, "ratio": ratio,
                                                   "params": psi})
    print(f"paraxis: {med['paraxis'] * 1e3:.1f} ms  deepspeed: {med['deepspeed'] * 1e3:.1f} ms")
    print(ratio_line("ratio paraxis/deepspeed (median step time)", ratio, bold=False))


if __name__ == "__main__":
    main()
