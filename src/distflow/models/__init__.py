"""Model helpers."""

from distflow.models.tiny import build_tiny_model, resolve_model_path

__all__ = ["build_tiny_model", "resolve_model_path"]
