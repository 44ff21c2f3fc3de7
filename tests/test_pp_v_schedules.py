"""The V schedules (ZB-V, DualPipeV) on Hugging Face families against one process
(tests/hf_parity.py): the first step's gradients parameter by parameter, then 20 steps'
losses, gradient norms, an evaluation loss and the gathered weights.

Two ranks hold four stages in a V: rank 0 the first and the last (stages 0 and 3),
rank 1 the turn (stages 1 and 2, handed over in memory).

* SmolLM3 ties its word embedding to the head: in a V both ends are on rank 0, so the
  two uses accumulate into the one parameter the chunks share; summing them again over
  the embedding group (as when the ends are on two ranks) would double it.
* Mixtral's router loss travels with the activations as a carry (issue 32's exact
  router loss under a pipeline), across the turn of the V too.
"""

import pytest

pytest.importorskip("transformers")

from hf_parity import compare

FOUR_STAGES = {"num_hidden_layers": 4}


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
@pytest.mark.parametrize("family", ["smollm3", "mixtral"])
def test_v_schedules_match_one_process(worlds, family, schedule):
    out = compare(worlds, family, {"pipeline": 2}, overrides=FOUR_STAGES, steps=20,
                  microbatches=4, pipeline_schedule=schedule, virtual_stages=2)
    if family == "mixtral":
        assert all(h[2] > 0 for h in out[0][0]), "the router loss is trained every step"
