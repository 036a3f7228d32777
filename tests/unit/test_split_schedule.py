"""The split run's pure parts: which rank does what (Roles) and the staged schedule."""

from __future__ import annotations

import pytest

from distflow.config import ConfigError, ModelConfig
from distflow.distributed import DistInfo
from distflow.distributed.layout import ParallelLayout
from distflow.distributed.roles import Roles
from distflow.pipeline.schedule import admits, dealt_retries, engine_version, held_targets, weights_needed
from distflow.tasks.sampler import ShardedSampler


def test_trainers_come_first_and_each_rollout_rank_has_one_publisher():
    roles = Roles(world_size=5, rollout_ranks=3)
    assert roles.trainers == 2 and [roles.is_trainer(r) for r in range(5)] == [True, True, False, False, False]
    assert [roles.publisher(r) for r in (2, 3, 4)] == [0, 1, 0]
    assert roles.rollout_set(0) == [2, 4] and roles.rollout_set(1) == [3]
    assert sorted(r for t in range(2) for r in roles.rollout_set(t)) == [2, 3, 4]
    assert Roles(4, 1).rollout_set(1) == [] and Roles(4, 1).role_ranks(3) == (3,)


@pytest.mark.parametrize("trainers,rollout", [(2, 2), (1, 2), (2, 1), (3, 3), (2, 4)])
def test_each_trainer_gets_what_a_sync_run_on_its_count_deals_its_rank(trainers, rollout):
    """Rollout rank j draws positions offset + j + k*R; routed by position, trainer t gets exactly
    sync rank t's positions (offset + t + k*T), in stream order."""
    roles, per_rank, items = Roles(trainers + rollout, rollout), 2, 50
    n = per_rank * trainers
    drawn = [ShardedSampler(items, j, rollout, 0).next_positions(n // rollout) for j in range(rollout)]
    got = {t: sorted(p for ps in drawn for p in ps if roles.trainer_of(p, 0) == t) for t in range(trainers)}
    assert got == {t: ShardedSampler(items, t, trainers, 0).next_positions(per_rank) for t in range(trainers)}


def test_the_staged_schedule():
    assert [engine_version(s, 0) for s in (1, 2, 3)] == [0, 1, 2]  # sync
    assert [engine_version(s, 2) for s in (1, 2, 3, 4, 5)] == [0, 0, 0, 1, 2]
    assert [weights_needed(v, 1, 6) for v in (3, 4, 5, 6)] == [True, True, False, False]
    assert [weights_needed(v, 1, 6, inflight=True) for v in (4, 5, 6)] == [True, True, False]  # fresher, in flight
    assert list(held_targets(3, 2, 6)) == [4, 5] and list(held_targets(5, 2, 6)) == [6]
    assert list(held_targets(6, 2, 6)) == [] and list(held_targets(3, 0, 6)) == []


def test_an_inflight_rank_admits_a_step_once_its_version_holds_and_its_samples_fit():
    assert admits(4, 1, 2, 0, 12, None) and not admits(4, 0, 2, 0, 12, None)  # version >= 4 - 1 - 2
    assert admits(4, 1, 2, 12, 12, None) and admits(4, 1, 2, 12, 12, 24)  # beside the running ones
    assert not admits(4, 1, 2, 13, 12, 24) and admits(4, 1, 2, 0, 30, 24)  # an empty engine takes it anyway
    assert not admits(4, 0, 2, 0, 12, 24)  # room alone does not admit it


def test_positions_moved_past_a_checkpoint_are_dealt_to_the_resumed_ranks_once_each():
    """pipeline.late=retarget: the saved cursors name positions to draw again. A trainer resumed on its own
    state deals its cursors' over its rollout set; resized, every trainer reads every cursor and deals
    them over all rollout ranks, taking its set's share: together each position once."""
    saved = [{"offset": 30, "retry": [25, 7]}, {"offset": 30, "retry": [12]}, {"offset": 30}]
    assert dealt_retries(saved[:1], [2], [2]) == {2: [7, 25]}
    pooled = [dealt_retries(saved, [3, 4, 5], mine) for mine in ([3, 5], [4])]  # R = 3 ranks, T = 2 trainers
    assert pooled == [{3: [7], 5: [25]}, {4: [12]}]
    assert dealt_retries(saved[2:], [2, 3], [2, 3]) == {2: [], 3: []}


@pytest.mark.parametrize("world,rollout,shard,line", [
    (4, 4, 1, "pipeline.rollout_ranks=4 leaves no rank to train: it must be below the world size 4"),
    (4, 1, 2, "model.shard_ranks=2 does not divide the 3 trainer ranks"),
])
def test_layouts_a_split_cannot_run(world, rollout, shard, line):
    info = DistInfo(0, world, 0, world, "cpu", "gloo")
    with pytest.raises(ConfigError, match=f"^{line}$"):
        ParallelLayout.from_config(ModelConfig(path="tiny", shard_ranks=shard), info, 1, rollout)


def test_a_split_layout_shards_over_the_trainers():
    info = DistInfo(0, 4, 0, 4, "cpu", "gloo")
    layout = ParallelLayout.from_config(ModelConfig(path="tiny", shard_ranks=-1), info, 1, 2)
    assert (layout.trainers, layout.shard, layout.replicate) == (2, 2, 1)
