"""Resolve a user-named callable: a built-in name, or `package.module:attribute` imported.

Rewards, environments and tool-call parsers are all named this way in the config; any problem
(a typo, a module that fails to import, a missing attribute) is one ConfigError line naming the
config key, raised at start-up on every rank.
"""

from __future__ import annotations

import importlib
from typing import Mapping

from distflow.config import ConfigError

# Modules that moved inside distflow, under the names a config may still give them.
MOVED_MODULES = {"distflow.rewards": "distflow.tasks.rewards", "distflow.envs": "distflow.tasks.envs",
                 "distflow.data": "distflow.tasks"}


def current_module(name: str) -> str:
    """`name` as it is called now, for a distflow module that moved (`distflow.envs` and below)."""
    for old, new in MOVED_MODULES.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old):]
    return name


def resolve(spec: str, builtins: Mapping[str, object], key: str, form: str = "module:function"):
    if spec in builtins:
        return builtins[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key} {spec!r} is neither a built-in ({', '.join(builtins)}) nor '{form}'")
    try:
        obj = getattr(importlib.import_module(current_module(module_name)), attr)
    except Exception as e:  # ImportError, AttributeError, or anything the module raises on import
        raise ConfigError(f"{key} {spec!r} cannot be imported: {type(e).__name__}: {e}".replace("\n", " ")) from e
    if not callable(obj):
        raise ConfigError(f"{key} {spec!r} is not callable")
    return obj
