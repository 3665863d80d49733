"""Tries from JSON descriptors (happy paths): TokenTreePayload and the RTP-LLM prefix dictionary.

Malformed descriptors are in ``test_bad_inputs.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trie_decode import TokenTrie
from trie_decode.descriptors import read_json, tries_from_token_tree_payload, trie_from_prefix_dict
from trie_decode.errors import DescriptorError

PAYLOAD = {
    "modelId": "smollm2-135m",
    "descriptors": [
        {
            "path": "tools/search",
            "leaves": [
                {"name": "web", "tokens": [12, 7]},
                {"name": "images", "tokens": [12, 8, 3]},
                {"name": "news", "tokens": [4]},
            ],
        },
        {
            "path": "tools/math",
            "leaves": [
                {"name": "add", "tokens": [4, 1]},
                {"name": "add-again", "tokens": [4, 1]},  # a duplicate: merged, first name kept
                {"name": "a", "tokens": [4]},
            ],
        },
    ],
}

# A complete dict: every candidate has a key, entries end with the end token (strict mode accepts it).
RTP = {
    "start_token_id": 225,
    "end_token_id": 2,
    "sep": "_",
    "prefix_dict": {"225": [64000, 64003], "225_64000": [2], "225_64003": [64001], "225_64003_64001": [2]},
}


def _check_payload_tries(tries):
    assert list(tries) == ["tools/search", "tools/math"]
    search, math = tries["tools/search"], tries["tools/math"]
    assert search.sequences() == [(12, 7), (12, 8, 3), (4,)]
    assert search.names() == ["web", "images", "news"]
    assert search.lookup([12, 8, 3]).name == "images"
    assert search.lookup([12, 8]) is None
    assert search.children(search.root)[0].tolist() == [4, 12]
    assert search.forced_run(search.walk([12, 8])) == [3]
    assert math.sequences() == [(4, 1), (4,)]
    assert math.names() == ["add", "a"]
    assert math.num_duplicates == 1
    assert math.is_terminal(math.walk([4])) and math.children(math.walk([4]))[0].tolist() == [1]
    for trie in (search, math):
        trie.validate()
        assert trie.vocab_size == 70000 and trie.fingerprint == "fp-1"
    assert search.options == {"source": "TokenTreePayload", "path": "tools/search", "modelId": "smollm2-135m"}


def test_token_tree_payload_from_dict():
    _check_payload_tries(tries_from_token_tree_payload(PAYLOAD, 70000, fingerprint="fp-1"))


def test_token_tree_payload_from_text_bytes_and_files(tmp_path):
    text = json.dumps(PAYLOAD)
    (tmp_path / "p.json").write_text(text, encoding="utf-8")
    for source in (text, "\n  " + text, text.encode(), tmp_path / "p.json", str(tmp_path / "p.json")):
        _check_payload_tries(tries_from_token_tree_payload(source, 70000, fingerprint="fp-1"))


def test_token_tree_payload_without_model_id_and_unicode_names():
    payload = {"descriptors": [{"path": "p", "leaves": [{"name": "Zürich 東京", "tokens": [1]}]}]}
    (trie,) = tries_from_token_tree_payload(payload, 2).values()
    assert trie.names() == ["Zürich 東京"] and trie.options["modelId"] is None


def test_prefix_dict_docstring_example():
    trie = trie_from_prefix_dict(RTP, 70000, fingerprint="fp")
    # The start token (225) is the prompt's last token and the end token (2) marks the end: neither is an entry token.
    assert sorted(trie.sequences()) == [(64000,), (64003, 64001)]
    assert trie.children(trie.root)[0].tolist() == [64000, 64003]
    assert trie.forced_run(trie.walk([64003])) == [64001]
    assert trie.lookup([64003]) is None
    assert trie.lookup([64000]).name is None
    assert trie.walk([225]) == -1 and trie.walk([64000, 2]) == -1
    assert trie.fingerprint == "fp"
    assert trie.options == {
        "source": "rtp_llm_prefix_dict", "start_token_id": 225, "end_token_id": 2, "sep": "_", "strict": False
    }
    trie.validate()
    assert trie_from_prefix_dict(RTP, 70000, strict=True).options["strict"] is True


def test_prefix_dict_entry_that_is_a_prefix_of_another():
    data = {
        "start_token_id": 1,
        "end_token_id": 0,
        "prefix_dict": {"1": [5, 7], "1_5": [0, 6], "1_5_6": [0, 9], "1_5_6_9": [0], "1_7": [0]},
    }
    trie = trie_from_prefix_dict(data, 10)
    assert sorted(trie.sequences()) == [(5,), (5, 6), (5, 6, 9), (7,)]
    five = trie.walk([5])
    assert trie.is_terminal(five) and trie.children(five)[0].tolist() == [6]
    assert trie.forced_run(five) == []  # an entry ends here: the model may stop or go on
    assert trie.options["sep"] == "_"  # the default


def test_prefix_dict_with_another_separator_and_repeated_candidates():
    data = {
        "start_token_id": 9,
        "end_token_id": 8,
        "sep": ",",
        "prefix_dict": {"9": [3, 3, 4], "9,3": [8, 8], "9,4": [1], "9,4,1": [8]},
    }
    trie = trie_from_prefix_dict(json.dumps(data), 10)
    assert sorted(trie.sequences()) == [(3,), (4, 1)]
    assert trie.num_duplicates == 0


def test_prefix_dict_does_not_explode_on_repeated_candidates():
    # Each level repeats its candidate 4 times: walking every repetition would visit 4**30 paths.
    depth = 30
    prefix_dict = {"0" + "".join(f"_{t}" for t in range(1, d + 1)): [d + 1] * 4 for d in range(depth)}
    prefix_dict["0" + "".join(f"_{t}" for t in range(1, depth + 1))] = [99] * 4
    trie = trie_from_prefix_dict({"start_token_id": 0, "end_token_id": 99, "prefix_dict": prefix_dict}, 100)
    assert trie.sequences() == [tuple(range(1, depth + 1))]


def test_prefix_dict_candidates_without_keys_end_there():
    # RTP-LLM's real dicts list most candidates without a key of their own: after such a candidate RTP-LLM allows
    # only the end token, so the candidate ends an entry. A key with [] allows only the end token as well.
    data = {
        "start_token_id": 225,
        "end_token_id": 2,
        "prefix_dict": {"225": [64000, 64003, 64006], "225_64003": [64001, 64004], "225_64006": []},
    }
    trie = trie_from_prefix_dict(data, 70000)
    assert sorted(trie.sequences()) == [(64000,), (64003, 64001), (64003, 64004), (64006,)]
    assert trie.lookup([64003]) is None  # "225_64003" does not list the end token


def _to_prefix_dict(trie: TokenTrie, start: int, end: int, sep: str = "_") -> dict:
    """Inverse of trie_from_prefix_dict: one key per node, candidates = children (+ end if terminal)."""
    out = {}
    for node in range(trie.num_nodes):
        key = sep.join(map(str, (start,) + trie.tokens_of(node)))
        out[key] = trie.children(node)[0].tolist() + ([end] if trie.is_terminal(node) else [])
    return {"start_token_id": start, "end_token_id": end, "sep": sep, "prefix_dict": out}


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 20), min_size=1, max_size=6), min_size=1, max_size=25),
    st.sampled_from(["_", "-", "|", "::"]),
)
def test_prefix_dict_round_trip(sequences, sep):
    # Tokens 0..20; the end token 21 and the start token 22 are outside the entries' tokens.
    trie = TokenTrie.from_sequences(sequences, 23)
    rebuilt = trie_from_prefix_dict(_to_prefix_dict(trie, start=22, end=21, sep=sep), 23, strict=True)
    assert set(rebuilt.sequences()) == set(trie.sequences())
    for name in ("child_ptr", "token", "level_ptr"):
        assert getattr(rebuilt, name).tolist() == getattr(trie, name).tolist()


def test_read_json_accepts_parsed_objects_text_and_paths(tmp_path):
    assert read_json({"a": 1}, "x") == {"a": 1}
    assert read_json([1], "x") == [1]
    assert read_json('{"a": 1}', "x") == {"a": 1}
    assert read_json(b'[1, 2]', "x") == [1, 2]
    path = tmp_path / "f.json"
    path.write_text('{"b": 2}')
    assert read_json(path, "x") == {"b": 2}
    assert read_json(str(path), "x") == {"b": 2}


def test_read_json_names_text_that_is_not_utf8_or_nested_too_deeply(tmp_path):
    # these raised UnicodeDecodeError and RecursionError from the json module instead of a DescriptorError
    from trie_decode.errors import DescriptorError

    path = tmp_path / "latin1.json"
    path.write_bytes('{"name": "Zürich"}'.encode("latin-1"))
    for source in (b'{"a": "\xff"}', path, str(path)):
        with pytest.raises(DescriptorError, match="prefix dict: not UTF-8 text"):
            trie_from_prefix_dict(source, vocab_size=10)
    with pytest.raises(DescriptorError, match="TokenTreePayload: invalid JSON .nested too deeply"):
        tries_from_token_tree_payload("[" * 100_000 + "]" * 100_000, vocab_size=10)


@pytest.mark.parametrize("vocab", [23, 100])
def test_descriptor_tries_save_and_load(tmp_path, vocab):
    tries = tries_from_token_tree_payload(
        {"descriptors": [{"path": "p", "leaves": [{"name": "x", "tokens": [22, 0]}, {"name": "y", "tokens": [1]}]}]},
        vocab,
    )
    tries["p"].save(tmp_path / "p.safetensors")
    loaded = TokenTrie.load(Path(tmp_path / "p.safetensors"))
    assert loaded.names() == ["x", "y"] and loaded.options["path"] == "p"


def test_a_bad_vocab_size_is_named_as_itself_not_as_a_leaf_problem():
    # Was: "TokenTreePayload: descriptor 'p', leaves as entries: vocab_size must be ...".
    from trie_decode import InvalidTokenError

    payload = {"descriptors": [{"path": "p", "leaves": [{"name": "a", "tokens": [1]}]}]}
    with pytest.raises(InvalidTokenError, match=r"^vocab_size must be an integer in \[1, 2\*\*31\], got -1$"):
        tries_from_token_tree_payload(payload, -1)


def test_a_model_id_json_cannot_hold_is_named_as_the_payloads_field():
    """A payload built in Python with a numpy or set ``modelId`` was refused as "leaves as entries: options['modelId']
    ... which JSON cannot hold": neither the leaves nor an ``options`` argument (the function has none) were the
    problem. The payload's field is named now."""
    import numpy as np

    from trie_decode import DescriptorError

    for model_id in (np.int64(3), {"smollm2"}):
        payload = {"modelId": model_id, "descriptors": [{"path": "p", "leaves": [{"name": "a", "tokens": [1]}]}]}
        with pytest.raises(DescriptorError, match=r"^TokenTreePayload: 'modelId' is (int64|set) .*not JSON") as info:
            tries_from_token_tree_payload(payload, 8)
        assert "options" not in str(info.value)


@pytest.mark.parametrize("strict", ["no", "false", 0, None])
def test_prefix_dict_strict_is_a_bool(strict):
    # strict="no" was truthy, so it ran the strict checks; 0 and None read as False without a word.
    with pytest.raises(DescriptorError, match=f"strict must be True or False, got {type(strict).__name__}"):
        trie_from_prefix_dict({"start_token_id": 0, "end_token_id": 2, "prefix_dict": {"0": [1]}}, 4, strict=strict)
