"""Every CPU example command in the README runs (shortened to one step, into a temp folder)."""

import os
import re
import shlex
import subprocess

import pytest

from launch_helpers import ROOT, TESTS


def readme_commands() -> list[str]:
    """Commands of the README's bash blocks that start with .venv/bin/torchrun or launch/local.sh
    (continuation lines joined)."""
    text = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        commands += [line.strip() for line in joined.splitlines()
                     if line.startswith((".venv/bin/torchrun", "launch/local.sh"))]
    return commands


def test_readme_has_cpu_examples():
    assert len(readme_commands()) >= 4


@pytest.mark.slow
@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_runs(command, tmp_path):
    args = shlex.split(command)
    args[0] = str(ROOT / args[0])  # --standalone picks a free rendezvous port itself
    args += ["trainer.steps=1", f"trainer.output_dir={tmp_path}", "trainer.plot_at_end=false"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(TESTS))
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1
