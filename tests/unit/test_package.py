"""The package imports from a plain source tree, with no installed metadata: that is how the GPU
check runs it, over a machine's own torch."""

import shutil
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def test_distflow_imports_from_a_source_tree_without_metadata(tmp_path):
    shutil.copytree(SRC / "distflow", tmp_path / "distflow", ignore=shutil.ignore_patterns("__pycache__"))
    # -S: no site-packages, so no installed distflow (nor its metadata) can be found
    code = "import importlib.metadata as m, distflow; print(distflow.__file__, distflow.__version__, len(list(m.distributions())))"
    proc = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          env={"PYTHONPATH": str(tmp_path)}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    path, version, installed = proc.stdout.split()
    assert Path(path) == tmp_path / "distflow" / "__init__.py" and version == "0+source" and installed == "0"
