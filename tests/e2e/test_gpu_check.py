"""bench/gpu_check.sh, the prepared one-GPU check, on the CPU: its dry run with only the GPU image's
packages plus the carried ones (requirements/gpu-check.txt), its pre-flight when one is missing,
and its refusal to run without a usable GPU otherwise. (On a GPU machine it runs the same code on CUDA.)

The GPU image is emulated by a venv of this interpreter whose site-packages links to exactly the
distributions bench/gpu_check_machine.txt names (with what they require, as installed here) and
those of requirements/gpu-check.txt: an import of anything else fails there as it would there."""

import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import zipfile

import pytest
from packaging.requirements import Requirement

from launch_helpers import ROOT

SCRIPT = ROOT / "bench" / "gpu_check.sh"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _names(path) -> list[str]:
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return [_norm(Requirement(line).name) for line in lines if line]


def _machine_venv(folder, carried: bool):
    """A venv with the image's distributions (and their requirements' closure, as installed here)
    and, when `carried`, requirements/gpu-check.txt's (installed there --no-deps: no closure)."""
    have = {_norm(d.metadata["Name"]): d for d in md.distributions()}
    todo = [n for n in _names(ROOT / "bench" / "gpu_check_machine.txt") if n in have]
    chosen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in chosen:
            continue
        chosen.add(name)
        for text in have[name].requires or []:
            req = Requirement(text)
            if (not req.marker or req.marker.evaluate({"extra": ""})) and _norm(req.name) in have:
                todo.append(_norm(req.name))
    assert not chosen & {"hydra-core", "datasets", "distflow"}, "the image would already have them"
    if carried:
        chosen |= set(_names(ROOT / "requirements" / "gpu-check.txt"))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    site = next(folder.glob("lib/python3*/site-packages"))
    for name in sorted(chosen):
        dist = have[name]
        tops = {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "__pycache__")}
        for top in tops:
            src, dst = dist.locate_file(top), site / top
            if os.path.exists(src) and not dst.exists() and not top.endswith(".pth"):
                dst.symlink_to(src)
    return folder / "bin" / "python"


def _wheel(folder, name: str, files: dict[str, str]):
    """A minimal wheel of `files` (no dependencies), as pip builds them."""
    dist = f"{name}-0.0.1"
    path = folder / f"{dist}-py3-none-any.whl"
    folder.mkdir(parents=True, exist_ok=True)
    meta = {f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0.1\n",
            f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    entries = {**files, **meta}
    record = "".join(f"{p},,\n" for p in entries) + f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for p, text in {**entries, f"{dist}.dist-info/RECORD": record}.items():
            z.writestr(p, text)
    return path


def _run(args, python, timeout):
    env = dict(os.environ, PYTHON=str(python), OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_without_a_usable_gpu_it_refuses_and_points_to_the_dry_run(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    (tmp_path / "gpu_check.json").write_text("{}")  # an earlier check's result
    proc = _run(["--out", str(tmp_path)], sys.executable, timeout=120)
    assert proc.returncode == 2
    assert f"gpu_check: error: torch {torch.__version__} (CUDA None) sees no usable GPU; use --dry-run" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the stale result is gone, nothing else written


def test_without_the_carried_packages_the_preflight_names_them_before_any_run(tmp_path):
    python = _machine_venv(tmp_path / "machine", carried=False)
    out = tmp_path / "out"
    proc = _run(["--dry-run", "--out", str(out)], python, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("gpu_check: error: cannot import hydra (No module named 'hydra')"), proc.stderr
    assert "datasets (No module named 'datasets')" in line and "bench/gpu_check_wheels.sh" in line
    assert not (out / "gpu_check.json").exists() and not (out / "models").exists()


def test_dry_run_on_the_image_packages_plus_the_carried_ones_writes_every_figure(tmp_path):
    python = _machine_venv(tmp_path / "machine", carried=True)
    wheels = tmp_path / "wheels"
    _wheel(wheels, "gpu_check_marker", {"gpu_check_marker.py": "CARRIED = True\n"})
    out = tmp_path / "out"
    proc = _run(["--dry-run", "--out", str(out), "--wheels", str(wheels)], python, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "site" / "gpu_check_marker.py").is_file()  # the carried wheel went into --target
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["dry_run"] is True and result["ok"] is True, result["checks"]
    assert result["carried_wheels"] == ["gpu_check_marker-0.0.1-py3-none-any.whl"]
    assert result["machine"]["python_executable"] == str(python)
    assert result["peak_bf16_tflops"] == 989.0 and "H200" in result["peak_source"]
    assert list(result["runs"]) == ["dry_run_shape_bf16", "carryover_dry_run_bf16", "publish_dry_run_bf16"]
    publish = result["runs"]["publish_dry_run_bf16"]  # bench/publish_rate.py on the same packages and weights
    assert publish["rc"] == 0, publish.get("output_tail")
    figures = publish["publish"]
    assert figures["device"] == "cpu" and figures["dtype"] == "bfloat16" and figures["pinned"] is False
    assert figures["bytes"] > 0 and figures["buckets"] >= 1 and figures["tensors"] > 0
    for part in ("pack", "stage_to_host", "host_to_device", "publish"):  # publish: to a second rank, gloo
        assert figures[f"{part}_s"] > 0 and figures[f"{part}_s_per_gib"] > 0, (part, figures)
    assert figures["ranks"] == 2 and figures["receivers"] == 1
    carry = result["runs"]["carryover_dry_run_bf16"]  # bench/carryover.py on the same packages
    assert carry["rc"] == 0 and [s["eta"] for s in carry["summary"]] == [0, 1, 3], carry.get("output_tail")
    assert carry["eta3_generate_ratio"] > 0 and isinstance(carry["goals_met"], bool)
    # bench/carryover.py's own figures (this is the suite's run of that benchmark, at its --smoke sizes)
    modes = {s["eta"]: s for s in carry["summary"]}
    assert modes[0]["generate_ratio"] == 1.0 and modes[0]["carried_tokens"] == 0 and modes[3]["carried_tokens"] > 0
    for s in modes.values():
        assert s["generate_s"] > 0 and s["step_s"] > 0 and s["staleness_max"] <= s["eta"], s
    run = result["runs"]["dry_run_shape_bf16"]
    assert run["rc"] == 0 and run["steps"] == 1, run.get("output_tail")
    config = json.loads((out / "models" / "dry_run" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 1024
    assert f"model.path={out / 'models' / 'dry_run'}" in run["overrides"]
    assert run["params"] > 0 and run["update_tokens_per_s"] > 0 and 0 < run["mfu"] < 1
    assert run["generate_tokens_per_s"] > 0 and run["resync_s"] > 0
    assert run["probe_max_abs_logprob_diff"] is not None
    assert set(run["mismatch"]) == {"abs_mean", "abs_p99", "abs_max", "kl"}
    assert all(v is not None for v in run["mismatch"].values())
    assert {"startup:engine", "generate", "logprob", "update", "sync"} <= set(run["memory_per_phase"]["peak_rss_gib"])


def test_a_carried_torch_stops_the_check_before_any_run(tmp_path):
    import torch

    wheels = tmp_path / "wheels"
    _wheel(wheels, "torch", {"torch/__init__.py": "from . import version\n__version__ = '0.0.1'\n",
                             "torch/version.py": "cuda = '99.9'\n"})
    out = tmp_path / "out"
    out.mkdir()
    (out / "gpu_check.json").write_text('{"ok": true}')  # an earlier check's result
    proc = _run(["--dry-run", "--out", str(out), "--wheels", str(wheels)], sys.executable, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"gpu_check: error: after set-up torch is 0.0.1 (CUDA 99.9, {out / 'site' / 'torch' / '__init__.py'}), "
        f"not the machine's {torch.__version__} (CUDA {torch.version.cuda}, {torch.__file__})"), proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["site"]  # no result, no model, no run folder
