"""The commands the README and the docs/ pages show, and running one as a user would: from a folder
that holds the repo's entry points and the docs' own my_rewards.py."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

from launch_helpers import ROOT, SUPPORT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def pages_text() -> str:
    return "\n".join(page.read_text() for page in PAGES)


def doc_commands() -> list[str]:
    """Every command line of the bash blocks of every page (continuation lines joined, comments dropped)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", pages_text(), re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        commands += [line.split("  #")[0].strip() for line in joined.splitlines()
                     if line.strip() and not line.lstrip().startswith("#")]
    return commands


def doc_command(command: str) -> str:
    """`command`, which the docs must show exactly so (a test that runs it fails when they change it)."""
    assert command in doc_commands(), f"the docs no longer show {command!r}"
    return command


def user_folder(tmp_path: Path) -> Path:
    """A folder a user launches from: the repo's entry points, and the docs' my_rewards.py."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    for name in (".venv", "recipes", "launch"):
        if not (work / name).exists():
            (work / name).symlink_to(ROOT / name)
    module = next(b for b in re.findall(r"```python\n(.*?)```", pages_text(), re.S) if b.startswith("# my_rewards.py"))
    (work / "my_rewards.py").write_text(module)
    return work


def run_doc_command(command: str, extra: list[str], tmp_path: Path, timeout: float = 600,
                    log_file: Path | None = None) -> subprocess.CompletedProcess:
    """The docs' `command` with `extra` overrides, typed in a user folder (the test rewards importable).
    With `log_file`, as `command > log_file 2>&1` would: both streams into one file, whose text
    comes back as stdout (stderr is then empty)."""
    pythonpath = [str(SUPPORT), *(str(Path(p).resolve()) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(pythonpath))
    args = [*shlex.split(command), *extra]
    if log_file is None:
        return subprocess.run(args, cwd=user_folder(tmp_path), env=env, capture_output=True, text=True,
                              timeout=timeout)
    with open(log_file, "w") as f:
        proc = subprocess.run(args, cwd=user_folder(tmp_path), env=env, stdout=f, stderr=subprocess.STDOUT,
                              timeout=timeout)
    return subprocess.CompletedProcess(args, proc.returncode, Path(log_file).read_text(), "")
