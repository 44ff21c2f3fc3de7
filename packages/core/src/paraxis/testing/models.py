"""Re-export of the built-in tiny model for tests and benchmarks."""

from paraxis.models.tiny import TinyConfig, TinyTransformer, causal_lm_loss, random_batches

__all__ = ["TinyConfig", "TinyTransformer", "causal_lm_loss", "random_batches"]
