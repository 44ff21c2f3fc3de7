"""The launcher's arguments, without processes: SLURM's environment read into torchrun's
rendezvous, node lists expanded, and the batch script ``--print-sbatch`` writes."""

import argparse

import pytest

from paraxis.config.errors import ConfigError
from paraxis.train.launcher import (
    LaunchOptions,
    add_launch_arguments,
    sbatch_script,
    slurm_hosts,
    torchrun_args,
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
