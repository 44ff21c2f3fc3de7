"""The order of gradient synchronizers is a contract (Megatron-Core's finalize_model_grads):
data-parallel reductions finish first, then tensor partial sums, then tied embeddings.

Sequence parallelism's partial sums rewrite the gradients of norms that the data-parallel
all-reduce may still be reducing asynchronously; they used to run first, in whatever
order the strategies happened to append them.
"""

import torch.distributed as dist
from hf_parity import compare

import paraxis
from paraxis_hf import build_debug_model


def sync_order():
    engine = paraxis.parallelize(build_debug_model("llama"), data=2, tensor=2,
                                 sequence_parallel=True, bucket_mb=0.005,
                                 train={"seq_length": 16})
    appended = [type(s).__name__ for s in engine.ctx.grad_syncs]
    finished = [type(s).__name__ for s in engine.ctx.ordered_syncs()]
    buckets = len(engine.ctx.grad_syncs[-1].buckets) if dist.get_rank() == 0 else None
    engine.close()
    return appended, finished, buckets


def test_data_parallel_finishes_before_tensor_partial_sums(worlds):
    appended, finished, buckets = worlds.run(4, sync_order)[0]
    # Phases append the tensor axis' sync first; the engine finishes data first anyway.
    assert appended == ["PartialGradSync", "DataParallel"]
    assert finished == ["DataParallel", "PartialGradSync"]
    assert buckets > 3


def test_data_by_tensor_with_sequence_parallel_and_many_buckets(worlds):
    compare(worlds, "llama", {"data": 2, "tensor": 2, "sequence_parallel": True},
            bucket_mb=0.005, microbatches=2)
