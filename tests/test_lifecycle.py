"""Runs that survive: ``paraxis train`` stopped by a signal, killed outright, restarted
after a dead rank, and launched as two nodes, each as a user would run it.

Every run is the tiny model on the standard library's bytes, 2 CPU ranks, so the
processes are real (torchrun's agent in the launcher, workers in their own sessions).
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paraxis.runtime.world import free_port

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "examples/tiny.yaml")
SMALL = ["model.config.hidden_size=32", "model.config.num_layers=2",
         "model.config.intermediate_size=64", "train.seq_length=32", "train.global_batch=8",
         "train.warmup_steps=2", "train.log_every=1", "data.max_bytes=200000",
         "logging.wandb=false", "logging.progress=false"]


def env():
    out = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "PARAXIS_LOCK_HELD"):
        out.pop(var, None)
    return out


def start(ckpt, *extra, steps=400, job=None):
    return subprocess.Popen(
        [sys.executable, "-m", "paraxis", "train", "--config", CONFIG, *SMALL,
         f"train.steps={steps}", f"train.checkpoint_dir={ckpt}", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**env(), **(job or {})}, start_new_session=True)


def run(ckpt, *extra, steps=12, timeout=240):
    proc = start(ckpt, *extra, steps=steps)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def wait_for_step(proc, step, timeout=120):
    """Read the launcher's stdout until a worker has logged ``step``."""
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        seen.append(line)
        match = re.match(r"step\s+(\d+)/", line)
        if match and int(match.group(1)) >= step:
            return "".join(seen)
    raise AssertionError("no progress:\n" + "".join(seen[-20:]))


def workers_of(ckpt):
    """PIDs of live processes whose command line names this checkpoint directory."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if f"train.checkpoint_dir={ckpt}" in cmd and int(entry.name) != os.getpid():
                pids.append(int(entry.name))
    return pids


def losses(out):
    return [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_every_rank_at_a_step_and_saves(tmp_path, sig):
    ckpt = tmp_path / "ckpt"
    proc = start(ckpt)
    wait_for_step(proc, 3)
    os.kill(proc.pid, sig)  # the launcher; torchrun forwards it to the workers
    out, err = proc.communicate(timeout=120)
    stops = re.findall(r"stopped by a signal after step (\d+): checkpoint (\S+) written; "
                       r"resume with: paraxis train", out)
    assert len(stops) == 1, out[-2000:] + err[-2000:]
    step = int(stops[0][0])
    assert (ckpt / "latest").read_text().strip() == f"step-{step:08d}"
    assert "Traceback" not in err, err[-3000:]
    code, again, err = run(ckpt, steps=step + 2)
    assert code == 0, err[-3000:]
    assert re.findall(r"step\s+(\d+)/", again) == [str(step + 1), str(step + 2)]


def test_one_writer_per_directory_and_no_orphans(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = start(ckpt)
    wait_for_step(first, 2)
    code, _, err = run(ckpt)
    assert code == 1 and "is in use by another run" in err, err[-2000:]
    assert f"pid {first.pid}" in err
    assert workers_of(ckpt), "the first run's workers should be running"
    os.kill(first.pid, signal.SIGKILL)  # the launcher dies without any cleanup
    first.communicate(timeout=30)
    deadline = time.monotonic() + 15
    while workers_of(ckpt) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not workers_of(ckpt), "workers outlived their launcher"
    code, _, err = run(ckpt, steps=12)
    assert code == 0 and "taking over the lock" in err, err[-2000:]


def test_a_dead_rank_restarts_and_finishes_like_an_uninterrupted_run(tmp_path):
    straight = losses(run(tmp_path / "straight", steps=14)[1])
    ckpt = tmp_path / "ckpt"
    proc = start(ckpt, "train.checkpoint_every=4", "--max-restarts", "1", steps=14)
    wait_for_step(proc, 6)
    victim = max(p for p in workers_of(ckpt) if p != proc.pid)
    os.kill(victim, signal.SIGKILL)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    assert losses(out)[-1] == straight[-1]  # resumed from step 4 or 8, exactly
    assert len(straight) == 14


def test_two_nodes_on_one_machine(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    one = run(tmp_path / "one", "parallelism.data=2", steps=6)
    shared = tmp_path / "shared"  # one checkpoint directory, as on a shared filesystem
    nodes = [start(shared, "--nnodes", "2", "--node-rank", str(r),
                   "--rdzv-endpoint", endpoint, steps=6) for r in range(2)]
    outs = [p.communicate(timeout=240) for p in nodes]
    assert all(p.returncode == 0 for p in nodes), [e[-2000:] for _, e in outs]
    both = "".join(o for o, _ in outs)
    assert losses(both) == losses(one[1])  # the same 2-rank run, over two "nodes"
    # As srun starts them: no launch arguments, the job's environment only (node count,
    # node id, job id; the rendezvous on the node list's first host).
    job = {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "127.0.0.1", "MASTER_PORT": str(free_port())}
    nodes = [start(tmp_path / "slurm", steps=6, job={**job, "SLURM_NODEID": str(r)})
             for r in range(2)]
    outs = [p.communicate(timeout=240) for p in nodes]
    assert all(p.returncode == 0 for p in nodes), [e[-2000:] for _, e in outs]
    assert losses("".join(o for o, _ in outs)) == losses(one[1])


def test_an_error_every_rank_meets_is_said_once(tmp_path):
    """A damaged checkpoint (every rank would read the index): one line naming the file,
    no traceback per rank, exit code 1; since issue 38 it is found before any rank
    starts (paraxis.cli.prelaunch reads the index to check it against the model)."""
    ckpt = tmp_path / "ckpt"
    assert run(ckpt, steps=2)[0] == 0
    (ckpt / "step-00000002" / "index.json").write_text('{"trunc')
    code, _, err = run(ckpt, steps=4)
    said = err.strip().splitlines()
    assert code == 1 and len(said) == 1, err[-3000:]
    assert f"{ckpt}/step-00000002/index.json is corrupted" in said[0]
    assert "Traceback" not in err


def test_a_rank_killed_outright_is_named_with_its_memory(tmp_path):
    """SIGKILL (what the kernel's out-of-memory killer sends) leaves no traceback: the
    launcher names the rank, the likely cause and its last recorded memory and step."""
    ckpt = tmp_path / "ckpt"
    proc = start(ckpt)
    wait_for_step(proc, 3)
    victim = max(p for p in workers_of(ckpt) if p != proc.pid)
    os.kill(victim, signal.SIGKILL)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 1
    assert re.search(r"paraxis: rank \d was killed by SIGKILL, most likely by the kernel's "
                     r"out-of-memory killer .*peak resident memory was \d+\.\d\d GiB after "
                     r"step \d+", err), err[-3000:]
