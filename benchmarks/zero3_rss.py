"""Every rank's peak resident memory under ZeRO-3 through ``paraxis train`` (issue 36,
item 5): a Llama from config (0.50B parameters by default) over data 8, two steps.

    python benchmarks/zero3_rss.py            # runs `paraxis train` itself
    python benchmarks/zero3_rss.py --activation-checkpointing full --zero-prefetch 0
    python benchmarks/zero3_rss.py --no-write
    python benchmarks/zero3_rss.py --peer fsdp2     # the same model and steps under FSDP2

The run is launched as a user launches it: ``paraxis train --config <yaml>`` with no
``MALLOC_*`` variable in the environment (they are removed), so whatever the launcher
does is what is measured. Each worker's peak resident set (``VmHWM`` in
``/proc/<pid>/status``, the kernel's high-water mark) is read every 0.2 s while it runs;
the workers are told apart by the ``RANK`` torchrun gives them. Target: every rank at
most 0.5 x the whole fp32 model + 0.7 GB (the issue's; the model state of ZeRO-3 over 8
ranks is 16/8 = 2 bytes a parameter, 0.5 of the fp32 weights, and the rest is the
runtime, the gathered layers and activations). Recomputation and ``zero_prefetch`` 0
(one unit gathered, one reduce-scatter in flight) are the least-memory config.

``--peer fsdp2`` measures torch's FSDP2 the same way, as a peer for what the config
costs: ``torchrun`` workers build the same Llama on the meta device, ``fully_shard`` the
embedding, each layer and the head (resharding after forward) and the root, prefetch one
unit each way (none at ``--zero-prefetch 0``), recompute each layer under
``--activation-checkpointing full`` (transformers' gradient checkpointing, non-reentrant),
materialize their shards (normal 0.02, norms 1), then run the same steps: one sequence
of ``--seq`` random tokens a rank, loss, backward, global-norm clipping at 1 and AdamW.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from common import machine, write_section

from paraxis.train.launcher import MALLOC_DEFAULTS

GB = 1e9


def llama_config(args: argparse.Namespace) -> dict:
    """The Llama's config fields, the same for paraxis and the FSDP2 peer."""
    return {"hidden_size": args.hidden, "intermediate_size": args.intermediate,
            "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
            "num_key_value_heads": args.heads, "vocab_size": args.vocab,
            "max_position_embeddings": args.seq, "tie_word_embeddings": False}


def config(args: argparse.Namespace, root: Path) -> dict:
    return {
        "parallelism": {"data": args.ranks, "zero": 3, "zero_prefetch": args.zero_prefetch},
        "schedule": {"activation_checkpointing": args.activation_checkpointing},
        "model": {"family": "llama", "config": llama_config(args)},
        "train": {"steps": args.steps, "global_batch": args.ranks, "seq_length": args.seq,
                  "warmup_steps": 0,
                  "log_every": 1, "checkpoint_dir": str(root / "ckpt"),
                  "checkpoint_every": 1000},
        "data": {"source": "stdlib", "tokenizer": "bytes", "max_bytes": 200_000},
        "logging": {"progress": False, "run_name": "zero3_rss", "wandb": False},
    }


def parameters(args: argparse.Namespace) -> int:
    h, i, v = args.hidden, args.intermediate, args.vocab
    layer = 4 * h * h + 3 * h * i + 2 * h
    return args.layers * layer + 2 * v * h + h


def fsdp2_worker(args: argparse.Namespace) -> None:
    """One torchrun worker of the FSDP2 peer (see the module docstring)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    cfg = AutoConfig.for_model("llama", **llama_config(args))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    if args.activation_checkpointing == "full":
        model.gradient_checkpointing_enable({"use_reentrant": False})
    elif args.activation_checkpointing != "none":
        raise SystemExit("the FSDP2 peer recomputes whole layers only (none or full)")
    units = [model.model.embed_tokens, *model.model.layers, model.lm_head]
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh)
    if args.zero_prefetch > 0:
        for i, unit in enumerate(units):
            unit.set_modules_to_forward_prefetch(units[i + 1:i + 1 + args.zero_prefetch])
            unit.set_modules_to_backward_prefetch(units[max(0, i - args.zero_prefetch):i][::-1])
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local()
            local.fill_(1.0) if "norm" in name else local.normal_(0.0, 0.02)
        rotary = model.model.rotary_emb
        inv_freq, _ = rotary.compute_default_rope_parameters(cfg)
        rotary.inv_freq.copy_(inv_freq)
        rotary.original_inv_freq.copy_(inv_freq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.ranks // dist.get_world_size(), args.seq))
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    dist.destroy_process_group()


def workers(launcher: int) -> dict[int, int]:
    """rank -> pid of the launcher's descendants that torchrun gave a RANK, or of its
    children where the workers were forked from it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = {}, [launcher]
    forked = sorted(children.get(launcher, []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
        if rank is not None and pid != launcher:
            out[rank] = pid
    # Workers forked from the launcher (paraxis.train.forked, CPU) show the launcher's
    # environment at its start in /proc, without RANK: its children, in start order.
    return out or dict(enumerate(forked))


def peak_of(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=4096)
    p.add_argument("--layers", type=int, default=26)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--activation-checkpointing", default="none",
                   choices=("none", "selective", "full"))
    p.add_argument("--zero-prefetch", type=int, default=1,
                   help="parallelism.zero_prefetch (0: the least memory)")
    p.add_argument("--peer", choices=("fsdp2",), default=None,
                   help="measure torch's FSDP2 on the same model and steps instead")
    p.add_argument("--fsdp2-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    if args.fsdp2_worker:
        fsdp2_worker(args)
        return 0
    n = parameters(args)
    bound = 0.5 * 4 * n + 0.7 * GB
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.yaml"
        path.write_text(yaml.safe_dump(config(args, Path(tmp))))
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        command = [sys.executable, "-m", "paraxis", "train", "--config", str(path)]
        if args.peer == "fsdp2":  # the same malloc thresholds as paraxis's CPU workers
            env.update(MALLOC_DEFAULTS)
            env.setdefault("OMP_NUM_THREADS", "1")
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc-per-node={args.ranks}", __file__, "--fsdp2-worker",
                       *sys.argv[1:]]
        start = time.monotonic()
        proc = subprocess.Popen(command, env=env)
        peaks: dict[int, int] = {}
        while proc.poll() is None:
            for rank, pid in workers(proc.pid).items():
                peak = peak_of(pid)
                if peak is not None:
                    peaks[rank] = max(peaks.get(rank, 0), peak)
            time.sleep(0.2)
        wall = time.monotonic() - start
    who = "torchrun (FSDP2 peer)" if args.peer else "paraxis train"
    if proc.returncode != 0 or len(peaks) != args.ranks:
        print(f"{who} exited {proc.returncode}; ranks seen: {sorted(peaks)}")
        return 1
    rows = [f"| {r} | {peaks[r] / GB:.3f} | {peaks[r] / (4 * n):.3f} |" for r in sorted(peaks)]
    worst = max(peaks.values())
    ok = worst <= bound
    ac, ahead = args.activation_checkpointing, args.zero_prefetch
    title = ("" if ac == "none" else f", activation checkpointing {ac}") + \
        ("" if ahead == 1 else f", zero_prefetch {ahead}")
    flag = ("" if ac == "none" else f" --activation-checkpointing {ac}") + \
        ("" if ahead == 1 else f" --zero-prefetch {ahead}")
    if args.peer:
        heading = f"## The FSDP2 peer of the ZeRO-3 peak RSS per rank (issue 36, item 5){title}"
        what = (f"FSDP2 over data {args.ranks} (module docstring: the same units, prefetch "
                f"{ahead}), {args.steps} steps of {args.ranks} x {args.seq} tokens, its "
                "workers started by torchrun with the MALLOC_* thresholds paraxis's "
                "launcher gives its CPU workers")
        flag += f" --peer {args.peer}"
    else:
        heading = f"## ZeRO-3 peak RSS per rank through `paraxis train` (issue 36, item 5){title}"
        what = (f"ZeRO-3 over data {args.ranks}, {args.steps} steps of {args.ranks} x "
                f"{args.seq} tokens, no MALLOC_* in the environment")
    text = "\n".join([
        heading, "",
        f"`python benchmarks/zero3_rss.py{flag}` (Llama from config: {n / 1e9:.2f}B parameters, "
        f"hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, "
        f"vocabulary {args.vocab}; whole model {4 * n / GB:.2f} GB in fp32; {what}; "
        f"{machine()}; {wall:.0f} s). Peak RSS is each "
        "worker's VmHWM (forked workers counted in start order; their pages shared with the "
        "launcher count in each).", "",
        "| rank | peak RSS (GB) | of the whole fp32 model |", "| ---: | ---: | ---: |",
        *rows, "",
        f"Worst {worst / GB:.3f} GB against the bound 0.5 x {4 * n / GB:.2f} + 0.7 = "
        f"{bound / GB:.3f} GB: {'met' if ok else 'not met'}."])
    print(text)
    if not args.no_write:
        name = "zero3_rss" + (f"_{args.peer}" if args.peer else "") + \
            ("" if ac == "none" else f"_{ac}") + ("" if ahead == 1 else f"_prefetch{ahead}")
        write_section(name, text, {"peaks": peaks, "parameters": n, "bound": bound,
                                   "wall_s": wall})
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
