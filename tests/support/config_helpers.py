"""Compose a config exactly as recipes/grpo.py does, in-process: the recipe's Hydra schema and
resolver, old key spellings renamed, the typed config built (unknown keys and bad choices raise)."""

from __future__ import annotations

import importlib.util

from launch_helpers import ROOT

RECIPES = ROOT / "recipes"
_recipe = None


def fp32_config():
    """The default DistflowConfig in float32, its other automatic values resolved for the CPU as the
    start-up plan resolves them (components refuse "auto"). In-process tests compare against float32
    references (engine vs policy to 1e-5, 1 vs 2 ranks), so they pin it: model.dtype=auto picks bf16
    on CPUs with bf16 matrix instructions. model.shard_ranks stays null: the layout follows
    model.path, which some tests change."""
    from distflow.config import DistflowConfig
    from distflow.distributed.devices import resolve_auto

    cfg = DistflowConfig()
    cfg.model.dtype = "float32"
    cfg = resolve_auto(cfg, "cpu")
    cfg.model.shard_ranks = None
    return cfg


def recipe():
    """recipes/grpo.py as a module, loaded once: it registers the schema in Hydra's ConfigStore and
    the recipes_dir resolver."""
    global _recipe
    if _recipe is None:
        spec = importlib.util.spec_from_file_location("grpo_recipe", RECIPES / "grpo.py")
        _recipe = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_recipe)
    return _recipe


def compose(overrides: list[str]):
    """The DistflowConfig a `recipes/grpo.py` command line builds (not yet validated)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from distflow.config import DistflowConfig, rename_overrides

    recipe()
    overrides, _ = rename_overrides(list(overrides))
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        tree = hydra_compose("grpo", overrides=overrides)
    return DistflowConfig.from_dict(OmegaConf.to_container(tree, resolve=True))
