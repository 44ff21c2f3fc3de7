"""ZeRO-3 under ``train.precision: bf16`` (issue 36, item 1): the shards stay fp32 (the
master weights the optimizer steps) and the units are gathered, and held for compute,
in bf16.

On data 2 (core's tiny model, two steps, one microbatch), against the same run in fp32:
the data-axis bytes per step are at most 0.70 of fp32's with fp32 gradient reductions
and 0.55 with ``reduce_dtype: bf16`` (each element gathered twice and reduced once: 2 +
2 + 4 = 8 of 12 bytes, and 6 of 12; the norms ZeRO keeps whole are all-reduced in fp32
in both), and the bytes held gathered at once, at their peak, are half of fp32's. The
parity with one process in bf16 (SGD weights at the derived bf16 tolerance) is
tests/test_precision_parity.py's ``bf16-zero3``, which now runs these gathers."""

import torch
from zero_tiny import TRAIN, build, train_steps

import paraxis

ONE_STEP_BOUND = {"fp32": 0.70, "bf16": 0.55}  # the issue's, by reduce_dtype


def measure(precision, reduce_dtype):
    engine = paraxis.parallelize(build(), data=2, zero=3, reduce_dtype=reduce_dtype,
                                 train={**TRAIN, "precision": precision})
    sync = engine.ctx.extras["zero"]
    peak, held = [0], set()

    def gathered_bytes():
        return sum(full.untyped_storage().nbytes() for u in sync.units for f in u.flats
                   for full in f.fulls.values())

    for unit in sync.units:  # the bytes held gathered, read after every gather
        def gather(compute, unit=unit, inner=unit.gather):
            inner(compute)
            held.update(p.dtype for p in unit.params)
            peak[0] = max(peak[0], gathered_bytes())
        unit.gather = gather
    train_steps(engine, 0, 1)  # the first step builds the optimizer's state
    mark = engine.grid.comm.mark()
    train_steps(engine, 1, 2)
    moved = sum(n for (axes, _), n in engine.grid.comm.since(mark)["bytes"].items()
                if axes.startswith("data"))
    masters = {p.dtype for p in engine.optimizer.owned}
    engine.close()
    return moved, peak[0], held, masters


def test_zero3_gathers_in_bf16_half_the_bytes_and_keeps_fp32_shards(worlds):
    fp32_moved, fp32_peak, fp32_held, _ = worlds.run(2, measure, "fp32", "fp32")[0]
    assert fp32_held == {torch.float32}
    for reduce_dtype, bound in ONE_STEP_BOUND.items():
        moved, peak, held, masters = worlds.run(2, measure, "bf16", reduce_dtype)[0]
        print(f"reduce_dtype {reduce_dtype}: data bytes {moved / fp32_moved:.3f} of fp32's, "
              f"peak gathered {peak} against {fp32_peak}")
        assert held == {torch.bfloat16} and masters == {torch.float32}
        assert moved <= bound * fp32_moved, (reduce_dtype, moved, fp32_moved)
        assert 2 * peak == fp32_peak
