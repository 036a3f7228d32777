"""A run.output_dir that cannot be created or written stops a launch with one `distflow: error:`
line and exit status 2 before anything loads, whichever way the file system refuses it: from one
process (`python recipes/grpo.py`, what each torchrun rank runs), from launch/local.sh's
pre-flight, and from every rank under bare torchrun. Hydra makes hydra.run.dir before the
recipe's main runs, so the recipe hands it a stand-in then; nothing is left behind, and a usable
folder gets .hydra/ as before."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from config_helpers import recipe
from launch_helpers import ROOT, assert_clean_failure, launch_env, torchrun
from mount_helpers import fill, private_tmpfs

RECIPE = str(ROOT / "recipes" / "grpo.py")


# Each case: the folder, the command prefix the launch runs under, what the line says after the folder.
@contextmanager
def _sysfs(tmp: Path):
    yield Path("/sys/distflow-test"), [], "cannot be created"  # sysfs takes no folder, not even root's


@contextmanager
def _no_write_permission(tmp: Path):
    locked = tmp / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    # in a user namespace of its own even root is not the folder's owner's root: the mode applies
    yield locked, ["unshare", "--user"], "is not writable"


@contextmanager
def _read_only(tmp: Path):
    with private_tmpfs(tmp / "ro", readonly=True) as ro:
        yield ro / "run", [], "cannot be created"


@contextmanager
def _full(tmp: Path):
    with private_tmpfs(tmp / "full", size="16k") as full:
        fill(full)
        yield full / "run", [], f"is not writable: could not write {full}/run/.distflow-lock"


@contextmanager
def _through_a_file(tmp: Path):
    (tmp / "a_file").write_text("x")
    yield tmp / "a_file" / "run", [], "cannot be created"


@contextmanager
def _name_too_long(tmp: Path):
    yield tmp / ("n" * 256) / "run", [], "cannot be created"


CASES = {errno.EPERM: _sysfs, errno.EACCES: _no_write_permission, errno.EROFS: _read_only, errno.ENOSPC: _full,
         errno.ENOTDIR: _through_a_file, errno.ENAMETOOLONG: _name_too_long}


def _snapshot(folder: Path) -> list[str]:
    """The nearest existing folder at or above `folder`, and what is in it: what a refusal must not change."""
    while not os.path.isdir(folder):
        folder = folder.parent
    return [str(folder), *sorted(os.listdir(folder))]


@pytest.mark.parametrize("code", list(CASES), ids=[errno.errorcode[c] for c in CASES])
def test_an_unusable_output_dir_is_one_line_from_the_recipe_and_the_pre_flight(tmp_path, code):
    tmpdir = tmp_path / "tmpdir"  # where a stand-in for Hydra would be left
    tmpdir.mkdir()
    with CASES[code](tmp_path) as (out, prefix, what):
        free = " (0 B free there)" if code == errno.ENOSPC else ""
        line = f"distflow: error: run.output_dir {out} {what}: {os.strerror(code)}{free}\n"
        before = _snapshot(out)
        for flags in ([], ["--check-config", "--with-output-dir"]):  # one rank; launch/local.sh's pre-flight
            command = [*prefix, sys.executable, RECIPE, *flags, "experiment=smoke", f"run.output_dir={out}"]
            proc = subprocess.run(command, cwd=ROOT, env=launch_env({"TMPDIR": str(tmpdir)}), capture_output=True,
                                  text=True, timeout=120)
            assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", line), (flags, proc.stderr[-3000:])
            assert _snapshot(out) == before and os.listdir(tmpdir) == []


def test_every_rank_under_bare_torchrun_says_it_once_and_leaves_nothing(tmp_path):
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    out = "/sys/distflow-test"
    proc = torchrun(["experiment=smoke", f"run.output_dir={out}"], timeout=180, torchrun_args=["--monitor-interval=1"],
                    extra_env={"TMPDIR": str(tmpdir)})
    line = f"distflow: error: run.output_dir {out} cannot be created: Operation not permitted"
    assert_clean_failure(proc, line)
    text = proc.stdout + proc.stderr
    assert [t for t in text.splitlines() if "distflow: error:" in t] == [line, line, f"  traceback : {line}",
                                                                         f"  traceback : {line}"], text[-3000:]
    assert "PermissionError" not in text and 'grpo.py", line' not in text, text[-3000:]  # no rank's traceback
    assert list(tmpdir.glob("distflow-hydra-*")) == []


def test_hydra_gets_the_folder_itself_when_it_can_write_there(tmp_path):
    """In-process, the resolver behind hydra.run.dir: a usable folder is itself, with .hydra/ made
    and the probe gone; an unusable one gets one empty stand-in however often Hydra resolves it."""
    grpo = recipe()
    out = tmp_path / "a" / "run"
    assert grpo._hydra_dir(str(out)) == str(out)
    assert os.listdir(out) == [".hydra"] and os.listdir(out / ".hydra") == []
    (tmp_path / "a_file").write_text("x")
    unusable = str(tmp_path / "a_file" / "run")
    stand_in = grpo._hydra_dir(unusable)
    try:
        assert stand_in != unusable and os.listdir(stand_in) == [] and grpo._hydra_dir(unusable) == stand_in
    finally:
        shutil.rmtree(grpo._stand_ins.pop(unusable))
