"""The perturb-and-resync check shared by the weight-sync and tensor-parallel tests."""

from __future__ import annotations

import torch

from distflow.train.weight_stream import full_parameters
from distflow.sample import Sample
from distflow.train.batch import TokenBatch


def inspect_models_in_process() -> None:
    """vLLM inspects a model class it has no cached record of (~/.cache/vllm/modelinfos, empty on a
    fresh machine) in a new Python process that imports vLLM again: 10-20 s per architecture on
    two busy cores. It does so to keep CUDA out of the parent; a CPU test process has none, so
    inspect here."""
    from vllm.model_executor.models import registry

    registry._run_in_subprocess = lambda fn: fn()


def fast_exit_teardown() -> None:
    """For a test process about to exit with vLLM engines alive: each engine's shutdown (the last
    one's, and the rest's finalizers at exit) collects the whole heap twice, ~1 s each once a few
    dozen engines' objects are unfrozen; memory freed just before the process ends is worth nothing."""
    import gc

    gc.collect = lambda generation=2: 0


def policy_logprobs(policy, seqs):
    batch = TokenBatch.from_samples([Sample(s[:1], s[1:], [], False) for s in seqs], 0, torch.device("cpu"))
    with torch.no_grad():
        lp = policy.logprobs(batch)
    return [lp[i, : len(s) - 1] for i, s in enumerate(seqs)]


def max_diff(engine_lp, policy_lp):
    """Max |engine - policy| logprob; every sequence must be answered in full (no vacuous match)."""
    assert len(engine_lp) == len(policy_lp) > 0, (len(engine_lp), len(policy_lp))
    for e, p in zip(engine_lp, policy_lp, strict=True):
        assert len(e) == p.numel() > 0, (len(e), p.numel())
    diffs = [(torch.tensor(e, dtype=torch.float32) - p).abs() for e, p in zip(engine_lp, policy_lp, strict=True)]
    assert all(bool(torch.isfinite(d).all()) for d in diffs), diffs
    return max(float(d.max()) for d in diffs)


def perturb_and_resync(engine, policy, seqs, seed: int) -> tuple[float, float, float]:
    """Max |engine - policy| logprob on `seqs` before a perturbation of every parameter shard (the
    tied embedding too), after it, and after streaming the perturbed weights into the engine."""
    before = max_diff(engine.prompt_logprobs(seqs), policy_logprobs(policy, seqs))
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for p in policy.model.parameters():
            local = p.to_local()
            local.add_(torch.randn(local.shape, generator=g) * 0.05)
    stale = max_diff(engine.prompt_logprobs(seqs), policy_logprobs(policy, seqs))
    engine.load_weights(full_parameters(policy.model, torch.float32, bucket_bytes=1 << 16))
    after = max_diff(engine.prompt_logprobs(seqs), policy_logprobs(policy, seqs))
    return before, stale, after


def perturb_adapters_and_load(engine, policy, seqs, seed: int) -> tuple[float, float, float]:
    """The adapter resync's counterpart of perturb_and_resync, for a LoRA policy and an engine built
    for model.lora.resync=adapter: max |engine - policy| logprob with the fresh adapter (B = 0, the
    engine serving the base it loaded), after a perturbation of every adapter shard (B != 0), and
    after the engine loaded the adapter."""
    from distflow.train.lora import adapter_tensors, is_adapter_key

    fresh = max_diff(engine.prompt_logprobs(seqs), policy_logprobs(policy, seqs))
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for name, p in policy.model.named_parameters():
            if is_adapter_key(name):
                local = p.to_local()
                local.add_(torch.randn(local.shape, generator=g) * 0.05)
    stale = max_diff(engine.prompt_logprobs(seqs), policy_logprobs(policy, seqs))
    engine.load_adapter(adapter_tensors(policy.model), policy.adapter_config)
    after = max_diff(engine.prompt_logprobs(seqs), policy_logprobs(policy, seqs))
    return fresh, stale, after
