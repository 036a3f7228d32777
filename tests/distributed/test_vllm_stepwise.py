"""The vLLM engine step by step (submit / step / abort) on a real vLLM-CPU engine in a gloo rank:
its blocking generate, now submit-all-then-step, samples exactly the tokens and logprobs vLLM's own
LLM.generate sampled with the same seeds; requests join a running engine, honour their own
max_tokens and ignore_eos, and an abort hands back what was generated."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from config_helpers import fp32_config
from dist_helpers import run_distributed
from distflow.rollout import build_engine
from distflow.rollout.base import Request

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")]

PROMPTS = [[5, 17, 42, 99, 7], [11, 12, 13], [3, 30, 300, 31, 32, 33, 34, 35]]
SEEDS = [7, 8, 9]


def _llm_generate(engine, prompts, n, seeds, max_tokens):
    """What the engine's generate was: one LLM.generate call, each prompt with its seed (FINAL_ONLY)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(n=n, temperature=1.0, top_p=1.0, max_tokens=max_tokens, logprobs=0, seed=s,
                             detokenize=False) for s in seeds]
    outs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [[(list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]) for c in o.outputs]
            for o in outs]


def _worker(rank, world, model_dir):
    cfg = fp32_config()
    cfg.rollout.engine, cfg.rollout.max_new_tokens = "vllm", 12
    engine = build_engine(model_dir, cfg.model, cfg.rollout, torch.device("cpu"), seed=0)
    out = {}
    reference = _llm_generate(engine, PROMPTS, 4, SEEDS, 12)
    stepped = engine.generate(PROMPTS, 4, SEEDS)
    out["same"] = [[(s.response_ids, s.logprobs) for s in group] for group in stepped] == reference
    out["lengths"] = [len(s.response_ids) for group in stepped for s in group]
    # a request joins a running engine; each keeps its own budget
    engine.submit(Request("a", PROMPTS[0], 2, 1))
    first = engine.step()
    engine.submit(Request("b", PROMPTS[1], 3, 2, max_tokens=5, ignore_eos=True))
    done = dict(first)
    steps = 1
    while engine.pending():
        done.update(engine.step())
        steps += 1
    out["joined"] = sorted(done), [len(done["a"]), len(done["b"])], [len(s.response_ids) for s in done["b"]], \
        all(s.truncated for s in done["b"])
    # an abort returns the samples as far as they got, and the id may be used again
    engine.submit(Request("c", PROMPTS[2], 2, 3, max_tokens=12, ignore_eos=True))
    for _ in range(4):
        engine.step()
    partial = engine.abort(["c", "never-submitted"])
    out["aborted"] = sorted(partial), [len(s.response_ids) for s in partial["c"]], engine.pending(), \
        all(s.truncated and len(s.logprobs) == len(s.response_ids) for s in partial["c"])
    engine.submit(Request("c", PROMPTS[2], 1, 3))
    while engine.pending():
        engine.step()
    engine.load_weights([], version=3)
    out["version"] = engine.version
    engine.shutdown()
    return out


def test_generate_by_steps_is_llm_generate_and_requests_join_and_abort(tiny_model_dir):
    r = run_distributed(_worker, 1, tiny_model_dir, timeout=600)
    assert r["same"], "generate over engine steps must sample exactly what LLM.generate sampled"
    assert len(r["lengths"]) == 12 and max(r["lengths"]) > 1, r["lengths"]
    assert r["joined"] == (["a", "b"], [2, 3], [5, 5, 5], True), r["joined"]
    names, lengths, pending, kept = r["aborted"]
    assert names == ["c"] and pending == 0 and kept, r["aborted"]
    assert len(lengths) == 2 and all(0 < n < 12 for n in lengths), lengths  # cut after a few steps
    assert r["version"] == 3
