"""paraxis-hf: Hugging Face transformers models for paraxis."""

from paraxis_hf.build import build_causal_lm
from paraxis_hf.debug import DEBUG_CONFIGS, build_debug_model
from paraxis_hf.plan import hf_plan
from paraxis_hf.pretrained import from_pretrained

__all__ = ["DEBUG_CONFIGS", "build_causal_lm", "build_debug_model", "from_pretrained",
           "hf_plan"]
