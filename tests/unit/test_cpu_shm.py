"""clear_stale_cpu_shm: a rank removes exactly the segments its own vLLM-CPU tensor-parallel slot
would collide with, and nothing else in the directory."""

from distflow.rollout.vllm_engine import clear_stale_cpu_shm


def test_removes_only_this_ranks_stale_segments(tmp_path):
    names = [
        "-tp:14-[2-3]-cpushm_1", "-tp:29-[2-3]-cpushm_1",  # rank 3's slot in group [2-3], two launches
        "-tp:14-[2-3]-cpushm_0",  # its peer's segment
        "-tp:14-[0-1]-cpushm_1",  # the same slot in another group
        "-tp:14-[2-3-4-5]-cpushm_1",  # a group of four
        "run7-tp:14-[2-3]-cpushm_1",  # an engine named after its own launch
        "-pp:14-[2-3]-cpushm_1", "torch_123", "-tp:14-[2-3]-cpushm_10",
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"\0" * 64)
    removed = clear_stale_cpu_shm(rank=3, tp=2, shm_dir=str(tmp_path))
    assert sorted(removed) == ["-tp:14-[2-3]-cpushm_1", "-tp:29-[2-3]-cpushm_1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(set(names) - set(removed))
    assert clear_stale_cpu_shm(rank=3, tp=2, shm_dir=str(tmp_path)) == []
    assert clear_stale_cpu_shm(rank=0, tp=2, shm_dir=str(tmp_path / "absent")) == []
