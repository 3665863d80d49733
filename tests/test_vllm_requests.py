"""Inline string tries in vLLM requests take the same tokenization options as ``TokenTrie.from_strings`` (forms,
a context, Unicode normalization), checked at admission with named errors. No engine: the resolver directly."""

from __future__ import annotations

import pytest

import vllm  # noqa: F401  (make venv installs it: a missing vLLM fails the suite)

from trie_decode import TokenTrie
from trie_decode.integrations.vllm_requests import TrieRequestError, TrieResolver, parse_trie_request, trie_args

NAMES = ["France", "Japan", "Côte d'Ivoire"]


@pytest.fixture(scope="module")
def resolver(tokenizer):
    return TrieResolver(tokenizer)


@pytest.mark.parametrize("options, kwargs", [
    (dict(context="The answer is"), dict(context="The answer is")),
    (dict(context=["The answer is", "Answer:\n"]), dict(context=["The answer is", "Answer:\n"])),
    (dict(leading_space=[True, False]), dict(leading_space=[True, False])),
    (dict(leading_space=True, normalize="NFD"), dict(leading_space=True, normalize="NFD")),
])
def test_inline_strings_are_the_python_builders_trie(resolver, tokenizer, options, kwargs):
    req = parse_trie_request(trie_args(NAMES, **options))
    trie, _ = resolver.resolve(req)
    ref = TokenTrie.from_strings(NAMES, tokenizer, **kwargs)
    assert trie.sequences() == ref.sequences() and trie.options == ref.options
    assert req.trie_key() != parse_trie_request(trie_args(NAMES)).trie_key()  # forms are part of the cache key


@pytest.mark.parametrize("extra, message", [
    ({"trie": [[1, 2]], "context": "x"}, "apply only to an inline list of strings"),
    ({"trie": NAMES, "context": ""}, "must be a non-empty string"),
    ({"trie": NAMES, "context": []}, "must be a non-empty string"),
    ({"trie": NAMES, "leading_space": []}, "empty list"),
    ({"trie": NAMES, "leading_space": [True, "no"]}, "must be a boolean"),
    ({"trie": NAMES, "normalize": "NFX"}, r"extra_args\['normalize'\] must be one of"),
    ({"trie": NAMES, "context": [f"c{i}" for i in range(9)]}, "over the limit of 8"),
])
def test_bad_tokenization_options_are_named(extra, message):
    with pytest.raises(TrieRequestError, match=message):
        parse_trie_request(extra)


def test_a_context_that_merges_with_the_entries_is_refused_with_the_fix(resolver):
    req = parse_trie_request({"trie": NAMES, "context": "The answer is "})
    with pytest.raises(TrieRequestError, match=r"extra_args\['trie'\]: context 'The answer is ' .*rstrip"):
        resolver.admit(req)
