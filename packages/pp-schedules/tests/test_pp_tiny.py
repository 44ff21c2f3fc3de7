"""Pipeline parallelism on core's own tiny model (no transformers): every schedule and
recomputation against one process (the first step's gradients parameter by parameter,
per-step losses, final weights), at the shared tolerance. This is what
``nox -s tests_isolated`` runs with only core and this package installed."""

import pytest
import torch
import torch.distributed as dist

import paraxis
from paraxis import ParallelConfig
from paraxis.config.parallel import V_SCHEDULES
from paraxis.models.tiny import TinyConfig, TinyTransformer
from paraxis.testing.parity import (
    assert_same_gradients,
    assert_same_weights,
    local_gradients,
    local_shards,
)
from paraxis.testing.tolerance import assert_losses_close

CFG = TinyConfig(vocab_size=61, hidden_size=32, num_layers=4, num_heads=4,
                 intermediate_size=64, seq_length=16)
STEPS, BATCH, LR = 6, 8, 1e-3


def train(options):
    torch.manual_seed(0)
    pipeline = dist.get_world_size()
    config = ParallelConfig.from_kwargs(pipeline=pipeline, microbatches=4, **options)
    engine = paraxis.parallelize(TinyTransformer(CFG), config=config,
                                 train={"steps": STEPS, "lr": LR, "warmup_steps": 2,
                                        "seq_length": CFG.seq_length})
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_length), generator=g)
               for _ in range(STEPS)]
    grads = local_gradients(engine, batches[0])
    losses = [engine.train_step(ids)["loss"] for ids in batches]
    shards = local_shards(engine.model)
    engine.close()
    return losses, shards, grads


@pytest.fixture(scope="module")
def reference(worlds):
    return worlds.run(1, train, {})[0]


@pytest.mark.parametrize("options", [
    {"pipeline_schedule": "gpipe"},
    {"pipeline_schedule": "1f1b"},
    {"pipeline_schedule": "zero_bubble_h1"},
    {"pipeline_schedule": "interleaved_1f1b", "virtual_stages": 2},
    {"pipeline_schedule": "zbv", "virtual_stages": 2},
    {"pipeline_schedule": "dualpipev", "virtual_stages": 2},
    {"activation_checkpointing": "full"},
    {"activation_checkpointing": "selective", "pipeline_schedule": "zero_bubble_h1"},
    # whole and split backwards of one chunk, each recomputing its own kind of forward
    {"activation_checkpointing": "full", "pipeline_schedule": "dualpipev",
     "virtual_stages": 2},
], ids=lambda o: "-".join(str(v) for v in o.values()))
def test_tiny_pipeline_matches_one_process(worlds, reference, options):
    ref_losses, ref_shards, ref_grads = reference
    out = worlds.run(2, train, options)
    assert_same_gradients([g for *_, g in out], ref_grads)
    for losses, *_ in out:
        assert_losses_close(losses, ref_losses)
    assert_same_weights([s for _, s, _ in out], ref_shards, lr=LR, steps=STEPS)


def summarize(schedule="1f1b"):
    """The run's end as the trainer asks for it: the axes' ``paraxis_summarize_run``."""
    torch.manual_seed(0)
    engine = paraxis.parallelize(TinyTransformer(CFG), pipeline=2, microbatches=4,
                                 pipeline_schedule=schedule,
                                 virtual_stages=2 if schedule in V_SCHEDULES else 1,
                                 train={"steps": 2, "lr": LR, "seq_length": CFG.seq_length})
    engine.train_step(torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_length)))
    reports = [r for r in paraxis.make_plugin_manager().hook.paraxis_summarize_run(
        ctx=engine.ctx, history=[]) if r is not None]
    engine.close()
    return [(r.figures, r.text) for r in reports]


def test_the_run_summary_has_the_measured_timeline(worlds):
    """pp-schedules' ``paraxis_summarize_run`` gives the trainer the last step's measured
    timeline (an SVG with a row per stage) and its bubble against theory, on every
    stage (the hook is collective over the pipeline group); the bubble its passes make
    alone (replayed on their own durations with nothing between them) is no larger."""
    for reports in worlds.run(2, summarize, "1f1b"):
        ((figures, text),) = reports
        ((name, svg),) = figures
        assert name == "pipeline_timeline" and svg.lstrip().startswith("<svg")
        assert "stage 0" in text[0] and "stage 1" in text[0]
        assert text[0].startswith("pipeline 1f1b: measured bubble 0.")
        measured = float(text[0].split("measured bubble ")[1].split(" ")[0])
        alone = float(text[0].split("its passes alone ")[1].split(")")[0])
        assert " of it, its passes alone " in text[0]  # the point-to-point part
        assert 0.0 < alone <= measured  # replayed with nothing between the passes
        assert "theory 0.200 (p=2, m=4, v=1)" in text[0]


def _stage_columns(line):
    """{stage: {column: ms}} from the summary line's "stage r: F 1.2 ms, ..." parts."""
    out = {}
    for part in line.split("; ")[1:]:
        stage, cols = part.split(": ")
        out[stage] = {c.rsplit(" ", 2)[0]: float(c.rsplit(" ", 2)[1]) for c in cols.split(", ")}
    return out


@pytest.mark.parametrize(("schedule", "columns"), [
    # One backward pass computes both gradients: no W column anywhere.
    # Every rank sends and receives: the part of its idle time spent handing messages
    # over is measured (p2p).
    ("1f1b", {"stage 0": {"F", "B+W", "idle", "p2p"}, "stage 1": {"F", "B+W", "idle", "p2p"}}),
    # Split: the tiny model's stage 0 holds a learned position table, which keeps
    # torch's split (no deferred weight GEMMs): no input gradient to send, its whole
    # backward runs at W; it printed "B 0 ms" (issue 32). The last stage measures I and
    # W apart.
    ("zero_bubble_h1", {"stage 0": {"F", "B+W", "idle", "p2p"},
                        "stage 1": {"F", "I", "W", "idle", "p2p"}}),
    # A V: rank 0 holds stage 0 (whole backwards at W) and the last stage (I and W apart).
    ("zbv", {"rank 0 (stages 0, 3)": {"F", "I", "W", "B+W", "idle", "p2p"},
             "rank 1 (stages 1, 2)": {"F", "I", "W", "idle", "p2p"}}),
    # DualPipeV runs whole backwards (B) beside the split ones of its drain.
    ("dualpipev", {"rank 0 (stages 0, 3)": {"F", "I", "W", "B+W", "idle", "p2p"},
                   "rank 1 (stages 1, 2)": {"F", "I", "W", "B+W", "idle", "p2p"}}),
])
def test_the_stage_times_name_only_passes_that_were_measured(worlds, schedule, columns):
    (((_, (line,)),), _) = worlds.run(2, summarize, schedule)
    measured = _stage_columns(line)
    assert {s: set(c) for s, c in measured.items()} == columns, line
    for stage, cols in measured.items():
        assert all(ms > 0 for k, ms in cols.items() if k != "idle"), (stage, line)
        assert cols["p2p"] <= cols["idle"], (stage, line)  # handing over lies between actions


def _receives(schedule: str):
    """Per rank over one step: (receives from another rank, those already posted when
    their action asked, most posts of one message)."""
    torch.manual_seed(0)
    engine = paraxis.parallelize(TinyTransformer(CFG), pipeline=2, microbatches=4,
                                 pipeline_schedule=schedule,
                                 virtual_stages=2 if schedule in V_SCHEDULES else 1,
                                 train={"steps": 2, "lr": LR, "seq_length": CFG.seq_length})
    mail = engine.ctx.forward_backward.mail
    posts: dict[tuple, int] = {}
    counts = {"received": 0, "ahead": 0}
    post, recv = mail.post, mail.recv

    def counted_post(shape, stage, kind, mb, src_stage):
        before = len(mail._posted)  # a receive actually posted adds one
        post(shape, stage, kind, mb, src_stage)
        if len(mail._posted) > before:
            posts[(kind, mb, src_stage)] = posts.get((kind, mb, src_stage), 0) + 1

    def counted_recv(shape, stage, kind, mb, src_stage):
        if not mail.here(stage):
            counts["received"] += 1
            counts["ahead"] += (kind, mb, src_stage) in posts
        return recv(shape, stage, kind, mb, src_stage)

    mail.post, mail.recv = counted_post, counted_recv
    engine.train_step(torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_length)))
    engine.close()
    return counts["received"], counts["ahead"], max(posts.values())


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_every_receive_is_posted_once_before_its_action_asks(worlds, schedule):
    """Host tensors: the runner posts each message's receive once, before the action that
    needs it (posted when asked, gloo hands a message over only then: the action waits
    for the hand-over)."""
    for received, ahead, most in worlds.run(2, _receives, schedule):
        assert received > 0 and ahead == received and most == 1
