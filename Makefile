# Two set-up commands for a fresh machine: `make demo` (the main job) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU build of torch that lies on this machine's disk; pinned so that no dependency pulls a
# multi-GB CUDA build. Override on GPU machines: make TORCH_SPEC=torch==2.7.0 ...
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv demo test clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile scripts/check_imports.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" -e ".[dev,benchmarks]" "$(TORCH_SPEC)"
	# NOTE: litdata pulls torchvision, whose PyPI build fails to import beside the pinned torch and
	# then breaks `import lightning`; nothing here needs torchvision, so it goes.
	$(PY) -m pip uninstall -q -y torchvision || true
	$(PY) scripts/check_imports.py
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

demo: $(STAMP)
	$(PY) -m moe_lit.cli demo

clean:
	rm -rf $(VENV)
