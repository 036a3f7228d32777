"""The run folder: every artifact named once, a fresh start that moves exactly distflow's artifacts
aside, and a folder distflow did not write refused (a real earlier LoRA + W&B run moved aside:
distributed/test_trainer_loop.py)."""

from __future__ import annotations

import json

import pytest

from distflow.config import ConfigError
from distflow.run.rundir import MARKER, RunDir

ARTIFACTS = ["config.json", "metrics.jsonl", "summary.json", "training.png", "checkpoints/step_000002/COMPLETE",
             "hf_model/model.safetensors", "adapter/adapter_config.json", "wandb/offline-run-1/run.wandb",
             "wandb_run_id", "tb/events.out.tfevents.1", "logs/rank_0.log", "logs/rank_1.log"]
FOREIGN = ["notes.txt", "data/train.jsonl", "logs/4242-node01.log", "launch.txt", ".hydra/config.yaml",
           "previous/20250101-000000/metrics.jsonl"]


def _write(root, names, text="x"):
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"model": {}, "rollout": {}, "algorithm": {}}) if name == "config.json" else text)


def test_a_fresh_start_moves_exactly_the_earlier_runs_artifacts(tmp_path):
    run = RunDir(tmp_path / "out")
    run.claim()
    _write(run.root, ARTIFACTS)
    _write(run.root, FOREIGN, "keep me")
    moved = run.set_aside()
    assert moved.parent == run.previous
    left = sorted(p.relative_to(run.root).as_posix() for p in run.root.rglob("*") if p.is_file())
    assert [p for p in left if not p.startswith("previous/")] == sorted(f for f in FOREIGN if not f.startswith("prev"))
    assert all((run.root / f).read_text() == "keep me" for f in FOREIGN)
    got = sorted(p.relative_to(moved).as_posix() for p in moved.rglob("*") if p.is_file())
    assert got == sorted([*ARTIFACTS, MARKER])
    assert run.set_aside() is None  # nothing of distflow's is left
    run.claim()
    assert run.marker.is_file() and run.written_by_distflow()


def test_a_folder_distflow_did_not_write_is_refused_and_left_alone(tmp_path):
    run = RunDir(tmp_path / "someone_else")
    _write(run.root, ["checkpoints/model.pt", "notes.txt"])
    (run.root / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')  # an HF model's config
    before = sorted(p.relative_to(run.root).as_posix() for p in run.root.rglob("*"))
    with pytest.raises(ConfigError, match=r"^run.output_dir .* holds files distflow did not write \(config.json, "
                                          r"checkpoints\); choose an empty or new folder$"):
        run.set_aside()
    assert sorted(p.relative_to(run.root).as_posix() for p in run.root.rglob("*")) == before


def test_a_run_from_before_the_marker_is_recognised_by_its_config(tmp_path):
    run = RunDir(tmp_path / "old")
    _write(run.root, ["config.json", "metrics.jsonl"])
    assert not run.marker.exists() and run.written_by_distflow()
    assert sorted(p.name for p in run.set_aside().iterdir()) == ["config.json", "metrics.jsonl"]


def test_an_empty_or_foreign_only_folder_needs_no_set_aside(tmp_path):
    run = RunDir(tmp_path / "new")
    assert run.set_aside() is None and not run.root.exists()
    _write(run.root, ["notes.txt", "logs/job-node.log"])
    assert run.set_aside() is None  # nothing under distflow's names: nothing to refuse or move
    two_runs = RunDir(tmp_path / "twice")
    for _ in range(2):  # two set-asides within one second get distinct folders
        two_runs.claim()
        _write(two_runs.root, ["metrics.jsonl"])
        two_runs.set_aside()
    assert len(list(two_runs.previous.iterdir())) == 2
