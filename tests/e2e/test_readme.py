"""Every command the README and the docs/ pages show, as a new user would type it.

CPU lines (`.venv/bin/torchrun`, `launch/local.sh`) run, shortened to one step, from a fresh
working folder that holds the README's own `my_rewards.py` (so a reward module beside the user is
importable under torchrun, as the README says). GPU lines (`.venv-gpu/bin/torchrun`) are
composed: the config they build must validate and resolve on CUDA to the documented defaults.
sbatch lines run the real template against a fake allocation (stub srun, a stand-in GPU python)
and the torchrun command it builds is composed the same way. make lines are dry-run (`make -n`).
"""

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from launch_helpers import ROOT

KINDS = {"make": "make ", "cpu": (".venv/bin/torchrun", "launch/local.sh"), "gpu": ".venv-gpu/bin/torchrun",
         "sbatch": "sbatch "}


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _pages() -> str:
    return "\n".join(page.read_text() for page in PAGES)


def readme_commands() -> list[str]:
    """Every command line of the bash blocks of every page (continuation lines joined, comments dropped)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", _pages(), re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        commands += [line.split("  #")[0].strip() for line in joined.splitlines()
                     if line.strip() and not line.lstrip().startswith("#")]
    return commands


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


@pytest.mark.parametrize("command", of_kind("make"))
def test_readme_make_target_exists(command):
    proc = subprocess.run(["make", "-n", *shlex.split(command)[1:]], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr


def _pythonpath() -> str:
    """This checkout's PYTHONPATH with relative entries made absolute (the commands run elsewhere)."""
    return os.pathsep.join(str(Path(p).resolve()) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)


def _user_folder(tmp_path) -> Path:
    """A folder a user launches from: the repo's entry points, and the README's my_rewards.py."""
    work = tmp_path / "work"
    work.mkdir()
    for name in (".venv", "recipes", "launch"):
        (work / name).symlink_to(ROOT / name)
    module = next(b for b in re.findall(r"```python\n(.*?)```", _pages(), re.S) if b.startswith("# my_rewards.py"))
    (work / "my_rewards.py").write_text(module)
    return work


@pytest.mark.slow
@pytest.mark.parametrize("command", of_kind("cpu"))
def test_readme_cpu_command_runs(command, tmp_path):
    work = _user_folder(tmp_path)
    args = shlex.split(command)
    out = tmp_path / "out"
    args += ["run.steps=1", f"run.output_dir={out}", "logging.plot_at_end=false"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=_pythonpath())
    proc = subprocess.run(args, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1
    if "my_rewards" in command:  # the user's reward really scored (no import error turned into zeros)
        assert rows[0]["reward/errors"] == 0, rows[0]


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
