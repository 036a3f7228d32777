"""What a model is, as both wings see it: its decoder blocks (FSDP2's units, LoRA's default
targets), its experts, and its meta-device skeleton (a model with no memory, to read its shape or
names from). `distflow.train` shards and trains these; `distflow.rollout` only reads them (the
engine's LoRA slots, the weight names its loaders expect).
"""

from __future__ import annotations

import copy

import torch


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        layers = next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), None)
    if layers is None:
        raise ValueError(f"cannot find the decoder blocks of {type(model).__name__} to shard")
    return list(layers)


def default_targets(blocks: list[torch.nn.Module]) -> list[str]:
    """The leaf names of every nn.Linear inside the decoder blocks (q_proj, ..., down_proj)."""
    names = {name.rsplit(".", 1)[-1] for block in blocks for name, m in block.named_modules()
             if isinstance(m, torch.nn.Linear)}
    return sorted(names)


def experts_of(config) -> tuple[int, int] | None:
    """(experts per layer, experts per token) of a mixture-of-experts config, else None."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    return (int(experts), int(top_k)) if experts and top_k else None


def attention_kwargs(config) -> dict:
    """Soft-capped attention scores (Gemma 2) are computed only by transformers' eager attention:
    its SDPA path drops the cap, and the policy would then differ from the engine, which applies
    it. Every other model keeps transformers' default (SDPA)."""
    return {"attn_implementation": "eager"} if getattr(config, "attn_logit_softcapping", None) else {}


def skeleton(auto_cls, config, trust_remote_code: bool = False) -> torch.nn.Module:
    """`auto_cls`'s model for `config` (fp32, as the full load) with every parameter and buffer on
    the meta device: no memory and no init work. It draws nothing from the global RNG, so rank 0's
    load in `materialize` draws exactly what every rank's load drew before (the critic's fresh
    head depends on it)."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        return auto_cls.from_config(copy.deepcopy(config), dtype=torch.float32, trust_remote_code=trust_remote_code,
                                    **attention_kwargs(config))
