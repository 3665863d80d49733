"""Semantic-id catalogs: the fast builder equals the generic one, keeps every item of a shared id, and round-trips
through the file and the CLI."""

from __future__ import annotations

import numpy as np
import pytest

from trie_decode import InvalidEntryError, InvalidTokenError, TokenTrie
from trie_decode.catalogs import catalog_from_codes, item_keys_of, items_of
from trie_decode.cli import main


@pytest.mark.parametrize("seed", range(8))
def test_same_trie_as_the_generic_builder_and_every_item_kept(seed):
    rng = np.random.default_rng(seed)
    n, levels, k = int(rng.integers(1, 400)), int(rng.integers(1, 5)), int(rng.integers(1, 7))
    codes = rng.integers(0, k, size=(n, levels))
    trie = catalog_from_codes(codes, codebook_size=k, token_offset=10, vocab_size=10 + k * levels,
                              keys=[f"item{i}" for i in range(n)])
    trie.validate()
    ref = TokenTrie.from_sequences(codes + 10 + np.arange(levels) * k, 10 + k * levels)
    for name in ("child_ptr", "token", "node_entry", "entry_node", "level_ptr"):
        assert np.array_equal(getattr(trie, name), getattr(ref, name)), name
    seen = []
    for e in range(trie.num_entries):
        items = items_of(trie, e)
        assert all(tuple(codes[i] + 10 + np.arange(levels) * k) == trie.entry(e).tokens for i in items)
        assert item_keys_of(trie, e) == [f"item{i}" for i in items] and trie.entry(e).key == f"item{items[0]}"
        seen += items.tolist()
    assert sorted(seen) == list(range(n)) and trie.num_duplicates == n - trie.num_entries


def test_file_and_cli_round_trip(tmp_path, capsys):
    codes = np.array([[3, 1], [3, 2], [3, 1], [0, 5]], dtype=np.int64)
    np.save(tmp_path / "ids.npy", codes)
    (tmp_path / "keys.txt").write_text("a\nb\nc\nd\n")
    out = tmp_path / "items.trie"
    assert main(["build", "--codes", str(tmp_path / "ids.npy"), "--codebook-size", "8", "--token-offset", "100",
                 "--vocab-size", "200", "--keys", str(tmp_path / "keys.txt"), "-o", str(out)]) == 0
    assert "3 distinct ids (1 items share an id)" in capsys.readouterr().out
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
