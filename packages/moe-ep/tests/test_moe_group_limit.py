"""A group-limited router (DeepSeek-V3's ``n_group`` / ``topk_group``) that cannot route
is refused by ``parallelize``'s checks, naming the field, before any process group
(``preflight``: what ``parallelize`` checks before it creates one)."""

import pytest

pytest.importorskip("transformers")

from moe_tiny_models import build, plan_of

from paraxis import ParallelConfig
from paraxis.config.errors import ConfigError
from paraxis.config.run import TrainSection
from paraxis.engine.apply import preflight
from paraxis_moe.config import group_limit_problems


def _refusal(**overrides):
    model = build("deepseek_v3", **overrides)
    with pytest.raises(ConfigError) as err:
        preflight(model, ParallelConfig.from_kwargs(expert=2), train=TrainSection(seq_length=8),
                  plan=plan_of(model), world_size=2)
    return err.value


def test_topk_group_above_n_group_is_refused_before_any_group():
    err = _refusal(n_group=2, topk_group=3)
    problem = next(p for p in err.problems if p.field == "model.topk_group")
    assert problem.value == 3 and "n_group=2" in problem.rule
    assert "topk_group <= 2" in problem.fix


def test_n_group_not_dividing_the_experts_is_refused():
    err = _refusal(n_group=3, topk_group=1)
    problem = next(p for p in err.problems if p.field == "model.n_group")
    assert problem.value == 3 and "[1, 2, 4]" in problem.fix


def test_a_routable_group_limit_and_a_router_without_one_pass():
    assert group_limit_problems(build("deepseek_v3").config) == []
    assert group_limit_problems(build("mixtral").config) == []
