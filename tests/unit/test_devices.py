"""Which device a rank trains on, and the "auto" settings that follow from it (distflow.distributed.devices).

The decision is a pure function of torch's CUDA state and the environment, so every case a GPU
machine can present is faked here: CUDA_VISIBLE_DEVICES, SLURM's GPU variables, the driver's
device count, a CPU-only torch, a CUDA torch the driver cannot run, fewer GPUs than ranks.
"""

import pytest
import torch

from distflow.config import ConfigError, DistflowConfig, ModelConfig
from distflow.distributed import devices
from distflow.distributed.devices import (CpuBf16, CudaState, auto_dtype, choose_backend, choose_device, dtype_line,
                                          enforce_eager, gpu_signs, resolve_auto, shard_ranks, torch_dtype)

CPU_TORCH = CudaState("2.13.0+cpu", None, False, 0, 0)
CUDA_TORCH_OLD_DRIVER = CudaState("2.13.0", "13.0", False, 0, 8)
CUDA_8 = CudaState("2.13.0", "13.0", True, 8, 8)


@pytest.mark.parametrize("env,driver,expected", [
    ({}, 0, []),
    ({"CUDA_VISIBLE_DEVICES": ""}, 0, []),
    ({"CUDA_VISIBLE_DEVICES": "-1"}, 0, []),
    ({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, 0, []),  # what SLURM sets for a job without GPUs
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, 0, ["CUDA_VISIBLE_DEVICES=0,1"]),
    ({"SLURM_GPUS_ON_NODE": "8"}, 0, ["SLURM_GPUS_ON_NODE=8"]),
    ({"SLURM_GPUS_PER_NODE": "h100:4"}, 0, ["SLURM_GPUS_PER_NODE=h100:4"]),
    ({"SLURM_GPUS_PER_NODE": "0"}, 0, []),
    ({"SLURM_JOB_GPUS": "0"}, 0, ["SLURM_JOB_GPUS=0"]),  # a list of indices: GPU 0
    ({}, 2, ["the NVIDIA driver reports 2 GPU(s)"]),
])
def test_gpu_signs(env, driver, expected):
    assert gpu_signs(env, driver) == expected


def test_cpu_machine_trains_on_cpu():
    assert choose_device("auto", CPU_TORCH, {}) == "cpu"
    assert choose_backend("auto", "cpu") == "gloo"


@pytest.mark.parametrize("env,driver,sign", [
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, 0, "CUDA_VISIBLE_DEVICES=0,1"),
    ({"SLURM_GPUS_ON_NODE": "8", "SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7"}, 0, "SLURM_GPUS_ON_NODE=8, SLURM_JOB_GPUS="),
    ({}, 4, "the NVIDIA driver reports 4 GPU(s)"),
])
def test_visible_gpus_with_a_cpu_torch_stop_the_run(env, driver, sign):
    cuda = CudaState("2.13.0+cpu", None, False, 0, driver)
    with pytest.raises(ConfigError) as err:
        choose_device("auto", cuda, env)
    msg = str(err.value)
    assert sign in msg and "torch 2.13.0+cpu is a CPU-only build" in msg
    assert "make install-gpu" in msg and "run.device=cpu" in msg and "\n" not in msg


def test_cuda_torch_the_driver_cannot_run_stops_the_run():
    with pytest.raises(ConfigError, match=r"the NVIDIA driver reports 8 GPU\(s\)\) but torch 2.13.0 \(CUDA 13.0\) "
                                          r"cannot use them: torch.cuda.is_available\(\) is False"):
        choose_device("auto", CUDA_TORCH_OLD_DRIVER, {})


def test_device_cpu_is_the_explicit_way_to_train_on_cpu():
    env = {"CUDA_VISIBLE_DEVICES": "0", "SLURM_GPUS_ON_NODE": "1"}
    assert choose_device("cpu", CPU_TORCH, env) == "cpu"
    assert choose_device("cpu", CUDA_8, env) == "cpu"
    with pytest.raises(ConfigError, match="run.backend=nccl needs CUDA"):
        choose_backend("nccl", "cpu")


def test_device_cuda_without_usable_cuda_fails():
    with pytest.raises(ConfigError, match="run.device=cuda but torch 2.13.0\\+cpu is a CPU-only build"):
        choose_device("cuda", CPU_TORCH, {})


def test_usable_cuda_is_chosen_and_ranks_must_fit_the_gpus():
    assert choose_device("auto", CUDA_8, {"CUDA_VISIBLE_DEVICES": "0"}, local_rank=7, local_world=8) == "cuda"
    assert choose_backend("auto", "cuda") == "nccl"
    with pytest.raises(ConfigError, match=r"9 ranks on this node but torch sees 8 GPU\(s\) \(LOCAL_RANK=8 has none\)"):
        choose_device("auto", CUDA_8, {}, local_rank=8, local_world=9)


SAPPHIRE_RAPIDS, ZEN4, SKYLAKE = CpuBf16(True, True), CpuBf16(False, True), CpuBf16(False, False)


@pytest.mark.parametrize("cpu,dtype,why", [
    (SAPPHIRE_RAPIDS, torch.bfloat16, "the CPU has AMX-BF16 and AVX512-BF16"),
    (ZEN4, torch.bfloat16, "the CPU has AVX512-BF16"),
    (CpuBf16(True, False), torch.bfloat16, "the CPU has AMX-BF16"),
    (SKYLAKE, torch.float32, "the CPU has neither AMX-BF16 nor AVX512-BF16 (bf16 matmuls would be emulated)"),
])
def test_auto_dtype_on_cpu_follows_its_bf16_instructions(cpu, dtype, why, monkeypatch):
    assert auto_dtype("cpu", cpu) == (dtype, why)
    assert auto_dtype("cuda", cpu) == (torch.bfloat16, "CUDA")  # whatever the host CPU
    monkeypatch.setattr(devices, "_CPU_BF16", cpu)  # what the trainer's resolution reads
    assert torch_dtype("auto", torch.device("cpu")) == dtype
    assert resolve_auto(DistflowConfig(), "cpu").model.dtype == str(dtype).removeprefix("torch.")
    assert dtype_line("auto", "cpu") == f"model dtype {str(dtype).removeprefix('torch.')} (model.dtype=auto: {why})"
    assert dtype_line("float32", "cpu") == "model dtype float32 (model.dtype=float32)"


@pytest.mark.parametrize("torch_says,flags,expected", [
    ({"_is_amx_tile_supported": True, "_is_avx512_bf16_supported": True}, "fpu sse", SAPPHIRE_RAPIDS),
    ({"_is_amx_tile_supported": False, "_is_avx512_bf16_supported": True}, "fpu", ZEN4),
    ({}, "fpu avx512f avx512_bf16 amx_bf16 amx_tile", SAPPHIRE_RAPIDS),  # a torch without the helpers
    ({}, "fpu avx512f avx512_bf16", ZEN4),
    ({"_is_amx_tile_supported": False, "_is_avx512_bf16_supported": False}, "fpu avx2", SKYLAKE),
    ({"_is_avx512_bf16_supported": RuntimeError("no cpuinfo")}, "", SKYLAKE),
])
def test_cpu_bf16_probe_reads_torch_then_the_kernel(torch_says, flags, expected, monkeypatch, tmp_path):
    for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        if name not in torch_says:
            monkeypatch.delattr(torch.cpu, name, raising=False)
        elif isinstance(torch_says[name], Exception):
            monkeypatch.setattr(torch.cpu, name, lambda e=torch_says[name]: (_ for _ in ()).throw(e))
        else:
            monkeypatch.setattr(torch.cpu, name, lambda v=torch_says[name]: v)
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: test\nflags\t\t: {flags}\n\n")
    read = devices._cpuinfo_flags
    monkeypatch.setattr(devices, "_cpuinfo_flags", lambda: read(str(cpuinfo)))
    assert CpuBf16.probe() == expected


def test_auto_dtype_and_eager_follow_the_device():
    assert torch_dtype("auto", "cuda") == torch.bfloat16
    assert torch_dtype("float32", "cuda") == torch.float32 and torch_dtype("bfloat16", "cpu") == torch.bfloat16
    assert enforce_eager("auto", "cuda:3") is False and enforce_eager("auto", "cpu") is True
    assert enforce_eager("True", "cuda") is True and enforce_eager("false", "cpu") is False


def test_a_named_model_gets_the_documented_defaults():
    """`model.path=...` alone must not inherit the built-in tiny model's replicas or fp32."""
    assert shard_ranks(ModelConfig(path="Qwen/Qwen2.5-1.5B-Instruct")) == -1
    assert shard_ranks(ModelConfig(path="tiny")) == 1 and shard_ranks(ModelConfig(path="smollm2_135m")) == 1
    assert shard_ranks(ModelConfig(path="tiny", shard_ranks=-1)) == -1
    cfg = DistflowConfig()
    cfg.model.path = "Qwen/Qwen2.5-1.5B-Instruct"
    on_gpu = resolve_auto(cfg, "cuda")
    assert (on_gpu.model.dtype, on_gpu.model.shard_ranks, on_gpu.rollout.enforce_eager) == ("bfloat16", -1, "false")
    on_cpu = resolve_auto(cfg, "cpu", SKYLAKE)
    assert (on_cpu.model.dtype, on_cpu.rollout.enforce_eager) == ("float32", "true")
    assert resolve_auto(cfg, "cpu", ZEN4).model.dtype == "bfloat16"
    assert cfg.model.dtype == "auto"  # the input is not modified


def test_gpu_memory_metrics_only_on_cuda(monkeypatch):
    from distflow.metrics.report import gpu_memory

    assert gpu_memory() == {}  # CPU: no keys at all
    resets = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (100 * 2**30, 140 * 2**30))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: resets.append(1))
    assert gpu_memory() == {"memory/peak_allocated_gib": 3.0, "memory/device_used_gib": 40.0}
    assert resets == [1]  # the next step's peak starts afresh
