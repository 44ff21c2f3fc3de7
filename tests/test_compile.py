"""``train.compile``: each transformer layer compiled after the axes apply, against one
eager process, on data 2, tensor 2 + SP and pipeline 2 (first-step gradients per
parameter, losses and gradient norms per step, eval loss and final weights at the shared
tolerance). The suite compiles with ``aot_eager``: dynamo and AOTAutograd trace the
layers with every axis' hooks, which is what paraxis can break; TorchInductor's code
generation (``compile: true``) takes minutes per run on 2 CPU cores and is measured by
benchmarks/compile.py, with the parity probe checking it at ``parallelize``."""

import pytest
import torch
from hf_parity import compare

import paraxis
from paraxis_hf import build_debug_model

COMPILED = {"compile": "aot_eager"}
LAYOUTS = {
    "data2": ({"data": 2}, {}),
    "tensor2_sp": ({"tensor": 2}, {"sequence_parallel": True}),
    "pipeline2": ({"pipeline": 2}, {"microbatches": 2}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_layers_match_one_eager_process(worlds, layout):
    degrees, options = LAYOUTS[layout]
    compare(worlds, "llama", degrees, steps=4, recipe=COMPILED, **options)


def compiled_breaks():
    model = build_debug_model("llama")
    engine = paraxis.parallelize(model, tensor=2, sequence_parallel=True,
                                 train={"seq_length": 16, "compile": "aot_eager"})
    ids = torch.randint(0, model.config.vocab_size, (2, 16),
                        generator=torch.Generator().manual_seed(0))
    m = engine.train_step({"input_ids": ids, "labels": ids})
    compiled = engine.ctx.extras["compile"]
    engine.close()
    return compiled, m["compile/graphs"], m["compile/graph_breaks"]


def test_compile_reports_what_it_compiled_and_its_graph_breaks(worlds):
    compiled, graphs, breaks = worlds.run(2, compiled_breaks)[0]
    assert compiled == "aot_eager, 2 layers"
    assert graphs > 0  # dynamo compiled graphs: the layers did not all fall back
    # Tensor parallelism's gathers and reductions run from hooks, eagerly: dynamo breaks
    # the graph around them and says so.
    assert breaks > 0
