"""Multi-turn episodes on an inflight rollout rank (distflow.pipeline.inflight_episodes), on a real
step-wise HF engine (tiny model, fp32, in-process) and a real task pool with an environment: with no
version applied they are the synchronous EpisodeRunner's episodes, whether the environment answers in
waves or each turn as it finishes (pipeline.env_wait); with `free`, the engine steps other episodes
while a slow environment answers; a version applied mid-episode continues the running turns under it,
so every generated token's logprob is its version's model's and every observation token carries its
turn's version.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from carry_helpers import model_logprobs, moved_weights
from config_helpers import fp32_config
from launch_helpers import ROOT
from distflow.config import RolloutConfig, TaskConfig
from distflow.pipeline.inflight_episodes import InflightEpisodes
from distflow.rollout.episodes import EpisodeRunner
from distflow.rollout.hf_engine import HFEngine
from distflow.seeds import sample_seed
from distflow.tasks.envs import build_env
from distflow.tasks.prompts import load_prompts
from distflow.tasks.rewards.pool import RewardPool

G, SEED = 2, 0
ROLLOUT = RolloutConfig(engine="hf", max_new_tokens=8, max_turns=3, max_total_tokens=60)
TASK = TaskConfig(path=str(ROOT / "recipes" / "data" / "arith.jsonl"), env="envs_for_tests:EchoEnv",
                  reward="rewards_for_tests:digit_fraction", reward_workers=1)


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = HFEngine(tiny_model_dir, fp32_config().model, ROLLOUT, torch.device("cpu"))
    items = load_prompts(TASK, tok, 512, env=build_env(TASK.env, {}))[:4]
    return tok, engine, items


def _episodes(setup, pool, env_wait: str) -> InflightEpisodes:
    tok, engine, items = setup
    runner = EpisodeRunner(engine, pool, tok, ROLLOUT)
    return InflightEpisodes(engine, SEED, G, ROLLOUT.max_new_tokens, runner, lambda p: items[p].fields, env_wait)


def _run(live: InflightEpisodes, items, steps_while_asked: list | None = None) -> list:
    live.admit(1, [0, 1], [list(items[p].prompt_ids) for p in (0, 1)])
    for _ in range(3):  # the second target's turns end at other engine steps than the first's
        live.step()
    live.admit(2, [2, 3], [list(items[p].prompt_ids) for p in (2, 3)])
    while live.running():
        if steps_while_asked is not None and live.owner:
            steps_while_asked.append(live.env.outstanding)
        live.step()
    live.close()
    assert live.done(1) and live.done(2)
    return [s for target in (1, 2) for s in live.take(target)[1]]


@pytest.mark.parametrize("env_wait", ["wave", "free"])
def test_with_no_version_applied_the_episodes_are_the_sync_loops(setup, env_wait):
    tok, engine, items = setup
    engine.version = 0
    with RewardPool.from_task(TASK) as pool:
        pool.wait_ready()
        samples = _run(_episodes(setup, pool, env_wait), items)
        expected = [s for g in EpisodeRunner(engine, pool, tok, ROLLOUT).run(
            items, G, [sample_seed(SEED, p) for p in range(4)]) for s in g]
    assert [s.position for s in samples] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert max(s.episode.turns for s in samples) >= 2  # answered, and answered turns taken
    for s, e in zip(samples, expected):
        assert (s.response_ids, s.mask, s.versions, s.truncated) == (e.response_ids, e.mask, e.versions, e.truncated)
        assert (s.episode.turns, s.episode.env_reward, s.episode.transcript) == \
            (e.episode.turns, e.episode.env_reward, e.episode.transcript)
        # the logprobs to float noise: the engine's batch held other episodes' rows besides
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(e.logprobs), atol=1e-5, rtol=0)


def test_free_steps_the_engine_while_the_environment_answers_and_wave_does_not(setup):
    tok, engine, items = setup
    slow = TaskConfig(**{**TASK.__dict__, "env_args": {"delay": 0.05}})
    seen = {}
    with RewardPool.from_task(slow) as pool:
        pool.wait_ready()
        for env_wait in ("wave", "free"):
            seen[env_wait] = []
            _run(_episodes(setup, pool, env_wait), items, seen[env_wait])
    assert seen["wave"] and max(seen["wave"]) == 0  # every engine step came after the answers it waited for
    assert max(seen["free"]) > 0  # engine steps with turns at the environment


def test_a_version_applied_mid_episode_continues_the_running_turns_under_it(setup):
    tok, engine, items = setup
    original, moved = moved_weights(engine, 3)
    engine.version = 0
    try:
        with RewardPool.from_task(TASK) as pool:
            live = _episodes(setup, pool, "wave")
            live.admit(1, [0, 1], [list(items[p].prompt_ids) for p in (0, 1)])
            while not any(ep.info.turns >= 1 for eps in live.episodes.values() for ep in eps) or not live.owner:
                live.step()  # until a turn has been answered and turns run
            live.recompute(lambda: engine.load_weights(iter(moved.items()), 1))
            assert engine.version == 1 and live.reprefilled > 0
            while live.running():
                live.step()
            positions, samples = live.take(1)
        assert positions == [0, 1]
        assert {v for s in samples for v in s.versions} == {0, 1}
        for s in samples:
            assert len(s.response_ids) == len(s.mask) == len(s.logprobs) == len(s.versions)
            assert s.versions == sorted(s.versions)  # one cut: version 0's tokens, then version 1's
            for i, m in enumerate(s.mask):
                if not m:  # an observation: logprob 0, its turn's version
                    assert s.logprobs[i] == 0.0 and s.versions[i] == s.versions[i - 1], s
            old, new = model_logprobs(engine, original, s), model_logprobs(engine, moved, s)
            want = [(old if v == 0 else new)[i] if m else 0.0 for i, (v, m) in enumerate(zip(s.versions, s.mask))]
            torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(want), atol=1e-5, rtol=0)
    finally:
        engine.load_weights(iter(original.items()), 0)
