"""The launcher's arguments, without processes: SLURM's environment read into torchrun's
rendezvous, node lists expanded, and the batch script ``--print-sbatch`` writes."""

import argparse

import pytest

from paraxis.config.errors import ConfigError
from paraxis.train.launcher import (
    MALLOC_DEFAULTS,
    LaunchOptions,
    add_launch_arguments,
    sbatch_script,
    slurm_hosts,
    torchrun_args,
    worker_environment,
)


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_launch_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(("nodelist", "hosts"), [
    ("localhost", ["localhost"]),
    ("a,b", ["a", "b"]),
    ("gpu[01-03,7],login", ["gpu01", "gpu02", "gpu03", "gpu7", "login"]),
    ("node-[9-11]-ib", ["node-9-ib", "node-10-ib", "node-11-ib"]),
])
def test_slurm_node_lists_expand_like_scontrol(nodelist, hosts):
    assert slurm_hosts(nodelist) == hosts


def test_a_slurm_job_gives_nodes_rank_id_and_the_first_host_as_rendezvous():
    env = {"SLURM_JOB_NUM_NODES": "4", "SLURM_NODEID": "2", "SLURM_JOB_ID": "81",
           "SLURM_JOB_NODELIST": "gpu[07-10]"}
    opts = LaunchOptions.from_args(parse(), env)
    assert opts == LaunchOptions(4, 2, "gpu07:29500", "81", 0)
    assert "--rdzv-endpoint=gpu07:29500" in torchrun_args(32, opts, ["train"])
    assert "--nproc-per-node=8" in torchrun_args(32, opts, ["train"])
    # MASTER_ADDR / MASTER_PORT and explicit arguments win.
    opts = LaunchOptions.from_args(parse(), {**env, "MASTER_ADDR": "h", "MASTER_PORT": "7"})
    assert opts.rdzv_endpoint == "h:7"
    assert LaunchOptions.from_args(parse("--node-rank", "0"), env).node_rank == 0


def test_several_nodes_without_a_rendezvous_are_refused():
    with pytest.raises(ConfigError, match="--rdzv-endpoint"):
        LaunchOptions.from_args(parse("--nnodes", "2"), {})


def test_the_batch_script_runs_one_launcher_per_node():
    argv = ["train", "--config", "run.yaml", "--print-sbatch", "--gpus-per-node", "8",
            "train.steps=50"]
    script = sbatch_script(64, 8, argv)
    assert "#SBATCH --nodes=8\n" in script and "#SBATCH --gpus-per-node=8\n" in script
    assert "#SBATCH --ntasks-per-node=1\n" in script
    assert script.rstrip().endswith("srun paraxis train --config run.yaml train.steps=50")
    assert "#SBATCH --nodes=1\n" in sbatch_script(4, 8, ["train"])  # fits one node
    assert "#SBATCH --gpus-per-node=4\n" in sbatch_script(4, 8, ["train"])
    with pytest.raises(ConfigError, match="must divide the world size 12"):
        sbatch_script(12, 8, ["train"])


def test_cpu_workers_get_fixed_malloc_thresholds_unless_set():
    env = worker_environment({}, cuda=False)
    assert env == MALLOC_DEFAULTS
    assert worker_environment({"MALLOC_MMAP_THRESHOLD_": "4096"}, cuda=False) == {
        "MALLOC_TRIM_THRESHOLD_": MALLOC_DEFAULTS["MALLOC_TRIM_THRESHOLD_"]}
    assert worker_environment({}, cuda=True) == {}


# What ZeRO-3 does to glibc's heap every step: a large block freed (a gathered layer)
# raises the mmap threshold to its size, then blocks below it (the next layers,
# gradients) come from the heap between small tensors that stay (activations, state),
# and once freed their pages stay with the process. Prints the bytes still resident.
_PATTERN = """
import gc, torch
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS'):
            return int(line.split()[1]) * 1024
torch.empty(4 << 20).fill_(1)             # 16 MiB freed: threshold -> 16 MiB
big, small = [], []
for _ in range(40):
    big.append(torch.empty(2 << 20).fill_(1))   # 8 MiB each
    small.append(torch.empty(1 << 10).fill_(1))  # 4 KiB each, kept
before = rss()
big.clear(); gc.collect()
print(before - rss())
"""


def test_the_thresholds_give_freed_blocks_back_to_the_system():
    """A child with the launcher's environment returns the 320 MiB it freed; one without
    keeps them (glibc's dynamic threshold; the check fails without the thresholds)."""
    import os
    import subprocess
    import sys

    def returned(env):
        clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        out = subprocess.run([sys.executable, "-c", _PATTERN], env={**clean, **env},
                             capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1])

    freed = 40 * 8 << 20
    with_thresholds = returned(worker_environment({}, cuda=False))
    without = returned({})
    print(f"returned {with_thresholds / freed:.3f} of what was freed with the thresholds, "
          f"{without / freed:.3f} without")
    assert with_thresholds >= 0.9 * freed
    assert without <= 0.1 * freed  # what the thresholds are for (glibc's default)


# After a 16 MiB block is freed (glibc's dynamic threshold now 16 MiB), how many of forty
# 8 MiB blocks glibc maps on their own (mallinfo2's hblks; glibc >= 2.33): all with a
# 1 MiB threshold in force, none without. Deterministic, unlike the pages returned.
_MAPPED = """
import ctypes, torch
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
torch.empty(4 << 20).fill_(1)
before = libc.mallinfo2().hblks
big = [torch.empty(2 << 20) for _ in range(40)]
print(libc.mallinfo2().hblks - before)
"""


def test_a_forked_worker_applies_the_thresholds_it_inherits():
    """A forked worker's glibc read its environment before the launcher set the
    thresholds (issue 38's forked start-up): ``malloc_from_environment`` applies them
    with mallopt (paraxis.train.forked). The child here sets them after it started, as a
    forked worker finds them; without the call (the plant) none of the blocks is mapped
    on its own."""
    import os
    import subprocess
    import sys

    def mapped(apply):
        clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        setup = ("import os\nfrom paraxis.train.forked import malloc_from_environment\n"
                 f"os.environ.update({dict(MALLOC_DEFAULTS)!r})\n"
                 + ("assert len(malloc_from_environment()) == 2\n" if apply else ""))
        out = subprocess.run([sys.executable, "-c", setup + _MAPPED], env=clean,
                             capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1])

    assert mapped(True) == 40
    assert mapped(False) == 0  # glibc's own threshold, which the call replaces


def test_the_launcher_gives_its_caller_the_environment_back(monkeypatch):
    """run_workers sets the workers' environment (report directory, lock, thread and
    malloc settings) in the process that calls it; that process has its own back when
    the job ends, or a later ``main`` in it (a test's) reads a removed report directory.
    The job here sets what the real one sets, then fails."""
    import os

    from paraxis.train import launcher

    def job(world_size, opts, argv, checkpoint_dir, entry, warm):
        os.environ["PARAXIS_REPORT_DIR_PLANT"] = "/gone"
        os.environ["OMP_NUM_THREADS"] = "97"
        raise RuntimeError("the job failed")

    monkeypatch.setattr(launcher, "_run_workers", job)
    before = dict(os.environ)
    with pytest.raises(RuntimeError):
        launcher.run_workers(2, LaunchOptions(1, 0, "", "", 0), ["train"], None)
    assert dict(os.environ) == before
