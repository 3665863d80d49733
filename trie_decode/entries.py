"""Entry payloads: the name and the optional external key of every trie entry, in flat UTF-8 arrays.

Why this exists: an entry's tokens say what the model generated; users want back *which* entry it was (an
entity name, a document id, an enum value). Storing a million Python strings would defeat memory-mapping, so the
strings live in one UTF-8 byte blob with offsets, decoded only when an entry is looked up.
"""

from __future__ import annotations

import numbers
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from .errors import InvalidEntryError

__all__ = ["Entry", "StringTable", "utf8_bytes", "entry_strings", "entry_column", "check_names", "check_keys",
           "catalog_item_keys", "catalog_key_table", "catalog_problem", "filter_number_map", "retired_key_table",
           "filter_arrays_problem"]


def utf8_bytes(text: str, what: str, error: type = InvalidEntryError) -> bytes:
    """``text``'s UTF-8 bytes, or ``error`` naming ``what`` where ``text`` holds a lone surrogate (``"\\ud800"``,
    what ``json.loads`` makes of half an escaped pair, or ``os.fsdecode`` of a byte that is no UTF-8), which no UTF-8
    text and no tokenizer can hold: the one rule of every text trie_decode is given.

    Example:
        >>> utf8_bytes("Zürich", "value")
        b'Z\\xc3\\xbcrich'
    """
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise error(f"{what} {text!r:.60} holds the lone surrogate {text[exc.start]!r} at index {exc.start}: "
                    "it is not UTF-8 text (half of an escaped UTF-16 pair?); remove it or join it with its other half"
                    ) from exc


def entry_strings(strings: Any) -> list[str]:
    """``strings``, the entries of ``TokenTrie.from_strings``, ``tokenize_strings`` or ``tokenize_in_context``, as a
    list, each a non-empty string of UTF-8 text; else :class:`InvalidEntryError` naming the first that is not, a
    single string (one entry per character) or a set or mapping (numbered in the per-process hash order)."""
    if isinstance(strings, (str, bytes)):
        raise InvalidEntryError(f"expected a collection of strings, got a single string {strings!r:.40}")
    if isinstance(strings, (AbstractSet, Mapping)):
        raise InvalidEntryError(f"strings is a {type(strings).__name__}, which has no order of its own (a set of "
                                "strings iterates in another order in every process): give a list, e.g. "
                                "sorted(strings)")
    strings = list(strings)
    for i, s in enumerate(strings):
        if not isinstance(s, str):
            raise InvalidEntryError(f"entry {i} is {type(s).__name__} {s!r:.60}, not a string")
        if s == "":
            raise InvalidEntryError(f"entry {i} is the empty string: every entry needs at least one token")
        if not s.isascii():  # a tokenizer fails deep inside on a lone surrogate
            utf8_bytes(s, f"entry {i}")
    return strings


def entry_column(values: Any, label: str, count: int, rows: str) -> list:
    """``values``, the builders' ``names`` or ``keys`` (``label``: one per input, ``count`` ``rows``), as a list.

    Any iterable is read once (a generator too), as the builders read their sequences; a single string is refused
    (it would give one item per character), and so are a set and a dict (no order of their own).

    Raises:
        InvalidEntryError: a string, bytes, a set, a dict or no iterable at all; a length other than ``count``.
    """
    if isinstance(values, (str, bytes)):
        raise InvalidEntryError(f"{label} is a single {type(values).__name__} {values!r:.40}: give a list, one "
                                f"{label[:-1]} for each of the {count} {rows}")
    if isinstance(values, (AbstractSet, Mapping)):
        raise InvalidEntryError(f"{label} is a {type(values).__name__}, which has no order of its own: give a list, "
                                f"one {label[:-1]} for each of the {count} {rows}")
    try:
        items = values if isinstance(values, list) else list(values)
    except TypeError as exc:  # not iterable (a number, a 0-d array)
        raise InvalidEntryError(f"{label} is {type(values).__name__} {values!r:.40}, not a list: give one "
                                f"{label[:-1]} for each of the {count} {rows}") from exc
    if len(items) != count:
        raise InvalidEntryError(f"{label} has {len(items)} items but there are {count} {rows}")
    return items


def check_names(names: Sequence[object]) -> None:
    """Raise :class:`InvalidEntryError` naming the first name that is not a string (``str`` would write None as
    ``"None"``)."""
    bad = next((i for i, name in enumerate(names) if not isinstance(name, str)), None)
    if bad is not None:
        raise InvalidEntryError(f"names[{bad}] is {type(names[bad]).__name__} {names[bad]!r:.40}: a name is a "
                                "string (leave names= out for entries without names)")


def check_keys(keys: Sequence[object]) -> None:
    """Raise :class:`InvalidEntryError` naming the first key that is not a string or a number (a key is written with
    ``str``: None would become the key ``"None"``, ``b"x"`` the key ``"b'x'"``)."""
    bad = next((i for i, key in enumerate(keys) if isinstance(key, (bool, np.bool_))
                or not isinstance(key, (str, numbers.Number))), None)
    if bad is not None:
        raise InvalidEntryError(f"keys[{bad}] is {keys[bad]!r:.40}: a key is a string or a number (leave keys= out "
                                "for entries without keys)")


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
    def from_strings(cls, strings: Sequence[str], what: str = "string") -> "StringTable":
        """The table of ``strings`` (``what`` they are, for the message).

        Raises:
            InvalidEntryError: a string holds a lone surrogate (``"\\ud800"``, from a JSON escape): not UTF-8.
        """
        try:
            encoded = [s.encode("utf-8") for s in strings]
        except UnicodeEncodeError:
            for s in strings:  # the rule's own error, naming the first
                utf8_bytes(s, f"a {what}")
            raise
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

    def problem(self, count: Optional[int]) -> Optional[str]:
        """What is wrong with this table as the strings of ``count`` entries (None when nothing is; ``count`` None:
        any number of strings, a table of its own such as retired keys): a 1-D uint8 blob with 1-D int64 offsets
        (one or more) from 0 to the blob's end, UTF-8 text with no entry starting inside a character.
        """
        blob, offsets = self.blob, self.offsets
        if (
            not isinstance(blob, np.ndarray)
            or not isinstance(offsets, np.ndarray)
            or blob.ndim != 1
            or blob.dtype != np.uint8
            or offsets.ndim != 1
            or offsets.dtype != np.int64
        ):
            return "must be a 1-D uint8 blob with 1-D int64 offsets"
        if (
            len(offsets) == 0  # not even the end: no table of any length (len(self) would be -1)
            or (count is not None and len(offsets) - 1 != count)
            or offsets[0] != 0
            or offsets[-1] != len(blob)
            or np.any(np.diff(offsets) < 0)
        ):
            return "does not match the entries"
        # Every entry's text must decode: the blob is UTF-8 and no entry starts inside a character.
        try:
            blob.tobytes().decode("utf-8")
        except UnicodeDecodeError:
            return "is not UTF-8 text"
        starts = offsets[:-1][offsets[:-1] < len(blob)]
        if np.any((blob[starts] & 0xC0) == 0x80):
            return "splits a character between entries"
        return None

    @staticmethod
    def concat(tables: Sequence["StringTable"]) -> "StringTable":
        """The strings of ``tables``, one table after the other."""
        blobs = [t.blob for t in tables]
        shifts = np.cumsum([0] + [len(b) for b in blobs[:-1]])
        offsets = np.concatenate([np.zeros(1, dtype=np.int64)] + [t.offsets[1:] + s for t, s in zip(tables, shifts)])
        return StringTable(np.concatenate(blobs) if blobs else np.zeros(0, np.uint8), offsets.astype(np.int64))


# A semantic-id catalog (trie_decode.catalogs) keeps its items in the trie's extra arrays: the items of entry e are
# ITEM_IDS[ITEM_PTR[e] : ITEM_PTR[e + 1]] (rows of the codes array), and their keys, when given, a StringTable in
# item order. ITEM_IDS lists every item once; the items after ITEM_PTR[-1] are held by no entry (a compacted live
# catalog's removed items: their keys stay known to filters, and name nothing). Items added to a live catalog are
# numbered after the codes array's rows. The layout is here, below the trie, so that an entry can carry its item keys.
ITEM_PTR, ITEM_IDS = "catalog_item_ptr", "catalog_item_ids"
ITEM_KEYS_BLOB, ITEM_KEYS_OFFSETS = "catalog_item_keys_blob", "catalog_item_keys_offsets"


#: The dtype of each catalog array (all 1-D).
ITEM_DTYPES = {ITEM_PTR: np.int64, ITEM_IDS: np.int64, ITEM_KEYS_BLOB: np.uint8, ITEM_KEYS_OFFSETS: np.int64}


def catalog_key_table(extra: Mapping[str, np.ndarray]) -> Optional[StringTable]:
    """Every item's key, in item order, from a trie's ``extra`` arrays (None: not a catalog built with keys)."""
    if ITEM_KEYS_BLOB not in extra:
        return None
    return StringTable(extra[ITEM_KEYS_BLOB], extra[ITEM_KEYS_OFFSETS])


def catalog_item_keys(extra: Mapping[str, np.ndarray], entry: int) -> Optional[tuple[str, ...]]:
    """The keys of every item of entry ``entry`` of a catalog built with keys, in input order; None for any other
    trie (``Entry.item_keys``)."""
    table = catalog_key_table(extra)
    if table is None or ITEM_PTR not in extra:
        return None
    ptr, ids = extra[ITEM_PTR], extra[ITEM_IDS]
    return tuple(table[int(i)] for i in ids[ptr[entry] : ptr[entry + 1]])


def catalog_problem(extra: Mapping[str, np.ndarray], num_entries: int) -> Optional[str]:
    """What is wrong with the catalog arrays among ``extra`` for a trie of ``num_entries`` entries (None when nothing
    is, or when there are none): every reader above indexes with them without a check.

    A catalog has ``ITEM_PTR`` (E+1 offsets from 0, one item or more per entry, up to at most every item: the rest
    are held by no entry) and ``ITEM_IDS`` (every item exactly once: a permutation of the item indices), and
    optionally the two arrays of the items' key table.
    """
    present = [name for name in ITEM_DTYPES if name in extra]
    if not present:
        return None
    if ITEM_PTR not in extra or ITEM_IDS not in extra:
        return f"has {present} without both {ITEM_PTR!r} and {ITEM_IDS!r}"
    if (ITEM_KEYS_BLOB in extra) != (ITEM_KEYS_OFFSETS in extra):
        return f"has only half of the item key table ({ITEM_KEYS_BLOB}/{ITEM_KEYS_OFFSETS})"
    for name in present:
        array = extra[name]
        if not isinstance(array, np.ndarray) or array.ndim != 1 or array.dtype != np.dtype(ITEM_DTYPES[name]):
            return f"array {name!r} must be a 1-D {np.dtype(ITEM_DTYPES[name]).name} array"
    ptr, ids = extra[ITEM_PTR], extra[ITEM_IDS]
    n = len(ids)
    if len(ptr) != num_entries + 1 or ptr[0] != 0 or ptr[-1] > n or np.any(np.diff(ptr) < 1):
        return f"{ITEM_PTR!r} is not a pointer array from 0 to at most {n} items with one item or more per entry"
    if n and (int(ids.min()) < 0 or int(ids.max()) >= n or np.any(np.bincount(ids, minlength=n) != 1)):
        return f"{ITEM_IDS!r} does not list every item exactly once"
    table = catalog_key_table(extra)
    problem = table.problem(n) if table is not None else None
    return f"the item key table {problem}" if problem else None


# What filters name in a trie besides its entries' keys (trie_decode.filters.entry_indices, KeyIndex), for a trie that
# stands for a live catalog (trie_decode.live): the keys of the entries removed from it (RETIRED_KEYS_*, a StringTable:
# a filter may name them, and they name no entry; kept by every compaction, so a "seen items" deny list that names a
# withdrawn item keeps working), and the catalog snapshot's entry numbers (NUMBER_ENTRY, on the trie a server decodes
# for a trie file with a delta file beside it: NUMBER_ENTRY[n] is the entry numbered n, -1 for a removed one; filter
# numbers then mean what they mean on the catalog's snapshot, not the compacted trie's own entry indices).
NUMBER_ENTRY = "filter_number_entry"
RETIRED_KEYS_BLOB, RETIRED_KEYS_OFFSETS = "retired_keys_blob", "retired_keys_offsets"
#: The dtype of each of these arrays (all 1-D).
FILTER_DTYPES = {NUMBER_ENTRY: np.int64, RETIRED_KEYS_BLOB: np.uint8, RETIRED_KEYS_OFFSETS: np.int64}


def retired_key_table(extra: Mapping[str, np.ndarray]) -> Optional[StringTable]:
    """The keys of the entries removed from a trie (see ``RETIRED_KEYS_BLOB``), or None."""
    if RETIRED_KEYS_BLOB not in extra:
        return None
    return StringTable(extra[RETIRED_KEYS_BLOB], extra[RETIRED_KEYS_OFFSETS])


def filter_number_map(extra: Mapping[str, np.ndarray]) -> Optional[np.ndarray]:
    """The entry of each filter number (-1: a removed entry), or None when filter numbers are entry indices."""
    return extra.get(NUMBER_ENTRY)


def filter_arrays_problem(extra: Mapping[str, np.ndarray], num_entries: int) -> Optional[str]:
    """What is wrong with the filter arrays among ``extra`` (``NUMBER_ENTRY``, ``RETIRED_KEYS_*``) for a trie of
    ``num_entries`` entries (None when nothing is, or when there are none): every entry has exactly one number."""
    for name, dtype in FILTER_DTYPES.items():
        array = extra.get(name)
        if array is not None and (not isinstance(array, np.ndarray) or array.ndim != 1 or array.dtype != dtype):
            return f"array {name!r} must be a 1-D {np.dtype(dtype).name} array"
    if (RETIRED_KEYS_BLOB in extra) != (RETIRED_KEYS_OFFSETS in extra):
        return f"has only half of the retired key table ({RETIRED_KEYS_BLOB}/{RETIRED_KEYS_OFFSETS})"
    table = retired_key_table(extra)
    problem = table.problem(None) if table is not None else None
    if problem:
        return f"the retired key table {problem}"
    numbers = filter_number_map(extra)
    if numbers is not None:
        held = numbers[numbers >= 0]
        if (numbers.size and int(numbers.min()) < -1) or len(held) != num_entries or (
            held.size and (int(held.max()) >= num_entries or np.any(np.bincount(held, minlength=num_entries) != 1))
        ):
            return f"{NUMBER_ENTRY!r} does not number every entry exactly once (and nothing else but -1)"
    return None
