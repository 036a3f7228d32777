"""Tiny random-weight models of the families users train, built locally (no download).

Each family is its transformers config class at test size (2 layers, hidden 64, head_dim 32 as
vLLM's CPU attention needs) with the tiny model's tokenizer, written with save_pretrained, so
transformers and vLLM load it exactly as they load a hub folder of that family. Tied and untied
heads, grouped-query attention, q/k norms, sliding windows, soft-capped logits, fused projections
and two mixture-of-experts layouts are all represented.
"""

from __future__ import annotations

import json
from pathlib import Path

from distflow.models.cache import build_once

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
              intermediate_size=128, max_position_embeddings=512)
MOE = dict(num_experts_per_tok=2, norm_topk_prob=True)

# model_type -> (architecture, extra config). A model's own defaults fill the rest.
FAMILIES: dict[str, tuple[str, dict]] = {
    "qwen2": ("Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3ForCausalLM", dict(tie_word_embeddings=True)),
    "llama": ("LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "mistral": ("MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=None)),
    "gemma2": ("Gemma2ForCausalLM", dict(tie_word_embeddings=True, query_pre_attn_scalar=32, sliding_window=16,
                                         final_logit_softcapping=30.0, attn_logit_softcapping=50.0)),
    "gemma3_text": ("Gemma3ForCausalLM", dict(tie_word_embeddings=True, query_pre_attn_scalar=32, sliding_window=16)),
    "phi3": ("Phi3ForCausalLM", dict(tie_word_embeddings=False)),
    "olmo2": ("Olmo2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(tie_word_embeddings=True, num_experts=4, moe_intermediate_size=64,
                                              decoder_sparse_step=1, mlp_only_layers=[], **MOE)),
    "mixtral": ("MixtralForCausalLM", dict(tie_word_embeddings=False, num_local_experts=4, intermediate_size=64,
                                           num_experts_per_tok=2, sliding_window=None)),
}
MOE_FAMILIES = ("qwen3_moe", "mixtral")


def _config(model_type: str, vocab_size: int, ids: dict):
    from transformers import AutoConfig

    arch, extra = FAMILIES[model_type]
    kwargs = {**COMMON, **extra}
    if model_type == "phi3":  # Phi-3 has no head_dim key: hidden / heads
        kwargs.pop("head_dim")
    config = AutoConfig.for_model(model_type, vocab_size=vocab_size, dtype="float32", **kwargs, **ids)
    config.architectures = [arch]
    return config


def build_family(model_type: str, root: str, seed: int = 0) -> str:
    """The tiny `model_type` model's folder under `root` (built once)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from distflow.models.tiny import EOS, PAD, build_tiny_model

    def build(tmp: Path) -> None:
        tok = AutoTokenizer.from_pretrained(build_tiny_model())
        tok.save_pretrained(tmp)
        pad_id, eos_id = tok.convert_tokens_to_ids([PAD, EOS])
        config = _config(model_type, -(-len(tok) // 64) * 64, dict(bos_token_id=pad_id, eos_token_id=eos_id,
                                                                      pad_token_id=pad_id))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            with torch.no_grad():  # some families start norms at 0 or 1 exactly: make every weight matter
                for p in model.parameters():
                    if p.dim() == 1:
                        p.add_(torch.randn_like(p) * 0.1)
        model.save_pretrained(tmp, safe_serialization=True)
        (tmp / ".complete").write_text(json.dumps({"model_type": model_type}))

    return build_once(Path(root) / f"tiny-{model_type}", lambda p: (p / ".complete").is_file(), build)
