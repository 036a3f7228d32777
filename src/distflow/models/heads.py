"""A model's attention-head counts, read before any weights load.

A tensor-parallel engine splits the attention heads evenly over its ranks, so the head counts
decide which rollout.tensor_parallel_size can work. They come from the built-in models' known
configs, or from the folder's config.json (AutoConfig reads only that file).
"""

from __future__ import annotations

from distflow.models.tiny import MODEL_KWARGS as TINY

# (attention heads, key/value heads) of the models distflow builds or converts by name.
BUILTIN_HEADS = {
    "tiny": (TINY["num_attention_heads"], TINY["num_key_value_heads"]),
    "smollm2_135m": (9, 3),  # SmolLM2-135M: 9 query heads, 3 key/value heads
}


def attention_heads(path: str, trust_remote_code: bool = False) -> tuple[int, int] | None:
    """(attention heads, key/value heads), or None when the config cannot be read here (e.g. a
    hub name offline: the engine then checks when it loads)."""
    if path in BUILTIN_HEADS:
        return BUILTIN_HEADS[path]
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None
    cfg = getattr(cfg, "text_config", None) or cfg
    heads = getattr(cfg, "num_attention_heads", None)
    if heads is None:
        return None
    return int(heads), int(getattr(cfg, "num_key_value_heads", None) or heads)


def tensor_parallel_problem(k: int, heads: tuple[int, int] | None) -> str | None:
    """Why k tensor-parallel ranks cannot split these heads (vLLM's rule), or None if they can:
    query heads split evenly; key/value heads split evenly, or each is replicated on k / kv ranks."""
    if k == 1 or heads is None:
        return None
    q, kv = heads
    if q % k:
        return f"the model has {q} attention heads, which {k} tensor-parallel ranks cannot split evenly"
    if (kv >= k and kv % k) or (kv < k and k % kv):
        return f"the model has {kv} key/value heads, which {k} tensor-parallel ranks can neither split nor replicate evenly"
    return None
