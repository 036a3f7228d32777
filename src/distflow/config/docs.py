"""docs/configuration.md, generated from the schema: `python -m distflow config-docs > docs/configuration.md`.

The page lists every key with its type, default and doc, and marks the operational ones (those
a resumed run may change). A test fails when the committed page differs from what this writes.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import typing
from typing import Any

from distflow.config.aliases import ALIASES, REMOVED
from distflow.config.fields import choices_of, leaf_keys
from distflow.config.schema import DistflowConfig

HEADER = """# Configuration

Every key of a run, generated from `distflow.config` (`python -m distflow config-docs`); do not
edit by hand. Set a key on the command line (`run.steps=20`), in an experiment file under
`recipes/experiment/`, or through a config group (`algorithm=dapo`, `model=smollm2_135m`,
`task=gym_arith`, `rollout=hf`). Unknown keys and values outside a key's choices stop every rank
with one line before anything loads.

**Operational** keys (marked ✓) change where or how a run executes, logs or saves, not what it
computes: a resumed run may change them (`checkpoint.resume=auto` compares every other key with
the checkpoint's and stops on a difference). Values written `a | b` are the only ones accepted.
"""


def _type(annotation: Any) -> str:
    allowed = choices_of(annotation)
    if allowed is not None:
        text = " | ".join(str(a) for a in allowed)
        return f"list of {text}" if typing.get_origin(annotation) is list else text
    optional = type(None) in typing.get_args(annotation)
    if optional:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    origin = typing.get_origin(annotation)
    name = {list: "list", dict: "dict"}.get(origin) or getattr(annotation, "__name__", str(annotation))
    return f"{name} or null" if optional else name


def _default(f: dataclasses.Field) -> str:
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return "`" + json.dumps(value) + "`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def configuration_markdown() -> str:
    hints = typing.get_type_hints(DistflowConfig)
    lines = [HEADER]
    for section in dataclasses.fields(DistflowConfig):
        cls = hints[section.name]
        lines += [f"## {section.name}", ""]
        doc = inspect.getdoc(cls)
        if doc and not doc.startswith(f"{cls.__name__}("):
            lines += [" ".join(doc.split()), ""]
        lines += ["| key | type | default | ✓ | what it does |", "|---|---|---|---|---|"]
        for key, f, annotation in leaf_keys(cls, f"{section.name}."):
            lines.append(f"| `{key}` | {_cell(_type(annotation))} | {_cell(_default(f))} | "
                         f"{'✓' if f.metadata.get('operational') else ''} | {_cell(f.metadata.get('doc', ''))} |")
        lines.append("")
    lines += ["## Old spellings", "",
              "These keys were renamed; an override that uses one still works and logs one line naming the new key.",
              "", "| old key | new key |", "|---|---|"]
    lines += [f"| `{old}` | {f'`{new}`' if new else f'removed: {REMOVED[old]}'} |" for old, new in ALIASES.items()]
    return "\n".join(lines) + "\n"
