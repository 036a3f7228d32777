"""LoRA end to end: a 2-rank smoke run on the vLLM engine that resyncs the adapters alone, bit-exact
resume from an adapters-only checkpoint, the exports (live and from the checkpoint). The merged
resync streams HF-named full weights, the path every other run's resync takes: with LoRA it is
checked in-process (distributed/test_trainer_loop.py, which also has a bad target stop every rank
before any weights load)."""

import shutil

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from launch_helpers import read_metrics, stable_metrics, torchrun
from distflow.checkpoint.export import export_checkpoint

LORA = ["experiment=smoke", "rollout=vllm", "task.reward=rewards_for_tests:digit_fraction", "model.lora.enabled=true",
        "model.lora.rank=8", "optim.lr=1e-2", "algorithm.kl_coef=0.05"]


def _run(out, *extra, **kw):
    proc = torchrun([*LORA, f"run.output_dir={out}", *extra], **kw)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _equal_files(a, b):
    ta, tb = load_file(a), load_file(b)
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.mark.slow
def test_adapter_resync_run_resumes_bit_exact_and_exports(tmp_path, tiny_model_dir):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _run(straight, "model.lora.resync=adapter", "run.steps=4", "checkpoint.every=2",
         "checkpoint.export_at_end=true")
    rows = read_metrics(straight)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:  # vLLM serves the adapter the policy has: same logprobs after every resync
        assert r["sync/max_abs_logprob_diff"] <= 1e-5, r
    assert rows[-1]["loss/kl"] > 0  # the reference (adapters off) differs from the trained policy
    # the checkpoint is the adapters and their optimizer only
    ckpt = straight / "checkpoints" / "step_000002"
    keys = [k for k in FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata if k.startswith("policy.model.")]
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys), keys[:5]

    # resume from step 2, from a copy (the straight run's folder stays as it is)
    shutil.copytree(ckpt, tmp_path / "step2")
    proc = _run(resumed, "model.lora.resync=adapter", "run.steps=4", f"checkpoint.resume={tmp_path / 'step2'}",
                "checkpoint.export_at_end=true")
    assert "resumed from step 2" in proc.stdout
    again = read_metrics(resumed)  # a new folder: its metrics start where the checkpoint left off
    assert [r["step"] for r in again] == [3, 4]
    assert [stable_metrics(r) for r in again] == [stable_metrics(r) for r in rows[2:]]
    assert _equal_files(straight / "adapter" / "adapter_model.safetensors", resumed / "adapter" / "adapter_model.safetensors")

    # the checkpoint export equals the end-of-run export, as adapters and merged
    final = straight / "checkpoints" / "step_000004"
    cli = export_checkpoint(str(final), str(tmp_path / "cli_adapter"))
    assert _equal_files(straight / "adapter" / "adapter_model.safetensors", f"{cli}/adapter_model.safetensors")
    merged = export_checkpoint(str(final), str(tmp_path / "cli_merged"), merged=True)
    assert _equal_files(straight / "hf_model" / "model.safetensors", f"{merged}/model.safetensors")

    # PEFT puts the adapter on the untouched base: the merged export is exactly that, so training
    # changed no base weight
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(straight / "adapter"))
    by_peft = peft_model.merge_and_unload().state_dict()
    exported = load_file(straight / "hf_model" / "model.safetensors")
    for name, t in exported.items():
        assert torch.allclose(by_peft[name], t, atol=1e-6, rtol=0), name
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    moved = max(float((base[n] - t).abs().max()) for n, t in exported.items())
    assert moved > 1e-4  # ... and the adapters did move the merged weights
