"""Live catalogs: add and remove entries of a loaded trie without rebuilding it on the request path.

Why this exists: retrieval and recommendation catalogs change every day (new items, withdrawn ones), and a trie of
millions of entries takes about a second to rebuild. A :class:`LiveCatalog` keeps the loaded trie (the *base*) as it
is and records the changes beside it:

- added entries go into a small *delta* (an entry list, and a small trie of it in each snapshot);
- removed base entries become *tombstones* (sorted base entry indices);
- removing an added entry drops it from the delta (its key stays known: see below); adding an entry the base holds
  but that was removed revives it.

Filters name entries by key or by the snapshot's entry numbers (:class:`CatalogSnapshot`). A removed entry's key,
base or added, stays known: a filter that names it keeps working and names nothing (a compaction keeps these keys,
``retired`` keys, so a rebase keeps them too), while a key the catalog never held is an error.

A :class:`CatalogSnapshot` is one immutable state (base, delta, tombstones, version). Decoding reads it as data, one
ordinary :class:`~trie_decode.constraint.TrieConstraint` plus a deny filter (:class:`CatalogView`), never as a second
decoder:

1. nothing changed: the base trie, no filter;
2. otherwise the newest *compacted* trie of the catalog (one real trie of the base with the changes folded in,
   built by a background thread, about 1 s per million entries), or the base before the first compaction, with the
   entries removed since then as a deny filter (:mod:`trie_decode.filters`: the C kernel masks it in its own pass);
   a snapshot with removals only is therefore the base plus its tombstones.

So **removals are immediate and additions become visible after a compaction**: a snapshot whose added entries the
newest compacted trie lacks asks for a new compaction and decodes the last one until it is ready
(:meth:`LiveCatalog.wait_compacted` waits for it). ``"release"`` mode takes no filter: there a snapshot with removals
decodes its own compacted trie, built on first use (the request waits for it).

What running requests see: a request decodes against the view it took when it started, to its end. A change never
reaches a running request, so it never sees half of one; every request that starts after the change sees its
removals at once and its additions once compacted. A snapshot keeps the compaction it decoded as long as it lives,
so one held across later changes never loses an entry it served.

Changes are saved as a small *delta file* (:meth:`LiveCatalog.save_delta`, a safetensors file beside the trie file,
by convention :func:`delta_path_for`) that names the base trie it belongs to: it is never applied to another base.

Dimension letters: E entries, T tombstones, K base entries a compacted trie holds, A added entries.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from dataclasses import replace
from typing import Any, BinaryIO, Iterable, Iterator, Optional, Sequence, Union

import numpy as np
import torch

from ._build import RaggedTokens, _is_integer, build_arrays, check_tokens, to_ragged
from .constraint import SpanRules, TrieConstraint
from .device import DeviceTrie
from .catalogs import compacted_items
from .entries import (NUMBER_ENTRY, RETIRED_KEYS_BLOB, RETIRED_KEYS_OFFSETS, Entry, StringTable, catalog_key_table,
                      check_keys, check_names, entry_column, retired_key_table)
from .errors import (CatalogUpdateError, ConstraintConfigError, EmptyFilterError, EmptyTrieError, FilterModeError,
                     InvalidEntryError, TrieFileError, UnknownEntryError, raised_as)
from .fileio import DELTA_KIND, check_vectors, read_arrays, write_arrays
from .filters import LIVE_ALLOW_HINT, EntryOrder, KeyIndex, RowFilters, spec_items
from .kernels.vectorized import NUMPY_KERNEL
from .options import row_specs
from .trie import TokenTrie

__all__ = [
    "LiveCatalog",
    "CatalogSnapshot",
    "CatalogView",
    "constraint_for",
    "delta_path_for",
    "apply_delta_file",
    "base_identity",
]

#: 2: the base identity covers the base's ``extra`` arrays. A version 1 file's identity leaves them out: it is read
#: only for a base without any (whose identity is the same in both versions).
DELTA_VERSION = 2
#: Compacted tries a catalog keeps besides its base, for the snapshots to come; a snapshot keeps the newest one it
#: read (or that was built for it) as long as it lives, so a pinned snapshot never loses an entry it could generate.
KEEP_COMPACTIONS = 2
#: Deny filters a view keeps built (one per device, kernel and batch size seen).
KEEP_FILTERS = 8


# ---------------------------------------------------------------------------------------------------------- helpers
def delta_path_for(trie_path: Union[str, "os.PathLike[str]"]) -> str:
    """The conventional delta file of a trie file: ``catalog.safetensors`` -> ``catalog.delta.safetensors``.

    Example:
        >>> delta_path_for("/data/catalog.safetensors")
        '/data/catalog.delta.safetensors'
    """
    path = os.fspath(trie_path)
    stem = path[: -len(".safetensors")] if path.endswith(".safetensors") else path
    return f"{stem}.delta.safetensors"


def base_identity(trie: TokenTrie) -> str:
    """A digest of a trie's structure, entry numbering, names, keys and ``extra`` arrays (a catalog's item lists,
    retired keys: what filters and removals by key resolve through): what a delta file names as its base.

    Costs one pass over the trie's arrays (~0.1 s per million entries); :class:`LiveCatalog` computes it once.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{trie.vocab_size}:{trie.num_nodes}:{trie.num_entries}".encode())
    for array in (trie.child_ptr, trie.token, trie.node_entry, trie.entry_node):
        h.update(np.ascontiguousarray(array).data)
    for label, table in (("names", trie._names), ("keys", trie._keys)):
        if table is not None:
            h.update(label.encode())
            h.update(np.ascontiguousarray(table.offsets).data)
            h.update(np.ascontiguousarray(table.blob).data)
    for name in sorted(trie.extra):  # none: the identity of delta files of version 1
        array = np.ascontiguousarray(trie.extra[name], dtype=trie.extra[name].dtype.newbyteorder("<"))  # as saved
        h.update(f"{name}:{array.dtype.str}:{array.shape}".encode())
        h.update(array.data)
    return h.hexdigest()


def _key_index(trie: TokenTrie) -> KeyIndex:
    """key -> every entry holding it (catalog item keys included), the index filters use (built once per trie)."""
    try:
        return KeyIndex.of(trie)
    except ConstraintConfigError:
        raise CatalogUpdateError("this catalog has neither keys nor names: name entries by index or by tokens") from None


def _sequences(entries: Any, strings: str) -> RaggedTokens:
    """The token-id sequences given to :meth:`LiveCatalog.add` or ``remove(sequences=)``, packed; strings are refused
    with the message ``strings``, which names the argument of that call that takes them (the builders' own message
    points to ``TokenTrie.from_strings``).

    Raises:
        CatalogUpdateError: a string, or a list or tuple (an iterator, read once) holding one.
        InvalidEntryError, InvalidTokenError: anything else :func:`~trie_decode._build.to_ragged` refuses.
    """
    if isinstance(entries, Iterator):  # read once, here: the check for strings sees its items
        entries = list(entries)
    if isinstance(entries, str) or (isinstance(entries, (list, tuple)) and any(isinstance(e, str) for e in entries)):
        raise CatalogUpdateError(strings)
    return to_ragged(entries)


def _column(values: Any, label: str, count: int) -> Optional[list[str]]:
    """``names=`` or ``keys=`` (``label``) of :meth:`LiveCatalog.add` for ``count`` sequences, as the builders take
    them (any iterable read once, one item per sequence; a name is a string, a key is not None), written as strings.
    Checked before the change is applied: every later snapshot builds its delta trie from them, so one the builders
    refuse (a lone surrogate too) would make every snapshot of the catalog fail.

    Raises:
        CatalogUpdateError: (an :class:`~trie_decode.errors.InvalidEntryError` too, as the builders raise) a single
            string, a set or a dict, a length other than ``count``, a name that is not a string, a key that is None,
            text that is not UTF-8.
    """
    if values is None:
        return None
    try:
        items = entry_column(values, label, count, "sequences")
        (check_names if label == "names" else check_keys)(items)
        strings = [str(x) for x in items]
        StringTable.from_strings(strings, label[:-1])  # refuses a lone surrogate, naming it
    except InvalidEntryError as exc:  # the builders' problem, and a refused change: both classes (raised_as)
        raise raised_as(type(exc), CatalogUpdateError)(str(exc)) from None
    return strings


def _tuples(ragged: RaggedTokens) -> list[tuple[int, ...]]:
    """The sequences of ``ragged`` as tuples (the catalog's dictionary keys)."""
    v, o = ragged.values.tolist(), ragged.offsets.tolist()
    return [tuple(v[o[i] : o[i + 1]]) for i in range(len(o) - 1)]


def _entries_of(trie: TokenTrie, ragged: RaggedTokens) -> list[int]:
    """The entry of ``trie`` each sequence is (-1: none): the node it reaches, one batched child lookup per depth
    (the numpy kernel's, over the CPU :class:`~trie_decode.device.DeviceTrie`, built once per trie), then its entry."""
    dtrie = DeviceTrie.get(trie, "cpu")
    lengths = ragged.lengths
    node = np.zeros(len(ragged), dtype=np.int64)
    for d in range(int(lengths.max(initial=0))):
        idx = np.flatnonzero((lengths > d) & (node >= 0))
        node[idx] = NUMPY_KERNEL.child(dtrie, node[idx], ragged.values[ragged.offsets[idx] + d])
    return np.where(node >= 0, trie.node_entry[np.maximum(node, 0)], -1).tolist()


def apply_delta_file(base: TokenTrie, delta: Union[str, "os.PathLike[str]", BinaryIO], *, verify: bool = True
                     ) -> TokenTrie:
    """The trie a server decodes for a trie file with a delta file beside it: the base with the delta's changes
    folded in (:meth:`LiveCatalog.load_delta`, then :meth:`CatalogSnapshot.compact`), one real trie, so every
    serving path (processors, beam search, fast-forward, filters, distinct lists) works on it unchanged. The base
    is returned as it is when the delta changes nothing. Costs a compaction (about 1 s per million entries): cache
    the result by both files' identities.

    Filters name its entries as they name the catalog's snapshot (``LiveCatalog.open(trie_path, delta_path)``), so
    a request means the same entries here as in-process: numbers are the snapshot's entry numbers (base entries
    keep their base index, added ones follow; the trie carries that numbering, ``trie.extra[NUMBER_ENTRY]``, read
    by :func:`~trie_decode.filters.entry_indices`), removed entries' keys are accepted and name nothing, and a
    catalog's item keys are kept (see :meth:`CatalogSnapshot.compact`).

    Args:
        delta: the delta file's path, or a binary file object opened on it (a server opens it through its access
            policy and passes the descriptor: the file read is the file checked).

    Raises:
        TrieFileError: the delta file is corrupted, malformed, or was written for another base trie.
    """
    catalog = LiveCatalog(base)
    catalog.load_delta(delta, verify=verify)
    snap = catalog.snapshot()
    if snap.plain and not snap.retired:
        return base
    trie = snap.compact()
    if snap.tombstones.size:  # compacted entries are renumbered: the filters' numbers stay the snapshot's
        trie.extra[NUMBER_ENTRY] = snap.numbers()
    return trie


# ---------------------------------------------------------------------------------------------------------- snapshot
class CatalogSnapshot:
    """One immutable state of a live catalog: the base trie, the delta trie of added entries (or None), the sorted
    base entry indices removed (tombstones) and a version number. Decode it through :meth:`view`.

    Entries are numbered as the union: base entries keep their base index (removed ones are gone), added entries
    come after, ``base.num_entries + i`` for the delta's entry ``i``. These numbers hold within one snapshot (filters
    over a live catalog take them; so does the trie a server decodes for it, :func:`apply_delta_file`);
    :meth:`compact` renumbers.

    Args:
        base: the base trie.
        delta: the added entries as a trie of the same vocabulary and columns (keys, names), none of them a live
            base entry, or None.
        tombstones: removed base entry indices, sorted and unique. Shape: (T,), int64.
        version: the catalog's change counter when the snapshot was taken.
        retired: keys (names in a catalog without keys) of added entries that were removed since: filters may
            name them, as they name a removed base entry's key, and they name nothing.

    Example:
        >>> from trie_decode import TokenTrie
        >>> base = TokenTrie.from_sequences([[3, 4], [3, 5], [6]], vocab_size=8, keys=["a", "b", "c"])
        >>> catalog = LiveCatalog(base)
        >>> catalog.add([[3, 7]], keys=["d"]), catalog.remove(["b"])
        (1, 1)
        >>> snap = catalog.snapshot()
        >>> snap.num_entries, sorted(snap.sequences()), snap.lookup([3, 7]).key
        (3, [(3, 4), (3, 7), (6,)], 'd')
    """

    def __init__(
        self,
        base: TokenTrie,
        delta: Optional[TokenTrie] = None,
        tombstones: Optional[np.ndarray] = None,
        version: int = 0,
        *,
        retired: Iterable[str] = (),
        _compactor: Optional["_Compactor"] = None,
        _added: Optional[dict[tuple[int, ...], int]] = None,
    ) -> None:
        if not isinstance(base, TokenTrie):
            raise TypeError(f"base must be a TokenTrie, not {type(base).__name__}")
        if delta is not None:
            if not isinstance(delta, TokenTrie):
                raise TypeError(f"delta must be a TokenTrie or None, not {type(delta).__name__}")
            if delta.vocab_size != base.vocab_size:
                raise CatalogUpdateError(f"the delta's vocab_size {delta.vocab_size} differs from the base's "
                                         f"{base.vocab_size}")
        tomb = np.zeros(0, dtype=np.int64) if tombstones is None else np.asarray(tombstones, dtype=np.int64).ravel()
        if tomb.size and (np.any(np.diff(tomb) <= 0) or tomb[0] < 0 or tomb[-1] >= base.num_entries):
            raise CatalogUpdateError(f"tombstones must be sorted, unique base entry indices in [0, {base.num_entries})")
        tomb.flags.writeable = False
        if delta is not None:
            for label in ("names", "keys"):  # compact() concatenates the base's columns with the delta's
                has = getattr(base, f"_{label}") is not None
                if has != (getattr(delta, f"_{label}") is not None):
                    raise CatalogUpdateError(f"the delta's {label} do not match the base's (the base "
                                             f"{'has' if has else 'has no'} {label})")
            if _added is None:  # a delta of one's own (a catalog's never repeats a base entry: add() revives it)
                held = np.asarray(_entries_of(base, delta.entry_tokens(np.arange(delta.num_entries))), dtype=np.int64)
                live = np.flatnonzero((held >= 0) & ~np.isin(held, tomb))
                if live.size:
                    raise CatalogUpdateError(f"delta entry {live[0]} is base entry {held[live[0]]}, which the snapshot "
                                             "holds: a snapshot holds each sequence once")
        self.base, self.delta, self.tombstones, self.version = base, delta, tomb, int(version)
        self.retired: frozenset[str] = frozenset(retired)
        # The compacted versions of this base, shared by every snapshot of one catalog (a snapshot made on its own
        # has its own).
        self._compactor = _Compactor(base) if _compactor is None else _compactor
        self._lock = threading.Lock()
        self._view: Optional[CatalogView] = None
        self._added = _added  # see added(); given by the catalog, which knows the delta's entries in order
        # The newest compaction this snapshot read or had built for it (_latest_view): kept while the snapshot
        # lives, whatever compactions the catalog keeps for newer snapshots.
        self._record: Optional[_Compaction] = None

    def snapshot(self) -> "CatalogSnapshot":
        """This snapshot (so that a snapshot and a :class:`LiveCatalog` are interchangeable where one is read)."""
        return self

    # ------------------------------------------------------------------ sizes
    @property
    def plain(self) -> bool:
        """True when nothing changed: no delta, no tombstone (decoding is then the base trie's, with no overhead)."""
        return self.delta is None and self.tombstones.size == 0

    @property
    def num_entries(self) -> int:
        return self.base.num_entries - len(self.tombstones) + (self.delta.num_entries if self.delta is not None else 0)

    def __len__(self) -> int:
        return self.num_entries

    @property
    def max_depth(self) -> int:
        """The deepest entry's length (an upper bound: removed base entries count)."""
        return max(self.base.max_depth, self.delta.max_depth if self.delta is not None else 0)

    @property
    def vocab_size(self) -> int:
        return self.base.vocab_size

    @property
    def fingerprint(self) -> str:
        return self.base.fingerprint

    def check_tokenizer(self, tokenizer: Any) -> None:
        """Raise :class:`~trie_decode.TokenizerMismatchError` unless ``tokenizer`` is the base trie's."""
        self.base.check_tokenizer(tokenizer)

    # ------------------------------------------------------------------ entries
    def removed(self, index: int) -> bool:
        """Whether base entry ``index`` is removed in this snapshot."""
        i = int(np.searchsorted(self.tombstones, index))
        return i < len(self.tombstones) and int(self.tombstones[i]) == int(index)

    def entry(self, index: int) -> Entry:
        """Entry number ``index`` of this snapshot (see the class docstring for the numbering).

        Raises:
            InvalidEntryError: ``index`` is not an integer (a float, a string, a bool), as :meth:`TokenTrie.entry`.
            IndexError: a removed base entry, or a number outside the snapshot.
        """
        if not _is_integer(index):
            raise InvalidEntryError(f"entry {index!r:.40} is {type(index).__name__}, not an integer")
        index = int(index)
        nb = self.base.num_entries
        if 0 <= index < nb:
            if self.removed(index):
                raise IndexError(f"entry {index} was removed from the catalog")
            return self.base.entry(index)
        nd = self.delta.num_entries if self.delta is not None else 0
        if not nb <= index < nb + nd:
            raise IndexError(f"entry {index} is not in this snapshot ({nb} base entries, {nd} added)")
        added = self.delta.entry(index - nb)
        # In a catalog with item keys, an added entry is one item: its own key (as its compaction holds it).
        items = (added.key,) if catalog_key_table(self.base.extra) is not None and added.key is not None else None
        return replace(added, index=index, item_keys=items)

    def lookup(self, tokens: Iterable[int]) -> Optional[Entry]:
        """The live entry whose tokens are exactly ``tokens``, or None."""
        tokens = list(tokens)
        found = self.base.lookup(tokens)
        if found is not None and not self.removed(found.index):
            return found
        if self.delta is not None:
            found = self.delta.lookup(tokens)
            if found is not None:
                return self.entry(self.base.num_entries + found.index)
        return None

    def sequences(self) -> list[tuple[int, ...]]:
        """Every live entry's tokens: the base's in base order, then the added ones (the order of :meth:`compact`)."""
        return _tuples(self._ragged())

    def _alive_base(self) -> np.ndarray:
        alive = np.ones(self.base.num_entries, dtype=np.bool_)
        alive[self.tombstones] = False
        return np.flatnonzero(alive)

    def _added_ragged(self) -> RaggedTokens:
        """The added entries' tokens, in delta order."""
        return to_ragged([]) if self.delta is None else self.delta.entry_tokens(np.arange(self.delta.num_entries))

    def _ragged(self) -> RaggedTokens:
        """Every live entry's tokens: the live base entries in base order, then the added ones."""
        base, added = self.base.entry_tokens(self._alive_base()), self._added_ragged()
        offsets = np.concatenate([base.offsets, added.offsets[1:] + base.offsets[-1]])
        return RaggedTokens(np.concatenate([base.values, added.values]), offsets)

    def added(self) -> dict[tuple[int, ...], int]:
        """Tokens of each added entry -> its index within the delta (computed once)."""
        if self._added is None:
            self._added = {seq: i for i, seq in enumerate(_tuples(self._added_ragged()))}
        return self._added

    def delta_keys(self) -> Optional[KeyIndex]:
        """key -> added entry indices (within the delta), or None without a delta."""
        return None if self.delta is None else _key_index(self.delta)

    def numbers(self) -> np.ndarray:
        """The entry of :meth:`compact`'s trie that each of this snapshot's entry numbers names (-1: a removed base
        entry). Shape: (base entries + added entries,), int64."""
        nb, nd = self.base.num_entries, self.delta.num_entries if self.delta is not None else 0
        alive = self._alive_base()
        out = np.full(nb + nd, -1, dtype=np.int64)
        out[alive] = np.arange(len(alive), dtype=np.int64)
        out[nb:] = len(alive) + np.arange(nd, dtype=np.int64)
        return out

    def retired_keys(self) -> list[str]:
        """The keys (names in a catalog without keys) a filter may name that no entry of :meth:`compact`'s trie
        holds: the base's own retired keys, the removed base entries', and :attr:`retired`, sorted."""
        base = self.base
        out = set(self.retired)
        old = retired_key_table(base.extra) if base.extra else None
        if old is not None:
            out.update(old.to_list())
        labels = base._keys if base._keys is not None else base._names
        if labels is not None and self.tombstones.size:
            out.update(labels.take(self.tombstones).to_list())
        return sorted(out)

    def compact(self) -> TokenTrie:
        """One real trie: the base minus its removed entries, then the added ones (entries renumbered in that
        order; names, keys, fingerprint and options kept). What filters name besides the entries is kept too
        (``extra`` arrays, :mod:`trie_decode.entries`): a catalog's item lists (items keep their numbers; an added
        entry is one new item, with its key; removed items are held by no entry,
        :func:`~trie_decode.catalogs.compacted_items`), and the keys of every entry removed so far
        (:meth:`retired_keys`: a filter that names one still works, and it names nothing). Other ``extra`` arrays
        are not carried over. Costs about 1 s per million entries; with removals only, a pruning of the base
        (:meth:`TokenTrie.subset`, about 12 ms per million nodes).

        Raises:
            EmptyTrieError: every entry was removed.
        """
        if self.num_entries == 0:
            raise EmptyTrieError("every entry of the catalog was removed: compact() would give an empty trie")
        alive = self._alive_base()
        base, delta = self.base, self.delta
        if delta is None:
            trie = base.subset(alive)
        else:
            built = build_arrays(self._ragged(), base.vocab_size)
            # build_arrays numbers entries in the order of their first input: with no duplicate, entry i is input i.
            assert built.num_duplicates == 0, "a live catalog never holds one sequence twice"

            def column(base_table: Optional[StringTable], delta_table: Optional[StringTable]) -> Optional[StringTable]:
                if base_table is None:
                    return None
                return StringTable.concat([base_table.take(alive)] + ([delta_table] if delta_table is not None else []))

            trie = base._rebuilt(built, column(base._names, delta._names), column(base._keys, delta._keys))
        added_labels = None
        if delta is not None:
            labels = delta._keys if delta._keys is not None else delta._names
            added_labels = labels.to_list() if labels is not None else None
        extra = compacted_items(base, alive, delta.num_entries if delta is not None else 0, added_labels)
        retired = self.retired_keys()
        if retired:
            table = StringTable.from_strings(retired)
            extra.update({RETIRED_KEYS_BLOB: table.blob, RETIRED_KEYS_OFFSETS: table.offsets})
        trie.extra = extra
        return trie

    # ------------------------------------------------------------------ decoding
    def view(self, rules: Optional[SpanRules] = None, *, whole: bool = False) -> "CatalogView":
        """What decoding this snapshot reads now: one trie and the entries of it to deny (see the module docstring).
        A snapshot whose added entries are not all in the newest compacted trie asks the catalog's background
        thread for a new one; the view is then the last one, with this snapshot's removals denied. With
        ``"release"`` rules (which take no filter) and removals, the snapshot's own compacted trie (built now, once).

        Args:
            whole: a view whose trie holds exactly this snapshot's entries (none denied, none pending; the
                snapshot's own compacted trie, built now, once, when the newest lacks some): what reading back
                generated tokens needs, since a denied entry still extends the trie's paths and a pending one is
                absent from them.

        Raises:
            EmptyTrieError: the snapshot holds no entry.
        """
        if self.num_entries == 0:
            raise EmptyTrieError("every entry of the catalog was removed: nothing could be generated")
        if rules is not None and not isinstance(rules, SpanRules):
            raise TypeError(f"rules must be SpanRules or None, not {type(rules).__name__}")
        found = self._latest_view()
        release = rules is not None and rules.on_complete == "release"
        if found.visible == 0 or (found.deny.size and (release or whole)) or (found.pending and whole):
            # Nothing live is visible yet (only added entries remain), "release" mode, which takes no deny filter, or
            # a whole view: this snapshot compacted now, on this thread, kept by it and as the catalog's newest.
            record = _Compaction.of(self)
            self._keep(record)
            self._compactor.publish(record)
            found = self._latest_view()
        elif found.pending:
            self._compactor.request(self)
        return found

    def _keep(self, record: "_Compaction") -> None:
        """Keep ``record`` (a compaction of this catalog at this snapshot's version or before) if it is the newest
        this snapshot has."""
        with self._lock:
            if self._record is None or record.version > self._record.version:
                self._record = record

    def _latest_view(self) -> "CatalogView":
        """The view over the newest compaction this snapshot may read (cached while it stays the newest): the
        catalog's, or the one this snapshot kept when the catalog no longer keeps it (newer ones replaced it)."""
        record = self._compactor.best(self.version)
        self._keep(record)
        with self._lock:
            record = self._record
            found = self._view
        if found is None or found.record is not record:
            found = CatalogView(self, record)
            with self._lock:
                self._view = found
        return found

    def __repr__(self) -> str:
        added = self.delta.num_entries if self.delta is not None else 0
        return (f"CatalogSnapshot(version={self.version}, entries={self.num_entries}, base={self.base.num_entries}, "
                f"added={added}, removed={len(self.tombstones)})")


class _Compaction:
    """One compacted state of a catalog: its trie and where the trie's entries come from (its K base entries in
    base order, then its added ones: the order of :meth:`CatalogSnapshot.compact`).

    Attributes:
        trie: the compacted trie (the base itself in the base's own record).
        version: the catalog version it holds (-1: the base's record, before any change).
        alive: the base entries it holds, sorted: trie entry i is base entry ``alive[i]``; None: every base entry,
            with its own number (the base's record). Shape: (K,), int64.
        added: tokens of each added entry it holds -> its trie entry (after the K base entries).
    """

    def __init__(self, trie: TokenTrie, version: int, alive: Optional[np.ndarray],
                 added: dict[tuple[int, ...], int]) -> None:
        self.trie, self.version, self.alive, self.added = trie, version, alive, added

    @classmethod
    def of(cls, snap: CatalogSnapshot, warm: Iterable[tuple[SpanRules, str]] = ()) -> "_Compaction":
        """The compaction of ``snap`` (about 1 s per million entries), with the arrays the first request reads: the
        entry order, the CPU arrays, and the step tables of the (rules, device) pairs in ``warm`` (about 0.5 s per
        million entries each)."""
        trie = snap.compact()
        alive = snap._alive_base()
        added = {seq: len(alive) + i for seq, i in snap.added().items()}
        EntryOrder.of(trie)  # built here, off the request path: the deny filters of later removals read it
        DeviceTrie.get(trie, "cpu")
        for rules, device in warm:
            DeviceTrie.get(trie, device).table(rules)
        return cls(trie, snap.version, alive, added)

    def base_entries(self, entries: np.ndarray) -> np.ndarray:
        """The trie entries of the base entries among ``entries`` (sorted, unique) that :attr:`trie` holds.
        Shape: (K',), int64."""
        if self.alive is None:
            return entries
        pos = np.searchsorted(self.alive, entries)
        held = pos < len(self.alive)
        held[held] = self.alive[pos[held]] == entries[held]
        return pos[held]


class _Compactor:
    """The compacted tries of one base and the background thread that builds them, one at a time, always for the
    newest snapshot that asked (:meth:`request`); then for older snapshots that asked when the catalog had already
    compacted newer ones, which they may not read (each keeps its own). Shared by a catalog and its snapshots."""

    def __init__(self, base: TokenTrie) -> None:
        self.base_record = _Compaction(base, -1, None, {})
        self.records: list[_Compaction] = []  # newest last
        self.cond = threading.Condition()
        self.wanted: Optional[CatalogSnapshot] = None
        self.old: dict[int, CatalogSnapshot] = {}  # older snapshots to compact for themselves, by id
        self.building = -2  # the version the thread is compacting (-2: none)
        self.running = False
        self.error: Optional[BaseException] = None
        self.failed_version = -2
        self.warm: dict[tuple[SpanRules, str], None] = {}  # the (rules, device) pairs views decoded, newest last

    def used(self, rules: SpanRules, device: str) -> None:
        """Note that a view decodes with ``rules`` on ``device``: the next compactions build that step table."""
        with self.cond:
            self.warm.pop((rules, device), None)
            self.warm[rules, device] = None
            while len(self.warm) > KEEP_FILTERS:
                del self.warm[next(iter(self.warm))]

    def best(self, version: int) -> _Compaction:
        """The newest record a snapshot of ``version`` may read (a newer one could show it later additions)."""
        with self.cond:
            for record in reversed(self.records):
                if record.version <= version:
                    return record
        return self.base_record

    def request(self, snap: CatalogSnapshot) -> None:
        """Compact ``snap`` in the background (coalesced: the thread takes the newest snapshot asked for). A snapshot
        older than a compaction the catalog already has (which it may not read: it holds later additions) is
        compacted for itself, after the newest, and keeps its compaction (:meth:`CatalogSnapshot._keep`)."""
        with self.cond:
            if snap.version in (self.failed_version, self.building):
                return
            if any(r.version >= snap.version for r in self.records):
                self.old[id(snap)] = snap
            elif self.wanted is None or snap.version > self.wanted.version:
                self.wanted = snap
            if not self.running:
                self.running = True
                threading.Thread(target=self._run, name="trie_decode-compaction", daemon=True).start()

    def _run(self) -> None:
        while True:
            with self.cond:
                snap, self.wanted = self.wanted, None
                own = snap is None and bool(self.old)  # an older snapshot, compacted for itself only
                if own:
                    snap = self.old.pop(next(iter(self.old)))
                warm = list(self.warm)
                if snap is None:
                    self.running, self.building = False, -2
                    self.cond.notify_all()
                    return
                self.building = snap.version
            try:
                record = _Compaction.of(snap, warm)
            except Exception as exc:  # kept for wait_compacted(); requests keep the last compacted trie
                with self.cond:
                    self.error, self.failed_version = exc, snap.version
                continue
            snap._keep(record)  # the snapshot that asked keeps it, whatever the catalog keeps later
            if own:
                with self.cond:
                    self.error = None
                    self.cond.notify_all()
            else:
                self.publish(record)

    def publish(self, record: _Compaction) -> None:
        """Keep ``record`` among the newest compactions (in version order)."""
        with self.cond:
            if all(r.version != record.version for r in self.records):
                self.records = sorted(self.records + [record], key=lambda r: r.version)[-KEEP_COMPACTIONS:]
            self.error = None
            self.cond.notify_all()

    def wait(self, timeout: Optional[float]) -> bool:
        """Wait until no compaction is running or wanted; False on timeout. Raises the last compaction's error."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while self.running:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.cond.wait(left)
            if self.error is not None:
                raise self.error
        return True


class CatalogView:
    """What decoding a snapshot reads: one trie (:attr:`trie`) and the entries of it the snapshot no longer holds
    (:attr:`deny`), for an ordinary :class:`~trie_decode.constraint.TrieConstraint` and the deny filter of
    :mod:`trie_decode.filters` combined with a request's own filters (:meth:`filters`). Made by
    :meth:`CatalogSnapshot.view`.

    Attributes:
        snapshot: the snapshot.
        trie: the base, or a compacted trie of the catalog.
        deny: entries of ``trie`` that the snapshot removed, sorted. Shape: (D,), int64.
        visible: live entries of the snapshot that ``trie`` holds.
        pending: live entries of the snapshot that ``trie`` lacks (added since its compaction; 0 once compacted).

    Example:
        >>> import torch
        >>> from trie_decode import TokenTrie
        >>> catalog = LiveCatalog(TokenTrie.from_sequences([[3, 4], [3, 5], [6]], vocab_size=8))
        >>> catalog.remove([1])
        1
        >>> rules = SpanRules(end_token_id=0)
        >>> view = catalog.snapshot().view(rules)
        >>> view.trie is catalog.base, view.deny.tolist()
        (True, [1])
        >>> c = view.constraint(rules, "cpu")
        >>> state = c.advance(c.start(1), torch.tensor([3]))
        >>> masked = c.mask_(torch.zeros(1, 8), state, filters=view.filters(c, 1))
        >>> c.allowed_tokens(state), masked.isfinite().nonzero()[:, 1].tolist()   # the trie's, and with removals
        ([[4, 5]], [4])
    """

    def __init__(self, snapshot: CatalogSnapshot, record: _Compaction) -> None:
        self.snapshot, self.record, self.trie = snapshot, record, record.trie
        # The trie's entries that the snapshot removed: base entries it holds that are tombstones now, added entries
        # no longer added, or added again with another name or key (removed, then added back: the snapshot's is
        # another entry, pending until the next compaction).
        added = snapshot.added()
        gone = [e for seq, e in record.added.items() if seq not in added]
        kept = [(e, added[seq]) for seq, e in record.added.items() if seq in added]
        if kept:
            ours, theirs = np.asarray(kept, dtype=np.int64).T
            for label in ("_names", "_keys"):
                mine, now = getattr(record.trie, label), getattr(snapshot.delta, label)
                if mine is not None and now is not None:
                    a, b = mine.take(ours), now.take(theirs)
                    if not (np.array_equal(a.offsets, b.offsets) and np.array_equal(a.blob, b.blob)):
                        gone += [e for e, x, y in zip(ours.tolist(), a.to_list(), b.to_list()) if x != y]
        deny = np.unique(np.concatenate([record.base_entries(snapshot.tombstones), np.asarray(gone, dtype=np.int64)]))
        deny.flags.writeable = False
        self.deny = deny
        self.visible = self.trie.num_entries - len(deny)
        self.pending = snapshot.num_entries - self.visible
        self._lock = threading.Lock()
        self._constraints: dict[tuple, TrieConstraint] = {}
        self._deny_filters: dict[tuple, RowFilters] = {}

    def constraint(self, rules: SpanRules, device: torch.device | str, *, kernel: Optional[str] = None,
                   dense_min_fanout: Optional[int] = None) -> TrieConstraint:
        """The :class:`TrieConstraint` of :attr:`trie` under ``rules`` on ``device`` (built once, then cached)."""
        key = (rules, str(torch.device(device)), kernel, dense_min_fanout)
        found = self._constraints.get(key)
        if found is None:
            if dense_min_fanout is None:
                self.snapshot._compactor.used(rules, str(torch.device(device)))
            found = TrieConstraint(self.trie, rules, device, kernel=kernel, dense_min_fanout=dense_min_fanout)
            with self._lock:
                found = self._constraints.setdefault(key, found)
        return found

    def entry_indices(self, spec: Any, what: str) -> np.ndarray:
        """The entries of :attr:`trie` that a filter spec names: entry keys (str: every entry of the snapshot that
        holds the key, a catalog's item keys included) or the snapshot's entry numbers (int, see
        :class:`CatalogSnapshot`). Entries the trie lacks (added, not compacted yet) are left out, and so are removed
        ones: a removed entry's key (a base entry's, an added entry's, or one removed before the last rebase) names
        nothing, so a filter that names it keeps working. Shape: (K,), int64.

        Raises:
            ConstraintConfigError: a key the catalog never held, an entry number outside the snapshot, an item that
                is neither.
        """
        snap = self.snapshot
        keys, numbers = spec_items(spec, what, "entry numbers")  # the spec rule of every filter (mixed specs too)
        nb, added = snap.base.num_entries, list(snap.added())
        base_idx: list[int] = []
        delta_idx: list[int] = []
        missing: list[str] = []
        if keys:
            base_keys, delta_keys = _key_index(snap.base), snap.delta_keys()
            for x in keys:
                hits_b = base_keys.get(x)
                hits_d = delta_keys.get(x) if delta_keys is not None else []
                base_idx += hits_b
                delta_idx += hits_d
                if not hits_b and not hits_d and not base_keys.knows(x) and x not in snap.retired:
                    missing.append(x)
            if missing:
                raise UnknownEntryError(
                    f"{what}: {len(missing)} keys are not entries of the catalog and never were (check their "
                    f"spelling), e.g. {missing[:3]}")
        for x in numbers:
            i = int(x)
            if not 0 <= i < nb + len(added):
                raise UnknownEntryError(f"{what}: entry number {i} is outside the snapshot's {nb + len(added)} "
                                        "entry numbers")
            (base_idx if i < nb else delta_idx).append(i if i < nb else i - nb)
        record = self.record
        base = record.base_entries(np.unique(np.asarray(base_idx, dtype=np.int64)))
        held = [record.added.get(added[j], -1) for j in set(delta_idx)]
        return np.sort(np.concatenate([base, np.asarray([e for e in held if e >= 0], dtype=np.int64)]))

    def source_entries(self, found: list[list[Entry]]) -> list[list[Entry]]:
        """Entries of :attr:`trie` (per row, as :meth:`TrieConstraint.replay` gives them) as the snapshot's entries:
        its entry numbers, names and keys (a compacted trie renumbers, and keeps the old key of an entry added back
        under another); an entry the snapshot removed is left out."""
        rows = [[self.snapshot.lookup(e.tokens) for e in row] for row in found]
        return [[e for e in row if e is not None] for row in rows]

    def filters(
        self,
        constraint: TrieConstraint,
        num_rows: int,
        allow: Optional[Sequence[Any]] = None,
        deny: Optional[Sequence[Any]] = None,
        *,
        distinct: bool = False,
        max_entries: Optional[int] = None,
    ) -> Optional[RowFilters]:
        """The rows' filters: this view's deny set combined with a request's own allow/deny (entries named as
        :meth:`entry_indices` takes them) by :meth:`TrieConstraint.filters`, distinct lists included; None when
        nothing is filtered (an unchanged catalog, or a compacted one with nothing removed since, and no request
        filter). The deny set alone is built once per device, kernel and batch size.

        Args:
            constraint: :meth:`constraint`'s (over :attr:`trie`).
            num_rows, allow, deny, distinct, max_entries: as :meth:`TrieConstraint.filters` (``allow``/``deny``: one
                spec for every row, or one per row).

        Raises:
            ConstraintConfigError: as :meth:`entry_indices`; a row whose allow set holds no entry this view serves;
                ``"release"`` rules with removals (take the view with :meth:`CatalogSnapshot.view` ``(rules)``); as
                :meth:`TrieConstraint.filters`.
        """
        own = isinstance(constraint, TrieConstraint) and len(constraint.tries) == 1 and constraint.tries[0] is self.trie
        if not own:
            raise ConstraintConfigError("constraint must be this view's own (CatalogView.constraint)")
        if allow is None and deny is None and not distinct and max_entries is None:
            if not self.deny.size:
                return None
            if constraint.rules.on_complete == "release":
                raise FilterModeError(
                    '"release" mode takes no filter, and this view denies removed entries: take the view with '
                    "CatalogSnapshot.view(rules), which compacts the snapshot for it")
            key = (str(constraint.device), constraint.kernel.name, int(num_rows))
            found = self._deny_filters.get(key)
            if found is None:
                found = constraint.filters(num_rows, deny=self.deny)
                with self._lock:
                    self._deny_filters = dict(list(self._deny_filters.items())[-(KEEP_FILTERS - 1):])
                    found = self._deny_filters.setdefault(key, found)
            return found

        def rows_of(spec: Any, what: str) -> list[Optional[np.ndarray]]:
            extra = self.deny if what == "deny" and self.deny.size else None
            converted: dict[int, np.ndarray] = {}  # rows sharing one spec object share its arrays

            def one(s: Any) -> Optional[np.ndarray]:
                if s is None:
                    return extra
                if id(s) not in converted:
                    idx = self.entry_indices(s, what)
                    converted[id(s)] = idx if extra is None else np.union1d(idx, extra)
                return converted[id(s)]

            return [one(s) for s in row_specs(spec, num_rows, what)]

        try:
            return constraint.filters(num_rows, rows_of(allow, "allow"), rows_of(deny, "deny"), distinct=distinct,
                                      max_entries=max_entries)
        except EmptyFilterError as exc:  # the filters' refusal; removed or pending entries may be why
            raise type(exc)(f"{exc} ({LIVE_ALLOW_HINT})") from None

    def __repr__(self) -> str:
        return (f"CatalogView({self.snapshot!r}, trie of {self.trie.num_entries} entries, denied={len(self.deny)}, "
                f"pending={self.pending})")


def constraint_for(
    trie: Union[TokenTrie, CatalogSnapshot, "LiveCatalog"], rules: SpanRules, device: torch.device | str,
    *, kernel: Optional[str] = None,
) -> TrieConstraint:
    """The constraint of a trie, or of the trie a snapshot (a live catalog's latest) is decoded with now
    (:meth:`CatalogSnapshot.view`). Masking a live catalog also needs the view's deny filter
    (:meth:`CatalogView.filters`); reading its entries back needs a trie of exactly its entries and their snapshot
    numbers (:func:`~trie_decode.integrations.transformers.match_all`: ``view(whole=True)``, ``source_entries``).

    Example:
        >>> from trie_decode import TokenTrie
        >>> catalog = LiveCatalog(TokenTrie.from_sequences([[3, 4], [6]], vocab_size=8, keys=["a", "b"]))
        >>> catalog.add([[5]], keys=["c"]), catalog.wait_compacted()
        (1, True)
        >>> c = constraint_for(catalog, SpanRules(end_token_id=0), "cpu")
        >>> c.allowed_tokens(c.start(1)), [e.key for e in c.replay([[5, 0]])[0]]
        ([[3, 5, 6]], ['c'])
    """
    if isinstance(trie, TokenTrie):
        return TrieConstraint(trie, rules, device, kernel=kernel)
    if isinstance(trie, (CatalogSnapshot, LiveCatalog)):
        return trie.snapshot().view(rules).constraint(rules, device, kernel=kernel)
    raise TypeError(f"expected a TokenTrie, CatalogSnapshot or LiveCatalog, not {type(trie).__name__}")


# ---------------------------------------------------------------------------------------------------------- catalog
class LiveCatalog:
    """A trie that accepts changes: entries added and removed without a rebuild on the request path; decode
    ``snapshot().view(rules)`` (removals at once, additions once a background thread compacted them, see the module
    docstring; :meth:`wait_compacted` waits for it).

    Changes are validated before anything is applied (a change either happens whole or raises), and are safe
    against concurrent :meth:`snapshot` calls from other threads.

    Entries are named as in filters: a string is an entry key (the base's keys, else its names), an integer a base
    entry index; ``sequences=`` names entries by their tokens. Added entries need the columns the base has: keys if
    the base has keys, names if it has names (entries added from strings are named by them where the base has
    names).

    Args:
        base: the trie to start from (loaded, memory-mapped: it is never copied or modified).

    Example:
        >>> from trie_decode import TokenTrie
        >>> catalog = LiveCatalog(TokenTrie.from_sequences([[3, 4], [3, 5], [6]], vocab_size=8, keys=["a", "b", "c"]))
        >>> catalog.remove(["a", 2]), catalog.add([[7], [3, 4]], keys=["d", "a"])   # [3, 4] is revived
        (2, 2)
        >>> sorted(catalog.snapshot().sequences())
        [(3, 4), (3, 5), (7,)]
        >>> catalog.compact().num_entries
        3
    """

    def __init__(self, base: TokenTrie) -> None:
        if not isinstance(base, TokenTrie):
            raise TypeError(f"base must be a TokenTrie, not {type(base).__name__}")
        self._lock = threading.RLock()
        self._version = 0
        self._reset(base)

    def _reset(self, base: TokenTrie) -> None:
        self._base = base
        self._tomb: set[int] = set()
        # The added entries, in order of addition: tokens -> (name, key).
        self._delta: dict[tuple[int, ...], tuple[Optional[str], Optional[str]]] = {}
        self._delta_by_label: dict[str, dict[tuple[int, ...], None]] = {}
        # The labels (keys, else names) of added entries removed since, that no added entry holds again: filters
        # may still name them (CatalogSnapshot.retired). A rebase keeps them in the new base (its retired keys).
        self._retired: set[str] = set()
        self._snap: Optional[CatalogSnapshot] = None
        self._compactor = _Compactor(base)
        self._identity: Optional[str] = None

    @classmethod
    def open(
        cls, base_path: Union[str, "os.PathLike[str]"], delta_path: Union[str, "os.PathLike[str]", None] = None, *,
        tokenizer: Any = None, verify: bool = True,
    ) -> "LiveCatalog":
        """Load a trie file, and the changes of a delta file written by :meth:`save_delta` for it.

        Raises:
            TrieFileError: a file is missing or corrupted, or the delta was written for another base trie.
            TokenizerMismatchError: ``tokenizer`` is not the trie's.
        """
        catalog = cls(TokenTrie.load(base_path, tokenizer=tokenizer, verify=verify))
        if delta_path is not None:
            catalog.load_delta(delta_path, verify=verify)
        return catalog

    # ------------------------------------------------------------------ state
    @property
    def base(self) -> TokenTrie:
        return self._base

    @property
    def version(self) -> int:
        """The change counter: +1 for every call that changed the catalog."""
        return self._version

    @property
    def num_added(self) -> int:
        return len(self._delta)

    @property
    def num_removed(self) -> int:
        """Base entries removed."""
        return len(self._tomb)

    @property
    def num_entries(self) -> int:
        return self._base.num_entries - len(self._tomb) + len(self._delta)

    def __len__(self) -> int:
        return self.num_entries

    def identity(self) -> str:
        """The base's :func:`base_identity` (computed once)."""
        with self._lock:
            if self._identity is None:
                self._identity = base_identity(self._base)
            return self._identity

    def _changed(self) -> None:
        self._version += 1
        self._snap = None

    # ------------------------------------------------------------------ changes
    def add(
        self,
        entries: Any,
        *,
        names: Optional[Sequence[str]] = None,
        keys: Optional[Sequence[Any]] = None,
        tokenizer: Any = None,
        leading_space: Any = None,
        context: Any = None,
        normalize: Optional[str] = None,
    ) -> int:
        """Add entries: token sequences, or strings with ``tokenizer`` (tokenized as
        :meth:`TokenTrie.from_strings` does, with the same ``leading_space``/``context``/``normalize`` options).

        An entry the catalog already holds is left as it is (its name and key too); a removed base entry is
        revived with its base name and key.

        Args:
            entries: token-id sequences (as :meth:`TokenTrie.from_sequences` takes), or strings with ``tokenizer``.
            names: a name per sequence (needed when the base has names; strings name themselves, and their names are
                dropped when the base has none).
            keys: a key per sequence or string (needed when the base has keys).
            tokenizer: the base's tokenizer (its fingerprint is checked), to add strings.

        Returns:
            How many entries became live.

        Raises:
            CatalogUpdateError: names or keys missing, unexpected or of the wrong length; string options without a
                tokenizer. InvalidTokenError, InvalidEntryError: bad sequences (as the trie builders).
            TokenizerMismatchError: ``tokenizer`` is not the base's.
        """
        base = self._base
        if tokenizer is not None:
            base.check_tokenizer(tokenizer)
            if names is not None:
                raise CatalogUpdateError("entries added from strings are named by them: do not pass names=")
            built = TokenTrie.from_strings(entries, tokenizer, leading_space=leading_space, context=context,
                                           keys=keys, normalize=normalize)
            ragged = to_ragged(built.sequences())
            names = built.names() if base._names is not None else None  # a base without names keeps none
            keys = built._keys.to_list() if built._keys is not None else None
        else:
            for label, value in (("leading_space", leading_space), ("context", context), ("normalize", normalize)):
                if value is not None:
                    raise CatalogUpdateError(f"{label}= applies to strings: pass tokenizer= too")
            ragged = _sequences(entries, "entries given as strings need the base's tokenizer: pass tokenizer= (or "
                                         "give token-id sequences)")
            names, keys = _column(names, "names", len(ragged)), _column(keys, "keys", len(ragged))
        if len(ragged) == 0:
            return 0
        check_tokens(ragged, base.vocab_size)
        problems = []
        for label, column, table in (("names", names, base._names), ("keys", keys, base._keys)):
            if table is not None and column is None:
                problems.append(f"the base trie has entry {label}: pass {label}= (one per entry)")
            if table is None and column is not None:
                problems.append(f"the base trie has no entry {label}: they would be lost; leave {label}= out")
        if problems:
            raise CatalogUpdateError("; ".join(problems))
        with self._lock:
            if self._base is not base:
                raise CatalogUpdateError("the catalog was rebased during add(); add again")
            by_label = base._keys is not None
            changed = 0
            for i, (e, seq) in enumerate(zip(_entries_of(base, ragged), _tuples(ragged))):
                if e >= 0:
                    if e in self._tomb:
                        self._tomb.discard(e)
                        changed += 1
                    continue
                if seq in self._delta:
                    continue
                name = names[i] if names is not None else None
                key = keys[i] if keys is not None else None
                self._delta[seq] = (name, key)
                label = key if by_label else name
                if label is not None:
                    self._delta_by_label.setdefault(label, {})[seq] = None
                    self._retired.discard(label)
                changed += 1
            if changed:
                self._changed()
        return changed

    def remove(
        self, items: Optional[Iterable[Union[str, int]]] = None, *, sequences: Any = None, missing_ok: bool = False,
    ) -> int:
        """Remove entries: by key (every entry holding it, base or added), by base entry index, or by tokens.

        Args:
            items: a list of entry keys (strings: the base's keys, else its names) and base entry indices (ints).
            sequences: token sequences of entries to remove.
            missing_ok: ignore entries the catalog does not hold (or no longer holds) instead of raising.

        Returns:
            How many entries were removed.

        Raises:
            CatalogUpdateError: an entry the catalog does not hold (unless ``missing_ok``), an index outside the
                base, an item that is neither a key nor an index, keys on a catalog with neither keys nor names.
        """
        # One item: a scalar, or a 0-d array or tensor (iterating one failed inside numpy or torch).
        single = items is not None and (not hasattr(items, "__iter__") or getattr(items, "ndim", 1) == 0)
        if isinstance(items, (str, bytes)) or single:
            kind = ("string" if isinstance(items, (str, bytes)) else "integer" if _is_integer(items)
                    else type(items).__name__)
            raise CatalogUpdateError(f"items must be a list of entry keys or base entry indices, got the single {kind} "
                                     f"{items!r:.60}: pass [{items!r:.60}]")
        with self._lock:
            base = self._base
            nb = base.num_entries
            tomb_add: set[int] = set()
            delta_del: dict[tuple[int, ...], None] = {}
            missing: list[Any] = []
            for x in items if items is not None else ():
                if isinstance(x, str):
                    hits = [e for e in _key_index(base).get(x) if e not in self._tomb]
                    tomb_add.update(hits)
                    added = self._delta_by_label.get(x, {})
                    delta_del.update(added)
                    if not hits and not added:
                        missing.append(x)
                elif _is_integer(x):  # an int, a numpy integer, a 0-d integer tensor (not a bool)
                    e = int(x)
                    if not 0 <= e < nb:
                        raise CatalogUpdateError(f"entry index {e} is not a base entry (the base has {nb}); remove "
                                                 "an added entry by its key or its tokens")
                    if e in self._tomb:
                        missing.append(e)
                    tomb_add.add(e)
                else:
                    raise CatalogUpdateError(f"items must hold entry keys (str) or base entry indices (int), got {x!r:.40}")
            if sequences is not None:
                ragged = _sequences(sequences, "sequences= takes token-id sequences: remove entries by key, "
                                               "remove([...]) (the base's keys, else its names)")
                if len(ragged):
                    check_tokens(ragged, base.vocab_size)
                    for e, seq in zip(_entries_of(base, ragged), _tuples(ragged)):
                        if e >= 0 and e not in self._tomb:
                            tomb_add.add(e)
                        elif seq in self._delta:
                            delta_del[seq] = None
                        else:
                            missing.append(seq)
            if missing and not missing_ok:
                raise CatalogUpdateError(f"{len(missing)} entries to remove are not in the catalog, e.g. {missing[:3]}"
                                         " (pass missing_ok=True to ignore them)")
            tomb_add -= self._tomb
            self._tomb |= tomb_add
            by_label = base._keys is not None
            for seq in delta_del:
                name, key = self._delta.pop(seq)
                label = key if by_label else name
                if label is not None:
                    group = self._delta_by_label[label]
                    del group[seq]
                    if not group:
                        del self._delta_by_label[label]
                        self._retired.add(label)  # filters may still name it (CatalogSnapshot.retired)
            changed = len(tomb_add) + len(delta_del)
            if changed:
                self._changed()
            return changed

    # ------------------------------------------------------------------ reading
    def snapshot(self) -> CatalogSnapshot:
        """The catalog as it is now, immutable (cached until the next change). Taking a snapshot after a change
        rebuilds the delta trie from the added entries (it is small: milliseconds per ten thousand entries)."""
        with self._lock:
            if self._snap is None:
                # The delta trie numbers its entries in the order of self._delta (from_sequences keeps input order).
                self._snap = CatalogSnapshot(self._base, self._delta_trie(), np.array(sorted(self._tomb), dtype=np.int64),
                                             self._version, retired=self._retired, _compactor=self._compactor,
                                             _added={seq: i for i, seq in enumerate(self._delta)})
            return self._snap

    def _delta_trie(self) -> Optional[TokenTrie]:
        if not self._delta:
            return None
        base = self._base
        columns = list(self._delta.values())
        return TokenTrie.from_sequences(
            list(self._delta),  # tuples of ints: packed in bulk (to_ragged's fast path)
            base.vocab_size,
            names=[c[0] for c in columns] if base._names is not None else None,
            keys=[c[1] for c in columns] if base._keys is not None else None,
            fingerprint=base.fingerprint,
            options={"source": "live catalog delta"},
        )

    def wait_compacted(self, timeout: Optional[float] = None) -> bool:
        """Make the catalog's additions visible: start the compaction of the current snapshot if it has entries the
        newest compacted trie lacks, and wait for the background thread (about 1 s per million entries).

        Returns:
            True when the current snapshot decodes with every entry it holds; False on timeout (or when the catalog
            changed meanwhile: call again).

        Raises:
            The compaction's error (e.g. MemoryError); requests keep decoding the last compacted trie.
        """
        snap = self.snapshot()
        if snap.num_entries == 0 or not snap.view().pending:
            return True
        if not snap._compactor.wait(timeout):
            return False
        return snap._latest_view().pending == 0

    def compact(self) -> TokenTrie:
        """One real trie of the current entries (see :meth:`CatalogSnapshot.compact`); the catalog is unchanged."""
        return self.snapshot().compact()

    def rebase(self) -> TokenTrie:
        """Fold the changes into a new base: compact, then continue from the result with no delta and no
        tombstone (running requests keep their snapshots). Save the returned trie over the trie file and delete the
        delta file so that other processes follow.

        Returns:
            The new base trie.
        """
        with self._lock:
            trie = self.compact()
            self._reset(trie)
            self._changed()
            return trie

    # ------------------------------------------------------------------ files
    def save_delta(self, path: Union[str, "os.PathLike[str]"]) -> None:
        """Write the changes (added entries with their names and keys, removed base entries, the keys of removed added
        entries) as a delta file that names its base trie; written to a temporary file, then renamed (readers never
        see half a file)."""
        with self._lock:
            snap = self.snapshot()
            identity = self.identity()
        base, delta = snap.base, snap.delta
        ragged = snap._added_ragged()
        arrays: dict[str, np.ndarray] = {
            "delta_tokens": ragged.values.astype(np.int32),
            "delta_offsets": ragged.offsets.astype(np.int64),
            "tombstones": np.asarray(snap.tombstones, dtype=np.int64),
        }
        for label, table in (("names", base._names), ("keys", base._keys)):
            if table is not None:
                column = getattr(delta, f"_{label}") if delta is not None else StringTable.from_strings([])
                arrays[f"{label}_blob"] = column.blob
                arrays[f"{label}_offsets"] = column.offsets
        if snap.retired:  # removed added entries' keys (optional: a file without them has none)
            column = StringTable.from_strings(sorted(snap.retired))
            arrays["retired_blob"], arrays["retired_offsets"] = column.blob, column.offsets
        metadata = {
            "kind": DELTA_KIND,
            "delta_version": str(DELTA_VERSION),
            "base_identity": identity,
            "base_entries": str(base.num_entries),
            "base_nodes": str(base.num_nodes),
            "vocab_size": str(base.vocab_size),
            "base_fingerprint": base.fingerprint,  # the tokenizer its token ids are of ("": unknown)
            "catalog_version": str(snap.version),
        }
        write_arrays(path, arrays, metadata)

    def load_delta(self, path: Union[str, "os.PathLike[str]", BinaryIO], *, verify: bool = True) -> None:
        """Replace the catalog's changes with those of a delta file written by :meth:`save_delta` for this base.

        Raises:
            TrieFileError: not a delta file, corrupted, malformed, or written for another base trie.
        """
        arrays, meta = read_arrays(path, verify=verify)
        label = str(getattr(path, "name", "the delta file")) if hasattr(path, "read") else os.fspath(path)
        if meta.get("kind") != DELTA_KIND:
            raise TrieFileError(f"{label} is not a live catalog delta file (kind {meta.get('kind')!r})")
        if meta.get("delta_version") not in ("1", str(DELTA_VERSION)):
            raise TrieFileError(f"{label}: unknown delta file version {meta.get('delta_version')!r}")
        base = self._base
        if meta["delta_version"] == "1" and base.extra:
            raise TrieFileError(
                f"{label} is a version 1 delta file: its base identity leaves out the base's extra arrays "
                f"({', '.join(sorted(base.extra))}), so it may have been written for this trie with other item lists "
                "or retired keys; save it again (save_delta) from the catalog that wrote it")
        mine = self.identity()
        if meta.get("base_identity") != mine:
            raise TrieFileError(
                f"{label} was written for another base trie (identity {meta.get('base_identity')!r}, "
                f"{meta.get('base_entries')} entries), not this catalog's base (identity {mine!r}, "
                f"{base.num_entries} entries): a delta applies only to the trie it was saved with"
            )
        theirs = meta.get("base_fingerprint", "")  # files written before it was recorded: unknown
        if theirs and base.fingerprint and theirs != base.fingerprint:  # the same ids, another tokenizer's tokens
            raise TrieFileError(f"{label} was written for a trie of another tokenizer (fingerprint {theirs[:16]}...), "
                                f"not this catalog's base (fingerprint {base.fingerprint[:16]}...): its token ids "
                                "would mean other text (a base saved by an older trie_decode records the older form "
                                "of its tokenizer's fingerprint: then save the delta again from a catalog over it)")
        expected = {"delta_tokens": np.int32, "delta_offsets": np.int64, "tombstones": np.int64}
        for t in ("names", "keys", "retired"):
            expected.update({f"{t}_blob": np.uint8, f"{t}_offsets": np.int64})
        check_vectors(arrays, expected, label)
        for name in ("delta_tokens", "delta_offsets", "tombstones"):
            if name not in arrays:
                raise TrieFileError(f"{label} is missing the array {name!r}")
        tokens, offsets, tomb = arrays["delta_tokens"], arrays["delta_offsets"], arrays["tombstones"]
        k = len(offsets) - 1
        if k < 0 or offsets[0] != 0 or offsets[-1] != len(tokens) or np.any(np.diff(offsets) <= 0):
            raise TrieFileError(f"{label}: delta_offsets do not delimit non-empty sequences of delta_tokens")
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= base.vocab_size):
            raise TrieFileError(f"{label}: a token id is outside the base's vocabulary [0, {base.vocab_size})")
        if tomb.size and (np.any(np.diff(tomb) <= 0) or tomb[0] < 0 or tomb[-1] >= base.num_entries):
            raise TrieFileError(f"{label}: tombstones are not sorted unique base entry indices")
        columns: dict[str, list[str]] = {}
        for t, table in (("names", base._names), ("keys", base._keys)):
            present = f"{t}_blob" in arrays and f"{t}_offsets" in arrays
            if (table is not None) != present:
                raise TrieFileError(f"{label}: the delta's {t} do not match the base's (the base "
                                    f"{'has' if table is not None else 'has no'} {t})")
            if present:
                column = StringTable(arrays[f"{t}_blob"], arrays[f"{t}_offsets"])
                problem = column.problem(k)
                if problem:
                    raise TrieFileError(f"{label}: the {t} table {problem}")
                columns[t] = column.to_list()
        retired: list[str] = []
        if "retired_blob" in arrays or "retired_offsets" in arrays:
            column = StringTable(arrays.get("retired_blob", np.zeros(0, np.uint8)),
                                 arrays.get("retired_offsets", np.zeros(0, np.int64)))
            problem = column.problem(None)
            if problem:
                raise TrieFileError(f"{label}: the retired key table {problem}")
            retired = column.to_list()
        ragged = RaggedTokens(tokens.astype(np.int64), offsets.astype(np.int64))
        with self._lock:
            if self._base is not base:  # checked against a base another thread has replaced since (rebase())
                raise TrieFileError(f"{label}: the catalog was rebased while the delta file was read, and the delta "
                                    "applies only to the base it was saved with")
            saved = (self._tomb, self._delta, self._delta_by_label, self._retired, self._snap)
            self._tomb, self._delta, self._delta_by_label, self._retired = set(tomb.tolist()), {}, {}, set()
            try:
                if k:
                    self.add(ragged, names=columns.get("names"), keys=columns.get("keys"))
            except Exception:
                self._tomb, self._delta, self._delta_by_label, self._retired, self._snap = saved
                raise
            self._retired = set(retired) - set(self._delta_by_label)
            self._changed()

    def __repr__(self) -> str:
        return (f"LiveCatalog(version={self._version}, entries={self.num_entries}, base={self._base.num_entries}, "
                f"added={len(self._delta)}, removed={len(self._tomb)})")
