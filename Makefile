# Two entry points: `make run` (generate with the default model on CPU) and `make test`.
# Set-up is idempotent: .venv is created once; on a CPU-only machine torch==2.13.0 (the local
# CPU build) is installed first so that nothing pulls multi-GB CUDA wheels; on a machine that
# already has a CUDA torch, the venv inherits it (system site-packages) and keeps it.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.specmla-installed
PROMPT ?= def fibonacci(n):
MAX_TOKENS ?= 64

.PHONY: setup run test clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@if [ ! -x $(VPY) ]; then \
	  if $(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
	    $(PY) -m venv --system-site-packages $(VENV); \
	  else \
	    $(PY) -m venv $(VENV); \
	  fi; \
	fi
	@if ! $(VPY) -c "import torch" 2>/dev/null; then \
	  $(VPY) -m pip install -q torch==2.13.0; \
	fi
	$(VPY) -m pip install -q -e ".[test]"
	@touch $(STAMP)

run: setup
	$(VENV)/bin/specmla generate --prompt "$(PROMPT)" --max-tokens $(MAX_TOKENS)

test: setup
	$(VPY) -m pytest -q -m "not gpu"

clean:
	rm -rf $(VENV) build *.egg-info
