"""Expert tensor parallelism (``parallelism.expert_tensor``, Megatron-Core's ETP): each
expert's FFN split column/row-wise over the tensor group, on Mixtral (fused experts)
trained through ``parallelize`` against one process (tests/hf_parity.py): the first
step's gradients parameter by parameter, per-step losses, gradient norms and router
losses, the evaluation loss and the final weights, at the shared tolerance.

Under sequence parallelism the rows each rank's experts received are all-gathered over
the tensor group and the partial outputs reduce-scattered back; without it the input
enters by Megatron's f and the output leaves by g (all-reduce).
"""

import pytest

pytest.importorskip("transformers")
pytest.importorskip("paraxis_moe")

from hf_parity import compare

LAYOUTS = {
    "expert2_tensor2_sp": ({"expert": 2, "tensor": 2}, True),
    "tensor2_sp": ({"tensor": 2}, True),
    "tensor2": ({"tensor": 2}, False),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_split_experts_match_one_process(worlds, layout):
    degrees, sp = LAYOUTS[layout]
    out = compare(worlds, "mixtral", degrees, steps=6, expert_tensor=2, sequence_parallel=sp)
    assert all(h[2] > 0 for h in out[0][0]), "the router loss is trained every step"
