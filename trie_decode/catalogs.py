"""Semantic-id catalogs: tries built from integer code arrays (TIGER-style ids), with every item of every id kept.

Why this exists: generative retrieval and recommendation (TIGER, OneRec, STATIC) give each item a short code, one
integer per level; level l's code c is a token id (new special tokens, or a given offset table). Catalogs are big
(10M items) and many items can share a code (collisions): the trie must build in seconds and an entry must keep
every item it stands for. The generic builder handles any token sequences with one ``np.unique`` per depth over
(parent, token) pairs; fixed-length codes need less. The whole code and the item's index usually fit one int64,
so one plain ``np.sort`` of those integers (several times faster than an argsort) orders the items by token path
and, within a code, by input order. Everything else is linear passes: the distinct codes are the entries, the
distinct prefixes are every level's nodes (already in breadth-first order with siblings sorted by token), and
entry numbers and items come from a cumsum, one gather and one scatter (10M items x 4 levels in about 1 s, about
11 bare sorts of 10M int64). Codes too wide for one int64 take a stable lexsort of the columns instead.

Example:
    >>> import numpy as np
    >>> from trie_decode.catalogs import catalog_from_codes, items_of
    >>> codes = np.array([[3, 1], [3, 2], [3, 1], [0, 5]])          # item 2 collides with item 0
    >>> trie = catalog_from_codes(codes, codebook_size=8, token_offset=100, vocab_size=200)
    >>> trie.num_entries, trie.sequences()[0]
    (3, (103, 109))
    >>> items_of(trie, trie.lookup([103, 109]).index).tolist()
    [0, 2]

Dimension letters: N items, L levels, E entries (distinct codes), K nodes.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence, Union

import numpy as np

from .entries import (ITEM_IDS, ITEM_KEYS_BLOB, ITEM_KEYS_OFFSETS, ITEM_PTR, StringTable, catalog_key_table, check_keys,
                      entry_column)
from .errors import InvalidEntryError, InvalidTokenError
from .options import token_id
from .trie import VOCAB_SIZE, TokenTrie, check_fingerprint, check_vocab_size

__all__ = ["catalog_from_codes", "items_of", "item_keys_of", "item_entries", "item_key_table", "compacted_items"]


def _level_ints(value: Any, name: str, levels: int) -> np.ndarray:
    """``value`` (one integer, or one per level) as an int64 array of one per level, or a named error: not integers
    (a float, a bool, an int too large for int64), or a length other than ``levels``. Shape: (L,), int64."""
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu" or (arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max):
        raise InvalidEntryError(f"{name} must be integers (one, or one per level) that fit int64, got {value!r:.60}")
    if arr.ndim > 1 or (arr.ndim == 1 and len(arr) != levels):
        raise InvalidEntryError(f"{name} must give one integer, or one per level ({levels}), got shape {arr.shape}")
    return np.broadcast_to(arr.astype(np.int64), (levels,))


def catalog_from_codes(
    codes: np.ndarray,
    *,
    vocab_size: int,
    codebook_size: Union[int, Sequence[int], None] = None,
    token_offset: int = 0,
    level_offsets: Optional[Sequence[int]] = None,
    keys: Optional[Iterable[str]] = None,
    fingerprint: str = "",
) -> TokenTrie:
    """Build a trie from semantic ids.

    Args:
        codes: item i's code at level l. Shape: (N, L), integer.
        vocab_size: the model's vocabulary (every token must be below it).
        codebook_size: codes per level (one for all levels, or one per level); level l's code c is token
            ``token_offset + sum(codebook_size[:l]) + c``. Give this or ``level_offsets``.
        token_offset: the first level's first token (e.g. the id of the first added special token).
        level_offsets: the token of code 0 at each level, instead of ``codebook_size``/``token_offset``.
            Shape: (L,).
        keys: optional external id per item (the entry's key is its first item's; :func:`item_keys_of` gives all).
        fingerprint: the tokenizer's fingerprint, if known.

    Returns:
        A :class:`~trie_decode.TokenTrie` whose entries are the distinct codes, numbered by first appearance; its
        ``extra`` arrays list each entry's items (:func:`items_of`), saved and loaded with the trie.

    Raises:
        InvalidEntryError: not a 2-D integer array, no item, or a negative code or one outside its codebook; a
            ``fingerprint`` that is not a string.
        InvalidTokenError: a token outside ``[0, vocab_size)``.
    """
    try:
        codes = np.asarray(codes)
    except ValueError as exc:  # nested lists of different lengths
        raise InvalidEntryError(f"codes must be a 2-D integer array (items x levels), got rows of different lengths "
                                f"({type(codes).__name__})") from exc
    except TypeError as exc:  # a tensor dtype numpy has no counterpart for (bfloat16): not an integer dtype
        raise InvalidEntryError(f"codes must be a 2-D integer array (items x levels), got {codes.dtype}") from exc
    if codes.ndim != 2 or not np.issubdtype(codes.dtype, np.integer):
        raise InvalidEntryError(f"codes must be a 2-D integer array (items x levels), got {codes.dtype} {codes.shape}")
    n, levels = codes.shape
    if n == 0 or levels == 0:
        raise InvalidEntryError(f"codes has shape {codes.shape}: a catalog needs at least one item and one level")
    check_vocab_size(vocab_size, VOCAB_SIZE)
    check_fingerprint(fingerprint)
    if keys is not None:
        keys = entry_column(keys, "keys", n, "rows of codes")
        check_keys(keys)
    if codes.dtype == np.uint64 and int(codes.max()) >= 1 << 62:
        raise InvalidEntryError(f"codes hold {int(codes.max())}, outside any codebook")
    codes = codes.astype(np.int64, copy=False) if codes.dtype == np.uint64 else codes
    # Whole-array reductions first (contiguous: fast); per-level ones (strided) only when needed.
    if int(codes.min()) < 0:
        raise InvalidEntryError(f"level {int(np.flatnonzero(_per_level(codes, np.min) < 0)[0])} holds a negative code")
    highest = int(codes.max())
    # Checked first, in both forms: beside level_offsets, an array compared with 0 failed inside numpy.
    token_id(token_offset, "token_offset", VOCAB_SIZE, below=vocab_size)  # InvalidTokenError
    if level_offsets is None:
        if codebook_size is None:
            raise InvalidEntryError("give codebook_size (codes per level) or level_offsets (token of code 0 per level)")
        sizes = _level_ints(codebook_size, "codebook_size", levels)
        if (sizes < 1).any():
            raise InvalidEntryError(f"codebook_size must be at least 1 per level, got {codebook_size!r}")
        high = np.minimum(sizes - 1, highest)  # a bound on each level's largest code
        if highest >= int(sizes.min()):
            high = _per_level(codes, np.max)
            if (high >= sizes).any():
                bad = int(np.flatnonzero(high >= sizes)[0])
                raise InvalidEntryError(
                    f"level {bad} holds code {int(high[bad])}, outside its codebook of {int(sizes[bad])}")
        offsets = token_offset + np.concatenate([[0], np.cumsum(sizes)[:-1]])
    else:
        if codebook_size is not None or token_offset != 0:  # level_offsets places every level: they would be ignored
            raise InvalidEntryError("give codebook_size (and token_offset) or level_offsets, not both")
        if np.shape(level_offsets) != (levels,):
            raise InvalidEntryError(f"level_offsets has shape {np.shape(level_offsets)}, expected ({levels},)")
        offsets = _level_ints(level_offsets, "level_offsets", levels)
        high = _per_level(codes, np.max)
        sizes = high + 1
    if int(offsets.min()) < 0:
        raise InvalidTokenError(f"the codes map to tokens outside the vocabulary [0, {vocab_size}) (negative offset)")
    # A token is its level's offset plus a code, both >= 0: either one at or past the vocabulary puts the token
    # outside it (checked first, so that the sum below cannot wrap around in int64 and look small).
    outside = int(offsets.max()) >= vocab_size or highest >= vocab_size
    if outside or int((offsets + high).max()) >= vocab_size:  # ``high`` may be a bound: check the exact maxima
        if outside or int((offsets + _per_level(codes, np.max)).max()) >= vocab_size:
            raise InvalidTokenError(f"the codes map to tokens outside the vocabulary [0, {vocab_size})")
    bits = np.array([max(int(s - 1).bit_length(), 1) for s in sizes], dtype=np.int64)
    # 1. Sort the items by code (ties by item index: a code's first item comes first) and find the distinct codes.
    if int(bits.sum()) + max(int(n - 1).bit_length(), 1) <= 63:
        order, first, gap, thresholds, code_at = _sort_packed(codes, bits)
    else:
        order, first, gap, thresholds, code_at = _sort_wide(codes)
    e = len(first)
    # 2. Each level's nodes are the distinct prefixes of the sorted codes, already in breadth-first order with
    #    siblings by token: level l's nodes start at the codes j where ``gap[j] >= thresholds[l]`` (code j differs
    #    from code j-1 at level l or above). Deepest level first: each level's starts are a subset of the level
    #    below's, so the work shrinks going up, and a node's children are the starts below it up to its sibling's.
    starts: list[Optional[np.ndarray]] = [None] * levels  # each node's position in the distinct codes (None: all)
    fanouts = [np.zeros(e, dtype=np.int64)]  # the deepest level's nodes have no children
    below_gap = gap
    for level in range(levels - 2, -1, -1):
        head = np.flatnonzero(below_gap >= thresholds[level])
        below = starts[level + 1]
        fanouts.append(np.diff(head, append=len(below_gap)))
        starts[level] = head if below is None else below[head]
        below_gap = below_gap[head]
    fanouts.append(np.array([len(below_gap)], dtype=np.int64))  # the root's children: the first level's nodes
    count = [1] + [e if s_ is None else len(s_) for s_ in starts]
    level_ptr = np.concatenate([[0], np.cumsum(count)]).astype(np.int64)
    child_ptr = np.zeros(int(level_ptr[-1]) + 1, dtype=np.int32)  # the trie's dtypes directly: no cast afterwards
    np.cumsum(np.concatenate(fanouts[::-1]), dtype=np.int32, out=child_ptr[1:])
    child_ptr += 1  # the root is node 0: the first child is node 1
    token = np.empty(int(level_ptr[-1]), dtype=np.int32)
    token[0] = -1
    for level in range(levels):
        np.add(code_at(level, starts[level]), offsets[level], out=token[level_ptr[level + 1] : level_ptr[level + 2]],
               casting="unsafe")
    leaf0 = int(level_ptr[levels])  # the deepest level's nodes are the distinct codes, in sorted order
    # 3. Entries, numbered by first appearance in the input (as every builder does). A code's first item is its
    #    smallest (ties were sorted by index); the entry of first item i is i minus the number of *later* items
    #    (items whose code appeared before) below i. Later items are few: one sparse mask and a cumsum, no sort.
    #    The code -> entry map and its inverse are then one gather and one scatter.
    size = np.diff(first, append=n)
    shared = np.flatnonzero(size > 1)  # codes that several items share
    extra = size[shared] - 1  # their later items
    within = np.arange(int(extra.sum()), dtype=np.int64) - np.repeat(np.cumsum(extra) - extra, extra)
    later = np.take(order, np.repeat(first[shared] + 1, extra) + within)  # in sorted order: by code, then index
    if e == n:  # no two items share a code: entry i is item i
        entry_rank, first_items = order, np.arange(n, dtype=np.int64)
    else:
        is_later = np.zeros(n, dtype=bool)
        is_later[later] = True
        first_item = np.take(order, first)
        before = np.cumsum(is_later, dtype=np.int32 if n < 2**31 else np.int64)  # int32: half the random reads
        entry_rank = first_item - np.take(before, first_item)
        first_items = np.flatnonzero(~is_later)  # each entry's first item, in entry order
    entry_node = np.empty(e, dtype=np.int32)  # the leaf of each entry: the inverse of entry_rank, as node ids
    entry_node[entry_rank] = np.arange(leaf0, leaf0 + e, dtype=np.int32)
    node_entry = np.full(len(token), -1, dtype=np.int32)
    node_entry[leaf0:] = entry_rank
    # 4. Items of each entry, in input order: its first item, then the later items of its code.
    item_ptr, item_ids = _entry_items(first_items, later, np.repeat(np.take(entry_rank, shared), extra), within, n)
    all_keys = key_table = None
    if keys is not None:
        all_keys = StringTable.from_strings([str(k) for k in keys], "key")
        key_table = all_keys.take(first_items)
    trie = TokenTrie(
        child_ptr=child_ptr,
        token=token,
        node_entry=node_entry,
        entry_node=entry_node,
        level_ptr=level_ptr,
        vocab_size=int(vocab_size),
        keys=key_table,
        fingerprint=fingerprint,
        options={"source": "semantic_ids", "levels": int(levels)},
        num_duplicates=n - e,
    )
    trie.extra = {ITEM_PTR: item_ptr, ITEM_IDS: item_ids}
    if all_keys is not None:
        trie.extra.update({ITEM_KEYS_BLOB: all_keys.blob, ITEM_KEYS_OFFSETS: all_keys.offsets})
    return trie


def _per_level(codes: np.ndarray, reduce: Callable) -> np.ndarray:
    """``reduce`` of each level's codes, column by column (a reduction over axis 0 of an (N, L) array with small L
    is several times slower). Shape: (L,), int64."""
    return np.array([int(reduce(codes[:, level])) for level in range(codes.shape[1])], dtype=np.int64)


_Sorted = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, Callable]  # order, first, gap, thresholds, code_at


def _sort_packed(codes: np.ndarray, bits: np.ndarray) -> _Sorted:
    """Sort by code when the code and the item index fit one int64: one plain ``np.sort`` of
    ``code << index_bits | index`` (several times faster than an argsort of the code), packed by one integer matmul.

    Returns:
        order: the items in sorted order. Shape: (N,), int64.
        first: where each distinct code starts in ``order``. Shape: (E,), int64.
        gap: how far distinct code j is from code j-1 (their XOR; the largest int64 for j = 0). Shape: (E,), int64.
        thresholds: code j starts a new level-l node iff ``gap[j] >= thresholds[l]``. Shape: (L,), int64.
        code_at: ``code_at(level, positions)``, the level's codes of the distinct codes at those positions (None:
            all).
    """
    n, levels = codes.shape
    shifts = np.concatenate([np.cumsum(bits[::-1])[::-1][1:], [0]]).astype(np.int64)
    index_bits = max(int(n - 1).bit_length(), 1)
    packed = codes @ (np.int64(1) << (shifts + index_bits))  # bit fields do not overlap: the sum is their OR
    packed |= np.arange(n, dtype=np.int64)
    packed.sort()
    order = packed & ((1 << index_bits) - 1)
    packed >>= index_bits
    first = np.flatnonzero(packed[1:] != packed[:-1]) + 1
    first = np.concatenate([np.zeros(1, dtype=np.int64), first])
    uniq = packed[first]
    gap = np.empty(len(first), dtype=np.int64)
    gap[0] = np.iinfo(np.int64).max
    np.bitwise_xor(uniq[1:], uniq[:-1], out=gap[1:])
    masks = (np.int64(1) << bits) - 1

    def code_at(level: int, positions: Optional[np.ndarray]) -> np.ndarray:
        chosen = uniq if positions is None else uniq[positions]
        return (chosen >> int(shifts[level])) & int(masks[level])

    return order, first, gap, np.int64(1) << shifts, code_at


def _sort_wide(codes: np.ndarray) -> _Sorted:
    """Sort by code when the code does not fit one int64 (large codebooks, many levels): a stable lexsort of the
    columns. Returns what :func:`_sort_packed` returns; ``gap`` is L minus the first level where codes differ."""
    n, levels = codes.shape
    order = np.lexsort(codes.T[::-1]).astype(np.int64)
    ranked = codes[order]
    differs = ranked[1:] != ranked[:-1]  # (N-1, L)
    new = differs.any(axis=1)
    first = np.concatenate([np.zeros(1, dtype=np.int64), np.flatnonzero(new) + 1])
    uniq = ranked[first]
    gap = np.full(len(first), levels + 1, dtype=np.int64)
    gap[1:] = levels - differs[new].argmax(axis=1)

    def code_at(level: int, positions: Optional[np.ndarray]) -> np.ndarray:
        return (uniq[:, level] if positions is None else uniq[positions, level]).astype(np.int64)

    return order, first, gap, levels - np.arange(levels, dtype=np.int64), code_at


def _entry_items(first_items: np.ndarray, later: np.ndarray, later_entry: np.ndarray, within: np.ndarray,
                 n: int) -> tuple[np.ndarray, np.ndarray]:
    """Each entry's items in input order, as CSR: ``item_ids[item_ptr[e]:item_ptr[e + 1]]``.

    Args:
        first_items: each entry's first item, in entry order. Shape: (E,).
        later: the other items, grouped by code, in input order within a code. Shape: (N - E,).
        later_entry: the entry of each of them. within: its position among its code's later items. Shape: (N - E,).
        n: N.
    """
    e = len(first_items)
    if e == n:
        return np.arange(n + 1, dtype=np.int64), first_items
    item_ptr = np.zeros(e + 1, dtype=np.int64)
    np.cumsum(np.bincount(later_entry, minlength=e) + 1, out=item_ptr[1:])
    item_ids = np.empty(n, dtype=np.int64)
    item_ids[item_ptr[:-1]] = first_items
    item_ids[item_ptr[later_entry] + 1 + within] = later
    return item_ptr, item_ids


def _item_lists(trie: TokenTrie) -> tuple[np.ndarray, np.ndarray]:
    """A catalog's item lists ``(ITEM_PTR, ITEM_IDS)``: the items of entry e are ``ids[ptr[e]:ptr[e + 1]]``."""
    if ITEM_PTR not in trie.extra:
        raise InvalidEntryError("this trie is not a catalog (built by catalog_from_codes)")
    return trie.extra[ITEM_PTR], trie.extra[ITEM_IDS]


def items_of(trie: TokenTrie, entry: int) -> np.ndarray:
    """The items (row indices of the codes array) that entry ``entry`` stands for, in input order.

    Raises:
        InvalidEntryError: not a catalog, or ``entry`` is not an integer. IndexError: ``entry`` is out of range.

    Example:
        >>> import numpy as np
        >>> trie = catalog_from_codes(np.array([[1, 2], [0, 3], [1, 2]]), codebook_size=4, vocab_size=8)
        >>> items_of(trie, 0).tolist()
        [0, 2]
    """
    ptr, ids = _item_lists(trie)
    entry = trie._check_entry(entry)  # a catalog has one item list per entry (catalog_problem)
    return ids[ptr[entry] : ptr[entry + 1]]


def item_keys_of(trie: TokenTrie, entry: int) -> list[str]:
    """The keys of every item of entry ``entry`` (catalogs built with ``keys``), in input order.

    Also ``trie.entry(entry).item_keys``, and so on every entry that ``match``/``rank`` return.

    Example:
        >>> import numpy as np
        >>> trie = catalog_from_codes(np.array([[1, 2], [0, 3], [1, 2]]), codebook_size=4, vocab_size=8,
        ...                           keys=["a", "b", "c"])
        >>> item_keys_of(trie, 0), trie.entry(0).item_keys
        (['a', 'c'], ('a', 'c'))
    """
    table = item_key_table(trie)
    if table is None:
        raise InvalidEntryError("this catalog was built without item keys")
    return [table[int(i)] for i in items_of(trie, entry)]


def item_entries(trie: TokenTrie) -> np.ndarray:
    """The entry of every item of a catalog (items that share a code share an entry; -1: an item removed from a live
    catalog, held by no entry). Shape: (N,), int64.

    Example:
        >>> import numpy as np
        >>> trie = catalog_from_codes(np.array([[1, 2], [0, 3], [1, 2]]), codebook_size=4, vocab_size=8)
        >>> item_entries(trie).tolist()
        [0, 1, 0]
    """
    ptr, ids = _item_lists(trie)
    held = int(ptr[-1])  # the items after it are held by no entry (removed from a live catalog): -1
    out = np.full(len(ids), -1, dtype=np.int64)
    out[ids[:held]] = np.repeat(np.arange(len(ptr) - 1, dtype=np.int64), np.diff(ptr))
    return out


def item_key_table(trie: TokenTrie) -> Optional[StringTable]:
    """Every item's key, in item order (None for a catalog built without keys, or a trie that is not a catalog)."""
    return catalog_key_table(trie.extra)


def compacted_items(trie: TokenTrie, kept: np.ndarray, num_added: int = 0,
                    added_keys: Optional[Sequence[str]] = None) -> dict[str, np.ndarray]:
    """The catalog arrays of a trie made of the entries ``kept`` of catalog ``trie`` (in that order), then
    ``num_added`` added entries (a live catalog's compaction, :mod:`trie_decode.live`); empty for a trie that is not
    a catalog. Items keep their numbers (rows of the codes array): the kept entries keep their items, each added entry
    is one new item numbered after every item of ``trie`` (with its key), and the items of the other entries are held
    by no entry (after ``ITEM_PTR[-1]``: their keys stay known to filters, and name nothing).

    Args:
        kept: entries of ``trie``, distinct. Shape: (K,), int64.
        num_added: the entries added after them.
        added_keys: their keys (needed when the catalog has item keys).

    Raises:
        InvalidEntryError: entries added to a catalog with item keys, without their keys.

    Example:
        >>> import numpy as np
        >>> trie = catalog_from_codes(np.array([[1, 2], [0, 3], [1, 2]]), codebook_size=4, vocab_size=8,
        ...                           keys=["a", "b", "c"])
        >>> arrays = compacted_items(trie, np.array([0]), 1, ["d"])
        >>> arrays["catalog_item_ptr"].tolist(), arrays["catalog_item_ids"].tolist()
        ([0, 2, 3], [0, 2, 3, 1])
    """
    if ITEM_PTR not in trie.extra:
        return {}
    ptr, ids = _item_lists(trie)
    table = item_key_table(trie)
    kept = np.asarray(kept, dtype=np.int64)
    n, added = len(ids), int(num_added)
    counts = np.diff(ptr)[kept]
    new_ptr = np.zeros(len(kept) + added + 1, dtype=np.int64)
    np.cumsum(np.concatenate([counts, np.ones(added, dtype=np.int64)]), out=new_ptr[1:])
    start = new_ptr[: len(kept)]
    kept_items = ids[np.repeat(ptr[kept] - start, counts) + np.arange(int(counts.sum()), dtype=np.int64)]
    held = np.zeros(n, dtype=np.bool_)
    held[kept_items] = True
    new_ids = np.concatenate([kept_items, np.arange(n, n + added, dtype=np.int64), np.flatnonzero(~held)])
    out = {ITEM_PTR: new_ptr, ITEM_IDS: new_ids}
    if table is not None:
        if (added_keys is None and added) or (added_keys is not None and len(added_keys) != added):
            raise InvalidEntryError("the catalog has item keys: every added entry needs a key")
        keys = table if not added else StringTable.concat([table, StringTable.from_strings(list(added_keys or []))])
        out.update({ITEM_KEYS_BLOB: keys.blob, ITEM_KEYS_OFFSETS: keys.offsets})
    return out
