"""The PEFT adapter folder (`write_adapter_folder`: what PEFT and vLLM load), and where a vLLM
engine reads the LoRA adapter from after every update (vLLM 0.32 loads adapters
from folders only): a folder in RAM (/dev/shm) while that has room, else one on disk.

The adapter is written in the engine's dtype (a bf16 engine gets half the bytes of the float32
trainable weights). /dev/shm can be small: Docker gives containers 64 MiB by default, less than a
rank-16 adapter of a 1.5B model in float32 (74 MB). Before each write the folder checks that its
file system holds the new file beside the old one, and otherwise moves to the temporary folder
on disk for the rest of the run, with one line in the log.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile

import torch

log = logging.getLogger("distflow")
SLACK_BYTES = 1 << 20
WEIGHTS_FILE = "adapter_model.safetensors"  # PEFT's file names
CONFIG_FILE = "adapter_config.json"  # the config file, safetensors' header, the file system's own blocks


def write_adapter_folder(tensors: dict[str, torch.Tensor], config, folder: str) -> str:
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors) that PEFT's
    PeftModel.from_pretrained and vLLM's LoRARequest load. The weights are written to a temporary
    name and renamed, so a reader never sees half a file."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{WEIGHTS_FILE}.tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(folder, WEIGHTS_FILE))
    record = config.to_dict()
    record["target_modules"] = sorted(record["target_modules"])
    with open(os.path.join(folder, CONFIG_FILE), "w") as f:
        json.dump(record, f, indent=2, default=str)
    return folder


def writable_dir(path: str | None) -> str | None:
    return path if path and os.path.isdir(path) and os.access(path, os.W_OK) else None


class AdapterFolder:
    def __init__(self, dtype: torch.dtype, ram: str | None = "/dev/shm", disk: str | None = None):
        self.dtype = dtype
        self.disk = disk or tempfile.gettempdir()
        self.in_ram = writable_dir(ram) is not None
        self.path = tempfile.mkdtemp(prefix="distflow-adapter-", dir=ram if self.in_ram else self.disk)

    def write(self, tensors: dict[str, torch.Tensor], config) -> str:
        """The folder holding `tensors` (PEFT file names) and `config`, in the engine's dtype."""
        tensors = {k: v.detach().to(self.dtype).contiguous() for k, v in tensors.items()}
        need = sum(t.numel() * t.element_size() for t in tensors.values()) + SLACK_BYTES
        free = shutil.disk_usage(self.path).free
        if self.in_ram and free < need:
            moved = tempfile.mkdtemp(prefix="distflow-adapter-", dir=self.disk)
            log.warning(f"the LoRA adapter ({need / 2**20:.1f} MiB) no longer fits in {os.path.dirname(self.path)} "
                        f"({free / 2**20:.1f} MiB free); it is written to {moved} on disk from now on")
            shutil.rmtree(self.path, ignore_errors=True)
            self.path, self.in_ram = moved, False
        return write_adapter_folder(tensors, config, self.path)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
