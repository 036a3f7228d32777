"""The weight names an engine's loaders read: a model folder's (checkpoint) names, not the ones
transformers gives parameters in memory."""

from __future__ import annotations

from typing import Iterable, Iterator

import torch


class CheckpointNames:
    """Renames a resync stream from transformers' in-memory parameter names to the names its model
    folders hold, which is what vLLM's loaders read.

    transformers 5 fuses and renames some weights when it loads them: a mixture-of-experts layer's
    per-expert `experts.<i>.gate_proj/up_proj/down_proj` become one `experts.gate_up_proj`
    [E, 2I, H] and one `experts.down_proj` [E, H, I], and Mixtral's `block_sparse_moe` becomes `mlp`.
    vLLM's Mixtral loader refuses the in-memory names outright ("no module named layers.0.mlp"), so
    the engine gets what `save_pretrained` would have written: the reversal of transformers' own
    conversion table (`revert_weight_conversion`), applied one module's parameters at a time so
    that no more than one module's weights are held at once.
    Dense families have no conversion and pass through untouched."""

    def __init__(self, config, trust_remote_code: bool = False):
        """`config`: the model folder's transformers config."""
        from transformers import AutoModelForCausalLM

        from distflow.models.anatomy import skeleton

        self.model = skeleton(AutoModelForCausalLM, config, trust_remote_code)
        self.revert = _reverter(self.model)

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        if self.revert is None:
            yield from weights
            return
        group: dict[str, torch.Tensor] = {}
        for name, t in weights:
            if group and _module_of(name) != _module_of(next(iter(group))):
                yield from self.revert(self.model, group).items()
                group = {}
            group[name] = t
        if group:
            yield from self.revert(self.model, group).items()


def _module_of(name: str) -> str:
    return name.rpartition(".")[0]


def _reverter(model: torch.nn.Module):
    """transformers' `revert_weight_conversion` where `model` has conversions to revert, else None."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, revert_weight_conversion
    except ImportError:  # a transformers without load-time conversions stores what it loads
        return None
    # the same selection revert_weight_conversion makes for a model not loaded by from_pretrained
    conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
    return revert_weight_conversion if conversions else None
