"""Models as files and shapes: the built-in models (tiny, smollm2) built once into a cache, hub
names resolved to a local folder, a model's anatomy and head counts, the weight names an
engine's loaders read, and the PEFT adapter folder an engine loads LoRA from."""

from distflow.models.tiny import build_tiny_model, resolve_model_path

__all__ = ["build_tiny_model", "resolve_model_path"]
