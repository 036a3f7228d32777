"""Export a checkpoint (or the live policy) as a plain HF folder: safetensors, config, tokenizer.

    python -m distflow.export <checkpoint_dir> <out_dir>

The result loads with `transformers` and vLLM like any hub model. The CLI needs no process
group: DCP reads the sharded checkpoint into one unsharded model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoModelForCausalLM, AutoTokenizer

from distflow.checkpoint import POLICY, read_marker
from distflow.config import ConfigError


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


def export_live(model: torch.nn.Module, model_path: str, out_dir: str, write: bool) -> None:
    """Collective: every rank gathers the FSDP2 model's full weights; the rank with `write` saves them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from distflow.distributed import barrier

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if write:
        save_hf_folder(model_path, full, out_dir)
    barrier()


def export_checkpoint(checkpoint: str, out_dir: str) -> str:
    path = Path(checkpoint)
    try:
        model_path = read_marker(path)["meta"]["model_path"]
    except ConfigError as e:
        raise SystemExit(f"distflow.export: error: {e}") from None
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    state = {POLICY: {"model": model.state_dict()}}
    dcp.load(state, checkpoint_id=str(path))
    return save_hf_folder(model_path, state[POLICY]["model"], out_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m distflow.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint folder (…/checkpoints/step_NNNNNN)")
    parser.add_argument("out_dir", help="where to write the HF folder")
    args = parser.parse_args(argv)
    print(export_checkpoint(args.checkpoint, args.out_dir))


if __name__ == "__main__":
    main(sys.argv[1:])
