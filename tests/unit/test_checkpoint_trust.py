"""A checkpoint folder is data: a tampered DCP file is refused at resume and at export without
running what it holds, a real checkpoint still loads bit-identically through the restricted
reader, and a marker that is not the JSON a save writes counts as a torn checkpoint.

One real checkpoint is written in-process (the tiny model with an AdamW that has stepped, no
process group), and each test tampers with its own copy."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from transformers import AutoModelForCausalLM

from config_helpers import fp32_config
from distflow.config import ConfigError, config_record
from distflow.checkpoint.checkpointer import (
    MARKER,
    POLICY,
    Checkpointer,
    ModelOptimState,
    is_complete,
    latest_checkpoint,
    read_marker,
)
from distflow.checkpoint.reader import ALLOWED, read_metadata


def _policy(model_dir: str, lr: float):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def _checkpointer(root: Path, model, optimizer) -> Checkpointer:
    ck = Checkpointer(root, keep_last=2, rank=0)
    ck.register(POLICY, ModelOptimState(model, optimizer), "sharded")
    return ck


@pytest.fixture(scope="module")
def saved(tiny_model_dir, tmp_path_factory):
    """(checkpoint folder, the saved model's state): one AdamW step, so the optimizer has state."""
    model, optimizer = _policy(tiny_model_dir, lr=1e-3)
    model(input_ids=torch.tensor([[1, 5, 9, 33]])).logits.sum().backward()
    optimizer.step()
    root = tmp_path_factory.mktemp("trust") / "checkpoints"
    path = _checkpointer(root, model, optimizer).save(1, config_record(fp32_config()), tiny_model_dir)
    return path, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture
def checkpoint(saved, tmp_path) -> Path:
    """This test's own copy of the saved checkpoint."""
    copy = tmp_path / "checkpoints" / saved[0].name
    shutil.copytree(saved[0], copy)
    return copy


class _Payload:
    """Unpickled, it runs `touch <flag>`."""

    def __init__(self, flag: Path):
        self.flag = flag

    def __reduce__(self):
        return os.system, (f"touch {self.flag}",)


def _resize_in_marker(folder: Path) -> None:
    """What a tamperer does too: the marker lists the tampered files' new sizes."""
    marker = json.loads((folder / MARKER).read_text())
    marker["files"] = {name: (folder / name).stat().st_size for name in marker["files"]}
    (folder / MARKER).write_text(json.dumps(marker))


def _refused_everywhere(folder: Path, model_dir: str, tmp_path: Path, flag: Path, needle: str) -> None:
    """Resume (Checkpointer.load) and export both refuse `folder` with one line; the payload never ran."""
    model, optimizer = _policy(model_dir, lr=5e-3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=needle) as e:
        _checkpointer(folder.parent, model, optimizer).load(folder)
    assert "\n" not in str(e.value) and "runs no code" in str(e.value)
    assert not flag.exists()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing was loaded

    from distflow.checkpoint.export import export_checkpoint

    with pytest.raises(SystemExit, match=needle):
        export_checkpoint(str(folder), str(tmp_path / "hf"))
    assert not flag.exists() and not (tmp_path / "hf").exists()


def test_a_real_checkpoint_loads_bit_identically_through_the_restricted_reader(saved, tiny_model_dir):
    path, weights = saved
    metadata = read_metadata(path)
    assert any(isinstance(m, BytesStorageMetadata) for m in metadata.state_dict_metadata.values())
    model, optimizer = _policy(tiny_model_dir, lr=5e-3)
    _checkpointer(path.parent, model, optimizer).load(path)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert optimizer.param_groups[0]["lr"] == 1e-3  # a byte entry, read with weights_only=True
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.999)


def test_a_pickle_payload_in_the_metadata_is_refused_at_resume_and_export(checkpoint, tiny_model_dir, tmp_path):
    flag = tmp_path / "payload-ran"
    metadata = read_metadata(checkpoint)
    metadata.planner_data["extra"] = _Payload(flag)  # a real metadata object, one foreign object inside
    tampered = pickle.dumps(metadata)
    pickle.loads(tampered)  # the payload is live: plain pickle runs it
    assert flag.exists()
    flag.unlink()
    (checkpoint / ".metadata").write_bytes(tampered)
    _resize_in_marker(checkpoint)
    assert is_complete(checkpoint)
    _refused_everywhere(checkpoint, tiny_model_dir, tmp_path, flag, r"\.metadata refers to posix\.system")


def test_a_pickle_payload_in_a_byte_entry_is_refused(checkpoint, tiny_model_dir, tmp_path):
    """The optimizer's param_groups are DCP byte entries, which DCP itself reads with weights_only=False."""
    flag = tmp_path / "payload-ran"
    payload = io.BytesIO()
    torch.save(_Payload(flag), payload)
    metadata = read_metadata(checkpoint)
    index = next(i for i in metadata.storage_data if i.fqn == f"{POLICY}.optim.param_groups.0.lr")
    shard = checkpoint / metadata.storage_data[index].relative_path
    metadata.storage_data[index] = _StorageInfo(shard.name, shard.stat().st_size, len(payload.getvalue()))
    with open(shard, "ab") as f:
        f.write(payload.getvalue())
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    _resize_in_marker(checkpoint)
    model, optimizer = _policy(tiny_model_dir, lr=5e-3)
    with pytest.raises(ConfigError, match=rf"{shard.name} refers to posix\.system \(entry {POLICY}\.optim") as e:
        _checkpointer(checkpoint.parent, model, optimizer).load(checkpoint)
    assert "\n" not in str(e.value) and not flag.exists()
    torch.load(io.BytesIO(payload.getvalue()), weights_only=False)  # and it was live
    assert flag.exists()


@pytest.mark.parametrize("relative_path", ["../../outside", "/etc/hostname", ".."])
def test_metadata_pointing_outside_its_folder_is_refused(checkpoint, tiny_model_dir, tmp_path, relative_path):
    metadata = read_metadata(checkpoint)
    index = next(iter(metadata.storage_data))
    info = metadata.storage_data[index]
    metadata.storage_data[index] = _StorageInfo(relative_path, info.offset, info.length)
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    _resize_in_marker(checkpoint)
    model, optimizer = _policy(tiny_model_dir, lr=5e-3)
    with pytest.raises(ConfigError, match="points outside its folder"):
        _checkpointer(checkpoint.parent, model, optimizer).load(checkpoint)


def test_the_allowed_classes_are_only_dcp_metadata():
    modules = {module for module, _ in ALLOWED}
    assert modules == {"torch", "torch.serialization", "torch.distributed.checkpoint.metadata",
                       "torch.distributed.checkpoint.filesystem", "pathlib", "collections"}
    assert ("torch", "load") not in ALLOWED and not any(name in ("system", "eval", "exec") for _, name in ALLOWED)


MALFORMED = {
    "not JSON": "{'format': 3",
    "not UTF-8": b"\xff\xfe{}",
    "a JSON list": "[1, 2]",
    "a JSON string": '"COMPLETE"',
    "files missing": {"drop": "files"},
    "files a list": {"files": ["rank_0.json"]},
    "a size not an int": {"files": {"rank_0.json": "12"}},
    "a size a bool": {"files": {"rank_0.json": True}},
    "a file outside the folder": {"files": {"../rank_0.json": 1}},
    "step a string": {"step": "1"},
    "step a float": {"step": 1.0},
    "step negative": {"step": -1},
    "format a string": {"format": "3"},
    "world_size zero": {"world_size": 0},
    "config not an object": {"config": "fp32"},
    "state not an object": {"state": None},
    "a 5000-digit step": "digits",
}


@pytest.mark.parametrize("form", list(MALFORMED))
def test_a_malformed_marker_is_skipped_like_a_torn_checkpoint(checkpoint, caplog, form):
    good = checkpoint.parent / "step_000000"
    shutil.copytree(checkpoint, good)
    marker = checkpoint / MARKER
    current, bad = json.loads(marker.read_text()), MALFORMED[form]
    if isinstance(bad, dict):
        bad = ({k: v for k, v in current.items() if k != bad["drop"]} if "drop" in bad
               else json.dumps({**current, **bad}))
        bad = json.dumps(bad) if isinstance(bad, dict) else bad
    elif bad == "digits":
        bad = json.dumps(current).replace('"step": 1,', '"step": 1' + "0" * 5000 + ",")
        assert bad != json.dumps(current)
    marker.write_bytes(bad if isinstance(bad, bytes) else bad.encode())
    assert not is_complete(checkpoint)
    with caplog.at_level("WARNING", logger="distflow"):
        assert latest_checkpoint(checkpoint.parent) == good
    assert f"skipping incomplete checkpoint {checkpoint}" in caplog.text
    with pytest.raises(ConfigError, match="is incomplete"):
        read_marker(checkpoint)
