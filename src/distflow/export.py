"""Export a checkpoint (or the live policy) as a plain HF folder: safetensors, config, tokenizer.

    python -m distflow.export <checkpoint_dir> <out_dir>

The result loads with `transformers` and vLLM like any hub model. The CLI needs no process
group: DCP reads the sharded checkpoint into one unsharded model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoModelForCausalLM, AutoTokenizer

from distflow.checkpoint import MARKER, is_complete


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


def export_checkpoint(checkpoint: str, out_dir: str) -> str:
    path = Path(checkpoint)
    if not is_complete(path):
        raise SystemExit(f"distflow.export: error: {checkpoint} is not a complete checkpoint (no {MARKER} marker)")
    model_path = json.loads((path / MARKER).read_text())["model_path"]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    state = {"app": {"model": model.state_dict()}}
    dcp.load(state, checkpoint_id=str(path))
    return save_hf_folder(model_path, state["app"]["model"], out_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m distflow.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint folder (…/checkpoints/step_NNNNNN)")
    parser.add_argument("out_dir", help="where to write the HF folder")
    args = parser.parse_args(argv)
    print(export_checkpoint(args.checkpoint, args.out_dir))


if __name__ == "__main__":
    main(sys.argv[1:])
