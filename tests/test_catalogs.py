"""Semantic-id catalogs: the fast builder equals the generic one node for node (packed and wide codes, any integer
dtype, heavy collisions), keeps every item of a shared id, resolves every item's key in filters and on the matched
entry, and round-trips through the file and the CLI."""

from __future__ import annotations

import numpy as np
import pytest

import torch

from trie_decode import ConstraintConfigError, InvalidEntryError, InvalidTokenError, TokenTrie
from trie_decode.catalogs import catalog_from_codes, item_entries, item_keys_of, items_of
from trie_decode.cli import main
from trie_decode.constraint import SpanRules, TrieConstraint


def _check_against_the_generic_builder(codes, tokens, vocab, **kwargs):
    """Build with catalog_from_codes and compare with TokenTrie.from_sequences of the same tokens: every array, every
    entry's items (in input order, each item once) and keys."""
    n = len(codes)
    keys = [f"item{i}" for i in range(n)]
    trie = catalog_from_codes(codes, vocab_size=vocab, keys=keys, **kwargs)
    trie.validate()
    ref = TokenTrie.from_sequences(tokens, vocab)
    for name in ("child_ptr", "token", "node_entry", "entry_node", "level_ptr"):
        assert np.array_equal(getattr(trie, name), getattr(ref, name)), name
    seen = []
    entry_of = item_entries(trie)
    for e in range(trie.num_entries):
        items = items_of(trie, e)
        assert (np.diff(items) > 0).all()  # input order
        assert all(tuple(tokens[i]) == trie.entry(e).tokens for i in items)
        assert item_keys_of(trie, e) == [f"item{i}" for i in items] and trie.entry(e).key == f"item{items[0]}"
        assert trie.entry(e).item_keys == tuple(item_keys_of(trie, e))
        assert (entry_of[items] == e).all()
        seen += items.tolist()
    assert sorted(seen) == list(range(n)) and trie.num_duplicates == n - trie.num_entries
    return trie


@pytest.mark.parametrize("seed", range(10))
def test_same_trie_as_the_generic_builder_and_every_item_kept(seed):
    rng = np.random.default_rng(seed)
    n, levels, k = int(rng.integers(1, 400)), int(rng.integers(1, 6)), int(rng.integers(1, 7))
    codes = rng.integers(0, k, size=(n, levels))
    if seed % 3 == 1:
        codes = codes.astype(np.uint8 if seed % 2 else np.int32)
    if seed == 9:
        codes = codes.astype(np.uint64)
    tokens = codes.astype(np.int64) + 10 + np.arange(levels) * k
    _check_against_the_generic_builder(codes, tokens, 10 + k * levels, codebook_size=k, token_offset=10)


@pytest.mark.parametrize("seed", range(4))
def test_wide_codes_and_level_offsets_match_the_generic_builder(seed):
    """Codes too wide for one int64 with the item index (the lexsort path), and per-level offsets that overlap."""
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(2, 300))
    if seed % 2 == 0:  # 20 levels x 16 codes: 80 bits
        levels, k = 20, 16
        codes = rng.integers(0, 3, size=(n, levels)) * 7  # few distinct codes per level: many shared prefixes
        tokens = codes + 5 + np.arange(levels) * k
        trie = _check_against_the_generic_builder(codes, tokens, 5 + k * levels, codebook_size=k, token_offset=5)
    else:  # level offsets, all levels on the same tokens; codes up to 3 * 2**29: 3 levels of 31 bits
        codes = rng.integers(0, 4, size=(n, 3)) << 29
        tokens = codes + 3
        _check_against_the_generic_builder(codes, tokens, int(tokens.max()) + 1, level_offsets=[3, 3, 3])


def test_heavy_collisions_and_one_item():
    rng = np.random.default_rng(5)
    codes = rng.integers(0, 2, size=(500, 2))  # 4 distinct ids for 500 items
    trie = _check_against_the_generic_builder(codes, codes + np.array([3, 5]), 7, codebook_size=2, token_offset=3)
    assert trie.num_entries == 4
    _check_against_the_generic_builder(np.array([[2, 0, 1]]), np.array([[2, 3, 7]]), 8, codebook_size=3)


def test_file_and_cli_round_trip(tmp_path, capsys):
    codes = np.array([[3, 1], [3, 2], [3, 1], [0, 5]], dtype=np.int64)
    np.save(tmp_path / "ids.npy", codes)
    (tmp_path / "keys.txt").write_text("a\nb\nc\nd\n")
    out = tmp_path / "items.trie"
    assert main(["build", "--codes", str(tmp_path / "ids.npy"), "--codebook-size", "8", "--token-offset", "100",
                 "--vocab-size", "200", "--keys", str(tmp_path / "keys.txt"), "-o", str(out)]) == 0
    assert "3 distinct ids (1 item shares an id)" in capsys.readouterr().out
    trie = TokenTrie.load(out)
    e = trie.lookup([103, 109]).index
    assert items_of(trie, e).tolist() == [0, 2] and item_keys_of(trie, e) == ["a", "c"]


def test_bad_codes_are_named():
    with pytest.raises(InvalidEntryError, match="2-D integer array"):
        catalog_from_codes(np.zeros(3), codebook_size=4, vocab_size=10)
    with pytest.raises(InvalidEntryError, match="outside its codebook"):
        catalog_from_codes(np.array([[1, 9]]), codebook_size=4, vocab_size=10)
    with pytest.raises(InvalidEntryError, match="negative code"):
        catalog_from_codes(np.array([[1, -1]]), codebook_size=4, vocab_size=10)
    with pytest.raises(InvalidTokenError, match="outside the vocabulary"):
        catalog_from_codes(np.array([[1, 2]]), codebook_size=4, token_offset=5, vocab_size=10)
    with pytest.raises(InvalidEntryError, match="codebook_size"):
        catalog_from_codes(np.array([[1, 2]]), vocab_size=10)
    with pytest.raises(InvalidEntryError, match="2-D integer array .*rows of different lengths"):  # not numpy's error
        catalog_from_codes([[1, 2], [3]], codebook_size=4, vocab_size=10)
    with pytest.raises(InvalidEntryError, match="2-D integer array .*got torch.bfloat16"):  # not torch's TypeError
        catalog_from_codes(torch.zeros((2, 2), dtype=torch.bfloat16), codebook_size=4, vocab_size=10)
    # level_offsets places every level: a codebook_size beside it was ignored, and a code outside it built silently.
    with pytest.raises(InvalidEntryError, match="codebook_size .*or level_offsets, not both"):
        catalog_from_codes(np.array([[1, 9]]), codebook_size=4, level_offsets=[0, 4], vocab_size=20)


@pytest.mark.parametrize("keys, message", [
    (["a", None], r"keys\[1\] is None: a key is a string or a number"),  # not the key "None", as from_sequences
    (["a", "b\ud800"], r"a key .* holds the lone surrogate .*: it is not UTF-8 text"),  # not a UnicodeEncodeError
])
def test_bad_item_keys_are_named(keys, message):
    with pytest.raises(InvalidEntryError, match=message):
        catalog_from_codes(np.array([[1, 2], [0, 3]]), codebook_size=4, vocab_size=10, keys=keys)


def test_every_item_key_filters_its_entry_and_the_entry_lists_them_all(tmp_path):
    """Items 0, 2 and 4 share one id: the entry's key is item 0's, ``item_keys`` lists all three (on lookups, on
    ``match`` results, after a save and load), and a filter by any of their keys applies to that entry."""
    from trie_decode.integrations.transformers import match

    codes = np.array([[3, 1], [3, 2], [3, 1], [0, 5], [3, 1]])  # tokens (103, 109), (103, 110), (100, 113)
    built = catalog_from_codes(codes, codebook_size=8, token_offset=100, vocab_size=200, keys=list("abcde"))
    built.save(tmp_path / "items.trie")
    for trie in (built, TokenTrie.load(tmp_path / "items.trie")):
        shared = trie.lookup([103, 109])
        assert shared.key == "a" and shared.item_keys == ("a", "c", "e")
        assert trie.lookup([100, 113]).item_keys == ("d",)
        assert match(trie, [[103, 109, 1]], end_token_id=1)[0].item_keys == ("a", "c", "e")
        c = TrieConstraint(trie, SpanRules(end_token_id=1), "cpu")

        def reachable(**spec):
            """The entries a row can complete under these filters (every walk through the masks)."""
            f = c.filters(1, **spec)
            found, frontier = set(), [()]
            while frontier:
                path = frontier.pop()
                state = c.start(1)
                for tok in path:
                    state = c.advance(state, torch.tensor([tok]), filters=f)
                allowed = c.mask_(torch.zeros(1, 200), state, filters=f).isfinite().nonzero()[:, 1].tolist()
                found |= {path} if 1 in allowed and path else set()
                frontier += [path + (t,) for t in allowed if t != 1]
            return found

        assert reachable(deny=["e"]) == {(103, 110), (100, 113)}  # e is not its entry's key: still its entry
        assert reachable(deny=["c", "b"]) == {(100, 113)}  # the whole 103 subtree is pruned
        assert reachable(allow=["e"]) == {(103, 109)}
        assert reachable(allow=["b", "d"], deny=["a"]) == {(103, 110), (100, 113)}
        with pytest.raises(ConstraintConfigError, match="not entries of the trie"):
            c.filters(1, deny=["zz"])


def test_catalog_without_keys_has_no_item_keys():
    trie = catalog_from_codes(np.array([[1, 2], [1, 2]]), codebook_size=4, vocab_size=8)
    assert trie.entry(0).item_keys is None and items_of(trie, 0).tolist() == [0, 1]
    with pytest.raises(InvalidEntryError, match="without item keys"):
        item_keys_of(trie, 0)
    assert TokenTrie.from_sequences([[1]], vocab_size=4, keys=["k"]).entry(0).item_keys is None


def test_vocab_size_and_offsets_that_are_not_token_ids_are_named():
    # vocab_size was only int()-ed: 100.7 built a trie with token 100 for vocab_size 100 (invalid), and a string or
    # None failed inside a comparison
    for vocab_size in (100.7, "200", None, True):
        with pytest.raises(InvalidTokenError, match="vocab_size must be an integer"):
            catalog_from_codes(np.array([[0]]), codebook_size=1, token_offset=100, vocab_size=vocab_size)
    # an offset or a code near 2**63 wrapped the int64 sum offset + code around: the build gave a small wrong token
    with pytest.raises(InvalidTokenError, match="outside the vocabulary"):
        catalog_from_codes(np.array([[5]]), level_offsets=[2**63 - 2], vocab_size=10)
    with pytest.raises(InvalidTokenError, match="outside the vocabulary"):
        catalog_from_codes(np.array([[2**63 - 1]]), level_offsets=[1], vocab_size=10)
    for token_offset in (2**70, -1, 10, 1.5):
        with pytest.raises(InvalidTokenError, match="token_offset"):
            catalog_from_codes(np.array([[1, 2]]), codebook_size=4, token_offset=token_offset, vocab_size=10)
    # beside level_offsets, an array token_offset failed inside numpy ("The truth value of an array ... is
    # ambiguous")
    with pytest.raises(InvalidTokenError, match=r"token_offset must be a token id in \[0, 10\), got array"):
        catalog_from_codes(np.array([[1, 2]]), level_offsets=[0, 4], token_offset=np.array([1, 2]), vocab_size=10)
    with pytest.raises(InvalidEntryError, match="not both"):
        catalog_from_codes(np.array([[1, 2]]), level_offsets=[0, 4], token_offset=np.int64(3), vocab_size=10)
    # codebook sizes and level offsets: a huge int overflowed inside numpy, a float was truncated, a wrong length
    # failed in a broadcast
    for name, value, message in (("codebook_size", 2**70, "fit int64"), ("codebook_size", 4.5, "must be integers"),
                                 ("codebook_size", True, "must be integers"), ("codebook_size", [4, 4, 4], "one per level"),
                                 ("level_offsets", [2**70, 1], "fit int64"), ("level_offsets", [1.5, 2.0], "must be integers")):
        with pytest.raises(InvalidEntryError, match=message):
            catalog_from_codes(np.array([[1, 2]]), vocab_size=10, **{name: value})


@pytest.mark.parametrize("change, message", [
    ({"catalog_item_ids": np.array([0, 7, 1, 3, 4])}, "every item exactly once"),
    ({"catalog_item_ids": np.array([0, 0, 1, 3, 4])}, "every item exactly once"),
    ({"catalog_item_ptr": np.array([0, 4, 3, 5])}, "catalog_item_ptr"),
    ({"catalog_item_ptr": np.array([0, 3, 4])}, "catalog_item_ptr"),
    ({"catalog_item_ptr": np.array([0.0, 3, 4, 5], dtype=np.float32)}, "catalog_item_ptr"),
    ({"catalog_item_ids": None}, "without both"),
    ({"catalog_item_keys_offsets": None}, "half of the item key table"),
    ({"catalog_item_keys_offsets": np.array([0, 1, 2, 3, 4, 50])}, "item key table"),
    # Offsets without even their end: a bare ValueError from StringTable.__len__ (-1) instead of the named refusal.
    ({"catalog_item_keys_offsets": np.zeros(0, np.int64)}, "item key table does not match"),
    ({"retired_keys_blob": np.zeros(0, np.uint8), "retired_keys_offsets": np.zeros(0, np.int64)},
     "retired key table does not match"),
])
def test_a_file_with_corrupt_item_lists_is_refused_on_load(tmp_path, change, message):
    # The item lists were not checked on load: a file whose CRCs agree but whose lists are wrong gave items that do
    # not exist (items_of), or an IndexError, TypeError or KeyError from numpy in item_entries, entry() and filters.
    from trie_decode.errors import TrieFileError
    from trie_decode.fileio import read_arrays, write_arrays

    catalog_from_codes(np.array([[3, 1], [3, 2], [3, 1], [0, 5], [3, 1]]), codebook_size=8, vocab_size=20,
                       keys=list("abcde")).save(tmp_path / "good.trie")
    arrays, meta = read_arrays(tmp_path / "good.trie")
    arrays = {name: np.array(a) for name, a in arrays.items()}
    for name, value in change.items():
        arrays.pop(name) if value is None else arrays.__setitem__(name, value)
    write_arrays(tmp_path / "bad.trie", arrays, {k: v for k, v in meta.items() if k not in ("format", "crc32")})
    with pytest.raises(TrieFileError, match=message):
        TokenTrie.load(tmp_path / "bad.trie")


def test_items_of_takes_an_integer_entry_and_keys_a_list():
    trie = catalog_from_codes(np.array([[1, 2], [0, 3], [1, 2]]), codebook_size=4, vocab_size=8)
    # Were: numpy's IndexError (a float) and TypeError (a bool), which name neither the entry nor the problem.
    for bad in (1.5, True, "0"):
        with pytest.raises(InvalidEntryError, match=f"entry {bad!r} is {type(bad).__name__}, not an integer"):
            items_of(trie, bad)
    with pytest.raises(IndexError, match="entry 2 is not in this trie"):
        items_of(trie, 2)
    assert items_of(trie, np.int64(0)).tolist() == [0, 2]
    # A single string was one key per character.
    with pytest.raises(InvalidEntryError, match="keys is a single str 'abc': give a list, one key for each of the 3 "
                                                "rows of codes"):
        catalog_from_codes(np.array([[1, 2], [0, 3], [1, 2]]), codebook_size=4, vocab_size=8, keys="abc")
    keyed = catalog_from_codes(np.array([[1, 2], [0, 3]]), codebook_size=4, vocab_size=8, keys=(k for k in "ab"))
    assert item_keys_of(keyed, 1) == ["b"]
