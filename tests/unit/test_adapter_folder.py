"""The engine's adapter folder: written in the engine's dtype, in RAM while the RAM file system
has room for it, on disk from the first write that would not fit (a real 256 KiB tmpfs)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from peft import LoraConfig
from safetensors.torch import load_file

from distflow.models.adapter_folder import AdapterFolder
from mount_helpers import private_tmpfs

CONFIG = LoraConfig(r=4, target_modules=["q_proj"])


def _adapter(rows: int) -> dict[str, torch.Tensor]:
    return {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(rows, 64),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4)}


def test_adapter_moves_to_disk_when_ram_is_too_small(tmp_path, caplog):
    with private_tmpfs(tmp_path / "shm", size="2m") as shm:
        folder = AdapterFolder(torch.bfloat16, ram=str(shm), disk=str(tmp_path / "disk"))
        (tmp_path / "disk").mkdir()
        first = Path(folder.write(_adapter(4), CONFIG))
        assert folder.in_ram and first.parent == shm  # 0.5 KiB in bf16 (+1 MiB slack) fits in 2 MiB
        weights = load_file(first / "adapter_model.safetensors")
        assert {t.dtype for t in weights.values()} == {torch.bfloat16}  # the engine's dtype, half the bytes
        with caplog.at_level(logging.WARNING, logger="distflow"):
            second = Path(folder.write(_adapter(8192), CONFIG))  # 1 MiB in bf16: no room beside the slack
        assert not folder.in_ram and second.parent == tmp_path / "disk" and not first.exists()
        assert "no longer fits" in caplog.text and str(second) in caplog.text
        assert load_file(second / "adapter_model.safetensors")[next(iter(_adapter(1)))].shape == (8192, 64)
        assert (second / "adapter_config.json").is_file()
        third = Path(folder.write(_adapter(4), CONFIG))  # stays on disk for the rest of the run
        assert third == second
        folder.remove()
        assert not second.exists()


def test_without_a_ram_file_system_the_folder_starts_on_disk(tmp_path):
    folder = AdapterFolder(torch.float32, ram=str(tmp_path / "missing"), disk=str(tmp_path))
    assert not folder.in_ram and Path(folder.path).parent == tmp_path
    assert load_file(Path(folder.write(_adapter(2), CONFIG)) / "adapter_model.safetensors")
    folder.remove()
