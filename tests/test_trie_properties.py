"""Property tests of ``TokenTrie`` against a brute-force reference: the set of all prefixes of the entries.

Small vocabularies (2..50) and short entries (1..8 tokens) force shared prefixes; the strategy also adds entries
that are prefixes of other entries and exact duplicates. Every answer of the trie (children, step, walk,
is_terminal, forced_run, entry_at, lookup, stats, node numbering, files) is compared with what the plain set of
tuples says.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trie_decode import TokenTrie

from reference import TrieReference

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def entry_sets(draw, max_entries: int = 30):
    """(vocab_size, sequences): random entries plus some prefixes of them and some duplicates, shuffled."""
    vocab = draw(st.integers(2, 50))
    token = st.integers(0, vocab - 1)
    base = draw(st.lists(st.lists(token, min_size=1, max_size=8), min_size=1, max_size=max_entries))
    extra = []
    for seq in base:
        choice = draw(st.integers(0, 3))
        if choice == 1 and len(seq) > 1:  # a proper prefix of another entry
            extra.append(seq[: draw(st.integers(1, len(seq) - 1))])
        elif choice == 2:  # an exact duplicate
            extra.append(list(seq))
    sequences = draw(st.permutations(base + extra))
    return vocab, [list(s) for s in sequences]


def _names(sequences):
    # Unique per input position, so "the name of the first occurrence" is observable.
    return [f"n{i}-{'.'.join(map(str, s))}" for i, s in enumerate(sequences)]


@SETTINGS
@given(entry_sets())
def test_trie_matches_brute_force(case):
    vocab, sequences = case
    names = _names(sequences)
    keys = [f"k{i}" for i in range(len(sequences))]
    trie = TokenTrie.from_sequences(sequences, vocab, names=names, keys=keys)
    ref = TrieReference(sequences)
    trie.validate()

    assert trie.num_nodes == len(ref.prefixes)  # distinct non-empty prefixes + the root
    assert trie.num_entries == len(ref.entries) == len(trie)
    assert trie.stats()["duplicates_merged"] == len(sequences) - len(ref.entries)
    assert trie.max_depth == max(map(len, sequences))

    node_of = {p: trie.walk(p) for p in ref.prefixes}
    for p in ref.prefixes:
        node = node_of[p]
        assert node >= 0, p
        assert trie.tokens_of(node) == p
        tokens, child_nodes = trie.children(node)
        assert tokens.tolist() == sorted(ref.next_tokens[p])
        assert child_nodes.tolist() == [node_of[p + (t,)] for t in sorted(ref.next_tokens[p])]
        assert trie.is_terminal(node) == (p in ref.first_index)
        assert trie.forced_run(node) == ref.forced_run(p)
        # step agrees with walk for every token of the vocabulary (and a few outside it).
        for t in range(-1, vocab + 1):
            assert trie.step(node, t) == node_of.get(p + (t,), -1)
        # walk from an inner node agrees with walk from the root.
        for k in range(len(p) + 1):
            assert trie.walk(p[k:], node_of[p[:k]]) == node
        entry = trie.entry_at(node)
        if p in ref.first_index:
            first = ref.first_index[p]
            assert entry is not None
            assert entry.tokens == p
            assert entry.index == ref.entry_number[p]
            assert entry.name == names[first]
            assert entry.key == keys[first]
            assert trie.lookup(p) == entry
            assert trie.entry(entry.index) == entry
        else:
            assert entry is None
            assert trie.lookup(p) is None

    # Sequences that leave the trie.
    for p in list(ref.prefixes)[:20]:
        for t in range(vocab):
            if p + (t,) not in ref.prefixes:
                assert trie.walk(p + (t,)) == -1
                assert trie.walk(p + (t, 0)) == -1
                assert trie.lookup(p + (t,)) is None

    assert trie.sequences() == ref.entries
    assert trie.names() == [names[ref.first_index[e]] for e in ref.entries]


@SETTINGS
@given(entry_sets())
def test_breadth_first_layout(case):
    vocab, sequences = case
    trie = TokenTrie.from_sequences(sequences, vocab)
    ref = TrieReference(sequences)

    # Node ids are exactly the breadth-first numbering with siblings sorted by token.
    assert [trie.tokens_of(n) for n in range(trie.num_nodes)] == ref.bfs_order
    ptr = trie.child_ptr.astype(np.int64)
    assert ptr[0] == 1 and ptr[-1] == trie.num_nodes
    assert np.all(np.diff(ptr) >= 0)
    # Children come after their parent and siblings are strictly increasing.
    parent = trie.parent
    assert parent[0] == -1
    assert np.all(parent[1:] < np.arange(1, trie.num_nodes))
    same = parent[2:] == parent[1:-1]
    assert np.all(trie.token[2:][same] > trie.token[1:-1][same])
    assert trie.token[0] == -1
    # level_ptr[d] = number of prefixes shorter than d.
    depths = [len(p) for p in ref.bfs_order]
    expected_levels = [sum(d < level for d in depths) for level in range(trie.max_depth + 2)]
    assert trie.level_ptr.tolist() == expected_levels
    # node_entry / entry_node are inverse of each other.
    assert trie.node_entry[trie.entry_node].tolist() == list(range(trie.num_entries))
    assert int(np.count_nonzero(trie.node_entry >= 0)) == trie.num_entries
    for arr in (trie.child_ptr, trie.token, trie.node_entry, trie.entry_node):
        assert arr.dtype == np.int32
    assert trie.level_ptr.dtype == np.int64


@SETTINGS
@given(entry_sets(), st.randoms(use_true_random=False))
def test_structure_is_independent_of_input_order(case, rnd):
    vocab, sequences = case
    shuffled = list(sequences)
    rnd.shuffle(shuffled)
    a = TokenTrie.from_sequences(sequences, vocab)
    b = TokenTrie.from_sequences(shuffled, vocab)
    for name in ("child_ptr", "token", "level_ptr"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    # Entry numbers follow the input order, but each node ends the same entry tokens.
    assert np.array_equal(a.node_entry >= 0, b.node_entry >= 0)
    assert set(a.sequences()) == set(b.sequences())


@SETTINGS
@given(entry_sets())
def test_stats_match_brute_force(case):
    vocab, sequences = case
    trie = TokenTrie.from_sequences(sequences, vocab)
    ref = TrieReference(sequences)
    stats = trie.stats()
    assert stats["entries"] == len(ref.entries)
    assert stats["nodes"] == len(ref.prefixes)
    assert stats["max_depth"] == max(map(len, ref.entries))
    assert stats["root_fanout"] == len(ref.next_tokens[()])
    assert stats["max_fanout"] == max(len(v) for v in ref.next_tokens.values())
    assert sum(stats["fanout_histogram"].values()) == len(ref.prefixes)
    assert stats["fanout_histogram"].get("0", 0) == sum(not v for v in ref.next_tokens.values())
    assert stats["forced_token_share"] == ref.forced_token_share()
    n, e, d = len(ref.prefixes), len(ref.entries), max(map(len, ref.entries))
    assert stats["bytes"] == trie.nbytes == 4 * (n + 1) + 4 * n + 4 * n + 4 * e + 8 * (d + 2)
    assert stats["vocab_size"] == vocab


@settings(max_examples=60, deadline=None)
@given(entry_sets(max_entries=20), st.booleans())
def test_save_load_round_trip(case, with_names):
    vocab, sequences = case
    names = _names(sequences) if with_names else None
    keys = list(range(100, 100 + len(sequences))) if with_names else None
    trie = TokenTrie.from_sequences(sequences, vocab, names=names, keys=keys, fingerprint="fp", options={"x": 1})
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.safetensors"
        trie.save(path)
        loaded = TokenTrie.load(path)
        for name in ("child_ptr", "token", "node_entry", "entry_node", "level_ptr"):
            a, b = getattr(trie, name), getattr(loaded, name)
            assert a.dtype == b.dtype and np.array_equal(a, b), name
        assert loaded.vocab_size == vocab
        assert loaded.fingerprint == "fp" and loaded.options == {"x": 1}
        assert loaded.stats() == trie.stats()
        assert loaded.sequences() == trie.sequences()
        assert loaded.names() == trie.names()
        for i in range(trie.num_entries):
            assert loaded.entry(i) == trie.entry(i)
        for seq in sequences:
            assert loaded.lookup(seq) == trie.lookup(seq)
            node = loaded.walk(seq[:-1])
            assert loaded.forced_run(node) == trie.forced_run(node)
            assert loaded.children(node)[0].tolist() == trie.children(node)[0].tolist()
        del loaded  # release the memory map before the folder goes


@SETTINGS
@given(st.integers(2, 50), st.integers(1, 8), st.integers(1, 30), st.randoms(use_true_random=False))
def test_2d_array_input_equals_list_input(vocab, length, count, rnd):
    rows = [[rnd.randrange(vocab) for _ in range(length)] for _ in range(count)]
    a = TokenTrie.from_sequences(np.array(rows, dtype=np.int32), vocab)
    b = TokenTrie.from_sequences(rows, vocab)
    for name in ("child_ptr", "token", "node_entry", "entry_node", "level_ptr"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.num_duplicates == b.num_duplicates == count - len({tuple(r) for r in rows})


@pytest.mark.parametrize("seed", [0, 1])
def test_wide_vocab_keys_do_not_collide(seed):
    """parent * vocab + token must not overflow or collide for a large vocabulary and many nodes."""
    rng = np.random.default_rng(seed)
    vocab = (1 << 31) - 1
    rows = rng.integers(vocab - 1000, vocab, size=(2000, 4))
    trie = TokenTrie.from_sequences(rows, vocab)
    trie.validate()
    ref = TrieReference(rows.tolist())
    assert trie.num_nodes == len(ref.prefixes)
    for row in rows[:200].tolist():
        assert trie.lookup(row).tokens == tuple(row)
