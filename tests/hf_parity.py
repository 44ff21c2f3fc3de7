"""One parity run for the cross-package tests: a debug-sized Hugging Face family trained
on random tokens under some degrees, against the same model in one process.

The first step's gradients (parameter by parameter, gathered through the placements; a
router loss's included, as a step back-propagates it), per-step losses and gradient
norms, an evaluation loss and the gathered final weights must agree at the shared
tolerances (paraxis.testing.tolerance), derived from the run's ``train.precision``;
DeepSeek-V3's correction biases, under ``moe.bias_update_rate``, must equal one process's
after every step. Functions here run on the ranks of the ``worlds`` fixture (spawned
workers import this module by name).
"""

from __future__ import annotations

import math

import torch

import paraxis
from paraxis import ParallelConfig
from paraxis.testing.parity import (
    assemble,
    assert_same_gradients,
    assert_same_sgd_weights,
    assert_same_weights,
    local_gradients,
    local_shards,
)
from paraxis.testing.tolerance import (
    assert_losses_close,
    gradient_errors,
    loss_rtol,
    precision_rtol,
    sgd_weight_errors,
)
from paraxis_hf import build_debug_model

LR, BATCH, SEQ = 1e-3, 8, 16
IGNORED = 9  # labels of sample 0 set to -100 (see train)
# The groups over the data axis (issue 38's metric names; HSDP's data_shard x ... and
# data_replica keep their keys).
DATA_SIDE = ("comm/data", "comm/replicas", "comm/expert_replicas", "comm/sequence_shards")
_REFERENCES: dict[tuple, tuple] = {}
_STARTS: dict[tuple, tuple] = {}


def reference_order(count, microbatches, batch=BATCH):
    """A sample order for the one-process reference under gradient accumulation: its
    microbatch ``i`` holds every sample shard's microbatch ``i`` (``count`` shards of the
    global batch, cut into ``microbatches`` each). The language-model loss is a sum over
    tokens, so order never mattered to it; a router's load-balancing loss is computed
    per forward, as transformers computes it per call, so the reference must run the
    same microbatches as the parallel run's global ones."""
    per = batch // count
    size = per // microbatches
    return [r * per + i * size + j for i in range(microbatches) for r in range(count)
            for j in range(size)]


def with_lora(model, lora):
    """``model`` wrapped by peft's LoRA (``lora``: LoraConfig's arguments), A and B both
    drawn from one seed: peft's zero B would leave every A's first gradient zero, and the
    comparison would check nothing there. Every run starts from the same adapters."""
    from peft import LoraConfig, get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        return get_peft_model(model, LoraConfig(init_lora_weights=False, **lora))


def train(family, degrees, overrides, steps, options, order=None, seq=SEQ, batch=BATCH,
          recipe=None, lora=None):
    """Train ``steps`` steps of ``batch`` sequences of ``seq`` tokens; returns per-step
    (loss, grad_norm, router loss or None, correction biases or None, model-state bytes
    or None, data-axis bytes), an eval loss and shards. ``order`` permutes each global
    batch's samples first; ``recipe`` adds to the train section (precision, optimizer),
    and the first step's gradients are taken in its precision; ``lora`` (LoraConfig's
    arguments) trains the model's peft LoRA adapters instead (:func:`with_lora`)."""
    config = ParallelConfig.from_kwargs(**degrees, **options)
    model = build_debug_model(family, **overrides)
    vocab = model.config.vocab_size
    if lora is not None:
        model = with_lora(model, lora)
    recipe = recipe or {}
    engine = paraxis.parallelize(model, config=config, train={
        "steps": steps, "lr": LR, "warmup_steps": 2, "seq_length": seq, **recipe})
    index, count = engine.grid.sample_shard()
    part = slice(index * batch // count, (index + 1) * batch // count)
    g = torch.Generator().manual_seed(3)
    history, grads = [], None
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        labels = ids.clone()
        labels[0, :IGNORED] = -100  # uneven token counts over the data ranks
        if order is not None:
            ids, labels = ids[order], labels[order]
        share = {"input_ids": ids[part], "labels": labels[part]}
        if grads is None:  # the first batch's gradients, before any step
            grads = local_gradients(engine, share, in_precision="precision" in recipe)
        if recipe.get("compile") and not history:  # what compiled is the layers
            assert engine.ctx.extras["compile"].endswith("layers"), engine.ctx.extras
        m = engine.train_step(share)
        data_bytes = sum(v for k, v in m.items()  # the groups over the data axis
                         if k.startswith(DATA_SIDE) and k.endswith("_bytes"))
        history.append((m["loss"], m["grad_norm"], m.get("moe/aux_loss"), _biases(engine),
                        m.get("model_state_bytes"), data_bytes))
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(4))
    eval_loss = engine.eval_step(ids[part])
    shards = local_shards(engine.model)
    engine.close()
    return history, eval_loss, shards, grads


def compare(worlds, family, degrees, *, overrides=None, steps=8, seq=SEQ, batch=BATCH,
            recipe=None, rtol=None, lora=None, worker=None, **options):
    """Run ``degrees`` and one process on ``family`` (``batch`` sequences of ``seq``
    tokens per step), both with ``recipe`` (train options); assert parity; return the
    runs.

    The reference runs the same microbatches (see :func:`reference_order`) and the same
    ``moe`` section; a router loss, when the model has one, is compared per step too.
    Tolerances follow ``train.precision`` (:func:`tolerances`) unless ``rtol`` is given
    for every check. Weights are compared after fp32 Adam steps, and after SGD steps
    (``optimizer: sgd``) in any precision, relative to how far they moved; a ``compile``
    in the recipe applies to the parallel run only (the reference is eager). ``lora``
    (LoraConfig's arguments) runs both sides on the same peft LoRA model: the gradients
    compared are the adapters' (what the optimizer steps), the weights all of them (the
    frozen ones must not move). ``worker`` runs the parallel side instead of
    :func:`train` (same arguments): a planted bug's."""
    recipe = recipe or {}
    reference_recipe = {k: v for k, v in recipe.items() if k != "compile"}
    overrides = overrides or {}
    single = {k: v for k, v in options.items()
              if k in ("activation_checkpointing", "microbatches", "moe")}
    config = ParallelConfig.from_kwargs(**degrees, **options)
    order = reference_order(config.sample_shards, config.schedule.microbatches, batch)
    order = None if order == sorted(order) else order
    key = (family, repr(sorted(overrides.items())), steps, repr(sorted(single.items())),
           repr(order), seq, batch, repr(sorted(reference_recipe.items())),
           repr(sorted((lora or {}).items())))
    if key not in _REFERENCES:  # layouts sharing a reference run it once per session
        _REFERENCES[key] = worlds.run(1, train, family, {}, overrides, steps, single,
                                      order, seq, batch, reference_recipe, lora)[0]
    ref_history, ref_eval, ref_shards, ref_grads = _REFERENCES[key]
    out = worlds.run(config.world_size, worker or train, family, degrees, overrides, steps,
                     options, None, seq, batch, recipe, lora)
    precision = recipe.get("precision", "fp32")
    sgd = recipe.get("optimizer") == "sgd"
    initial, logit_rms, tokens = (_start(family, overrides, seq, batch)
                                  if sgd or precision != "fp32" else (None, 0.0, 0))
    grad_rtol, lrtol = tolerances(precision, rtol, logit_rms=logit_rms, tokens=tokens,
                                  loss=ref_history[0][0])
    _report(family, degrees, options, out, _REFERENCES[key], initial if sgd else None,
            steps=steps, grad_rtol=grad_rtol, loss_rtol=lrtol)
    assert_same_gradients([g for *_, g in out], ref_grads, rtol=grad_rtol)
    if ref_history[0][3] is not None:  # routing state first: the losses follow from it
        _assert_same_biases([history for history, *_ in out], ref_history)
    for history, eval_loss, _, _ in out:
        assert_losses_close([h[0] for h in history], [h[0] for h in ref_history], rtol=lrtol)
        assert_losses_close([h[1] for h in history], [h[1] for h in ref_history],
                            "gradient norms", rtol=grad_rtol)
        if ref_history[0][2] is not None:
            assert_losses_close([h[2] for h in history], [h[2] for h in ref_history],
                                "router load-balancing losses", rtol=grad_rtol)
        assert_losses_close([eval_loss], [ref_eval], "evaluation loss", rtol=lrtol)
    if sgd:
        assert_same_sgd_weights([s for _, _, s, _ in out], ref_shards, initial,
                                rtol=grad_rtol, steps=steps)
    elif precision == "fp32":
        assert_same_weights([s for _, _, s, _ in out], ref_shards, lr=LR, steps=steps)
    return out


def tolerances(precision, rtol=None, *, logit_rms, tokens, loss):
    """(per-parameter gradients, gradient norms, router losses and SGD weights; losses)
    for a run in ``precision`` (paraxis.testing.tolerance: :func:`precision_rtol`,
    :func:`loss_rtol`), or ``rtol`` for both where a test gives one."""
    if rtol is not None:
        return rtol, rtol
    return precision_rtol(precision), loss_rtol(precision, logit_rms=logit_rms, loss=loss,
                                                tokens=tokens)


def _start(family, overrides, seq, batch):
    """What every run of ``family`` starts from, built here as one process builds it:
    the initial weights by global name (an SGD step's displacement is measured from
    them), the rms of the logits of the first batch (the low-precision loss tolerance
    scales with it) and that batch's scoring tokens. Cached per session."""
    key = (family, repr(sorted(overrides.items())), seq, batch)
    if key not in _STARTS:
        with torch.random.fork_rng(devices=[]):  # the build seeds torch's generator
            model = build_debug_model(family, **overrides)
        ids = torch.randint(0, model.config.vocab_size, (batch, seq),
                            generator=torch.Generator().manual_seed(3))  # train's first
        with torch.no_grad():
            logits = model(ids).logits
        tokens = batch * (seq - 1) - (IGNORED - 1)  # targets are the next tokens
        initial = {name: p.detach().clone() for name, p in model.named_parameters()}
        _STARTS[key] = initial, float(logits.double().pow(2).mean().sqrt()), tokens
    return _STARTS[key]


def _report(family, degrees, options, out, reference, initial, *, steps, grad_rtol,
            loss_rtol):
    """Print the worst differences against what is allowed (``pytest -s``)."""
    ref_history, _, ref_shards, ref_grads = reference
    parts = [f"{what} {_worst(out, ref_history, i):.1e}" for i, what in
             enumerate(("loss", "grad norm", "router loss")) if ref_history[0][i] is not None]
    got, want = _common(assemble([g for *_, g in out]), assemble([ref_grads]))
    grads = gradient_errors(got, want)
    name = max(grads, key=grads.get)
    parts.append(f"first-step gradient {grads[name]:.1e} ({name})")
    if initial is not None:
        got, want = _common(assemble([s for _, _, s, _ in out]), assemble([ref_shards]),
                            initial)
        shares = sgd_weight_errors(got, want, initial, rtol=grad_rtol, steps=steps)
        name = max(shares, key=shares.get)
        parts.append(f"weights {shares[name]:.2f} of their bound ({name})")
    print(f"{family} {degrees} {options}: worst relative difference over {steps} steps "
          + ", ".join(parts) + f"; allowed: loss {loss_rtol:.1e}, gradients {grad_rtol:.1e}")


def _common(got, want, initial=None):
    """The parameters every side holds (the assertions after the report name others)."""
    held = got.keys() & (initial.keys() if initial is not None else got.keys())
    return got, {name: w for name, w in want.items() if name in held}


def _worst(out, reference, i):
    # A reference of exactly 0 (Nemotron-H's router loss: its MoE adds none) is matched
    # only by 0, as assert_losses_close (atol 0) holds it.
    return max(abs(h[i] - r[i]) / abs(r[i]) if r[i] else
               (math.inf if h[i] != r[i] else 0.0)
               for history, *_ in out for h, r in zip(history, reference, strict=True))


def _biases(engine):
    """This rank's DeepSeek-V3 correction biases by block (a stage holds its own), when
    ``moe.bias_update_rate`` updates them; else None."""
    expert = engine.ctx.extras.get("expert")
    balancer = getattr(expert, "balancer", None)
    if balancer is None:
        return None
    return {name: bias.detach().clone() for name, bias in balancer.biases.items()}


def _assert_same_biases(histories, reference):
    """Every step's biases equal one process's exactly: they move by the sign of the
    global load, integer counts reduced exactly, so any difference is a routing or a
    reduction that differs. Every block is held by some rank."""
    held = set()
    for history in histories:
        for step, (h, r) in enumerate(zip(history, reference, strict=True)):
            assert h[3].keys() <= r[3].keys(), sorted(h[3].keys() - r[3].keys())
            held |= h[3].keys()
            for name, bias in h[3].items():
                assert torch.equal(bias, r[3][name]), (
                    f"step {step}: {name}'s correction bias {bias.tolist()} differs from "
                    f"one process's {r[3][name].tolist()}")
    assert held == reference[0][3].keys(), sorted(reference[0][3].keys() - held)
    assert any(b.abs().max() > 0 for b in reference[-1][3].values()), "the biases moved"
