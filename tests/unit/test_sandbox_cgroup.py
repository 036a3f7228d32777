"""The python tool's memory limit over all of a program's processes (distflow.tasks.envs.cgroup): where a cgroup v2
can hold it, read from fake /proc and /sys/fs/cgroup trees, what a call's cgroup is given, and the start-up note
where none can. The real limit against a hostile program: tests/unit/test_sandbox.py."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from distflow.tasks.envs import python_tool
from distflow.tasks.envs.cgroup import PREFIX, detect, per_process_note, settings
from distflow.tasks.envs.python_tool import PROCESS_LIMIT, TMP_SIZE, PythonExecutor

V2 = "30 24 0:26 / /sys/fs/cgroup {opts} shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MEMORY = "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
HYBRID = ("31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n" + V1_MEMORY +
          "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n")


def fake(root: Path, cgroup: str, mountinfo: str, folders: dict[str, dict[str, str]]) -> str:
    """A fake machine under root: /proc/self/{cgroup,mountinfo} and cgroup folders with their files."""
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(cgroup)
    (root / "proc/self/mountinfo").write_text(mountinfo)
    for folder, files in folders.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (root / folder / name).write_text(text)
    return str(root)


def delegated(root: Path, opts: str = "rw,nosuid") -> str:
    """A systemd-like machine: our process in /user.slice/job.scope, whose parent has memory and pids on."""
    return fake(root, "0::/user.slice/job.scope\n", V2.format(opts=opts), {
        "sys/fs/cgroup/user.slice": {"cgroup.type": "domain", "cgroup.controllers": "cpu memory pids",
                                     "cgroup.subtree_control": "memory pids"},
        "sys/fs/cgroup/user.slice/job.scope": {"cgroup.type": "domain", "cgroup.controllers": "memory pids",
                                               "cgroup.subtree_control": ""}})


def test_a_delegated_v2_tree_is_used(tmp_path):
    base = tmp_path / "sys/fs/cgroup/user.slice"
    assert detect(delegated(tmp_path), uid=0) == (str(base), "")
    assert detect(str(tmp_path), uid=os.getuid()) == (str(base), "")  # owned by us: delegated
    # our own cgroup, when the memory controller is on for its children
    (base / "job.scope/cgroup.subtree_control").write_text("memory")
    assert detect(str(tmp_path), uid=0) == (str(base / "job.scope"), "")


def test_the_tree_root_may_enable_the_controller_itself(tmp_path):
    root = fake(tmp_path, "0::/\n", V2.format(opts="rw"), {
        "sys/fs/cgroup": {"cgroup.controllers": "cpu memory pids", "cgroup.subtree_control": ""}})
    assert detect(root, uid=0) == (str(tmp_path / "sys/fs/cgroup"), "")


@pytest.mark.parametrize("machine,reason", [
    ("v1_only", "cgroup v1 only"),
    ("hybrid", "the memory controller is on cgroup v1"),  # this project's machines
    ("no_memory", "the memory controller is not enabled for our cgroup /user.slice/job.scope"),
    ("read_only", "/sys/fs/cgroup is mounted read-only"),
    ("not_ours", "our cgroup /user.slice/job.scope cannot take a child with the memory controller here "
                 "(not delegated to us)"),
    ("no_mount", "no cgroup2 file system is mounted"),
    ("outside", "our cgroup /user.slice/job.scope is outside the cgroup2 mount at /sys/fs/cgroup"),
])
def test_where_no_v2_limit_is_possible_detection_says_why(tmp_path, machine, reason):
    uid = 0
    if machine == "v1_only":
        root = fake(tmp_path, "4:memory:/job\n1:name=systemd:/\n", V1_MEMORY, {})
    elif machine == "hybrid":
        root = fake(tmp_path, "4:memory:/job\n0::/\n", HYBRID, {
            "sys/fs/cgroup/unified": {"cgroup.controllers": "hugetlb", "cgroup.subtree_control": ""}})
    elif machine == "read_only":
        root = delegated(tmp_path, opts="ro,nosuid")
    else:
        root = delegated(tmp_path)
        if machine == "no_memory":
            (tmp_path / "sys/fs/cgroup/user.slice/job.scope/cgroup.controllers").write_text("cpu io")
        elif machine == "not_ours":
            uid = os.getuid() + 1  # neither root nor the owner of the fake folders
        elif machine == "no_mount":
            (tmp_path / "proc/self/mountinfo").write_text(V1_MEMORY)
        elif machine == "outside":
            (tmp_path / "proc/self/mountinfo").write_text(V2.format(opts="rw").replace(" / /sys", " /other /sys"))
    assert detect(root, uid=uid) == (None, reason)


def test_a_calls_cgroup_holds_memory_and_processes_in_total():
    assert settings(64 << 20, 64, {"memory", "pids"}) == {
        "memory.max": str(64 << 20), "memory.swap.max": "0", "memory.oom.group": "1", "pids.max": "67"}
    assert "pids.max" not in settings(64 << 20, 64, {"memory"})


def test_the_note_states_the_bound_per_process():
    assert per_process_note("the memory controller is on cgroup v1", 64, 512 << 20, 64 << 20) == (
        "python tool: no cgroup v2 memory limit here (the memory controller is on cgroup v1); its programs' memory "
        "is bounded per process only: up to 64 processes x 512 MiB = 32768 MiB, plus 64 MiB of /tmp")
    assert per_process_note("cgroup v1 only", None, 256 << 20, 64 << 20) == (
        "python tool: no cgroup v2 memory limit here (cgroup v1 only); its programs' memory is bounded per process "
        "only: 256 MiB each, plus 64 MiB of /tmp, and their number is not limited here")


def tool_on(root: str, sandboxed: bool = True, **kwargs) -> PythonExecutor:
    class OnFakeTree(PythonExecutor):
        _cgroup_root = root
        _mechanisms = PythonExecutor._mechanisms if sandboxed else ()

    return OnFakeTree(timeout_s=5, **kwargs)


def test_without_a_limit_the_tool_notes_it_once_per_process(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(python_tool, "_noted", False)
    root = fake(tmp_path, "4:memory:/job\n0::/\n", HYBRID, {
        "sys/fs/cgroup/unified": {"cgroup.controllers": "hugetlb", "cgroup.subtree_control": ""}})
    with caplog.at_level(logging.INFO, logger="distflow"):
        first, _ = tool_on(root, memory_mib=256), tool_on(root, memory_mib=128)
    assert first.cgroups is None
    assert [r.getMessage() for r in caplog.records] == [per_process_note(
        "the memory controller is on cgroup v1", PROCESS_LIMIT, 256 << 20, TMP_SIZE)]
    assert caplog.records[0].levelno == logging.INFO


@pytest.mark.parametrize("sandboxed", [True, False], ids=["sandbox", "unisolated"])
def test_with_a_limit_each_call_runs_in_its_own_cgroup(tmp_path, monkeypatch, caplog, sandboxed):
    """On a fake delegated tree: no note, and the call's cgroup got its limits and the program's first process
    wrote itself into its cgroup.procs before starting the program (a real cgroupfs would move it there)."""
    monkeypatch.setattr(python_tool, "_noted", False)
    root = delegated(tmp_path)
    with caplog.at_level(logging.INFO, logger="distflow"):
        tool = tool_on(root, sandboxed, memory_mib=64, allow_unisolated=not sandboxed)
    assert caplog.records == [] and tool.cgroups is not None
    base = tmp_path / "sys/fs/cgroup/user.slice"
    assert tool.cgroups.base == str(base) and (base / "cgroup.subtree_control").read_text() == "memory pids"
    make = tool.cgroups.make

    def make_as_cgroupfs():  # the kernel gives a new cgroup its cgroup.procs; a plain folder has none
        cgroup = make()
        Path(cgroup.procs).write_text("")
        return cgroup

    monkeypatch.setattr(tool.cgroups, "make", make_as_cgroupfs)
    before = set(os.listdir(base))
    assert tool({"code": "print('ran')"}).output == "ran\n"
    [made] = [base / n for n in set(os.listdir(base)) - before if n.startswith(f"{PREFIX}{os.getpid()}-")]
    assert {p.name: p.read_text() for p in made.iterdir()} == {
        "memory.max": str((64 << 20) + TMP_SIZE), "memory.oom.group": "1", "pids.max": str(PROCESS_LIMIT + 3),
        "cgroup.procs": "0"}  # no memory.swap.max on a machine without swap accounting


def test_the_tree_roots_controllers_are_enabled_once(tmp_path):
    root = fake(tmp_path, "0::/\n", V2.format(opts="rw"), {
        "sys/fs/cgroup": {"cgroup.controllers": "cpu memory pids", "cgroup.subtree_control": ""}})
    assert tool_on(root).cgroups is not None
    assert (tmp_path / "sys/fs/cgroup/cgroup.subtree_control").read_text() == "+memory +pids"
