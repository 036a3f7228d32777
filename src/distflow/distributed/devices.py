"""Which device a rank trains on, decided before anything loads, and the defaults that follow from it.

A job must never train on the wrong device without saying so. vLLM's CUDA build picks CUDA
whenever NVML sees a GPU, while a torch that cannot use CUDA (a CPU build, or a CUDA build the
driver is too old for) would fall back to gloo on the CPU: with `rollout=hf` a GPU job would
then train on CPU and report nothing. So `run.device=auto` looks for signs that GPUs are
meant to be used (CUDA_VISIBLE_DEVICES, SLURM's GPU variables, the driver's device count) and,
when torch has no usable CUDA, stops every rank with one line naming the sign and the torch
build. `run.device=cpu` is the explicit way to train on the CPU of a GPU machine.

"auto" settings, resolved once by `resolve_auto` (the start-up plan, distflow.plan, calls it; code
built after it reads only concrete values and refuses "auto": `concrete`, `compute_dtype`):
  model.dtype          bfloat16 on CUDA, and on a CPU with bf16 matrix instructions (AMX-BF16 or
                       AVX512-BF16: Xeons since Sapphire Rapids, AMD Zen 4/5), where oneDNN's bf16
                       GEMMs run 4-28x faster than fp32 ones; float32 on other CPUs, whose bf16
                       products are emulated and slower than fp32. float16 is refused by the
                       config: training in it needs a gradient scaler that works on FSDP2's sharded
                       gradients (torch's ShardedGradScaler), which distflow lacks.
  rollout.enforce_eager  false on CUDA (CUDA graphs: level-2 sleep keeps the engine's memory at the
                       same addresses and the resync writes the weights in place, so captured graphs
                       stay valid); true on CPU, where vLLM captures no graphs.
  model.shard_ranks    null: -1 (all ranks, plain FSDP) for a model you name; 1 (full replicas) for
                       the built-in small models, whose fp32 weights, gradients and AdamW state fit on
                       every rank (recipes/model/smollm2_135m.yaml says what that saves).
  rollout.kv_cache_gib null, vLLM on CPU: CPU_KV_CACHE_GIB (vLLM's own default would reserve most of
                       the RAM per engine); on CUDA null stays: the cache is what
                       rollout.gpu_memory_utilization leaves after the weights, which vLLM measures.
  optim.shared_prefix  on when algorithm.group_size > 1 (packed rows need a prompt shared by several
                       samples), off otherwise; not a device matter, resolved here so that every
                       "auto" has one rule in one place.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from distflow.config import BUILTIN_MODELS, ConfigError, DistflowConfig, ModelConfig, OptimConfig, RolloutConfig

# SLURM sets these for a job or step with GPUs: counts ("8", "h100:8") or lists of indices ("0,1").
SLURM_GPU_COUNTS = ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", "SLURM_GPUS_PER_TASK", "SLURM_GPUS")
SLURM_GPU_LISTS = ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS")
HIDDEN = ("", "-1", "none", "nodevfiles")  # CUDA_VISIBLE_DEVICES values that show no GPU


@dataclass(frozen=True)
class CudaState:
    """What torch can do with CUDA on this machine, and what the driver sees."""

    torch_version: str
    cuda_build: str | None  # torch.version.cuda: None for a CPU-only build
    available: bool  # torch.cuda.is_available()
    count: int  # devices torch can use
    driver_gpus: int  # devices the NVIDIA driver reports, whatever torch thinks

    @classmethod
    def probe(cls) -> "CudaState":
        available = torch.cuda.is_available()
        return cls(torch.__version__, torch.version.cuda, available,
                   torch.cuda.device_count() if available else 0, driver_gpu_count())

    @property
    def usable(self) -> bool:
        return self.available and self.count > 0

    def why_unusable(self) -> str:
        if self.cuda_build is None:
            return f"torch {self.torch_version} is a CPU-only build"
        return (f"torch {self.torch_version} (CUDA {self.cuda_build}) cannot use them: torch.cuda.is_available() "
                f"is False (an NVIDIA driver older than CUDA {self.cuda_build} needs, or no device visible)")


def driver_gpu_count() -> int:
    """GPUs NVML reports (what vLLM asks when it picks CUDA), through the driver's own library, so
    no binding needs to be installed; 0 without an NVIDIA driver."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return 0
    if nvml.nvmlInit_v2() != 0:
        return 0
    count = ctypes.c_uint(0)
    ok = nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0
    nvml.nvmlShutdown()
    return count.value if ok else 0


def _slurm_count(value: str) -> int:
    total = 0
    for part in value.split(","):
        count = part.rsplit(":", 1)[-1].split("(")[0].strip()  # "h100:4", "4", "4(IDX:0-3)"
        total += int(count) if count.isdigit() else 0
    return total


def gpu_signs(env: Mapping[str, str], driver_gpus: int) -> list[str]:
    """Evidence that this process is meant to use GPUs, each as it would be reported."""
    signs = []
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip().lower() not in HIDDEN:
        signs.append(f"CUDA_VISIBLE_DEVICES={visible}")
    for name in SLURM_GPU_COUNTS:
        if _slurm_count(env.get(name, "")) > 0:
            signs.append(f"{name}={env[name]}")
    for name in SLURM_GPU_LISTS:
        if env.get(name, "").strip().lower() not in HIDDEN:
            signs.append(f"{name}={env[name]}")
    if driver_gpus > 0:
        signs.append(f"the NVIDIA driver reports {driver_gpus} GPU(s)")
    return signs


def choose_device(requested: str, cuda: CudaState, env: Mapping[str, str], local_rank: int = 0,
                  local_world: int = 1) -> str:
    """"cuda" or "cpu" for run.device=`requested`; ConfigError (one line, every rank alike) when
    GPUs are wanted or visible and torch cannot use them, or this node has fewer GPUs than ranks."""
    if requested == "cpu":
        return "cpu"
    if not cuda.usable:
        if requested == "cuda":
            raise ConfigError(f"run.device=cuda but {cuda.why_unusable()}; install with `make install-gpu`")
        signs = gpu_signs(env, cuda.driver_gpus)
        if not signs:
            return "cpu"
        raise ConfigError(f"GPUs are visible or allocated ({', '.join(signs)}) but {cuda.why_unusable()}; "
                          "use the CUDA install (`make install-gpu`, .venv-gpu), or set run.device=cpu "
                          "to train on the CPU on purpose")
    if local_rank >= cuda.count:
        raise ConfigError(f"{local_world} ranks on this node but torch sees {cuda.count} GPU(s) "
                          f"(LOCAL_RANK={local_rank} has none); start at most {cuda.count} ranks per node")
    return "cuda"


def choose_backend(requested: str, device: str) -> str:
    """run.backend for the device a rank trains on (the config checked the value itself)."""
    if requested == "auto":
        return "nccl" if device == "cuda" else "gloo"
    if requested == "nccl" and device != "cuda":
        raise ConfigError("run.backend=nccl needs CUDA, but this rank trains on the CPU (use gloo or auto)")
    return requested


def _type(device: torch.device | str) -> str:
    return torch.device(device).type


@dataclass(frozen=True)
class CpuBf16:
    """Which bf16 matrix instructions this CPU has, as torch's own dispatcher sees them (it picks
    oneDNN's bf16 kernels from the same checks), with the kernel's flags as a second opinion."""

    amx_bf16: bool
    avx512_bf16: bool

    @classmethod
    def probe(cls) -> "CpuBf16":
        flags = _cpuinfo_flags()
        amx = _torch_reports("_is_amx_tile_supported") or {"amx_bf16", "amx_tile"} <= flags
        return cls(amx, _torch_reports("_is_avx512_bf16_supported") or "avx512_bf16" in flags)

    @property
    def fast(self) -> bool:
        return self.amx_bf16 or self.avx512_bf16

    def reason(self) -> str:
        found = [name for name, has in (("AMX-BF16", self.amx_bf16), ("AVX512-BF16", self.avx512_bf16)) if has]
        return (f"the CPU has {' and '.join(found)}" if found
                else "the CPU has neither AMX-BF16 nor AVX512-BF16 (bf16 matmuls would be emulated)")


def _torch_reports(check: str) -> bool:
    fn = getattr(torch.cpu, check, None)  # private helpers; absent in some torch builds
    try:
        return bool(fn()) if fn is not None else False
    except RuntimeError:
        return False


def _cpuinfo_flags(path: str = "/proc/cpuinfo") -> set[str]:
    try:
        with open(path) as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


_CPU_BF16: CpuBf16 | None = None


def cpu_bf16() -> CpuBf16:
    """This machine's CpuBf16, probed once per process."""
    global _CPU_BF16
    if _CPU_BF16 is None:
        _CPU_BF16 = CpuBf16.probe()
    return _CPU_BF16


def auto_dtype(device: torch.device | str, cpu: CpuBf16 | None = None) -> tuple[torch.dtype, str]:
    """(dtype, why) for model.dtype=auto on `device`: bfloat16 on CUDA and on CPUs with bf16
    matrix instructions, float32 on other CPUs. `cpu` defaults to this machine's report."""
    if _type(device) == "cuda":
        return torch.bfloat16, "CUDA"
    cpu = cpu or cpu_bf16()
    return (torch.bfloat16 if cpu.fast else torch.float32), cpu.reason()


def torch_dtype(name: str, device: torch.device | str, cpu: CpuBf16 | None = None) -> torch.dtype:
    """model.dtype as a torch dtype; "auto" as `auto_dtype` decides."""
    return auto_dtype(device, cpu)[0] if name == "auto" else getattr(torch, name)


def dtype_line(requested: str, device: torch.device | str, cpu: CpuBf16 | None = None) -> str:
    """The start-up line that says which dtype the model computes in, and why."""
    if requested != "auto":
        return f"model dtype {requested} (model.dtype={requested})"
    dtype, why = auto_dtype(device, cpu)
    return f"model dtype {str(dtype).removeprefix('torch.')} (model.dtype=auto: {why})"


def enforce_eager(value: str | bool, device: torch.device | str) -> bool:
    """rollout.enforce_eager as a bool; "auto" = CUDA graphs on CUDA, eager on CPU."""
    text = str(value).lower()
    return _type(device) != "cuda" if text == "auto" else text == "true"


def shard_ranks(model: ModelConfig) -> int:
    """model.shard_ranks with null resolved: 1 for the built-in small models, -1 for yours."""
    if model.shard_ranks is None:
        return 1 if model.path in BUILTIN_MODELS else -1
    return model.shard_ranks


CPU_KV_CACHE_GIB = 0.25  # rollout.kv_cache_gib's default for vLLM on CPU (SmolLM2-135M: ~5,800 tokens)


def kv_cache_gib(rollout: RolloutConfig, device: torch.device | str) -> float | None:
    """rollout.kv_cache_gib with null resolved where distflow picks the size (vLLM on CPU)."""
    if rollout.kv_cache_gib is None and rollout.engine == "vllm" and _type(device) == "cpu":
        return CPU_KV_CACHE_GIB
    return rollout.kv_cache_gib


def shared_prefix(optim: OptimConfig, group_size: int, branches: bool = False) -> str:
    """optim.shared_prefix as "on" or "off"; "auto" packs whenever a prompt has several samples, or
    `branches` may give a sample rows that share a prefix (a harness episode's)."""
    several = group_size > 1 or branches
    return "on" if optim.shared_prefix == "on" or (optim.shared_prefix == "auto" and several) else "off"


def resolve_auto(cfg: DistflowConfig, device: torch.device | str, cpu: CpuBf16 | None = None) -> DistflowConfig:
    """A copy of `cfg` with every automatic value above made concrete for `device` (what config.json
    records); `cpu` defaults to this machine's bf16 report. Resolving a resolved config changes nothing."""
    dtype = str(torch_dtype(cfg.model.dtype, device, cpu)).removeprefix("torch.")
    model = dataclasses.replace(cfg.model, dtype=dtype, shard_ranks=shard_ranks(cfg.model))
    eager = str(enforce_eager(cfg.rollout.enforce_eager, device)).lower()
    rollout = dataclasses.replace(cfg.rollout, enforce_eager=eager, kv_cache_gib=kv_cache_gib(cfg.rollout, device))
    branches = bool(cfg.task.agent) and cfg.agent.rows == "every"
    optim = dataclasses.replace(cfg.optim, shared_prefix=shared_prefix(cfg.optim, cfg.algorithm.group_size, branches))
    return dataclasses.replace(cfg, model=model, rollout=rollout, optim=optim)


class UnresolvedAuto(ValueError):
    """A component was handed a setting still automatic: the start-up plan resolves every one first."""


def concrete(key: str, value, automatic="auto"):
    """`value` of config key `key`, refused while it is still `automatic` ("auto", or null for keys whose
    automatic setting is null): each is decided once, by the start-up plan, and no component decides again."""
    if value == automatic:
        raise UnresolvedAuto(f"{key}={value!r} reached a component unresolved: resolve the config first "
                             "(distflow.plan.plan, or distflow.distributed.devices.resolve_auto)")
    return value


def compute_dtype(name: str) -> torch.dtype:
    """A concrete model.dtype as a torch dtype ("auto" refused: see `concrete`)."""
    return getattr(torch, concrete("model.dtype", name))
