"""The multi-rank harness itself: results, failures that name the rank, no hangs."""

import time

import pytest
import torch
import torch.distributed as dist

from paraxis.testing import DistributedWorld, RankFailure, run_distributed


def rank_and_sum():
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 waits here for a rank that never comes


def sleep_on_rank_zero():
    if dist.get_rank() == 0:
        time.sleep(60)
    return "done"


def test_results_come_back_in_rank_order():
    assert run_distributed(rank_and_sum, 3) == [(0, 6.0), (1, 6.0), (2, 6.0)]


def test_a_failure_names_the_rank_and_carries_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailure) as err:
        run_distributed(fail_on_rank_one, 2, timeout=60)
    text = str(err.value)
    assert "rank 1:" in text and "ValueError: boom on purpose" in text
    assert time.monotonic() - start < 30  # the stuck rank 0 is not waited on for long


def test_a_hang_times_out_naming_the_silent_rank():
    with DistributedWorld(2, timeout=60) as world, pytest.raises(RankFailure) as err:
        world.run(sleep_on_rank_zero, timeout=3)
    assert "ranks [0] did not answer within 3s" in str(err.value)
    assert world.broken


def test_world_is_reused_across_runs(worlds):
    first = worlds.run(2, rank_and_sum)
    second = worlds.run(2, rank_and_sum)
    assert first == second == [(0, 3.0), (1, 3.0)]
