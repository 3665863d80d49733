"""The docstring examples of the public API run, and say what they show (doctest of every core module).

The integrations' examples that need a model (``TrieLogitsProcessor``) are covered by the README and docs tests
(tests/test_docs.py), which run the same code end to end.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import trie_decode

MODULES = sorted(
    m.name for m in pkgutil.walk_packages(trie_decode.__path__, "trie_decode.")
    if not m.name.startswith(("trie_decode.integrations", "trie_decode._kernel"))
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) of {name} failed"


def test_the_core_api_has_examples():
    """The modules users call directly each show at least one example."""
    for name in ("trie_decode.trie", "trie_decode.constraint", "trie_decode.options", "trie_decode.spans"):
        assert doctest.testmod(importlib.import_module(name)).attempted > 0, name
