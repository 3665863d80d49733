"""Vectorized construction of the flat token trie.

Why this exists: a trie of millions of entries must build in seconds. The builder loops over *depth* only; each
level is one ``np.unique`` over the (parent node, token) pairs of the entries still alive at that depth, which
numbers the new nodes in breadth-first order with siblings sorted by token. That order gives the CSR layout for
free: the children of node ``n`` are the contiguous node ids ``child_ptr[n] .. child_ptr[n+1]-1``.

Dimension letters used in this module:
    K: number of input sequences (before duplicates are merged)
    T: total number of tokens over all input sequences
    N: number of trie nodes (the root included)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .errors import EmptyTrieError, InvalidEntryError, InvalidTokenError

MAX_NODES = np.iinfo(np.int32).max - 1


@dataclass(frozen=True)
class RaggedTokens:
    """Token sequences packed into one flat array.

    Attributes:
        values: all tokens, sequence after sequence. Shape: (T,), dtype int64.
        offsets: start of each sequence in ``values``, plus the end. Shape: (K+1,), dtype int64.
    """

    values: np.ndarray
    offsets: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i] : self.offsets[i + 1]]


@dataclass(frozen=True)
class BuiltArrays:
    """What :func:`build_arrays` returns (the raw material of a ``TokenTrie``)."""

    child_ptr: np.ndarray  # (N+1,) int32
    token: np.ndarray  # (N,) int32; token[0] == -1 (the root has no incoming edge)
    node_entry: np.ndarray  # (N,) int32; entry index at terminal nodes, -1 elsewhere
    entry_node: np.ndarray  # (E,) int32; terminal node of each entry
    level_ptr: np.ndarray  # (D+2,) int64; first node id at each depth
    entry_source: np.ndarray  # (E,) int64; index of each entry's first occurrence in the input
    num_duplicates: int


def to_ragged(sequences: Any) -> RaggedTokens:
    """Pack token sequences into :class:`RaggedTokens`, checking that every token is an integer.

    Accepts a ``RaggedTokens``, a 2-D integer array (one sequence per row, all the same length), or any sequence of
    sequences of ints (lists, tuples, 1-D numpy arrays, 1-D tensors).
    """
    if isinstance(sequences, RaggedTokens):
        return sequences
    if isinstance(sequences, (str, bytes)):
        raise InvalidEntryError("expected a collection of token-id sequences, got a single string")
    if hasattr(sequences, "ndim") and getattr(sequences, "ndim") == 2:
        array = np.asarray(sequences)
        _check_integer_dtype(array.dtype, "sequences")
        k, length = array.shape
        offsets = np.arange(k + 1, dtype=np.int64) * length
        return RaggedTokens(_as_int64(array.reshape(-1), offsets), offsets)
    try:
        sequences = list(sequences)
    except TypeError as exc:
        raise InvalidEntryError(f"expected a collection of token-id sequences, got {type(sequences).__name__}") from exc
    for i, seq in enumerate(sequences):
        if isinstance(seq, (str, bytes)) or not hasattr(seq, "__len__"):
            raise InvalidEntryError(
                f"entry {i} is {type(seq).__name__} {seq!r:.60}, not a sequence of token ids "
                "(build from strings with TokenTrie.from_strings)"
            )
    lengths = np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))
    offsets = np.zeros(len(sequences) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = list(itertools.chain.from_iterable(sequences))
    try:
        values = np.array(flat) if flat else np.zeros(0, dtype=np.int64)
    except (ValueError, TypeError):  # a nested list of another length: numpy refuses the inhomogeneous shape
        values = np.zeros(0, dtype=object)
    # numpy promotes [True, 2] to int64, so bools mixed with ints are only visible in the element types.
    types = set(map(type, flat))
    if (
        values.ndim != 1
        or values.dtype == object
        or values.dtype == np.bool_
        or bool in types
        or np.bool_ in types
        or not np.issubdtype(values.dtype, np.integer)
    ):
        entry, bad = _first_non_integer(sequences)
        if entry < 0:  # every element is an int, but one does not fit in int64 (numpy made floats or objects)
            entry, bad = _first_oversized(sequences)
            raise InvalidTokenError(f"entry {entry} has token id {bad}, outside any vocabulary (exceeds int64)")
        raise InvalidTokenError(f"token ids must be integers; entry {entry} has {bad!r} ({type(bad).__name__})")
    return RaggedTokens(_as_int64(values, offsets), offsets)


def _as_int64(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """``values`` as int64, refusing unsigned ids that would wrap around to negative numbers."""
    if values.dtype.kind == "u" and values.size and int(values.max()) > np.iinfo(np.int64).max:
        bad = int(np.argmax(values > np.iinfo(np.int64).max))
        entry = int(np.searchsorted(offsets, bad, side="right") - 1)
        raise InvalidTokenError(
            f"entry {entry} has token id {int(values[bad])}, outside any vocabulary (exceeds int64)"
        )
    return values.astype(np.int64, copy=False)


def _first_oversized(sequences: Sequence[Sequence[Any]]) -> tuple[int, int]:
    limit = np.iinfo(np.int64)
    for i, seq in enumerate(sequences):
        for tok in seq:
            if not limit.min <= int(tok) <= limit.max:
                return i, int(tok)
    return -1, 0


def _check_integer_dtype(dtype: np.dtype, what: str) -> None:
    if not np.issubdtype(dtype, np.integer) or dtype == np.bool_:
        raise InvalidTokenError(f"{what}: token ids must be integers, got dtype {dtype}")


def _first_non_integer(sequences: Sequence[Sequence[Any]]) -> tuple[int, Any]:
    for i, seq in enumerate(sequences):
        for tok in seq:
            if isinstance(tok, bool) or not isinstance(tok, (int, np.integer)):
                if hasattr(tok, "item") and getattr(tok, "ndim", 1) == 0:
                    value = tok.item()
                    if isinstance(value, int) and not isinstance(value, bool):
                        continue
                return i, tok
    return -1, None


def check_tokens(ragged: RaggedTokens, vocab_size: int) -> None:
    """Raise a named error for an empty set, an empty entry, or a token outside ``[0, vocab_size)``."""
    if len(ragged) == 0:
        raise EmptyTrieError("the set of entries is empty: a trie needs at least one entry")
    lengths = ragged.lengths
    if lengths.min() <= 0:
        i = int(np.argmin(lengths))
        raise InvalidEntryError(f"entry {i} has no tokens: every entry needs at least one token")
    if ragged.values.size:
        low, high = int(ragged.values.min()), int(ragged.values.max())
        if low < 0 or high >= vocab_size:
            bad = np.flatnonzero((ragged.values < 0) | (ragged.values >= vocab_size))[0]
            entry = int(np.searchsorted(ragged.offsets, bad, side="right") - 1)
            raise InvalidTokenError(
                f"entry {entry} has token id {int(ragged.values[bad])}, outside the vocabulary [0, {vocab_size})"
            )


def build_arrays(ragged: RaggedTokens, vocab_size: int) -> BuiltArrays:
    """Build the CSR trie arrays from checked token sequences.

    Steps:
      1. Order the sequences longest first, so the sequences alive at depth d are a prefix of that order.
      2. For each depth d: key = parent * V + token for the alive sequences; ``np.unique`` gives the new nodes
         (sorted by parent, then token: breadth-first order) and each sequence's node at depth d.
      3. Each sequence's node at its last depth is its terminal node; equal sequences share it (duplicates).
      4. ``child_ptr`` is 1 + the running sum of children counts (a bincount of the nodes' parents).
    """
    k = len(ragged)
    lengths = ragged.lengths
    order = np.argsort(-lengths, kind="stable")
    sorted_lengths = lengths[order]
    starts = ragged.offsets[:-1][order]
    max_depth = int(sorted_lengths[0])
    # alive[d] = number of sequences with length > d (they hold a token at depth index d).
    alive = k - np.searchsorted(sorted_lengths[::-1], np.arange(max_depth + 1), side="right")

    vocab = np.int64(vocab_size)
    node_of_seq = np.zeros(k, dtype=np.int64)
    end_node = np.empty(k, dtype=np.int64)
    parents: list[np.ndarray] = []
    tokens: list[np.ndarray] = [np.array([-1], dtype=np.int64)]
    level_ptr = [0, 1]
    next_id = 1
    for depth in range(max_depth):
        n_alive = int(alive[depth])
        tok = ragged.values[starts[:n_alive] + depth]
        keys = node_of_seq[:n_alive] * vocab + tok
        uniq, inverse = np.unique(keys, return_inverse=True)
        node_of_seq[:n_alive] = next_id + inverse.reshape(-1)
        parents.append(uniq // vocab)
        tokens.append(uniq % vocab)
        next_id += len(uniq)
        if next_id > MAX_NODES:
            raise InvalidEntryError(f"the trie would exceed {MAX_NODES} nodes; split the entries into several tries")
        level_ptr.append(next_id)
        n_next = int(alive[depth + 1])
        # Sequences of length depth + 1 end here.
        end_node[order[n_next:n_alive]] = node_of_seq[n_next:n_alive]

    num_nodes = next_id
    parent = np.concatenate(parents)
    counts = np.bincount(parent, minlength=num_nodes)
    child_ptr = np.empty(num_nodes + 1, dtype=np.int64)
    child_ptr[0] = 1
    np.cumsum(counts, out=child_ptr[1:])
    child_ptr[1:] += 1

    terminal_nodes, first_input = np.unique(end_node, return_index=True)
    by_first_use = np.argsort(first_input, kind="stable")
    entry_node = terminal_nodes[by_first_use]
    entry_source = first_input[by_first_use]
    node_entry = np.full(num_nodes, -1, dtype=np.int32)
    node_entry[entry_node] = np.arange(len(entry_node), dtype=np.int32)
    return BuiltArrays(
        child_ptr=child_ptr.astype(np.int32),
        token=np.concatenate(tokens).astype(np.int32),
        node_entry=node_entry,
        entry_node=entry_node.astype(np.int32),
        level_ptr=np.asarray(level_ptr, dtype=np.int64),
        entry_source=entry_source.astype(np.int64),
        num_duplicates=k - len(entry_node),
    )
