"""Live catalogs: add and remove entries of a loaded trie without rebuilding it, and decode over the result.

Why this exists: retrieval and recommendation catalogs change every day (new items, withdrawn ones), and a trie of
millions of entries takes seconds to rebuild. A :class:`LiveCatalog` keeps the loaded trie (the *base*) as it is and
records the changes beside it:

- added entries go into a small *delta* trie, rebuilt from its entry list when a snapshot is taken (it is small);
- removed base entries become *tombstones* (sorted base entry indices), applied while decoding through the deny
  filters of :mod:`trie_decode.filters`: a removed entry can never be completed, and a subtree whose entries are all
  removed is pruned from the mask;
- removing an added entry drops it from the delta; adding an entry the base holds but that was removed revives it.

Decoding reads a :class:`CatalogSnapshot`: base, delta, tombstones and a version number, immutable. A
:class:`SnapshotConstraint` decodes over the union of base-minus-tombstones and delta exactly as a
:class:`~trie_decode.constraint.TrieConstraint` over the single trie :meth:`CatalogSnapshot.compact` builds
(tests/test_live.py checks it step by step, in every ``on_complete`` mode, with triggers, on every kernel).
:meth:`LiveCatalog.compact` folds the changes into one real trie when the delta has grown.

What running requests see: a request decodes against the snapshot taken when it started, to its end. A change
never reaches a running request, so it never sees half of one (an entry's removal without the addition made with
it, or a path whose entry disappeared under it); every request that starts after the change sees all of it.

Changes are saved as a small *delta file* (:meth:`LiveCatalog.save_delta`, a safetensors file beside the trie file,
by convention :func:`delta_path_for`) that names the base trie it belongs to: it is never applied to another base.

Dimension letters: R state rows, B logits rows, V logits width, E entries, T tombstones.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import stat
import threading
from dataclasses import dataclass, replace
from typing import Any, Iterable, Optional, Sequence, Union

import numpy as np
import torch

from ._build import RaggedTokens, build_arrays, check_tokens, to_ragged
from .constraint import DONE, FREE, RowState, SpanRules, TrieConstraint
from .device import DeviceTrie
from .entries import Entry, StringTable
from .errors import (
    CatalogUpdateError,
    ConstraintConfigError,
    EmptyTrieError,
    InvalidTokenError,
    TrieFileError,
)
from .fileio import read_arrays, write_arrays
from .filters import EntryOrder, KeyIndex, RowFilters, entry_indices, is_per_row
from .kernels.vectorized import ALL_MASKED_FLOOR, NEG_INF
from .masking import pack_bitmask
from .spans import EXTRA0, EXTRA1, span_moves
from .trie import TokenTrie

__all__ = [
    "LiveCatalog",
    "CatalogSnapshot",
    "SnapshotConstraint",
    "SnapshotState",
    "SnapshotFilters",
    "constraint_for",
    "delta_path_for",
    "delta_stat",
    "apply_delta_file",
    "base_identity",
]

DELTA_KIND = "trie_decode.live_delta"
DELTA_VERSION = 1


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
    """A digest of a trie's structure, entry numbering, names and keys: what a delta file names as its base.

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
    return h.hexdigest()


def _key_index(trie: TokenTrie) -> KeyIndex:
    """key -> every entry holding it (catalog item keys included), the index filters use (built once per trie)."""
    try:
        return KeyIndex.of(trie)
    except ConstraintConfigError:
        raise CatalogUpdateError("this catalog has neither keys nor names: name entries by index or by tokens") from None


def _entry_tokens(trie: TokenTrie, entries: np.ndarray) -> RaggedTokens:
    """The token sequences of entries ``entries`` of ``trie``, vectorized over entries (a loop over depth only).

    Args:
        entries: Shape: (K,), int64.
    """
    nodes = trie.entry_node[entries].astype(np.int64)
    depth = (np.searchsorted(trie.level_ptr, nodes, side="right") - 1).astype(np.int64)
    width = int(depth.max(initial=0))
    matrix = np.zeros((len(nodes), width), dtype=np.int64)
    parent = trie.parent
    cur = nodes
    rows = np.arange(len(nodes))
    for step in range(width):
        pos = depth - 1 - step
        ok = pos >= 0
        matrix[rows[ok], pos[ok]] = trie.token[cur[ok]]
        cur = np.where(ok, parent[cur], cur)
    offsets = np.zeros(len(nodes) + 1, dtype=np.int64)
    np.cumsum(depth, out=offsets[1:])
    return RaggedTokens(matrix[np.arange(width) < depth[:, None]], offsets)


def _concat_ragged(parts: Sequence[RaggedTokens]) -> RaggedTokens:
    shifts = np.cumsum([0] + [int(p.offsets[-1]) for p in parts[:-1]])
    offsets = np.concatenate([np.zeros(1, dtype=np.int64)] + [p.offsets[1:] + s for p, s in zip(parts, shifts)])
    return RaggedTokens(np.concatenate([p.values for p in parts]), offsets)


def _walk(trie: TokenTrie, ragged: RaggedTokens) -> np.ndarray:
    """The node each sequence reaches in ``trie`` (-1: it leaves the trie): one ``searchsorted`` per depth over the
    trie's edge keys (the CPU :class:`~trie_decode.device.DeviceTrie`'s, built once per trie). Shape: (K,), int64."""
    edge_key = DeviceTrie.get(trie, "cpu").arrays.edge_key
    lengths = ragged.lengths
    node = np.zeros(len(ragged), dtype=np.int64)
    vocab = np.int64(trie.vocab_size)
    for d in range(int(lengths.max(initial=0))):
        idx = np.flatnonzero((lengths > d) & (node >= 0))
        key = node[idx] * vocab + ragged.values[ragged.offsets[idx] + d]
        pos = np.minimum(np.searchsorted(edge_key, key), len(edge_key) - 1)
        node[idx] = np.where(edge_key[pos] == key, pos, -1)
    return node


def delta_stat(trie_path: Union[str, "os.PathLike[str]"]) -> Optional[tuple]:
    """The identity of the delta file beside a trie file (:func:`delta_path_for`): ``(path, st_dev, st_ino,
    st_mtime_ns, st_size)``, or None when there is none (or it is not a regular file). A server adds it to its trie cache key, so that a new or
    replaced delta file is picked up by the next request (as a replaced trie file is, by its own stat).

    Example:
        >>> delta_stat("/nonexistent/catalog.safetensors") is None
        True
    """
    path = delta_path_for(trie_path)
    try:
        st = os.lstat(path)  # a symlink is not followed: a delta file is the regular file beside the trie file
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return (path, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


def apply_delta_file(base: TokenTrie, delta_path: Union[str, "os.PathLike[str]"], *, verify: bool = True) -> TokenTrie:
    """The trie a server decodes for a trie file with a delta file beside it: the base with the delta's changes
    folded in (:meth:`LiveCatalog.load_delta`, then :meth:`CatalogSnapshot.compact`), one real trie, so every
    serving path (processors, beam search, fast-forward, filters, distinct lists) works on it unchanged. The base
    is returned as it is when the delta changes nothing. Costs a compaction (about 1 s per million entries): cache
    the result by both files' identities (:func:`delta_stat`).

    Raises:
        TrieFileError: the delta file is corrupted, malformed, or was written for another base trie.
    """
    catalog = LiveCatalog(base)
    catalog.load_delta(delta_path, verify=verify)
    snap = catalog.snapshot()
    return base if snap.plain else snap.compact()


# ---------------------------------------------------------------------------------------------------------- snapshot
class CatalogSnapshot:
    """One immutable state of a live catalog: the base trie, the delta trie of added entries (or None), the sorted
    base entry indices removed (tombstones) and a version number.

    Entries are numbered as the union: base entries keep their base index (removed ones are gone), added entries
    come after, ``base.num_entries + i`` for the delta's entry ``i``. These numbers hold within one snapshot;
    :meth:`compact` renumbers.

    Args:
        base: the base trie.
        delta: the added entries as a trie of the same vocabulary, or None.
        tombstones: removed base entry indices, sorted and unique. Shape: (T,), int64.
        version: the catalog's change counter when the snapshot was taken.

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
        _base_constraints: Optional[dict] = None,
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
        self.base, self.delta, self.tombstones, self.version = base, delta, tomb, int(version)
        # Constraints over the base are shared by every snapshot of one catalog (same base): a new snapshot only
        # builds its delta's.
        self._base_constraints = {} if _base_constraints is None else _base_constraints
        self._constraints: dict[tuple, Any] = {}
        self._lock = threading.Lock()

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
        """Entry number ``index`` of this snapshot (see the class docstring for the numbering)."""
        index = int(index)
        nb = self.base.num_entries
        if 0 <= index < nb:
            if self.removed(index):
                raise IndexError(f"entry {index} was removed from the catalog")
            return self.base.entry(index)
        nd = self.delta.num_entries if self.delta is not None else 0
        if not nb <= index < nb + nd:
            raise IndexError(f"entry {index} is not in this snapshot ({nb} base entries, {nd} added)")
        return replace(self.delta.entry(index - nb), index=index)

    def lookup(self, tokens: Iterable[int]) -> Optional[Entry]:
        """The live entry whose tokens are exactly ``tokens``, or None."""
        tokens = list(tokens)
        found = self.base.lookup(tokens)
        if found is not None and not self.removed(found.index):
            return found
        if self.delta is not None:
            found = self.delta.lookup(tokens)
            if found is not None:
                return replace(found, index=self.base.num_entries + found.index)
        return None

    def sequences(self) -> list[tuple[int, ...]]:
        """Every live entry's tokens: the base's in base order, then the added ones (the order of :meth:`compact`)."""
        ragged = self._ragged()
        v, o = ragged.values.tolist(), ragged.offsets.tolist()
        return [tuple(v[o[i] : o[i + 1]]) for i in range(len(o) - 1)]

    def _alive_base(self) -> np.ndarray:
        alive = np.ones(self.base.num_entries, dtype=np.bool_)
        alive[self.tombstones] = False
        return np.flatnonzero(alive)

    def _ragged(self) -> RaggedTokens:
        parts = [_entry_tokens(self.base, self._alive_base())]
        if self.delta is not None:
            parts.append(_entry_tokens(self.delta, np.arange(self.delta.num_entries)))
        return _concat_ragged(parts)

    def delta_keys(self) -> Optional[KeyIndex]:
        """key -> added entry indices (within the delta), or None without a delta."""
        return None if self.delta is None else _key_index(self.delta)

    def compact(self) -> TokenTrie:
        """One real trie: the base minus its removed entries, then the added ones (entries renumbered in that
        order; names, keys, fingerprint and options kept). The base's ``extra`` arrays (a catalog's item lists) are
        not carried over.

        Raises:
            EmptyTrieError: every entry was removed.
        """
        if self.num_entries == 0:
            raise EmptyTrieError("every entry of the catalog was removed: compact() would give an empty trie")
        alive = self._alive_base()
        ragged = self._ragged()
        built = build_arrays(ragged, self.base.vocab_size)
        assert built.num_duplicates == 0, "a live catalog never holds one sequence twice"

        def column(base_table: Optional[StringTable], delta_table: Optional[StringTable]) -> Optional[StringTable]:
            if base_table is None:
                return None
            tables = [base_table.take(alive)] + ([delta_table] if delta_table is not None else [])
            return StringTable.concat(tables).take(built.entry_source)

        delta = self.delta
        return TokenTrie(
            child_ptr=built.child_ptr,
            token=built.token,
            node_entry=built.node_entry,
            entry_node=built.entry_node,
            level_ptr=built.level_ptr,
            vocab_size=self.base.vocab_size,
            names=column(self.base._names, delta._names if delta is not None else None),
            keys=column(self.base._keys, delta._keys if delta is not None else None),
            fingerprint=self.base.fingerprint,
            options=self.base.options,
        )

    # ------------------------------------------------------------------ decoding
    def constraint(
        self, rules: SpanRules, device: torch.device | str, *, kernel: Optional[str] = None,
        dense_min_fanout: Optional[int] = None,
    ) -> Union[TrieConstraint, "SnapshotConstraint"]:
        """The constraint that decodes this snapshot under ``rules`` on ``device`` (built once, then cached): the
        base's own :class:`TrieConstraint` when nothing changed, else a :class:`SnapshotConstraint`."""
        key = (rules, str(torch.device(device)), kernel, dense_min_fanout)
        with self._lock:
            found = self._constraints.get(key)
        if found is None:
            found = (self._base_constraint(rules, device, kernel, dense_min_fanout) if self.plain else
                     SnapshotConstraint(self, rules, device, kernel=kernel, dense_min_fanout=dense_min_fanout))
            with self._lock:
                found = self._constraints.setdefault(key, found)
        return found

    def _base_constraint(self, rules: SpanRules, device: torch.device | str, kernel: Optional[str],
                         dense_min_fanout: Optional[int]) -> TrieConstraint:
        """The base's :class:`TrieConstraint` for these options, shared by every snapshot of one catalog (a new
        snapshot builds only its delta's)."""
        key = (rules, str(torch.device(device)), kernel, dense_min_fanout)
        with self._lock:
            found = self._base_constraints.get(key)
        if found is None:
            found = TrieConstraint(self.base, rules, device, kernel=kernel, dense_min_fanout=dense_min_fanout)
            with self._lock:
                found = self._base_constraints.setdefault(key, found)
        return found

    def __repr__(self) -> str:
        added = self.delta.num_entries if self.delta is not None else 0
        return (f"CatalogSnapshot(version={self.version}, entries={self.num_entries}, base={self.base.num_entries}, "
                f"added={added}, removed={len(self.tombstones)})")


def constraint_for(
    trie: Union[TokenTrie, CatalogSnapshot, "LiveCatalog"], rules: SpanRules, device: torch.device | str,
    *, kernel: Optional[str] = None,
) -> Union[TrieConstraint, "SnapshotConstraint"]:
    """The constraint for a trie, a snapshot, or a live catalog's latest snapshot.

    Example:
        >>> from trie_decode import TokenTrie
        >>> catalog = LiveCatalog(TokenTrie.from_sequences([[3, 4], [6]], vocab_size=8))
        >>> catalog.add([[5]])
        1
        >>> c = constraint_for(catalog, SpanRules(end_token_id=0), "cpu")
        >>> c.allowed_tokens(c.start(1))
        [[3, 5, 6]]
    """
    if isinstance(trie, TokenTrie):
        return TrieConstraint(trie, rules, device, kernel=kernel)
    if isinstance(trie, (CatalogSnapshot, LiveCatalog)):
        return trie.snapshot().constraint(rules, device, kernel=kernel)
    raise TypeError(f"expected a TokenTrie, CatalogSnapshot or LiveCatalog, not {type(trie).__name__}")


# ---------------------------------------------------------------------------------------------------------- catalog
class LiveCatalog:
    """A trie that accepts changes: entries added and removed without a rebuild; decode over :meth:`snapshot`.

    Changes are validated before anything is applied (a change either happens whole or raises), and are safe
    against concurrent :meth:`snapshot` calls from other threads.

    Entries are named as in filters: a string is an entry key (the base's keys, else its names), an integer a base
    entry index; ``sequences=`` names entries by their tokens. Added entries need the columns the base has: keys if
    the base has keys, names if it has names (entries added from strings are named by them).

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
        self._snap: Optional[CatalogSnapshot] = None
        self._base_constraints: dict = {}
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
            names: a name per sequence (needed when the base has names; strings name themselves).
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
            names = built.names()
            keys = built._keys.to_list() if built._keys is not None else None
        else:
            for label, value in (("leading_space", leading_space), ("context", context), ("normalize", normalize)):
                if value is not None:
                    raise CatalogUpdateError(f"{label}= applies to strings: pass tokenizer= too")
            ragged = to_ragged(entries)
            for label, column in (("names", names), ("keys", keys)):
                if column is not None and len(column) != len(ragged):
                    raise CatalogUpdateError(f"{label} has {len(column)} items but there are {len(ragged)} sequences")
        if len(ragged) == 0:
            return 0
        check_tokens(ragged, base.vocab_size)
        for label, column, table in (("names", names, base._names), ("keys", keys, base._keys)):
            if table is not None and column is None:
                raise CatalogUpdateError(f"the base trie has entry {label}: pass {label}= (one per entry)")
            if table is None and column is not None:
                raise CatalogUpdateError(f"the base trie has no entry {label}: they would be lost; leave {label}= out")
        names = [str(x) for x in names] if names is not None else None
        keys = [str(x) for x in keys] if keys is not None else None
        values, offsets = ragged.values.tolist(), ragged.offsets.tolist()
        with self._lock:
            if self._base is not base:
                raise CatalogUpdateError("the catalog was rebased during add(); add again")
            node = _walk(base, ragged)
            entry = np.where(node >= 0, base.node_entry[np.maximum(node, 0)], -1).tolist()
            by_label = base._keys is not None
            changed = 0
            for i, e in enumerate(entry):
                if e >= 0:
                    if e in self._tomb:
                        self._tomb.discard(e)
                        changed += 1
                    continue
                seq = tuple(values[offsets[i] : offsets[i + 1]])
                if seq in self._delta:
                    continue
                name = names[i] if names is not None else None
                key = keys[i] if keys is not None else None
                self._delta[seq] = (name, key)
                label = key if by_label else name
                if label is not None:
                    self._delta_by_label.setdefault(label, {})[seq] = None
                changed += 1
            if changed:
                self._changed()
        return changed

    def remove(
        self, items: Optional[Iterable[Union[str, int]]] = None, *, sequences: Any = None, missing_ok: bool = False,
    ) -> int:
        """Remove entries: by key (every entry holding it, base or added), by base entry index, or by tokens.

        Args:
            items: entry keys (strings: the base's keys, else its names) and base entry indices (ints).
            sequences: token sequences of entries to remove.
            missing_ok: ignore entries the catalog does not hold (or no longer holds) instead of raising.

        Returns:
            How many entries were removed.

        Raises:
            CatalogUpdateError: an entry the catalog does not hold (unless ``missing_ok``), an index outside the
                base, an item that is neither a key nor an index, keys on a catalog with neither keys nor names.
        """
        if isinstance(items, (str, bytes)):
            raise CatalogUpdateError(f"items must be a list of keys or indices, got the single string {items!r:.60}")
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
                elif isinstance(x, (int, np.integer)) and not isinstance(x, bool):
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
                ragged = to_ragged(sequences)
                if len(ragged):
                    check_tokens(ragged, base.vocab_size)
                    node = _walk(base, ragged)
                    entry = np.where(node >= 0, base.node_entry[np.maximum(node, 0)], -1).tolist()
                    values, offsets = ragged.values.tolist(), ragged.offsets.tolist()
                    for i, e in enumerate(entry):
                        seq = tuple(values[offsets[i] : offsets[i + 1]])
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
                self._snap = CatalogSnapshot(self._base, self._delta_trie(), np.array(sorted(self._tomb), dtype=np.int64),
                                             self._version, _base_constraints=self._base_constraints)
            return self._snap

    def _delta_trie(self) -> Optional[TokenTrie]:
        if not self._delta:
            return None
        base = self._base
        columns = list(self._delta.values())
        # The sequences were checked when added: pack them directly (no per-token type checks).
        lengths = np.fromiter(map(len, self._delta), dtype=np.int64, count=len(self._delta))
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = np.fromiter(itertools.chain.from_iterable(self._delta), dtype=np.int64, count=int(offsets[-1]))
        return TokenTrie.from_sequences(
            RaggedTokens(values, offsets),
            base.vocab_size,
            names=[c[0] for c in columns] if base._names is not None else None,
            keys=[c[1] for c in columns] if base._keys is not None else None,
            fingerprint=base.fingerprint,
            options={"source": "live catalog delta"},
        )

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
        """Write the changes (added entries with their names and keys, removed base entries) as a delta file that
        names its base trie; written to a temporary file, then renamed (readers never see half a file)."""
        with self._lock:
            snap = self.snapshot()
            identity = self.identity()
        base, delta = snap.base, snap.delta
        if delta is not None:
            ragged = _entry_tokens(delta, np.arange(delta.num_entries))
        else:
            ragged = RaggedTokens(np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64))
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
        metadata = {
            "kind": DELTA_KIND,
            "delta_version": str(DELTA_VERSION),
            "base_identity": identity,
            "base_entries": str(base.num_entries),
            "base_nodes": str(base.num_nodes),
            "vocab_size": str(base.vocab_size),
            "catalog_version": str(snap.version),
        }
        write_arrays(path, arrays, metadata)

    def load_delta(self, path: Union[str, "os.PathLike[str]"], *, verify: bool = True) -> None:
        """Replace the catalog's changes with those of a delta file written by :meth:`save_delta` for this base.

        Raises:
            TrieFileError: not a delta file, corrupted, malformed, or written for another base trie.
        """
        arrays, meta = read_arrays(path, verify=verify)
        label = os.fspath(path)
        if meta.get("kind") != DELTA_KIND:
            raise TrieFileError(f"{label} is not a live catalog delta file (kind {meta.get('kind')!r})")
        if meta.get("delta_version") != str(DELTA_VERSION):
            raise TrieFileError(f"{label}: unknown delta file version {meta.get('delta_version')!r}")
        base = self._base
        mine = self.identity()
        if meta.get("base_identity") != mine:
            raise TrieFileError(
                f"{label} was written for another base trie (identity {meta.get('base_identity')!r}, "
                f"{meta.get('base_entries')} entries), not this catalog's base (identity {mine!r}, "
                f"{base.num_entries} entries): a delta applies only to the trie it was saved with"
            )
        expected = {"delta_tokens": np.int32, "delta_offsets": np.int64, "tombstones": np.int64}
        for t in ("names", "keys"):
            expected.update({f"{t}_blob": np.uint8, f"{t}_offsets": np.int64})
        for name, dtype in expected.items():
            if name in arrays and (arrays[name].ndim != 1 or arrays[name].dtype != np.dtype(dtype)):
                raise TrieFileError(f"{label}: array {name!r} is {arrays[name].dtype} {arrays[name].shape}, "
                                    f"expected a 1-D {np.dtype(dtype).name} array")
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
        columns: dict[str, Optional[list[str]]] = {}
        for t, table in (("names", base._names), ("keys", base._keys)):
            present = f"{t}_blob" in arrays and f"{t}_offsets" in arrays
            if (table is not None) != present:
                raise TrieFileError(f"{label}: the delta's {t} do not match the base's (the base "
                                    f"{'has' if table is not None else 'has no'} {t})")
            if present:
                column = StringTable(arrays[f"{t}_blob"], arrays[f"{t}_offsets"])
                offs = column.offsets
                if len(column) != k or offs[0] != 0 or offs[-1] != len(column.blob) or np.any(np.diff(offs) < 0):
                    raise TrieFileError(f"{label}: the {t} table does not match the delta's sequences")
                try:
                    columns[t] = column.to_list()
                except UnicodeDecodeError as exc:
                    raise TrieFileError(f"{label}: the {t} table is not UTF-8 text") from exc
            else:
                columns[t] = None
        ragged = RaggedTokens(tokens.astype(np.int64), offsets.astype(np.int64))
        with self._lock:
            saved = (self._tomb, self._delta, self._delta_by_label, self._snap)
            self._tomb, self._delta, self._delta_by_label = set(tomb.tolist()), {}, {}
            try:
                if k:
                    self.add(ragged, names=columns["names"], keys=columns["keys"])
            except Exception:
                self._tomb, self._delta, self._delta_by_label, self._snap = saved
                raise
            self._changed()

    def __repr__(self) -> str:
        return (f"LiveCatalog(version={self._version}, entries={self.num_entries}, base={self._base.num_entries}, "
                f"added={len(self._delta)}, removed={len(self._tomb)})")


# ---------------------------------------------------------------------------------------------------------- decoding
@dataclass
class SnapshotState:
    """The state of R rows decoding a snapshot: one state code per side (see :mod:`trie_decode.spans`), and the
    trie index (always 0: a snapshot is one catalog). Every Shape: (R,), int64.

    While a row is inside an entry, each side is at its node for the row's path, or DONE when the path left that
    side (the side is *out*: it contributes nothing). At a state code (FREE, a separator, DONE) both sides hold it.

    Attributes:
        base: each row's state on the base side. delta: on the delta side (equal to ``base`` when there is no
            delta). tree: zeros.
    """

    base: torch.Tensor
    delta: torch.Tensor
    tree: torch.Tensor

    def __len__(self) -> int:
        return self.base.numel()

    def select(self, index: torch.Tensor) -> "SnapshotState":
        """Rows ``index`` of this state (a gather: beam reordering)."""
        return SnapshotState(self.base[index], self.delta[index], self.tree[index])

    def clone(self) -> "SnapshotState":
        return SnapshotState(self.base.clone(), self.delta.clone(), self.tree.clone())

    def assign(self, index: Any, other: "SnapshotState") -> None:
        """Write ``other``'s rows into rows ``index`` of this state (in place)."""
        self.base[index] = other.base
        self.delta[index] = other.delta
        self.tree[index] = other.tree

    @staticmethod
    def cat(states: Sequence["SnapshotState"]) -> "SnapshotState":
        return SnapshotState(torch.cat([s.base for s in states]), torch.cat([s.delta for s in states]),
                             torch.cat([s.tree for s in states]))

    @property
    def node(self) -> torch.Tensor:
        """A :class:`RowState`-like view: the shared code where the row is at one, else the base side's node where
        the base is in, else the delta side's node. Assigning it sets the rows whose value changes to that code on
        both sides (for codes, e.g. ``state.node = torch.where(ended, DONE, state.node)``)."""
        return torch.where(self.base != DONE, self.base, self.delta)

    @node.setter
    def node(self, value: torch.Tensor) -> None:
        changed = value != self.node
        self.base = torch.where(changed, value, self.base)
        self.delta = torch.where(changed, value, self.delta)

    @property
    def done(self) -> torch.Tensor:
        """Rows that may only emit the end token. Shape: (R,), bool."""
        return (self.base == DONE) & (self.delta == DONE)


def _as_state(state: Any) -> SnapshotState:
    """A :class:`SnapshotState`; a :class:`RowState` of state codes only (DONE, FREE, separator codes) is taken as
    both sides at those codes."""
    if isinstance(state, SnapshotState):
        return state
    if isinstance(state, RowState):
        return SnapshotState(state.node, state.node, state.tree)
    raise TypeError(f"state must be a SnapshotState, not {type(state).__name__}")


class SnapshotFilters:
    """Per-row allow/deny filters over a snapshot: one :class:`RowFilters` per side, the base's including the
    tombstones. Made by :meth:`SnapshotConstraint.filters`.

    Attributes:
        base, delta: the sides' filters (None: the side is unfiltered; the base then uses the tombstones alone).
        base_off, delta_off: rows whose allow set holds nothing on that side. Shape: (R,), bool, or None.
    """

    def __init__(self, base: Optional[RowFilters], delta: Optional[RowFilters], base_off: Optional[torch.Tensor],
                 delta_off: Optional[torch.Tensor]) -> None:
        self.base, self.delta, self.base_off, self.delta_off = base, delta, base_off, delta_off

    def select(self, index: torch.Tensor) -> "SnapshotFilters":
        """Rows ``index`` of these filters (beam reordering)."""
        pick = lambda f: None if f is None else f.select(index)  # noqa: E731
        cut = lambda t: None if t is None else t[index]  # noqa: E731
        return SnapshotFilters(pick(self.base), pick(self.delta), cut(self.base_off), cut(self.delta_off))


class SnapshotConstraint:
    """Decode over a :class:`CatalogSnapshot`: the union of the base minus its tombstones and the delta, exactly as
    a :class:`TrieConstraint` over the trie :meth:`CatalogSnapshot.compact` would build.

    The same public methods as :class:`TrieConstraint` (``start``, ``advance``, ``mask_``, ``allowed``,
    ``allowed_tokens``, ``bitmask``, ``replay``, ``filters``), with :class:`SnapshotState` for the rows. Inside,
    one :class:`TrieConstraint` per side with the same :class:`SpanRules`; every row has a state on each side.

    A step (advance): each side takes the token by its own rules. A side whose node has the token as a child (with
    an entry left below it) goes down; a side that has no such child is *out* (DONE) until the entry ends. When no
    side went down, a side that stood at a live entry end (or at a shared code) moves to a code (FREE, a separator
    code, the root after a separator or a trigger): every side takes it; otherwise every side is DONE.

    The mask: the delta side's kept columns (its node's children and extra tokens, W + 2 per row, W the delta's
    largest fanout) and their values are read first; then the base side is masked in place by its kernel (the
    tombstones as a deny filter, with the request's own filters); a side that is out keeps nothing, not even the end
    token; the delta's columns are merged in by a max over those columns only. With a request filter on the delta
    side, the delta is masked whole into a scratch copy and merged by an element-wise max. In ``"release"`` mode,
    rows standing at a live entry end are shown FREE to both sides (unconstrained), and with tombstones the sides
    mask under ``"eos"`` rules (a removed entry end must not release the row). Fixed shapes and no host read on
    the torch path. With no delta and no tombstone it is :class:`TrieConstraint`'s step.

    One deviation from the compacted trie: where another processor set every token the base side allows to -inf
    while a token of the delta is still finite, the base side's tokens keep the floor
    (:data:`~trie_decode.kernels.vectorized.ALL_MASKED_FLOOR`) instead of -inf (and the other way round on the
    whole-mask path). The floor is far below any real logit, so the chosen token is the same.

    Args:
        snapshot: the snapshot.
        rules, device, dense_min_fanout, kernel: as :class:`TrieConstraint`.

    Raises:
        EmptyTrieError: the snapshot holds no entry.

    Example:
        >>> import torch
        >>> from trie_decode import TokenTrie
        >>> catalog = LiveCatalog(TokenTrie.from_sequences([[3, 4], [3, 5], [6]], vocab_size=8))
        >>> catalog.remove([1]), catalog.add([[3, 7], [2]])
        (1, 2)
        >>> c = SnapshotConstraint(catalog.snapshot(), SpanRules(end_token_id=0), "cpu")
        >>> state = c.start(1)
        >>> c.allowed_tokens(state), c.allowed_tokens(c.advance(state, torch.tensor([3])))
        ([[2, 3, 6]], [[4, 7]])
    """

    def __init__(
        self,
        snapshot: CatalogSnapshot,
        rules: SpanRules,
        device: torch.device | str,
        *,
        dense_min_fanout: Optional[int] = None,
        kernel: Optional[str] = None,
    ) -> None:
        if not isinstance(snapshot, CatalogSnapshot):
            raise TypeError(f"snapshot must be a CatalogSnapshot, not {type(snapshot).__name__}")
        if not isinstance(rules, SpanRules):
            raise TypeError(f"rules must be SpanRules, not {type(rules).__name__}")
        if snapshot.num_entries == 0:
            raise EmptyTrieError("every entry of the catalog was removed: nothing could be generated")
        self.snapshot, self.rules, self.device = snapshot, rules, torch.device(device)
        options = dict(dense_min_fanout=dense_min_fanout, kernel=kernel)
        self.base = snapshot._base_constraint(rules, device, kernel, dense_min_fanout)
        self.delta = TrieConstraint(snapshot.delta, rules, device, **options) if snapshot.delta is not None else None
        self.kernel = self.base.kernel
        self._options = options
        self.vocab_size = snapshot.vocab_size
        self.needed_width = max(self.base.needed_width, self.delta.needed_width if self.delta is not None else 0)
        self._plain = snapshot.plain
        tomb = snapshot.tombstones
        self._tomb = (RowFilters(EntryOrder.of(snapshot.base), [None], [tomb], self.device) if tomb.size else None)
        self._release_fix = rules.on_complete == "release" and tomb.size > 0
        if self._release_fix:
            eos = SpanRules(rules.end_token_id)
            self._mask_base = snapshot._base_constraint(eos, device, kernel, dense_min_fanout)
            self._mask_delta = TrieConstraint(snapshot.delta, eos, device, **options) if self.delta is not None else None
        else:
            self._mask_base, self._mask_delta = self.base, self.delta
        self._scratch = threading.local()
        if self.delta is not None:  # the delta side's sparse reading (see _delta_columns)
            t = self.delta.dtries[0].tensors
            width = int(np.diff(snapshot.delta.child_ptr).max(initial=0))
            self._delta_ptr = t.child_ptr.to(torch.long)
            self._delta_tok = torch.cat([t.child_token.to(torch.long), t.child_token.new_zeros(width, dtype=torch.long)])
            n = snapshot.delta.num_nodes
            self._delta_extra = self._mask_delta.tables[0].tensor[:n, EXTRA0 : EXTRA1 + 1].to(torch.long)
            self._delta_j = torch.arange(width, device=self.device)
        # Arrays the step reads, built now (setup may read the device; the step may not).
        for side in (self.base, self.delta):
            if side is not None:
                side.dtries[0].tensors.terminal
        for order in ([EntryOrder.of(snapshot.base)] if tomb.size else []):
            order.on(self.device)

    def with_kernel(self, kernel: str) -> "SnapshotConstraint":
        """The same constraint stepping with another kernel (to compare them)."""
        return SnapshotConstraint(self.snapshot, self.rules, self.device, kernel=kernel,
                                  dense_min_fanout=self._options["dense_min_fanout"])

    # ------------------------------------------------------------------ state
    def start(self, num_rows: int, tree: Optional[torch.Tensor] = None, tails: Optional[torch.Tensor] = None
              ) -> SnapshotState:
        """The state of rows about to generate their first token (see :meth:`TrieConstraint.start`; ``tree`` must
        be zeros: a snapshot is one catalog)."""
        if tree is not None and tree.numel() and bool((tree != 0).any()):
            raise ConstraintConfigError("a catalog snapshot is one trie: every row's trie index must be 0")
        s = self.base.start(num_rows, None, tails)
        return SnapshotState(s.node, s.node.clone(), s.tree)

    def _side_filters(self, filters: Optional[SnapshotFilters]) -> tuple:
        if filters is None:
            return self._tomb, None, None, None
        if not isinstance(filters, SnapshotFilters):
            raise TypeError(f"filters must come from SnapshotConstraint.filters, not {type(filters).__name__}")
        return (filters.base if filters.base is not None else self._tomb), filters.delta, filters.base_off, filters.delta_off

    @staticmethod
    def _info(c: TrieConstraint, node: torch.Tensor, filters: Optional[RowFilters], off: Optional[torch.Tensor]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row of one side: whether its node still has a usable entry below it (``alive``), and whether a usable
        entry ends at it (``own``); both False at codes. One batched ``searchsorted`` with filters. Shape: (R,)."""
        inside = node >= 0
        n = node.clamp(min=0)
        if filters is None:
            alive, own = inside, inside & c.dtries[0].tensors.terminal[n]
        else:
            lo, hi, node_rank = filters.order.on(node.device)
            first = lo[n]
            # In depth-first rank order a node's own entry comes first in its interval: [lo, lo+1) is it.
            usable = filters.usable(torch.stack([first, first + 1, hi[n]], dim=1))
            alive = inside & (usable[:, 0] | usable[:, 1])
            own = inside & (node_rank[n] >= 0) & usable[:, 0]
        if off is not None:
            alive, own = alive & ~off, own & ~off
        return alive, own

    def _step(self, state: Any, tokens: torch.Tensor, tails: Optional[torch.Tensor],
              filters: Optional[SnapshotFilters]) -> tuple[SnapshotState, torch.Tensor, Optional[torch.Tensor]]:
        """The union step (see the class docstring); also which rows completed a base / a delta entry.

        Moves follow the trie the row may use, as :class:`TrieConstraint` with filters does: the compacted trie
        without what the tombstones and the request's filters exclude (an excluded child is no child).
        """
        state = _as_state(state)
        if tokens.dtype is not torch.long or tokens.device != self.device:
            tokens = tokens.to(self.device, torch.long)
        fb, fd, off_b, off_d = self._side_filters(filters)
        ob, od, tree = state.base, state.delta, state.tree
        nb = self.base.advance(RowState(ob, tree), tokens, tails).node
        exist_nb, _ = self._info(self.base, nb, fb, off_b)
        _, own_ob = self._info(self.base, ob, fb, off_b)
        # Inside an entry a move to a node id >= 1 is a child (the root, 0, is only reached from a code).
        down_b = (ob >= 0) & (nb >= 1) & exist_nb
        move_b = torch.where((ob >= 0) & ((nb >= 1) | ~own_ob), DONE, nb)
        if fb is not None or off_b is not None:
            # An excluded child is no child: at a usable entry end the token makes the move it makes off the trie (a
            # separator, a release), which the kernel did not take because the base still holds the child.
            move_b = torch.where((ob >= 0) & (nb >= 1) & ~exist_nb & own_ob,
                                 self._off_trie(self.base, ob, tokens, tails), move_b)
        if self.delta is not None:
            nd = self.delta.advance(RowState(od, tree), tokens, tails).node
            exist_nd, _ = self._info(self.delta, nd, fd, off_d)
            _, own_od = self._info(self.delta, od, fd, off_d)
            down_d = (od >= 0) & (nd >= 1) & exist_nd
            move_d = torch.where((od >= 0) & ((nd >= 1) | ~own_od), DONE, nd)
            if fd is not None or off_d is not None:
                move_d = torch.where((od >= 0) & (nd >= 1) & ~exist_nd & own_od,
                                     self._off_trie(self.delta, od, tokens, tails), move_d)
            went = down_b | down_d
            code = torch.where(move_b != DONE, move_b, move_d)
            new_b = torch.where(down_b, nb, torch.where(went, DONE, code))
            new_d = torch.where(down_d, nd, torch.where(went, DONE, code))
            done_d = own_od & ~went
        else:
            went = down_b
            new_b = new_d = torch.where(down_b, nb, move_b)
            done_d = None
        done_b = own_ob & ~went
        return SnapshotState(new_b, new_d, tree), done_b, done_d

    def _off_trie(self, side: TrieConstraint, node: torch.Tensor, tokens: torch.Tensor,
                  tails: Optional[torch.Tensor]) -> torch.Tensor:
        """Each row's move on ``side`` as if its token were not a child (the step table's off-trie move)."""
        moved = span_moves(side.tables[0].tensor, self.rules, node, tokens, torch.full_like(node, -1))
        if self.rules.trigger:
            moved = torch.where((moved == FREE) & side._tail_is_trigger(tails, len(tokens)), 0, moved)
        return moved

    def advance(self, state: SnapshotState, tokens: torch.Tensor, tails: Optional[torch.Tensor] = None, *,
                filters: Optional[SnapshotFilters] = None) -> SnapshotState:
        """The state after each row appends ``tokens`` (a new state; ``state`` is unchanged). Arguments as
        :meth:`TrieConstraint.advance`; ``filters`` from :meth:`filters`."""
        if isinstance(filters, RowFilters):  # an unchanged snapshot's filters (see :meth:`filters`)
            return _as_state(self.base.advance(RowState(_as_state(state).base, state.tree), tokens, tails,
                                               filters=filters))
        return self._step(state, tokens, tails, filters)[0]

    # ------------------------------------------------------------------ masks
    def _mask_nodes(self, state: SnapshotState, filters: Optional[SnapshotFilters]) -> tuple:
        """Each side's node to mask with, the rows where a side is out while the other is in, and the rows left
        with no usable entry although their path is live (a request's filters exclude everything below it: the
        compacted trie's constraint gives them the end token at the floor, and so does this one). Shape: (R,) each.

        A side with no usable entry below its node is masked as DONE (it keeps the end token only, which is then
        taken away when the other side is in). In ``"release"`` mode rows at a live entry end are shown FREE on both
        sides: the row is unconstrained (the base side's mask then keeps everything).
        """
        fb, fd, off_b, off_d = self._side_filters(filters)
        b, d = state.base, state.delta
        use_b, own_b = self._info(self.base, b, fb, off_b)
        dead_b = (b == DONE) | ((b >= 0) & ~use_b)
        stuck = None
        if filters is not None and (filters.base is not None or off_b is not None):
            exist_b, _ = self._info(self.base, b, self._tomb, None)
            stuck = exist_b & ~use_b
        release = self.rules.on_complete == "release"
        if self.delta is None:
            nb = torch.where(dead_b, DONE, b)
            if release:
                nb = torch.where(own_b, FREE, nb)
            return nb, None, None, None, stuck
        use_d, own_d = self._info(self.delta, d, fd, off_d)
        dead_d = (d == DONE) | ((d >= 0) & ~use_d)
        if filters is not None and (fd is not None or off_d is not None or stuck is not None):
            stuck = ((d >= 0) | (stuck if stuck is not None else False)) & dead_b & dead_d
        nb, nd = torch.where(dead_b, DONE, b), torch.where(dead_d, DONE, d)
        out_b, out_d = dead_b & ~dead_d, dead_d & ~dead_b
        if release:
            ends = own_b | own_d
            nb, nd = torch.where(ends, FREE, nb), torch.where(ends, FREE, nd)
            out_b, out_d = out_b & ~ends, out_d & ~ends
        return nb, nd, out_b, out_d, stuck

    def _delta_columns(self, logits: torch.Tensor, idx: torch.Tensor, nd: torch.Tensor, out_b: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The delta side's kept columns and their values, for rows inside the delta: the node's children and its
        extra tokens (the step table's end and separator columns). Columns a row does not keep repeat its first
        kept column and value (duplicate writes then write one value); a row keeping nothing names the end token
        with -inf. Values: the logits', or the floor where every kept value is -inf and the base side is out.

        Args:
            idx: logits row of each state row. nd: each row's delta node (negative: nothing kept). Shape: (R,).
        Returns:
            cols, vals: Shape: (R, W + 2), W the delta's largest fanout.
        """
        ptr, tok, extra, j = self._delta_ptr, self._delta_tok, self._delta_extra, self._delta_j
        inside = nd >= 0
        n = nd.clamp(min=0)
        start = ptr[n]
        kids = (j < (ptr[n + 1] - start).unsqueeze(1)) & inside.unsqueeze(1)
        ex = extra[n]
        valid = torch.cat([kids, (ex >= 0) & inside.unsqueeze(1)], dim=1)
        cols = torch.cat([tok[start.unsqueeze(1) + j], ex.clamp(min=0)], dim=1)
        vals = logits[idx.unsqueeze(1), cols]
        alive = (valid & (vals != NEG_INF)).any(dim=1, keepdim=True)
        vals = torch.where((out_b.unsqueeze(1) & ~alive), torch.full_like(vals, ALL_MASKED_FLOOR), vals)
        first = valid.to(torch.uint8).argmax(dim=1, keepdim=True)
        none = ~valid.any(dim=1, keepdim=True)
        c0 = torch.where(none, self.rules.end_token_id, cols.gather(1, first))
        v0 = torch.where(none, NEG_INF, vals.gather(1, first))
        return torch.where(valid, cols, c0), torch.where(valid, vals, v0)

    def _scratch_like(self, logits: torch.Tensor) -> torch.Tensor:
        """A private (B, V) buffer for the delta side, reused per thread (never returned to the caller)."""
        buf = getattr(self._scratch, "buf", None)
        if buf is None or buf.shape != logits.shape or buf.dtype != logits.dtype or buf.device != logits.device:
            buf = self._scratch.buf = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        return buf

    def mask_(
        self,
        logits: torch.Tensor,
        state: SnapshotState,
        rows: Optional[torch.Tensor] = None,
        *,
        inplace: bool = True,
        out: Optional[torch.Tensor] = None,
        filters: Optional[SnapshotFilters] = None,
    ) -> torch.Tensor:
        """Set every disallowed logit of the rows to -inf; return the masked logits. Arguments as
        :meth:`TrieConstraint.mask_` (Shape of ``logits``: (B, V)); ``filters`` from :meth:`filters`."""
        state = _as_state(state)
        if self._plain and (filters is None or isinstance(filters, RowFilters)):
            return self.base.mask_(logits, RowState(state.base, state.tree), rows, inplace=inplace, out=out,
                                   filters=filters)
        InvalidTokenError.check_logits_width(logits.shape[-1], self.needed_width)
        fb, fd, _, _ = self._side_filters(filters)
        if rows is not None and rows.device != logits.device:
            rows = rows.to(logits.device)
        nb, nd, out_b, out_d, stuck = self._mask_nodes(state, filters)
        tree = state.tree
        idx = rows if rows is not None else torch.arange(len(state), device=logits.device)
        end = self.rules.end_token_id
        if self.delta is None:
            res = self._mask_base.mask_(logits, RowState(nb, tree), rows, inplace=inplace, out=out, filters=fb)
        elif fd is None and (filters is None or filters.delta_off is None):
            # The delta side is read sparsely: its kept columns and values, gathered before the base side masks the
            # logits in place, then merged into the base side's result by a max over those columns only.
            cols, vals = self._delta_columns(logits, idx, nd, out_b)
            res = self._mask_base.mask_(logits, RowState(nb, tree), rows, inplace=inplace, out=out, filters=fb)
            res[idx, end] = torch.where(out_b, NEG_INF, res[idx, end])
            at = idx.unsqueeze(1)
            res[at, cols] = torch.maximum(res[at, cols], vals)
        else:
            # The delta side reads the logits first: the base side may mask them in place.
            scratch = self._mask_delta.mask_(logits, RowState(nd, tree), rows, out=self._scratch_like(logits),
                                             filters=fd)
            res = self._mask_base.mask_(logits, RowState(nb, tree), rows, inplace=inplace, out=out, filters=fb)
            # A side that is out was masked as DONE: it kept the end token only; it must keep nothing.
            res[idx, end] = torch.where(out_b, NEG_INF, res[idx, end])
            scratch[idx, end] = torch.where(out_d, NEG_INF, scratch[idx, end])
            torch.maximum(res, scratch, out=res)
        if stuck is not None:
            res[idx, end] = torch.where(stuck, ALL_MASKED_FLOOR, res[idx, end])
        return res

    def allowed(self, state: SnapshotState, width: Optional[int] = None, *,
                filters: Optional[SnapshotFilters] = None) -> torch.Tensor:
        """Boolean mask of each row's allowed tokens (unconstrained rows allow all). Shape: (R, width), bool."""
        width = width or self.vocab_size
        InvalidTokenError.check_logits_width(width, self.needed_width)
        probe = torch.zeros(len(state), width, device=self.device)
        return self.mask_(probe, state, filters=filters).isfinite()

    def allowed_tokens(self, state: SnapshotState, width: Optional[int] = None, *,
                       filters: Optional[SnapshotFilters] = None) -> list[Optional[list[int]]]:
        """Each row's allowed token ids, sorted, read on the host (None: the row is unconstrained)."""
        mask = self.allowed(state, width, filters=filters).cpu()
        return [None if bool(row.all()) else row.nonzero().flatten().tolist() for row in mask]

    def bitmask(self, state: SnapshotState, width: Optional[int] = None) -> torch.Tensor:
        """The allowed tokens as an int32 bitmask. Shape: (R, ceil(width / 32)), int32 (XGrammar's format)."""
        return pack_bitmask(self.allowed(state, width))

    # ------------------------------------------------------------------ filters
    def filters(
        self,
        num_rows: int,
        allow: Optional[Sequence[Any]] = None,
        deny: Optional[Sequence[Any]] = None,
        *,
        distinct: bool = False,
        max_entries: int = 64,
    ) -> SnapshotFilters:
        """Per-row filters over the snapshot, as :meth:`TrieConstraint.filters`: entries named by key (base or
        added: every entry holding the key) or by snapshot entry index. Removed entries stay removed whatever the
        filters say.

        Distinct lists need one list state over the whole catalog: on an unchanged snapshot they are the base's
        (:meth:`TrieConstraint.filters`); once the catalog has changes, compact it first (:meth:`LiveCatalog.rebase`).

        Raises:
            ConstraintConfigError: an unknown key or index, a row whose allow set holds no live entry,
                ``"release"`` mode, ``distinct`` outside ``"repeat"`` mode or over a changed catalog.
        """
        if self._plain:
            return self.base.filters(num_rows, allow, deny, distinct=distinct, max_entries=max_entries)
        if self.rules.on_complete == "release":
            raise ConstraintConfigError('filters need on_complete="eos" or "repeat" (a released row is unconstrained)')
        if distinct and self.rules.on_complete != "repeat":
            raise ConstraintConfigError('distinct=True needs on_complete="repeat" (a list of entries)')
        if distinct:
            raise ConstraintConfigError(
                f"distinct=True needs one trie, and this catalog has changes ({self.snapshot!r}): fold them in with "
                "LiveCatalog.rebase() (or compact()) first")
        snap = self.snapshot
        nb = snap.base.num_entries
        nd = snap.delta.num_entries if snap.delta is not None else 0
        empty = np.zeros(0, dtype=np.int64)
        resolved: dict[int, tuple[np.ndarray, np.ndarray]] = {}

        def resolve(spec: Any, what: str) -> tuple[np.ndarray, np.ndarray]:
            """A spec as (base entry indices, delta entry indices), sorted and unique (converted once per object)."""
            if id(spec) in resolved:
                return resolved[id(spec)]
            items = spec.ravel().tolist() if isinstance(spec, np.ndarray) else list(spec)
            if isinstance(spec, (str, bytes)):
                raise ConstraintConfigError(f"{what} must be a list of keys or indices, got the string {spec!r:.60}")
            base_idx: list[int] = []
            delta_idx: list[int] = []
            missing = []
            base_keys = delta_keys = None
            for x in items:
                if isinstance(x, str):
                    if base_keys is None:
                        base_keys = _key_index(snap.base)
                        delta_keys = snap.delta_keys()
                    hits_b = base_keys.get(x)
                    hits_d = delta_keys.get(x) if delta_keys is not None else []
                    base_idx += hits_b
                    delta_idx += hits_d
                    if not hits_b and not hits_d:
                        missing.append(x)
                elif isinstance(x, (int, np.integer)) and not isinstance(x, bool):
                    i = int(x)
                    if not 0 <= i < nb + nd:
                        raise ConstraintConfigError(f"{what}: entry index {i} is outside the snapshot's "
                                                    f"{nb + nd} entry numbers")
                    (base_idx if i < nb else delta_idx).append(i if i < nb else i - nb)
                else:
                    raise ConstraintConfigError(f"{what} must hold entry keys (str) or entry indices (int), got {x!r:.40}")
            if missing:  # a catalog's item keys (and any other key the filters know) name base entries too
                try:
                    base_idx += entry_indices(snap.base, missing, what).tolist()
                except ConstraintConfigError:
                    raise ConstraintConfigError(
                        f"{what}: {len(missing)} keys are not entries of the catalog, e.g. {missing[:3]}") from None
            out = (np.unique(np.asarray(base_idx, dtype=np.int64)), np.unique(np.asarray(delta_idx, dtype=np.int64)))
            resolved[id(spec)] = out
            return out

        def rows_of(spec: Any, what: str) -> list[Any]:
            if spec is None:
                return [None] * num_rows
            if is_per_row(spec):
                if len(spec) != num_rows:
                    raise ConstraintConfigError(f"{what} has {len(spec)} row specs for {num_rows} rows")
                return list(spec)
            return [spec] * num_rows

        allow_rows, deny_rows = rows_of(allow, "allow"), rows_of(deny, "deny")
        tomb = snap.tombstones
        sides: dict[tuple[int, int], tuple] = {}  # rows sharing spec objects share the arrays (RowFilters shares them)
        per_row = []
        for i, (a, d) in enumerate(zip(allow_rows, deny_rows)):
            key = (id(a), id(d))
            if key not in sides:
                db, dd = resolve(d, "deny") if d is not None else (empty, empty)
                db_all = np.union1d(db, tomb) if tomb.size else db
                if a is None:
                    sides[key] = (None, db_all, False, None, dd, False)
                else:
                    ab, ad = resolve(a, "allow")
                    ab = np.setdiff1d(ab, db_all, assume_unique=True)
                    ad = np.setdiff1d(ad, dd, assume_unique=True)
                    if not ab.size and not ad.size:
                        raise ConstraintConfigError(f"row {i}: the allow filter holds no live entry: nothing could "
                                                    "be generated")
                    sides[key] = (ab if ab.size else None, db_all, not ab.size, ad if ad.size else None, dd, not ad.size)
            per_row.append(sides[key])
        need_base = any(r[0] is not None or r[1].size for r in per_row)
        need_delta = snap.delta is not None and any(r[3] is not None or r[4].size for r in per_row)
        base = (RowFilters(EntryOrder.of(snap.base), [r[0] for r in per_row], [r[1] for r in per_row], self.device)
                if need_base else None)
        delta = (RowFilters(EntryOrder.of(snap.delta), [r[3] for r in per_row], [r[4] for r in per_row], self.device)
                 if need_delta else None)
        off = lambda k: (torch.tensor([r[k] for r in per_row], dtype=torch.bool, device=self.device)  # noqa: E731
                         if any(r[k] for r in per_row) else None)
        return SnapshotFilters(base, delta, off(2), off(5) if snap.delta is not None else None)

    # ------------------------------------------------------------------ host-side answers
    def replay(
        self,
        generated: Union[torch.Tensor, Sequence[Sequence[int]]],
        tree: Optional[Sequence[int]] = None,
        prompt_tails: Optional[Sequence[Sequence[int]]] = None,
    ) -> list[list[Entry]]:
        """The entries each row completed, in order (snapshot entries: see :class:`CatalogSnapshot`), by running
        the rows through this constraint's own steps; as :meth:`TrieConstraint.replay`."""
        rows = generated.tolist() if isinstance(generated, torch.Tensor) else [list(r) for r in generated]
        if tree is not None and any(int(t) != 0 for t in tree):
            raise ConstraintConfigError("a catalog snapshot is one trie: every row's trie index must be 0")
        r = len(rows)
        found: list[list[Entry]] = [[] for _ in range(r)]
        if r == 0:
            return found
        host = self if self.device.type == "cpu" else SnapshotConstraint(self.snapshot, self.rules, "cpu")
        snap = self.snapshot
        nb = snap.base.num_entries
        base_entry, delta_entry = snap.base.node_entry, snap.delta.node_entry if snap.delta is not None else None
        width = max((len(x) for x in rows), default=0)
        t = len(self.rules.trigger)
        tails = np.full((r, t), -1, dtype=np.int64)
        if t and prompt_tails is not None:
            for i, tail in enumerate(prompt_tails):
                tail = list(tail)[-t:]
                if tail:
                    tails[i, t - len(tail) :] = tail
        pad = np.full((r, width), -1, dtype=np.int64)
        lengths = np.array([len(x) for x in rows], dtype=np.int64)
        for i, x in enumerate(rows):
            pad[i, : len(x)] = x
        full = np.concatenate([tails, pad], axis=1)
        state = host.start(r, None, torch.from_numpy(tails) if t else None)

        def record(positions: np.ndarray, done_b: torch.Tensor, done_d: Optional[torch.Tensor], sub: SnapshotState) -> None:
            b, d = sub.base.numpy(), sub.delta.numpy()
            for k in np.flatnonzero(done_b.numpy()).tolist():
                found[int(positions[k])].append(snap.base.entry(int(base_entry[b[k]])))
            if done_d is not None:
                for k in np.flatnonzero(done_d.numpy()).tolist():
                    found[int(positions[k])].append(snap.entry(nb + int(delta_entry[d[k]])))

        for j in range(width):
            live = np.flatnonzero(lengths > j)
            sub = state.select(torch.from_numpy(live)) if len(live) < r else state
            tok = torch.from_numpy(pad[live, j])
            tail = torch.from_numpy(full[live, j + 1 : j + 1 + t]) if t else None
            new, done_b, done_d = host._step(sub, tok, tail, None)
            record(live, done_b, done_d, sub)
            if len(live) < r:
                state.assign(torch.from_numpy(live), new)
            else:
                state = new
        # Rows that stop at an entry end completed it too.
        _, own_b = host._info(host.base, state.base, host._tomb, None)
        own_d = host._info(host.delta, state.delta, None, None)[1] if host.delta is not None else None
        record(np.arange(r), own_b, own_d, state)
        return found

    def __repr__(self) -> str:
        return f"SnapshotConstraint({self.snapshot!r}, {self.rules!r}, device={self.device})"


