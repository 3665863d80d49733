"""Vectorized construction of the flat token trie.

Why this exists: a trie of millions of entries must build in seconds. The builder loops over *depth* only; each
level orders the (parent node, token) pairs of the entries still alive at that depth (already ascending between
parents: one nearly sorted pass) and numbers the new nodes in breadth-first order with siblings sorted by token.
That order gives the CSR layout for free: the children of node ``n`` are the contiguous node ids
``child_ptr[n] .. child_ptr[n+1]-1``. Token lists from Python are checked in bulk (:func:`to_ragged`).

Dimension letters used in this module:
    K: number of input sequences (before duplicates are merged)
    T: total number of tokens over all input sequences
    N: number of trie nodes (the root included)
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Mapping, Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

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
        return _checked_ragged(sequences)
    if isinstance(sequences, (str, bytes)):
        raise InvalidEntryError("expected a collection of token-id sequences, got a single string")
    if isinstance(sequences, Mapping):  # its iteration gives its keys, not its values
        raise InvalidEntryError(
            f"expected a collection of token-id sequences, got a {type(sequences).__name__}: pass its values, "
            "list(d.values()) (names= or keys= can carry its keys, list(d))"
        )
    if getattr(sequences, "ndim", None) == 1 and getattr(sequences, "dtype", None) != object:  # rows of scalars
        raise InvalidEntryError(
            f"expected a collection of token-id sequences, got a 1-D {type(sequences).__name__} (one sequence: wrap "
            "it in a list, [ids])"
        )
    # A 2-D object array (a table's values, from pandas) holds Python objects: read row by row, element by element.
    if getattr(sequences, "ndim", None) == 2 and getattr(sequences, "dtype", None) != object:
        if isinstance(sequences, torch.Tensor):  # numpy reads only a CPU tensor, with no graph and a numpy dtype
            if sequences.is_floating_point() or sequences.is_complex() or sequences.dtype == torch.bool:
                raise InvalidTokenError(f"sequences: token ids must be integers, got dtype {sequences.dtype}")
            sequences = sequences.detach().cpu()  # token ids on a GPU (rows of GPU tensors are read too)
        array = np.asarray(sequences)
        _check_integer_dtype(array.dtype, "sequences")
        k, length = array.shape
        offsets = np.arange(k + 1, dtype=np.int64) * length
        return RaggedTokens(_as_int64(array.reshape(-1), offsets), offsets)
    try:
        sequences = list(sequences)
    except TypeError as exc:
        raise InvalidEntryError(f"expected a collection of token-id sequences, got {type(sequences).__name__}") from exc
    row_types = set(map(type, sequences))  # one C-level pass over the rows' types
    if row_types <= _PLAIN_ROWS:
        packed = _pack_plain_rows(sequences)
        if packed is not None:
            return packed
    # The general path: any row type, and the per-row error report of the fast path's failures.
    if any(issubclass(t, (AbstractSet, Mapping)) for t in row_types):  # a length, but no order of its own
        i, seq = next((i, s) for i, s in enumerate(sequences) if isinstance(s, (AbstractSet, Mapping)))
        raise InvalidEntryError(f"entry {i} is {type(seq).__name__} {seq!r:.60}, not a sequence of token ids (a set "
                                "has no order and a dict gives its keys: give a list of ids)")
    for i, seq in enumerate(sequences):
        if isinstance(seq, (str, bytes)) or not hasattr(seq, "__len__"):
            raise _not_a_sequence(i, seq)
    try:
        lengths = np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))
    except TypeError:  # a 0-d array or tensor has __len__, and no length
        bad = next(((i, s) for i, s in enumerate(sequences) if getattr(s, "ndim", 1) == 0), None)
        if bad is None:
            raise
        raise _not_a_sequence(*bad) from None
    offsets = np.zeros(len(sequences) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = list(itertools.chain.from_iterable(sequences))
    # numpy promotes [True, 2] to int64, so bools mixed with ints are only visible in the element types (and a 0-d
    # bool tensor only in its own dtype: any element type but an integer one is looked at one by one).
    types = set(map(type, flat))
    well_typed = not types or all(issubclass(t, (int, np.integer)) and t is not bool for t in types)
    try:
        # Integers are read as int64 directly: numpy would promote uint64 ids mixed with signed ones (rows of
        # different dtypes) to float64, refused below as no integers.
        values = np.array(flat, dtype=np.int64 if well_typed else None) if flat else np.zeros(0, dtype=np.int64)
    except (ValueError, TypeError, OverflowError):  # a nested list of another length (numpy refuses the
        values = np.zeros(0, dtype=object)  # inhomogeneous shape), or an integer beyond int64: named below
    wrong_array = values.ndim != 1 or values.dtype == object or not np.issubdtype(values.dtype, np.integer)
    if wrong_array or not well_typed or values.dtype == np.bool_:
        entry, bad = _first_non_integer(sequences)
        if entry >= 0:
            raise InvalidTokenError(f"token ids must be integers; entry {entry} has {bad!r} ({type(bad).__name__})")
        if wrong_array:  # every element is an int, but one does not fit in int64 (numpy made floats or objects)
            entry, bad = _first_oversized(sequences)
            raise InvalidTokenError(f"entry {entry} has token id {bad}, outside any vocabulary (exceeds int64)")
    return RaggedTokens(_as_int64(values, offsets), offsets)


def _not_a_sequence(i: int, seq: Any) -> InvalidEntryError:
    """The error for entry ``i``, ``seq``, which is not a sequence of token ids (a scalar, a string, a 0-d array)."""
    return InvalidEntryError(f"entry {i} is {type(seq).__name__} {seq!r:.60}, not a sequence of token ids "
                             "(build from strings with TokenTrie.from_strings)")


def _checked_ragged(ragged: RaggedTokens) -> RaggedTokens:
    """``ragged`` with int64 values, once its arrays are known to describe sequences: 1-D integer arrays, offsets
    from 0 to the number of values (the builder indexes ``values`` at ``offsets`` without a check)."""
    values, offsets = np.asarray(ragged.values), np.asarray(ragged.offsets)
    if values.ndim != 1 or offsets.ndim != 1 or len(offsets) == 0:
        raise InvalidEntryError(
            f"RaggedTokens needs 1-D values and offsets, got shapes {values.shape} and {offsets.shape}"
        )
    _check_integer_dtype(values.dtype, "RaggedTokens values")
    if not np.issubdtype(offsets.dtype, np.integer) or offsets.dtype == np.bool_:
        raise InvalidEntryError(f"RaggedTokens offsets must be integers, got dtype {offsets.dtype}")
    offsets = offsets.astype(np.int64, copy=False)
    if offsets[0] != 0 or offsets[-1] != len(values):
        raise InvalidEntryError(
            f"RaggedTokens offsets run from {int(offsets[0])} to {int(offsets[-1])}, not from 0 to the "
            f"{len(values)} values"
        )
    if values.dtype == np.int64 and offsets is ragged.offsets:
        return ragged
    return RaggedTokens(_as_int64(values, offsets), offsets)


#: Row types of the fast path of :func:`to_ragged` (what a tokenizer returns): their elements are checked in bulk.
_PLAIN_ROWS = frozenset((list, tuple))


def _pack_plain_rows(rows: list) -> Optional[RaggedTokens]:
    """Lists and tuples of token ids packed in bulk, or None when some element is not an int64 integer (the caller's
    general path then finds the first bad element and names it).

    Why this exists: a per-element type check in Python costs more than the whole trie build (~70% of
    ``from_sequences`` on 133k tokenized names). Here every element is converted by one C loop that accepts only
    what has ``__index__`` and fits in int64 (``array('q')``: floats, strings, None, numpy bools and oversized ints
    raise), so the one thing left to check is a ``bool`` (an ``int`` subclass, read as 0 or 1): only the positions
    whose value is 0 or 1 are looked at, one by one (real vocabularies give those ids to special tokens, rare in
    entries).
    """
    k = len(rows)
    offsets = np.zeros(k + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, rows), dtype=np.int64, count=k), out=offsets[1:])
    try:
        buf = array.array("q", list(itertools.chain.from_iterable(rows)))
    except (TypeError, OverflowError, ValueError):
        return None
    values = np.frombuffer(buf, dtype=np.int64) if len(buf) else np.zeros(0, dtype=np.int64)
    suspects = np.flatnonzero(values.view(np.uint64) <= 1)  # the positions holding 0 or 1
    if len(suspects):
        row_of = np.searchsorted(offsets, suspects, side="right") - 1
        for r, pos in zip(row_of.tolist(), (suspects - offsets[row_of]).tolist()):
            if not _is_integer(rows[r][pos]):
                return None
    return RaggedTokens(values, offsets)


def _is_integer(tok: Any) -> bool:
    """True for an integer token id: an int or numpy integer (not a bool), or a 0-d array or tensor holding one."""
    if isinstance(tok, bool) or not isinstance(tok, (int, np.integer)):
        if hasattr(tok, "item") and getattr(tok, "ndim", 1) == 0:
            value = tok.item()
            return isinstance(value, int) and not isinstance(value, bool)
        return False
    return True


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
            if not _is_integer(tok):
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


def token_paths(nodes: np.ndarray, parent: np.ndarray, token: np.ndarray, level_ptr: Any) -> RaggedTokens:
    """The token path from the root to each of ``nodes``, packed; vectorized over the nodes (a loop over depth only).
    The one walk up a breadth-first tree: a trie's entries (``TokenTrie.entry_tokens``) and a prefix dict's
    (:mod:`trie_decode.descriptors`).

    Args:
        nodes: node ids (the root's path is empty). Shape: (K,), integer.
        parent: each node's parent. Shape: (N,), integer.
        token: the token on the edge into each node. Shape: (N,), integer.
        level_ptr: the first node id of each depth, then N. Shape: (D+2,), integer.
    """
    nodes = np.asarray(nodes, dtype=np.int64)
    depth = np.searchsorted(level_ptr, nodes, side="right") - 1
    offsets = np.zeros(len(nodes) + 1, dtype=np.int64)
    np.cumsum(depth, out=offsets[1:])
    values = np.empty(int(offsets[-1]), dtype=np.int64)
    below_root = nodes > 0
    cur, pos = nodes[below_root], offsets[1:][below_root] - 1  # each path is written from its last token back
    while len(cur):
        values[pos] = token[cur]
        cur = parent[cur]
        alive = cur > 0
        cur, pos = cur[alive], pos[alive] - 1
    return RaggedTokens(values, offsets)


def build_arrays(ragged: RaggedTokens, vocab_size: int) -> BuiltArrays:
    """Build the CSR trie arrays from checked token sequences.

    Steps:
      1. Depth 0: the root's children are the distinct first tokens (a presence row over the vocabulary, no sort,
         unless the vocabulary is far wider than the input); the sequences are put in the order of their node (a
         radix sort of the node ids when they fit in 16 bits).
      2. Each further depth d: key = node * V + token for the sequences still alive, which are in the order of
         their node, so the keys are already ascending from one node's group to the next: a stable sort (timsort,
         which finds those runs) orders them, equal neighbours are one new node (boundaries from
         ``keys[1:] != keys[:-1]``, ids from ``cumsum``), numbered breadth-first with siblings sorted by token.
         Sequences that end at depth d record their node and leave.
      3. ``child_ptr`` is 1 + the running sum of children counts (a bincount of the nodes' parents).
      4. Equal sequences share a terminal node (duplicates): an entry per terminal node, numbered in the order of
         its first input (``minimum.at`` of the input index per node).
    """
    k = len(ragged)
    lengths = ragged.lengths
    max_depth = int(lengths.max())
    vocab = np.int64(vocab_size)
    seq = np.arange(k, dtype=np.int64)  # the sequences still alive, in the order of their node
    node = np.zeros(k, dtype=np.int64)  # the node of each of them
    end_node = np.empty(k, dtype=np.int64)
    parents: list[np.ndarray] = []
    tokens: list[np.ndarray] = [np.array([-1], dtype=np.int64)]
    level_ptr = [0, 1]
    next_id = 1
    for depth in range(max_depth):
        tok = ragged.values[ragged.offsets[seq] + depth]
        if depth == 0:
            if vocab_size <= max(1 << 20, 8 * k):  # a presence row over the vocabulary: no sort
                present = np.zeros(vocab_size, dtype=np.bool_)
                present[tok] = True
                uniq_tok = np.flatnonzero(present)
                inverse = (np.cumsum(present) - 1)[tok]
            else:  # a vocabulary far wider than the input: sort the first tokens instead
                uniq_tok, inverse = np.unique(tok, return_inverse=True)
                inverse = inverse.reshape(-1)
            order = np.argsort(inverse.astype(np.uint16) if len(uniq_tok) <= 1 << 16 else inverse, kind="stable")
            uniq_parent = np.zeros(len(uniq_tok), dtype=np.int64)
            seq, inverse = seq[order], inverse[order]
        else:
            keys = node * vocab + tok
            order = np.argsort(keys, kind="stable")
            keys, seq = keys[order], seq[order]
            new = np.empty(len(keys), dtype=np.bool_)
            new[0] = True
            np.not_equal(keys[1:], keys[:-1], out=new[1:])
            inverse = np.cumsum(new) - 1
            uniq = keys[new]
            uniq_parent, uniq_tok = uniq // vocab, uniq % vocab
        parents.append(uniq_parent)
        tokens.append(uniq_tok)
        node = next_id + inverse
        next_id += len(uniq_tok)
        if next_id > MAX_NODES:
            raise InvalidEntryError(f"the trie would exceed {MAX_NODES} nodes; split the entries into several tries")
        level_ptr.append(next_id)
        ends = lengths[seq] == depth + 1
        end_node[seq[ends]] = node[ends]
        alive = ~ends
        seq, node = seq[alive], node[alive]

    num_nodes = next_id
    parent = np.concatenate(parents)
    counts = np.bincount(parent, minlength=num_nodes)
    child_ptr = np.empty(num_nodes + 1, dtype=np.int64)
    child_ptr[0] = 1
    np.cumsum(counts, out=child_ptr[1:])
    child_ptr[1:] += 1

    inputs = np.arange(k, dtype=np.int64)
    first_input = np.full(num_nodes, k, dtype=np.int64)
    np.minimum.at(first_input, end_node, inputs)
    entry_source = np.flatnonzero(first_input[end_node] == inputs)  # ascending: entries in order of first use
    entry_node = end_node[entry_source]
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
