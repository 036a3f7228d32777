"""The groups an inflight rollout rank keeps in its engine (distflow.pipeline.inflight.InflightGroups),
on a real step-wise HF engine (tiny model, fp32, in-process): without a version applied they sample
the tokens the blocking generate samples for the same positions; a version applied while they run
cuts every unfinished sample and continues it under the new weights, so each token carries the version
whose model gives its logprob; targets finish and are taken in position order, each position once.
"""

from __future__ import annotations

import pytest
import torch

from carry_helpers import carry_config, item, key, model_logprobs, moved_weights
from distflow.pipeline.inflight import InflightGroups
from distflow.rollout.hf_engine import HFEngine
from distflow.seeds import sample_seed

G, BUDGET, SEED = 2, 24, 0


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> HFEngine:
    cfg = carry_config(0)
    return HFEngine(tiny_model_dir, cfg.model, cfg.rollout, torch.device("cpu"))


def _admit(live: InflightGroups, target: int, positions: list[int]) -> None:
    live.admit(target, positions, [item(p).prompt_ids for p in positions])


def _finish(live: InflightGroups) -> None:
    while live.running():
        live.step()


def test_without_a_version_applied_the_groups_are_what_generate_samples(engine):
    engine.version = 0
    live = InflightGroups(engine, SEED, G, BUDGET)
    _admit(live, 1, [0, 2])
    _admit(live, 2, [4, 6])  # two targets in the engine together
    _finish(live)
    assert live.done(1) and live.done(2)
    positions, samples = live.take(2)
    assert positions == [4, 6] and [s.position for s in samples] == [4, 4, 6, 6]
    expected = engine.generate([item(p).prompt_ids for p in positions], G, [sample_seed(SEED, p) for p in positions])
    expected = [s for group in expected for s in group]
    # the same tokens; the logprobs to float noise (the engine's batch held other groups' rows besides)
    assert [k[:2] + k[3:] for k in key(samples)] == [k[:2] + k[3:] for k in key(expected)]
    for s, e in zip(samples, expected):
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(e.logprobs), atol=1e-5, rtol=0)
    assert live.take(1)[0] == [0, 2] and not live.groups and live.reprefilled == 0


def test_a_version_applied_while_samples_run_continues_them_under_it(engine):
    original, moved = moved_weights(engine, 3)
    engine.version = 0
    try:
        live = InflightGroups(engine, SEED, G, BUDGET)
        _admit(live, 1, [1, 3])
        for _ in range(3):
            live.step()
        assert live.running() and not live.done(1)
        live.recompute(lambda: engine.load_weights(iter(moved.items()), 1))
        assert engine.version == 1 and live.reprefilled > 0
        _admit(live, 2, [5])  # admitted under version 1: all its tokens are version 1's
        _finish(live)
        positions, samples = live.take(1)
        assert positions == [1, 3] and all(len(s.response_ids) == len(s.logprobs) == len(s.versions) for s in samples)
        for s in samples:
            cut = s.versions.index(1)
            assert cut == 3 and set(s.versions[:cut]) == {0} and set(s.versions[cut:]) == {1}, s.versions
            before, after = model_logprobs(engine, original, s)[:cut], model_logprobs(engine, moved, s)[cut:]
            torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(before + after), atol=1e-5, rtol=0)
        assert {v for s in live.take(2)[1] for v in s.versions} == {1}
        live.drop()
        assert engine.pending() == 0
    finally:
        engine.load_weights(iter(original.items()), 0)


def _late_groups(engine) -> InflightGroups:
    """Target 2's groups: position 0 admitted first under version 0, position 2 five engine steps later
    (still version 0), position 6 with it under version 1; stepped until position 0 alone has finished."""
    live = InflightGroups(engine, SEED, G, BUDGET)
    engine.version = 0
    _admit(live, 2, [0])
    for _ in range(5):
        live.step()
    _admit(live, 2, [2])
    engine.version = 1
    _admit(live, 2, [6])
    assert live.late(2, 1, 4, "retarget") == live.late(2, 1, 4, "drop") == 0  # none finished: the step waits
    while None in live.groups[0].samples:
        live.step()
    assert None in live.groups[2].samples and None in live.groups[6].samples
    return live


def test_late_groups_move_to_the_next_step_only_where_the_bound_still_holds(engine):
    """pipeline.late=retarget at eta = 1: step 2 is due with one group finished. The group started under
    version 1 moves to step 3 (1 >= 3 - 1 - 1); the one started under version 0 stays, and the step waits
    for it; nothing moves past the run's last step. Until sent, a moved group is named for resumes."""
    live = _late_groups(engine)
    assert live.late(2, 1, 2, "retarget") == 0  # step 2 is the run's last
    assert live.late(2, 1, 4, "retarget") == 1 and live.groups[6].target == 3 and live.groups[2].target == 2
    assert live.late(2, 1, 4, "retarget") == 0 and not live.done(2)
    _finish(live)
    assert live.take(2)[0] == [0, 2] and live.undelivered(2) == [6]
    positions, samples = live.take(3)
    assert positions == [6] and set(samples[0].versions) == {1} and live.undelivered(3) == []


def test_late_groups_dropped_are_aborted_and_never_sent(engine):
    live = _late_groups(engine)
    assert live.late(2, 1, 4, "drop") == 2 and live.done(2) and not live.running() and engine.pending() == 0
    positions, samples = live.take(2)
    assert positions == [0] and len(samples) == G and live.undelivered(2) == []


def test_a_version_kept_under_running_samples_tags_their_later_tokens_and_prefills_nothing(engine):
    """pipeline.kv_after_update=keep: the version is loaded under the running samples. Their tokens from
    then on carry it, nothing is prefilled again, and each later logprob is the new model's on top of the
    keys and values the old one computed (PipelineRL's in-flight update), not a fresh forward of either."""
    original, moved = moved_weights(engine, 4)
    engine.version = 0
    try:
        live = InflightGroups(engine, SEED, G, BUDGET)
        _admit(live, 1, [1])
        for _ in range(3):
            live.step()
        engine.load_weights(iter(moved.items()), 1, keep_running=True)
        _finish(live)
        _, samples = live.take(1)
        assert live.reprefilled == 0
        for s in samples:
            assert s.versions == [0] * 3 + [1] * (len(s.response_ids) - 3), s.versions
            seq = torch.tensor([s.prompt_ids + s.response_ids])
            cut = len(s.prompt_ids) + 2  # the old model's keys and values: the prompt and the first 2 tokens
            with torch.no_grad():
                engine.load_weights(iter(original.items()), 0)
                old = engine.model(input_ids=seq[:, :cut], use_cache=True)
                engine.load_weights(iter(moved.items()), 1)
                new = engine.model(input_ids=seq[:, cut:], past_key_values=old.past_key_values)
            logits = torch.cat([old.logits[0, len(s.prompt_ids) - 1:], new.logits[0, :-1]]).float()
            expected = logits.log_softmax(-1).gather(-1, seq[0, len(s.prompt_ids):, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-5, rtol=0)
    finally:
        engine.load_weights(iter(original.items()), 0)
