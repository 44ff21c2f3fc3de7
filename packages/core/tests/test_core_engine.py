"""The engine on a world of one (core alone): metrics, schedule, clipping, eval, trace,
and errors raised before any process group exists."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import paraxis
import paraxis.testing
from paraxis import MissingAxisPackageError, make_plugin_manager
from paraxis.models.tiny import TinyConfig, TinyTransformer

CFG = TinyConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                 intermediate_size=64, seq_length=16)
TRAIN = {"steps": 6, "lr": 1e-2, "warmup_steps": 3, "grad_clip": 0.5,
         "seq_length": CFG.seq_length, "peak_flops": 1e12}


def one_rank_run(path):
    torch.manual_seed(0)
    engine = paraxis.parallelize(TinyTransformer(CFG), train=TRAIN)
    ids = torch.randint(0, CFG.vocab_size, (4, CFG.seq_length),
                        generator=torch.Generator().manual_seed(0))
    before = engine.eval_step(ids)
    metrics = [engine.train_step(ids) for _ in range(TRAIN["steps"])]
    after = engine.eval_step(ids)
    trace = str(engine.tracer.export(f"{path}/rank0.json"))
    engine.close()
    return before, metrics, after, trace


def test_one_rank_engine_reports_metrics_and_learns(worlds, tmp_path):
    before, metrics, after, _ = worlds.run(1, one_rank_run, str(tmp_path))[0]
    assert metrics[0]["loss"] == pytest.approx(before, rel=1e-6)  # eval = train loss
    assert after < before
    assert metrics[0]["grad_norm"] > TRAIN["grad_clip"]  # so clipping was exercised
    lrs = [m["lr"] for m in metrics]
    assert lrs[:3] == pytest.approx([1e-2 / 3, 2e-2 / 3, 1e-2])  # linear warmup
    assert lrs[3] > lrs[4] > lrs[5] > 1e-3 - 1e-12  # cosine towards min_lr_ratio x peak
    last = metrics[-1]
    for key in ("loss", "tokens_per_s", "step_time_s", "exposed_comm_s", "mfu",
                "straggler_spread_s", "model_state_bytes", "peak_rss_bytes"):
        assert key in last and last[key] >= 0, key
    assert 0 < last["mfu"] < 1
    assert last["straggler_spread_s"] == 0.0


def test_clipped_norm_bounds_the_update():
    from paraxis.engine.optim import WarmupCosine

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = WarmupCosine(opt, warmup=2, total=10, min_ratio=0.1)
    factors = [sched.factor(s) for s in range(11)]
    assert factors[:2] == [0.5, 1.0] and factors[10] == pytest.approx(0.1)
    state = sched.state_dict()
    sched.step()
    sched.load_state_dict(state)
    assert sched.lr == pytest.approx(0.5)


def test_missing_axis_fails_before_any_process_group():
    pm = make_plugin_manager(load_entrypoints=False)
    with pytest.raises(MissingAxisPackageError, match="pip install paraxis-zero-shard"):
        paraxis.parallelize(TinyTransformer(CFG), data=1, zero=1, plugin_manager=pm)
    assert not dist.is_initialized()


def test_bad_degrees_fail_before_any_process_group():
    with pytest.raises(paraxis.ConfigError, match="world_size = 1: must equal"):
        paraxis.parallelize(TinyTransformer(CFG), data=2)
    assert not dist.is_initialized()


def bf16_against_fp32():
    out = []
    for bf16 in (False, True):
        torch.manual_seed(0)
        engine = paraxis.parallelize(TinyTransformer(CFG), train={**TRAIN, "bf16": bf16})
        ids = torch.randint(0, CFG.vocab_size, (4, CFG.seq_length),
                            generator=torch.Generator().manual_seed(0))
        losses = [engine.train_step(ids)["loss"] for _ in range(3)]
        dtypes = {p.dtype for p in engine.model.parameters()}
        engine.close()
        out.append((losses, dtypes))
    return out


def test_bf16_autocast_keeps_fp32_master_weights(worlds):
    (fp32, _), (bf16, dtypes) = worlds.run(1, bf16_against_fp32)[0]
    assert dtypes == {torch.float32}
    assert bf16 != fp32  # autocast really ran in bf16...
    assert bf16 == pytest.approx(fp32, rel=2e-2)  # ...and trains the same model


def recompute_run(mode):
    torch.manual_seed(0)
    engine = paraxis.parallelize(TinyTransformer(CFG), train=TRAIN,
                                 config=paraxis.ParallelConfig.from_kwargs(
                                     activation_checkpointing=mode))
    calls = {"attn": 0, "mlp": 0}
    layer = engine.model.layers[0]
    layer.attn.qkv.register_forward_hook(lambda *a: calls.__setitem__("attn", calls["attn"] + 1))
    layer.mlp.up.register_forward_hook(lambda *a: calls.__setitem__("mlp", calls["mlp"] + 1))
    ids = torch.randint(0, CFG.vocab_size, (4, CFG.seq_length),
                        generator=torch.Generator().manual_seed(0))
    losses = [engine.train_step(ids)["loss"] for _ in range(3)]
    params = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    engine.close()
    return losses, params, calls


@pytest.mark.parametrize(("mode", "attn", "mlp"), [("full", 6, 6), ("selective", 6, 3)])
def test_recomputation_changes_nothing_but_runs_forward_again(worlds, mode, attn, mlp):
    (base, base_params, base_calls), = worlds.run(1, recompute_run, "none")
    (again, params, calls), = worlds.run(1, recompute_run, mode)
    assert base_calls == {"attn": 3, "mlp": 3}
    assert calls == {"attn": attn, "mlp": mlp}  # what is recomputed ran twice
    assert again == base
    for name, p in base_params.items():
        assert torch.equal(params[name], p), name


class NoAttention(nn.Module):
    """Layers with no attention child: selective recomputation has nothing to pick."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 16)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def selective_without_attention():
    try:
        paraxis.parallelize(NoAttention(), activation_checkpointing="selective")
    except paraxis.PlanError as exc:
        return str(exc)
    return None


def test_selective_needs_an_attention_block(worlds):
    (message,) = worlds.run(1, selective_without_attention)
    assert message and "no attention block" in message


def test_the_loss_is_at_least_fp32_and_keeps_fp64():
    """Half-precision logits are upcast; float64 logits stay float64, so a float64 model
    trains in float64 end to end (the coverage matrix's exact reference)."""
    from paraxis.engine.loss import causal_lm_loss_sum

    logits = torch.randn(2, 5, 7, dtype=torch.float64)
    targets = torch.randint(0, 7, (2, 5))
    loss, count = causal_lm_loss_sum(logits, targets)
    assert loss.dtype == torch.float64 and count == 10
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1),
                                             reduction="sum")
    assert float(loss) == float(want)
    assert causal_lm_loss_sum(logits.bfloat16(), targets)[0].dtype == torch.float32
