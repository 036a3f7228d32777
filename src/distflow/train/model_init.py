"""Meta-device start-up: every rank builds a model's skeleton on the meta device, shards it, and
fills its shards from the one full copy that global rank 0 reads from disk.

Reading the whole fp32 model on every rank before sharding makes a node's start-up host memory
grow with ranks x model size (a 7B model is ~30 GB per rank). Here only rank 0 holds a full copy,
and only while the shards fill: torch's set_model_state_dict(broadcast_from_rank0) sends one
tensor at a time and each rank keeps its slice.

Global rank 0, not local rank 0 of each node: torch's broadcast_from_rank0 reads from global rank
0 over the default group, and one read per job keeps every other host free of a full copy; each
rank receives the same bytes (the full model, one tensor at a time) either way.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from distflow.distributed import role_group
from distflow.models.anatomy import attention_kwargs, skeleton


def initial_model(auto_cls, model_path: str, config, meta_device: bool,
                  trust_remote_code: bool = False) -> tuple[torch.nn.Module, Callable[[], torch.nn.Module]]:
    """(model, load): `auto_cls`'s fp32 model for `config` from `model_path`, either loaded now or,
    with `meta_device`, as a skeleton that ShardedModel fills by calling `load` on rank 0. Ranks that
    took roles (pipeline.mode=split) each load it: torch's broadcast_from_rank0 runs on the default
    group, which holds the rollout ranks too."""
    load = functools.partial(auto_cls.from_pretrained, model_path, config=config, dtype=torch.float32,
                             trust_remote_code=trust_remote_code, **attention_kwargs(config))
    meta_device = meta_device and role_group() is None
    return (skeleton(auto_cls, config, trust_remote_code) if meta_device else load()), load


def is_meta(model: torch.nn.Module) -> bool:
    return any(t.is_meta for t in model.parameters())


def _non_persistent_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Buffers no state dict carries (e.g. rotary inv_freq), in module order."""
    return [(f"{prefix}.{name}" if prefix else name, buf)
            for prefix, module in model.named_modules()
            for name, buf in module.named_buffers(recurse=False) if name in module._non_persistent_buffers_set]


def materialize(model: torch.nn.Module, device: torch.device,
                load_full: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """Allocate a sharded meta skeleton on `device` and fill it with the weights `load_full()`
    returns on global rank 0 (the only rank that calls it). Afterwards every rank holds what
    loading the full model itself and sharding it would have given: the same parameters (a tied
    weight filled once and still one parameter), the same non-persistent buffers, and rank 0's
    global RNG state (which the load may have drawn from, as every rank's load did before)."""
    model.to_empty(device=device)  # DTensor parameters are swapped in place, so ties survive
    # Rank 0 reads the model, then tells every rank what it got (or why it failed) in one message,
    # so a bad checkpoint stops every rank with the same error instead of leaving peers waiting.
    full, full_sd, header, error = None, {}, None, None
    if dist.get_rank() == 0:
        try:
            full = load_full()
            # named_parameters() lists a tied weight once, under its first name: it is sent once.
            names = {n for n, _ in full.named_parameters()} | set(dict(full.named_buffers()))
            full_sd = {k: v for k, v in full.state_dict().items() if k in names}
            header = {"keys": sorted(full_sd), "rng": torch.get_rng_state(),
                      "buffers": [(n, b.cpu()) for n, b in _non_persistent_buffers(full)]}
        except Exception as exc:  # noqa: BLE001 - sent to every rank, then re-raised below
            error, header = exc, {"error": f"{type(exc).__name__}: {exc}"}
    box = [header]
    dist.broadcast_object_list(box, src=0)
    header = box[0]
    if error is not None:
        raise error
    if "error" in header:
        raise RuntimeError(f"rank 0 could not load the model's weights: {header['error']}")
    _check_keys(model, header["keys"])
    set_model_state_dict(model, full_sd,
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False))
    del full, full_sd
    # Matched by order, not name: a wrapper (activation checkpointing) adds a level to the names
    # but keeps the module order.
    mine = _non_persistent_buffers(model)
    if [tuple(b.shape) for _, b in mine] != [tuple(b.shape) for _, b in header["buffers"]]:
        raise RuntimeError(f"the model's non-persistent buffers {[n for n, _ in mine]} differ from those rank 0 "
                           f"loaded {[n for n, _ in header['buffers']]}")
    with torch.no_grad():
        for (_, buf), (_, value) in zip(mine, header["buffers"]):
            buf.copy_(value)
    torch.set_rng_state(header["rng"])
    return model


def _check_keys(model: torch.nn.Module, sent: list[str]) -> None:
    """Rank 0 sent exactly the skeleton's state-dict keys, each tied weight under its first name
    only (strict=False lets the later names through; this keeps the check strict)."""
    seen, expected = set(), set()
    for key, value in model.state_dict(keep_vars=True).items():  # the parameters themselves
        if id(value) not in seen:
            seen.add(id(value))
            expected.add(key)
    if set(sent) != expected:
        missing, extra = sorted(expected - set(sent)), sorted(set(sent) - expected)
        raise RuntimeError(f"rank 0's weights do not match the model: missing {missing[:5]}, unexpected {extra[:5]}")
