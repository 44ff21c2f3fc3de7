"""Operating a run as a batch job would (issue 38): ``paraxis train ... > run.log`` shows
its steps in the file while it trains, keeps ``metrics.jsonl`` and profiles chosen steps
on every rank; a resume onto another layout says in one line what it took over, a run
cut by ``train.exit_after_steps`` how to resume, and a library's warning is one line."""

import collections
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP = re.compile(r"^step\s+(\d+)/\d+  loss (\d+\.\d+)", re.M)


def env():
    out = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "PARAXIS_LOCK_HELD"):
        out.pop(var, None)
    return out


def paraxis(config, *overrides):
    return [sys.executable, "-m", "paraxis", "train", "--config", str(ROOT / config),
            *overrides]


TINY = ["model.config.hidden_size=32", "model.config.num_layers=2",
        "model.config.intermediate_size=64", "train.seq_length=32", "train.global_batch=8",
        "train.warmup_steps=2", "data.max_bytes=200000", "logging.wandb=false"]


def test_a_redirected_run_shows_its_steps_while_it_trains_and_profiles_every_rank(tmp_path):
    ckpt, log = tmp_path / "ckpt", tmp_path / "run.log"
    with log.open("w") as out, (tmp_path / "err.log").open("w") as err:
        proc = subprocess.Popen(
            paraxis("examples/tiny.yaml", *TINY, "train.steps=5000", "train.log_every=2",
                    f"train.checkpoint_dir={ckpt}",
                    "train.profile={start: 2, steps: 2, memory: true}",
                    "logging.progress=true"),  # the default (tiny.yaml turns it off)
            stdout=out, stderr=err, env=env(), start_new_session=True)
        deadline, seen = time.monotonic() + 180, []
        while len(seen) < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
            seen = STEP.findall(log.read_text())
        running = proc.poll() is None
        if running:
            os.kill(proc.pid, signal.SIGINT)  # stop it at a step, with a checkpoint
        proc.wait(timeout=120)
    text = log.read_text()
    assert running and len(seen) >= 3, text[-2000:] + (tmp_path / "err.log").read_text()
    steps = [int(s) for s, _ in STEP.findall(text)]
    assert steps == list(range(2, 2 * len(steps) + 1, 2))  # one line per log_every steps
    assert "\x1b[" not in text  # plain lines: no progress bar off a terminal
    # metrics.jsonl in the checkpoint directory: every logged step, every metric
    rows = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], f"{r['loss']:.4f}") for r in rows] == [
        (int(s), loss) for s, loss in STEP.findall(text)]
    assert {"lr", "grad_norm", "tokens_per_s", "exposed_comm_s", "comm/replicas_bytes",
            "comm/world_exposed_s"} <= set(rows[0])
    # train.profile: a trace per rank, Chrome's format, torch's events and paraxis's spans
    for rank in (0, 1):
        trace = json.loads((ckpt / f"profile/rank0000{rank}.steps2-3.trace.json").read_text())
        names = collections.Counter(e.get("name") for e in trace["traceEvents"])
        assert {"ProfilerStep#2", "ProfilerStep#3", "paraxis/forward", "paraxis/backward",
                "paraxis/optimizer", "paraxis/metrics_gather"} <= set(names), names
        assert any(str(n).startswith("aten::") for n in names)
        assert all({"ph", "name"} <= set(e) for e in trace["traceEvents"])
        top = (ckpt / f"profile/rank0000{rank}.steps2-3.tracemalloc.txt").read_text()
        assert top.startswith(f"# rank {rank}, steps 2-3")
    assert "profile written in" in text


LLAMA = ["model.config.hidden_size=32", "model.config.intermediate_size=64",
         "model.config.num_hidden_layers=2", "model.config.max_position_embeddings=32",
         "train.seq_length=32", "train.global_batch=8", "train.warmup_steps=2",
         "train.log_every=1", "data.max_bytes=200000", "logging.wandb=false",
         "train.steps=6"]


def test_a_resume_onto_another_layout_says_what_it_took_over(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()  # a lock left by a run that died: the launcher's own warning, one line
    (ckpt / ".paraxis.lock").write_text(json.dumps({"pid": 1, "host": "gone"}))
    first = subprocess.run(paraxis("examples/default.yaml", *LLAMA, "train.exit_after_steps=3",
                                   f"train.checkpoint_dir={ckpt}"),  # data 2 x tensor 2
                           capture_output=True, text=True, env=env(), timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert [w for w in first.stderr.splitlines() if "Warning" in w] == [
        f"warning: UserWarning: taking over the lock of {ckpt} from pid 1 on gone, which is "
        "no longer running"], first.stderr[-3000:]
    resume = re.findall(r"^stopped by train.exit_after_steps = 3 after step 3: checkpoint "
                        rf"{ckpt}/step-00000003 written; resume with: paraxis train --config "
                        r".*train.exit_after_steps=3.*$", first.stdout, re.M)
    assert len(resume) == 1, first.stdout[-3000:]
    again = subprocess.run(paraxis("examples/default.yaml", *LLAMA, "parallelism.pipeline=2",
                                   "parallelism.tensor=1", f"train.checkpoint_dir={ckpt}"),
                           capture_output=True, text=True, env=env(), timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    line = re.findall(rf"^resumed from {ckpt}/step-00000003 at step 3: written on data 2 x "
                      r"tensor 2, read onto pipeline 2 x data 2; data at sample 24 \(epoch 1, "
                      r"batch 4 of \d+\); lr schedule as saved \(cosine to step 6\): lr "
                      r"\d\.\d\de-\d\d at step 3$", again.stdout, re.M)
    assert len(line) == 1, again.stdout[-3000:]
    assert [int(s) for s, _ in STEP.findall(again.stdout)] == [4, 5, 6]
    # The pipeline's warning about a model on the meta device: once, one line, no path.
    warned = [w for w in again.stderr.splitlines() if "Warning" in w]
    assert warned == ["warning: UserWarning: LlamaForCausalLM is on the meta device: the "
                      "pipeline stages are not checked against its own forward"], warned
