"""Carry-over rollouts: the schedule's rules, the carry buffer as data, and the driver on a real
step-wise HF engine (tiny model, fp32, in-process).

The driver is checked against what must hold whatever the timing: with eta = 0 it samples exactly
what the blocking generate samples; with eta > 0 every group trains by its due step and every
trained token's version is within the bound; each position is trained exactly once; a sample cut
and continued under the next version has the logprobs the model gives its whole sequence; and a
driver rebuilt from its saved buffer continues exactly as the one that was never stopped.
"""

from __future__ import annotations

import json

import pytest
import torch

from carry_helpers import (G, LENGTHS, PER_STEP, admitted, carry_config, item, key, model_logprobs, moved_weights,
                           run_steps)
from distflow.rollout import schedule
from distflow.rollout.carry import CarriedGroup, CarryBuffer
from distflow.rollout.driver import CarryoverDriver
from distflow.rollout.hf_engine import HFEngine
from distflow.sample import Sample
from distflow.seeds import sample_seed

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> HFEngine:
    cfg = carry_config(0)
    return HFEngine(tiny_model_dir, cfg.model, cfg.rollout, CPU)


def _resync(engine: HFEngine, version: int) -> None:
    """The weights unchanged, the version moved on (what a step's resync does to the engine)."""
    engine.load_weights(((n, p.detach().clone()) for n, p in engine.model.named_parameters()), version)


def _run(engine, driver, steps, first_step=1):
    return run_steps(engine, driver, steps, _resync, first_step)


# ---------------------------------------------------------------------- the rules
def test_the_rules():
    assert schedule.due_step(3, 0) == 3 and schedule.due_step(3, 2) == 5
    assert schedule.round_done(2, 2, 0) and not schedule.round_done(1, 2, 0) and not schedule.round_done(5, 2, 1)
    ended = Sample([1], [2, 3], [0.0, 0.0], False)
    cut = Sample([1], [2, 3], [0.0, 0.0], True)
    assert schedule.sample_done(ended, 8) and not schedule.sample_done(cut, 8) and schedule.sample_done(cut, 2)
    assert schedule.oldest_allowed(5, 1) == 3 and schedule.staleness(5, [4, 3, 4]) == [0, 1, 0]
    assert schedule.bound_problem(5, 3, 1) is None and schedule.bound_problem(5, 4, 0) is None
    assert schedule.bound_problem(5, 3, 0) == ("step 5: a token of policy version 3 would train, older than step - 1 - "
                                               "pipeline.max_staleness = 4; stopping")
    assert schedule.deal([4, 5, 6, 7, 9], 1, 2) == [1, 3, 4] and schedule.deal([4, 5], 0, 1) == [0, 1]
    assert schedule.admit_order([(3, 10), (2, 30), (2, 20)]) == [2, 1, 0]
    assert schedule.admissions(1, 1, 3, 2, True) == 9 and schedule.admissions(1, 1, 3, 2, False) == 3
    assert schedule.admissions(4, 1, 3, 2, True) == 3 and schedule.admissions(4, 4, 3, 0, True) == 3
    finished = [(2, 9), (3, 4), (1, 7), (3, 2)]  # (admitted, position) in finish order; eta 1 at step 3
    assert schedule.hand_out(finished, 3, 1, 1) == [2, 0]  # both due: more than the quota
    assert schedule.hand_out(finished, 3, 1, 3) == [1, 2, 0]  # then the earliest finished other
    assert schedule.hand_out(finished, 3, 1, 4) == [3, 1, 2, 0] and schedule.hand_out([], 3, 1, 2) == []
    assert schedule.fits(0, 9, 4) and schedule.fits(2, 2, 4) and not schedule.fits(3, 2, 4) and schedule.fits(50, 8, None)


# ---------------------------------------------------------------------- the buffer
def _carried(position: int) -> CarriedGroup:
    return CarriedGroup(position, 2, 1, [Sample([1, 2], [3], [-0.1], True, versions=[1]),
                                         Sample([1, 2], [], [], True, versions=[])])


def test_the_buffer_is_json_data_and_a_resize_deals_it_by_position():
    old = [CarryBuffer(r, 2) for r in range(2)]
    old[0].groups, old[1].groups = [_carried(4), _carried(6)], [_carried(5)]
    files = [json.loads(json.dumps(b.state_dict())) for b in old]  # what rank_<r>.json holds
    same = CarryBuffer(1, 2)
    same.load_state_dict(files[1])
    assert [g.to_data() for g in same.groups] == [_carried(5).to_data()]
    one = CarryBuffer(0, 1)
    one.load_pooled(files)
    assert [g.position for g in one.groups] == [4, 5, 6]  # every group once, none from rank 0 twice
    three = [CarryBuffer(r, 3) for r in range(3)]
    for b in three:
        b.load_pooled(files)
    assert [[g.position for g in b.groups] for b in three] == [[6], [4], [5]]


@pytest.mark.parametrize("defect", [{"position": 1}, {"position": 1, "admitted": 0, "cuts": 0, "samples": [
    {"prompt_ids": [1], "response_ids": [2, 3], "logprobs": [0.0], "truncated": True, "versions": None}]}])
def test_a_malformed_carried_group_is_refused(defect):
    with pytest.raises(ValueError, match="carried"):
        CarryBuffer(0, 1).load_state_dict({"groups": [defect]})


# ---------------------------------------------------------------------- the driver
def test_eta_0_samples_exactly_what_generate_samples(engine):
    cfg = carry_config(0)
    driver = CarryoverDriver(engine, cfg, CarryBuffer(0, 1))
    positions = [7, 8, 9, 10]
    done = driver.round(1, positions, [item(p) for p in positions], len(positions))
    assert driver.end_step(1)["carried_groups"] == 0
    expected = engine.generate([item(p).prompt_ids for p in positions], G, [sample_seed(cfg.run.seed, p) for p in positions])
    assert sorted(done.positions) == positions
    got = dict(zip(done.positions, done.groups))
    for p, group in zip(positions, expected):
        assert key(got[p]) == key(group)
        assert all(s.position == p and s.versions == [engine.version] * len(s.response_ids) for s in got[p])


@pytest.mark.parametrize("eta,concurrency", [(1, None), (3, None), (2, 5)])
def test_the_bound_holds_and_every_position_trains_once(engine, eta, concurrency):
    engine.version = 0
    driver = CarryoverDriver(engine, carry_config(eta, concurrency), CarryBuffer(0, 1), lengths=LENGTHS.__getitem__)
    steps = _run(engine, driver, 6)
    trained, admitted_at = {}, {}
    for step, (groups, counts) in enumerate(steps, start=1):
        for p in admitted(driver, step):
            admitted_at[p] = step
        assert len(groups) >= PER_STEP  # the quota, or more where more were due
        for p, samples in groups.items():
            assert p not in trained, f"position {p} trained twice"
            trained[p] = step
            assert step <= admitted_at[p] + eta, (p, admitted_at[p], step)  # never past its due step
            for s in samples:
                assert min(s.versions) >= schedule.oldest_allowed(step, eta), (step, s.versions)
                assert len(s.response_ids) == LENGTHS[p] == len(s.logprobs) == len(s.versions)
                assert s.prompt_ids == item(p).prompt_ids
        assert counts["carried_groups"] == len(driver.buffer)
    carried = {g.position for g in driver.buffer.groups}
    assert set(trained) | carried == set(admitted_at) and not set(trained) & carried  # the fates partition them
    assert any(counts["carried_groups"] for _, counts in steps)  # the tail was really cut


def test_a_cut_sample_continues_with_the_models_logprobs_under_the_new_version(engine):
    """Step 1's resync moves the weights (version 1): a sample cut at step 1 and finished at step 2
    has version 0's logprobs up to the cut and version 1's after it, each the model's own (fp32)."""
    original, moved = moved_weights(engine, 3)

    def resync(engine, version):
        engine.load_weights(iter((moved if version % 2 else original).items()), version)

    engine.version = 0
    try:
        steps = run_steps(engine, CarryoverDriver(engine, carry_config(1), CarryBuffer(0, 1), lengths=LENGTHS.__getitem__),
                          2, resync)
        long = steps[1][0][3]  # admitted at step 1 (version 0), cut there, finished at step 2 (version 1)
        for s in long:
            cut = s.versions.index(1)
            assert 0 < cut < len(s.versions) and set(s.versions[cut:]) == {1}, s.versions
            before, after = model_logprobs(engine, original, s)[:cut], model_logprobs(engine, moved, s)[cut:]
            torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(before + after), atol=1e-5, rtol=0)
            assert max(abs(a - b) for a, b in zip(s.logprobs[cut:], model_logprobs(engine, original, s)[cut:])) > 1e-3
    finally:
        engine.load_weights(iter(original.items()), 0)


def test_a_driver_rebuilt_from_its_saved_buffer_continues_exactly(engine):
    engine.version = 0
    straight = _run(engine, CarryoverDriver(engine, carry_config(2), CarryBuffer(0, 1), lengths=LENGTHS.__getitem__), 5)
    engine.version = 0
    first = CarryoverDriver(engine, carry_config(2), CarryBuffer(0, 1), lengths=LENGTHS.__getitem__)
    head = _run(engine, first, 2)
    saved = json.loads(json.dumps(first.buffer.state_dict()))
    assert saved["groups"], "the boundary must hold carried groups for this check"
    buffer = CarryBuffer(0, 1)
    buffer.load_state_dict(saved)
    tail = _run(engine, CarryoverDriver(engine, carry_config(2), buffer, lengths=LENGTHS.__getitem__), 3, first_step=3)
    for (a, counts_a), (b, counts_b) in zip(straight, head + tail):
        assert sorted(a) == sorted(b) and counts_a["carried_tokens"] == counts_b["carried_tokens"]
        for p in a:
            assert key(a[p]) == key(b[p])


def test_the_trainer_stops_every_rank_on_a_token_older_than_its_bound():
    """What the trainer checks where it trains (one all_reduce(min); a lone process here): a token
    of version 3 at step 5 holds for eta = 1 and stops the run with one line for eta = 0."""
    from distflow.errors import RunAborted
    from distflow.trainer import Trainer

    trainer = Trainer.__new__(Trainer)  # only the check: no run, no models
    trainer.cfg, trainer.step = carry_config(1), 5
    samples = [Sample([1], [2, 3], [0.0, 0.0], False, versions=[3, 4]), Sample([1], [], [], True, versions=[])]
    trainer.check_staleness(samples)
    trainer.cfg.pipeline.max_staleness = 0
    with pytest.raises(RunAborted, match=r"^step 5: a token of policy version 3 would train, older than step - 1 - "
                                         r"pipeline.max_staleness = 4; stopping$"):
        trainer.check_staleness(samples)
