"""Mixture-of-experts routers in the update: the auxiliary load-balancing loss and the load metric.

Two real gloo ranks train a tiny Qwen3-MoE under plain FSDP2 with zero advantages, so the policy
loss has no gradient and every gradient is model.router_aux_loss_coef times the routers' loss.
It must equal a single unsharded transformers model's gradient of coef x the mean over ranks of
each rank's Switch Transformer loss, written out here from its definition (token fractions per
expert times mean router probabilities, times the expert count, over the unpadded tokens). The
load metric is checked against the same router logits counted independently.
"""

from __future__ import annotations

import pytest
import torch

from config_helpers import fp32_config
from dist_helpers import gathered, run_distributed
from grad_helpers import assert_grads_close, fixed_batch, full_grads, update_batch
from model_families import build_family

COEF = 0.5


def switch_loss(router_logits, attention_mask, experts: int, top_k: int) -> torch.Tensor:
    """E * sum_e f_e * P_e over every layer's unpadded tokens (Switch Transformer, eq. 4-6)."""
    keep = attention_mask.reshape(-1).bool()
    logits = torch.cat([layer[keep] for layer in router_logits])
    probs = logits.softmax(-1)
    chosen = torch.zeros_like(probs).scatter(1, probs.topk(top_k, dim=-1).indices, 1.0)
    return experts * (chosen.mean(0) * probs.mean(0)).sum()  # f_e: share of tokens with e among their top k


def _load_ratio(router_logits, attention_mask, experts, top_k) -> float:
    keep = attention_mask.reshape(-1).bool()
    ratios = []
    for layer in router_logits:
        counts = [0] * experts
        for row in layer[keep].tolist():
            for e in sorted(range(experts), key=lambda i: -row[i])[:top_k]:
                counts[e] += 1
        ratios.append(max(counts) / (sum(counts) / experts))
    return sum(ratios) / len(ratios)


def _worker(rank, world, model_dir):
    from transformers import AutoModelForCausalLM

    from distflow.distributed.layout import ParallelLayout
    from distflow.train.batch import TokenBatch
    from distflow.train.policy import Policy
    from distflow.train.update import Updater

    cfg = fp32_config()
    cfg.model.shard_ranks, cfg.model.router_aux_loss_coef = -1, COEF
    cfg.optim.micro_batch_size = 8  # one pass per rank: the reference below is one forward per rank
    cfg.algorithm.kl_coef = cfg.algorithm.entropy_coef = 0.0
    samples, _, _ = fixed_batch(vocab=200, n=8)
    halves = [samples[:4], samples[4:]]
    policy = Policy(model_dir, cfg.model, cfg.optim, ParallelLayout.current(cfg.model))
    batch = update_batch(halves[rank], torch.zeros(4))  # zero advantages: only the routers' loss has a gradient
    sums = Updater(cfg, 0).backward_policy(policy, batch, list(range(len(batch))))
    grads = full_grads(policy.model)
    # the reference: one unsharded model, every rank's half
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    experts, top_k = ref.config.num_experts, ref.config.num_experts_per_tok
    total, loads, auxes = 0.0, [], []
    for half in halves:
        tokens = TokenBatch.from_samples(half, 0, torch.device("cpu"))
        out = ref(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, position_ids=tokens.position_ids,
                  output_router_logits=True)
        aux = switch_loss(out.router_logits, tokens.attention_mask, experts, top_k)
        total = total + COEF * aux / world
        auxes.append(float(aux))
        loads.append(_load_ratio(out.router_logits, tokens.attention_mask, experts, top_k))
    total.backward()
    expected = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
    return gathered({"grads": grads, "expected": expected, "aux": (sums.moe_aux, auxes[rank]),
                     "load": (sums.moe_load, loads[rank]), "passes": sums.moe_passes})


@pytest.mark.slow
def test_router_loss_gradient_and_load_metric_under_fsdp(tmp_path):
    model_dir = build_family("qwen3_moe", str(tmp_path))
    for r in run_distributed(_worker, 2, model_dir):
        assert r["passes"] == 1
        measured, reference = r["aux"]
        assert measured == pytest.approx(reference, rel=1e-5) and reference > 1.0  # top_k = 2 when even
        assert r["load"][0] == pytest.approx(r["load"][1], rel=1e-6) and r["load"][1] > 1.0
        grads, expected = r["grads"], r["expected"]
        moved = {n for n, g in grads.items() if g.abs().max() > 0}
        assert any("mlp.gate" in n for n in moved) and moved <= set(expected), sorted(moved ^ set(expected))
        assert_grads_close(expected, {n: grads[n] for n in expected}, 1e-4, "router loss")
