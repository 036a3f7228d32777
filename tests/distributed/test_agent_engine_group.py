"""Harness episodes on a tensor-parallel engine group: the ranks of a group step one engine together
(distflow.rollout.engine_group), while each rank serves its own endpoint and runs its own harnesses.

Two gloo ranks form one group over the step-wise transformers engine (each rank runs the same
engine calls on its copy, as vLLM's workers do on their slices). The ranks run different numbers
of episodes, and rank 1's harness works between its requests: each rank joins a group step once its
own wave is ready and keeps joining after its episodes are over, so nothing hangs, each rank's
rows are, id for id, what its own endpoint answered, and its tokens equal those of the same
episodes on an engine of its own. Run twice, the group's rows are bit-identical (wave mode).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

import agents_for_tests
from dist_helpers import gathered, run_distributed
from distflow.config import DistflowConfig
from distflow.rollout.agents.episodes import AgentRunner
from distflow.rollout.engine_group import EngineGroup
from distflow.rollout.hf_engine import HFEngine


def _cfg(model_dir) -> DistflowConfig:
    return DistflowConfig.from_dict({
        "model": {"path": model_dir, "dtype": "float32"},
        "task": {"path": "unused.jsonl", "agent": "agents_for_tests:dispatch"},
        "rollout": {"engine": "hf", "max_new_tokens": 8, "max_turns": 3, "max_total_tokens": 192,
                    "max_prompt_tokens": 128}}).validate()


def _rows(groups):
    return [(s.prompt_ids, s.response_ids, s.logprobs, s.mask) for g in groups for s in g]


def _worker(rank, world, model_dir):
    cfg = _cfg(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    # rank 0: three ReAct episodes; rank 1: one harness that works 0.3 s between its two requests
    kinds = ["react", "react", "react"] if rank == 0 else ["slow"]
    items, seeds = agents_for_tests.items(tok, kinds), [10 * rank + k for k in range(len(kinds))]
    group = EngineGroup(HFEngine(model_dir, cfg.model, cfg.rollout, torch.device("cpu")), dist.group.WORLD)
    runner = AgentRunner(group, tok, cfg, agents_for_tests.dispatch)
    agents_for_tests.RECORD.clear()
    start = time.monotonic()
    first = runner.run(items, 1, seeds)
    took = time.monotonic() - start
    records = dict(agents_for_tests.RECORD)
    answered = [records[f"{runner.endpoint.url}/e/{k + 1}/v1"]["turns"] for k in range(len(kinds))]
    second = runner.run(items, 1, seeds)
    runner.close()
    alone = AgentRunner(HFEngine(model_dir, cfg.model, cfg.rollout, torch.device("cpu")), tok, cfg,
                        agents_for_tests.dispatch)
    solo = alone.run(items, 1, seeds)
    alone.close()
    return gathered({"first": _rows(first), "second": _rows(second), "solo": _rows(solo), "answered": answered,
                     "took": took, "left": group.pending()})


def test_harness_episodes_step_one_engine_group_together(tiny_model_dir):
    ranks = run_distributed(_worker, 2, tiny_model_dir, timeout=240)
    for r in ranks:
        assert r["left"] == 0 and r["took"] < 60, r["took"]
        assert r["first"] == r["second"]  # bit for bit: the group's steps do not depend on timing
        assert [row[1] for row in r["first"]] == [row[1] for row in r["solo"]]  # the same tokens alone
        for (prompt, response, logprobs, mask), turns in zip(r["first"], r["answered"]):
            assert len(turns) >= 2
            assert prompt + response == turns[-1]["prompt"] + turns[-1]["ids"]
            assert [t for t, m in zip(response, mask) if m] == [t for turn in turns for t in turn["ids"]]
    assert len(ranks[0]["first"]) == 3 and len(ranks[1]["first"]) == 1
