"""Sleep and wake around the update: the call order vLLM's sleep mode needs, checked on CPU.

vLLM has no sleep mode on CPU, so the engine's side runs against a recording stand-in for
`vllm.LLM`; the trainer's side runs a real 2-step training with the HF engine wrapped in a
recorder. Order wanted on CUDA: sleep(level=2) -> wake_up(tags=["weights"]) -> reload ->
wake_up(tags=["kv_cache"]) -> reset_prefix_cache(), with nothing generated in between.
"""

import json
from types import SimpleNamespace

import pytest
import torch

from dist_helpers import run_distributed
from distflow.config import ConfigError, RolloutConfig
from distflow.models.adapter_folder import AdapterFolder
from distflow.rollout.vllm_engine import VLLMEngine, check_platform, max_model_len, memory_kwargs
from launch_helpers import ROOT
from config_helpers import fp32_config


class RecordingLLMEngine:
    """Stands in for vllm.LLM.llm_engine, where the step-wise engine submits: a request is recorded
    as "generate" and finishes, with nothing sampled, at the next step."""

    def __init__(self, calls: list):
        self.calls, self.queued = calls, []

    def add_request(self, request_id, prompt, params, lora_request=None):
        self.calls.append("generate")
        self.queued.append(request_id)

    def step(self):
        done, self.queued = self.queued, []
        return [SimpleNamespace(request_id=i, outputs=[], finished=True) for i in done]

    def abort_request(self, request_ids):
        self.queued = [i for i in self.queued if i not in request_ids]


class RecordingLLM:
    """Stands in for vllm.LLM: records the calls the engine makes (and consumes the weight stream)."""

    def __init__(self):
        self.calls = []
        self.llm_engine = RecordingLLMEngine(self.calls)

    def sleep(self, level=1):
        self.calls.append(f"sleep(level={level})")

    def wake_up(self, tags=None):
        self.calls.append(f"wake_up(tags={tags})")

    def collective_rpc(self, method, kwargs=None):
        if callable(method):  # a function run on each worker (the CPU repacks)
            self.calls.append(f"{method.__name__}()")
            return
        names = [n for n, _ in kwargs["weights_iterator"]]
        self.calls.append(f"{method}({len(names)} tensors)")

    def _preprocess_cmpl_one(self, prompt):
        return prompt

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache()")

    def generate(self, *args, **kwargs):
        self.calls.append("generate")
        return []


def _engine(on_cpu=False, sleep_during_update=True) -> VLLMEngine:
    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM construction: the stand-in is the engine
    engine.llm, engine.on_cpu, engine.tied_head, engine.sleeping = RecordingLLM(), on_cpu, False, False
    engine.head32 = False  # a float32 head would add one more rpc after each CPU reload
    engine.cfg = RolloutConfig(sleep_during_update=sleep_during_update)
    engine.adapter_folder, engine.lora_request = None, None
    engine.version, engine._running, engine._waiting, engine.token_budget = 0, {}, [], 1 << 20
    engine.checkpoint_names = lambda weights: weights  # a dense model's names need no renaming
    return engine


def _weights():
    return iter([("a", torch.zeros(2)), ("b", torch.ones(3))])


def test_sleep_level_2_then_the_resync_wakes_weights_reloads_then_wakes_the_kv_cache():
    engine = _engine()
    engine.sleep()
    engine.sleep()  # a second call does nothing
    with pytest.raises(RuntimeError, match="asleep"):  # nothing generates on freed weights
        engine.generate([[1, 2]], 1, [0])
    with pytest.raises(RuntimeError, match="asleep"):
        engine.prompt_logprobs([[1, 2]])
    engine.load_weights(_weights())
    assert engine.llm.calls == ["sleep(level=2)", "wake_up(tags=['weights'])", "reload_weights(2 tensors)",
                                "wake_up(tags=['kv_cache'])", "reset_prefix_cache()"]
    assert not engine.sleeping
    engine.generate([[1, 2]], 1, [0])  # awake again
    assert engine.llm.calls[-1] == "generate"


def test_a_resync_without_sleep_wakes_nothing():
    engine = _engine()
    engine.load_weights(_weights())  # resume: the engine never slept
    assert engine.llm.calls == ["reload_weights(2 tensors)", "reset_prefix_cache()"]


@pytest.mark.parametrize("on_cpu,sleep_during_update", [(True, True), (False, False)])
def test_no_sleep_on_cpu_or_when_turned_off(on_cpu, sleep_during_update):
    engine = _engine(on_cpu, sleep_during_update)
    engine.sleep()
    engine.load_weights(_weights())
    repack = ["_repack_cpu_experts()"] if on_cpu else []  # vLLM's CPU MoE kernel packs its experts again
    assert engine.llm.calls == ["reload_weights(2 tensors)", *repack, "reset_prefix_cache()"]


def test_an_engine_serving_adapters_never_sleeps():
    """Level 2 frees the base weights, and an adapter resync never sends them again."""
    engine = _engine()
    engine.adapter_folder = AdapterFolder(torch.float32)
    engine.adapter_folder.remove()
    engine.sleep()
    assert engine.llm.calls == [] and not engine.sleeping


def test_kv_cache_size_is_honoured_on_both_devices():
    """rollout.kv_cache_gib: on CPU 0.25 GiB unless set (vLLM's own default takes most of the RAM);
    on CUDA, when set, that size whatever the card, else what gpu_memory_utilization leaves."""
    from distflow.distributed.devices import UnresolvedAuto, kv_cache_gib

    gib = 2**30
    with pytest.raises(UnresolvedAuto):  # null on CPU is the start-up plan's to resolve, not the engine's
        memory_kwargs(RolloutConfig(), on_cpu=True)
    cpu_default = RolloutConfig(kv_cache_gib=kv_cache_gib(RolloutConfig(), "cpu"))
    assert memory_kwargs(cpu_default, on_cpu=True) == {"kv_cache_memory_bytes": gib // 4}
    assert memory_kwargs(RolloutConfig(kv_cache_gib=1.5), on_cpu=True) == {"kv_cache_memory_bytes": 3 * gib // 2}
    cuda = memory_kwargs(RolloutConfig(gpu_memory_utilization=0.5, sleep_during_update=False), on_cpu=False)
    assert cuda == {"gpu_memory_utilization": 0.5, "enable_sleep_mode": False}
    assert memory_kwargs(RolloutConfig(kv_cache_gib=8), on_cpu=False)["kv_cache_memory_bytes"] == 8 * gib


def test_max_model_len_fits_the_probe():
    """The probe resubmits a full-length prompt plus a truncated response and asks for one token."""
    assert max_model_len(RolloutConfig(max_prompt_tokens=128, max_new_tokens=16)) == 128 + 16 + 1


def test_a_vllm_build_for_the_other_device_is_refused():
    check_platform("cpu", vllm_on_cpu=True)
    check_platform("cuda", vllm_on_cpu=False)
    with pytest.raises(ConfigError, match="trains on the CPU but this vLLM is a GPU build"):
        check_platform("cpu", vllm_on_cpu=False)
    with pytest.raises(ConfigError, match="trains on CUDA but this vLLM is the CPU build"):
        check_platform("cuda", vllm_on_cpu=True)


# ----------------------------------------------------------------------------- the trainer's order
class RecordingEngine:
    """Wraps a real engine and records which of its methods the trainer calls, in order."""

    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name not in ("generate", "prompt_logprobs", "load_weights", "sleep"):
            return attr

        def call(*args, **kwargs):
            self.log.append(name)
            return attr(*args, **kwargs)
        return call


def _train_two_steps(rank, world, out):
    import distflow.rollout.collect as C
    import distflow.trainer as T

    calls = []
    real = C.build_engine
    C.build_engine = lambda *a, **k: RecordingEngine(real(*a, **k), calls)
    cfg = fp32_config()
    cfg.rollout.engine, cfg.rollout.max_new_tokens = "hf", 8
    cfg.task.path, cfg.task.reward = str(ROOT / "recipes" / "data" / "arith.jsonl"), "numeric"
    cfg.run.steps, cfg.run.output_dir, cfg.run.sync_probe_every = 2, f"{out}/run", 1
    cfg.logging.plot_at_end = cfg.logging.progress_bar = False
    events = []

    class Recorder:  # an observer (distflow.metrics.timer): sees the phases, changes nothing
        def on_train_start(self, step):
            events.append(["train", step])

        def on_phase_end(self, phase, step, seconds):
            events.append([phase, step])

        def on_step_end(self, step, metrics):
            events.append(["step_end", step, metrics["step"]])

        def on_checkpoint(self, step, path):
            events.append(["checkpoint", step])

        def on_run_end(self, trainer):
            events.append(["end", trainer.step])

    trainer = T.Trainer(cfg, observers=[Recorder()])
    try:
        trainer.train()
    finally:
        trainer.close()
    with open(f"{out}/calls.json", "w") as f:
        json.dump({"calls": calls, "events": events}, f)


def test_trainer_sleeps_after_rollout_and_wakes_only_through_the_resync(tmp_path):
    run_distributed(_train_two_steps, 1, str(tmp_path), timeout=600)
    record = json.loads((tmp_path / "calls.json").read_text())
    calls, events = record["calls"], record["events"]
    step = ["generate", "sleep", "load_weights", "prompt_logprobs"]  # rollout, update, resync, probe
    assert calls == ["prompt_logprobs"] + step + step, calls  # the start-up probe, then two steps
    # the observers see start-up, then each step's phases in the loop's order, then the end
    startup = [e for e in events if e[0].startswith("startup")]
    assert [e[0] for e in startup] == ["startup:engine", "startup:policy", "startup:critic", "startup"], startup
    loop = events[events.index(["train", 0]):]
    phases = ["generate", "balance", "logprob", "reward", "update", "sync", "probe"]
    for s in (1, 2):
        assert [e for e in loop if e[1] == s and e[0] in phases] == [[p, s] for p in phases], loop
        assert ["step_end", s, s] in loop
    assert loop[-3:] == [["step_end", 2, 2], ["checkpoint", 2], ["end", 2]], loop  # checkpoint.at_end
