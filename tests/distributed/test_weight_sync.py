"""After the policy's weights change, a resync makes each rank's engine agree with the policy.

Real gloo ranks, a real FSDP2 policy and a real engine per rank. The check can fail both ways:
before the resync the engine must disagree (the perturbation is visible), after it the engine
logprobs must equal the policy's on the same token ids (fp32, max abs 1e-5), also on the longest
sequence the trainer's probe resubmits (a full-length prompt plus a response cut at max_new_tokens).
"""

import importlib.util

import pytest
import torch

from dist_helpers import gathered, run_distributed
from engine_helpers import perturb_and_resync
from config_helpers import fp32_config
from distflow.probe import max_logprob_diff
from distflow.train.weight_stream import full_parameters
from distflow.train.batch import TokenBatch
from distflow.distributed.layout import ParallelLayout
from distflow.train.policy import Policy
from distflow.rollout import build_engine
from distflow.sample import Sample


def _worker(rank, world, model_dir, engine_name):
    cfg = fp32_config()
    cfg.rollout.engine = engine_name
    cfg.rollout.max_new_tokens = 8
    engine = build_engine(model_dir, cfg.model, cfg.rollout, torch.device("cpu"), seed=0)
    policy = Policy(model_dir, cfg.model, cfg.optim, ParallelLayout.current(cfg.model))
    seqs = [[5 + rank, 17, 42, 99, 7, 64, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
    before, stale, after = perturb_and_resync(engine, policy, seqs, seed=100 + rank)
    # generation uses the new weights too: greedy tokens follow the policy's argmax
    sample = engine.generate([seqs[0]], 1, [0], greedy=True)[0][0]
    with torch.no_grad():
        b = TokenBatch.from_samples([Sample(seqs[0], sample.response_ids, [], False)], 0, torch.device("cpu"))
        logits = policy.model(input_ids=b.input_ids).logits[0]
    start = len(seqs[0])
    assert logits.shape[0] == start + len(sample.response_ids), (logits.shape, start, len(sample.response_ids))
    # every generated token, the last one (EOS or the max_new_tokens-th) included
    policy_greedy = [int(logits[start - 1 + i].argmax()) for i in range(len(sample.response_ids))]
    # the longest sequence the probe resubmits: a prompt of exactly rollout.max_prompt_tokens (the data
    # keeps it: unit/test_data.py) and a response cut at max_new_tokens, as one prompt of the engine
    g = torch.Generator().manual_seed(rank)
    longest = torch.randint(3, 200, (cfg.rollout.max_prompt_tokens,), generator=g).tolist()
    cut = engine.generate([longest], 1, [1])[0][0]
    probe = max_logprob_diff(engine, policy, [longest + cut.response_ids], 0)
    every_rank = gathered({"before": before, "stale": stale, "after": after, "response": list(sample.response_ids),
                           "policy_greedy": policy_greedy, "longest": (len(longest), cut.truncated, probe)})
    engine.shutdown()
    return every_rank


@pytest.mark.parametrize("engine_name", [
    pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")]),
    "hf",
])
def test_resync_makes_engine_match_policy(tiny_model_dir, engine_name):
    for r in run_distributed(_worker, 2, tiny_model_dir, engine_name, timeout=600):
        assert r["before"] <= 1e-5, r
        assert r["stale"] > 1e-3, r  # the perturbation is visible before the resync
        assert r["after"] <= 1e-5, r
        # a one-token response would only check the first step: the comparison needs several
        assert len(r["response"]) > 1, r
        assert r["response"] == r["policy_greedy"], r
        length, truncated, probe = r["longest"]
        assert length == 256 and truncated and probe <= 1e-5, r["longest"]


def _gather_bytes_worker(rank, world, model_dir):
    """Bytes each rank puts into the resync's all-gathers, per dtype, on a plain FSDP mesh."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class GatherBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes, self.dtypes = 0, set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "all_gather" in str(func):
                self.bytes += args[0].numel() * args[0].element_size()
                self.dtypes.add(str(args[0].dtype))
            return func(*args, **(kwargs or {}))

    cfg = fp32_config()
    cfg.model.shard_ranks = -1  # plain FSDP: every parameter is a shard to gather
    policy = Policy(model_dir, cfg.model, cfg.optim, ParallelLayout.current(cfg.model))
    shard_numel = sum(p.to_local().numel() for p in policy.model.parameters())
    result = {"shard_numel": shard_numel}
    for dtype in (torch.float32, torch.bfloat16):
        with GatherBytes() as mode:
            full = dict(full_parameters(policy.model, dtype, bucket_bytes=1 << 16))
        result[str(dtype)] = {"bytes": mode.bytes, "dtypes": sorted(mode.dtypes),
                              "out": sorted({str(t.dtype) for t in full.values()})}
    return gathered(result)


def test_resync_casts_shards_before_gathering(tiny_model_dir):
    """bf16 engines get bf16 over the link: half the bytes of the fp32 master weights."""
    for r in run_distributed(_gather_bytes_worker, 2, tiny_model_dir):
        fp32, bf16 = r["torch.float32"], r["torch.bfloat16"]
        assert fp32["bytes"] == 4 * r["shard_numel"] and fp32["dtypes"] == ["torch.float32"], r
        assert bf16["bytes"] == 2 * r["shard_numel"] and bf16["dtypes"] == ["torch.bfloat16"], r
        assert bf16["out"] == ["torch.bfloat16"] and fp32["out"] == ["torch.float32"]


@pytest.mark.parametrize("diff,dtype,stops", [
    (1e-6, "float32", False), (1.3e-4, "float32", False), (5e-3, "float32", True),
    (0.3, "bfloat16", False), (1.3, "bfloat16", False), (5.0, "bfloat16", True), (float("nan"), "float32", False),
])
def test_probe_limit_depends_on_the_dtype(diff, dtype, stops):
    from distflow.probe import mismatch_line

    line = mismatch_line(diff, dtype, "qwen3_moe", "step 3")
    assert (line is not None) is stops
    if stops:
        assert line.startswith("step 3: the engine's logprobs differ") and "qwen3_moe" in line, line
        assert "run.allow_engine_mismatch=true" in line and "\n" not in line, line
