"""Expert tensor parallelism and a family's own gate function: accepted when the packed
column split commutes with it (each rank's slice of the gate and up halves gives that
rank's slice of the output), refused when it does not, before any process group."""

import torch
from torch import nn

from paraxis_moe.expert_tensor import refusals


class Experts(nn.Module):
    """Fused experts of transformers 5.x's shape: gate_up (E, 2F, H), down (E, H, F)."""

    has_gate, has_bias = True, False

    def __init__(self, width: int = 8):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(4, 2 * width, 16))
        self.down_proj = nn.Parameter(torch.zeros(4, 16, width))


class ClampedHalves(Experts):  # DeepSeek-V4's, MiniMax-M3's, HY-V4's kind
    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate.clamp(max=1.0)) * up.clamp(-1.0, 1.0)


class Interleaved(Experts):  # GPT-OSS's kind: gate and up alternate
    def _apply_gate(self, gate_up):
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        return gate * torch.sigmoid(gate) * (up + 1)


class Mixing(Experts):  # normalizes over the features: a slice cannot give its share
    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.softmax(gate, dim=-1) * up


def test_a_gate_acting_on_contiguous_halves_splits():
    assert refusals(ClampedHalves(), 2) == []
    assert refusals(ClampedHalves(), 4) == []


def test_a_gate_that_does_not_commute_with_the_split_is_refused():
    for experts in (Interleaved(), Mixing()):
        found = refusals(experts, 2)
        assert len(found) == 1 and "does not give each rank's slice" in found[0], found
        assert type(experts).__name__ in found[0]
