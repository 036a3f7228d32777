"""Model helpers."""

from distflow.models.tiny import build_tiny_model, resolve_model_path, resolve_on_local_rank0_first

__all__ = ["build_tiny_model", "resolve_model_path", "resolve_on_local_rank0_first"]
