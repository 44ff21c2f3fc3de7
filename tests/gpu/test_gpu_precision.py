"""``train.precision: bf16`` and fused AdamW on one GPU (``nox -s gpu``). Skipped, one
line each, without CUDA.

* bf16: the forward's linear layers compute in bf16 under CUDA's autocast while the
  parameters (the master weights) and their gradients stay fp32, and the per-step
  losses and gradient norms of a debug Llama follow the same run in fp32 within the
  derived bf16 tolerance (BF16_RTOL: losses and norms are means, which average the
  roundings down);
* fused AdamW (``train.optimizer_kwargs: {fused: true}``, torch's single-kernel step):
  the optimizer is fused and holds its state on the GPU, and its weights after the
  steps equal the multi-tensor (foreach) step's at the shared tolerance for weights
  after Adam (the two order the same arithmetic differently).
"""

from __future__ import annotations

import torch
from gpu_checks import needs_cuda
from torch import nn

import paraxis
from paraxis.testing.parity import local_shards, random_token_shares
from paraxis.testing.tolerance import BF16_RTOL, assert_losses_close, assert_weights_close

LR, STEPS, BATCH, SEQ = 1e-3, 6, 4, 64
RECIPE = {"steps": STEPS, "lr": LR, "warmup_steps": 2, "seq_length": SEQ}


def _engine(**train):
    from paraxis_hf import build_debug_model

    return paraxis.parallelize(build_debug_model("llama"), train={**RECIPE, **train})


def _train(engine) -> list[dict[str, float]]:
    shares = random_token_shares(engine, steps=STEPS, batch=BATCH, seq=SEQ,
                                 vocab=engine.model.config.vocab_size)
    return [engine.train_step(share) for share in shares]


@needs_cuda("bf16 autocast on CUDA")
def test_bf16_computes_in_bf16_over_fp32_masters_and_tracks_fp32():
    engine = _engine(precision="bf16")
    outputs: set[torch.dtype] = set()
    hooks = [m.register_forward_hook(lambda m, a, out: outputs.add(out.dtype))
             for m in engine.model.modules() if isinstance(m, nn.Linear)]
    bf16 = _train(engine)
    for h in hooks:
        h.remove()
    params = list(engine.model.parameters())
    assert engine.device.type == "cuda" and all(p.is_cuda for p in params)
    assert outputs == {torch.bfloat16}, outputs
    assert {p.dtype for p in params} == {torch.float32}
    engine.close()
    fp32 = _train(reference := _engine())
    reference.close()
    for key in ("loss", "grad_norm"):
        got, want = [m[key] for m in bf16], [m[key] for m in fp32]
        worst = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
        print(f"bf16 against fp32 on CUDA, {key}: worst relative difference {worst:.2e}")
        assert_losses_close(got, want, f"per-step {key}", rtol=BF16_RTOL)


@needs_cuda("fused AdamW on CUDA")
def test_fused_adamw_steps_as_the_foreach_step():
    runs = {}
    for kind in ("fused", "foreach"):
        torch.manual_seed(0)
        engine = _engine(optimizer_kwargs={kind: True})
        assert engine.optimizer.defaults[kind] is True
        _train(engine)
        state = next(iter(engine.optimizer.state.values()))
        assert state["exp_avg"].is_cuda
        runs[kind] = local_shards(engine.model)
        engine.close()
    for name, (weight, _) in runs["foreach"].items():
        assert_weights_close(runs["fused"][name][0], weight, lr=LR, steps=STEPS, what=name)
