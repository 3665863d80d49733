"""Bad inputs, one by one: each raises its named error class, and the message names the problem.

Duplicates are not bad input: they are merged and counted (see the last tests).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from trie_decode.descriptors import tries_from_token_tree_payload, trie_from_prefix_dict
from trie_decode import (
    DescriptorError,
    EmptyTrieError,
    InvalidEntryError,
    InvalidTokenError,
    TokenTrie,
    TrieDecodeError,
)


def _raises(error, pattern, func, *args, **kwargs):
    with pytest.raises(error) as info:
        func(*args, **kwargs)
    assert re.search(pattern, str(info.value)), f"message {str(info.value)!r} does not match {pattern!r}"
    assert isinstance(info.value, TrieDecodeError)
    return info.value


# ------------------------------------------------------------------ from_sequences


@pytest.mark.parametrize("empty", [[], (), np.zeros((0, 3), dtype=np.int64), iter([])])
def test_empty_set(empty):
    _raises(EmptyTrieError, "set of entries is empty", TokenTrie.from_sequences, empty, 10)


def test_empty_error_is_a_value_error():
    with pytest.raises(ValueError):
        TokenTrie.from_sequences([], 10)


@pytest.mark.parametrize(
    "sequences, pattern",
    [
        ([[1, 2], [3, -1]], r"entry 1 has token id -1, outside the vocabulary \[0, 10\)"),
        ([[-5]], r"entry 0 has token id -5"),
        ([[1], [2], [3, 4, 10]], r"entry 2 has token id 10, outside the vocabulary \[0, 10\)"),
        ([[1], [99999]], r"entry 1 has token id 99999"),
        (np.array([[1, 2], [3, 12]]), r"entry 1 has token id 12"),
        ([np.array([1, 2], dtype=np.uint8), np.array([250], dtype=np.uint8)], r"entry 1 has token id 250"),
        ([[1], [2**63 + 5]], r"entry 1 has token id 9223372036854775813, outside any vocabulary"),
        ([[1], [2**70]], r"entry 1 has token id 1180591620717411303424, outside any vocabulary"),
        ([[1], np.array([2**64 - 1], dtype=np.uint64)], r"entry 1 has token id 18446744073709551615"),
    ],
    ids=["negative", "negative-first", "equal-to-vocab", "far-above", "2d-array", "uint8", "2**63", "2**70", "uint64"],
)
def test_token_outside_the_vocabulary(sequences, pattern):
    err = _raises(InvalidTokenError, pattern, TokenTrie.from_sequences, sequences, 10)
    assert isinstance(err, ValueError)


@pytest.mark.parametrize(
    "sequences, pattern",
    [
        ([[1, 2], [3, 4.0]], r"entry 1 has 4\.0 \(float\)"),
        ([[1.5]], r"entry 0 has 1\.5 \(float\)"),
        ([[1], [2, "3"]], r"entry 1 has '3' \(str\)"),
        ([[1], [2, None]], r"entry 1 has None \(NoneType\)"),
        ([[1], [True, 2]], r"entry 1 has True \(bool\)"),  # numpy would silently turn it into 1
        ([[1], [np.True_, 2]], r"entry 1 has .*True.* \(bool\)"),
        ([[False]], r"entry 0 has False \(bool\)"),
        ([[1], [2, [3, 4]]], r"entry 1 has \[3, 4\] \(list\)"),  # nested, inhomogeneous
        ([[1, 2], [[3, 4]]], r"entry 1 has \[3, 4\] \(list\)"),
        ([np.array([1.0, 2.0])], r"entry 0 has .*1\.0.* \(float64\)"),
        (np.array([[1.0, 2.0]]), r"token ids must be integers, got dtype float64"),
        (np.array([[True, False]]), r"token ids must be integers, got dtype bool"),
    ],
    ids=["float", "float-only", "str", "none", "bool", "np-bool", "bool-only", "nested", "nested-2", "float-rows",
         "2d-float", "2d-bool"],
)
def test_non_integer_token_ids(sequences, pattern):
    _raises(InvalidTokenError, r"token ids must be integers", TokenTrie.from_sequences, sequences, 10)
    _raises(InvalidTokenError, pattern, TokenTrie.from_sequences, sequences, 10)


def test_non_integer_torch_ids():
    import torch

    _raises(InvalidTokenError, r"entry 1 has tensor\(2\.\) \(Tensor\)", TokenTrie.from_sequences,
            [torch.tensor([1]), torch.tensor([2.0])], 10)
    # A dtype numpy has no counterpart for is named too (numpy's conversion fails on it).
    _raises(InvalidTokenError, r"token ids must be integers, got dtype torch\.bfloat16", TokenTrie.from_sequences,
            torch.tensor([[1, 2]], dtype=torch.bfloat16), 10)


@pytest.mark.parametrize(
    "make, pattern",
    [
        # One tokenized entry as a tensor: its rows are 0-d tensors, whose len() fails inside torch.
        (lambda torch: torch.tensor([1, 2, 3]), r"got a 1-D Tensor \(one sequence: wrap it in a list, \[ids\]\)"),
        (lambda torch: list(torch.tensor([1, 2])), r"entry 0 is Tensor tensor\(1\), not a sequence of token ids"),
        (lambda torch: [np.array(3)], r"entry 0 is ndarray array\(3\), not a sequence of token ids"),
        # Sets and dicts have a length, but a set has no order and a dict gives its keys: never a silent trie.
        (lambda torch: [[1], {5, 3}], r"entry 1 is set \{3, 5\}, not a sequence of token ids \(a set has no order"),
        (lambda torch: [frozenset([9, 1])], r"entry 0 is frozenset .*a set has no order"),
        (lambda torch: [{1: 2}], r"entry 0 is dict \{1: 2\}, not a sequence .*a dict gives its keys"),
        (lambda torch: {"France": [1, 2]}, r"got a dict: pass its values, list\(d\.values\(\)\)"),
    ],
    ids=["1d-tensor", "0d-tensor-rows", "0d-array-row", "set-row", "frozenset-row", "dict-row", "dict"],
)
def test_rows_that_are_no_sequence_of_ids_are_named(make, pattern):
    import torch

    err = _raises(InvalidEntryError, pattern, TokenTrie.from_sequences, make(torch), 10)
    assert isinstance(err, TypeError)


@pytest.mark.parametrize(
    "sequences, pattern",
    [
        ([[1], 3], r"entry 1 is int 3, not a sequence of token ids"),
        ([[1], "ab"], r"entry 1 is str 'ab', not a sequence of token ids .*from_strings"),
        (["France", "Spain"], r"entry 0 is str 'France'"),
        ([[1], b"ab"], r"entry 1 is bytes b'ab'"),
        ([[1], None], r"entry 1 is NoneType None"),
        ([[1], 2.5], r"entry 1 is float 2\.5"),
        ([np.int64(4)], r"entry 0 is int64 (np.int64\(4\)|4), not a sequence"),
        # One sequence, not a collection of them:
        (np.array([1, 2, 3]), r"got a 1-D ndarray \(one sequence: wrap it in a list, \[ids\]\)"),
        ("abc", r"got a single string"),
        (b"abc", r"got a single string"),
        (5, r"expected a collection of token-id sequences, got int"),
        (None, r"got NoneType"),
    ],
    ids=["int", "str", "strings", "bytes", "none", "float", "np-int", "1d-array", "single-str", "single-bytes",
         "bare-int", "bare-none"],
)
def test_entry_that_is_not_a_sequence(sequences, pattern):
    err = _raises(InvalidEntryError, pattern, TokenTrie.from_sequences, sequences, 10)
    assert isinstance(err, TypeError)


@pytest.mark.parametrize(
    "sequences, pattern",
    [
        ([[1], [], [2]], r"entry 1 has no tokens"),
        ([()], r"entry 0 has no tokens"),
        ([[1], [2], np.array([], dtype=np.int64)], r"entry 2 has no tokens"),
        (np.zeros((3, 0), dtype=np.int64), r"entry 0 has no tokens"),
    ],
)
def test_empty_entry(sequences, pattern):
    _raises(InvalidEntryError, pattern, TokenTrie.from_sequences, sequences, 10)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(names=["a"]), r"names has 1 items but there are 2 sequences"),
        (dict(names=["a", "b", "c"]), r"names has 3 items but there are 2 sequences"),
        (dict(keys=[]), r"keys has 0 items but there are 2 sequences"),
        (dict(names=["a", "b"], keys=[1, 2, 3]), r"keys has 3 items"),
    ],
)
def test_names_or_keys_of_the_wrong_length(kwargs, pattern):
    _raises(InvalidEntryError, pattern, TokenTrie.from_sequences, [[1], [2]], 10, **kwargs)


@pytest.mark.parametrize("vocab_size", [0, -1, 1.5, 10.0, "10", None, True, 2**31 + 1, 2**40])
def test_invalid_vocab_size(vocab_size):
    _raises(InvalidTokenError, rf"vocab_size must be an integer in \[1, 2\*\*31\], got {re.escape(repr(vocab_size))}",
            TokenTrie.from_sequences, [[0]], vocab_size)


def test_largest_vocab_size_is_accepted():
    trie = TokenTrie.from_sequences([[2**31 - 1], [0]], 2**31)
    assert trie.sequences() == [(2**31 - 1,), (0,)]  # stored as int32 without wrapping around


# ------------------------------------------------------------------ from_strings


class _NeverCalled:
    """Stands in for a tokenizer: the input checks must fire before any tokenization."""

    def __call__(self, *args, **kwargs):
        raise AssertionError("the tokenizer must not be called on bad input")

    def get_vocab(self):
        raise AssertionError("the tokenizer must not be called on bad input")


@pytest.mark.parametrize(
    "strings, error, pattern",
    [
        (["France", ""], InvalidEntryError, r"entry 1 is the empty string"),
        ([""], InvalidEntryError, r"entry 0 is the empty string"),
        (["France", 3], InvalidEntryError, r"entry 1 is int 3, not a string"),
        (["France", None], InvalidEntryError, r"entry 1 is NoneType None, not a string"),
        ([b"France"], InvalidEntryError, r"entry 0 is bytes b'France', not a string"),
        ([["France"]], InvalidEntryError, r"entry 0 is list \['France'\], not a string"),
        ("France", InvalidEntryError, r"expected a collection of strings, got a single string"),
        ([], EmptyTrieError, r"set of entries is empty"),
    ],
)
def test_from_strings_bad_input(strings, error, pattern):
    _raises(error, pattern, TokenTrie.from_strings, strings, _NeverCalled())


# ------------------------------------------------------------------ TokenTreePayload


def _payload(*descriptors):
    return {"modelId": "m", "descriptors": list(descriptors)}


GOOD_LEAF = {"name": "ok", "tokens": [1, 2]}


@pytest.mark.parametrize(
    "payload, pattern",
    [
        ([GOOD_LEAF], r"TokenTreePayload must be a JSON object, got list"),
        ("[1, 2]", r"TokenTreePayload must be a JSON object, got list"),
        ({"modelId": "m"}, r"field 'descriptors' is missing"),
        ({"descriptors": []}, r"'descriptors' is missing or is not a non-empty list"),
        ({"descriptors": {"path": "p"}}, r"'descriptors' is missing or is not a non-empty list"),
        (_payload("p"), r"descriptors\[0\] is not an object"),
        (_payload({"leaves": [GOOD_LEAF]}), r"descriptors\[0\] has no 'path' string"),
        (_payload({"path": "", "leaves": [GOOD_LEAF]}), r"descriptors\[0\] has no 'path' string"),
        (_payload({"path": 7, "leaves": [GOOD_LEAF]}), r"descriptors\[0\] has no 'path' string"),
        (_payload({"path": "p"}), r"descriptor 'p' has no leaves"),
        (_payload({"path": "p", "leaves": None}), r"descriptor 'p' has no leaves"),
        (_payload({"path": "p", "leaves": []}), r"descriptor 'p' has no leaves"),
        (_payload({"path": "p", "leaves": {"name": "x"}}), r"descriptor 'p' has no leaves"),
        (_payload({"path": "p", "leaves": [GOOD_LEAF, "x"]}), r"descriptor 'p' leaves\[1\] is not an object"),
        (_payload({"path": "p", "leaves": [{"tokens": [1]}]}), r"descriptor 'p' leaves\[0\] has no 'name' string"),
        (_payload({"path": "p", "leaves": [{"name": 5, "tokens": [1]}]}), r"leaves\[0\] has no 'name' string"),
        (_payload({"path": "p", "leaves": [GOOD_LEAF, {"name": "w"}]}), r"leaves\[1\] \('w'\) has no 'tokens'"),
        (_payload({"path": "p", "leaves": [{"name": "w", "tokens": []}]}), r"\('w'\) has an empty 'tokens' list"),
        (_payload({"path": "p", "leaves": [{"name": "w", "tokens": 3}]}), r"'tokens' must be a list of token ids"),
        (_payload({"path": "p", "leaves": [{"name": "w", "tokens": [1, "2"]}]}), r"holds '2', not an integer"),
        (_payload({"path": "p", "leaves": [{"name": "w", "tokens": [1, 2.0]}]}), r"holds 2\.0, not an integer"),
        (_payload({"path": "p", "leaves": [{"name": "w", "tokens": [True]}]}), r"holds True, not an integer"),
        (_payload({"path": "p", "leaves": [{"name": "w", "tokens": [None]}]}), r"holds None, not an integer"),
        (
            _payload({"path": "p", "leaves": [GOOD_LEAF]}, {"path": "q", "leaves": [GOOD_LEAF]},
                     {"path": "p", "leaves": [GOOD_LEAF]}),
            r"path 'p' appears twice \(descriptors\[2\]\)",
        ),
        ('{"descriptors": [', r"TokenTreePayload: invalid JSON"),
        ("{not json}", r"TokenTreePayload: invalid JSON"),
        (b"\n{'single': 'quotes'}", r"TokenTreePayload: invalid JSON"),
        ("/no/such/payload.json", r"TokenTreePayload: no such file '/no/such/payload.json'"),
        (42, r"expected a dict, JSON text or a file path, got int"),
    ],
)
def test_token_tree_payload_malformed(payload, pattern):
    _raises(DescriptorError, pattern, tries_from_token_tree_payload, payload, 10)


def test_token_tree_payload_no_leaves_raises_rather_than_returning_nothing():
    # Also when other descriptors are fine: a path with nothing to generate must not silently vanish.
    payload = _payload({"path": "good", "leaves": [GOOD_LEAF]}, {"path": "empty", "leaves": []})
    _raises(DescriptorError, r"descriptor 'empty' has no leaves", tries_from_token_tree_payload, payload, 10)


def test_token_tree_payload_token_outside_the_vocabulary_names_the_descriptor():
    payload = _payload({"path": "tools", "leaves": [GOOD_LEAF, {"name": "big", "tokens": [3, 10]}]})
    _raises(InvalidTokenError, r"descriptor 'tools'.*entry 1 has token id 10, outside the vocabulary \[0, 10\)",
            tries_from_token_tree_payload, payload, 10)
    payload = _payload({"path": "tools", "leaves": [{"name": "neg", "tokens": [-3]}]})
    _raises(InvalidTokenError, r"descriptor 'tools'.*entry 0 has token id -3", tries_from_token_tree_payload,
            payload, 10)


def test_token_tree_payload_built_in_python_takes_numpy_integers():
    # A numpy integer is an integer token id, as in a prefix dict (it was refused as "holds np.int64(7), not an
    # integer token id"); a numpy bool is still not one.
    payload = _payload({"path": "p", "leaves": [{"name": "w", "tokens": [np.int64(7), np.int32(2)]}]})
    assert tries_from_token_tree_payload(payload, 10)["p"].sequences() == [(7, 2)]
    payload = _payload({"path": "p", "leaves": [{"name": "w", "tokens": [np.bool_(True)]}]})
    _raises(DescriptorError, r"holds (np\.)?True_?, not an integer", tries_from_token_tree_payload, payload, 10)


def test_json_with_a_byte_order_mark_reads_and_empty_text_is_named(tmp_path):
    # A byte-order mark was "invalid JSON (Unexpected UTF-8 BOM (decode using utf-8-sig))": a fix no call can take.
    text = json.dumps({"start_token_id": 5, "end_token_id": 2, "prefix_dict": {"5": [1, 3]}})
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    for source in (path, str(path), path.read_bytes(), path.read_text(encoding="utf-8")):
        assert sorted(trie_from_prefix_dict(source, 10).sequences()) == [(1,), (3,)]
    # An empty string was read as the path "." ("no such file '.'").
    _raises(DescriptorError, r"prefix dict: got an empty string, neither JSON text nor a file path",
            trie_from_prefix_dict, " ", 10)


def test_token_tree_payload_invalid_json_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"descriptors": [{"path": "p", "leaves": [')
    _raises(DescriptorError, r"TokenTreePayload: invalid JSON", tries_from_token_tree_payload, path, 10)


# ------------------------------------------------------------------ RTP-LLM prefix dict


def _rtp(prefix_dict, **fields):
    data = {"start_token_id": 1, "end_token_id": 0, "prefix_dict": prefix_dict}
    data.update(fields)
    return data


GOOD_DICT = {"1": [5], "1_5": [0]}


@pytest.mark.parametrize(
    "data, pattern",
    [
        ([1, 2], r"prefix dict must be a JSON object, got list"),
        ({"start_token_id": 1, "end_token_id": 0}, r"field 'prefix_dict' is missing"),
        (_rtp(GOOD_DICT, start_token_id="1"), r"start_token_id must be an integer, got '1'"),
        (_rtp(GOOD_DICT, end_token_id=None), r"end_token_id must be an integer, got None"),
        (_rtp(GOOD_DICT, end_token_id=False), r"end_token_id must be an integer, got False"),
        (_rtp(GOOD_DICT, sep=""), r"'sep' must be a non-empty string, got ''"),
        (_rtp(GOOD_DICT, sep=3), r"'sep' must be a non-empty string, got 3"),
        (_rtp([["1", [5]]]), r"'prefix_dict' must be an object"),
        (_rtp({"1": 5, "1_5": [0]}), r"candidates of '1' must be a list of token ids, got int"),
        (_rtp({"1": [5, "6"], "1_5": [0]}), r"candidates of '1' holds '6', not an integer"),
        ('{"start_token_id": 1,', r"prefix dict: invalid JSON"),
        ("not/a/file.json", r"prefix dict: no such file 'not/a/file.json'"),
    ],
)
def test_prefix_dict_malformed(data, pattern):
    """What RTP-LLM itself refuses to load is refused in both modes."""
    for strict in (False, True):
        _raises(DescriptorError, pattern, trie_from_prefix_dict, data, 10, strict=strict)


def _rtp9(prefix_dict):
    return {"start_token_id": 1, "end_token_id": 9, "prefix_dict": prefix_dict}


@pytest.mark.parametrize(
    "data, pattern",
    [
        (_rtp9({"2": [5], "2_5": [9]}), r"the start key '1' is missing"),
        (_rtp9({"1": [5, 6], "1_5": [9]}), r"candidate 6 of '1' -> '1_6'"),
        (_rtp9({"1": [5], "1_5": [9], "2_5": [9]}), r"not reachable from the start key .*'2_5'"),
        (_rtp9({"1": [5], "1_5": []}), r"keys without a usable candidate .*'1_5'"),
        (_rtp9({"1": [9, 5], "1_5": [9]}), r"end token is allowed right after the start token"),
        (_rtp9({"1": [5, 12], "1_5": [9]}), r"outside the vocabulary \[0, 10\).*'1': 12"),
    ],
)
def test_prefix_dict_strict_names_what_rtp_llm_accepts_silently(data, pattern):
    """RTP-LLM loads these (and so does the default mode, as RTP-LLM reads them: tests/test_rtp_llm.py); strict
    mode names each."""
    trie_from_prefix_dict(data, 10)
    _raises(DescriptorError, r"(?s)\(strict\).*" + pattern, trie_from_prefix_dict, data, 10, strict=True)


# ------------------------------------------------------------------ duplicates are fine


def test_duplicates_are_merged_and_counted_not_rejected():
    trie = TokenTrie.from_sequences([[1, 2], [1, 2], [3], [1, 2]], 10, names=["a", "b", "c", "d"])
    assert trie.num_entries == 2 and trie.stats()["duplicates_merged"] == 2
    assert trie.lookup([1, 2]).name == "a"
    payload = _payload({"path": "p", "leaves": [GOOD_LEAF, dict(GOOD_LEAF, name="again")]})
    trie = tries_from_token_tree_payload(json.dumps(payload), 10)["p"]
    assert trie.num_entries == 1 and trie.num_duplicates == 1 and trie.names() == ["ok"]


# ------------------------------------------------------------------ names, keys and the tokenizer


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(names=[None]), r"names\[0\] is NoneType None: a name is a string"),
    (dict(names=["a", 7]), r"names\[1\] is int 7: a name is a string"),
    (dict(keys=[None]), r"keys\[0\] is None"),
])
def test_a_name_that_is_not_a_string_or_a_none_key_is_refused(kwargs, pattern):
    n = len(next(iter(kwargs.values())))
    _raises(InvalidEntryError, pattern, TokenTrie.from_sequences, [[i + 1] for i in range(n)], 10, **kwargs)


@pytest.mark.parametrize("build, pattern", [
    (lambda: TokenTrie.from_sequences([[1], [2]], 10, names=["a", "b\ud800"]), r"a name .* holds the lone surrogate"),
    (lambda: TokenTrie.from_sequences([[1], [2]], 10, keys=["a", "\udc00b"]), r"a key .* holds the lone surrogate"),
    (lambda: TokenTrie.from_strings(["France", "Fr\ud800ance"], _NeverCalled()), r"entry 1 .* holds the lone surrogate"),
    (lambda: tries_from_token_tree_payload('{"descriptors": [{"path": "p", "leaves": [{"name": "\\ud800", '
                                           '"tokens": [1]}]}]}', 10), r"descriptor 'p'.*a name .* holds the lone surrogate"),
], ids=["name", "key", "from_strings", "payload-leaf-name"])
def test_a_lone_surrogate_is_named_not_a_unicode_error(build, pattern):
    # A JSON "\ud800" escape gives such a string: it is not UTF-8 text, so neither the string tables nor a tokenizer
    # can take it (UnicodeEncodeError, or a TypeError from inside the tokenizer).
    _raises(InvalidEntryError, pattern + r".*not UTF-8 text", build)


def test_a_number_key_is_its_text():
    assert TokenTrie.from_sequences([[1]], 10, keys=[7]).entry(0).key == "7"


@pytest.mark.parametrize("tokenizer", [None, "gpt2", lambda text, **kw: {"input_ids": [1]}],
                         ids=["none", "a name", "a function"])
def test_from_strings_without_a_tokenizer_is_named(tokenizer):
    # a plain function was called with add_special_tokens= and failed with its own TypeError
    _raises(InvalidEntryError, "from_strings needs the model's tokenizer", TokenTrie.from_strings, ["a"], tokenizer)


# ------------------------------------------------------------------ names and keys: one per entry, in order


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(names="ab"), r"names is a single str 'ab': give a list, one name for each of the 2 sequences"),
    (dict(keys="ab"), r"keys is a single str 'ab': give a list, one key for each of the 2 sequences"),
    (dict(keys=b"ab"), r"keys is a single bytes"),
    (dict(names={"a", "b"}), r"names is a set, which has no order of its own"),
    (dict(keys={"a": 1, "b": 2}), r"keys is a dict, which has no order of its own"),
    (dict(keys=7), r"keys is int 7, not a list"),
])
def test_names_or_keys_that_are_no_list_are_named(kwargs, pattern):
    # A single string was read as one name (or key) per character.
    _raises(InvalidEntryError, pattern, TokenTrie.from_sequences, [[1], [2]], 10, **kwargs)


def test_names_and_keys_may_be_any_iterable_as_sequences_may():
    # Was: TypeError "object of type 'generator' has no len()".
    trie = TokenTrie.from_sequences(([i] for i in (1, 2)), 10, names=(s for s in ["a", "b"]),
                                    keys=map(str, [7, 8]))
    assert trie.names() == ["a", "b"] and [trie.entry(i).key for i in range(2)] == ["7", "8"]
    _raises(InvalidEntryError, r"keys has 1 items but there are 2 sequences", TokenTrie.from_sequences, [[1], [2]],
            10, keys=iter(["x"]))
    _raises(InvalidEntryError, r"keys is a single str 'ab': give a list, one key for each of the 1 strings",
            TokenTrie.from_strings, ["France"], _NeverCalled(), keys="ab")


# ------------------------------------------------------------------ lookups take integers only


def test_lookups_refuse_a_float_a_string_or_a_bool():
    trie = TokenTrie.from_sequences([[1, 2], [3], [1, 4]], vocab_size=10)
    # Were: index 1 (a float truncated, a bool read as 1), and -1 for the string token "5".
    for bad in (1.7, "1", True, np.float64(1.0), None):
        _raises(InvalidEntryError, rf"entry {re.escape(repr(bad))} is {type(bad).__name__}, not an integer",
                trie.entry, bad)
        _raises(InvalidEntryError, rf"node .* is {type(bad).__name__}, not an integer", trie.children, bad)
        _raises(InvalidEntryError, r"node .*, not an integer", trie.step, bad, 1)
        _raises(InvalidTokenError, rf"token .* is {type(bad).__name__}, not an integer token id", trie.step, 0, bad)
    _raises(InvalidTokenError, r"token '5' is str", trie.walk, [1, "5"])
    assert trie.entry(np.int64(1)).tokens == (3,) and trie.step(np.int32(0), np.int64(1)) == 1
    assert trie.step(0, np.array(3)) == trie.walk([3]) and trie.children(np.uint8(0))[0].tolist() == [1, 3]
    with pytest.raises(IndexError, match="entry 3 is not in this trie"):
        trie.entry(3)


# ------------------------------------------------------------------ options are JSON


@pytest.mark.parametrize("options, pattern", [
    ({"x": np.int64(3)}, r"options\['x'\] is int64 .*which JSON cannot hold"),
    ({"x": {1, 2}}, r"options\['x'\] is set .*which JSON cannot hold"),
    ({1: "a"}, r"options key 1 is int: the keys of options are strings"),
    ("ab", r"options must be a dict"),
])
def test_options_that_a_file_cannot_hold_are_refused_before_the_build(options, pattern, tmp_path):
    # Was: a plain TypeError from json at save(), after the build.
    _raises(InvalidEntryError, pattern, TokenTrie.from_sequences, [[1]], 10, options=options)
    if isinstance(options, dict):
        trie = TokenTrie.from_sequences([[1]], 10)
        trie.options.update(options)  # changed after the build: save() names it too
        _raises(InvalidEntryError, pattern, trie.save, tmp_path / "t.trie")


# ------------------------------------------------------------------ from_strings: options and forms


def test_on_unstable_without_a_context_is_refused():
    # Was: ignored (the leading-space forms always keep a merging entry's own tokens).
    _raises(InvalidEntryError, r"on_unstable='raw' only applies with a context .*add context='TEXT'",
            TokenTrie.from_strings, ["France"], _NeverCalled(), on_unstable="raw")
    _raises(InvalidEntryError, r"on_unstable='raw' only applies with a context",
            TokenTrie.from_strings, ["France"], _NeverCalled(), leading_space=[True, False], on_unstable="raw")


class _DropsNone:
    """SmolLM2's tokenizer, except that ``"NONE"`` not after a space tokenizes to nothing."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __len__(self):
        return len(self._tokenizer)

    def __call__(self, texts, **kwargs):
        return self._tokenizer([t.replace(" NONE", " none").replace("NONE", "") for t in texts], **kwargs)


def test_a_string_with_no_token_in_a_later_form_is_named_by_its_own_index(tokenizer):
    # Was: "entry 3 has no tokens" (its place among both forms' sequences) for 2 strings.
    _raises(InvalidEntryError, r"entry 1 \('NONE'\) tokenizes to no token at the start of a line",
            TokenTrie.from_strings, ["a", "NONE"], _DropsNone(tokenizer), leading_space=[True, False])
