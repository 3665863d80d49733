"""The same bad allow/deny filter is refused alike by the transformers front door (``TrieLogitsProcessor``'s
``allow=``/``deny=``) and by a vLLM request (``extra_args['allow']``/``['deny']``, parsed and resolved as the
front-end admits it; no engine): one rule per problem (:mod:`trie_decode.filters`, :mod:`trie_decode.options`), one
error class per problem, and one message but for the option's name. They used to differ: a vLLM request's errors were
all ``TrieRequestError``, an empty allow filter had two wordings, a number was a bare ``TypeError`` in transformers and
a string was "invalid JSON" in vLLM. A vLLM refusal stays a ``TrieRequestError`` too (its HTTP 400)."""

from __future__ import annotations

import pickle
import re

import pytest
import torch

from trie_decode import TokenTrie
from trie_decode.errors import EmptyFilterError, FilterModeError, FilterSpecError, UnknownEntryError
from trie_decode.integrations.transformers import TrieLogitsProcessor
from trie_decode.integrations.vllm_requests import TrieRequestError, TrieResolver, parse_trie_request

NAMES = ["France", "Japan", "Chile"]
KINDS = (FilterSpecError, UnknownEntryError, FilterModeError, EmptyFilterError)


@pytest.fixture(scope="module")
def doors(tokenizer):
    """The two front doors, each a function of the filter options that raises what it refuses."""
    trie = TokenTrie.from_strings(NAMES, tokenizer)
    resolver = TrieResolver(tokenizer)

    def transformers(**options):
        TrieLogitsProcessor(trie, tokenizer, **options)

    def vllm(**options):
        req = parse_trie_request({"trie": NAMES, **options})
        resolver.filters(req, resolver.resolve(req)[0])

    return transformers, vllm


def _refusal(call, **options) -> Exception:
    with pytest.raises(Exception) as info:
        call(**options)
    return info.value


@pytest.mark.parametrize("options, kind", [
    (dict(allow=["Italy"]), UnknownEntryError),
    (dict(deny=[7]), UnknownEntryError),
    (dict(allow=["Japan", -1]), UnknownEntryError),
    (dict(allow=[True]), FilterSpecError),
    (dict(deny=["Japan", 1.5]), FilterSpecError),
    (dict(deny=["Japan", None]), FilterSpecError),
    (dict(deny="Japan"), FilterSpecError),
    (dict(allow=5), FilterSpecError),
    (dict(allow=torch.tensor([0, 1])), FilterSpecError),
    (dict(deny=["Japan"], on_complete="release"), FilterModeError),
    (dict(allow=[]), EmptyFilterError),
    (dict(allow=["Japan"], deny=["Japan", 0]), EmptyFilterError),
    (dict(deny=["Japan", 2**63]), UnknownEntryError),
], ids=["unknown-key", "index-out-of-range", "negative-index", "bool", "float", "none", "string", "number", "tensor",
        "release", "empty-allow", "allow-all-denied", "index-past-int64"])
def test_a_bad_filter_gets_one_error_at_both_front_doors(doors, options, kind):
    transformers, vllm = doors
    here, there = _refusal(transformers, **options), _refusal(vllm, **options)
    assert type(here) is kind, repr(here)
    assert [k for k in KINDS if isinstance(there, k)] == [kind] and type(there).__name__ == kind.__name__, repr(there)
    assert isinstance(there, TrieRequestError)  # still the request's refusal (an HTTP 400)
    assert re.search(r"\bextra_args\['(allow|deny)'\]", str(there)), str(there)  # the option the client sent
    assert re.sub(r"extra_args\['(\w+)'\]", r"\1", str(there)) == str(here)  # the same message otherwise


def test_both_front_doors_take_a_deny_filter_of_every_entry(doors):
    """The empty-filter rule is about allow: a row whose every entry is denied can only end, at both doors."""
    for door in doors:
        door(deny=[0, 1, 2])


def test_a_vllm_refusal_pickles_as_what_it_is(doors):
    """A refusal that is both a problem's class and ``TrieRequestError`` crosses a process boundary unchanged."""
    for options in (dict(allow=["Italy"]), dict(allow=5)):
        error = _refusal(doors[1], **options)
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error) and str(again) == str(error) and isinstance(again, TrieRequestError)
    assert isinstance(error, TypeError) and isinstance(error, ValueError)  # a spec error is both built-ins


def test_keys_on_a_trie_without_keys_or_names_name_the_option():
    """A trie built from bare token sequences has no keys: a filter that names one says which option did."""
    from trie_decode.errors import ConstraintConfigError

    trie = TokenTrie.from_sequences([[5], [6]], vocab_size=10)
    with pytest.raises(ConstraintConfigError, match=r"^deny: this trie has neither keys nor names: filter by entry"):
        TrieLogitsProcessor(trie, end_token_id=0, deny=["x"])
    TrieLogitsProcessor(trie, end_token_id=0, deny=[1])  # by index


def test_a_uint64_index_past_int64_is_named_as_it_was_sent(tokenizer):
    """A uint64 array's index of 2**63 or more wrapped to a negative one, which the error named instead."""
    import numpy as np

    with pytest.raises(UnknownEntryError, match=f"entry index {2**64 - 1} is outside"):
        TrieLogitsProcessor(TokenTrie.from_strings(NAMES, tokenizer), tokenizer, deny=np.array([0, 2**64 - 1], np.uint64))
