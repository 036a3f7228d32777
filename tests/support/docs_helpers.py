"""The commands the README and the docs/ pages show, and running one as a user would: from a folder
that holds the repo's entry points and the docs' own my_rewards.py. Also the README's code map,
generated from the package tree and each wing's `__init__.py` docstring:
`.venv/bin/python tests/support/docs_helpers.py code-map` rewrites it in README.md."""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
import textwrap
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


# The README's code map: "src/distflow/" and one entry per top-level module and per wing (a package,
# nested ones included), each wing described by the first paragraph of its __init__.py docstring
# and followed by its modules. The lines after it (recipes/, launch/, ...) are the README's own.
PACKAGE = ROOT / "src" / "distflow"
CODE_MAP_HEADING = "## Where things are"
CODE_MAP_WIDTH = 100


def first_paragraph(path: Path) -> str:
    """The first paragraph of a module's docstring, on one line ('' when it has none)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return " ".join(doc.strip().split("\n\n")[0].split()).rstrip(":")


def package_tree(package: Path = PACKAGE) -> dict[str, list[str]]:
    """{wing: its modules} for the package: "" holds the top-level modules (file names), every other
    key is a wing's folder relative to the package ("tasks/envs/"), its modules without .py."""
    tree = {"": sorted(p.name for p in package.glob("*.py") if p.name != "__init__.py")}
    for init in sorted(package.rglob("__init__.py")):
        if init.parent == package or "__pycache__" in init.parts:
            continue
        wing = init.parent.relative_to(package).as_posix() + "/"
        tree[wing] = sorted(p.stem for p in init.parent.glob("*.py") if p.name != "__init__.py")
    return tree


def _entry(name: str, text: str, column: int) -> list[str]:
    return textwrap.wrap(text, CODE_MAP_WIDTH, initial_indent=f"  {name}".ljust(column),
                         subsequent_indent=" " * column, break_on_hyphens=False) or [f"  {name}"]


def code_map(package: Path = PACKAGE) -> str:
    """The src/distflow/ part of the README's code map, as the tree and the docstrings say."""
    tree = package_tree(package)
    column = 2 + max(len(name) for name in [*tree, *tree[""]]) + 2
    lines = [f"{package.relative_to(package.parents[1]).as_posix()}/"]
    for module in tree.pop(""):
        lines += _entry(module, first_paragraph(package / module), column)
    for wing, modules in tree.items():
        lines += _entry(wing, first_paragraph(package / wing / "__init__.py"), column)
        lines += _entry("", "modules: " + ", ".join(modules), column) if modules else []
    return "\n".join(lines) + "\n"


def readme_code_map(readme: Path = ROOT / "README.md") -> str:
    """The code block under the README's "Where things are" heading."""
    section = readme.read_text().split(CODE_MAP_HEADING, 1)[1]
    match = re.search(r"```\n(.*?)```", section, re.S)
    assert match, f"README.md has no code block under {CODE_MAP_HEADING!r}"
    return match.group(1)


def code_map_names(block: str) -> dict[str, list[str]]:
    """{wing: modules} as a code map names them (the inverse of package_tree, read from the text):
    entries are the lines indented by two spaces under "src/distflow/", up to the next unindented
    line; a wing's modules are its "modules:" line, which may wrap."""
    lines = block.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("src/distflow/")) + 1
    names: dict[str, list[str]] = {"": []}
    wing, listing = "", None
    for line in lines[start:]:
        if line and not line.startswith(" "):
            break
        if line.startswith("  ") and line[2:3] != " ":  # a new entry: a wing or a top-level module
            wing, listing = line.split()[0], None
            if wing.endswith("/"):
                names[wing] = []
            else:
                names[""].append(wing)
            continue
        text = line.strip()
        if text.startswith("modules:"):
            listing, text = wing, text[len("modules:"):]
        if listing is not None and wing == listing:
            names[wing] += [m.strip() for m in text.split(",") if m.strip()]
    return names


def write_code_map(readme: Path = ROOT / "README.md") -> None:
    """Replace the src/distflow/ part of the README's code map with code_map()."""
    text = readme.read_text()
    old = readme_code_map(readme)
    lines = old.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("src/distflow/"))
    end = next((i for i in range(start + 1, len(lines)) if lines[i] and not lines[i].startswith(" ")), len(lines))
    new = "\n".join(lines[:start]) + ("\n" if start else "") + code_map() + "\n".join(lines[end:])
    head, tail = text.split(CODE_MAP_HEADING, 1)
    readme.write_text(head + CODE_MAP_HEADING + tail.replace(old, new, 1))


TROUBLESHOOTING = ROOT / "docs" / "troubleshooting.md"


def generated_block(text: str, name: str) -> str:
    """What stands between `<!-- name:start -->` and `<!-- name:end -->` in `text`."""
    match = re.search(rf"<!-- {name}:start -->\n(.*?)<!-- {name}:end -->", text, re.S)
    assert match, f"no generated block {name!r}"
    return match.group(1)


def fault_table_markdown(faults) -> str:
    """docs/troubleshooting.md's fault table: one row per fault, grouped by area, in table order."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    out = []
    for area in dict.fromkeys(f.area for f in faults):
        out += [f"**{area[0].upper()}{area[1:]}**", "",
                "| what happened | what distflow prints | what it keeps | what to do |", "|---|---|---|---|"]
        for f in (f for f in faults if f.area == area):
            prints = "<br>".join(f"`{cell(line)}`" for line in f.prints)
            out.append(f"| {cell(f.fault)} | {prints} | {cell(f.keeps)} | {cell(f.next)} |")
        out.append("")
    return "\n".join(out)


def write_fault_table(page: Path = TROUBLESHOOTING) -> None:
    from fault_table import FAULTS

    text = page.read_text(encoding="utf-8")
    head, rest = text.split("<!-- fault-table:start -->\n", 1)
    tail = rest.split("<!-- fault-table:end -->", 1)[1]
    block = f"<!-- fault-table:start -->\n{fault_table_markdown(FAULTS)}<!-- fault-table:end -->"
    page.write_text(head + block + tail, encoding="utf-8")


if __name__ == "__main__":
    commands = {"code-map": write_code_map, "fault-table": write_fault_table}
    if len(sys.argv) != 2 or sys.argv[1] not in commands:
        sys.exit("usage: python tests/support/docs_helpers.py code-map|fault-table   (rewrites README.md's code map "
                 "or docs/troubleshooting.md's fault table)")
    commands[sys.argv[1]]()
