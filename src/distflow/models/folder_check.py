"""What a model folder must hold before anything reads it, each defect as one line naming the key,
the folder and the file: transformers' own errors for these cases are multi-line tracebacks from
deep inside `from_pretrained` (or, for a missing weights file, a failure minutes later on the
policy's load), and they never say which config key pointed there.

Checked, cheaply (no tensor is read): config.json exists, is a JSON object with a `model_type`
this transformers knows (or code the user trusts via `auto_map`); a weights file exists; every
shard a safetensors index names exists; each safetensors file is as long as its header says; and
a tokenizer file exists.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from distflow.errors import ConfigError

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model")


def check_model_folder(path: str | Path, key: str = "model.path", trust_remote_code: bool = False,
                       tokenizer: bool = True) -> None:
    """ConfigError (one line) for the first defect of the local model folder `path` (`tokenizer`: whether
    it must hold one: the critic's folder need not)."""
    folder = Path(path)
    where = f"{key} {folder}"
    config = _config(folder, where)
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError(f"{where}: config.json has no model_type, so no architecture can be chosen")
    if not (trust_remote_code and "auto_map" in config):
        from transformers import __version__
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        if model_type not in CONFIG_MAPPING_NAMES:
            remote = " (its config names custom code: set model.trust_remote_code=true to run it)" \
                if "auto_map" in config else ""
            raise ConfigError(f"{where}: model_type {model_type!r} is not an architecture transformers "
                              f"{__version__} knows{remote}")
    for shard in _weight_files(folder, where):
        _check_safetensors(shard, where)
    if tokenizer and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"{where} has no tokenizer file (one of {', '.join(TOKENIZER_FILES)})")


def _config(folder: Path, where: str) -> dict:
    file = folder / "config.json"
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{where} has no config.json: not a Hugging Face model folder") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where}: config.json cannot be read: {getattr(e, 'strerror', None) or e}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: config.json is not JSON ({e.msg} at line {e.lineno} column {e.colno})") \
            from None
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: config.json holds a {type(config).__name__}, not an object")
    return config


def _weight_files(folder: Path, where: str) -> list[Path]:
    """The safetensors files to check (a .bin is left to torch); ConfigError when there is no weights
    file or an index names a shard that is not there."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{where}: {index.name} is not a safetensors index ({type(e).__name__})") from None
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise ConfigError(f"{where}: {index.name} names {len(missing)} shard(s) that are not there, "
                              f"e.g. {missing[0]}")
        return [folder / s for s in shards]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    if any((folder / name).is_file() for name in WEIGHT_FILES) or any(folder.glob("*.safetensors")):
        return sorted(folder.glob("*.safetensors"))
    raise ConfigError(f"{where} has no weights file (one of {', '.join(WEIGHT_FILES)})")


def _check_safetensors(file: Path, where: str) -> None:
    """A safetensors file is an 8-byte header length, the JSON header, then the tensors' bytes: the
    header's largest end offset says how long the file must be (a cut download is shorter)."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            (length,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
            header = json.loads(f.read(length)) if length is not None and 0 < length <= size - 8 else None
    except OSError as e:
        raise ConfigError(f"{where}: {file.name} cannot be read: {e.strerror or e}") from None
    except ValueError:
        header = None
    if not isinstance(header, dict):
        raise ConfigError(f"{where}: {file.name} is not a safetensors file (its header cannot be read)")
    ends = [t["data_offsets"][1] for k, t in header.items()
            if k != "__metadata__" and isinstance(t, dict) and len(t.get("data_offsets", ())) == 2]
    need = 8 + length + max(ends, default=0)
    if size < need:
        raise ConfigError(f"{where}: {file.name} is cut short ({size} bytes, its header describes {need}): "
                          "download or copy it again")


def check_same_tokenizer(model_path: str | Path, other_path: str | Path, key: str,
                         trust_remote_code: bool = False) -> None:
    """ConfigError (one line) when the folder `other_path` (named by `key`) tokenizes differently from
    the policy's `model_path`: a model that scores the policy's token ids (a distillation teacher)
    must read them as the same tokens. Compares the vocabularies (token -> id) and the special tokens."""
    from transformers import AutoTokenizer

    mine, theirs = (AutoTokenizer.from_pretrained(p, trust_remote_code=trust_remote_code)
                    for p in (model_path, other_path))
    a, b = mine.get_vocab(), theirs.get_vocab()
    if a == b and mine.all_special_tokens == theirs.all_special_tokens:
        return
    differ = sorted((t for t in a.keys() | b.keys() if a.get(t) != b.get(t)),
                    key=lambda t: min(a.get(t, 1 << 62), b.get(t, 1 << 62)))
    where = lambda vocab: f"id {vocab[differ[0]]}" if differ[0] in vocab else "absent"  # noqa: E731
    example = f"token {differ[0]!r} is {where(b)} in its vocabulary and {where(a)} in the policy's" if differ \
        else f"special tokens {theirs.all_special_tokens} against {mine.all_special_tokens}"
    raise ConfigError(f"{key} {other_path} has another tokenizer than model.path {model_path} ({len(b)} tokens "
                      f"against {len(a)}; {example}): it scores the policy's token ids, so both must use one tokenizer")
