"""bench/memory.py's variant handling: which override sets run where (no launch)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import memory  # noqa: E402


@pytest.mark.parametrize("overrides, unknown", [
    ([], []),
    (["model=smollm2_135m", "experiment=demo", "rollout.kv_cache_gib=2", "optim.micro_batch_tokens=512"], []),
    (["+task.gym_config.min_digits=3", "env:MALLOC_ARENA_MAX=2"], []),  # dict fields take any key
    (["model.no_such_lever=true", "rollout.kv_cache_gib=1"], ["model.no_such_lever"]),
    (["nosuchgroup=x", "trainer.nope.deeper=1"], ["nosuchgroup", "trainer.nope.deeper"]),
])
def test_unknown_keys(overrides, unknown):
    assert memory.unknown_keys(overrides) == unknown


def test_variants_parse_and_fit():
    assert memory.parse_variant("arena=env:MALLOC_ARENA_MAX=2 rollout.kv_cache_gib=2") == \
        ("arena", ["env:MALLOC_ARENA_MAX=2", "rollout.kv_cache_gib=2"])
    assert memory.parse_variant("plain") == ("plain", [])
    assert memory.split_env(["env:A=1=2", "x.y=3"]) == (["x.y=3"], {"A": "1=2"})
    tp2 = memory.VARIANTS["tp2"]
    assert memory.fits(tp2, 1) and memory.fits(tp2, 3) and memory.fits(tp2, 2) is None
    assert memory.fits(tp2, 4) is None and memory.fits(["rollout.kv_cache_gib=2"], 1) is None
    # every lever alone differs from "off" in exactly one override
    for name in ("meta", "ckpt", "chunk"):
        assert len(set(memory.VARIANTS[name]) - set(memory.VARIANTS["off"])) == 1


def test_phase_peaks_fold_parts():
    rank = {"peak_rss": {"imports": 5, "other": 3, "startup": 4, "startup:engine": 9, "update": 7}}
    assert memory.phase_peaks(rank) == {"other": 5, "startup": 9, "update": 7}
