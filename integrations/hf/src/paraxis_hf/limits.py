"""Layouts a transformers model's own code cannot run under, found by reading the model,
each with the reason (a :attr:`paraxis.ModelPlan.unsupported` entry, refused at
``parallelize`` before any process group).

Each rule names the module and what in its forward needs more than a rank holds. They
are the coverage matrix's defects that a shard cannot fix without changing the model's
code (docs/coverage.md); the parity probe would catch each one too, but only as "the
loss differs" or a shape error, which names no cause.
"""

from __future__ import annotations

import inspect

from torch import nn

__all__ = ["unsupported_layouts"]


def _first(model: nn.Module, test) -> str | None:
    return next((name for name, module in model.named_modules() if test(module)), None)


def _tensor(model: nn.Module) -> str | None:
    name = _first(model, lambda m: callable(getattr(m, "_gaussian_topk", None))
                  and float(getattr(m, "activation_sparsity", 0.0) or 0.0) > 0.0)
    if name is not None:
        return (f"{name} keeps the largest gate activations by the mean and standard "
                "deviation over the whole intermediate dimension (activation sparsity, "
                "_gaussian_topk), and a column shard holds 1/t of that dimension, so each "
                "rank would keep different activations")
    name = _first(model, lambda m: isinstance(getattr(m, "dt_proj", None), nn.Linear)
                  and isinstance(getattr(m, "A", None), nn.Parameter))
    if name is not None:
        return (f"transformers' tensor plan splits {name}.v_proj by head but "
                f"{name}.dt_proj row-wise, whose output holds every key-value head (as "
                f"does {name}.A), while the rank's attention holds 1/t of them")
    return None


def _sequence_parallel(model: nn.Module) -> str | None:
    if getattr(model.config, "hidden_size_per_layer_input", None):
        return ("the model computes per-layer inputs for the whole sequence from the "
                "token ids before its layers and adds one to each layer's output, which "
                "sequence parallelism cuts to 1/t of the sequence")
    if int(getattr(model.config, "hc_mult", 1) or 1) > 1:
        return (f"the model carries {model.config.hc_mult} streams of the hidden state "
                "between its layers (hyper-connections: a (batch, sequence, streams, "
                "hidden) residual), and sequence parallelism cuts the second-to-last "
                "dimension, which there holds the streams, not the sequence")
    name = _first(model, lambda m: _hands_on(m, "block_states"))
    if name is not None:
        return (f"{name} takes block_states beside the hidden states: a (batch, sequence, "
                "blocks, hidden) stack of earlier blocks' outputs (block attention "
                "residuals) that the model starts for the whole sequence before its first "
                "layer and extends between its layers, where sequence parallelism hands "
                "each layer 1/t of the sequence; it would need the stack split with the "
                "hidden states, inside the model's own loop. Set sequence_parallel: false "
                "(tensor parallelism without it runs this model)")
    if _first(model, lambda m: hasattr(m, "H_module") and hasattr(m, "L_module")):
        return ("the model adds its high-level state to its low-level one between its "
                "two layer stacks; a stack's output under sequence parallelism holds 1/t "
                "of the sequence and the other state all of it")
    return None


def _context(model: nn.Module) -> str | None:
    name = _first(model, lambda m: callable(getattr(m, "prepare_dynamic_mask", None)))
    if name is not None:
        return (f"{name} adds a learned mask over the keys (prepare_dynamic_mask) to every "
                "attention call; a rank holding a shard of the keys cannot apply a mask "
                "over the whole sequence")
    return None


def _hands_on(module: nn.Module, argument: str) -> bool:
    forward = getattr(type(module), "forward", None)
    try:
        return forward is not None and argument in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False


def _pipeline(model: nn.Module) -> str | None:
    """What a stage after the first cannot see: it receives the previous stage's hidden
    states (as ``inputs_embeds``) and nothing else the model's forward made before or
    between its layers."""
    causes = []
    if getattr(model.config, "hidden_size_per_layer_input", None):
        causes.append("the model computes per-layer inputs from the token ids before its "
                      "layers (get_per_layer_inputs), and a later stage receives hidden "
                      "states, not the ids")
    name = _first(model, lambda m: getattr(m, "is_kv_shared_layer", False) is True)
    if name is not None:
        causes.append(f"{name} reuses the keys and values an earlier layer computed (KV "
                      "sharing, shared_kv_states), which a later stage does not hold")
    name = _first(model, lambda m: hasattr(m, "tid2eid"))
    if name is not None:
        causes.append(f"{name} routes each token to experts by its token id (hash "
                      "routing, tid2eid), and a later stage receives hidden states, not "
                      "the ids")
    name = _first(model, lambda m: _hands_on(m, "prev_topk_indices"))
    if name is not None:
        causes.append(f"{name} hands its attention indexer's top-k key indices to the "
                      "next layer (prev_topk_indices), and a stage boundary carries only "
                      "the hidden states")
    return "; ".join(causes) or None


def unsupported_layouts(model: nn.Module) -> dict[str, str]:
    """Layout (``tensor``, ``sequence_parallel``, ``pipeline``, ``context``) -> why
    ``model`` cannot run under it."""
    found = {"tensor": _tensor(model), "sequence_parallel": _sequence_parallel(model),
             "pipeline": _pipeline(model), "context": _context(model)}
    return {layout: why for layout, why in found.items() if why}
