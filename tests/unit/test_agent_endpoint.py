"""Harness episodes against the rank's OpenAI-compatible endpoint, with the real `openai` client,
real HTTP (uvicorn) and the real step-wise transformers engine on the tiny model: one batch of
episodes of every kind (tests/support/agents_for_tests.py) runs concurrently, and each training
row is checked token for token against what the endpoint answered; the failures end their own
episodes only, the bad requests get OpenAI's errors, and an occupied port is one line."""

from __future__ import annotations

import importlib.util
import logging
import socket
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import agents_for_tests
from launch_helpers import ROOT
from distflow.config import ConfigError, DistflowConfig
from distflow.rollout.agents.endpoint import Endpoint, build_app
from distflow.rollout.agents.episodes import AgentRunner
from distflow.rollout.hf_engine import HFEngine
from distflow.tasks.prompts import PromptItem
from distflow.train.batch import TokenBatch
from distflow.train.lm_head import token_stats
from distflow.train.shared_prefix import install, pack, plan_packed, row_tokens

KINDS = ["react", "react", "blocking", "branching", "editing", "completion", "titled", "claude", "raises", "hangs",
         "silent", "errors", "stopping"]
TIMEOUT_S = 4.0


def _cfg(tiny_model_dir, wait="wave") -> DistflowConfig:
    return DistflowConfig.from_dict({
        "model": {"path": tiny_model_dir, "dtype": "float32"},
        "task": {"path": "unused.jsonl", "agent": "agents_for_tests:dispatch"},
        "rollout": {"engine": "hf", "max_new_tokens": 8, "max_turns": 3, "max_total_tokens": 192,
                    "max_prompt_tokens": 128},
        "agent": {"episode_timeout_s": TIMEOUT_S, "wait": wait}}).validate()


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def episodes(tiny_model_dir):
    warnings = _Lines()
    logging.getLogger("distflow").addHandler(warnings)
    cfg = _cfg(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = HFEngine(tiny_model_dir, cfg.model, cfg.rollout, torch.device("cpu"))
    runner = AgentRunner(engine, tok, cfg, agents_for_tests.dispatch, exclude=agents_for_tests.is_title)
    agents_for_tests.RECORD.clear()
    start = time.monotonic()
    groups = runner.run(agents_for_tests.items(tok, KINDS), 1, list(range(100, 100 + len(KINDS))))
    took = time.monotonic() - start
    records = dict(agents_for_tests.RECORD)
    # the well-behaved kinds twice more: agent.wait=wave makes the engine's batches, so its logprobs
    # to the last bit, independent of thread timing; wait=free gives the same tokens
    twice = [runner.run(agents_for_tests.items(tok, KINDS)[:5], 1, list(range(100, 105))) for _ in range(2)]
    free = AgentRunner(HFEngine(tiny_model_dir, cfg.model, cfg.rollout, torch.device("cpu")), tok,
                       _cfg(tiny_model_dir, "free"), agents_for_tests.dispatch)
    loose = free.run(agents_for_tests.items(tok, KINDS)[:5], 1, list(range(100, 105)))
    free.close()
    # more blocking harnesses at once than a fixed thread pool would hold: each has its thread, and the
    # wave (every episode with a request out) forms instead of waiting for a thread that never frees
    crowd = [PromptItem(it.prompt_ids, it.prompt_text, it.answer, {"kind": "blocking_once"}, it.messages)
             for it in agents_for_tests.items(tok, KINDS)[:2]]
    crowded = runner.run(crowd, 40, [7, 8])
    logging.getLogger("distflow").removeHandler(warnings)
    yield {"samples": [g[0] for g in groups], "records": records, "took": took, "twice": twice, "free": loose,
           "runner": runner, "warnings": warnings.lines, "crowded": [s for g in crowded for s in g]}
    runner.close()


def _record(episodes, index):
    url = f"{episodes['runner'].endpoint.url}/e/{index + 1}/v1"  # episodes are numbered from 1 in order
    return episodes["records"].get(url, {"turns": []})


def _check_exact(sample, turns):
    """The row is the last turn's prompt and answer, as the endpoint said; its generated tokens are
    every turn's, with the engine's logprobs, in order; the rest is masked."""
    last = turns[-1]
    assert sample.prompt_ids + sample.response_ids == last["prompt"] + last["ids"]
    assert sample.prompt_ids == turns[0]["prompt"]
    generated = [t for t, m in zip(sample.response_ids, sample.mask) if m]
    assert generated == [t for turn in turns for t in turn["ids"]]
    lps = [lp for lp, m in zip(sample.logprobs, sample.mask) if m]
    assert lps == pytest.approx([lp for turn in turns for lp in turn["logprobs"]], abs=1e-6)
    assert all(lp == 0.0 for lp, m in zip(sample.logprobs, sample.mask) if not m)


def test_trained_tokens_are_the_tokens_the_endpoint_answered(episodes):
    samples = episodes["samples"]
    for i, kind in enumerate(KINDS):
        if kind in ("react", "blocking"):
            turns = _record(episodes, i)["turns"]
            assert len(turns) == {"react": 3, "blocking": 2}[kind]
            _check_exact(samples[i], turns)
            assert samples[i].episode.turns == len(turns) and samples[i].episode.restarts == 0
            assert samples[i].mask.count(0) > 0  # observations between the turns, masked
    assert samples[2].episode.env_reward == 0.25  # what the blocking harness returned
    first, second = ([(g[0].prompt_ids, g[0].response_ids, g[0].logprobs, g[0].mask) for g in run]
                     for run in episodes["twice"])
    assert first == second  # bit for bit
    assert [g[0].response_ids for g in episodes["free"]] == [row[1] for row in first]


def _logprobs(model, batch) -> torch.Tensor:
    """[b, W] response logprobs of a padded or packed batch (Policy.forward's formula, no FSDP)."""
    with torch.no_grad(), batch.forward_context():
        out = model(**batch.model_inputs(), logits_to_keep=batch.logits_to_keep)
    return token_stats(batch.select(out.logits), batch.targets, 1.0, False)[0] * batch.resp_mask


def test_branches_train_once_each_and_pack_into_one_row(episodes, tiny_model_dir):
    """n=4 trains four rows, one per choice (the third goes on to the next turn), each with the request's
    prompt, every generated token in exactly one row; packed (optim.shared_prefix=on) they are one row
    holding the prompt once, and its forward equals the four padded rows' (fp32)."""
    i = KINDS.index("branching")
    turns, s = _record(episodes, i)["turns"], episodes["samples"][i]
    rows = s.rows
    assert len(rows) == 4 and all(r.prompt_ids == turns[0]["prompt"] for r in rows)
    assert rows[0].prompt_ids + rows[0].response_ids == s.prompt_ids + s.response_ids  # the scored trajectory first
    generated = sorted([t for t, m in zip(r.response_ids, r.mask) if m] for r in rows)
    assert generated == sorted([turns[k]["ids"] for k in (0, 1, 3)] + [turns[2]["ids"] + turns[4]["ids"]])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokens = TokenBatch.from_samples(rows, tok.pad_token_id, torch.device("cpu"))
    samples = row_tokens(tokens)
    plan = plan_packed(samples, list(range(len(rows))), budget=10_000)
    assert len(plan) == 1 and len(plan[0]) == 1  # one micro-batch of one unit: the prompt computed once
    order, packed = pack(samples, plan[0], tokens.resp_mask, torch.device("cpu"))
    assert packed.input_ids.shape[1] == len(turns[0]["prompt"]) + sum(len(r.response_ids) for r in rows)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    install(model)
    padded = _logprobs(model, tokens)[order]
    torch.testing.assert_close(_logprobs(model, packed), padded[:, :packed.targets.shape[1]], rtol=1e-6, atol=1e-6)
    assert bool((padded != 0).any())


def test_branches_restarts_and_completions(episodes):
    samples = episodes["samples"]
    branching = _record(episodes, KINDS.index("branching"))["turns"]
    s = samples[KINDS.index("branching")]
    assert len(branching) == 5 and s.episode.branches == 3  # four choices, then on from the third
    assert s.response_ids[:len(branching[2]["ids"])] == branching[2]["ids"]
    assert s.prompt_ids + s.response_ids == branching[4]["prompt"] + branching[4]["ids"]
    s = samples[KINDS.index("editing")]
    edited = _record(episodes, KINDS.index("editing"))["turns"]
    assert s.episode.restarts == 1 and s.prompt_ids == edited[1]["prompt"]
    # the trajectory before the edit trains too, as a row of its own
    assert [r.prompt_ids + r.response_ids for r in s.rows] == [t["prompt"] + t["ids"] for t in (edited[1], edited[0])]
    turns = _record(episodes, KINDS.index("completion"))["turns"]
    _check_exact(samples[KINDS.index("completion")], turns)  # the second prompt continued the first by text
    # a title asked on the side (task.agent_exclude) is answered, but neither trained nor continued
    titled = _record(episodes, KINDS.index("titled"))
    s = samples[KINDS.index("titled")]
    _check_exact(s, titled["turns"])
    assert s.rows is None  # one trajectory: the sample is its row
    assert s.episode.excluded == 1 and s.episode.restarts == 0 and s.episode.requests == 3 and titled["title"]
    # Anthropic's client: its answers echoed back as content blocks continue the trajectory
    claude = _record(episodes, KINDS.index("claude"))
    s = samples[KINDS.index("claude")]
    assert s.episode.requests == 2 and s.episode.turns == 2 and s.episode.restarts == 0, s.episode
    first = claude["turns"][0]
    assert first["type"] == "message" and first["stop_reason"] in ("end_turn", "max_tokens") and first["content"]
    assert first["usage"]["input_tokens"] == len(s.prompt_ids) and s.mask.count(0) > 0
    assert claude["error"] == (404, "invalid_request_error")


def test_a_failing_hanging_or_silent_harness_ends_only_its_episode(episodes):
    samples = episodes["samples"]
    raised, hung, silent = (samples[KINDS.index(k)] for k in ("raises", "hangs", "silent"))
    assert raised.episode.failed and not raised.episode.cut and len(raised.response_ids) > 0
    assert hung.episode.cut and hung.truncated and len(hung.response_ids) > 0  # its one turn kept
    assert silent.response_ids == [] and silent.episode.requests == 0 and silent.episode.env_reward == 1.0
    crowded = episodes["crowded"]  # 80 blocking harnesses of one round, none starved of a thread
    assert len(crowded) == 80 and all(s.episode.requests == 1 and not s.episode.cut for s in crowded)
    assert TIMEOUT_S <= episodes["took"] < TIMEOUT_S + 30  # the hanging one was cut at its deadline
    # one line for each kind, the first time (later ones are counted in agent/failed and agent/cut)
    assert episodes["warnings"] == [
        "agent episode 10: the harness ran past agent.episode_timeout_s=4.0 of its own time; cut, its turns kept as a "
        "truncated sample (logged once, later ones only counted in agent/cut)",
        "agent episode 9: the harness failed: RuntimeError: the harness broke; its turns are kept (logged once, later "
        "ones only counted in agent/failed)"]


def test_a_stop_sequence_ends_the_turn_after_the_token_that_completes_it(episodes):
    """The answer's text ends before the earliest stop sequence; its ids run to the token that completes
    it (no fewer: one less holds none), and those ids train, the next request closing the cut turn
    through the template (an end-of-turn token among the masked message tokens)."""
    i = KINDS.index("stopping")
    record, s = _record(episodes, i), episodes["samples"][i]
    tok = episodes["runner"].gateway.tokenizer
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    stops = agents_for_tests.STOPS
    for turn, (text, finish) in zip(record["turns"], record["answers"]):
        full = decode(turn["ids"])
        where = min(full.find(x) for x in stops if x in full)
        assert finish == "stop" and text == full[:where]
        assert not any(x in decode(turn["ids"][:-1]) for x in stops)
    _check_exact(s, record["turns"])
    first = len(record["turns"][0]["ids"])
    assert s.response_ids[first] == tok.convert_tokens_to_ids("<|im_end|>") and s.mask[first] == 0
    assert not s.truncated


def test_bad_requests_get_openai_errors(episodes):
    seen = _record(episodes, KINDS.index("errors"))["errors"]
    assert seen["model"] == (404, "model_not_found") and seen["key"][0] == 401
    assert seen["long"] == (400, "context_length_exceeded")
    assert seen["stream"] == (400, "unsupported") and seen["n"] == (400, "invalid_n")
    assert seen["stop"] == (400, "invalid_stop")
    assert seen["messages"] == (400, "invalid_messages")
    assert seen["json"] == (400, "invalid_json") and seen["episode"] == (404, "episode_not_found")
    assert seen["models"] == ["policy"]
    assert [seen[f"turn{k}"][0] for k in range(4)] == [200, 200, 200, 429]  # rollout.max_turns requests


def test_the_example_harness_is_the_documented_one_and_runs(tiny_model_dir, tmp_path):
    """recipes/harnesses/calculator_agent.py, shown whole in docs/tasks.md, runs against the endpoint:
    with a random model, a turn without a tool call (its answer) ends it."""
    harness = ROOT / "recipes" / "harnesses" / "calculator_agent.py"
    assert harness.read_text() in (ROOT / "docs" / "tasks.md").read_text()
    spec = importlib.util.spec_from_file_location("calculator_agent", harness)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = _cfg(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    runner = AgentRunner(HFEngine(tiny_model_dir, cfg.model, cfg.rollout, torch.device("cpu")), tok, cfg, module.run)
    try:
        samples = [g[0] for g in runner.run(agents_for_tests.items(tok, KINDS)[:3], 1, [1, 2, 3])]
    finally:
        runner.close()
    for s in samples:
        assert not (s.episode.failed or s.episode.cut) and s.episode.requests >= 1 and s.episode.restarts == 0


def test_an_occupied_port_is_one_line():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"^the agent endpoint cannot listen on 127.0.0.1:{port} .*agent.port"):
            Endpoint(build_app(None, "k"), "127.0.0.1", port)
