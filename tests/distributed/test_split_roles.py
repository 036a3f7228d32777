"""Role-split ranks on 3 real gloo processes (rank 0 trains, ranks 1 and 2 generate): the groups,
the role-scoped collectives, messages between the roles and the weight broadcast."""

from __future__ import annotations

import pytest
import torch

from dist_helpers import run_distributed


def _worker(rank, world):
    from distflow.config import ModelConfig
    from distflow.distributed import DistInfo, agree_failure, all_reduce, broadcast_object, enter_scope, rank_and_world
    from distflow.distributed.layout import ParallelLayout
    from distflow.distributed.roles import take_roles
    from distflow.pipeline.links import Links, PeerSilent
    from distflow.pipeline.weights import WeightPublisher, WeightReceiver

    info = DistInfo(rank, world, rank, world, torch.device("cpu"), "gloo")
    layout = ParallelLayout.from_config(ModelConfig(path="tiny", shard_ranks=1), info, 1, rollout_ranks=2)
    groups = take_roles(layout, "gloo")
    out = {"role": rank_and_world(), "sum": float(all_reduce(float(rank + 1))[0]),
           "first": broadcast_object(f"from {rank}"), "mesh": layout.fsdp_mesh.get_coordinate()}
    out["failed"] = agree_failure("broke" if rank == 2 else None)  # the rollout ranks agree among themselves
    links = Links(groups.link_group, rank, timeout_s=30)
    weights = {"a": torch.randn(3, 4), "b": torch.arange(6, dtype=torch.bfloat16), "c": torch.randn(5)}
    if rank == 0:
        out["messages"] = [links.recv(1, "a test message") for _ in range(3)]
        publisher = WeightPublisher(links, 0, groups.roles.rollout_set(0), groups.weight_groups[0], 30, bucket_bytes=40)
        publisher.publish(weights.items(), 5, notes={1: {"cursor": "one"}, 2: {"cursor": "two"}})
        publisher.publish(None, 6)
        quick = Links(groups.link_group, rank, timeout_s=1)
        try:
            quick.recv(2, "the groups of step 9")
        except PeerSilent as e:
            out["silent"] = str(e)
    else:
        if rank == 1:
            for i in range(3):
                links.send(0, {"n": i, "t": torch.full((2,), float(i))})
        receiver = WeightReceiver(links, 0, groups.weight_groups[0], torch.device("cpu"), 30)
        first = receiver.announce()
        got = dict(receiver.tensors(first))
        second = receiver.announce()
        out.update(version=first["version"], cursor=first["cursor"], same=all(torch.equal(got[k], weights[k]) for k in weights),
                   dtypes={k: str(v.dtype) for k, v in got.items()}, second=(second["version"], second["bucket"]))
    links.flush()
    enter_scope(None)
    from dist_helpers import gathered
    return gathered(out)


@pytest.fixture(scope="module")
def ranks():
    torch.manual_seed(0)
    return run_distributed(_worker, 3, timeout=120)


def test_collectives_run_within_each_role(ranks):
    assert [r["role"] for r in ranks] == [(0, 1), (0, 2), (1, 2)]
    assert [r["sum"] for r in ranks] == [1.0, 5.0, 5.0]
    assert [r["first"] for r in ranks] == ["from 0", "from 1", "from 1"]
    assert tuple(ranks[0]["mesh"]) == (0,) and ranks[1]["mesh"] is None  # FSDP's mesh holds the trainers only
    assert ranks[0]["failed"] is None and ranks[1]["failed"] == ranks[2]["failed"] == (2, "broke")  # global rank


def test_messages_arrive_in_order_and_a_silent_peer_is_named(ranks):
    got = ranks[0]["messages"]
    assert [m["n"] for m in got] == [0, 1, 2] and all(torch.equal(m["t"], torch.full((2,), float(m["n"]))) for m in got)
    assert ranks[0]["silent"].startswith("rank 2 died or hung: rank 0 waited for the groups of step 9 (at most "
                                         "run.collective_timeout_s=1 s; ")


def test_every_rollout_rank_receives_the_version_bit_for_bit(ranks):
    for r in ranks[1:]:
        assert r["same"] and r["version"] == 5 and r["second"] == (6, None)
        assert r["dtypes"] == {"a": "torch.float32", "b": "torch.bfloat16", "c": "torch.float32"}
    assert (ranks[1]["cursor"], ranks[2]["cursor"]) == ("one", "two")
