"""The elementwise bytes of one layer, counted from the operations the model runs
(issue 38): where the efficiency table's :class:`~paraxis.planner.efficiency.Elementwise`
constants come from.

    python -m paraxis.planner.census              # Llama, every precision
    python -m paraxis.planner.census --family mistral --precision bf16

The model is built small, through the ``paraxis_build_model`` hook (paraxis-hf answers
for transformers families; core imports no transformers), at 2 and at 3 layers, and
trained one step on CPU under the precision as paraxis runs it (bf16/fp16: fp32
parameters under autocast; ``mixed``: the model held in bf16; fp32). A dispatch mode
sees every aten operation; each operation other than a GEMM or fused attention adds the
bytes of its input and output tensors (what a kernel reads and writes from memory; views
move nothing). The 3-layer count minus the 2-layer one is one layer. Over shapes that
vary h, i, q, h_kv, the tokens and the weights, a least-squares fit gives bytes per
token per unit of each width, and per weight parameter.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from paraxis.planner.efficiency import Elementwise

__all__ = ["SHAPES", "fit_elementwise", "layer_census"]

# (hidden, intermediate, heads, kv heads, head dim): each width varied alone.
SHAPES = ((256, 704, 4, 1, 64), (512, 704, 8, 2, 64), (256, 1408, 4, 1, 64),
          (256, 704, 4, 1, 128), (256, 704, 8, 1, 64), (256, 704, 4, 2, 64))
TOKENS = (128, 256)
# Operations a GEMM or fused-attention kernel runs (timed by their own curves).
COMPUTE = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product")
# Operations that make a view: no kernel, no bytes.
VIEWS = {"view", "_unsafe_view", "t", "transpose", "expand", "slice", "select", "permute",
         "unsqueeze", "squeeze", "as_strided", "detach", "alias", "split", "split_with_sizes",
         "reshape", "_reshape_alias", "unbind", "chunk", "lift_fresh"}


class _Census(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.bytes, self.ops = 0, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None,
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in VIEWS:
            return out
        self.ops += 1
        if name.startswith(COMPUTE):
            return out
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return out


def _config(shape: tuple[int, ...], layers: int) -> dict[str, Any]:
    h, i, heads, kv, head_dim = shape
    return {"hidden_size": h, "intermediate_size": i, "num_attention_heads": heads,
            "num_key_value_heads": kv, "head_dim": head_dim, "num_hidden_layers": layers,
            "vocab_size": 256, "max_position_embeddings": 1024, "attn_implementation": "sdpa"}


def _one_step(family: str, config: dict[str, Any], tokens: int, precision: str,
              ) -> tuple[int, int, int]:
    """(bytes, operations, weight parameters) of one training step of the model."""
    from paraxis.engine.plugins import make_plugin_manager

    torch.manual_seed(0)
    model = make_plugin_manager().hook.paraxis_build_model(family=family, config=config)
    if model is None:
        raise SystemExit(f"no installed plugin builds {family!r} (pip install paraxis-hf)")
    if precision == "mixed":
        model = model.to(torch.bfloat16)
    ids = torch.randint(0, 256, (1, tokens))
    census = _Census()
    autocast = torch.autocast("cpu", dtype={"fp16": torch.float16}.get(precision,
                              torch.bfloat16), enabled=precision in ("bf16", "fp16"))
    with census:
        with autocast:
            logits = model(input_ids=ids).logits
        logits.float().sum().backward()
    weights = sum(p.numel() for p in model.parameters() if p.ndim >= 2)
    return census.bytes, census.ops, weights


def layer_census(family: str, shape: tuple[int, ...], tokens: int, precision: str,
                 ) -> tuple[float, float, float]:
    """(bytes, operations, weight parameters) of one layer: 3 layers minus 2."""
    three = _one_step(family, _config(shape, 3), tokens, precision)
    two = _one_step(family, _config(shape, 2), tokens, precision)
    return tuple(float(a - b) for a, b in zip(three, two, strict=True))  # type: ignore[return-value]


def fit_elementwise(family: str = "llama", precision: str = "mixed",
                    ) -> tuple[Elementwise, float]:
    """The layer's :class:`Elementwise` constants fitted over :data:`SHAPES` x
    :data:`TOKENS`, and the worst relative error of the fit."""
    rows, ys, ops = [], [], []
    for shape in SHAPES:
        h, i, heads, kv, head_dim = shape
        for s in TOKENS:
            nbytes, n_ops, weights = layer_census(family, shape, s, precision)
            rows.append([s * h, s * i, s * heads * head_dim, s * kv * head_dim, weights])
            ys.append(nbytes)
            ops.append(n_ops)
    a = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64)
    coef = torch.linalg.lstsq(a, y[:, None]).solution[:, 0]
    worst = float(((a @ coef) / y - 1).abs().max())
    hidden, inter, query, kv, per_weight = (round(float(c), 1) for c in coef)
    accumulate = 6.0 if precision == "mixed" else 12.0  # grad += new: 2 or 4 bytes x 3
    return Elementwise(hidden, inter, query, kv, max(0.0, per_weight), round(max(ops)),
                       accumulate), worst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="llama")
    p.add_argument("--precision", choices=("mixed", "bf16", "fp16", "fp32"), action="append")
    args = p.parse_args(argv)
    for precision in args.precision or ("mixed", "bf16", "fp32"):
        ew, worst = fit_elementwise(args.family, precision)
        print(f"{precision:>5}: {ew} (worst fit error {worst:.2%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
