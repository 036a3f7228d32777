"""LoRA adapters on the policy, through PEFT.

PEFT's `inject_adapter_in_model` replaces each targeted linear layer in place by a LoRA layer
that keeps the original under `<name>.base_layer` and adds `lora_A.default` / `lora_B.default`
(y = base(x) + alpha/r * B(A(dropout(x)))). The model stays the HF model (no PeftModel wrapper),
so FSDP2 shards it block by block as before and the decoder blocks are where they were. The
base is frozen; only the adapters have requires_grad, so only they get gradients, optimizer
state and checkpoint space.

Names: the policy's own names are PEFT's in-model names (`...q_proj.lora_A.default.weight`,
`...q_proj.base_layer.weight`). The engine gets HF names (merged weights, `...q_proj.weight`) or
a PEFT adapter folder (`base_model.model....q_proj.lora_A.weight`), the format PEFT's
`save_pretrained` writes and PEFT and vLLM load.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Iterator

import torch
from torch.distributed.tensor import DTensor

from distflow.config import ConfigError, LoraConfig
from distflow.models.adapter_folder import CONFIG_FILE, WEIGHTS_FILE, write_adapter_folder
from distflow.models.anatomy import default_targets

ADAPTER = "default"  # PEFT's adapter name inside the model
_BASE = ".base_layer."
_ADAPTER_KEYS = (f".lora_A.{ADAPTER}.", f".lora_B.{ADAPTER}.")


def peft_config(cfg: LoraConfig, blocks: list[torch.nn.Module], base_path: str = ""):
    """PEFT's LoraConfig for `cfg`; the default targets are found in `blocks`."""
    from peft import LoraConfig as PeftLoraConfig

    targets = list(cfg.target_modules) or default_targets(blocks)
    if not targets:
        raise ConfigError("model.lora: the decoder blocks have no linear layers to adapt; name them in "
                          "model.lora.target_modules")
    return PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                          bias="none", base_model_name_or_path=base_path or None)


def add_adapters(model: torch.nn.Module, config) -> torch.nn.Module:
    """Inject the LoRA layers of PEFT `config` into `model` in place and freeze everything else; PEFT's refusals
    (a target that matches nothing, a layer type it cannot adapt) become one-line ConfigErrors.
    lora_A is drawn from the global RNG (PEFT's Kaiming init), lora_B starts at zero, so the
    adapted model starts equal to the base."""
    from peft import inject_adapter_in_model

    try:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except (ValueError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"model.lora.target_modules={sorted(config.target_modules)} on "
                          f"{type(model).__name__}: {first}") from None
    return model


def has_adapters(model: torch.nn.Module) -> bool:
    return any(_is_lora_layer(m) for m in model.modules())


def _is_lora_layer(module: torch.nn.Module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "base_layer") and ADAPTER in getattr(module, "lora_A", {})


def _lora_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if _is_lora_layer(m)]


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Forward passes compute the base model alone (the KL reference of a LoRA run).

    Sets PEFT's per-layer flag directly: PEFT's own `enable_adapters(False)` also flips the
    adapters' requires_grad, and FSDP2 builds its unsharded parameters with the flag it sees
    first, so a reference pass before the first training pass would leave the adapters
    without gradients."""
    layers = _lora_layers(model)
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, flag in zip(layers, before):
            m._disable_adapters = flag


@contextlib.contextmanager
def dropout_off(model: torch.nn.Module) -> Iterator[None]:
    """The adapters' dropout layers in eval mode for the duration (logprob passes)."""
    drops = [d for m in _lora_layers(model) for d in m.lora_dropout.values() if d.training]
    for d in drops:
        d.eval()
    try:
        yield
    finally:
        for d in drops:
            d.train()


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t


def merged_parameters(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor in `dtype`) for every parameter of the model, adapters (if any)
    folded in: W + alpha/r * B @ A, computed in float32 from the gathered base and adapters, then
    cast. Collective, in named_parameters() order; weight_stream.full_parameters buckets it.

    Written here rather than with PEFT's merge: PEFT merges into the (sharded) base weight in
    place, and the policy must keep training on the unmerged base."""
    layers = {name: m for name, m in model.named_modules() if _is_lora_layer(m)}
    for name, param in model.named_parameters():
        if is_adapter_key(name):
            continue  # folded into its base weight below
        owner, _, leaf = name.partition(_BASE)
        if leaf == "weight" and owner in layers:
            m = layers[owner]
            a, b = _full(m.lora_A[ADAPTER].weight).float(), _full(m.lora_B[ADAPTER].weight).float()
            # one fused W + s * B @ A, no full-size temporaries besides the result
            yield f"{owner}.weight", torch.addmm(_full(param).float(), b, a, alpha=m.scaling[ADAPTER]).to(dtype)
        else:
            t = param.detach().to(dtype)  # cast the shard, then gather: bf16 moves half the bytes
            yield name.replace(_BASE, "."), _full(t)


def is_adapter_key(name: str) -> bool:
    return any(k in name for k in _ADAPTER_KEYS)


def adapter_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' full tensors (float32, on the CPU) under PEFT's file names. Collective."""
    out = {}
    for name, param in model.named_parameters():
        if is_adapter_key(name):
            out[file_key(name)] = _full(param).float().cpu().contiguous()
    return out


def file_key(name: str) -> str:
    """The in-model name `model.layers.0.q_proj.lora_A.default.weight` as PEFT's adapter file
    names it: `base_model.model.model.layers.0.q_proj.lora_A.weight`."""
    for key in _ADAPTER_KEYS:
        name = name.replace(key, key.replace(f".{ADAPTER}.", "."))
    return f"base_model.model.{name}"


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]
