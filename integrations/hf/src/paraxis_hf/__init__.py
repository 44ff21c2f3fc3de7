"""paraxis-hf: Hugging Face transformers models for paraxis."""

from paraxis_hf.build import build_causal_lm
from paraxis_hf.debug import DEBUG_CONFIGS, build_debug_model
from paraxis_hf.plan import hf_plan

__all__ = ["DEBUG_CONFIGS", "build_causal_lm", "build_debug_model", "hf_plan"]
