"""Mixture-of-experts routers in the policy's forward: the auxiliary load-balancing loss
(model.router_aux_loss_coef) and how evenly each layer's router spreads tokens over its experts.

transformers computes both from the router logits a MoE model returns with
output_router_logits=True: `aux_loss` is the Switch Transformer loss (load_balancing_loss_func,
the one the model's own pre-training added with its config's router_aux_loss_coef), over the
tokens the attention mask keeps. The load ratio here is the busiest expert's share of a layer's
top-k picks over the mean share (1: perfectly even; E / k: every token to the same k experts),
averaged over layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distflow.models.anatomy import experts_of


def aux_loss_coef(config, asked: float | None) -> float:
    """The load-balancing loss's weight: `asked` (model.router_aux_loss_coef), else the config's own;
    a weight above 0 for a model without experts is a config mistake."""
    from distflow.config import ConfigError

    if experts_of(config) is None:
        if asked:
            raise ConfigError(f"model.router_aux_loss_coef={asked} but {config.model_type} has no experts to balance "
                              "(a mixture-of-experts model only)")
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if asked is None else float(asked)


@dataclass(frozen=True)
class RouterStats:
    aux_loss: torch.Tensor  # scalar, differentiable
    load_max_over_mean: torch.Tensor  # scalar, detached


def router_stats(output, attention_mask: torch.Tensor, experts: int, top_k: int) -> RouterStats:
    """`output`: a MoE model's forward output with router logits ([tokens, experts] per layer)."""
    keep = attention_mask.reshape(-1).bool()
    ratios = []
    with torch.no_grad():
        for logits in output.router_logits:
            picks = logits[keep].topk(top_k, dim=-1).indices.reshape(-1)
            load = torch.bincount(picks, minlength=experts).float()
            ratios.append(load.max() / load.mean().clamp_min(1e-9))
    return RouterStats(output.aux_loss, torch.stack(ratios).mean())
