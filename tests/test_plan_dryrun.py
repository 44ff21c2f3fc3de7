"""``paraxis plan --dry-run``: the layout laid out for real on the meta device in a fake
process group (torch's ``fake`` backend), one rank per pipeline stage, its bytes read
from its tensors and compared with the plan (paraxis.planner.dryrun). The README and
benchmarks/RESULTS.md show Llama-3-70B on 512 ranks and Mixtral-8x7B with expert 8;
the suite runs smaller worlds of small models, the same code."""

import json

import pytest

from paraxis.cli.main import main

LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 704,
         "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
         "vocab_size": 32000, "max_position_embeddings": 512}
MIXTRAL = {**LLAMA, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2}


@pytest.mark.parametrize("model,layout", [
    (LLAMA, ["--data", "4", "--tensor", "4", "--pipeline", "4", "--zero", "1",
             "--sequence-parallel"]),
    (LLAMA, ["--data", "8", "--tensor", "2", "--zero", "3"]),
    (MIXTRAL, ["--data", "2", "--expert", "4", "--tensor", "2", "--pipeline", "2",
               "--zero", "1", "--sequence-parallel"]),
    # One local expert over 2 data replicas: ZeRO's dim-0 chunks leave it whole on a rank.
    (MIXTRAL, ["--data", "2", "--expert", "8", "--tensor", "2", "--zero", "1",
               "--sequence-parallel"]),
    # Each expert's FFN split over the tensor group (expert_tensor): expert bytes / 2.
    (MIXTRAL, ["--data", "2", "--expert", "4", "--tensor", "2", "--expert-tensor", "2",
               "--sequence-parallel"]),
], ids=["llama-d4t4p4-zero1-sp", "llama-d8t2-zero3", "mixtral-d2e4t2p2-zero1-sp",
        "mixtral-d2e8t2-zero1-sp", "mixtral-d2e4t2-etp2-sp"])
def test_dry_run_bytes_agree_with_the_plan(tmp_path, capsys, model, layout):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(model))
    assert main(["plan", "--model", str(path), "--seq", "256", "--precision", "bf16",
                 "--dry-run", "--json", *layout]) == 0
    rows = json.loads(capsys.readouterr().out)["dry_run"]
    stages = int(layout[layout.index("--pipeline") + 1]) if "--pipeline" in layout else 1
    assert {r["stage"] for r in rows} == set(range(stages))
    off = [r for r in rows if abs(r["ratio"] - 1) > 0.02]
    assert not off, off


def test_the_dry_run_counts_what_paraxis_holds_not_the_papers_mixed(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    with pytest.raises(ValueError, match="mixed"):
        main(["plan", "--model", str(path), "--data", "2", "--dry-run"])
