"""Semantic-id catalogs: tries built from integer code arrays (TIGER-style ids), with every item of every id kept.

Why this exists: generative retrieval and recommendation (TIGER, OneRec, STATIC) give each item a short code, one
integer per level; level l's code c is a token id (new special tokens, or a given offset table). Catalogs are big
(10M items) and many items can share a code (collisions): the trie must build in seconds and an entry must keep
every item it stands for. The generic builder handles any token sequences with one ``np.unique`` per depth over
(parent, token) pairs; for fixed-length codes with small codebooks the whole code fits one int64, so one sort of
those keys gives the entries, every level's nodes (the distinct prefixes, already in breadth-first order with
siblings sorted by token) and the items of each entry.

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

from typing import Optional, Sequence, Union

import numpy as np

from .entries import StringTable
from .errors import InvalidEntryError, InvalidTokenError
from .trie import MAX_VOCAB_SIZE, TokenTrie

__all__ = ["catalog_from_codes", "items_of", "item_keys_of"]

ITEM_PTR, ITEM_IDS = "catalog_item_ptr", "catalog_item_ids"


def catalog_from_codes(
    codes: np.ndarray,
    *,
    vocab_size: int,
    codebook_size: Union[int, Sequence[int], None] = None,
    token_offset: int = 0,
    level_offsets: Optional[Sequence[int]] = None,
    keys: Optional[Sequence[str]] = None,
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
        InvalidEntryError: not a 2-D integer array, no item, or a negative code or one outside its codebook.
        InvalidTokenError: a token outside ``[0, vocab_size)``.
    """
    codes = np.asarray(codes)
    if codes.ndim != 2 or not np.issubdtype(codes.dtype, np.integer):
        raise InvalidEntryError(f"codes must be a 2-D integer array (items x levels), got {codes.dtype} {codes.shape}")
    n, levels = codes.shape
    if n == 0 or levels == 0:
        raise InvalidEntryError(f"codes has shape {codes.shape}: a catalog needs at least one item and one level")
    if isinstance(vocab_size, bool) or not 0 < int(vocab_size) <= MAX_VOCAB_SIZE:
        raise InvalidTokenError(f"vocab_size must be an integer in [1, 2**31], got {vocab_size!r}")
    if keys is not None and len(keys) != n:
        raise InvalidEntryError(f"keys has {len(keys)} items but codes has {n} rows")
    low = codes.min(axis=0)
    high = codes.max(axis=0)
    if (low < 0).any():
        raise InvalidEntryError(f"level {int(np.flatnonzero(low < 0)[0])} holds a negative code")
    if level_offsets is None:
        if codebook_size is None:
            raise InvalidEntryError("give codebook_size (codes per level) or level_offsets (token of code 0 per level)")
        sizes = np.broadcast_to(np.asarray(codebook_size, dtype=np.int64), (levels,))
        if (high >= sizes).any():
            bad = int(np.flatnonzero(high >= sizes)[0])
            raise InvalidEntryError(f"level {bad} holds code {int(high[bad])}, outside its codebook of {int(sizes[bad])}")
        offsets = token_offset + np.concatenate([[0], np.cumsum(sizes)[:-1]])
    else:
        offsets = np.asarray(level_offsets, dtype=np.int64)
        if offsets.shape != (levels,):
            raise InvalidEntryError(f"level_offsets has shape {offsets.shape}, expected ({levels},)")
        sizes = high + 1
    if int((offsets + high).max()) >= vocab_size or int(offsets.min()) < 0:
        raise InvalidTokenError(f"the codes map to tokens outside the vocabulary [0, {vocab_size})")
    bits = np.array([max(int(s - 1).bit_length(), 1) for s in np.maximum(sizes, high + 1)], dtype=np.int64)
    if bits.sum() > 62:
        return _generic(codes, offsets, vocab_size, keys, fingerprint)
    shifts = np.concatenate([np.cumsum(bits[::-1])[::-1][1:], [0]])
    # 1. One int64 per item; sorting it sorts the items lexicographically by code, i.e. by token path.
    key = np.zeros(n, dtype=np.int64)
    for level in range(levels):
        key |= codes[:, level].astype(np.int64) << shifts[level]
    order = np.argsort(key, kind="stable")
    sorted_key = key[order]
    new_entry = np.empty(n, dtype=bool)
    new_entry[0] = True
    np.not_equal(sorted_key[1:], sorted_key[:-1], out=new_entry[1:])
    first = np.flatnonzero(new_entry)  # start of each distinct code in the sorted items
    uniq = sorted_key[first]  # (E,) ascending
    e = len(uniq)
    # 2. Each level's nodes: the distinct prefixes of the sorted codes (breadth-first order, siblings by token).
    node_count = [1]
    parent_of_entry = np.zeros(e, dtype=np.int64)  # the node of each code's prefix at the current depth
    tokens = [np.array([-1], dtype=np.int64)]
    child_counts = []
    level_start = 1
    for level in range(levels):
        prefix = uniq >> shifts[level]
        is_new = np.empty(e, dtype=bool)
        is_new[0] = True
        np.not_equal(prefix[1:], prefix[:-1], out=is_new[1:])
        starts = np.flatnonzero(is_new)
        ids = np.cumsum(is_new) - 1 + level_start  # node id of each code's prefix at this depth
        parents = parent_of_entry[starts]
        code = (prefix[starts] & ((1 << bits[level]) - 1))
        tokens.append(code + offsets[level])
        child_counts.append(np.bincount(parents - (level_start - node_count[-1]), minlength=node_count[-1]))
        parent_of_entry = ids
        node_count.append(len(starts))
        level_start += len(starts)
    total = level_start
    fanout = np.concatenate(child_counts + [np.zeros(node_count[-1], dtype=np.int64)])
    child_ptr = np.empty(total + 1, dtype=np.int64)
    child_ptr[0] = 1
    np.cumsum(fanout, out=child_ptr[1:])
    child_ptr[1:] += 1
    # 3. Entries, numbered by first appearance in the input (as every builder does); their leaves.
    first_item = order[first]  # earliest item of each code (stable sort: the first occurrence)
    entry_rank = np.empty(e, dtype=np.int64)
    entry_rank[np.argsort(first_item, kind="stable")] = np.arange(e)  # code (sorted) -> entry index
    leaf = parent_of_entry  # node id of each sorted code at the last level
    node_entry = np.full(total, -1, dtype=np.int32)
    node_entry[leaf] = entry_rank
    entry_node = np.empty(e, dtype=np.int32)
    entry_node[entry_rank] = leaf
    level_ptr = np.concatenate([[0], np.cumsum(node_count)]).astype(np.int64)
    # 4. Items of each entry, in input order within an entry.
    # The sorted items are grouped by code already; lay the groups out in entry order (no second sort).
    size = np.diff(np.append(first, n))
    code_of_entry = np.argsort(entry_rank)
    lengths = size[code_of_entry]
    item_ptr = np.zeros(e + 1, dtype=np.int64)
    np.cumsum(lengths, out=item_ptr[1:])
    item_ids = order[np.repeat(first[code_of_entry] - item_ptr[:-1], lengths) + np.arange(n)].astype(np.int64)
    key_table = None
    if keys is not None:
        key_table = StringTable.from_strings([str(keys[i]) for i in first_item[code_of_entry]])
    trie = TokenTrie(
        child_ptr=child_ptr.astype(np.int32),
        token=np.concatenate(tokens).astype(np.int32),
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
    if keys is not None:
        all_keys = StringTable.from_strings([str(k) for k in keys])
        trie.extra.update({"catalog_item_keys_blob": all_keys.blob, "catalog_item_keys_offsets": all_keys.offsets})
    return trie


def _generic(codes: np.ndarray, offsets: np.ndarray, vocab_size: int, keys: Optional[Sequence[str]], fingerprint: str) -> TokenTrie:
    """Codes too wide for one int64: the generic builder, then the items per entry from the tokens."""
    tokens = codes.astype(np.int64) + offsets
    trie = TokenTrie.from_sequences(tokens, int(vocab_size), keys=keys, fingerprint=fingerprint,
                                    options={"source": "semantic_ids", "levels": int(codes.shape[1])})
    node = np.zeros(len(tokens), dtype=np.int64)
    for level in range(tokens.shape[1]):
        lo, hi = trie.child_ptr[node], trie.child_ptr[node + 1]
        node = lo + np.array([np.searchsorted(trie.token[a:b], t) for a, b, t in zip(lo, hi, tokens[:, level])])
    item_entry = trie.node_entry[node].astype(np.int64)
    by_entry = np.argsort(item_entry, kind="stable")
    item_ptr = np.zeros(trie.num_entries + 1, dtype=np.int64)
    np.cumsum(np.bincount(item_entry, minlength=trie.num_entries), out=item_ptr[1:])
    trie.extra = {ITEM_PTR: item_ptr, ITEM_IDS: by_entry.astype(np.int64)}
    return trie


def items_of(trie: TokenTrie, entry: int) -> np.ndarray:
    """The items (row indices of the codes array) that entry ``entry`` stands for, in input order."""
    if ITEM_PTR not in trie.extra:
        raise InvalidEntryError("this trie is not a catalog (built by catalog_from_codes)")
    ptr, ids = trie.extra[ITEM_PTR], trie.extra[ITEM_IDS]
    if not 0 <= entry < len(ptr) - 1:
        raise IndexError(f"entry {entry} is not in this catalog ({len(ptr) - 1} entries)")
    return ids[ptr[entry] : ptr[entry + 1]]


def item_keys_of(trie: TokenTrie, entry: int) -> list[str]:
    """The keys of every item of entry ``entry`` (catalogs built with ``keys``)."""
    if "catalog_item_keys_blob" not in trie.extra:
        raise InvalidEntryError("this catalog was built without item keys")
    table = StringTable(trie.extra["catalog_item_keys_blob"], trie.extra["catalog_item_keys_offsets"])
    return [table[int(i)] for i in items_of(trie, entry)]
