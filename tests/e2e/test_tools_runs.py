"""Multi-turn tool episodes with LoRA adapters end to end: the docs' `experiment=tools_smoke` command
on 2 ranks with vLLM, where a scripted environment makes every episode a real calculator round trip
(tests/support/envs_for_tests.py), the policy trains LoRA adapters that the engine receives alone
(model.lora.resync=adapter), and a bit-exact resume from the adapters-only checkpoint mid-run; the
exports (live and from the checkpoint, adapters and merged). (An environment that does not import,
and a bad LoRA target, stop every rank before any model loads; the merged resync with LoRA and the
adapter resync's logprobs at 1e-5 per model family: distributed/test_trainer_loop.py,
test_model_families.py.)

It is also the suite's bf16 run: the engine computes in bf16 and so does FSDP2, over float32
master weights and AdamW moments (the checkpoint holds them), and the engine/trainer mismatch is
measured on every step's trained tokens. A bf16 CPU run is as deterministic as a float32 one, so
the resume still continues bit for bit."""

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from distflow.checkpoint.export import export_checkpoint
from distflow.probe import PROBE_LIMIT

from docs_helpers import doc_command, run_doc_command
from launch_helpers import read_metrics, stable_metrics

COMMAND = doc_command(".venv/bin/torchrun --standalone --nproc_per_node=2 recipes/grpo.py experiment=tools_smoke")
TOOLS = ["task.env=envs_for_tests:ScriptedToolEnv", "task.reward=rewards_for_tests:digit_fraction", "run.steps=4",
         "model.dtype=bfloat16", "checkpoint.export_at_end=true"]
LORA = ["model.lora.enabled=true", "model.lora.rank=8", "model.lora.resync=adapter", "optim.lr=1e-2",
        "algorithm.kl_coef=0.05"]
MISMATCH = ("mismatch/abs_mean", "mismatch/abs_p99", "mismatch/abs_max", "mismatch/kl")


def _run(out, *extra):
    """The docs' tools_smoke command, with a scripted environment that makes every episode a real round trip."""
    proc = run_doc_command(COMMAND, [*TOOLS, *LORA, f"run.output_dir={out}", *extra], out.parent)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _equal_files(a, b):
    ta, tb = load_file(a), load_file(b)
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tools_lora")
    straight, resumed = tmp / "straight", tmp / "resumed"
    _run(straight, "checkpoint.every=2")
    shutil.copytree(straight / "checkpoints" / "step_000002", tmp / "step2")  # the straight run's folder stays
    proc = _run(resumed, f"checkpoint.resume={tmp / 'step2'}")
    return tmp, proc


@pytest.mark.slow
def test_tool_episodes_train_in_bf16(runs):
    tmp, _ = runs
    straight = tmp / "straight"
    rows = read_metrics(straight)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert 1.0 < r["turns/mean"] <= 2.0, r  # most episodes: a turn, the tool's answer, a turn
        assert r["tool/calls"] > 0 and r["tool/errors"] == 0 and r["tool/timeouts"] == 0, r
        # observation tokens are in the sequences but not generated
        assert r["response_length/generated_mean"] < r["response_length/mean"], r
        assert r["grad_norm"] > 0, r
        # bf16 engine and bf16 trainer, the engine serving the adapters it received: close, not equal
        assert math.isnan(r["sync/max_abs_logprob_diff"]) or r["sync/max_abs_logprob_diff"] < PROBE_LIMIT["bfloat16"]
        assert all(math.isfinite(r[k]) for k in MISMATCH), r
        assert 0 < r["mismatch/abs_mean"] <= r["mismatch/abs_p99"] and r["mismatch/abs_max"] < 1.0, r
        assert 0 <= r["mismatch/kl"] < 0.1, r
    assert rows[-1]["loss/kl"] > 0  # the reference (adapters off) differs from the trained policy
    config = json.loads((straight / "config.json").read_text())
    assert config["model"]["dtype"] == "bfloat16"
    logs = [(straight / "logs" / f"rank_{k}.log").read_text() for k in (0, 1)]
    assert all("dtype=torch.bfloat16" in text for text in logs)  # each rank's vLLM engine
    assert "model dtype bfloat16 (model.dtype=bfloat16)" in logs[0]
    # the checkpoint is the adapters and their AdamW moments only, all float32 (what the run holds)
    meta = FileSystemReader(str(straight / "checkpoints" / "step_000002")).read_metadata().state_dict_metadata
    tensors = {k: m.properties.dtype for k, m in meta.items() if isinstance(m, TensorStorageMetadata)}
    weights = [k for k in tensors if k.startswith("policy.model.")]
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights), weights[:5]
    moments = [k for k in tensors if "exp_avg" in k]
    assert moments and {str(tensors[k]) for k in weights + moments} == {"torch.float32"}, tensors


@pytest.mark.slow
def test_the_run_resumed_from_the_adapters_checkpoint_continues_bit_exact(runs):
    tmp, proc = runs
    assert "resumed from step 2" in proc.stdout
    again = read_metrics(tmp / "resumed")  # a new folder: its metrics start where the checkpoint left off
    assert [r["step"] for r in again] == [3, 4]
    assert [stable_metrics(r) for r in again] == [stable_metrics(r) for r in read_metrics(tmp / "straight")[2:]]
    assert _equal_files(tmp / "straight" / "adapter" / "adapter_model.safetensors",
                        tmp / "resumed" / "adapter" / "adapter_model.safetensors")


@pytest.mark.slow
def test_the_exports_are_the_adapters_and_the_base_they_merge_into(runs, tiny_model_dir):
    tmp, _ = runs
    straight = tmp / "straight"
    # the checkpoint export equals the end-of-run export as adapters; merged, it is PEFT's merge into
    # the untouched float32 base, so training changed no base weight
    final = straight / "checkpoints" / "step_000004"
    cli = export_checkpoint(str(final), str(tmp / "cli_adapter"))
    assert _equal_files(straight / "adapter" / "adapter_model.safetensors", f"{cli}/adapter_model.safetensors")
    merged = load_file(f"{export_checkpoint(str(final), str(tmp / 'cli_merged'), merged=True)}/model.safetensors")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(straight / "adapter"))
    by_peft = peft_model.merge_and_unload().state_dict()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    for name, t in merged.items():
        assert torch.allclose(by_peft[name], t, atol=1e-6, rtol=0), name
    assert max(float((base[n] - t).abs().max()) for n, t in merged.items()) > 1e-4  # the adapters moved them
    # the run's own merged export folds the adapters into the base it computed with: bf16 in a bf16 run
    live = load_file(straight / "hf_model" / "model.safetensors")
    assert live.keys() == merged.keys()
    for name, t in live.items():
        rounding = base[name].to(torch.bfloat16).float() - base[name]
        assert torch.allclose(t, merged[name] + rounding, atol=1e-6, rtol=0), name
