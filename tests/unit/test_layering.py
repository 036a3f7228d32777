"""The package's floors, read from every import statement in src/distflow (function-local ones
too): a rollout rank must run without the trainer, the wings import each other without circles,
and no module outgrows one screenful of intent."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "distflow"
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path) -> set[str]:
    """Every distflow module `path` imports, wherever the statement stands."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("distflow"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("distflow"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # `from pkg import module`
    return found


def _wing(module: str) -> str:
    """distflow.rollout.collect -> rollout; a top-level module is its own wing."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_rollout_imports_nothing_from_train():
    modules = _modules()
    offenders = {name: sorted(i for i in _imports(path) if i == "distflow.train" or i.startswith("distflow.train."))
                 for name, path in modules.items() if name.startswith("distflow.rollout")}
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_the_check_sees_function_local_imports(tmp_path):
    hidden = tmp_path / "m.py"
    hidden.write_text("def f():\n    from distflow.train.lora import merged_parameters\n    import distflow.train\n")
    assert _imports(hidden) >= {"distflow.train.lora", "distflow.train"}


def test_no_circle_between_wings():
    modules = _modules()
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        for target in _imports(path):
            if target in modules and _wing(target) != _wing(name):
                edges.setdefault(_wing(name), set()).add(_wing(target))

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and (seen.add(n) or reaches(n, goal, seen)))
                   for n in edges.get(start, ()))

    circles = sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets if reaches(b, a, set()))
    assert not circles, circles


def test_no_module_is_over_the_limit():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_a_task_worker_imports_neither_torch_nor_datasets():
    """Reward and environment workers are fresh interpreters, several per rank, started while the models
    load: what their entry point imports is start-up CPU time every rank pays."""
    import subprocess
    import sys

    probe = ("import sys; from distflow.tasks.rewards.pool import _worker_main; "
             "from distflow.tasks.envs import build_env; print(sorted({'torch', 'datasets'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
