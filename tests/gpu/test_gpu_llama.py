"""One training step of a ~1B Llama built from config on one GPU (``nox -s gpu``), with
its MFU printed: bf16 autocast over fp32 masters, fused AdamW, the model's own SDPA
attention. Skipped, one line, without CUDA or without the memory it needs.

MFU is model FLOPs (6N + 12·L·H·Q·T per token, PaLM appendix B: paraxis's own count)
over the device's bf16 dense peak, from the step time measured with the device drained
around each step; the engine's own ``step_time_s`` (host time, which stops before the
optimizer's kernels finish) is printed beside it. A known peak is looked up by device
name, or given as ``PARAXIS_PEAK_FLOPS``.
"""

from __future__ import annotations

import os

import pytest
import torch
from gpu_checks import needs_cuda, synchronized_seconds

import paraxis
from paraxis.engine.metrics import model_flops_per_token

# TinyLlama-1.1B's shape: 1.10e9 parameters (0.97e9 outside the embeddings).
LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
            "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000,
            "max_position_embeddings": 2048}
BATCH, SEQ, WARMUP, TIMED = 2, 2048, 2, 4
# Model state is 16 bytes a parameter (fp32 weight, gradient, two Adam moments): 17.6 GB,
# plus about 10 GB of bf16 activations at 2 x 2048 tokens.
NEEDS_BYTES = 40 * 2**30
# bf16 dense tensor-core peaks from the vendors' datasheets (FLOP/s).
PEAKS = {"H200": 989.4e12, "H100 PCIe": 756e12, "H100": 989.4e12, "A100": 312e12}


def peak_flops() -> float | None:
    if "PARAXIS_PEAK_FLOPS" in os.environ:
        return float(os.environ["PARAXIS_PEAK_FLOPS"])
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAKS.items() if key in name), None)


@needs_cuda("a training step of a 1B Llama and its MFU")
def test_one_gpu_step_of_a_1b_llama(capsys):
    free, _ = torch.cuda.mem_get_info()
    if free < NEEDS_BYTES:
        pytest.skip(f"{free / 2**30:.0f} GiB free on the GPU, the 1B step needs "
                    f"{NEEDS_BYTES / 2**30:.0f}")
    from paraxis_hf import build_causal_lm

    torch.manual_seed(0)
    with torch.device("cuda"):  # the model's own init, drawn on the GPU
        model = build_causal_lm("llama", LLAMA_1B)
    engine = paraxis.parallelize(model, train={
        "precision": "bf16", "optimizer_kwargs": {"fused": True}, "seq_length": SEQ,
        "lr": 3e-4, "warmup_steps": 0, "steps": WARMUP + TIMED})
    ids = torch.randint(0, LLAMA_1B["vocab_size"], (BATCH, SEQ),
                        generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}  # the same batch: its loss must fall
    metrics = [engine.train_step(batch) for _ in range(WARMUP)]
    drained = synchronized_seconds(lambda: metrics.append(engine.train_step(batch)), TIMED)
    per_token = model_flops_per_token(engine.model, engine.model_shape)
    params = sum(p.numel() for p in engine.model.parameters())
    engine.close()
    losses = [m["loss"] for m in metrics]
    tokens_per_s = BATCH * SEQ / drained
    achieved = tokens_per_s * per_token
    peak = peak_flops()
    mfu = achieved / peak if peak else None
    with capsys.disabled():
        print(f"\n1B Llama on {torch.cuda.get_device_name()}: {params / 1e9:.2f}e9 "
              f"parameters, {BATCH}x{SEQ} tokens a step; step {drained * 1e3:.0f} ms "
              f"drained (engine step_time_s {metrics[-1]['step_time_s'] * 1e3:.0f} ms), "
              f"{tokens_per_s:,.0f} tokens/s, {achieved / 1e12:.1f} TFLOP/s, MFU "
              + (f"{mfu:.1%} of {peak / 1e12:.0f} TFLOP/s" if mfu is not None else
                 "unknown (set PARAXIS_PEAK_FLOPS to this device's bf16 peak)")
              + f"; peak memory {metrics[-1]['peak_alloc_bytes'] / 2**30:.1f} GiB; "
              f"losses {[round(x, 3) for x in losses]}")
    assert all(map(torch.isfinite, torch.tensor(losses))) and losses[-1] < losses[0]
    assert mfu is None or 0.0 < mfu <= 1.0, "more FLOP/s than the device's peak"
