"""Export a checkpoint (or the live policy) as a plain HF folder: safetensors, config, tokenizer.

    python -m distflow export <checkpoint_dir> <out_dir>            # LoRA: a PEFT adapter folder
    python -m distflow export --merged <checkpoint_dir> <out_dir>   # LoRA: base + adapters merged

The result loads with `transformers` and vLLM like any hub model; a LoRA run's adapter folder
loads with PEFT (PeftModel.from_pretrained) on top of model.path, or as a vLLM LoRARequest. The
CLI needs no process group: DCP reads the sharded checkpoint into one unsharded model.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from distflow.config import ConfigError, LoraConfig
from distflow.checkpoint.checkpointer import POLICY, read_marker
from distflow.checkpoint.reader import load_checkpoint, read_metadata
from distflow.train.lora import (
    adapter_tensors,
    add_adapters,
    is_adapter_key,
    merged_parameters,
    peft_config,
)
from distflow.models.adapter_folder import write_adapter_folder
from distflow.models.anatomy import decoder_blocks


def save_hf_folder(model_path: str, state_dict: dict[str, torch.Tensor], out_dir: str) -> str:
    """Write `state_dict` (full tensors, HF names) with the base model's config and tokenizer."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = [k for k in missing if k not in getattr(model, "_tied_weights_keys", {}) and "lm_head" not in k]
    if missing or unexpected:
        raise RuntimeError(f"state dict does not fit {model_path}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(model_path).save_pretrained(out_dir)
    return out_dir


def export_live(model: torch.nn.Module, model_path: str, out_dir: str, write: bool, adapter_config=None,
                adapter_dir: str = "") -> None:
    """Collective: every rank gathers the FSDP2 model's full weights; the rank with `write` saves
    them. A model with adapters (`adapter_config`, PEFT's) also writes its PEFT adapter folder
    to `adapter_dir`; `out_dir` gets the merged weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from distflow.distributed import barrier

    if adapter_config is not None:
        adapters = adapter_tensors(model)
        full = {name: t.cpu() for name, t in merged_parameters(model, torch.float32)}
        if write:
            write_adapter_folder(adapters, adapter_config, adapter_dir)
    else:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if write:
        save_hf_folder(model_path, full, out_dir)
    barrier()


def export_checkpoint(checkpoint: str, out_dir: str, merged: bool = False) -> str:
    """An HF folder of the checkpoint's policy; a LoRA checkpoint gives its PEFT adapter folder,
    or with `merged` an HF folder of base + adapters."""
    path = Path(checkpoint)
    try:
        marker = read_marker(path)
        read_metadata(path)  # refused before any model loads
    except ConfigError as e:
        raise SystemExit(f"distflow export: error: {e}") from None
    model_path = marker["model_path"]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    lora = LoraConfig(**marker["config"]["model"]["lora"])
    config = None
    if lora.enabled:  # the checkpoint holds the adapters only
        config = peft_config(lora, decoder_blocks(model), model_path)
        add_adapters(model, config)
        state = {POLICY: {"model": {k: v for k, v in model.state_dict().items() if is_adapter_key(k)}}}
    else:
        state = {POLICY: {"model": model.state_dict()}}
    try:
        load_checkpoint(state, path)  # in place, into the model's own tensors; runs no code from the files
    except ConfigError as e:
        raise SystemExit(f"distflow export: error: {e}") from None
    if config is not None and not merged:
        return write_adapter_folder(adapter_tensors(model), config, out_dir)
    weights = dict(merged_parameters(model, torch.float32)) if config is not None else state[POLICY]["model"]
    return save_hf_folder(model_path, weights, out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distflow export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint folder (…/checkpoints/step_NNNNNN)")
    parser.add_argument("out_dir", help="where to write the HF folder")
    parser.add_argument("--merged", action="store_true",
                        help="a LoRA checkpoint: write base + adapters merged, not the adapter folder")
    args = parser.parse_args(argv)
    print(export_checkpoint(args.checkpoint, args.out_dir, args.merged))
    return 0
