"""How the schema's fields are declared and walked: one `knob()` per field, carrying its doc and
whether it is operational; choices as `Literal`; and the generic passes every section shares
(building typed sections from a plain nested dict, checking choices, the config record, the
flat key list that resume compares and the docs page lists).

A field is *operational* when it changes where or how a run executes, logs or saves, but not
what it computes (or only by float rounding): a requeued or resized job may change it and still
resume. Everything else names the run.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from dataclasses import MISSING, Field, dataclass, field
from typing import Any, Iterator, Literal, Union

from distflow.config.aliases import ALIASES
from distflow.errors import ConfigError


def knob(default: Any = MISSING, doc: str = "", *, operational: bool = False, factory: Any = MISSING,
         refused: dict[str, str] | None = None) -> Any:
    """A schema field with its documentation. `factory` for mutable defaults; `refused` names
    values outside the choices that deserve their own explanation (model.dtype=float16)."""
    meta = {"doc": " ".join(doc.split()), "operational": operational, "refused": refused or {}}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type) -> type:
    """A config section: a dataclass whose fields are knobs (or nested sections)."""
    return dataclass(cls)


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=False)


def choices_of(annotation: Any) -> tuple | None:
    """The allowed values of a Literal annotation (also inside Optional[...] or List[...])."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return typing.get_args(annotation)
    if origin in (Union, types.UnionType, list, tuple):
        for arg in typing.get_args(annotation):
            found = choices_of(arg)
            if found is not None:
                return found
    return None


def is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and dataclasses.is_dataclass(annotation)


def walk(obj: Any, prefix: str = "") -> Iterator[tuple[str, Field, Any, Any]]:
    """(dotted key, field, annotation, value) of every leaf field of a section, nested sections
    descended into (model.lora.rank)."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if is_section(hints[f.name]):
            yield from walk(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, hints[f.name], value


def leaf_keys(cls: type, prefix: str = "") -> Iterator[tuple[str, Field, Any]]:
    """(dotted key, field, annotation) of every leaf field of a section class."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if is_section(hints[f.name]):
            yield from leaf_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, hints[f.name]


def operational_keys(cls: type) -> frozenset[str]:
    return frozenset(key for key, f, _ in leaf_keys(cls) if f.metadata.get("operational"))


def check_choices(cfg: Any) -> None:
    """ConfigError (one line) for the first value outside its Literal's choices."""
    for key, f, annotation, value in walk(cfg):
        allowed = choices_of(annotation)
        if allowed is None or value is None:
            continue
        for v in value if isinstance(value, list) else [value]:
            if v not in allowed:
                if v in f.metadata.get("refused", {}):
                    raise ConfigError(f"{key}={v} is not supported: {f.metadata['refused'][v]}")
                raise ConfigError(f"{key} must be one of {', '.join(map(str, allowed))}; got {v!r}")


def _normalise(annotation: Any, value: Any) -> Any:
    """A string choice in any letter case is the declared one (logging.level=info is INFO); YAML
    and the command line give a boolean, or OmegaConf the string "True", for a choice written
    "true" (rollout.enforce_eager)."""
    allowed = choices_of(annotation)
    if not allowed or not all(isinstance(a, str) for a in allowed):
        return value
    if isinstance(value, list):
        return [_normalise(annotation, v) for v in value]
    text = str(value) if isinstance(value, (bool, str)) else None
    if text is None or text in allowed:
        return value
    return next((a for a in allowed if a.lower() == text.lower()), value)


def from_dict(cls: type, tree: dict[str, Any], prefix: str = "") -> Any:
    """A `cls` built from a plain nested dict (a composed Hydra config, a test's overrides),
    defaults for what is absent; ConfigError naming the first key the schema does not declare."""
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in tree.items():
        if key not in names:
            raise ConfigError(unknown_key_line(cls, prefix, key, value))
        if is_section(hints[key]):
            if not isinstance(value, dict):
                raise ConfigError(f"{prefix}{key} is a section of keys, got {value!r}")
            kwargs[key] = from_dict(hints[key], value, f"{prefix}{key}.")
        else:
            kwargs[key] = _typed(hints[key], _normalise(hints[key], value), f"{prefix}{key}")
    return cls(**kwargs)


_SCALARS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _typed(annotation: Any, value: Any, key: str) -> Any:
    """`value` as the scalar type its field declares (int, float, bool or str, optionally None),
    else ConfigError naming the key. A number written as text ("1e-5" from a YAML file) is the
    number; an int where a float is declared is that float. Other annotations pass unchecked."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    optional = type(None) in args
    kinds = [a for a in args if a is not type(None)]
    if value is None and optional or len(kinds) != 1 or kinds[0] not in _SCALARS:
        return value
    kind = kinds[0]
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind in (bool, str) and isinstance(value, kind):
        return value
    if isinstance(value, str) and kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    raise ConfigError(f"{key} must be {_SCALARS[kind]}{' or null' if optional else ''}, got {value!r}")


def _written(key: str, value: Any) -> str:
    """The first dotted key the user wrote under `key` (a whole section: its first leaf)."""
    while isinstance(value, dict) and value:
        child, value = next(iter(value.items()))
        key = f"{key}.{child}"
    return key


def unknown_key_line(cls: type, prefix: str, key: str, value: Any) -> str:
    """One line for a key `cls` does not have: the key as the user wrote it (under a section that does
    not exist, its leaf: `trainer.bogus_key`, not `trainer`) and the closest real key, if one is near:
    the same leaf name in another section (a renamed section), else the nearest spelling."""
    written = _written(f"{prefix}{key}", value)
    known = [k for k, _, _ in leaf_keys(cls, prefix)]
    leaf = written.rsplit(".", 1)[-1]
    near = [k for k in known if k.rsplit(".", 1)[-1] == leaf] or difflib.get_close_matches(written, known, 1, 0.75)
    if not near:  # a misspelt leaf under a renamed section: the nearest leaf name anywhere
        leaves = {k.rsplit(".", 1)[-1]: k for k in known}
        near = [leaves[m] for m in difflib.get_close_matches(leaf, leaves, 1, 0.8)]
    moved = sorted({new.split(".")[0] for old, new in ALIASES.items() if new and old.split(".")[0] == written.split(".")[0]})
    hint = f"; did you mean {near[0]}?" if near else \
        f"; {written.split('.')[0]}.* keys are now under {', '.join(moved)}" if moved else ""
    return f"unknown config key {written}{hint} (docs/configuration.md lists every key)"


def to_record(cfg: Any) -> dict[str, Any]:
    """The config as plain JSON data (nested dicts), exactly as json.dumps writes it."""
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def flat_record(record: dict[str, Any], cls: type) -> dict[str, Any]:
    """{"section.key": value} of a config record, nested sections flattened (model.lora.rank);
    a dict-valued field (task.gym_config) stays one value."""
    out: dict[str, Any] = {}
    hints = _hints(cls)
    for key, value in record.items():
        annotation = hints.get(key)
        if annotation is not None and is_section(annotation) and isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in flat_record(value, annotation).items()})
        else:
            out[key] = value
    return out


def hydra_schema(cls: type) -> type:
    """A copy of a section class that OmegaConf accepts (it has no Literal type): every Literal
    becomes its values' type. Hydra types and checks overrides against it; the recipe then builds
    the real config with `from_dict`, which checks the choices."""
    hints = _hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        annotation = hints[f.name]
        if is_section(annotation):
            annotation = hydra_schema(annotation)
            default = dict(default_factory=annotation)
        else:
            annotation = _plain(annotation)
            default = dict(default=f.default) if f.default is not MISSING else dict(default_factory=f.default_factory)
        specs.append((f.name, annotation, field(**default)))
    return dataclasses.make_dataclass(cls.__name__, specs)


def _plain(annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return type(typing.get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return typing.Optional[_plain(next(a for a in typing.get_args(annotation) if a is not type(None)))]
    if origin is list:
        return typing.List[_plain(typing.get_args(annotation)[0])]
    return annotation
