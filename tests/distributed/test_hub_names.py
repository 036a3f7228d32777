"""Hub names for model.path resolve through the Hugging Face cache, offline, on 2 real gloo ranks.

The cache is built by hand in the hub's own layout (models--owner--name/refs/main and
snapshots/<revision>/), with the tiny model's files and HF_HUB_OFFLINE=1 as every test has: a name
in the cache resolves to its snapshot on every rank (local rank 0 first, the other after it); a
name that is not there stops every rank with the same one line instead of a traceback or a wait.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from dist_helpers import gathered, run_distributed

REVISION = "0123456789abcdef0123456789abcdef01234567"


def _hub_cache(root: Path, model_dir: str, name: str) -> Path:
    repo = root / f"models--{name.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


def _worker(rank, world):
    from transformers import AutoConfig

    from distflow.config import ConfigError
    from distflow.distributed import on_local_rank0_first
    from distflow.models import resolve_model_path

    found = on_local_rank0_first(lambda: resolve_model_path("acme/tiny-chat"), rank)
    model_type = AutoConfig.from_pretrained(found).model_type
    try:
        on_local_rank0_first(lambda: resolve_model_path("acme/not-there"), rank)
        missing = None
    except ConfigError as e:
        missing = str(e)
    return gathered({"found": found, "model_type": model_type, "missing": missing})


def test_a_hub_name_resolves_from_the_cache_on_every_rank(tiny_model_dir, tmp_path, monkeypatch):
    snapshot = _hub_cache(tmp_path / "hub", tiny_model_dir, "acme/tiny-chat")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # the spawned ranks read it at import
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ranks = run_distributed(_worker, 2, timeout=300)
    assert [r["found"] for r in ranks] == [str(snapshot)] * 2 and ranks[0]["model_type"] == "qwen2"
    line = ranks[0]["missing"]
    assert line == ranks[1]["missing"] and "\n" not in line, ranks
    assert line.startswith("model.path 'acme/not-there' is not in the Hugging Face cache and cannot be downloaded")


@pytest.mark.parametrize("path", ["./acme/tiny-chat", "/abs/acme", "~/acme/x"])
def test_paths_that_look_local_are_never_sent_to_the_hub(path):
    from distflow.models import resolve_model_path

    assert resolve_model_path(path) == os.path.expanduser(path)
