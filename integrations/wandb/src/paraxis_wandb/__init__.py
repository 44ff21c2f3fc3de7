"""paraxis-wandb: Weights & Biases logging for paraxis runs."""

from paraxis_wandb.logger import WandbLogger

__all__ = ["WandbLogger"]
