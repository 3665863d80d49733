"""Entry payloads: the name and the optional external key of every trie entry, in flat UTF-8 arrays.

Why this exists: an entry's tokens say what the model generated; users want back *which* entry it was (an
entity name, a document id, an enum value). Storing a million Python strings would defeat memory-mapping, so the
strings live in one UTF-8 byte blob with offsets, decoded only when an entry is looked up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np

__all__ = ["Entry", "StringTable", "catalog_item_keys"]


@dataclass(frozen=True)
class Entry:
    """One entry of a trie.

    Attributes:
        index: the entry's index in the trie (entries are numbered by first appearance in the input).
        name: the entry's text (the string it was built from, or the descriptor's leaf name), or None.
        key: the entry's external id (e.g. the ``id`` field of a JSONL line), or None.
        tokens: the entry's token ids.
        item_keys: in a catalog built with item keys (:func:`~trie_decode.catalogs.catalog_from_codes`), the keys
            of every item the entry stands for, in input order (several when items share one semantic id; ``key``
            is the first); None otherwise.
    """

    index: int
    name: Optional[str]
    key: Optional[str]
    tokens: tuple[int, ...]
    item_keys: Optional[tuple[str, ...]] = None


class StringTable:
    """An immutable table of strings in one UTF-8 blob.

    Args:
        blob: the concatenated UTF-8 bytes. Shape: (bytes,), dtype uint8.
        offsets: start of each string in ``blob``, plus the end. Shape: (K+1,), dtype int64.
    """

    __slots__ = ("blob", "offsets")

    def __init__(self, blob: np.ndarray, offsets: np.ndarray) -> None:
        self.blob = blob
        self.offsets = offsets

    @classmethod
    def from_strings(cls, strings: Sequence[str]) -> "StringTable":
        encoded = [s.encode("utf-8") for s in strings]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)), out=offsets[1:])
        blob = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        return cls(blob, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> str:
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.blob[start:end].tobytes().decode("utf-8")

    def to_list(self) -> list[str]:
        # One decode of the whole blob when it is ASCII (byte offsets are then character offsets); else one decode
        # per string from one bytes object. Either is several times faster than indexing the table string by string.
        raw = self.blob.tobytes()
        bounds = self.offsets.tolist()
        text = raw.decode("utf-8")
        source = text if len(text) == len(raw) else raw
        out = [source[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        return out if source is text else [b.decode("utf-8") for b in out]

    def take(self, index: np.ndarray) -> "StringTable":
        """Strings ``index`` as a new table (one vectorized byte gather, no Python loop over strings).

        Args:
            index: Shape: (K,), integer.
        """
        index = np.asarray(index, dtype=np.int64)
        start, stop = self.offsets[index], self.offsets[index + 1]
        lengths = stop - start
        offsets = np.zeros(len(index) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        gather = np.repeat(start - offsets[:-1], lengths) + np.arange(int(offsets[-1]), dtype=np.int64)
        return StringTable(self.blob[gather], offsets)

    @staticmethod
    def concat(tables: Sequence["StringTable"]) -> "StringTable":
        """The strings of ``tables``, one table after the other."""
        blobs = [t.blob for t in tables]
        shifts = np.cumsum([0] + [len(b) for b in blobs[:-1]])
        offsets = np.concatenate([np.zeros(1, dtype=np.int64)] + [t.offsets[1:] + s for t, s in zip(tables, shifts)])
        return StringTable(np.concatenate(blobs) if blobs else np.zeros(0, np.uint8), offsets.astype(np.int64))


# A semantic-id catalog (trie_decode.catalogs) keeps its items in the trie's extra arrays: the items of entry e are
# ITEM_IDS[ITEM_PTR[e] : ITEM_PTR[e + 1]] (rows of the codes array), and their keys, when given, a StringTable in
# item order. The layout is here, below the trie, so that an entry can carry its item keys.
ITEM_PTR, ITEM_IDS = "catalog_item_ptr", "catalog_item_ids"
ITEM_KEYS_BLOB, ITEM_KEYS_OFFSETS = "catalog_item_keys_blob", "catalog_item_keys_offsets"


def catalog_item_keys(extra: Mapping[str, np.ndarray], entry: int) -> Optional[tuple[str, ...]]:
    """The keys of every item of entry ``entry`` of a catalog built with keys, in input order; None for any other
    trie (``Entry.item_keys``)."""
    if ITEM_KEYS_BLOB not in extra or ITEM_PTR not in extra:
        return None
    ptr, ids = extra[ITEM_PTR], extra[ITEM_IDS]
    table = StringTable(extra[ITEM_KEYS_BLOB], extra[ITEM_KEYS_OFFSETS])
    return tuple(table[int(i)] for i in ids[ptr[entry] : ptr[entry + 1]])
