"""The HF engine as a batched, step-wise decoder: every running sample is a row of one batch that
requests join (a prefill, their cache merged into the running one) and leave between steps.

The reference is a plain decoder written here: one request at a time, no cache, a full forward
for every token, transformers' own warpers, the request's own generator. The batched engine must
sample what it samples, whatever else runs beside it and whenever it was submitted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from config_helpers import fp32_config

from distflow.rollout.base import Request
from distflow.rollout.hf_engine import HFEngine

TEMPERATURE, TOP_P, MAX_NEW = 0.7, 0.9, 10
CPU = torch.device("cpu")


def _engine(model_dir: str, dtype: str = "float32") -> HFEngine:
    cfg = fp32_config()
    cfg.model.dtype = dtype
    cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.max_new_tokens = TEMPERATURE, TOP_P, MAX_NEW
    return HFEngine(model_dir, cfg.model, cfg.rollout, CPU)


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> HFEngine:
    return _engine(tiny_model_dir)


@torch.no_grad()
def reference(model, eos_ids: set[int], req: Request) -> list[tuple[list[int], list[float], bool]]:
    """(tokens, logprobs, truncated) of each of the request's samples: its rows in lockstep, the
    finished ones dropped, a full forward over every running row's whole sequence per token."""
    warpers = [TemperatureLogitsWarper(TEMPERATURE), TopPLogitsWarper(TOP_P)]
    gen = torch.Generator().manual_seed(req.seed)
    limit = req.max_tokens or MAX_NEW
    rows = [([], [], True) for _ in range(req.n)]
    running = list(range(req.n))
    while running:
        ids = torch.tensor([req.prompt_ids + rows[i][0] for i in running])
        logits = model(input_ids=ids).logits[:, -1].float()
        if req.greedy:
            scores, tokens = logits, logits.argmax(-1)
        else:
            scores = logits
            for w in warpers:
                scores = w(ids, scores)
            tokens = torch.multinomial(torch.softmax(scores, -1), 1, generator=gen).squeeze(1)
        lps = torch.log_softmax(scores, -1).gather(-1, tokens[:, None]).squeeze(-1)
        still = []
        for i, tok, lp in zip(running, tokens.tolist(), lps.tolist()):
            rows[i][0].append(tok)
            rows[i][1].append(lp)
            if tok in eos_ids and not req.ignore_eos:
                rows[i] = (rows[i][0], rows[i][1], False)
            elif len(rows[i][0]) < limit:
                still.append(i)
        running = still
    return rows


def assert_matches(engine: HFEngine, req: Request, samples, atol: float = 1e-5) -> None:
    expected = reference(engine.model, engine.eos_ids, req)
    assert len(samples) == req.n
    for s, (tokens, lps, truncated) in zip(samples, expected):
        assert s.prompt_ids == req.prompt_ids
        assert s.response_ids == tokens, req.request_id
        assert s.truncated is truncated
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(lps), atol=atol, rtol=0)


def run_all(engine: HFEngine, schedule: dict[int, list[Request]]) -> tuple[dict, int]:
    """Step until idle, submitting schedule[k] before step k; the finished samples by id and the steps."""
    done, k = {}, 0
    while engine.pending() or any(step >= k for step in schedule):
        for req in schedule.get(k, []):
            engine.submit(req)
        for rid, samples in engine.step():
            assert rid not in done
            done[rid] = samples
        k += 1
    return done, k


PROMPTS = {"a": [5, 17, 42, 99, 7, 64, 3], "b": [11, 12], "c": [3], "d": [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30],
           "e": [40, 41, 42, 43]}


def _req(rid: str, n: int, seed: int, **kw) -> Request:
    return Request(rid, PROMPTS[rid[0]], n, seed, **kw)


def test_all_submitted_at_once_equals_the_reference(engine):
    reqs = [_req("a", 3, 1), _req("b", 1, 2), _req("c", 2, 3, max_tokens=4), _req("d", 4, 4, max_tokens=7)]
    done, steps = run_all(engine, {0: reqs})
    assert steps == MAX_NEW and set(done) == {"a", "b", "c", "d"}
    for req in reqs:
        assert_matches(engine, req, done[req.request_id])


def test_requests_joining_a_running_batch_equal_the_reference(engine):
    """Joiners with shorter and longer prompts than the running rows' context, one-token prompts,
    joining after others left: every cache merge and column cut on the way."""
    schedule = {0: [_req("b", 2, 5, max_tokens=3), _req("e", 1, 6)],
                2: [_req("d", 2, 7, max_tokens=4), _req("c", 3, 8)],
                4: [_req("a", 2, 9, max_tokens=12)],
                5: [_req("c2", 1, 10, max_tokens=2), _req("b2", 2, 11, greedy=True, max_tokens=5)],
                13: [_req("e2", 2, 12, max_tokens=3)]}
    done, _ = run_all(engine, schedule)
    reqs = [r for rs in schedule.values() for r in rs]
    assert set(done) == {r.request_id for r in reqs}
    for req in reqs:
        assert_matches(engine, req, done[req.request_id])


def test_a_requests_samples_do_not_depend_on_what_else_runs(engine):
    alone, _ = run_all(engine, {0: [_req("a", 3, 21)]})
    crowded, _ = run_all(engine, {0: [_req("d", 4, 22), _req("a", 3, 21), _req("c", 2, 23)],
                                  3: [_req("b", 5, 24)]})
    late, _ = run_all(engine, {0: [_req("d", 4, 22)], 3: [_req("a", 3, 21)]})
    for other in (crowded, late):
        for s, t in zip(alone["a"], other["a"]):
            assert s.response_ids == t.response_ids
            torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(t.logprobs), atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def eos_engine(tiny_model_dir, tmp_path_factory) -> tuple[HFEngine, int]:
    """The tiny model in a folder whose generation config also ends sequences at the token that
    the first sample of EOS_REQ draws fourth (and not before)."""
    plain = _engine(tiny_model_dir)
    first = reference(plain.model, plain.eos_ids, EOS_REQ)[0][0]
    stop = first[3]
    assert stop not in first[:3] and stop not in plain.eos_ids
    folder = tmp_path_factory.mktemp("eos_model")
    for f in Path(tiny_model_dir).iterdir():
        if f.is_file() and f.name != "generation_config.json":
            os.symlink(f, folder / f.name)
    gen = json.loads((Path(tiny_model_dir) / "generation_config.json").read_text())
    gen["eos_token_id"] = sorted(plain.eos_ids | {stop})
    (folder / "generation_config.json").write_text(json.dumps(gen))
    return _engine(str(folder)), stop


EOS_REQ = Request("e", PROMPTS["e"], 4, 0)


def test_eos_max_tokens_ignore_eos_and_greedy(eos_engine):
    engine, stop = eos_engine
    assert stop in engine.eos_ids
    reqs = [EOS_REQ, _req("e2", 4, 0, ignore_eos=True), _req("a", 2, 0, greedy=True, max_tokens=6),
            _req("b", 3, 31, max_tokens=5), _req("d", 2, 32, ignore_eos=True, max_tokens=8)]
    done, _ = run_all(engine, {0: reqs})
    for req in reqs:
        assert_matches(engine, req, done[req.request_id])
    ended = done["e"][0]  # ended by EOS; its siblings went on without it
    assert len(ended.response_ids) == 4 and ended.response_ids[-1] == stop and not ended.truncated
    assert max(len(s.response_ids) for s in done["e"][1:]) > 4
    ignored = done["e2"][0]  # the same draws, EOS ignored: it goes on to max_new_tokens
    assert ignored.response_ids[:4] == ended.response_ids and len(ignored.response_ids) == MAX_NEW
    assert ignored.truncated
    assert [s.response_ids for s in done["a"]] == [[3] * 6] * 2  # the tiny model's argmax repeats itself
    assert all(len(s.response_ids) <= 5 for s in done["b"])
    assert all(len(s.response_ids) == 8 and s.truncated for s in done["d"])


def test_abort_returns_partials_and_the_id_can_come_back(engine):
    engine.submit(_req("a", 2, 41))
    engine.submit(_req("b", 3, 42, max_tokens=2))
    assert engine.pending() == 2
    assert engine.step() == [] and engine.step()[0][0] == "b"  # b is done after its 2 tokens
    engine.step()
    engine.submit(_req("c", 2, 43))  # still queued when aborted
    engine.submit(_req("d", 1, 44))
    assert engine.pending() == 3
    out = engine.abort(["a", "c", "unknown"])
    assert set(out) == {"a", "c"} and engine.pending() == 1
    assert [len(s.response_ids) for s in out["a"]] == [3, 3] and all(s.truncated for s in out["a"])
    assert [len(s.logprobs) for s in out["a"]] == [3, 3]
    assert [s.response_ids for s in out["c"]] == [[], []]
    full = reference(engine.model, engine.eos_ids, _req("a", 2, 41))
    assert [s.response_ids for s in out["a"]] == [t[:3] for t, _, _ in full]  # the first steps of the full run
    with pytest.raises(ValueError, match="already pending"):
        engine.submit(_req("d", 1, 45))
    engine.submit(_req("a", 2, 41))  # an aborted id can be submitted again, and starts over
    done, _ = run_all(engine, {})
    assert set(done) == {"a", "d"} and engine.pending() == 0
    assert_matches(engine, _req("a", 2, 41), done["a"])
    assert_matches(engine, _req("d", 1, 44), done["d"])


def test_generate_groups_in_prompt_order_deterministically(engine):
    prompts = [PROMPTS["d"], PROMPTS["c"], PROMPTS["a"]]
    first = engine.generate(prompts, 3, [7, 8, 9])
    again = engine.generate(prompts, 3, [7, 8, 9])
    assert [[s.prompt_ids for s in g] for g in first] == [[p] * 3 for p in prompts]
    assert [[(s.response_ids, s.logprobs) for s in g] for g in first] == \
        [[(s.response_ids, s.logprobs) for s in g] for g in again]
    for prompt, seed, group in zip(prompts, [7, 8, 9], first):
        assert_matches(engine, Request("x", prompt, 3, seed), group)
    engine.submit(_req("a", 1, 0))
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.generate(prompts, 1, [1, 2, 3])
    engine.abort(["a"])


def test_bfloat16_batches_requests_joining_midway(tiny_model_dir):
    engine = _engine(tiny_model_dir, "bfloat16")
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    schedule = {0: [_req("a", 2, 1), _req("c", 1, 2)], 3: [_req("d", 2, 3, max_tokens=4)]}
    first, _ = run_all(engine, schedule)
    again, _ = run_all(engine, schedule)
    assert first == again and set(first) == {"a", "c", "d"}
    for rid, samples in first.items():
        for s in samples:
            assert len(s.response_ids) == len(s.logprobs) == (4 if rid == "d" else MAX_NEW)
            assert all(lp <= 0 and lp > float("-inf") for lp in s.logprobs)
