"""Load a DCP checkpoint as data: nothing in a checkpoint folder can run code when it is read.

torch.distributed.checkpoint unpickles its `.metadata` with plain pickle and loads non-tensor
entries (an optimizer's param_groups: floats, bools, tuples, parameter names) with
torch.load(weights_only=False), so a tampered checkpoint would run code at resume and at
export. `load_checkpoint` reads the same files with:

- an unpickler for `.metadata` that resolves only the classes DCP writes there (ALLOWED: the
  metadata dataclasses, torch.Size, dtypes, layouts, the path DCP records), found by unpickling
  distflow's checkpoints of a dense policy, a LoRA policy and a PPO critic;
- torch.load(weights_only=True) for the non-tensor entries (DCP already loads tensors so);
- every file the metadata points at being a plain file of the checkpoint folder.

Anything else is a one-line ConfigError naming the file and what was refused, raised before any
state is touched (the metadata) or on every rank alike (an entry).
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from distflow.config import ConfigError
from distflow.distributed import role_group

METADATA = ".metadata"
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
ALLOWED = {
    *((_DCP_METADATA, name) for name in ("Metadata", "TensorStorageMetadata", "ChunkStorageMetadata",
                                          "BytesStorageMetadata", "TensorProperties", "MetadataIndex",
                                          "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name ("torch.strided")
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),  # StorageMeta.checkpoint_id
    ("collections", "OrderedDict"),
}


class _Refused(pickle.UnpicklingError):
    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")


def _refusal(file: Path, what: str) -> ConfigError:
    return ConfigError(f"checkpoint file {file} refers to {what}, which a distflow checkpoint never holds; refused "
                       "(a checkpoint is data: distflow runs no code from it)")


def read_metadata(folder: Path) -> Metadata:
    """The folder's DCP metadata, unpickled with only ALLOWED classes; ConfigError otherwise."""
    file = Path(folder) / METADATA
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _Refused as e:
        raise _refusal(file, e.what) from None
    except OSError as e:
        raise ConfigError(f"checkpoint file {file} cannot be read: {e.strerror or e}") from None
    except Exception as e:  # noqa: BLE001 - a truncated or garbled pickle raises many types
        raise ConfigError(f"checkpoint file {file} is not DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise ConfigError(f"checkpoint file {file} is not DCP metadata (it holds a {type(metadata).__name__})")
    for info in metadata.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not (isinstance(info, _StorageInfo) and is_plain_name(name) and is_count(info.offset)
                and is_count(info.length)):
            raise ConfigError(f"checkpoint file {file} points outside its folder or at no file ({info!r}); refused")
    return metadata


def is_count(value: object) -> bool:
    """An int >= 0 (JSON's true/false and pickled bools are not counts)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_plain_name(name: object) -> bool:
    """A file name inside a checkpoint folder: no path separator, not empty, not . or .."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


class RestrictedReader(FileSystemReader):
    """FileSystemReader whose metadata comes from `read_metadata`. No `rank` keyword: DCP would
    otherwise fall back to a rank's own metadata file, which distflow never writes."""

    def read_metadata(self, *args: Any) -> Metadata:
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class RestrictedPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that loads non-tensor entries with weights_only=True."""

    def __init__(self, reader: RestrictedReader):
        super().__init__()
        self.reader = reader

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            file = Path(self.reader.path) / self.reader.storage_data[read_item.storage_index].relative_path
            raise _refusal(file, f"{_unsupported(e)} (entry {read_item.dest_index.fqn})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _unsupported(e: Exception) -> str:
    """The global torch's weights_only unpickler refused, from its message."""
    m = re.search(r"GLOBAL ([\w.]+)", str(e))
    return m.group(1) if m else str(e).strip().splitlines()[0]


def load_checkpoint(state: dict[str, Any], folder: Path | str) -> None:
    """dcp.load(state, folder) in place, through RestrictedReader and RestrictedPlanner. The metadata
    is checked here first, so a refused one is a ConfigError on every rank, before DCP starts."""
    read_metadata(Path(folder))
    reader = RestrictedReader(folder)
    try:
        dcp.load(state, storage_reader=reader, planner=RestrictedPlanner(reader), process_group=role_group())
    except CheckpointException as e:  # a rank's failure, handed to every rank by DCP
        for error, _ in e.failures.values():
            if isinstance(error, ConfigError):
                raise ConfigError(str(error)) from None
            if isinstance(error, pickle.UnpicklingError):  # a tensor entry (DCP loads those weights_only)
                raise _refusal(Path(folder), _unsupported(error)) from None
        # CheckpointException is a BaseException: unmapped, it would pass every `except Exception` as a
        # traceback on every rank. A shape or key mismatch means another model or config wrote it.
        error = next(iter(e.failures.values()))[0] if e.failures else e
        what = " ".join(str(error).split()) or type(error).__name__
        if isinstance(error, OSError):
            raise ConfigError(f"checkpoint {folder} cannot be read: {error.strerror or what}") from None
        raise ConfigError(f"checkpoint {folder} does not fit this run's model: {what}; it was written by a run with "
                          "another model or model config (checkpoint.resume=never starts afresh)") from None
