"""``paraxis plan --dry-run`` and ``paraxis train --dry-run``: the layout laid out for
real on the meta device in a fake process group (torch's ``fake`` backend), the first
and the last rank of every pipeline stage, its bytes read from its tensors after the
rest of a step (gradient synchronizers finished, the optimizer's first step) and
compared with the plan; the stage cut checked apart from the split function the planner
and the pipeline axis share (paraxis.planner.dryrun, paraxis.planner.stage_cut). The
suite runs small models at many ranks, and Llama-3-70B's own config.json at 512."""

import itertools
import json
from pathlib import Path

import pytest

from paraxis.cli.main import main
from paraxis.planner.dryrun import BOUND
from paraxis.planner.stage_cut import cut_problems, least_costliest_stage, stage_costs

ROOT = Path(__file__).resolve().parents[1]
LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 704,
         "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
         "vocab_size": 32000, "max_position_embeddings": 512}
MIXTRAL = {**LLAMA, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2}
# What a downloaded config.json carries: the dtype its checkpoint was saved in.
LLAMA_BF16 = {**LLAMA, "torch_dtype": "bfloat16"}


def _dry_run(capsys, model, layout, *extra):
    """The CLI's JSON and exit code for ``model`` (a config mapping or a path)."""
    code = main(["plan", "--model", str(model), "--seq", "256", "--precision", "bf16",
                 "--dry-run", "--json", *layout, *extra])
    return json.loads(capsys.readouterr().out), code


def _written(tmp_path, model):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(model))
    return path


def _assert_agrees(out, code, degrees):
    run = out["dry_run"]
    off = [r for r in run["rows"] if abs(r["ratio"] - 1) > BOUND]
    assert not off and not run["problems"] and run["ok"] and code == 0, (off, run["problems"])
    stages = degrees.get("pipeline", 1)
    assert {r["stage"] for r in run["rows"]} == set(range(stages))
    # The first and the last rank of every stage: every other axis at 0, then at its end.
    sharded = {a: d for a, d in degrees.items() if a != "pipeline" and d > 1}
    for stage in range(stages):
        which = {r["which"]: r["rank"] for r in run["rows"] if r["stage"] == stage}
        assert set(which) == ({"first", "last"} if sharded else {"first"}), which
        per_stage = out["config"]["world_size"] // stages
        assert which["first"] == stage * per_stage
        if sharded:
            assert which["last"] == (stage + 1) * per_stage - 1


LAYOUTS = {
    "llama-d4t4p4-zero1-sp": (LLAMA, ["--data", "4", "--tensor", "4", "--pipeline", "4",
                                      "--zero", "1", "--sequence-parallel"]),
    "llama-d8t2-zero3": (LLAMA, ["--data", "8", "--tensor", "2", "--zero", "3"]),
    "llama-d4-zero2": (LLAMA, ["--data", "4", "--zero", "2"]),
    # Data-parallel buckets (ZeRO 0) and an interleaved cut: 2 chunks per rank.
    "llama-d2t2p2v2-zero0": (LLAMA, ["--data", "2", "--tensor", "2", "--pipeline", "2",
                                     "--schedule", "interleaved_1f1b",
                                     "--virtual-stages", "2"]),
    # A head tied to the embedding, held by the first and last stage: ZeRO keeps it whole.
    "llama-tied-d2p2-zero1": ({**LLAMA, "tie_word_embeddings": True},
                              ["--data", "2", "--pipeline", "2", "--zero", "1"]),
    "mixtral-d2e4t2p2-zero1-sp": (MIXTRAL, ["--data", "2", "--expert", "4", "--tensor", "2",
                                            "--pipeline", "2", "--zero", "1",
                                            "--sequence-parallel"]),
    # One local expert over 2 data replicas: ZeRO splits it along its rows (issue 36).
    "mixtral-d2e8t2-zero1-sp": (MIXTRAL, ["--data", "2", "--expert", "8", "--tensor", "2",
                                          "--zero", "1", "--sequence-parallel"]),
    # Each expert's FFN split over the tensor group (expert_tensor): expert bytes / 2.
    "mixtral-d2e4t2-etp2-sp": (MIXTRAL, ["--data", "2", "--expert", "4", "--tensor", "2",
                                         "--expert-tensor", "2", "--sequence-parallel"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dry_run_bytes_agree_with_the_plan(tmp_path, capsys, name):
    model, layout = LAYOUTS[name]
    out, code = _dry_run(capsys, _written(tmp_path, model), layout)
    degrees = {a.lstrip("-"): int(d) for a, d in zip(layout[::2], layout[1::2], strict=False)
               if a.lstrip("-") in ("data", "tensor", "pipeline", "expert", "context")}
    _assert_agrees(out, code, degrees)


def test_a_bf16_torch_dtype_still_builds_fp32_masters(tmp_path, capsys):
    """A config.json saved in bf16 says so; the run still holds fp32 masters (4 bytes
    per parameter, gradient and moment), and so does the dry run: once it built in
    torch_dtype and read every parameter and gradient at 0.5000 of the plan."""
    layout = ["--data", "2", "--tensor", "2", "--pipeline", "2", "--zero", "1"]
    out, code = _dry_run(capsys, _written(tmp_path, LLAMA_BF16), layout)
    _assert_agrees(out, code, {"data": 2, "tensor": 2, "pipeline": 2})


def test_llama_3_70b_config_json_agrees_on_512_ranks(capsys):
    """issue 32's bar: Meta-Llama-3-70B's config.json as published (torch_dtype
    bfloat16), data 8 x tensor 8 x pipeline 8, ZeRO-1 + SP: every stage's parameters,
    gradients and optimizer state, first and last rank, within 2% of the plan."""
    layout = ["--data", "8", "--tensor", "8", "--pipeline", "8", "--zero", "1",
              "--sequence-parallel"]
    model = ROOT / "examples/plan/Meta-Llama-3-70B"
    assert json.loads((model / "config.json").read_text())["torch_dtype"] == "bfloat16"
    out, code = _dry_run(capsys, model, layout, "--global-batch", "512")
    _assert_agrees(out, code, {"data": 8, "tensor": 8, "pipeline": 8})
    assert len(out["dry_run"]["rows"]) == 8 * 2 * 3


def test_mixtral_8x7b_expert_state_is_sharded_at_expert_8_data_2(capsys):
    """Issue 36: Mixtral-8x7B at expert 8 x data 2, ZeRO-1, one local expert per rank.
    ZeRO split each fused expert tensor along its experts (one row), so one data rank
    kept all of it: the optimizer state was 1.99x a plan without the waste. It is now
    split along a dimension with enough rows, and the planner models no waste: every
    term of the first and the last rank within 2%."""
    layout = ["--data", "2", "--expert", "8", "--zero", "1"]
    out, code = _dry_run(capsys, ROOT / "examples/plan/mixtral-8x7b.json", layout,
                         "--global-batch", "16")
    _assert_agrees(out, code, {"data": 2, "expert": 8})
    for r in out["dry_run"]["rows"]:
        print(r["rank"], r["term"], f"{r['ratio']:.4f}")


def test_the_dry_run_counts_what_paraxis_holds_not_the_papers_mixed(tmp_path):
    with pytest.raises(ValueError, match="mixed"):
        main(["plan", "--model", str(_written(tmp_path, LLAMA)), "--data", "2", "--dry-run"])


def test_a_cut_the_planner_and_the_axis_share_is_still_checked(tmp_path, capsys,
                                                              monkeypatch):
    """Plant: the split function both sides call moves a layer from the last stage to
    the first. Plan and build agree (the same cut, so the bytes agree too); the check
    counted from the built modules calls it unbalanced, and the dry run fails."""
    import paraxis.parallel.split as split

    balanced = split.balanced_split

    def skewed(num_layers, stages, **kwargs):
        ranges = balanced(num_layers, stages, **kwargs)
        (a, b), (c, d) = ranges[0], ranges[-1]
        return [(a, b + 1), *[(x + 1, y + 1) for x, y in ranges[1:-1]], (c + 1, d)]

    monkeypatch.setattr(split, "balanced_split", skewed)
    small_head = {**LLAMA, "vocab_size": 512}  # two layers a stage, the head nearly free
    out, code = _dry_run(capsys, _written(tmp_path, small_head),
                         ["--data", "2", "--pipeline", "4", "--zero", "1"])
    run = out["dry_run"]
    assert all(abs(r["ratio"] - 1) <= BOUND for r in run["rows"])  # circular: agrees
    assert code == 1 and len(run["problems"]) == 1, run["problems"]
    assert "not balanced" in run["problems"][0]


def test_least_costliest_stage_is_the_brute_force_optimum():
    """The checker's optimum against every cut of small layer lists."""
    for layers, stages, vocab in itertools.product(range(1, 9), range(1, 5), (0, 300, 3000)):
        if stages > layers:
            continue
        best = min(max(stage_costs([b - a for a, b in itertools.pairwise((0, *cut, layers))],
                                   64, vocab))
                   for cut in itertools.combinations(range(1, layers), stages - 1))
        assert least_costliest_stage(layers, stages, 64, vocab) == pytest.approx(best)


def test_cut_problems_name_each_disagreement():
    plan = {0: [(0, 2)], 1: [(2, 2)]}
    held = {0: [((0, 1),), ((0, 1),)], 1: [((2, 3),), ((2, 3),)]}
    assert cut_problems(held, plan, num_layers=4, hidden=64, vocab=0) == []
    moved = {0: [((0, 1, 2),)] * 2, 1: [((3,),)] * 2}
    found = cut_problems(moved, plan, num_layers=4, hidden=64, vocab=0)
    assert any("the plan gives it" in p for p in found), found
    assert any("not balanced" in p for p in found), found
    split_at = cut_problems(held, plan, num_layers=4, hidden=64, vocab=0, points=[3])
    assert split_at and "pipeline_split" in split_at[0]
    lost = cut_problems({0: [((0, 1),)], 1: [((3,),)]}, {0: [(0, 2)], 1: [(3, 1)]},
                        num_layers=4, hidden=64, vocab=0)
    assert any("once each" in p for p in lost), lost
    apart = cut_problems({0: [((0, 1),), ((0,),)], 1: [((2, 3),)] * 2}, plan,
                         num_layers=4, hidden=64, vocab=0)
    assert any("different layers" in p for p in apart), apart


RUN_YAML = """
parallelism: {data: 2, tensor: 2, pipeline: 2, zero: 1}
schedule: {microbatches: 4}
model:
  family: llama
  config: {hidden_size: 256, intermediate_size: 704, num_hidden_layers: 8,
           num_attention_heads: 8, num_key_value_heads: 4, vocab_size: 32000,
           max_position_embeddings: 512, torch_dtype: bfloat16}
train: {steps: 10, global_batch: 16, seq_length: 256, precision: bf16, optimizer: sgd}
data: {source: stdlib, tokenizer: bytes}
"""


def test_train_dry_run_lays_out_the_runs_own_yaml(tmp_path, capsys):
    """``paraxis train --config F --dry-run``: the YAML's own layout, model and train
    section (SGD with momentum: 4 bytes of state per parameter, not Adam's 8)."""
    config = tmp_path / "run.yaml"
    config.write_text(RUN_YAML)
    assert main(["train", "--config", str(config), "--dry-run", "--world-size", "8",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    _assert_agrees(out, 0, {"data": 2, "tensor": 2, "pipeline": 2})
    assert out["config"]["world_size"] == 8 and out["config"]["microbatches"] == 4
    for r in out["dry_run"]["rows"]:
        if r["term"] == "optimizer":
            params = next(p for p in out["dry_run"]["rows"] if p["rank"] == r["rank"]
                          and p["term"] == "parameters")
            assert r["planned"] == pytest.approx(params["planned"] / 2)  # ZeRO-1 over 2

    assert main(["train", "--config", str(config), "--dry-run", "--world-size", "4"]) == 1
    assert "world" in capsys.readouterr().err
