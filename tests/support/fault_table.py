"""Every bad input and fault distflow defines a behaviour for, as one table: what the user did, the
exact line distflow prints, what it keeps, and what to do next. tests/unit/test_fault_table.py
triggers each row for real (a real file, model folder, checkpoint or config) and compares the line
it printed with the row; docs/troubleshooting.md's table is generated from the same rows
(`python tests/support/docs_helpers.py fault-table`), so the docs cannot drift from the messages.

A row's line is what the console shows: `distflow: error: ...` for a stop (exit status 2 at
start-up), `distflow: warning: ...` for a run that goes on. Paths are written as `<tmp>` (the
test's folder) and `<model>` (the tiny model's folder); `<N>` stands for a number that differs
between machines (a pid, a size, a version).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# ------------------------------------------------------------------------------ the rows


@dataclass(frozen=True)
class Fault:
    id: str
    area: str  # config, data, model folder, models in the loop, agents, reward module, tools, checkpoints, file system, run
    fault: str  # what the user did, or what happened
    prints: tuple[str, ...]  # the lines, normalised (see `normalise`)
    keeps: str  # what distflow keeps (files, the run folder, the checkpoint)
    next: str  # what the user does next
    trigger: Callable[["Scene"], None] | None = None  # None: the test named in `tested_by` checks it
    tested_by: str = ""


@dataclass
class Scene:
    """What a trigger gets: its own folder, the tiny model, a tokenizer and a real checkpoint."""
    tmp: Path
    model: str
    tokenizer: object
    checkpoint: Path  # a complete checkpoint folder of step 1 (its own copy), under tmp/run/checkpoints


def normalise(line: str, scene: Scene) -> str:
    line = re.sub(r"/proc/\d+/root/", "/", line)  # a private tmpfs, reached through its holder process
    line = line.replace(str(scene.tmp), "<tmp>").replace(scene.model, "<model>")
    line = re.sub(r"transformers \d+\.\d+\S*", "transformers <N>", line)
    return line


# ------------------------------------------------------------------------------ triggers
def _config(tree: dict) -> Callable[[Scene], None]:
    def run(scene: Scene) -> None:
        from distflow.config import DistflowConfig

        tree.setdefault("task", {}).setdefault("path", "data.jsonl")
        DistflowConfig.from_dict(tree).validate()
    return run


def _recipe(*overrides: str) -> Callable[[Scene], None]:
    """The launchers' pre-flight (`recipes/grpo.py --check-config`), in-process: Hydra composes the
    command line; its one line is re-raised as what it printed."""
    def run(scene: Scene) -> None:
        import contextlib
        import io

        from config_helpers import recipe
        from distflow.config import ConfigError

        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            status = recipe().check_config(list(overrides))
        if status:
            assert status == 2 and err.getvalue().count("\n") == 1, err.getvalue()
            raise ConfigError(err.getvalue().strip().removeprefix("distflow: error: "))
    return run


def _data(rows: list | bytes | None, name: str = "d.jsonl", max_prompt_tokens: int = 64, **task) -> Callable:
    def run(scene: Scene) -> None:
        from distflow.config import TaskConfig
        from distflow.tasks import load_prompts

        path = Path(name) if "/" in name else scene.tmp / name  # owner/name: a hub dataset's
        if isinstance(rows, bytes):
            path.write_bytes(rows)
        elif rows is not None:
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        cfg = TaskConfig(**{"path": str(path), "prompt_key": "question", "answer_key": "label", **task})
        load_prompts(cfg, scene.tokenizer, max_prompt_tokens)
    return run


GOOD = [{"question": "what is one plus one", "label": 2}, {"question": "what is two plus two", "label": 4}]


def _plan(tree: dict) -> Callable[[Scene], None]:
    """The start-up plan (config, model folder, layout) over the tiny model, one CPU rank."""
    def run(scene: Scene) -> None:
        import torch

        from distflow.config import DistflowConfig
        from distflow.distributed import DistInfo
        from distflow.plan import plan

        cfg = DistflowConfig.from_dict({**tree, "task": {"path": "d.jsonl"}, "model": {"path": scene.model}})
        plan(cfg, DistInfo(0, 1, 0, 1, torch.device("cpu"), "gloo"))
    return run


def _models_in_the_loop(tree: Callable[[Scene], dict], teacher_token: str | None = None) -> Callable[[Scene], None]:
    """The start-up plan with the models `tree(scene)` adds (a teacher, reward models, judges) over
    the tiny model; `teacher_token`: <tmp>/teacher is the tiny model with that token added."""
    def run(scene: Scene) -> None:
        import torch

        from distflow.config import DistflowConfig
        from distflow.distributed import DistInfo
        from distflow.plan import plan

        if teacher_token:
            shutil.copytree(scene.model, scene.tmp / "teacher")
            tok = type(scene.tokenizer).from_pretrained(scene.model)
            tok.add_tokens([teacher_token])
            tok.save_pretrained(scene.tmp / "teacher")
        extra = tree(scene)
        cfg = DistflowConfig.from_dict({**extra, "task": {"path": "d.jsonl", **extra.get("task", {})},
                                        "model": {"path": scene.model}})
        plan(cfg, DistInfo(0, 1, 0, 1, torch.device("cpu"), "gloo"))
    return run


def _model_path(name: str) -> Callable[[Scene], None]:
    def run(scene: Scene) -> None:
        _config({"model": {"path": str(scene.tmp / name)}})(scene)
    return run


def _offline(trigger: Callable[[Scene], None]) -> Callable[[Scene], None]:
    """`trigger` with the hub offline, as HF_HUB_OFFLINE=1 sets it (read at each call)."""
    def run(scene: Scene) -> None:
        import os

        saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
        os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        try:
            trigger(scene)
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.update({k: v})
    return run


def _model(damage: Callable[[Path], None]) -> Callable[[Scene], None]:
    """A copy of the tiny model with `damage` done to it, checked as the start-up plan checks it."""
    def run(scene: Scene) -> None:
        from distflow.models.folder_check import check_model_folder

        folder = scene.tmp / "model"
        shutil.copytree(scene.model, folder)
        damage(folder)
        check_model_folder(folder)
    return run


def _edit_json(name: str, edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        data = json.loads((folder / name).read_text())
        edit(data)
        (folder / name).write_text(json.dumps(data))
    return damage


def _cut(folder: Path) -> None:
    file = folder / "model.safetensors"
    with open(file, "r+b") as f:
        f.truncate(file.stat().st_size - 1000)


def _index_naming_a_missing_shard(folder: Path) -> None:
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    (length,) = struct.unpack("<Q", (folder / "model-00001-of-00002.safetensors").read_bytes()[:8])
    names = [k for k in json.loads((folder / "model-00001-of-00002.safetensors").read_bytes()[8:8 + length])
             if k != "__metadata__"]
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names} | {"lm_head.extra": "model-00002-of-00002.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _reward(spec: str) -> Callable[[Scene], None]:
    def run(scene: Scene) -> None:
        from distflow.tasks.rewards.registry import RewardSpec

        (scene.tmp / "my_rewards.py").write_text("def score(prompt, completion, ids, item):\n    return 1.0\n"
                                                 "NOT_A_FUNCTION = 3\n")
        import sys
        sys.path.insert(0, str(scene.tmp))
        try:
            for s in RewardSpec.parse(spec).specs():
                from distflow.tasks.rewards.registry import load_reward
                load_reward(s)
        finally:
            sys.path.remove(str(scene.tmp))
            sys.modules.pop("my_rewards", None)
    return run


def _scored(mode: str, workers: int, timeout_s: float = 5.0) -> Callable[[Scene], None]:
    """A reward that misbehaves (tests/support/rewards_for_tests.py) scored by a real reward pool."""
    def run(scene: Scene) -> None:
        from distflow.tasks.rewards.pool import RewardPool

        call = ("prompt", "abcd", [1, 2, 3], {"answer": "4", "mode": mode})
        with RewardPool("rewards_for_tests:misbehave", workers=workers, timeout_s=timeout_s) as pool:
            pool.wait_ready()
            rewards, _ = pool.score([call, call])
        assert rewards == [0.0, 0.0]
    return run


def _rewards(combination: dict) -> Callable[[Scene], None]:
    def run(scene: Scene) -> None:
        from distflow.tasks.rewards.registry import RewardSpec

        RewardSpec.parse(combination)
    return run


def _harness(spec: str) -> Callable[[Scene], None]:
    def run(scene: Scene) -> None:
        from distflow.config.specs import resolve

        resolve(spec, {}, "task.agent")  # as the task resolves it, before any weights load
    return run


def _port_in_use(scene: Scene) -> None:
    import socket

    from distflow.rollout.agents.endpoint import Endpoint, build_app

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        Endpoint(build_app(None, "key"), "127.0.0.1", held.getsockname()[1])


def _tools(**kw) -> Callable[[Scene], None]:
    def run(scene: Scene) -> None:
        from distflow.tasks.envs import ToolEnv

        ToolEnv(**kw)
    return run


def _turn_budget(scene: Scene) -> None:
    from distflow.tasks.envs import ToolEnv

    ToolEnv(tools=["python"], timeout_s=5, max_calls_per_turn=3).check_step_timeout(10.0)


def _env(spec: str, args: dict) -> Callable[[Scene], None]:
    def run(scene: Scene) -> None:
        from distflow.tasks.envs import build_env

        build_env(spec, args)
    return run


def _resume(mode: str, damage: Callable[[Path], None] = lambda c: None, steps: int = 1, **changes) -> Callable:
    """plan_resume (rank 0's start-up decision) over a run folder whose only checkpoint is `damage`d."""
    def run(scene: Scene) -> None:
        from config_helpers import fp32_config
        from distflow.config import config_record
        from distflow.run.resume import plan_resume
        from distflow.run.rundir import RunDir

        damage(scene.checkpoint)
        cfg = saved_config()
        cfg.run.output_dir, cfg.run.steps = str(scene.tmp / "run"), steps
        cfg.checkpoint.resume = mode.replace("<tmp>", str(scene.tmp))
        RunDir(scene.tmp / "run").claim()
        for key, value in changes.items():
            section, name = key.split("__")
            setattr(getattr(cfg, section), name, value)
        try:
            plan = plan_resume(cfg)
            for line in plan.warnings:
                logging.getLogger("distflow").warning(line)
        finally:
            RunDir(scene.tmp / "run").unlock()
    return run


def saved_config():
    """The config the Scene's checkpoint was written with."""
    from config_helpers import fp32_config

    cfg = fp32_config()
    cfg.run.steps = 1
    return cfg


def _truncate_shard(checkpoint: Path) -> None:
    shard = next(p for p in sorted(checkpoint.iterdir()) if p.suffix == ".distcp")
    with open(shard, "r+b") as f:
        f.truncate(10)


def _marker_not_json(checkpoint: Path) -> None:
    (checkpoint / "COMPLETE").write_text("{torn")


def _tampered_metadata(scene: Scene) -> None:
    import pickle

    from distflow.checkpoint.reader import read_metadata

    (scene.checkpoint / ".metadata").write_bytes(pickle.dumps(print))
    read_metadata(scene.checkpoint)


def _malformed_carry(scene: Scene) -> None:
    """A carry-over run's checkpoint whose carried group lost its samples' data: loaded as the
    trainer loads its rank-scoped state. The marker's sizes catch the edit (one whose size stayed
    the same is refused by the buffer's own check: the same line names the malformed state)."""
    from distflow.checkpoint.checkpointer import Checkpointer
    from distflow.rollout.carry import CarryBuffer

    rank_file = scene.checkpoint / "rank_0.json"
    state = json.loads(rank_file.read_text())
    state["carry"] = {"groups": [{"position": 4, "admitted": 1, "cuts": 1}]}
    rank_file.write_text(json.dumps(state))
    checkpointer = Checkpointer(scene.checkpoint.parent, keep_last=1, rank=0)
    checkpointer.register("carry", CarryBuffer(0, 1), "rank")
    checkpointer.load(scene.checkpoint)


def _other_model(scene: Scene) -> None:
    """The checkpoint loaded into a model twice as wide (what checkpoint.resume=force onto another
    model.path does)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from distflow.checkpoint.checkpointer import POLICY, Checkpointer, ModelOptimState

    config = AutoConfig.from_pretrained(scene.model)
    config.hidden_size *= 2
    model = AutoModelForCausalLM.from_config(config)
    ck = Checkpointer(scene.tmp / "other", keep_last=1, rank=0)
    ck.register(POLICY, ModelOptimState(model, torch.optim.AdamW(model.parameters())), "sharded")
    ck.load(scene.checkpoint)


def _lock_under(path_of: Callable[[Path], Path]) -> Callable[[Scene], None]:
    def run(scene: Scene) -> None:
        from distflow.run.rundir import RunDir

        RunDir(path_of(scene.tmp)).lock()
    return run


def _on_tmpfs(readonly: bool = False, full: bool = False) -> Callable[[Scene], None]:
    """run.output_dir on a real read-only or full file system (a private tmpfs, no privileges)."""
    def run(scene: Scene) -> None:
        from distflow.run.rundir import RunDir
        from mount_helpers import fill, private_tmpfs

        with private_tmpfs(scene.tmp / "fs", size="16k", readonly=readonly) as fs:
            if full:
                fill(fs)
            RunDir(fs / "run").lock()
    return run


def _held_by_another_run(scene: Scene) -> None:
    """A second launch while another process holds the folder's lock."""
    import subprocess
    import sys

    from distflow.run.rundir import RunDir

    hold = "import sys, time; from distflow.run.rundir import RunDir; print(RunDir(sys.argv[1]).lock(), flush=True); " \
           "time.sleep(60)"
    holder = subprocess.Popen([sys.executable, "-c", hold, str(scene.tmp / "out")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "None"
        RunDir(scene.tmp / "out").lock()
    finally:
        holder.kill()
        holder.wait()


def _through_a_file(tmp: Path) -> Path:
    (tmp / "a_file").write_text("x")
    return tmp / "a_file" / "run"


# ------------------------------------------------------------------------------ the table
E, W = "distflow: error: ", "distflow: warning: "
FIX_KEY = "Correct the key or value named and launch again."

FAULTS: list[Fault] = [
    # config
    Fault("config-unknown-key", "config", "an unknown key under a section that was renamed: `+trainer.bogus_key=1`",
          (E + "unknown config key trainer.bogus_key; trainer.* keys are now under checkpoint, logging, run, "
               "validation (docs/configuration.md lists every key)",),
          "nothing was started", FIX_KEY, _config({"trainer": {"bogus_key": 1}})),
    Fault("config-misspelt-key", "config", "a misspelt key: `+optim.lr_rate=1e-5`",
          (E + "unknown config key optim.lr_rate; did you mean optim.lr? (docs/configuration.md lists every key)",),
          "nothing was started", FIX_KEY, _config({"optim": {"lr_rate": 1e-5}})),
    Fault("config-wrong-type", "config", "a value of the wrong type: `run.steps=ten`",
          (E + "run.steps must be an integer, got 'ten'",), "nothing was started", FIX_KEY,
          _config({"run": {"steps": "ten"}})),
    Fault("config-section-value", "config", "a value where a section of keys belongs: `optim=3`",
          (E + "optim is a section of keys, got 3",), "nothing was started", FIX_KEY, _config({"optim": 3})),
    Fault("config-range", "config", "a value out of range: `optim.lr=-1`",
          (E + "optim.lr must be >= 0, got -1.0",), "nothing was started", FIX_KEY, _config({"optim": {"lr": -1}})),
    Fault("config-choice", "config", "a value outside the choices: `rollout.engine=sglang`",
          (E + "rollout.engine must be one of vllm, hf; got 'sglang'",), "nothing was started", FIX_KEY,
          _config({"rollout": {"engine": "sglang"}})),
    Fault("config-refused-dtype", "config", "`model.dtype=float16`",
          (E + "model.dtype=float16 is not supported: fp16 training needs a gradient scaler over FSDP2's sharded "
               "gradients (torch's ShardedGradScaler), which distflow does not run; use bfloat16 (the CUDA default) "
               "or float32",),
          "nothing was started", "Use bfloat16 or float32.", _config({"model": {"dtype": "float16"}})),
    Fault("config-group-size", "config", "a group-relative estimator with one sample per group: "
          "`algorithm.group_size=1`",
          (E + "algorithm.advantage=grpo is group-relative and needs group_size >= 2, got 1",),
          "nothing was started", "Use group_size >= 2, or an estimator with a critic (`algorithm=ppo`).",
          _config({"algorithm": {"group_size": 1}})),
    Fault("config-turns-without-env", "config", "`rollout.max_turns=3` without an environment",
          (E + "rollout.max_turns=3 needs an environment to answer the turns: set task.env (or task.agent)",),
          "nothing was started", "Set `task.env` (e.g. `tools`) or a harness (`task.agent`), or leave max_turns at 1.",
          _config({"rollout": {"max_turns": 3}})),
    Fault("config-staleness-uncorrected", "config", "carry-over with older tokens and no correction: "
          "`pipeline=carryover rollout_correction=metrics`",
          (E + "pipeline.max_staleness=1 trains tokens of older policies and needs a correction for them: choose "
               "one with rollout_correction=token_tis (or another preset), or set algorithm.rollout_correction."
               "rollout_is",),
          "nothing was started", "Pick a correction preset (`rollout_correction=token_tis`), or "
          "`pipeline.max_staleness=0`.",
          _config({"pipeline": {"mode": "carryover", "max_staleness": 1}})),
    Fault("config-staleness-sync", "config", "`pipeline.max_staleness=2` with `pipeline.mode=sync`",
          (E + "pipeline.max_staleness=2 needs pipeline.mode=carryover or split (sync trains every group at the "
               "step that generated it)",),
          "nothing was started", "Add `pipeline=carryover`.", _config({"pipeline": {"max_staleness": 2}})),
    Fault("config-split-no-rollout-ranks", "config", "`pipeline.mode=split` without `pipeline.rollout_ranks`",
          (E + "pipeline.mode=split needs pipeline.rollout_ranks >= 1 (the ranks that generate), got 0",),
          "nothing was started", "Set `pipeline.rollout_ranks` to the number of ranks that generate.",
          _config({"pipeline": {"mode": "split"}})),
    Fault("config-rollout-ranks-sync", "config", "`pipeline.rollout_ranks` outside a split run",
          (E + "pipeline.rollout_ranks=2 needs pipeline.mode=split",),
          "nothing was started", "Add `pipeline.mode=split`, or drop the key.",
          _config({"pipeline": {"rollout_ranks": 2}})),
    Fault("config-inflight-not-split", "config", "`pipeline.apply=inflight` outside a split run",
          (E + "pipeline.apply=inflight needs pipeline.mode=split (the rollout ranks apply the versions)",),
          "nothing was started", "Add `pipeline=split`, or drop the key.",
          _config({"pipeline": {"apply": "inflight"}})),
    Fault("config-oversample-staged", "config", "`pipeline.oversample` without `pipeline.apply=inflight`",
          (E + "pipeline.oversample=0.5 needs pipeline.apply=inflight with algorithm.dynamic_sampling (staged runs "
               "draw more rounds instead)",),
          "nothing was started", "Add `pipeline.apply=inflight` (with `algorithm=dapo`), or drop the key.",
          _config({"pipeline": {"mode": "split", "rollout_ranks": 1, "oversample": 0.5},
                   "algorithm": {"dynamic_sampling": True}})),
    Fault("config-late-staged", "config", "`pipeline.late=retarget` without `pipeline.apply=inflight`",
          (E + "pipeline.late=retarget needs pipeline.apply=inflight (a staged rank's steps are reproducible: it "
               "waits for every group)",),
          "nothing was started", "Add `pipeline.apply=inflight`, or drop the key.",
          _config({"pipeline": {"mode": "split", "rollout_ranks": 1, "late": "retarget"}})),
    Fault("config-keep-staged", "config", "`pipeline.kv_after_update=keep` without `pipeline.apply=inflight`",
          (E + "pipeline.kv_after_update=keep needs pipeline.apply=inflight (a staged rank's engine holds no running "
               "request where it applies a version)",),
          "nothing was started", "Add `pipeline.apply=inflight`, or drop the key.",
          _config({"pipeline": {"mode": "split", "rollout_ranks": 1, "kv_after_update": "keep"}})),
    Fault("config-keep-adapter", "config", "`pipeline.kv_after_update=keep` with LoRA adapter resyncs",
          (E + "pipeline.kv_after_update=keep with model.lora.resync=adapter: the running requests would change "
               "adapters mid-sequence; use kv_after_update=recompute, or lora.resync=merged",),
          "nothing was started", "Use `pipeline.kv_after_update=recompute`, or `model.lora.resync=merged`.",
          _config({"pipeline": {"mode": "split", "rollout_ranks": 1, "apply": "inflight", "kv_after_update": "keep"},
                   "model": {"lora": {"enabled": True, "resync": "adapter"}}, "rollout": {"engine": "vllm"}})),
    Fault("config-split-inflight-tensor-parallel", "config",
          "`pipeline.apply=inflight` with `rollout.tensor_parallel_size` > 1",
          (E + "pipeline.apply=inflight with rollout.tensor_parallel_size=2: the ranks of an engine would apply each "
               "version where it reaches them, not at one engine step; use pipeline.apply=staged",),
          "nothing was started", "Use `pipeline.apply=staged`, or one rank per engine.",
          _config({"pipeline": {"mode": "split", "rollout_ranks": 2, "apply": "inflight"},
                   "rollout": {"engine": "vllm", "tensor_parallel_size": 2}})),
    Fault("config-env-wait-staged", "config", "`pipeline.env_wait=free` without `pipeline.apply=inflight`",
          (E + "pipeline.env_wait=free needs pipeline.apply=inflight (a staged rank's episodes advance in the "
               "synchronous loop's waves)",),
          "nothing was started", "Add `pipeline.apply=inflight`, or drop the key.",
          _config({"pipeline": {"mode": "split", "rollout_ranks": 1, "env_wait": "free"},
                   "task": {"env": "tools"}, "rollout": {"max_turns": 2}})),
    Fault("config-concurrency", "config", "`pipeline.max_concurrency` below the group size",
          (E + "pipeline.max_concurrency=2 is below algorithm.group_size=4: a group's samples run together",),
          "nothing was started", "Raise it to at least `algorithm.group_size`, or null.",
          _config({"pipeline": {"mode": "carryover", "max_concurrency": 2}})),
    Fault("config-unknown-option", "config", "an unknown choice of a config group: `algorithm=grpo2`",
          (E + "In 'grpo': Could not find 'algorithm/grpo2' Available options in 'algorithm': cispo dapo distill drgrpo "
               "grpo gspo ppo reinforce_pp reinforce_pp_baseline rloo",),
          "nothing was started", "Pick one of the options listed.", _recipe("algorithm=grpo2")),
    Fault("config-not-an-integer", "config", "a command-line value Hydra cannot convert: `run.steps=abc`",
          (E + "Error merging override run.steps=abc: Value 'abc' of type 'str' could not be converted to Integer",),
          "nothing was started", FIX_KEY, _recipe("run.steps=abc")),
    Fault("config-malformed-override", "config", "an override without `=`: `run.steps`",
          (E + "Error parsing override 'run.steps' missing EQUAL at '<EOF>' See "
               "https://hydra.cc/docs/1.2/advanced/override_grammar/basic for details",),
          "nothing was started", "Write key=value.", _recipe("run.steps")),
    Fault("config-bad-interpolation", "config", "an interpolation of a key that does not exist: `model.path=${oops}`",
          (E + "model.path: Interpolation key 'oops' not found",), "nothing was started", FIX_KEY,
          _recipe("model.path=${oops}")),
    # data
    Fault("data-path-unset", "data", "no dataset named (`task.path` empty)",
          (E + "task.path is not set: give a local jsonl/json/parquet/csv file or a hub dataset name",),
          "nothing was started", "Set `task.path` or pick a task (`task=gsm8k`).", _config({"task": {"path": ""}})),
    Fault("data-missing-file", "data", "`task.path` names a local file that does not exist",
          (E + "task.path '<tmp>/nope.jsonl' is not a file",),
          "nothing was started", "Correct the path (relative paths are from the launch directory).",
          _data(None, "nope.jsonl")),
    Fault("data-extension", "data", "a file with an unknown extension (`data.txt`)",
          (E + "task.path '<tmp>/d.txt': unknown extension '.txt', expected one of ['.csv', '.json', '.jsonl', '.parquet']",),
          "nothing was started", "Convert it to jsonl, json, parquet or csv.", _data(GOOD, "d.txt")),
    Fault("data-empty", "data", "an empty dataset file",
          (E + "dataset <tmp>/d.jsonl has no rows",), "nothing was started", "Point at the file with the rows.",
          _data([])),
    Fault("data-unparseable", "data", "a jsonl file with a line that is not JSON",
          (E + "dataset <tmp>/d.jsonl: line 2 is not JSON (Expecting value at column 1): 'not json'",),
          "nothing was started", "Fix the line named.", _data(b'{"question": "a", "label": 1}\nnot json\n')),
    Fault("data-not-an-object", "data", "a jsonl line that is JSON but not an object (`[1, 2]`)",
          (E + "dataset <tmp>/d.jsonl: line 2 is a JSON list, not an object of columns",),
          "nothing was started", "Make each line one object of columns.",
          _data(b'{"question": "a", "label": 1}\n[1, 2]\n')),
    Fault("data-not-utf8", "data", "a dataset file with bytes that are not UTF-8",
          (E + "dataset <tmp>/d.jsonl is not valid UTF-8: byte 0xff at offset 14 (line 1); re-encode it as UTF-8 "
               "(e.g. `iconv -f latin1 -t utf-8`)",),
          "nothing was started", "Re-encode the file as UTF-8.", _data(b'{"question": "\xff", "label": 1}\n')),
    Fault("data-no-prompt-column", "data", "the prompt column is absent (`task.prompt_key=question`, "
          "the file has `problem`)",
          (E + "task.prompt_key 'question' is not a column of <tmp>/d.jsonl; columns: ['problem', 'label']",),
          "nothing was started", "Set `task.prompt_key` to one of the columns listed.",
          _data([{"problem": "one plus one", "label": 2}])),
    Fault("data-no-answer-column", "data", "the answer column is absent",
          (E + "task.answer_key 'label' is not a column of <tmp>/d.jsonl; columns: ['question', 'solution']",),
          "nothing was started", "Set `task.answer_key` to one of the columns listed.",
          _data([{"question": "one plus one", "solution": 2}])),
    Fault("data-all-too-long", "data", "every prompt is longer than `rollout.max_prompt_tokens`",
          (W + "dropped 2 of 2 prompts of <tmp>/d.jsonl longer than rollout.max_prompt_tokens=3",
           E + "no usable prompts in <tmp>/d.jsonl: 0 rows without a prompt string, 0 without an answer, 2 longer "
               "than rollout.max_prompt_tokens=3"),
          "nothing was started", "Raise `rollout.max_prompt_tokens` or shorten the prompts.",
          _data(GOOD, max_prompt_tokens=3)),
    Fault("data-some-too-long", "data", "some prompts are longer than `rollout.max_prompt_tokens`",
          (W + "dropped 1 of 3 prompts of <tmp>/d.jsonl longer than rollout.max_prompt_tokens=9",),
          "the other rows; the run goes on", "Nothing, or raise `rollout.max_prompt_tokens` to keep them.",
          _data(GOOD + [{"question": "what is one plus one plus one plus one plus one", "label": 5}],
                max_prompt_tokens=9)),
    Fault("data-row-without-prompt", "data", "a row without the prompt key",
          (W + "skipped 1 of 3 rows of <tmp>/d.jsonl whose 'question' is missing, empty, or neither a string nor chat "
               "messages",),
          "the other rows; the run goes on", "Nothing, or fix the rows named.",
          _data(GOOD + [{"label": 3}])),
    Fault("data-answer-missing", "data", "a row whose answer is null or blank",
          (W + "skipped 1 of 3 rows of <tmp>/d.jsonl whose answer 'label' is missing, null or empty",),
          "the other rows (never scored against \"None\"); the run goes on", "Nothing, or fix the rows.",
          _data(GOOD + [{"question": "what is one", "label": None}])),
    Fault("data-duplicates", "data", "duplicate rows", (W + "2 of 4 kept rows of <tmp>/d.jsonl repeat an earlier prompt (0 of them with a different answer); kept: every "
               "row is a prompt, so repeated ones are sampled more often",),
          "every row; the run goes on", "Nothing, or deduplicate the file.", _data(GOOD + GOOD)),
    Fault("data-hub-offline", "data", "a hub dataset name with no network (`HF_HUB_OFFLINE=1`)",
          (E + "task.path 'someone/no-such-dataset' is not a local file, and loading it as a Hugging Face Hub dataset "
               "'someone/no-such-dataset', split 'train' failed (<N>). HF_HUB_OFFLINE and HF_DATASETS_OFFLINE "
               "are set, so only an already cached copy can be used: a hub dataset needs network access; otherwise "
               "save it as a local jsonl/parquet file and point task.path at that file",),
          "nothing was started", "Download it once where there is network, or give a local file.",
          _offline(_data(None, "someone/no-such-dataset"))),
    # model folder
    Fault("model-not-a-folder", "model folder", "`model.path` is neither a folder nor a hub name",
          (E + "model.path '<tmp>/nope' is not a folder (expected a local HF model folder or a hub name)",),
          "nothing was started", "Correct `model.path`.", _model_path("nope")),
    Fault("model-no-config", "model folder", "a model folder without config.json",
          (E + "model.path <tmp>/model has no config.json: not a Hugging Face model folder",),
          "nothing was started", "Point `model.path` at the folder that holds config.json.",
          _model(lambda f: (f / "config.json").unlink())),
    Fault("model-config-not-json", "model folder", "a config.json that is not JSON",
          (E + "model.path <tmp>/model: config.json is not JSON (Expecting property name enclosed in double quotes "
               "at line 1 column 2)",),
          "nothing was started", "Copy the model folder again.", _model(lambda f: (f / "config.json").write_text("{x"))),
    Fault("model-unknown-type", "model folder", "a `model_type` this transformers does not know",
          (E + "model.path <tmp>/model: model_type 'mamba9' is not an architecture transformers <N> knows",),
          "nothing was started", "Upgrade transformers, or set `model.trust_remote_code=true` for a model that "
          "ships its code.", _model(_edit_json("config.json", lambda c: c.update(model_type="mamba9")))),
    Fault("model-no-weights", "model folder", "a model folder without weights",
          (E + "model.path <tmp>/model has no weights file (one of model.safetensors, model.safetensors.index.json, "
               "pytorch_model.bin, pytorch_model.bin.index.json)",),
          "nothing was started", "Copy the weights into the folder.",
          _model(lambda f: (f / "model.safetensors").unlink())),
    Fault("model-cut-weights", "model folder", "a safetensors file cut short (an interrupted download or copy)",
          (E + "model.path <tmp>/model: model.safetensors is cut short (<N> bytes, its header describes <N>): "
               "download or copy it again",),
          "nothing was started", "Download or copy the file again.", _model(_cut)),
    Fault("model-missing-shard", "model folder", "a safetensors index naming a shard that is not there",
          (E + "model.path <tmp>/model: model.safetensors.index.json names 1 shard(s) that are not there, "
               "e.g. model-00002-of-00002.safetensors",),
          "nothing was started", "Copy the missing shards.", _model(_index_naming_a_missing_shard)),
    Fault("model-no-tokenizer", "model folder", "a model folder without tokenizer files",
          (E + "model.path <tmp>/model has no tokenizer file (one of tokenizer.json, tokenizer.model, vocab.json, "
               "vocab.txt, tiktoken.model)",),
          "nothing was started", "Copy the tokenizer files from the base model.",
          _model(lambda f: (f / "tokenizer.json").unlink())),
    Fault("model-context", "model folder", "prompts and responses longer than the model's positions: "
          "`rollout.max_prompt_tokens=500 rollout.max_new_tokens=64` on a 512-position model",
          (E + "rollout.max_prompt_tokens=500 and rollout.max_new_tokens=64 need sequences of up to 565 tokens, beyond "
               "the model's max_position_embeddings=512 (<model>/config.json): lower them",),
          "nothing was started", "Lower the two lengths (prompts longer than max_prompt_tokens are dropped at load).",
          _plan({"rollout": {"max_prompt_tokens": 500, "max_new_tokens": 64}})),
    Fault("layout-tensor-parallel", "config", "`rollout.tensor_parallel_size=3` on a world of one rank",
          (E + "rollout.tensor_parallel_size=3 does not divide the world size 1",), "nothing was started",
          "Use a divisor of the number of ranks.", _plan({"rollout": {"tensor_parallel_size": 3}})),
    # models in the loop
    Fault("distill-no-teacher", "models in the loop", "`algorithm=distill` without `teacher.path`",
          (E + "algorithm.advantage=distill learns from a teacher: set teacher.path to its model folder",),
          "nothing was started", "Set `teacher.path` to the teacher's folder.",
          _config({"algorithm": {"advantage": "distill"}})),
    Fault("teacher-tokenizer", "models in the loop", "a teacher on another tokenizer than the policy's",
          (E + "teacher.path <tmp>/teacher has another tokenizer than model.path <model> (<N> tokens against <N>; "
               "token '<extra_0>' is id <N> in its vocabulary and absent in the policy's): it scores the policy's "
               "token ids, so both must use one tokenizer",),
          "nothing was started", "Distil from a teacher of the policy's model family (the same tokenizer).",
          _models_in_the_loop(lambda sc: {"algorithm": {"advantage": "distill"},
                                          "teacher": {"path": str(sc.tmp / "teacher")}}, "<extra_0>")),
    Fault("reward-model-not-a-classifier", "models in the loop", "a causal LM given as a reward model",
          (E + "task.reward_models[0].path <model> is not a sequence classifier (its config.json names "
               "['Qwen2ForCausalLM']): a reward model is an AutoModelForSequenceClassification with one label; a "
               "causal LM can score as a judge (task.judges)",),
          "nothing was started", "Give a sequence classifier, or ask the causal LM as a judge.",
          _models_in_the_loop(lambda sc: {"task": {"reward_models": [{"path": sc.model}]}})),
    Fault("judge-word", "models in the loop", "a judge whose `yes` word is two tokens of its vocabulary",
          (E + "task.judges[0].path <model>: 'Yes' is 2 tokens in the judge's vocabulary ([<N>, <N>]), not one; "
               "choose yes/no words the judge writes as one token",),
          "nothing was started", "Choose one-token words (often with or without a leading space).",
          _models_in_the_loop(lambda sc: {"task": {"judges": [{"path": sc.model, "template": "{answer}?"}]}})),
    Fault("judge-template", "models in the loop", "a judge template that does not name `{answer}`",
          (E + "task.judges[0].template has no {answer}: the judge would not see the sample it scores",),
          "nothing was started", "Put `{answer}` in the template.",
          _config({"task": {"judges": [{"path": "/tmp", "template": "Is {question} hard?"}]}})),
    # agents
    Fault("agent-not-importable", "agents", "`task.agent=my_agent:run` where the module is not on the path",
          (E + "task.agent 'my_agent:run' cannot be imported: ModuleNotFoundError: No module named 'my_agent'",),
          "nothing was started (before any worker or model)", "Put the harness's module on the path (the launch "
          "directory is).", _harness("my_agent:run")),
    Fault("agent-and-env", "agents", "both `task.agent` and `task.env` set",
          (E + "task.agent and task.env are two ways to run episodes: set one (a harness can call its own tools)",),
          "nothing was started", "Keep one; a harness runs its tools itself.",
          _config({"task": {"agent": "my_agent:run", "env": "tools"}})),
    Fault("agent-exclude-alone", "agents", "`task.agent_exclude` without `task.agent`",
          (E + "task.agent_exclude picks requests of a harness's episodes: it needs task.agent",),
          "nothing was started", "Set `task.agent` to the harness, or drop the filter.",
          _config({"task": {"agent_exclude": "my_agent:is_title"}})),
    Fault("agent-timeout-past-collectives", "agents",
          "a tensor-parallel engine with `agent.episode_timeout_s` at or past `run.collective_timeout_s`",
          (E + "agent.episode_timeout_s=900.0 must be < run.collective_timeout_s=600.0 with a tensor-parallel engine "
               "(a rank waits in the group's step while another rank's harness works)",),
          "nothing was started", "Lower `agent.episode_timeout_s`, or raise `run.collective_timeout_s`.",
          _config({"task": {"agent": "my_agent:run"}, "agent": {"episode_timeout_s": 900.0},
                   "rollout": {"tensor_parallel_size": 2}, "model": {"path": "/tmp"}})),
    Fault("agent-port-in-use", "agents", "`agent.port` taken by another program",
          (E + "the agent endpoint cannot listen on 127.0.0.1:<N> (Address already in use): choose another agent.port "
               "(local rank r uses agent.port + r), or 0 for any free port",),
          "nothing was trained", "Choose a free port, or 0 (the default).", _port_in_use),
    Fault("agent-harness-fails", "agents", "a harness that raises",
          (W + "agent episode <N>: the harness failed: RuntimeError: the harness broke; its turns are kept (logged "
               "once, later ones only counted in agent/failed)",),
          "the step and every other episode; that episode's turns so far are its sample", "Fix the harness.",
          tested_by="tests/unit/test_agent_endpoint.py::test_a_failing_hanging_or_silent_harness_ends_only_its_episode"),
    Fault("agent-harness-hangs", "agents", "a harness that never returns",
          (W + "agent episode <N>: the harness ran past agent.episode_timeout_s=<N> of its own time; cut, its turns kept "
               "as a truncated sample (logged once, later ones only counted in agent/cut)",),
          "the step; the harness is cancelled and its later requests refused (410)",
          "Fix the harness, or raise `agent.episode_timeout_s`.",
          tested_by="tests/unit/test_agent_endpoint.py::test_a_failing_hanging_or_silent_harness_ends_only_its_episode"),
    # reward module
    Fault("reward-not-importable", "reward module", "`task.reward=no_such_module:score`",
          (E + "task.reward 'no_such_module:score' cannot be imported: ModuleNotFoundError: No module named "
               "'no_such_module'",),
          "nothing was started (before any worker or model)", "Put the module on the path (the launch directory is).",
          _reward("no_such_module:score")),
    Fault("reward-no-function", "reward module", "`task.reward=my_rewards:scroe` (a function the module lacks)",
          (E + "task.reward 'my_rewards:scroe' cannot be imported: AttributeError: module 'my_rewards' has no "
               "attribute 'scroe'",),
          "nothing was started", "Correct the function's name.", _reward("my_rewards:scroe")),
    Fault("reward-not-callable", "reward module", "`task.reward=my_rewards:NOT_A_FUNCTION`",
          (E + "task.reward 'my_rewards:NOT_A_FUNCTION' is not callable",), "nothing was started",
          "Name a function.", _reward("my_rewards:NOT_A_FUNCTION")),
    Fault("reward-bad-spec", "reward module", "`task.reward=exact-match` (neither built in nor module:function)",
          (E + "task.reward 'exact-match' is neither a built-in (numeric, math, gsm8k, countdown, format, length_penalty, "
               "tool_use) nor 'module:function'",),
          "nothing was started", "Use a built-in name or module:function.", _reward("exact-match")),
    Fault("reward-empty-combination", "reward module", "`task.rewards={}` given as an empty combination",
          (E + "task.rewards is an empty combination",), "nothing was started", "Name at least one reward.",
          _rewards({})),
    Fault("reward-bad-weight", "reward module", "a reward combination with a weight that is not a number",
          (E + "reward 'numeric' with weight 'high': need a spec string and a finite weight",),
          "nothing was started", "Give each reward a finite number.", _rewards({"numeric": "high"})),
    Fault("reward-raises", "reward module", "a reward function that raises on some samples",
          (W + "reward 'rewards_for_tests:misbehave' raised on completion 'abcd': ValueError: deliberate failure in "
               "misbehave; scored 0.0 (logged once, later ones only counted)",),
          "the step; those samples score 0.0, counted as `reward/errors`; the traceback is in the rank's log",
          "Fix the function; the run goes on.", _scored("raise", workers=0)),
    Fault("reward-hangs", "reward module", "a reward function that never returns",
          (W + "reward 'rewards_for_tests:misbehave' timed out on completion 'abcd'<N>; scored 0.0 (logged once, later "
               "ones only counted)",),
          "the step; those samples score 0.0 after `task.reward_timeout_s`, counted as `reward/timeouts`; the "
          "worker is replaced", "Fix the function, or raise `task.reward_timeout_s`.",
          _scored("hang", workers=1, timeout_s=0.5)),
    Fault("reward-kills-worker", "reward module", "a reward function that kills its process (a crash in native code)",
          (W + "reward 'rewards_for_tests:misbehave' killed its worker process on completion 'abcd'<N>; scored 0.0 "
               "(logged once, later ones only counted)",),
          "the step; those samples score 0.0, counted as `reward/errors`; the worker is replaced",
          "Fix the function.", _scored("segv", workers=1)),
    Fault("reward-not-a-number", "reward module", "a reward function that returns something other than a number",
          (W + "reward 'rewards_for_tests:misbehave' returned a non-number on completion 'abcd'<N>; scored 0.0 (logged "
               "once, later ones only counted)",),
          "the step; those samples score 0.0, counted as `reward/invalid`", "Return a float.",
          _scored("str", workers=0)),
    # tools
    Fault("tools-unknown", "tools", "`task.env_args.tools=[calculator,browser]`",
          (E + "unknown tool 'browser'; the built-in tools are calculator, python",), "nothing was started",
          "Use the built-in tools or your own environment class.", _tools(tools=["calculator", "browser"])),
    Fault("tools-twice", "tools", "a tool listed twice", (E + "tool 'calculator' is listed twice",),
          "nothing was started", "List each tool once.", _tools(tools=["calculator", "calculator"])),
    Fault("tools-max-calls", "tools", "`task.env_args.max_calls_per_turn=0`",
          (E + "task.env_args.max_calls_per_turn must be an integer >= 1, got 0",), "nothing was started",
          "Use 1 or more.", _tools(max_calls_per_turn=0)),
    Fault("env-bad-args", "tools", "`task.env_args` the environment's class does not take",
          (E + "task.env 'tools' with task.env_args {'colour': 'red'}: TypeError: ToolEnv.__init__() got an "
               "unexpected keyword argument 'colour'",),
          "nothing was started", "Use the class's own arguments.", _env("tools", {"colour": "red"})),
    Fault("tools-python-timeout", "tools", "`task.env_args.timeout_s=0` with the python tool",
          (E + "python tool timeout_s must be > 0, got 0",), "nothing was started", "Give a positive time.",
          _tools(tools=["python"], timeout_s=0)),
    Fault("tools-python-memory", "tools", "`task.env_args.memory_mib=8` with the python tool",
          (E + "python tool memory_mib must be >= 32 (the interpreter needs ~15), got 8",), "nothing was started",
          "Give 32 MiB or more.", _tools(tools=["python"], memory_mib=8)),
    Fault("tools-turn-budget", "tools", "python calls per turn that cannot finish within the step's time limit",
          (E + "task.env_args.max_calls_per_turn=3 python calls of up to 6 s each (timeout_s + 1 s start-up) do not "
               "fit in task.reward_timeout_s=10: lower max_calls_per_turn or timeout_s, or raise task.reward_timeout_s",),
          "nothing was started", "As the line says.", _turn_budget),
    Fault("tools-parser", "tools", "`task.env_args.parser=my_mod:parse` that does not import",
          (E + "tool parser 'my_mod:parse' cannot be imported: ModuleNotFoundError: No module named 'my_mod'",),
          "nothing was started", "Put the module on the path, or use the built-in hermes parser.",
          _tools(parser="my_mod:parse")),
    Fault("env-not-importable", "tools", "`task.env=my_envs:Shop` that does not import",
          (E + "task.env 'my_envs:Shop' cannot be imported: ModuleNotFoundError: No module named 'my_envs'",),
          "nothing was started", "Put the module on the path (the launch directory is).", _env("my_envs:Shop", {})),
    # checkpoints
    Fault("checkpoint-torn-auto", "checkpoints", "the newest checkpoint is torn (a shard cut short), "
          "`checkpoint.resume=auto`",
          (W + "skipping checkpoint <tmp>/run/checkpoints/step_000001 (step 1): <tmp>/run/checkpoints/step_000001/"
               "__0_0.distcp is 10 bytes, the marker says <N>",
           W + "no complete checkpoint to continue: starting a fresh run at step 1",
           W + "<tmp>/run held files of an earlier run; they were moved to <tmp>/run/previous/<N>"),
          "the torn checkpoint's folder, moved with the earlier run's files to `previous/`",
          "Nothing: the run recomputes the steps named.", _resume("auto", _truncate_shard)),
    Fault("checkpoint-torn-force", "checkpoints", "the only checkpoint is torn, `checkpoint.resume=force`",
          (E + "checkpoint.resume=force: no complete checkpoint in <tmp>/run/checkpoints; the newest, "
               "<tmp>/run/checkpoints/step_000001, cannot be loaded: <tmp>/run/checkpoints/step_000001/__0_0.distcp "
               "is 10 bytes, the marker says <N>",),
          "every file as it was", "Restore the file, or relaunch with `checkpoint.resume=auto` to start afresh.",
          _resume("force", _truncate_shard)),
    Fault("checkpoint-marker-torn", "checkpoints", "a checkpoint whose marker is not JSON, `checkpoint.resume=force`",
          (E + "checkpoint.resume=force: no complete checkpoint in <tmp>/run/checkpoints; the newest, "
               "<tmp>/run/checkpoints/step_000001, cannot be loaded: its COMPLETE marker is not a "
               "checkpoint marker (torn or not distflow's)",),
          "every file as it was", "Relaunch with `checkpoint.resume=auto` to start afresh.",
          _resume("force", _marker_not_json)),
    Fault("checkpoint-named-incomplete", "checkpoints", "`checkpoint.resume=<folder>` naming a folder that is "
          "not a complete checkpoint",
          (E + "checkpoint.resume='<tmp>' is not a complete checkpoint folder: it has no COMPLETE "
               "marker (its save did not finish)",),
          "every file as it was", "Name a `step_*` folder that holds a marker.", _resume("<tmp>")),
    Fault("checkpoint-different-run", "checkpoints", "relaunching into a run folder with other settings "
          "(`optim.lr` changed), `checkpoint.resume=auto`",
          (E + "<tmp>/run holds a different run (optim.lr: 1e-05 -> 0.001). Start a new run with "
               "checkpoint.resume=never (the earlier one moves to <tmp>/run/previous/) or another run.output_dir; "
               "continue the earlier one with these settings with checkpoint.resume=force",),
          "every file as it was", "As the line says.", _resume("auto", optim__lr=1e-3)),
    Fault("checkpoint-complete", "checkpoints", "relaunching a run that already reached `run.steps`",
          ("distflow: <tmp>/run/checkpoints/step_000001 is already at step 1 of run.steps=1; nothing to train "
           "(results: <tmp>/run/summary.json). Start a new run with checkpoint.resume=never, or continue this one "
           "with a higher run.steps and checkpoint.resume=force",),
          "every file as it was (exit status 0)", "As the line says.", _resume("auto", steps=1)),
    Fault("checkpoint-tampered", "checkpoints", "a checkpoint file that unpickles to something other than data",
          (E + "checkpoint file <tmp>/run/checkpoints/step_000001/.metadata refers to builtins.print, which a "
               "distflow checkpoint never holds; refused (a checkpoint is data: distflow runs no code from it)",),
          "every file as it was; nothing in it ran", "Do not load checkpoints from untrusted sources.",
          _tampered_metadata),
    Fault("checkpoint-carry-malformed", "checkpoints", "a carry-over checkpoint whose carried groups are "
          "malformed (edited or cut short)",
          (E + "checkpoint <tmp>/run/checkpoints/step_000001 is incomplete: <tmp>/run/checkpoints/step_000001/"
               "rank_0.json is <N> bytes, the marker says <N>",),
          "every file as it was", "Resume from an earlier checkpoint (`checkpoint.resume=<folder>`), or start afresh.",
          _malformed_carry),
    Fault("checkpoint-other-model", "checkpoints", "`checkpoint.resume=force` onto a checkpoint of another model "
          "(other shapes)",
          (E + "checkpoint <tmp>/run/checkpoints/step_000001 does not fit this run's model: Size mismatch between saved "
               "torch.Size([512, 64]) and current: torch.Size([512, 128]) for policy.model.model.embed_tokens.weight; "
               "it was written by a run with another model or model config (checkpoint.resume=never starts afresh)",),
          "every file as it was", "Resume with the model it was written with, or start afresh.", _other_model),
    # file system (and what the run meets later)
    Fault("fs-not-a-directory", "file system", "`run.output_dir` through a file (ENOTDIR)",
          (E + "run.output_dir <tmp>/a_file/run cannot be created: Not a directory",),
          "nothing was written", "Pick another `run.output_dir`.", _lock_under(_through_a_file)),
    Fault("fs-not-permitted", "file system", "`run.output_dir=/sys/x` (EPERM)",
          (E + "run.output_dir /sys/x cannot be created: Operation not permitted",),
          "nothing was written", "Pick a folder you may write.", _lock_under(lambda t: Path("/sys/x"))),
    Fault("fs-read-only", "file system", "`run.output_dir` on a read-only file system (EROFS)",
          (E + "run.output_dir <tmp>/fs/run cannot be created: Read-only file system",),
          "nothing was written", "Pick a writable folder.", _on_tmpfs(readonly=True)),
    Fault("fs-full", "file system", "`run.output_dir` on a full disk (ENOSPC)",
          (E + "run.output_dir <tmp>/fs/run is not writable: could not write <tmp>/fs/run/.distflow-lock: "
               "No space left on device (0 B free there)",),
          "nothing: what the launch created is removed again", "Free space, or pick another folder.",
          _on_tmpfs(full=True)),
    Fault("fs-in-use", "file system", "a second launch into the folder of a live run",
          (E + "run.output_dir <tmp>/out is in use by another run (host <N>, pid <N>, started <N>); wait for it to "
               "end, or choose another run.output_dir",),
          "the live run and its folder, untouched", "Wait for it, stop it, or pick another `run.output_dir`.",
          _held_by_another_run),
    Fault("fs-name-too-long", "file system", "`run.output_dir` with a name over 255 bytes (ENAMETOOLONG)",
          (E + "run.output_dir <tmp>/" + "x" * 300 + " cannot be created: File name too long",),
          "nothing was written", "Pick a shorter name.", _lock_under(lambda t: t / ("x" * 300))),
    # the run: faults met after start-up, each checked by the test named (they need several ranks or a run)
    Fault("run-rank-raises", "run", "a rank raises in a rank-local part of a step (building the batch, waiting for "
          "the rewards, the step's report)",
          (E + "rank <N> raised RuntimeError: <N>; stopped writing the report of step <N>",),
          "every complete checkpoint; the failing rank's log has the traceback (exit status 1, all ranks within "
          "seconds)", "Fix what the line names and relaunch with the same `run.output_dir` to resume.",
          None, "tests/e2e/test_failures.py::test_a_rank_that_raises_in_its_report_stops_every_rank_with_its_line"),
    Fault("run-save-raises", "run", "a checkpoint save raises on one rank (not a write error)",
          (E + "checkpoint of step <N>: rank <N> raised ValueError: <N>; the save was removed and the latest checkpoint "
               "is still <N> (rank <N>'s log has the traceback)",),
          "the previous checkpoints; the torn save is removed", "Fix the cause and relaunch to resume.",
          None, "tests/distributed/test_checkpoint.py::test_a_save_that_raises_on_one_rank_stops_every_rank_with_its_line"),
    Fault("run-disk-full", "run", "the disk under the run folder fills up during the run",
          (E + "rank <N> could not write <N>/metrics.jsonl: No space left on device (<N> free there); stopped after step "
               "<N>. Free space and relaunch with the same run.output_dir to continue from its last checkpoint",),
          "every complete checkpoint and every complete metric row", "Free space and relaunch.",
          None, "tests/distributed/test_write_failures.py::test_a_full_disk_stops_every_rank_together_with_one_line"),
    Fault("run-nonfinite", "run", "the loss or gradient norm is not finite for `run.max_nonfinite_steps` steps",
          (E + "step <N>: the loss or gradient norm was not finite for <N> consecutive steps (run.max_nonfinite_steps); "
               "stopping",),
          "every complete checkpoint (the non-finite updates were skipped)",
          "Lower `optim.lr`, check the rewards, or resume from an earlier checkpoint.",
          None, "tests/distributed/test_trainer_loop.py::test_nonfinite_steps_in_a_row_stop_every_rank"),
    Fault("run-engine-mismatch", "run", "the engine does not compute what the policy trains (a resync left a tensor "
          "out)",
          (E + "step <N>: the engine's logprobs differ from the policy's by up to <N> (qwen2, float32; at most <N> "
               "expected): <N> run.allow_engine_mismatch=true trains anyway",),
          "every complete checkpoint; nothing was trained on the bad samples",
          "Report it with the line; `run.allow_engine_mismatch=true` trains anyway.",
          None, "tests/distributed/test_trainer_loop.py::test_an_engine_that_does_not_hold_the_policy_stops_the_run"),
]
