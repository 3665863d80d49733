"""Tries from strings with the real SmolLM2 tokenizer (pycountry names), fingerprints and tokenizer mismatches.

The session ``tokenizer`` fixture is shared: tests that change a tokenizer work on a deep copy.
"""

from __future__ import annotations

import copy

import pytest

from trie_decode import (
    InvalidEntryError,
    TokenizerMismatchError,
    TokenTrie,
    tokenize_strings,
    tokenizer_fingerprint,
    tokenizer_vocab_size,
)


def _ids(tokenizer, texts):
    return tokenizer(list(texts), add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def countries(tokenizer, country_names) -> TokenTrie:
    return TokenTrie.from_strings(country_names, tokenizer)


@pytest.fixture(scope="module")
def spaced_countries(tokenizer, country_names) -> TokenTrie:
    return TokenTrie.from_strings(country_names, tokenizer, leading_space=True)


@pytest.fixture(scope="module")
def other_tokenizer(tokenizer):
    """SmolLM2's tokenizer plus one added token: same ids for every existing token, but another vocabulary."""
    other = copy.deepcopy(tokenizer)
    assert other.add_tokens(["<trie_decode_test_token>"]) == 1
    return other


@pytest.fixture(scope="module")
def tiny_bpe_tokenizer():
    """A word-level-ish BPE tokenizer with a 30-token vocabulary, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = {"[UNK]": 0, **{c: i + 1 for i, c in enumerate(letters)}, "an": 27, "ce": 28, "ra": 29}
    merges = [("a", "n"), ("c", "e"), ("r", "a")]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


def test_every_country_round_trips(tokenizer, country_names, countries):
    assert countries.num_entries == len(country_names) == 249
    assert countries.num_duplicates == 0
    assert countries.vocab_size == tokenizer_vocab_size(tokenizer) == len(tokenizer)
    countries.validate()
    for name, ids in zip(country_names, _ids(tokenizer, country_names)):
        node = countries.walk(ids)
        assert node > 0 and countries.is_terminal(node), name
        entry = countries.entry_at(node)
        assert entry.name == name and entry.tokens == tuple(ids)
        assert countries.lookup(ids) == entry
    assert countries.names() == country_names
    assert countries.options == {"source": "strings", "leading_space": False}


def test_leading_space_changes_the_tokens(tokenizer, country_names, countries, spaced_countries):
    for name in ("France", "Germany", "Japan", "Canada"):
        assert name in country_names
        bare, spaced = _ids(tokenizer, [name, " " + name])
        assert bare[0] != spaced[0], name  # byte-level BPE: "France" and " France" are different tokens
        assert countries.lookup(bare).name == name and countries.lookup(spaced) is None
        assert spaced_countries.lookup(spaced).name == name and spaced_countries.lookup(bare) is None
    first_bare = set(countries.children(countries.root)[0].tolist())
    first_spaced = set(spaced_countries.children(spaced_countries.root)[0].tolist())
    assert first_bare != first_spaced
    for name, ids in zip(country_names, _ids(tokenizer, [" " + n for n in country_names])):
        assert spaced_countries.entry_at(spaced_countries.walk(ids)).name == name
    assert spaced_countries.options["leading_space"] is True


def test_shared_prefixes_branch_in_the_trie(tokenizer, countries):
    # "United States", "United Kingdom", ... share their first tokens: the trie branches after them.
    a, b = _ids(tokenizer, ["United States", "United Kingdom of Great Britain and Northern Ireland"])
    k = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert k >= 1
    node = countries.walk(a[:k])
    assert {a[k], b[k]} <= set(countries.children(node)[0].tolist())


def test_fingerprint_recorded_and_checked(tokenizer, countries, tmp_path):
    fingerprint = tokenizer_fingerprint(tokenizer)
    assert len(fingerprint) == 32 and int(fingerprint, 16) >= 0
    assert countries.fingerprint == fingerprint
    assert countries.stats()["fingerprint"] == fingerprint
    countries.check_tokenizer(tokenizer)
    countries.check_tokenizer(copy.deepcopy(tokenizer))  # an equal vocabulary is the same tokenizer
    countries.save(tmp_path / "c.safetensors")
    loaded = TokenTrie.load(tmp_path / "c.safetensors", tokenizer=tokenizer)
    assert loaded.fingerprint == fingerprint
    assert loaded.names() == countries.names()


def test_another_tokenizer_is_rejected(countries, other_tokenizer, tiny_bpe_tokenizer, tmp_path):
    countries.save(tmp_path / "c.safetensors")
    for other in (other_tokenizer, tiny_bpe_tokenizer):
        assert tokenizer_fingerprint(other) != countries.fingerprint
        with pytest.raises(TokenizerMismatchError, match="rebuild the trie with this tokenizer") as info:
            countries.check_tokenizer(other)
        assert countries.fingerprint in str(info.value) and tokenizer_fingerprint(other) in str(info.value)
        with pytest.raises(TokenizerMismatchError, match="vocabulary fingerprint"):
            TokenTrie.load(tmp_path / "c.safetensors", tokenizer=other)
        with pytest.raises(ValueError):  # callers that only know the built-in errors
            TokenTrie.load(tmp_path / "c.safetensors", tokenizer=other)
    # The mismatch is detected, not hidden by verify=False.
    with pytest.raises(TokenizerMismatchError):
        TokenTrie.load(tmp_path / "c.safetensors", tokenizer=other_tokenizer, verify=False)


def test_fingerprint_follows_added_tokens_on_the_same_object(tokenizer):
    tok = copy.deepcopy(tokenizer)
    trie = TokenTrie.from_strings(["France", "Spain"], tok)  # fingerprints (and caches) tok
    trie.check_tokenizer(tok)
    tok.add_tokens(["<added_after_build>"])
    assert tokenizer_fingerprint(tok) != trie.fingerprint
    with pytest.raises(TokenizerMismatchError):
        trie.check_tokenizer(tok)


def test_trie_for_the_tiny_tokenizer(tiny_bpe_tokenizer, tokenizer):
    trie = TokenTrie.from_strings(["france", "spain", "fran"], tiny_bpe_tokenizer)
    assert trie.vocab_size == 30
    assert trie.lookup(_ids(tiny_bpe_tokenizer, ["france"])[0]).name == "france"
    assert trie.lookup([6, 18, 27, 28]).name == "france"  # f r an ce: "an" merges before "ra"
    assert trie.lookup([6, 18, 27]).name == "fran"
    assert trie.forced_run(trie.walk([6])) == [18, 27]
    trie.check_tokenizer(tiny_bpe_tokenizer)
    with pytest.raises(TokenizerMismatchError):
        trie.check_tokenizer(tokenizer)


def test_trie_without_fingerprint_checks_the_vocabulary_size(tokenizer):
    n = len(tokenizer)
    TokenTrie.from_sequences([[n - 1]], n).check_tokenizer(tokenizer)
    with pytest.raises(TokenizerMismatchError, match=f"token ids up to {n + 9} but the tokenizer has only {n}"):
        TokenTrie.from_sequences([[1, n + 9]], n + 10).check_tokenizer(tokenizer)


def test_a_tokenizer_name_instead_of_a_tokenizer_is_named(tokenizer, tmp_path):
    # A name's len() is its length: without a fingerprint the check read it as a vocabulary size, then failed inside
    # (AttributeError: 'str' object has no attribute 'get_vocab'); with one it was named. Now both are named.
    for trie in (TokenTrie.from_sequences([[1]], 10), TokenTrie.from_strings(["France"], tokenizer)):
        trie.save(tmp_path / "t.trie")
        with pytest.raises(TypeError, match=r"expected a Hugging Face tokenizer with get_vocab\(\), got str"):
            TokenTrie.load(tmp_path / "t.trie", tokenizer="HuggingFaceTB/SmolLM2-135M-Instruct")


def test_language_names(tokenizer, language_names):
    keys = [f"iso-{i}" for i in range(len(language_names))]
    trie = TokenTrie.from_strings(language_names, tokenizer, leading_space=True, keys=keys)
    trie.validate()
    assert trie.num_entries == len(language_names) > 7000
    ids = tokenize_strings(language_names, tokenizer, leading_space=True)
    assert ids == _ids(tokenizer, [" " + n for n in language_names])
    for i in range(0, len(language_names), 7):
        entry = trie.lookup(ids[i])
        assert entry.name == language_names[i] and entry.key == keys[i]
    stats = trie.stats()
    assert 0 < stats["forced_token_share"] < 1
    assert stats["max_depth"] == max(map(len, ids))


def test_duplicate_strings_are_merged(tokenizer):
    trie = TokenTrie.from_strings(["Chad", "Peru", "Chad"], tokenizer, keys=["TD", "PE", "XX"])
    assert trie.num_entries == 2 and trie.num_duplicates == 1
    assert trie.lookup(_ids(tokenizer, ["Chad"])[0]).key == "TD"


# ------------------------------------------------------------------ an entry that merges with its context


def test_context_error_advice_can_be_followed(tokenizer):
    """The fix a ContextError recommends is a keyword from_strings has: on_unstable='raw' keeps the entry's own
    tokens (the ids the model writes after the context's own), and is recorded."""
    from trie_decode.options import FLAGS
    from trie_decode.tokenizers import ContextError

    context = '"country": "'
    with pytest.raises(ContextError, match=r"build with on_unstable='raw'") as info:
        TokenTrie.from_strings(["-hello", "France"], tokenizer, context=context)
    assert "--on-unstable raw" in info.value.message_for(FLAGS)
    trie = TokenTrie.from_strings(["-hello", "France"], tokenizer, context=context, on_unstable="raw")
    assert trie.sequences() == [tuple(_ids(tokenizer, ["-hello"])[0]),
                                tuple(TokenTrie.from_strings(["France"], tokenizer, context=context).sequences()[0])]
    assert trie.options["on_unstable"] == "raw"
    with pytest.raises(InvalidEntryError, match=r"on_unstable must be one of \('raise', 'raw'\), got 'skip'"):
        TokenTrie.from_strings(["France"], tokenizer, on_unstable="skip")


def test_context_error_for_a_trailing_space_names_each_front_door_s_options(tokenizer):
    from trie_decode.options import FLAGS
    from trie_decode.tokenizers import ContextError

    with pytest.raises(ContextError) as info:
        TokenTrie.from_strings(["France"], tokenizer, context="The answer is ")
    assert "context='The answer is' or leading_space=True" in str(info.value)
    assert "--context 'The answer is' or --leading-space" in info.value.message_for(FLAGS)


def test_tokenize_strings_takes_the_fix_its_context_error_names_and_refuses_a_second_form(tokenizer):
    """tokenize_strings(context=...)'s ContextError recommends on_unstable='raw': a keyword it takes; and
    leading_space beside context (one form per string) is refused, not silently dropped."""
    from trie_decode.tokenizers import ContextError

    with pytest.raises(ContextError, match=r"on_unstable='raw'"):
        tokenize_strings(["-hello"], tokenizer, context='"country": "')
    assert tokenize_strings(["-hello"], tokenizer, context='"country": "', on_unstable="raw") == _ids(tokenizer, ["-hello"])
    with pytest.raises(InvalidEntryError, match=r"on_unstable='raw' only applies with a context"):
        tokenize_strings(["France"], tokenizer, on_unstable="raw")
    with pytest.raises(InvalidEntryError, match=r"leading_space=True .*context="):
        tokenize_strings(["Paris"], tokenizer, leading_space=True, context="\n")


def test_a_trie_without_fingerprint_as_wide_as_padded_logits_fits_its_tokenizer(tokenizer):
    """A trie built from ids with vocab_size the model's logits width (wider than the tokenizer: Qwen, 152,064 logits
    for about 151,665 ids) fits the tokenizer; only a token id the tokenizer has not is a mismatch, named as it is."""
    v = len(tokenizer)
    TokenTrie.from_sequences([[5, 6]], vocab_size=v + 64).check_tokenizer(tokenizer)
    with pytest.raises(TokenizerMismatchError, match=f"token ids up to {v + 3} but the tokenizer has only {v} tokens"):
        TokenTrie.from_sequences([[5, v + 3]], vocab_size=v + 64).check_tokenizer(tokenizer)
