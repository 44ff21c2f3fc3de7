"""Core's own model family, ``tiny`` (plain torch, Llama-style), with its plan and stage
calls, so that every axis runs and is tested without transformers."""
