"""Building a ``TokenTrie``: exact arrays on small examples, input forms, queries, stats, validate() and scale."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from trie_decode import Entry, InvalidEntryError, InvalidTokenError, TokenTrie, TrieFileError
from trie_decode._build import RaggedTokens

# The module docstring's example: [5, 6] "a", [5, 7, 8] "b", [9] "c".
SEQS = [[5, 6], [5, 7, 8], [9]]
NAMES = ["a", "b", "c"]


@pytest.fixture()
def small() -> TokenTrie:
    return TokenTrie.from_sequences(SEQS, vocab_size=10, names=NAMES)


def test_exact_csr_arrays(small):
    # Nodes breadth-first, siblings by token: 0 root, 1 "5", 2 "9", 3 "5 6", 4 "5 7", 5 "5 7 8".
    assert small.token.tolist() == [-1, 5, 9, 6, 7, 8]
    assert small.child_ptr.tolist() == [1, 3, 5, 5, 5, 6, 6]
    assert small.node_entry.tolist() == [-1, -1, 2, 0, -1, 1]
    assert small.entry_node.tolist() == [3, 5, 2]
    assert small.level_ptr.tolist() == [0, 1, 3, 5, 6]
    assert small.parent.tolist() == [-1, 0, 0, 1, 1, 4]
    assert small.fanout.tolist() == [2, 2, 0, 0, 1, 0]
    assert (small.num_nodes, small.num_entries, small.max_depth, len(small)) == (6, 3, 3, 3)


def test_arrays_are_frozen(small):
    for name in ("child_ptr", "token", "node_entry", "entry_node", "level_ptr", "parent"):
        array = getattr(small, name)
        assert not array.flags.writeable, name
        with pytest.raises(ValueError):
            array[0] = 0


def test_queries_on_the_docstring_example(small):
    tokens, nodes = small.children(small.root)
    assert tokens.tolist() == [5, 9] and nodes.tolist() == [1, 2]
    node = small.walk([5, 7])
    assert node == 4
    assert small.forced_run(node) == [8]
    assert small.entry_at(small.walk([5, 7, 8])) == Entry(index=1, name="b", key=None, tokens=(5, 7, 8))
    assert small.step(small.root, 5) == 1
    assert small.step(small.root, 6) == -1
    assert small.step(small.root, 10) == -1  # past the last sibling
    assert small.step(small.root, 0) == -1  # before the first sibling
    assert small.walk([]) == small.root
    assert small.walk([5, 6, 1]) == -1
    assert small.walk([7, 5]) == -1
    assert small.walk([8], node=4) == 5
    assert small.is_terminal(small.walk([9])) and not small.is_terminal(small.walk([5]))
    assert small.entry_at(small.walk([5])) is None
    assert small.lookup([5]) is None and small.lookup([5, 7, 9]) is None and small.lookup([1]) is None
    assert small.lookup([9]).name == "c"
    assert small.children(small.walk([9]))[0].size == 0
    assert small.forced_run(small.walk([9])) == []
    assert small.forced_run(small.root) == []  # two ways on
    assert small.tokens_of(5) == (5, 7, 8) and small.tokens_of(0) == ()
    assert small.sequences() == [(5, 6), (5, 7, 8), (9,)]
    assert small.names() == NAMES
    assert "entries=3" in repr(small) and "nodes=6" in repr(small)


def test_out_of_range_nodes_and_entries_raise_index_error(small):
    for bad in (-1, 6, 100):
        with pytest.raises(IndexError, match=f"node {bad} is not in this trie"):
            small.children(bad)
        with pytest.raises(IndexError, match="node"):
            small.step(bad, 5)
        with pytest.raises(IndexError, match="node"):
            small.is_terminal(bad)
    with pytest.raises(IndexError, match="entry 3 is not in this trie"):
        small.entry(3)
    with pytest.raises(IndexError, match="entry -1"):
        small.entry(-1)


def test_entry_that_is_a_prefix_of_another():
    trie = TokenTrie.from_sequences([[1, 2, 3], [1], [1, 2, 3, 4]], vocab_size=5, names=["long", "short", "longer"])
    one = trie.walk([1])
    assert trie.is_terminal(one) and trie.children(one)[0].tolist() == [2]
    # The root has one child but the run stops where an entry ends.
    assert trie.forced_run(trie.root) == [1]
    assert trie.forced_run(one) == []
    assert trie.forced_run(trie.walk([1, 2])) == [3]
    assert trie.entry_at(one).name == "short"
    assert trie.entry_at(trie.walk([1, 2, 3])).name == "long"
    assert trie.lookup([1, 2, 3, 4]).name == "longer"
    assert trie.lookup([1, 2]) is None
    trie.validate()


def test_duplicates_are_merged_and_keep_the_first_name_and_key():
    seqs = [[3, 4], [1], [3, 4], [1], [3, 4], [2]]
    trie = TokenTrie.from_sequences(seqs, vocab_size=5, names=list("abcdef"), keys=[10, 11, 12, 13, 14, 15])
    assert trie.num_entries == 3
    assert trie.num_duplicates == 3 and trie.stats()["duplicates_merged"] == 3
    assert [trie.entry(i) for i in range(3)] == [
        Entry(0, "a", "10", (3, 4)),  # keys are stored as strings
        Entry(1, "b", "11", (1,)),
        Entry(2, "f", "15", (2,)),
    ]
    assert trie.lookup([3, 4]).name == "a"


@pytest.mark.parametrize(
    "make",
    [
        lambda: [(5, 6), (5, 7, 8), (9,)],
        lambda: [np.array([5, 6], dtype=np.int16), np.array([5, 7, 8], dtype=np.uint8), np.array([9])],
        lambda: [torch.tensor([5, 6]), torch.tensor([5, 7, 8]), torch.tensor([9])],
        lambda: [[np.int64(5), np.int32(6)], [5, 7, 8], [9]],
        lambda: (s for s in SEQS),  # any iterable of sequences
        lambda: RaggedTokens(np.array([5, 6, 5, 7, 8, 9], dtype=np.int64), np.array([0, 2, 5, 6], dtype=np.int64)),
        # uint64 rows beside signed ones: numpy promotes their elements to float64 together, and the build refused
        # them as "entry -1 has token id 0, outside any vocabulary (exceeds int64)"
        lambda: [np.array([5, 6], dtype=np.uint64), np.array([5, 7, 8], dtype=np.int64), np.array([9], np.int8)],
        lambda: [np.array([5, 6], dtype=np.uint64), [5, 7, 8], (np.int32(9),)],
    ],
    ids=["tuples", "numpy-rows", "torch-rows", "numpy-scalars", "generator", "ragged", "uint64-and-signed-rows",
         "uint64-and-list-rows"],
)
def test_input_forms_give_the_same_trie(make, small):
    trie = TokenTrie.from_sequences(make(), vocab_size=np.int64(10))
    for name in ("child_ptr", "token", "node_entry", "entry_node", "level_ptr"):
        assert np.array_equal(getattr(trie, name), getattr(small, name)), name
    assert trie.vocab_size == 10 and type(trie.vocab_size) is int


@pytest.mark.parametrize(
    "array", [np.array([[3, 1], [2, 2], [3, 1]], dtype=np.uint16), torch.tensor([[3, 1], [2, 2], [3, 1]]),
              # Python ints in an object array (a table's values) were refused as "got dtype object"
              np.array([[3, 1], [2, 2], [3, 1]], dtype=object)]
)
def test_2d_input(array):
    trie = TokenTrie.from_sequences(array, vocab_size=4)
    assert trie.sequences() == [(3, 1), (2, 2)]
    assert trie.num_duplicates == 1


def test_a_2d_object_array_names_the_element_that_is_no_token_id():
    for row, shown in (([1, 2.5], r"2\.5 \(float\)"), ([1, True], r"True \(bool\)"), ([1, None], "None")):
        with pytest.raises(InvalidTokenError, match=f"token ids must be integers; entry 0 has {shown}"):
            TokenTrie.from_sequences(np.array([row], dtype=object), vocab_size=10)


def test_uint64_rows_beside_signed_ones_name_the_bad_id():
    # Was "entry -1 has token id 0, outside any vocabulary" for each of them (the float64 numpy made of the ids).
    with pytest.raises(InvalidTokenError, match=r"^entry 1 has token id -1, outside the vocabulary \[0, 10\)$"):
        TokenTrie.from_sequences([np.array([5], dtype=np.uint64), [-1]], vocab_size=10)
    with pytest.raises(InvalidTokenError, match=r"^entry 1 has token id 4611686018427387905, outside the vocabulary"):
        TokenTrie.from_sequences([np.array([5], dtype=np.uint64), np.array([2**62 + 1])], vocab_size=10)
    with pytest.raises(InvalidTokenError, match=r"^entry 0 has token id 9223372036854775808, outside any vocabulary"):
        TokenTrie.from_sequences([np.array([2**63], dtype=np.uint64), np.array([1])], vocab_size=10)


def test_a_2d_tensor_numpy_cannot_read_is_named_or_read():
    # A float tensor that requires grad failed inside numpy (RuntimeError "Can't call numpy() on Tensor that requires
    # grad"); a GPU tensor of token ids was refused as "token ids must be integers, got dtype torch.int64".
    with pytest.raises(InvalidTokenError, match=r"^sequences: token ids must be integers, got dtype torch.float32$"):
        TokenTrie.from_sequences(torch.tensor([[1.0, 2.0]], requires_grad=True), vocab_size=10)
    if torch.cuda.is_available():
        trie = TokenTrie.from_sequences(torch.tensor([[3, 1], [2, 2]], device="cuda"), vocab_size=4)
        assert trie.sequences() == [(3, 1), (2, 2)]


def test_single_entry_and_boundary_token_ids():
    trie = TokenTrie.from_sequences([[0, 9, 0]], vocab_size=10)
    assert trie.num_nodes == 4 and trie.max_depth == 3
    assert trie.forced_run(trie.root) == [0, 9, 0]
    assert trie.lookup([0, 9, 0]).index == 0
    trie.validate()


def test_stats_on_the_docstring_example(small):
    stats = small.stats()
    assert stats["entries"] == 3 and stats["nodes"] == 6 and stats["max_depth"] == 3
    assert stats["root_fanout"] == 2 and stats["max_fanout"] == 2
    assert stats["fanout_histogram"] == {"0": 3, "1": 1, "2": 2}
    # Of the 6 entry tokens, only the 8 of "5 7 8" is forced (its parent "5 7" has one child and is no entry).
    assert stats["forced_token_share"] == round(1 / 6, 4)
    assert stats["duplicates_merged"] == 0 and stats["vocab_size"] == 10 and stats["fingerprint"] == ""
    assert json.loads(json.dumps(stats)) == stats  # printable and serializable  # printable and serializable


def test_children_tokens_are_a_view_not_a_copy(small):
    tokens, _ = small.children(small.root)
    assert np.shares_memory(tokens, small.token)


# ------------------------------------------------------------------ validate() catches broken structures


def _arrays(trie: TokenTrie) -> dict:
    return dict(
        child_ptr=trie.child_ptr.copy(),
        token=trie.token.copy(),
        node_entry=trie.node_entry.copy(),
        entry_node=trie.entry_node.copy(),
        level_ptr=trie.level_ptr.copy(),
        vocab_size=trie.vocab_size,
    )


def _broken(small, **changes):
    arrays = _arrays(small)
    for name, edit in changes.items():
        arrays[name] = edit(arrays[name])
    return TokenTrie(**arrays)


def _set(index, value):
    def edit(a):
        a[index] = value
        return a

    return edit


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(token=_set(3, 7)), "not sorted by token or hold a duplicate"),  # siblings 7, 7
        (dict(token=lambda a: a[[0, 2, 1, 3, 4, 5]]), "not sorted by token or hold a duplicate"),  # 9 before 5
        (dict(token=_set(1, 10)), r"token id is outside \[0, 10\)"),
        (dict(token=_set(0, 0)), "root's token is not -1"),
        (dict(child_ptr=_set(2, 6)), "child_ptr is not a monotone"),
        (dict(child_ptr=_set(0, 0)), "child_ptr is not a monotone"),
        (dict(level_ptr=_set(2, 4)), "level_ptr does not match the parent links"),
        (dict(level_ptr=_set(3, 3)), "level_ptr is inconsistent"),
        (dict(node_entry=_set(3, -1)), "entry_node and node_entry disagree"),
        (dict(entry_node=lambda a: a[[1, 0, 2]]), "entry_node and node_entry disagree"),
        (dict(node_entry=_set(4, 1)), "terminal without an entry"),
        (dict(node_entry=_set(1, 7)), "terminal without an entry"),
        (dict(entry_node=_set(0, 0)), "points outside the node range"),
        (dict(vocab_size=lambda v: 9), r"outside \[0, 9\)"),
    ],
)
def test_validate_rejects_broken_arrays(small, changes, message):
    broken = _broken(small, **changes)
    with pytest.raises(TrieFileError, match=message):
        broken.validate()


def test_validate_rejects_a_leaf_that_ends_no_entry(small):
    # Drop entry 2 ("9"): node 2 becomes a leaf with no entry.
    arrays = _arrays(small)
    arrays["node_entry"][2] = -1
    arrays["entry_node"] = arrays["entry_node"][:2]
    with pytest.raises(TrieFileError, match="leaf node is not the end of an entry"):
        TokenTrie(**arrays).validate()


def test_validate_rejects_a_node_that_is_its_own_child():
    # Monotone child_ptr summing to the right total, but node 3 lists itself as its child: unreachable cycle.
    trie = TokenTrie(
        child_ptr=np.array([1, 2, 3, 3, 5, 5], dtype=np.int32),
        token=np.array([-1, 1, 1, 1, 2], dtype=np.int32),
        node_entry=np.array([-1, -1, 0, -1, 1], dtype=np.int32),
        entry_node=np.array([2, 4], dtype=np.int32),
        level_ptr=np.array([0, 1, 2, 5], dtype=np.int64),
        vocab_size=3,
    )
    with pytest.raises(TrieFileError, match="breadth-first"):
        trie.validate()


def test_validate_rejects_a_names_table_of_the_wrong_size(small):
    from trie_decode.entries import StringTable

    arrays = _arrays(small)
    with pytest.raises(TrieFileError, match="names table does not match"):
        TokenTrie(**arrays, names=StringTable.from_strings(["a", "b"])).validate()
    table = StringTable.from_strings(["a", "b", "c"])
    bad = StringTable(table.blob, np.array([0, 2, 1, 3], dtype=np.int64))
    with pytest.raises(TrieFileError, match="names table does not match"):
        TokenTrie(**arrays, names=bad).validate()


# ------------------------------------------------------------------ scale (not a timing test)


def test_scale_200k_random_sequences():
    rng = np.random.default_rng(1234)
    k, vocab = 200_000, 49_152
    lengths = rng.integers(1, 13, size=k)
    offsets = np.zeros(k + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    # Zipf-like tokens so that prefixes are shared, as with real names.
    values = np.minimum(rng.zipf(1.3, size=int(offsets[-1])) - 1, vocab - 1).astype(np.int64)
    trie = TokenTrie.from_sequences(RaggedTokens(values, offsets), vocab_size=vocab)
    trie.validate()
    distinct = {tuple(values[offsets[i] : offsets[i + 1]].tolist()) for i in range(k)}
    assert trie.num_entries == len(distinct)
    assert trie.num_duplicates == k - len(distinct)
    stats = trie.stats()
    assert stats["bytes_per_node"] <= 16
    assert trie.nbytes <= 16 * trie.num_nodes
    for i in rng.integers(0, k, size=500).tolist():
        row = values[offsets[i] : offsets[i + 1]].tolist()
        assert trie.lookup(row).tokens == tuple(row)


def test_python_lists_are_packed_in_bulk_and_bad_elements_still_named():
    """``to_ragged`` checks plain lists and tuples in bulk (one C conversion; only the 0s and 1s are looked at one by
    one, where a bool could hide): the result equals the general path's, and every bad element is still named
    with its entry, wherever it sits."""
    from trie_decode import InvalidTokenError
    from trie_decode._build import to_ragged

    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 4, size=rng.integers(1, 6)).tolist() for _ in range(500)]  # many 0s and 1s
    fast = to_ragged(seqs)
    general = to_ragged([np.asarray(s) for s in seqs])  # 1-D arrays take the general path
    assert fast.values.dtype == np.int64 and fast.values.tolist() == general.values.tolist()
    assert fast.offsets.tolist() == general.offsets.tolist()
    assert to_ragged([tuple(s) for s in seqs]).values.tolist() == fast.values.tolist()
    assert to_ragged([[np.int64(1), 0], (np.int32(0),)]).values.tolist() == [1, 0, 0]
    assert to_ragged([[torch.tensor(1), 5]]).values.tolist() == [1, 5]  # a 0-d integer tensor is an id
    for bad, pattern in (
        (True, r"entry 300 has True \(bool\)"),
        (False, r"entry 300 has False \(bool\)"),
        (np.True_, r"entry 300 has .*True.* \(bool\)"),
        (torch.tensor(True), r"entry 300 has tensor\(True\)"),
        (2.0, r"entry 300 has 2\.0 \(float\)"),
        ("7", r"entry 300 has '7' \(str\)"),
        (None, r"entry 300 has None"),
        ([3], r"entry 300 has \[3\] \(list\)"),
    ):
        broken = [list(s) for s in seqs]
        broken[300] = broken[300] + [bad]
        with pytest.raises(InvalidTokenError, match=pattern):
            TokenTrie.from_sequences(broken, vocab_size=10)
    broken = [list(s) for s in seqs]
    broken[7] = (3, 2**63)
    with pytest.raises(InvalidTokenError, match=r"entry 7 has token id 9223372036854775808, outside any vocabulary"):
        TokenTrie.from_sequences(broken, vocab_size=10)


@pytest.mark.parametrize("vocab_size", [80_000, 2**31])
def test_every_path_of_the_builder_gives_the_same_trie(vocab_size):
    """The builder's depth 0 takes a presence row over the vocabulary (or sorts, for a vocabulary far wider than
    the input) and a 16-bit radix order (or a wider sort past 65536 root children); every path gives the trie of
    the sequences, duplicates and prefixes included, with entries numbered in order of first use."""
    rng = np.random.default_rng(1)
    firsts = rng.permutation(70_000)  # more than 65536 distinct first tokens
    seqs = [[int(f)] + rng.integers(0, 3, size=rng.integers(0, 3)).tolist() for f in firsts]
    seqs += [seqs[5], seqs[7][:1], [firsts[9]] + [2, 2, 2]]  # a duplicate, a prefix, a longer one
    few = [s for s in seqs if s[0] < 300]  # fewer than 65536 root children
    for group in (seqs, few):
        trie = TokenTrie.from_sequences(group, vocab_size=vocab_size)
        trie.validate()
        first_use = list(dict.fromkeys(tuple(s) for s in group))
        assert [trie.tokens_of(int(n)) for n in trie.entry_node] == first_use
        assert trie.token[1 : 1 + len(trie.children(0)[0])].tolist() == sorted({s[0] for s in group})
        assert trie.num_nodes == 1 + len({tuple(s[:d]) for s in group for d in range(1, len(s) + 1)})


@pytest.mark.parametrize("seed", range(6))
def test_subset_prunes_to_the_arrays_a_build_of_those_entries_gives(seed):
    # subset drops the nodes on no kept entry's path instead of rebuilding: the arrays must be a build's, to the
    # entry, for kept sets in any order (prefixes of other entries, the deepest entries gone, one entry left)
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, 6, size=rng.integers(1, 6)).tolist() for _ in range(300)]
    trie = TokenTrie.from_sequences(seqs, vocab_size=6, keys=[f"k{i}" for i in range(len(seqs))])
    deepest = np.flatnonzero(np.diff(trie.entry_tokens(np.arange(trie.num_entries)).offsets) < trie.max_depth)
    for entries in (rng.permutation(trie.num_entries)[: rng.integers(1, trie.num_entries)],
                    np.sort(rng.choice(trie.num_entries, 40, replace=False)), deepest, np.array([int(deepest[-1])])):
        got = trie.subset(entries)
        want = TokenTrie.from_sequences([list(trie.tokens_of(int(trie.entry_node[e]))) for e in entries],
                                        vocab_size=6, keys=[trie.entry(int(e)).key for e in entries])
        got.validate()
        for name in ("child_ptr", "token", "node_entry", "entry_node", "level_ptr"):
            assert getattr(got, name).dtype == getattr(want, name).dtype, name
            assert np.array_equal(getattr(got, name), getattr(want, name)), name
        assert [got.entry(i).key for i in range(len(entries))] == [trie.entry(int(e)).key for e in entries]
    with pytest.raises(ValueError, match="given twice"):  # few entries of a larger trie: the build path
        trie.subset(np.array([3, 3]))


def test_subset_names_a_bad_index(small):
    with pytest.raises(IndexError, match="entry index -1 is out of range for a trie of 3 entries"):
        small.subset(np.array([0, -1]))
    with pytest.raises(IndexError, match="entry index 3 is out of range"):
        small.subset(np.array([3]))
    with pytest.raises(ValueError, match="given twice"):
        small.subset(np.array([1, 1]))


def test_subset_and_entry_tokens_refuse_masks_and_wrapping_indices(small):
    # a boolean mask was read as the indices 0 and 1 (subset([True, False]) kept both entries, reordered), a float
    # was truncated, and entry_tokens read a negative index from the end
    two = TokenTrie.from_sequences([[1], [2]], vocab_size=4)
    with pytest.raises(InvalidEntryError, match="subset: entries must be a 1-D array of entry indices, not bool"):
        two.subset(np.array([True, False]))
    with pytest.raises(InvalidEntryError, match="not float64"):
        small.subset(np.array([0.7]))
    with pytest.raises(IndexError, match="entry_tokens: entry index -1 is out of range for a trie of 3 entries"):
        small.entry_tokens(np.array([-1]))
    # an unsigned index beyond int64 was named as the -1 it wrapped to
    with pytest.raises(IndexError, match="subset: entry index 18446744073709551615 is out of range"):
        small.subset(np.array([2**64 - 1], dtype=np.uint64))
    assert small.entry_tokens(np.zeros(0, dtype=np.int64)).offsets.tolist() == [0]


def test_ragged_tokens_that_do_not_describe_sequences_are_named():
    # RaggedTokens went to the builder unchecked: offsets past the values or float ids raised IndexError inside
    # numpy, and offsets not starting at 0 dropped the values before them without a word
    with pytest.raises(InvalidEntryError, match="offsets run from 0 to 5, not from 0 to the 3 values"):
        TokenTrie.from_sequences(RaggedTokens(np.array([1, 2, 3]), np.array([0, 2, 5])), 10)
    with pytest.raises(InvalidEntryError, match="offsets run from 1 to 3"):
        TokenTrie.from_sequences(RaggedTokens(np.array([1, 2, 3]), np.array([1, 3])), 10)
    with pytest.raises(InvalidTokenError, match="token ids must be integers, got dtype float64"):
        TokenTrie.from_sequences(RaggedTokens(np.array([1.5, 2.0]), np.array([0, 2])), 10)
    with pytest.raises(InvalidEntryError, match="offsets must be integers"):
        TokenTrie.from_sequences(RaggedTokens(np.array([1, 2]), np.array([0.0, 2.0])), 10)
    trie = TokenTrie.from_sequences(RaggedTokens(np.array([1, 2, 3], dtype=np.uint8), np.array([0, 2, 3])), 10)
    assert trie.sequences() == [(1, 2), (3,)]


def test_from_strings_refuses_a_set_or_a_dict_of_strings(tokenizer):
    # A set of strings was read in its hash order, which changes from one process to the next: the entry numbers
    # of the trie changed with it, and keys= was paired with the strings in that order (silently wrong keys).
    for strings in ({"France", "Chile"}, frozenset({"France"}), {"France": "FR"}):
        with pytest.raises(InvalidEntryError, match="no order of its own"):
            TokenTrie.from_strings(strings, tokenizer, keys=["FR", "CL"][: len(strings)])
    trie = TokenTrie.from_strings(sorted({"France", "Chile"}), tokenizer, keys=["CL", "FR"])
    assert [(e.name, e.key) for e in map(trie.entry, range(2))] == [("Chile", "CL"), ("France", "FR")]
