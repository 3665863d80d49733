"""Per-row allow and deny filters over a shared trie, and distinct lists: entries a row may not (or may only) emit.

Why this exists: retrieval and recommendation restrict each request to a category, exclude items the user has
already seen, and want a list without repeats, all over one big shared catalog that must not be rebuilt per
request. The mechanism, written once for every integration:

- entries are ranked in depth-first order (the lexicographic order of their token sequences), so that the entries
  below any node form one contiguous interval of ranks: ``[lo[n], hi[n])`` (:class:`EntryOrder`, built once per trie);
- a row's filter is a sorted array of ranks on the logits' device: the entries it may use (allow) and the entries
  it may not (deny; in ``distinct`` lists, the entries it has already emitted are added to it, each with every entry
  that shares its key, :class:`ItemGroups`: the forms of one string are one item, as a key is for filters);
- a child is allowed when its interval still holds a usable entry: a count over the sorted arrays, one batched
  ``searchsorted`` per step, fixed shapes and no host read. A subtree whose entries are all denied is pruned.
- the rule is stated once, here, as two bits per node (:data:`CHILD_EXCLUDED`, :data:`END_EXCLUDED`, by
  :func:`filter_bits` from :func:`usable_count`); the kernels only apply the bits: counted per row on any device
  (:meth:`RowFilters.bits`), or for a static filter once per node (:meth:`RowFilters.node_flags`, what the C kernel
  reads), and for a distinct list's whole filter once per row, recounted on the paths of each entry a row completes
  (:meth:`RowFilters.list_flags`).

A distinct list has a capacity chosen at setup (``max_entries``; :func:`distinct_capacity` gives the most entries
a row can complete in a token budget): the deny array has that much room per row, so the step keeps fixed shapes.
It never forgets an entry: a row whose list has room for one more entry may end that entry only with the end token
(not the separator), and a row whose list is full may only emit the end token. The list ends; it never repeats.
Likewise the separator is blocked after a list's last usable entry: every list ends with an entry and the end token.

An allow filter of k entries therefore behaves exactly like a trie of those k entries (tests/test_filters.py).

Dimension letters: R rows, N nodes, E entries, A allow capacity, D deny capacity, F the trie's largest fanout.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Collection, Mapping
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np
import torch

from .catalogs import item_entries, item_key_table
from .entries import Entry, filter_number_map, retired_key_table
from .errors import ConstraintConfigError, EmptyFilterError, FilterSpecError, UnknownEntryError, raised_as
from .kernels.rules import NEG_INF, floor_rule, kept_alive
from .options import check_filter_mode, check_positive, given_filters, filter_rows, prompt_filters
from .options import is_per_row  # the per-row rule (trie_decode.options), part of this module's API
from .spans import completes_entry
from .trie import TokenTrie

__all__ = ["EntryOrder", "KeyIndex", "NodeFlags", "RowFilters", "entry_indices", "spec_items",
           "check_allow_leaves_entries", "restricted_trie", "Restriction", "restriction", "filtered_tries",
           "filtered_restrictions", "ItemGroups", "is_per_row", "apply_filters_", "distinct_capacity",
           "CHILD_EXCLUDED", "END_EXCLUDED", "usable_count", "filter_bits"]


#: The filter rule as data: two bits per (filter, node), computed in one place (:func:`filter_bits`, from the one count
#: of usable entries, :func:`usable_count`) and read by every kernel: the C kernel's mask and moves
#: (``trie_decode/_kernel.c``), the torch pass (:func:`apply_filters_`) and ``TrieConstraint.advance``.
#: CHILD_EXCLUDED: no entry below the node is usable; as a child the node is blocked, and its token moves as a
#: token off the trie does.
CHILD_EXCLUDED = 1
#: END_EXCLUDED: an entry ends at the node and is not usable; the end token and the separator are blocked there
#: (unless they are usable children), and a row that leaves the node other than down a usable child ends (DONE).
END_EXCLUDED = 2


def usable_count(bounds: Any, allow: Optional[Any], deny: Any, has_allow: Optional[Any] = None) -> Any:
    """The filter rule's count: how many entries of each rank interval ``[bounds[..., j], bounds[..., j + 1])`` a
    filter leaves usable. With an allow set (the denied ranks already taken out of it), its ranks in the interval;
    without, every rank in the interval that is not denied. numpy arrays or torch tensors alike.

    Args:
        bounds: non-decreasing along the last axis (a decreasing pair gives a meaningless count). Shape: (M,) or
            (R, M), int64.
        allow, deny: sorted rank sets, padded with a rank above every entry. Shape: (K,) (one set for every row)
            or (R, K). allow None: no row has an allow set.
        has_allow: with (R, M) bounds and an allow set, which rows have one (None: every row). Shape: (R,), bool.
    Returns:
        Shape: bounds' shape with one less on the last axis, int64.
    """
    torch_ = isinstance(bounds, torch.Tensor)

    def count(sets: Any) -> Any:
        if torch_:
            pos = torch.searchsorted(sets, bounds)
        elif sets.ndim == 1:  # numpy searches a flat array of queries faster than a 2-D one
            pos = np.searchsorted(sets, bounds.ravel()).reshape(bounds.shape)
        else:  # a set per row: the rows' sets and queries set apart by an offset above every rank, one flat search
            row = np.arange(len(sets), dtype=np.int64)[:, None]
            apart = row * (max(int(sets.max()), int(bounds.max())) + 1)
            pos = np.searchsorted((sets + apart).ravel(), (bounds + apart).ravel()).reshape(bounds.shape)
            pos = pos - row * sets.shape[1]
        return pos[..., 1:] - pos[..., :-1]

    if allow is not None and has_allow is None:
        return count(allow)
    size = bounds[..., 1:] - bounds[..., :-1]
    if allow is None:
        return size - count(deny)
    return (torch.where if torch_ else np.where)(has_allow[:, None], count(allow), size - count(deny))


def filter_bits(usable_below: Any, usable_own: Any, terminal: Any) -> Any:
    """The filter rule: each node's bits (:data:`CHILD_EXCLUDED`, :data:`END_EXCLUDED`) from whether an entry below
    it is usable (its own entry included), whether its own entry is usable, and whether an entry ends there.

    Args:
        usable_below, usable_own, terminal: bool numpy arrays or torch tensors, of one shape (or broadcastable).
    Returns:
        uint8, same backend.
    """
    excluded_child, excluded_end = ~usable_below, terminal & ~usable_own
    if isinstance(excluded_child, torch.Tensor):
        return excluded_child.to(torch.uint8) * CHILD_EXCLUDED + excluded_end.to(torch.uint8) * END_EXCLUDED
    return (excluded_child.view(np.uint8) * np.uint8(CHILD_EXCLUDED)
            + excluded_end.view(np.uint8) * np.uint8(END_EXCLUDED))


class EntryOrder:
    """Depth-first entry ranks of a trie and the rank interval below each node (computed once, vectorized).

    Attributes:
        rank: each entry's depth-first rank. Shape: (E,), int64.
        lo, hi: the ranks of the entries below each node (the node's own entry included) are ``lo[n] .. hi[n]-1``.
            Shape: (N,), int64.
        node_rank: the rank of the entry ending at each node, -1 where none does. Shape: (N,), int64.
    """

    def __init__(self, trie: TokenTrie) -> None:
        n, e = trie.num_nodes, trie.num_entries
        # Depth-first pre-order of nodes = lexicographic order of their token paths; an entry's rank is its
        # terminal node's position among terminal nodes in that order.
        parent = trie.parent.astype(np.int64)
        # Pre-order index of every node, one depth level at a time: a child comes after its parent and after the
        # subtrees of its earlier siblings (siblings are sorted by token), so
        # pre[child] = pre[parent] + 1 + (sizes of the earlier siblings' subtrees).
        size = np.ones(n, dtype=np.int64)
        for d in range(trie.max_depth, 0, -1):
            lo_, hi_ = int(trie.level_ptr[d]), int(trie.level_ptr[d + 1])
            np.add.at(size, parent[lo_:hi_], size[lo_:hi_])
        pre = np.zeros(n, dtype=np.int64)
        ptr = trie.child_ptr.astype(np.int64)
        for d in range(0, trie.max_depth):
            lo_, hi_ = int(trie.level_ptr[d]), int(trie.level_ptr[d + 1])
            nodes = np.arange(lo_, hi_)
            counts = ptr[nodes + 1] - ptr[nodes]
            kids = np.arange(ptr[lo_], ptr[hi_])
            if len(kids) == 0:
                continue
            par = np.repeat(nodes, counts)
            # offset of each child within its parent's pre-order: 1 + sizes of the earlier siblings
            csum = np.cumsum(size[kids])
            first = np.repeat(ptr[nodes], counts)
            before = csum - size[kids] - (csum[first - kids[0]] - size[first])
            pre[kids] = pre[par] + 1 + before
        terminal = trie.node_entry >= 0
        term_nodes = np.flatnonzero(terminal)
        order = term_nodes[np.argsort(pre[term_nodes], kind="stable")]
        node_rank = np.full(n, -1, dtype=np.int64)
        node_rank[order] = np.arange(len(order), dtype=np.int64)
        # Entries below a node: terminal nodes with pre-order in [pre[n], pre[n] + size[n]).
        sorted_pre = pre[order]
        self.lo = np.searchsorted(sorted_pre, pre, side="left").astype(np.int64)
        self.hi = np.searchsorted(sorted_pre, pre + size, side="left").astype(np.int64)
        self.node_rank = node_rank
        self.rank = node_rank[trie.entry_node.astype(np.int64)]
        self.rank_node = order.astype(np.int64)  # the terminal node of each rank
        self.num_entries = e
        self.level_ptr = trie.level_ptr
        self._device: dict[str, tuple[torch.Tensor, ...]] = {}
        # an index array entry_indices made -> its sorted ranks: see sorted_ranks
        self._ranks_of = _ByIdentity()
        # (allow ranks, deny ranks) made here -> the allow ranks not denied (see RowFilters)
        self._usable_allow = _ByIdentity()
        self._nothing: Optional[np.ndarray] = None  # see nothing_usable

    @classmethod
    def of(cls, trie: TokenTrie) -> "EntryOrder":
        """The cached order of ``trie`` (built on first use, freed with the trie)."""
        return trie.derived("EntryOrder", lambda: cls(trie))

    def sorted_ranks(self, indices: np.ndarray) -> np.ndarray:
        """The sorted, unique ranks of entry ``indices`` (int64). An array :func:`entry_indices` made (from a list or
        keys; read only) is converted once while it lives: a vLLM request's filter is sorted once, not at every batch
        change that rebuilds its batch's filters. Any other array is converted at every call (its owner may change
        it in between).

        >>> from trie_decode import TokenTrie
        >>> order = EntryOrder(TokenTrie.from_sequences([[6], [5], [7]], vocab_size=8))
        >>> order.sorted_ranks(np.array([2, 0, 0])).tolist()   # entry 0 ([6]) ranks 1, entry 2 ([7]) ranks 2
        [1, 2]
        """
        hit = self._ranks_of.get(indices)  # only arrays made here are kept
        if hit is not None:
            return hit
        made_here = _MADE_HERE.get(indices) is not None
        got = np.sort(self.rank[indices])
        got = got[np.concatenate([[True], got[1:] != got[:-1]])] if len(got) > 1 else got  # unique
        if made_here:
            got.setflags(write=False)
            _RANKS_HERE.put((got,), True)
            self._ranks_of.put((indices,), got)
        return got

    def nothing_usable(self) -> np.ndarray:
        """The filter bits (:func:`filter_bits`) of every node for a filter that leaves no entry usable: where an
        allow filter starts (:func:`_node_flags`). Counted once (a pass over every node), read only. Shape: (N,),
        uint8."""
        if self._nothing is None:
            # same-shape arrays: numpy's broadcast of bools is slow
            nothing = np.zeros(len(self.node_rank), dtype=np.bool_)
            bits = filter_bits(nothing, nothing, self.node_rank >= 0)
            bits.setflags(write=False)
            self._nothing = bits
        return self._nothing

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(lo, hi, node_rank) as int64 tensors on ``device`` (cached)."""
        key = str(device)
        if key not in self._device:
            self._device[key] = tuple(torch.from_numpy(a).to(device) for a in (self.lo, self.hi, self.node_rank))
        return self._device[key]

    def child_holding(self, node: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
        """The child of each row's node whose subtree holds each rank: one ``searchsorted`` over a key that ascends
        with the node id, ``depth * (E + 1) + lo`` (nodes are numbered breadth-first with siblings sorted by token,
        so within a depth ``lo`` ascends). Meaningful only where the rank is below the node and not its own entry.

        Args:
            node: node ids (>= 0). Shape: (R,), int64.
            ranks: entry ranks per row. Shape: (R, K), int64.
        Returns:
            Node ids. Shape: (R, K), int64.
        """
        name = f"child key {node.device}"
        if name not in self._device:
            depth = np.repeat(np.arange(len(self.level_ptr) - 1, dtype=np.int64), np.diff(self.level_ptr))
            self._device[name] = (torch.from_numpy(depth * (self.num_entries + 1) + self.lo).to(node.device),
                                  torch.from_numpy(depth).to(node.device))
        key, depth = self._device[name]
        query = (depth[node] + 1).unsqueeze(1) * (self.num_entries + 1) + ranks
        return (torch.searchsorted(key, query, right=True) - 1).clamp(min=0)


def restricted_trie(trie: TokenTrie, allow: Any = None, deny: Any = None, what: str = "filter") -> TokenTrie:
    """A static filter as a trie: the entries of ``trie`` that ``allow`` names (every entry when None) and ``deny``
    does not, as their own trie (:meth:`TokenTrie.subset`). Decoding it is decoding ``trie`` with that filter on
    every row (an allow filter of k entries behaves exactly like a trie of those k entries), so each trie of a
    constraint with several (text spans) takes its own filter as data. ``trie`` itself when nothing is filtered out.
    Its entries are renumbered (and a catalog's item lists are not kept): :func:`restriction` also says which entry
    of ``trie`` each one is.

    Args:
        allow, deny: entry keys (str) or indices (int), as for :func:`entry_indices`.
        what: how the caller names the filter's owner in errors.

    Raises:
        ConstraintConfigError: an unknown key or index, or no entry left.

    Example:
        >>> trie = TokenTrie.from_sequences([[5, 6], [5, 7], [8]], vocab_size=9, keys=["a", "b", "c"])
        >>> restricted_trie(trie, deny=["b"]).sequences()
        [(5, 6), (8,)]
    """
    return restriction(trie, allow, deny, what).trie


class Restriction(NamedTuple):
    """The trie a static filter leaves (:func:`restricted_trie`) and where its entries come from: the results of a
    decode speak in the user's numbering (:meth:`source_entry`), whatever trie was decoded.

    Attributes:
        trie: the trie decoded: the kept entries, renumbered 0..K-1 (``source`` itself when nothing is filtered).
        source: the user's trie.
        kept: the ``source`` index of each entry of ``trie``, or None when ``trie`` is ``source``. Shape: (K,), int64.

    Example:
        >>> from trie_decode import TokenTrie
        >>> trie = TokenTrie.from_sequences([[5, 6], [5, 7], [8]], vocab_size=9, keys=["a", "b", "c"])
        >>> r = restriction(trie, deny=["a"])
        >>> r.trie.entry(1).index, r.source_entry(r.trie.entry(1)).index, r.source_entry(r.trie.entry(1)).key
        (1, 2, 'c')
    """

    trie: TokenTrie
    source: TokenTrie
    kept: Optional[np.ndarray]

    def source_entry(self, entry: Optional[Entry]) -> Optional[Entry]:
        """``entry`` of :attr:`trie` as the entry of :attr:`source` it is (index, name, key, a catalog's item keys);
        None stays None."""
        if entry is None or self.kept is None:
            return entry
        return self.source.entry(int(self.kept[entry.index]))


def restriction(trie: TokenTrie, allow: Any = None, deny: Any = None, what: str = "filter") -> Restriction:
    """:func:`restricted_trie`, with the source index of each entry it keeps (:class:`Restriction`)."""
    if allow is None and deny is None:
        return Restriction(trie, trie, None)
    keep = np.zeros(trie.num_entries, dtype=np.bool_)
    if allow is None:
        keep[:] = True
    else:
        keep[entry_indices(trie, allow, f"{what} allow")] = True
    if deny is not None:
        keep[entry_indices(trie, deny, f"{what} deny")] = False
    if keep.all():
        return Restriction(trie, trie, None)
    if not keep.any():
        raise EmptyFilterError(f"{what}: allow and deny leave none of the {trie.num_entries} entries")
    kept = np.flatnonzero(keep)
    return Restriction(trie.subset(kept), trie, kept)


def filtered_tries(tries: Sequence[TokenTrie], allow: Any, deny: Any, on_complete: str,
                   batch: Optional[int] = None) -> list[TokenTrie]:
    """Per prompt, the trie of the entries its filters leave (:func:`restricted_trie`): how a front door filters
    one trie per prompt, or decodes a filter as a trie of its own (fast-forward, whose forced runs are then the
    filtered trie's). One trie per prompt when the filters or the tries are per prompt; each distinct (trie, filter)
    pair built once. The options are checked as every front door checks them (:mod:`trie_decode.options`). Their
    entries are renumbered: :func:`filtered_restrictions` gives each prompt's :class:`Restriction`, to report
    entries in the user's numbering.

    Args:
        tries: one trie for every prompt, or one per prompt.
        allow, deny: entry keys or indices, one spec for every prompt or one per prompt (None: no such filter).
        on_complete: the span rules' mode (filters need "eos" or "repeat").
        batch: the batch's rows, when known: per-prompt filters must divide it.

    Example:
        >>> from trie_decode import TokenTrie
        >>> trie = TokenTrie.from_sequences([[5], [6], [7]], vocab_size=8)
        >>> [t.sequences() for t in filtered_tries([trie], None, [[0], [1, 2]], "eos")]
        [[(6,), (7,)], [(5,)]]
    """
    return [r.trie for r in filtered_restrictions(tries, allow, deny, on_complete, batch)]


def filtered_restrictions(tries: Sequence[TokenTrie], allow: Any, deny: Any, on_complete: str,
                          batch: Optional[int] = None) -> list[Restriction]:
    """:func:`filtered_tries` as each prompt's :class:`Restriction` (its trie, and the user's entry of each of its
    entries). Arguments and errors as :func:`filtered_tries`."""
    check_filter_mode(on_complete, given_filters(allow, deny))
    n = prompt_filters(allow, deny)
    if batch is not None:
        filter_rows(allow if allow is not None else deny, n, batch)  # per-prompt filters fit the batch
    if n and len(tries) > 1 and n != len(tries):
        raise ConstraintConfigError(f"allow/deny give filters for {n} prompts, and there are {len(tries)} tries, one "
                                    "per prompt: give both per prompt for the same prompts, or one of them for every "
                                    "prompt")
    count = max(n, len(tries))
    allow_rows, deny_rows = filter_rows(allow, n, count), filter_rows(deny, n, count)
    built: dict[tuple, Restriction] = {}
    out = []
    for i in range(count):
        trie = tries[i if len(tries) > 1 else 0]
        a = allow_rows[i] if n and allow_rows is not None else allow_rows
        d = deny_rows[i] if n and deny_rows is not None else deny_rows
        key = (id(trie), id(a), id(d))
        if key not in built:
            built[key] = restriction(trie, a, d, what=f"prompt {i}" if count > 1 else "filter")
        out.append(built[key])
    return out


class _ByIdentity:
    """A value per tuple of live arrays, found by the arrays' identity (not their content): for arrays made here read
    only, whose content never changes. An entry goes with the first of its arrays to go (None stands for itself)."""

    def __init__(self) -> None:
        self._found: dict[tuple, tuple[tuple, Any]] = {}

    def get(self, *arrays: Optional[np.ndarray]) -> Any:
        hit = self._found.get(tuple([id(a) for a in arrays]))
        if hit is None:
            return None
        for r, a in zip(hit[0], arrays):  # the same objects, not others at the same address since
            if (a is not None) if r is None else (r() is not a):
                return None
        return hit[1]

    def put(self, arrays: Sequence[Optional[np.ndarray]], value: Any) -> None:
        key, found = tuple(map(id, arrays)), self._found  # the callbacks hold the dict, not this object (no cycle)

        def gone(ref: weakref.ref, k: tuple = key) -> None:
            hit = found.get(k)
            if hit is not None and any(r is ref for r in hit[0]):
                found.pop(k, None)

        found[key] = (tuple(None if a is None else weakref.ref(a, gone) for a in arrays), value)


#: The index arrays :func:`entry_indices` made (read only), while they live, with their largest index (-1: empty):
#: the ones whose ranks may be kept, and whose range is checked once.
_MADE_HERE = _ByIdentity()
#: The rank arrays made here read only (:meth:`EntryOrder.sorted_ranks` of the arrays above, an allow set with its
#: denied ranks taken out): a filter made of them is found by identity (:class:`_NodeFlagCache`), not by content.
_RANKS_HERE = _ByIdentity()
#: No rank (the deny set of a row that has none).
_NO_RANKS = np.zeros(0, dtype=np.int64)
_NO_RANKS.setflags(write=False)
_RANKS_HERE.put((_NO_RANKS,), True)


def spec_items(spec: Any, what: str, numbers: str = "entry indices",
               error: type = ConstraintConfigError) -> tuple[list[Any], list[int]]:
    """The keys (str) and the entry numbers (int) a filter spec names, each in its order: the one rule of a spec, for
    a trie (:func:`entry_indices`), for a live catalog (:meth:`~trie_decode.live.CatalogView.entry_indices`) and for
    a vLLM request's filter. A spec is a collection (a list, a 1-D array) of keys, of numbers, or of both mixed.
    Refused with a ``FilterSpecError``: a single string (a list of its characters is never what was meant), what is
    no collection or a mapping (a number; an iterator, which a filter reads twice), a torch tensor, an array that is
    not 1-D (a 2-D array is one spec per prompt, which only a front door that takes per-prompt filters reads as such:
    :func:`~trie_decode.options.is_per_row`) and an item that is neither (a bool, a float, None).

    Args:
        numbers: what the caller's numbers are called in errors (``"entry indices"``, ``"entry numbers"``).
        error: the caller's error class (a vLLM request's ``TrieRequestError``): the error is one too.
    """
    fail = raised_as(FilterSpecError, error)
    if isinstance(spec, (str, bytes, Mapping)) or not isinstance(spec, Collection):
        got = f"the string {spec!r:.60}" if isinstance(spec, (str, bytes)) else f"{type(spec).__name__} {spec!r:.40}"
        raise fail(f"{what} must be a list of entry keys or {numbers}, got {got}")
    if isinstance(spec, torch.Tensor):
        raise fail(f"{what} must be a list (or numpy array) of entry keys or {numbers}, got a torch tensor of shape "
                   f"{tuple(spec.shape)}: pass its .tolist() or .numpy()")
    if isinstance(spec, np.ndarray) and spec.ndim != 1:
        raise fail(f"{what} must be one list (or 1-D array) of entry keys or {numbers}, got an array of shape "
                   f"{spec.shape}: it takes one filter here, not one per prompt")
    items = spec.tolist() if isinstance(spec, np.ndarray) else list(spec)
    kinds = set(map(type, items))
    if all(issubclass(k, str) for k in kinds):
        return items, []
    if all(issubclass(k, (int, np.integer)) and not issubclass(k, (bool, np.bool_)) for k in kinds):
        return [], items
    keys = [x for x in items if isinstance(x, str)]
    nums = [x for x in items if not isinstance(x, str)]
    for x in nums:
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
            raise fail(f"{what} must hold entry keys (str) or {numbers} (int), got {x!r:.40}")
    return keys, nums


#: Why a live catalog's allow filter may name entries and still leave none (:func:`check_allow_leaves_entries`).
LIVE_ALLOW_HINT = ("the catalog is live: its removed entries name nothing, nor do entries added since its last "
                   "compaction until that compaction is done")


def check_allow_leaves_entries(usable: Optional[int], what: str = "allow", deny: str = "deny",
                               error: type = ConstraintConfigError, live: bool = False) -> None:
    """The empty-filter rule of every front door: an allow filter must leave an entry once the denied ones are taken
    out (``usable``: how many it leaves; None: no allow filter), or nothing could be generated (a deny filter alone
    may deny every entry: the row can only end). ``what``, ``deny``: the options as the caller passed them; ``error``:
    as for :func:`spec_items`; ``live``: the trie stands for a live catalog's snapshot (the message says why named
    entries may be missing, :data:`LIVE_ALLOW_HINT`)."""
    if usable == 0:
        why = f" ({LIVE_ALLOW_HINT})" if live else ""
        raise raised_as(EmptyFilterError, error)(f"{what} leaves no entry (after {deny}): nothing could be "
                                                 f"generated{why}")


def entry_indices(trie: TokenTrie, spec: Any, what: str) -> np.ndarray:
    """Entry indices from a filter spec: entry indices (ints), keys (strings, see :class:`KeyIndex`: a key stands for
    every entry that carries it), both mixed, or a 1-D numpy array of indices (returned as it is) or of keys. Indices
    made from a list or keys come back read only. Raises a named error for an unknown key, an index out of range, a
    single string, an array that is not 1-D or an item that is neither a key nor an index (a bool mask, a float):
    see :func:`spec_items`.

    A trie that stands for a live catalog's snapshot (:func:`trie_decode.live.apply_delta_file`) numbers its entries
    as the snapshot does (``trie.extra`` ``NUMBER_ENTRY``, :mod:`trie_decode.entries`): the numbers of a list are
    read through it, and a removed entry's number names nothing (as a removed entry's key). A numpy integer array
    is the trie's own entry indices (what this function returns, resolved once and passed on), never renumbered."""
    if spec is None:
        return np.zeros(0, dtype=np.int64)
    numbers = filter_number_map(trie.extra) if trie.extra else None
    if isinstance(spec, np.ndarray) and spec.dtype.kind in "iu" and spec.ndim == 1:
        if spec.dtype == np.uint64 and spec.size and spec.max() >= 1 << 63:  # would wrap to a negative index
            raise UnknownEntryError(f"{what}: entry index {int(spec.max())} is outside the trie's {trie.num_entries} "
                                    "entries")
        idx = spec.astype(np.int64, copy=False)  # the array itself where it can be (see EntryOrder.sorted_ranks)
        top = _MADE_HERE.get(idx)  # made here: no index below 0, its largest known (a batch's rows come back often)
        if top is not None and top < trie.num_entries:
            return idx
    else:  # a list, or an array of keys (or of anything else: spec_items checks each item)
        keys, nums = spec_items(spec, what)
        try:
            idx = np.asarray(nums, dtype=np.int64)
        except OverflowError:  # past int64: outside any trie
            bad = next(int(x) for x in nums if not -(1 << 63) <= int(x) < 1 << 63)
            raise UnknownEntryError(f"{what}: entry index {bad} is outside the trie's {trie.num_entries} "
                                    "entries") from None
        if numbers is not None and idx.size:
            if idx.min() < 0 or idx.max() >= len(numbers):
                bad = int(idx[(idx < 0) | (idx >= len(numbers))][0])
                raise UnknownEntryError(f"{what}: entry number {bad} is outside the catalog's {len(numbers)} "
                                        "entry numbers")
            idx = numbers[idx]
            idx = idx[idx >= 0]  # removed entries
        if keys:
            try:
                index = KeyIndex.of(trie)
            except ConstraintConfigError as exc:  # a trie without keys or names: say which option named keys
                raise type(exc)(f"{what}: {exc}") from None
            found = index.entries(keys, what)
            idx = found if not nums else np.concatenate([found, idx])
        idx.setflags(write=False)  # made here and never changed: EntryOrder.sorted_ranks may keep its ranks
        if not idx.size or idx.min() >= 0:
            _MADE_HERE.put((idx,), int(idx.max()) if idx.size else -1)
    if idx.size and (idx.min() < 0 or idx.max() >= trie.num_entries):
        bad = int(idx[(idx < 0) | (idx >= trie.num_entries)][0])
        raise UnknownEntryError(f"{what}: entry index {bad} is outside the trie's {trie.num_entries} entries")
    return idx


class KeyIndex:
    """key -> every entry that carries it, for one trie (built once per trie: about 0.3 s per million keys).

    The keys are the trie's entry keys, else its names. A key may stand for several entries: the forms of one
    string (``from_strings(..., leading_space=[True, False])``) share its key, and a filter must reach all of them
    or the other form would slip through. In a catalog built with item keys
    (:func:`~trie_decode.catalogs.catalog_from_codes`) every item's key counts: an item that shares its semantic id
    with others stands for their common entry (generation cannot tell them apart).

    A compacted live catalog (:mod:`trie_decode.live`) also knows the keys of the entries removed from it
    (:attr:`retired`: its retired key table, and a catalog's items held by no entry): a filter may name them, and
    they name no entry. A key the trie never knew is an error.

    Example:
        >>> from trie_decode import TokenTrie
        >>> trie = TokenTrie.from_sequences([[5], [6], [7]], vocab_size=8, keys=["a", "b", "a"])
        >>> KeyIndex.of(trie).entries(["a"], "deny").tolist()
        [0, 2]
    """

    def __init__(self, trie: TokenTrie) -> None:
        items = item_key_table(trie)
        retired_table = retired_key_table(trie.extra) if trie.extra else None
        retired = set(retired_table.to_list()) if retired_table is not None else set()
        if items is not None:
            of_item = item_entries(trie)
            held = of_item >= 0  # items held by no entry were removed from a live catalog
            if held.all():
                table, entry_of = items, of_item.tolist()
            else:
                retired.update(items.take(np.flatnonzero(~held)).to_list())
                table, entry_of = items.take(np.flatnonzero(held)), of_item[held].tolist()
        else:
            table = trie._keys if trie._keys is not None else trie._names
            if table is None:
                raise ConstraintConfigError("this trie has neither keys nor names: filter by entry index instead")
            entry_of = list(range(len(table)))
        keys = table.to_list()
        self.first: dict[str, int] = dict(zip(reversed(keys), reversed(entry_of)))  # reversed: the first wins
        #: keys of entries removed from the trie (a live catalog's): known, naming no entry
        self.retired: frozenset[str] = frozenset(retired - self.first.keys())
        #: the keys of several entries -> all of them, in entry order (usually empty: one pass decides)
        self.more: dict[str, list[int]] = {}
        if len(self.first) < len(keys):
            for k, e in zip(keys, entry_of):
                if self.first[k] != e:
                    self.more.setdefault(k, [self.first[k]]).append(e)
            self.more = {k: sorted(set(v)) for k, v in self.more.items()}

    @classmethod
    def of(cls, trie: TokenTrie) -> "KeyIndex":
        """The cached index of ``trie`` (built on first use, freed with the trie)."""
        return trie.derived("KeyIndex", lambda: cls(trie))

    def knows(self, key: str) -> bool:
        """Whether ``key`` is an entry's key or a removed entry's (:attr:`retired`)."""
        return key in self.first or key in self.retired

    def get(self, key: str) -> list[int]:
        """Every entry of ``key`` (empty when no entry carries it)."""
        found = self.more.get(key)
        if found is not None:
            return found
        one = self.first.get(key)
        return [] if one is None else [one]

    def entries(self, keys: Sequence[str], what: str) -> np.ndarray:
        """Every entry of every key (none for a removed entry's key, :attr:`retired`), or a named error listing keys
        the trie never knew. Shape: (K',), int64."""
        first = self.first
        found = list(map(first.get, keys))  # one C-level pass of dict lookups
        if None in found:
            missing = [x for x, i in zip(keys, found) if i is None and x not in self.retired]
            if missing:
                raise UnknownEntryError(f"{what}: {len(missing)} keys are not entries of the trie, e.g. {missing[:3]}")
            found = [i for i in found if i is not None]  # removed entries' keys name nothing
        idx = np.array(found, dtype=np.int64)
        if self.more:
            extra = [e for x in keys for e in self.more.get(x, ()) if e != first[x]]
            idx = np.concatenate([idx, np.asarray(extra, dtype=np.int64)]) if extra else idx
        return idx


class ItemGroups:
    """The entries a distinct list counts as one item: the entries that share a key (a key stands for every entry
    that carries it, :class:`KeyIndex`: the forms of one string, ``from_strings(..., leading_space=[True, False])``,
    share its key, else its name). Entries linked through several keys are one group. Once a list holds one entry of
    a group, it holds them all: every rank of the group is denied to the row (:meth:`RowFilters.add_denied`), the
    data the filter kernels read. Built once per trie, vectorized (a few passes over the keys of several entries).

    Groups are stored flat, not padded to the largest: an entry with a thousand aliases must not cost a thousand
    slots for every other group.

    Attributes:
        flat: every rank, each group's ranks contiguous and ascending (an entry of its own is a group of one).
            Shape: (E,), int64.
        first, size: per rank, where its group starts in :attr:`flat` and how many ranks it holds. Shape: (E,), int64.
        width: G, the largest group's size (1 when every entry is its own item; the arrays are then empty).

    Example:
        >>> from trie_decode import TokenTrie
        >>> trie = TokenTrie.from_sequences([[5], [6], [7]], vocab_size=8, keys=["fr", "de", "fr"])
        >>> groups = ItemGroups.of(trie)
        >>> groups.width, groups.size.tolist(), groups.room(1), groups.room(2)   # entries 0 and 2 rank 0 and 2
        (2, [2, 1, 2], 2, 3)
        >>> import torch
        >>> groups.mates(torch.tensor([2, 1]), pad=3).tolist()
        [[0, 2], [1, 3]]
    """

    def __init__(self, trie: TokenTrie) -> None:
        e = self.num_entries = trie.num_entries
        shared: list[list[int]] = []
        if item_key_table(trie) is not None or trie._keys is not None or trie._names is not None:
            shared = list(KeyIndex.of(trie).more.values())  # each key that several entries carry: its entries
        self.flat = self.first = self.size = np.zeros(0, dtype=np.int64)
        self.width = 1
        self._sizes = np.zeros(0, dtype=np.int64)  # the sizes of the groups of several entries, largest first
        self._device: dict[str, tuple[torch.Tensor, ...]] = {}
        if not shared:
            return
        sizes = np.fromiter(map(len, shared), dtype=np.int64, count=len(shared))
        b = np.fromiter(itertools.chain.from_iterable(shared), dtype=np.int64, count=int(sizes.sum()))
        a = b[np.repeat(np.cumsum(sizes) - sizes, sizes)]  # each entry linked to its key's first entry
        label = np.arange(e, dtype=np.int64)  # each entry's group: the least entry linked to it, by propagation
        while True:
            low = np.minimum(label[a], label[b])
            new = label.copy()
            np.minimum.at(new, a, low)
            np.minimum.at(new, b, low)
            new = new[new]
            if np.array_equal(new, label):
                break
            label = new
        rank = EntryOrder.of(trie).rank
        by = np.lexsort((rank, label))
        self.flat = rank[by]
        _, first, sizes = np.unique(label[by], return_index=True, return_counts=True)
        self.first, self.size = np.empty(e, dtype=np.int64), np.empty(e, dtype=np.int64)
        self.first[self.flat], self.size[self.flat] = np.repeat(first, sizes), np.repeat(sizes, sizes)
        self.width = int(sizes.max())
        self._sizes = np.sort(sizes[sizes > 1])[::-1].astype(np.int64)

    @classmethod
    def of(cls, trie: TokenTrie) -> "ItemGroups":
        """The cached groups of ``trie`` (built on first use, freed with the trie)."""
        return trie.derived("ItemGroups", lambda: cls(trie))

    def room(self, items: int) -> int:
        """The most ranks a list of ``items`` items denies: the sizes of the ``items`` largest groups (an entry of
        its own is a group of one)."""
        singles = self.num_entries - int(self._sizes.sum())
        big = self._sizes[:items]
        return int(big.sum()) + min(max(items - len(big), 0), singles)

    def on(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(flat, first, size) as int64 tensors on ``device`` (cached)."""
        key = str(device)
        if key not in self._device:
            self._device[key] = tuple(torch.from_numpy(a).to(device) for a in (self.flat, self.first, self.size))
        return self._device[key]

    def mates(self, ranks: torch.Tensor, pad: int) -> torch.Tensor:
        """The ranks that are one item with each of ``ranks`` (itself included), ascending, padded with ``pad``.
        Fixed shape: (R, G), int64."""
        if self.width == 1:
            return ranks.unsqueeze(1)
        flat, first, size = self.on(ranks.device)
        j = torch.arange(self.width, device=ranks.device)
        at = (first[ranks].unsqueeze(1) + j).clamp(max=self.num_entries - 1)
        return torch.where(j < size[ranks].unsqueeze(1), flat[at], pad)


class RowFilters:
    """The allow and deny rank sets of R rows on one device, with fixed capacities.

    Args:
        order: the trie's :class:`EntryOrder`.
        allow: per row, the entry indices it may use, or None for "every entry". Length R.
        deny: per row, the entry indices it may not use (None: none). Length R.
        distinct_capacity: in ``distinct`` lists, how many entries each row's list may hold (room in its deny
            set for the entries it emits; a full list ends, see the module docstring). Above 0, these filters are a
            distinct list's (:attr:`distinct`); 0 (the default), static filters.
        same_item: in ``distinct`` lists, the trie's :class:`ItemGroups`: entries that share a key are one item,
            all denied once the list holds one of them (None: every entry is its own item).
        device: where the sets live.
        defer_sets: static filters only: build the padded rank sets (:attr:`allow`, :attr:`deny`) when first read,
            not now. For a kernel that masks and moves with :meth:`node_flags` and may never read them (the C
            kernel): a vLLM batch whose filtered requests change then builds only what is new.

    Attributes:
        allow, deny: per row, its usable allow ranks (the denied ones taken out) and its denied ranks, sorted and
            padded with :attr:`sentinel`; rows that share one filter keep one row. Shape: (R or 1, A), (R or 1, D),
            int64.
        has_allow: which rows have an allow set. Shape: (R,), bool.
        deny_count, deny_limit: per row, the ranks in its deny set and the most it may hold. Shape: (R,), int64.
        distinct: whether each entry a row completes is denied to it from then on (``TrieConstraint.advance``).
        emitted: in a distinct list, the ranks each row's list has denied since the filters were made (the part of
            :attr:`deny` its static filter did not deny), sorted, padded with :attr:`sentinel`: the only children a
            list can block beyond its static filter's are those that hold one. Shape: (R, room), int64.
        has_static: whether any row has an allow set or denies an entry from the start.
    """

    def __init__(
        self,
        order: EntryOrder,
        allow: Sequence[Optional[np.ndarray]],
        deny: Sequence[Optional[np.ndarray]],
        device: torch.device | str,
        *,
        distinct_capacity: int = 0,
        defer_sets: bool = False,
        same_item: Optional[ItemGroups] = None,
    ) -> None:
        r = len(allow)
        if len(deny) != r:  # else zip below would drop the rows one of them lacks
            raise ConstraintConfigError(f"allow and deny must give one set per row: {r} allow sets, {len(deny)} deny "
                                        "sets")
        self.order = order
        self.device = torch.device(device)
        memo: dict[tuple, np.ndarray] = {}  # rows usually share one spec object: convert it once

        def sorted_ranks(spec: Optional[np.ndarray], minus: Optional[np.ndarray] = None) -> np.ndarray:
            key = (id(spec), id(minus))
            if key not in memo:
                got = order.sorted_ranks(spec)
                if minus is not None and len(minus):
                    # ranks made here (read only, never changed) are found by identity: once while they live
                    here = _RANKS_HERE.get(got) is not None and _RANKS_HERE.get(minus) is not None
                    usable = order._usable_allow.get(got, minus) if here else None
                    if usable is None:
                        usable = got[~np.isin(got, minus, assume_unique=True)]
                        if here:
                            usable.setflags(write=False)
                            _RANKS_HERE.put((usable,), True)
                            order._usable_allow.put((got, minus), usable)
                    got = usable
                memo[key] = got
            return memo[key]

        deny_r = [_NO_RANKS if d is None else sorted_ranks(d) for d in deny]
        # An allow set holds only usable entries: the denied ones are taken out of it here.
        allow_r = [None if a is None else sorted_ranks(a, d) for a, d in zip(allow, deny_r)]
        a_cap = max((len(a) for a in allow_r if a is not None), default=0)
        capacity = min(max(int(distinct_capacity), 0), order.num_entries)  # a list holds each entry once at most
        # Entries that share a key are one item (ItemGroups); only a distinct list reads that.
        self._same_item = same_item if capacity and same_item is not None and same_item.width > 1 else None
        room = capacity if self._same_item is None else self._same_item.room(capacity)  # ranks a full list denies
        d_cap = max((len(d) for d in deny_r), default=0) + room
        sentinel = order.num_entries  # pads the sorted rank arrays: above every rank, never below a query bound
        self.sentinel = sentinel
        has_allow = np.array([a is not None for a in allow_r], dtype=np.bool_)
        for i, a in enumerate(allow_r):
            check_allow_leaves_entries(None if a is None else len(a), "allow" if r == 1 else f"row {i}: allow")
        # Rows that share one filter (a request's beams, one spec for every prompt) keep one copy: a (1, K) set is
        # searched by every row, which is also cheaper than R copies.
        shared = not capacity and r > 0 and all(a is allow_r[0] for a in allow_r) and all(
            d is deny_r[0] for d in deny_r)
        t = lambda a: torch.from_numpy(a).to(self.device)  # noqa: E731
        self.has_allow = t(has_allow)
        self.deny_count = t(np.array([len(d) for d in deny_r], dtype=np.int64))
        self.deny_limit = self.deny_count + capacity
        self.distinct = capacity > 0
        self.has_static = bool(has_allow.any()) or any(len(d) for d in deny_r)
        self.emitted = torch.full((r, room if capacity else 0), sentinel, dtype=torch.long, device=self.device)
        # Static (host) facts that let a step skip work: no row has an allow set / every row has one.
        self.any_allow, self.all_allow = bool(has_allow.any()), bool(has_allow.all())
        # The host sets, for the per-node flags a CPU kernel masks with (node_flags) and the padded sets; both
        # built on first use.
        self._host_sets = (allow_r, deny_r)
        self._host_rows: Optional[torch.Tensor] = None  # rows of _host_sets that a selection left, not yet applied
        self._flags: Optional[NodeFlags] = None
        self._list: Any = None  # a distinct list's whole filter as node flags (list_flags); False: not kept
        self._allow: Optional[torch.Tensor] = None
        self._deny: Optional[torch.Tensor] = None
        self._shape = (1 if shared else r, max(a_cap, 1), max(d_cap, 1))  # of the padded sets
        if not defer_sets or self.distinct:
            self._build_sets()

    def _build_sets(self) -> None:
        """The padded rank sets (:attr:`allow`, :attr:`deny`) from the host sets, on the filters' device."""
        allow_r, deny_r = self._host_sets
        rows, a_cap, d_cap = self._shape
        allow_m = np.full((rows, a_cap), self.sentinel, dtype=np.int64)
        deny_m = np.full((rows, d_cap), self.sentinel, dtype=np.int64)
        for i in range(rows):
            if allow_r[i] is not None:
                allow_m[i, : len(allow_r[i])] = allow_r[i]
            deny_m[i, : len(deny_r[i])] = deny_r[i]
        self._allow, self._deny = torch.from_numpy(allow_m).to(self.device), torch.from_numpy(deny_m).to(self.device)

    @property
    def allow(self) -> torch.Tensor:
        if self._allow is None:
            self._build_sets()
        return self._allow

    @allow.setter
    def allow(self, value: torch.Tensor) -> None:
        self._allow = value

    @property
    def deny(self) -> torch.Tensor:
        if self._deny is None:
            self._build_sets()
        return self._deny

    @deny.setter
    def deny(self, value: torch.Tensor) -> None:
        self._deny = value

    def built_node_flags(self, num_rows: int) -> Optional["NodeFlags"]:
        """The node flags if :meth:`node_flags` built them (else None), with each of ``num_rows`` rows' filter
        (one filter made for every row is repeated)."""
        if self._flags is None:
            return None
        filt = self._flags.filter_of_row
        if filt.numel() == 1 and num_rows != 1:
            return self._flags.for_rows(filt.expand(num_rows))
        return self._flags

    def node_flags(self, trie: TokenTrie) -> "NodeFlags":
        """The filter rule (:func:`filter_bits`) evaluated once per node for every distinct filter of the rows
        (:class:`NodeFlags`), for a kernel that applies static filters in its own pass (``supports_filters``). For
        a distinct list, the flags of its static filter (what the rows' allow and deny sets were when made): the
        entries its rows emit since are :attr:`emitted`. Each filter's flags come from the trie's cache
        (:class:`_NodeFlagCache`): a batch of filters seen before costs no count and no copy."""
        if self._flags is None:
            allow_r, deny_r = self._host_sets
            if self._host_rows is not None:
                rows_left = self._host_rows.tolist()
                allow_r, deny_r = [allow_r[i] for i in rows_left], [deny_r[i] for i in rows_left]
                self._host_sets, self._host_rows = (allow_r, deny_r), None
            index: dict[tuple, int] = {}
            per_row = [index.setdefault((id(a), id(d)), len(index)) for a, d in zip(allow_r, deny_r)]
            first_row = {f: row for row, f in reversed(list(enumerate(per_row)))}
            cache = trie.derived("NodeFlagCache", _NodeFlagCache)
            rows = [cache.get(self.order, trie, allow_r[first_row[f]], deny_r[first_row[f]]) for f in range(len(index))]
            self._flags = NodeFlags(rows, torch.tensor(per_row, dtype=torch.long), num_nodes=trie.num_nodes)
        return self._flags

    def list_flags(self, trie: TokenTrie) -> Optional["NodeFlags"]:
        """A distinct list's whole filter (its static part and every entry its rows emitted since) as node flags, for
        a kernel that masks and moves with them (:class:`_ListFlags`), or None: no distinct list, not on the CPU, or
        more than :data:`LIST_FLAG_BYTES` for these rows. Built on first use, then kept up to date by
        :meth:`add_denied`. The kernel applies the filter rule with them; :func:`apply_filters_` (``whole_applied``)
        adds the list's own rules (a full list, the separator at its last entry) for the rows that need them."""
        if self._list is None:
            rows = len(self.deny_count)
            if not self.distinct or self.device.type != "cpu" or rows * trie.num_nodes > LIST_FLAG_BYTES:
                self._list = False
                return None
            self.node_flags(trie)
            static = self.built_node_flags(rows)
            self._list = _ListFlags(trie, list(static.rows), static.filter_of_row.numpy().copy(),
                                    (self.deny_limit - self.deny_count).numpy().copy(), _usable_left(self),
                                    self._same_item.width if self._same_item is not None else 1)
            emitted = self.emitted.numpy()  # entries emitted before now: their paths, as add_denied recounts them
            emitting = np.flatnonzero(emitted[:, 0] != self.sentinel) if emitted.size else emitted[:0, 0]
            if len(emitting):
                self._list.update(self, emitting, emitted[emitting])
        return self._list.node_flags() if self._list else None

    def check_rows(self, num_rows: int) -> None:
        """Raise :class:`ConstraintConfigError` unless these filters were made for ``num_rows`` state rows (rows
        that share one set included). Sizes only: no host read."""
        rows = self.deny_count.shape[0]
        if rows != num_rows:
            raise ConstraintConfigError(f"the filters have sets for {rows} rows, the state has {num_rows} rows: "
                                        "build them with TrieConstraint.filters(num_rows, ...) for these rows")

    def select(self, index: torch.Tensor, keep_list: bool = True) -> "RowFilters":
        """Rows ``index`` of these filters (beam reordering). Filters that every row shares, with no distinct list,
        are the same whatever the rows: returned as they are. ``keep_list`` False: a selection to count with the
        torch pass only, which leaves this object's :meth:`list_flags` as they are (the selection has none)."""
        if not self.distinct and self._shape[0] == 1 and len(index) == len(self.has_allow):
            return self  # one shared set (and so one filter, in the node flags too): every row is alike
        out = object.__new__(RowFilters)  # with this object's sets indexed (built here if they were deferred)
        out.order, out.device, out.sentinel = self.order, self.device, self.sentinel
        out.has_allow, out.deny_count = self.has_allow[index], self.deny_count[index]
        out.deny_limit = self.deny_limit[index]
        shared = self._shape[0] == 1 and len(self.has_allow) != 1
        out.allow = self.allow if shared else self.allow[index]
        out.deny = self.deny if shared else self.deny[index]
        out._shape = (out.deny.shape[0], out.allow.shape[1], out.deny.shape[1])
        out.distinct, out.any_allow, out.all_allow = self.distinct, self.any_allow, self.all_allow
        out.has_static, out.emitted = self.has_static, self.emitted[index]
        out._host_sets, out._flags, out._same_item = self._host_sets, None, self._same_item
        out._host_rows = None
        out._list = self._list.select(index.cpu().numpy()) if self._list and keep_list else self._list and None
        if self._flags is None and self.distinct:
            # A distinct list's step reads no host value: its rows are mapped to their static filters' when its
            # flags are first built (node_flags, by a CPU kernel). A copy, as every other set here: the caller may
            # reuse its index tensor before then.
            out._host_rows = index.clone() if self._host_rows is None else self._host_rows[index]
        elif self._flags is None:
            # Rows keep their filter: the selection only maps rows to filters (flags are built on first use).
            allow_r, deny_r = self._host_sets
            idx = index.tolist()
            out._host_sets = ([allow_r[i] for i in idx], [deny_r[i] for i in idx])
        else:
            out._flags = self._flags.for_rows(self._flags.filter_of_row[index.cpu()])
        return out

    def following(self, filter_of_row: torch.Tensor) -> "RowFilters":
        """These static filters for rows that have followed their parent rows in a fused step, which keeps each row's
        filter as an index into :meth:`node_flags`' rows (``FusedStep.filters``): row i gets the filter of a row
        that had filter ``filter_of_row[i]``, as :meth:`select` of the parent rows would have given it."""
        if self._flags is None:
            raise ConstraintConfigError("these filters have no node flags: no fused step followed them")
        filt = self._flags.filter_of_row
        row_of = torch.empty(len(self._flags.rows), dtype=torch.long)
        row_of[filt] = torch.arange(len(filt))
        return self.select(row_of[filter_of_row.long()])

    def usable_count(self, bounds: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """How many entries each rank interval ``[bounds[:, j], bounds[:, j + 1])`` of each row holds that the row
        may use (:func:`usable_count` over the rows' sets). One batched ``searchsorted`` for all intervals.

        Args:
            bounds: non-decreasing along each row. Shape: (R, M), int64 (with ``rows``: (len(rows), M)); a numpy
                array for filters on the CPU (then ``rows`` too, and the count is one).
            rows: the rows whose sets count, in the order of ``bounds``' rows (default: every row).
        Returns:
            Shape: (R, M - 1), int64.
        """
        # Numpy bounds (CPU sets only) read the sets as numpy and pick their rows there: a torch gather of 2 rows of a
        # (64, 10k) set took 16 ms under thread contention (measured; numpy's: 8 us).
        as_np = isinstance(bounds, np.ndarray)

        def rows_of(t: torch.Tensor) -> Any:
            got = t.numpy() if as_np else t
            return got if rows is None else got[rows] if as_np else got.index_select(0, rows)

        def one(sets: torch.Tensor) -> Any:
            if sets.shape[0] == 1:  # shared: one 1-D set
                return sets[0].numpy() if as_np else sets[0]
            return rows_of(sets)

        if not self.any_allow:
            return usable_count(bounds, None, one(self.deny))
        has_allow = None if self.all_allow else rows_of(self.has_allow)
        return usable_count(bounds, one(self.allow), one(self.deny), has_allow)

    def bits(self, nodes: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The filter bits (:func:`filter_bits`) of each row's filter at any nodes, from one batched count of the
        intervals ``[lo, lo + 1)`` (the node's own entry, when one ends there: depth-first, it ranks first) and
        ``[lo + 1, hi)`` (the rest of its subtree).

        Args:
            nodes: node ids (>= 0) per row. Shape: (R, M), int64 (with ``rows``: (len(rows), M)); numpy arrays
                for filters on the CPU (``rows`` too): no torch op.
            rows: the rows whose filters count, in the order of ``nodes``' rows (default: every row).
        Returns:
            Shape: (R, M), uint8 (as :func:`filter_bits` gives them), same backend.
        """
        host = isinstance(nodes, np.ndarray)
        o = self.order
        lo, hi, node_rank = (o.lo, o.hi, o.node_rank) if host else o.on(nodes.device)
        r, m = nodes.shape
        first = lo[nodes]
        bounds = (np.stack if host else torch.stack)([first, first + 1, hi[nodes]], 2).reshape(r, 3 * m)
        ok = self.usable(bounds, rows)  # (R, 3M - 1)
        own, rest = ok[:, 0::3], ok[:, 1::3]
        return filter_bits(own | rest, own, node_rank[nodes] >= 0)

    def children_bits(self, node: torch.Tensor, child: torch.Tensor,
                      valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`bits` of each row's node and of all its children, with fewer intervals: in depth-first rank order a
        node's own entry comes first, then its children's subtrees one after another, so F + 2 bounds give the
        F + 1 intervals.

        Args:
            node: each row's node (>= 0). Shape: (R,), int64.
            child: the node's children in order, then padding. Shape: (R, F), int64, F >= every row's fanout.
            valid: which of them are children. Shape: (R, F), bool.
        Returns:
            The node's :data:`END_EXCLUDED` bit, Shape: (R,), and the children's bits (0 for padding), Shape: (R, F).
        """
        lo, hi, node_rank = self.order.on(node.device)
        kids_lo = torch.where(valid, lo[child], hi[node].unsqueeze(1))  # padding repeats the last bound: empty
        ok = self.usable(torch.cat([lo[node].unsqueeze(1), kids_lo, hi[node].unsqueeze(1)], 1))
        own = filter_bits(torch.ones_like(ok[:, 0]), ok[:, 0], node_rank[node] >= 0)
        kids = filter_bits(ok[:, 1:] | ~valid, torch.ones_like(valid), torch.zeros_like(valid))
        return own, kids

    def usable(self, bounds: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Whether each rank interval holds an entry the row may use (see :meth:`usable_count`). Shape: (R, M - 1),
        bool."""
        return self.usable_count(bounds, rows) > 0

    @property
    def full(self) -> torch.Tensor:
        """Rows whose distinct list is full (they may only emit the end token). Shape: (R,), bool."""
        return self.deny_count >= self.deny_limit

    def same_item(self, ranks: torch.Tensor) -> torch.Tensor:
        """The ranks that are one item with each of ``ranks`` (itself included, see :class:`ItemGroups`), ascending,
        padded with the sentinel. Shape: (R, G), int64; G = 1 (``ranks`` itself) when every entry is its own item."""
        if self._same_item is None:
            return ranks.unsqueeze(1)
        return self._same_item.mates(ranks, self.sentinel)

    def add_denied(self, ranks: torch.Tensor, where: torch.Tensor) -> None:
        """Deny rank ``ranks[i]`` in row i where ``where[i]`` (a completed entry of a distinct list), with every rank
        that is one item with it (:meth:`same_item`: the other forms of its string); also drop them from the row's
        allow set. Each counts as one entry of the list. Fixed shapes: merged into the sorted row, whose tail of
        sentinels has room for its list's every item (:meth:`ItemGroups.room`): O(R * D) per step, not a sort of
        every row (a distinct list beside a deny filter of 10k entries). A rank the row denies already is not
        written twice (each denied rank counts once). A row with no room left (it ignored the mask:
        :func:`apply_filters_` lets a full row emit only the end token) keeps its set: nothing already denied is
        overwritten."""
        cap = self.deny.shape[1]
        mates = self.same_item(ranks)
        fits = where & (self.deny_count < self.deny_limit)
        held = self.deny.gather(1, torch.searchsorted(self.deny, mates).clamp(max=cap - 1)) == mates
        new = torch.where(fits.unsqueeze(1) & ~held, mates, self.sentinel)
        if new.shape[1] > 1:
            new = torch.sort(new, dim=1).values  # (R, G): the sentinels last again
        self.deny, self.emitted = _merged(self.deny, new, self.sentinel), _merged(self.emitted, new, self.sentinel)
        self.deny_count = self.deny_count + fits.long()
        # Out of the allow set: the ranks left move left over the dropped ones, which go to the last slot (free then).
        # (No row has one: its sets hold only the sentinel, and stay so.)
        if self.any_allow:
            keep = ~(where.unsqueeze(1) & (self.allow.unsqueeze(2) == mates.unsqueeze(1)).any(2))
            last = self.allow.shape[1] - 1
            self.allow = torch.full_like(self.allow, self.sentinel).scatter_(
                1, torch.where(keep, keep.cumsum(1) - 1, last), torch.where(keep, self.allow, self.sentinel))
        if self._list:  # the whole filter's node flags, on the paths of what the rows' sets lost
            rows = np.flatnonzero(where.numpy())
            self._list.update(self, rows, mates.numpy()[rows])


def _merged(sets: torch.Tensor, new: torch.Tensor, sentinel: int) -> torch.Tensor:
    """Sorted rank sets with ``new`` merged in, as wide as ``sets``: each rank moves right by the ranks of the other
    set below it (the two hold no rank in common; only sentinels tie, in the tail) and the tail is cut, past which a
    row with room holds sentinels only. O(R * K), fixed shapes.

    Args:
        sets: sorted, padded with ``sentinel``. Shape: (R, K), int64.
        new: sorted, padded with ``sentinel``, none in ``sets``. Shape: (R, G), int64.
    """
    (r, k), g = sets.shape, new.shape[1]
    out = sets.new_full((r, k + g), sentinel)
    out.scatter_(1, torch.arange(k, device=out.device) + torch.searchsorted(new, sets), sets)
    out.scatter_(1, torch.arange(g, device=out.device) + torch.searchsorted(sets, new), new)
    return out[:, :k].contiguous()


class NodeFlags:
    """The filter rule at every node for a batch's static filters, what the C kernel masks and moves with: one
    (N,) uint8 row of bits (:data:`CHILD_EXCLUDED`, :data:`END_EXCLUDED`) per distinct filter, and each state row's
    filter. The rows are the trie's cached arrays (:class:`_NodeFlagCache`), shared and read only; the kernel reads
    them through a table of their addresses, so a batch of F filters costs F pointers, not an (F, N) copy.

    Attributes:
        rows: per filter, its bits at every node. Each Shape: (N,), uint8 (kept alive here while in use).
        filter_of_row: each state row's filter. Shape: (R,), int64, CPU.
        addresses: each row's data address, what the C kernel reads. Shape: (F,), int64, CPU.

    Example:
        >>> import numpy as np, torch
        >>> flags = NodeFlags([np.array([0, 1, 2], np.uint8), np.array([0, 0, 0], np.uint8)], torch.tensor([1, 0]))
        >>> flags.at(np.array([2, 2])).tolist()   # row 0 (filter 1) and row 1 (filter 0), both at node 2
        [0, 2]
    """

    def __init__(self, rows: Sequence[np.ndarray], filter_of_row: torch.Tensor,
                 addresses: Optional[torch.Tensor] = None, *, num_nodes: Optional[int] = None) -> None:
        self.rows = tuple(rows)
        self.num_nodes = len(self.rows[0]) if self.rows else num_nodes
        if self.num_nodes is None or any(r.dtype != np.uint8 or r.ndim != 1 or not r.flags.c_contiguous
                                         or len(r) != self.num_nodes for r in self.rows):
            raise ValueError("node flags need one contiguous (N,) uint8 array per filter, all of one length "
                             "(num_nodes= when there is none)")
        # contiguous int64 on the CPU, as the kernel reads it (no copy when it is one already)
        self.filter_of_row = filter_of_row.to("cpu", torch.int64).contiguous()
        self.addresses = addresses if addresses is not None else torch.tensor(
            [r.ctypes.data for r in self.rows], dtype=torch.int64)

    def for_rows(self, filter_of_row: torch.Tensor) -> "NodeFlags":
        """The same filters' flags for other state rows (row i has filter ``filter_of_row[i]``): no copy of a flag."""
        return NodeFlags(self.rows, filter_of_row, self.addresses, num_nodes=self.num_nodes)

    def at(self, nodes: np.ndarray) -> np.ndarray:
        """Each state row's bits at ``nodes[i]`` (valid node ids). Shape: (R,), uint8."""
        filt = self.filter_of_row.numpy()
        if len(self.rows) == 1:
            return self.rows[0][nodes]
        out = np.empty(len(nodes), dtype=np.uint8)
        for f, row in enumerate(self.rows):  # F is the batch's distinct filters: a few
            mine = filt == f
            out[mine] = row[nodes[mine]]
        return out


def _usable_left(filters: "RowFilters", rows: Optional[np.ndarray] = None) -> np.ndarray:
    """How many ranks each row's filter leaves usable (its allow set, or every rank but its deny set). Shape: (R,)."""
    s = filters.sentinel
    pick = (lambda t: t.numpy()) if rows is None else (lambda t: t.numpy()[rows])  # noqa: E731
    allow, deny = pick(filters.allow), pick(filters.deny)
    return np.where(pick(filters.has_allow), (allow != s).sum(1), filters.order.num_entries - (deny != s).sum(1))


#: The most bytes of node flags a distinct list keeps per batch (:class:`_ListFlags`, one (N,) row per row at most):
#: beyond, its emitted entries are counted by the torch pass (:func:`apply_filters_`) instead.
LIST_FLAG_BYTES = 16 << 20


class _ListFlags:
    """A distinct list's whole filter (its static part and the entries each row emitted since) as node flags, for a
    kernel that masks and moves with them (the C kernel): the filter rule of :func:`_node_flags`, recounted only on
    the paths of the entries a row completes (:meth:`RowFilters.add_denied`), so a step costs what a static filter's
    does and the torch pass runs only for rows the flags cannot finish (:meth:`recount`). A row reads its static
    filter's flags (the trie's cached rows, shared) until it completes an entry, then a copy of its own; a selection
    (beams) shares every copy, and a row writes only to a copy it made since (one writer per array).

    Attributes:
        arrays: the flag rows. Each Shape: (N,), uint8.
        of_row: each row's array. Shape: (R,), int64.
        room, left: per row, how many more entries its list may hold and how many ranks it may still use (host
            mirrors of the filters' sets, updated with them). Shape: (R,), int64.
    """

    def __init__(self, trie: TokenTrie, arrays: list, of_row: np.ndarray, room: np.ndarray, left: np.ndarray,
                 width: int) -> None:
        self.trie, self.arrays, self.of_row, self.room, self.left, self.width = trie, arrays, of_row, room, left, width
        self._addresses = [a.ctypes.data for a in arrays]  # what the kernel reads (NodeFlags.addresses)
        self._mine: set[int] = set()  # the arrays this object may write: copies it made since its last selection
        self._flags: Optional[NodeFlags] = None

    def node_flags(self) -> "NodeFlags":
        if self._flags is None:
            self._flags = NodeFlags(self.arrays, torch.from_numpy(self.of_row),
                                    torch.tensor(self._addresses, dtype=torch.int64), num_nodes=self.trie.num_nodes)
        return self._flags

    def select(self, index: np.ndarray) -> "_ListFlags":
        """Rows ``index``, sharing the arrays they read (kept: only those): from now on neither side writes them."""
        self._mine = set()
        used, of_row = np.unique(self.of_row[index], return_inverse=True)
        return _ListFlags(self.trie, [self.arrays[i] for i in used.tolist()], of_row.astype(np.int64).reshape(-1),
                          self.room[index], self.left[index], self.width)

    def update(self, filters: "RowFilters", rows: np.ndarray, ranks: np.ndarray) -> None:
        """Rows ``rows`` have ``ranks`` (Shape: (len(rows), G), int64, padded with the sentinel) out of their filters
        now: their bits on those ranks' paths (the only nodes whose bits change), counted in one batch from the
        rows' sets as they are now (:meth:`RowFilters.bits`)."""
        order, trie, s = filters.order, self.trie, filters.sentinel
        valid = ranks != s
        node = np.where(valid, order.rank_node[np.where(valid, ranks, 0)], 0)  # no rank: the root, recounted alike
        path, parent = [node], trie.parent
        while node.any():  # up to the root (the deepest of these entries, not the trie's deepest)
            node = np.maximum(parent[node], 0)
            path.append(node)
        nodes = np.concatenate(path, 1)
        bits = filters.bits(nodes, rows)
        for j, i in enumerate(rows.tolist()):
            f = int(self.of_row[i])
            if f not in self._mine:  # a shared array: this row's own copy from now on
                f = len(self.arrays)
                self.arrays.append(self.arrays[self.of_row[i]].copy())
                self._addresses.append(self.arrays[f].ctypes.data)
                self.of_row[i], self._flags = f, None
                self._mine.add(f)
            self.arrays[f][nodes[j]] = bits[j]
        self.left[rows] = _usable_left(filters, rows)
        self.room = (filters.deny_limit - filters.deny_count).numpy().copy()

    def recount(self, node: np.ndarray, node_rank: np.ndarray) -> np.ndarray:
        """The rows the flags cannot finish, to count with every child (:func:`_filter_rows_`): a full list, and a
        row at an entry that may be its list's last (one item of room left, or no more usable ranks than an item
        holds: the separator may be blocked there). Shape: (K,), int64 row indices."""
        inside = node >= 0
        terminal = inside & (node_rank[np.maximum(node, 0)] >= 0)
        last = terminal & ((self.room <= 1) | (self.left <= self.width))
        return np.flatnonzero(inside & ((self.room <= 0) | last))


#: How many bytes of node flags a trie keeps for the filters it saw last (see :class:`_NodeFlagCache`).
NODE_FLAG_CACHE_BYTES = 64 << 20


class _NodeFlagCache:
    """The node flags (:func:`_node_flags`) of the filters one trie saw, keyed by the filter's content. A filter's
    flags cost about 1 ms per million entries; with this a filter seen before costs a hash of its ranks: a new
    generation, a new processor with the same filter, or a vLLM batch whose filtered rows changed (every row's
    filter is rebuilt then). A filter of rank arrays made here (read only: a request's filter from a list or keys)
    is found by their identity first, without a hash: a batch change costs a lookup per unchanged row. Flags still
    in use elsewhere (a batch's :class:`NodeFlags` holds them) are always found; of the others, the least recently
    used go first beyond :data:`NODE_FLAG_CACHE_BYTES`. So a batch of filters whose flags together exceed the
    budget (64 requests with their own filters on a 1M-entry catalog) does not count them all again at every
    change."""

    def __init__(self) -> None:
        # key -> (a weak reference to the flags, the filter's allow and deny ranks): every filter whose flags live
        self._known: dict[tuple, tuple[weakref.ref, Optional[np.ndarray], np.ndarray]] = {}
        # key -> flags, kept alive here: the most recently used, at most NODE_FLAG_CACHE_BYTES
        self._kept: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # a live catalog compacts in a background thread
        # (allow, deny) rank arrays made here -> (key, a weak reference to their flags)
        self._by_identity = _ByIdentity()

    def get(self, order: EntryOrder, trie: TokenTrie, allow: Optional[np.ndarray], deny: np.ndarray) -> np.ndarray:
        """The flags of one filter (arguments as :func:`_node_flags`'). The returned array is shared: read only."""
        hit = self._by_identity.get(allow, deny)  # only rank arrays made here are kept
        flags = hit[1]() if hit is not None else None
        if flags is not None:
            with self._lock:
                self._keep(hit[0], flags)
            return flags
        here = (allow is None or _RANKS_HERE.get(allow) is not None) and _RANKS_HERE.get(deny) is not None
        key = (None if allow is None else hash(allow.tobytes()), hash(deny.tobytes()))
        with self._lock:
            known = self._known.get(key)
            flags = known[0]() if known is not None else None
            if flags is not None and (known[1] is None) == (allow is None) and (
                    allow is None or np.array_equal(known[1], allow)) and np.array_equal(known[2], deny):
                self._keep(key, flags)
                if here:
                    self._by_identity.put((allow, deny), (key, known[0]))
                return flags
        flags = _node_flags(order, trie, allow, deny)
        flags.setflags(write=False)  # shared by every batch with this filter (the C kernel reads it in place)
        with self._lock:
            # The callback holds the dict, not this cache. Its check and pop are two steps: a thread storing the same
            # key in between loses that entry, which costs a recount, never a wrong flag.
            known = self._known
            ref = weakref.ref(flags, lambda r, k=key: known.pop(k) if known.get(k, (None,))[0] is r else None)
            self._known[key] = (ref, allow, deny)
            self._keep(key, flags)
            if here:
                self._by_identity.put((allow, deny), (key, ref))
        return flags

    def _keep(self, key: tuple, flags: np.ndarray) -> None:
        """Keep ``flags`` as the most recently used (the lock held)."""
        if self._kept.get(key) is flags:
            self._kept.move_to_end(key)
            return
        old = self._kept.pop(key, None)
        if old is not None:
            self._bytes -= old.nbytes
        if flags.nbytes <= NODE_FLAG_CACHE_BYTES:
            self._kept[key] = flags
            self._bytes += flags.nbytes
            while self._bytes > NODE_FLAG_CACHE_BYTES:
                self._bytes -= self._kept.popitem(last=False)[1].nbytes


def _node_flags(order: EntryOrder, trie: TokenTrie, allow: Optional[np.ndarray], deny: np.ndarray) -> np.ndarray:
    """The filter rule (:func:`filter_bits`) at every node of ``trie``, for one filter (``allow``: the usable ranks,
    denied ones taken out; else every rank but ``deny``). Only the nodes on the filter's paths (its entries' nodes
    and their ancestors) are counted; every other node has nothing usable below it (an allow filter) or everything
    (a deny filter). Shape: (N,), uint8."""
    parent = trie.parent
    ranks = deny if allow is None else allow
    if allow is None:  # the bits of a node whose entries are all usable, at every node (no per-node array needed)
        usable = np.ones(1, dtype=np.bool_)
        flags = np.full(trie.num_nodes, filter_bits(usable, usable, usable)[0])
    else:  # the bits of a node with no usable entry, at every node (the trie's, counted once)
        flags = order.nothing_usable().copy()
    if not len(ranks):
        return flags
    # The nodes on the filter's paths, one gather per level. Ranks are sorted and nodes are numbered breadth-first
    # in depth-first order, so a level's ancestors come in runs: each run is kept once (a repeat left over is
    # harmless, every write is idempotent).
    level = order.rank_node[ranks]
    cand = [level]
    for _ in range(trie.max_depth):
        up = parent[level]
        up = up[up >= 0]
        level = up[np.flatnonzero(np.diff(up, prepend=-1))] if len(up) else up
        cand.append(level)
    cand = np.concatenate(cand)
    first, terminal = order.lo[cand], order.node_rank[cand] >= 0
    # The count over each node's subtree, and over its own entry's one rank where an entry ends there (depth-first,
    # it ranks first); elsewhere the own count is never read (filter_bits reads it only where terminal).
    usable_below = usable_count(np.stack([first, order.hi[cand]], 1), allow, deny)[:, 0] > 0
    usable_own = np.zeros_like(usable_below)
    ends = first[terminal]
    usable_own[terminal] = usable_count(np.stack([ends, ends + 1], 1), allow, deny)[:, 0] > 0
    flags[cand] = filter_bits(usable_below, usable_own, terminal)
    return flags


def apply_filters_(
    logits: torch.Tensor, node: torch.Tensor, filters: RowFilters, dtrie: Any, rules: Any,
    rows: Optional[torch.Tensor] = None, static_applied: bool = False, whole_applied: bool = False,
) -> torch.Tensor:
    """After a row's trie mask: block its children whose subtrees hold no usable entry, and its end token (and
    separator) where the entry ending at its node is not usable. A row left with nothing gets the end token at the
    floor value. In a distinct list the separator is blocked at the entry that fills the list or is its last
    usable one (the list ends there, with the end token), and a full list allows nothing but the end token.

    Which children are counted: on the CPU, when the ranks that can block a child are fewer than the trie's widest
    node has children, only the children that hold one (and those by an end column's token): O(R * D), not
    O(R * F), for a distinct list at a wide root. Those ranks are a filter's denied ones when it has no allow set,
    or, after a kernel applied a distinct list's static filter (``static_applied``: its :meth:`RowFilters.node_flags`),
    the list's :attr:`RowFilters.emitted` ones. Elsewhere every child of each row's node, with fixed shapes and no
    host read (the CPU path reads two flags on the host: whether a row may need the floor over children it did not
    count, or is a full list; such rows are counted again with every child).

    Args:
        logits: masked logits, modified in place. Shape: (B, V).
        node: the state rows' codes. Shape: (R,), int64.
        rows: logits row of each state row (default: row i).
        static_applied: the kernel masked these rows with the filters' static node flags already.
        whole_applied: the kernel masked these rows with a distinct list's whole filter already
            (:meth:`RowFilters.list_flags`): only the rows that may need the list's own rules are counted, as after
            its static filter (``_ListFlags.recount``).
    """
    if whole_applied:
        idx = filters._list.recount(node.numpy(), filters.order.node_rank)
        if len(idx):  # those rows as the kernel had masked their static filter only (a subset of the flags)
            at = torch.from_numpy(idx)
            apply_filters_(logits, node.index_select(0, at), filters.select(at, keep_list=False), dtrie, rules,
                           at if rows is None else rows.index_select(0, at), static_applied=True)
        return logits
    x = logits if rows is None else logits.index_select(0, rows)
    blocking = filters.emitted if static_applied else filters.deny
    every = _counts_every_child(filters, node, dtrie, blocking, static_applied)
    _filter_rows_(x, node, filters, dtrie, rules, None if every else blocking)
    if rows is not None:
        logits.index_copy_(0, rows, x)
    return logits


def _counts_every_child(filters: RowFilters, node: torch.Tensor, dtrie: Any, blocking: torch.Tensor,
                        static_applied: bool) -> bool:
    """Whether :func:`apply_filters_` counts every child of each row's node (see there), or only the children that
    hold a rank of ``blocking``: on the CPU and not under ``torch.compile`` (that path reads flags on the host), when
    those ranks are fewer, and when they are all that can block a child (an allow filter can block any child,
    unless the kernel applied it)."""
    return ((filters.any_allow and not static_applied) or node.device.type != "cpu"
            or torch.compiler.is_compiling() or blocking.shape[1] + 2 >= int(dtrie.max_fanout))


def _children_to_count(filters: RowFilters, node: torch.Tensor, inside: torch.Tensor, own: torch.Tensor,
                       ends: torch.Tensor, dtrie: Any, blocking: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The children the filters may block or must look at: per rank of ``blocking`` (Shape: (R or 1, D)), the child
    of the row's node that holds it, then the children by the end columns' tokens. Returns (child, valid), each
    Shape: (R, D + ends)."""
    lo, hi, _ = filters.order.on(node.device)
    deny = blocking.expand(len(node), -1)
    below = inside.unsqueeze(1) & (deny >= (lo[node] + own.long()).unsqueeze(1)) & (deny < hi[node].unsqueeze(1))
    t, v = dtrie.tensors, int(dtrie.vocab_size)
    key = node.unsqueeze(1) * v + ends
    at = torch.searchsorted(t.edge_key, key).clamp(max=dtrie.num_nodes - 1)
    by_end = inside.unsqueeze(1) & (ends < v) & (t.edge_key[at] == key)
    return torch.cat([filters.order.child_holding(node, deny), at], 1), torch.cat([below, by_end], 1)


def _filter_rows_(x: torch.Tensor, node: torch.Tensor, filters: RowFilters, dtrie: Any, rules: Any,
                  blocking: Optional[torch.Tensor]) -> None:
    """:func:`apply_filters_` on logits whose row i is state row i, counting every child (``blocking`` None) or
    only :func:`_children_to_count`'s."""
    every_child = blocking is None
    _, _, node_rank = filters.order.on(node.device)
    t = dtrie.tensors
    inside = node >= 0
    n = node.clamp(min=0)
    r = node_rank[n]
    terminal = inside & (r >= 0)
    ends = _end_columns(rules, node.device).expand(len(node), -1)
    # the filter rule, as bits (see filter_bits)
    if every_child:
        start = t.child_ptr[n].long()
        count = torch.where(inside, t.child_ptr[n + 1].long() - start, 0)
        j = torch.arange(max(int(dtrie.max_fanout), 1), device=node.device)
        valid = j < count.unsqueeze(1)
        child = (start.unsqueeze(1) + j).clamp(max=dtrie.num_nodes - 1)
        own_bits, kid_bits = filters.children_bits(n, child, valid)
    else:
        child, valid = _children_to_count(filters, n, inside, r >= 0, ends, dtrie, blocking)
        bits = filters.bits(torch.cat([n.unsqueeze(1), child], 1))
        own_bits, kid_bits = bits[:, 0], bits[:, 1:]
    own_ok = terminal & ((own_bits & END_EXCLUDED) == 0)
    blocked = valid & ((kid_bits & CHILD_EXCLUDED) != 0)
    full = inside & filters.full if filters.distinct else torch.zeros_like(inside)  # a full list: the end token only
    if filters.distinct:
        own_ok = own_ok & ~full
        blocked = blocked | (valid & full.unsqueeze(1))  # counting only some children, full rows are redone below
    open_child = valid & ~blocked
    # A slot that holds no child writes where the end token's column does, as that column does (see below).
    tok = torch.where(valid, t.child_token[child].long(), ends[:, :1])
    end_child = torch.stack([((tok == ends[:, k : k + 1]) & open_child).any(1) for k in range(ends.shape[1])], 1)
    block_end = (terminal & ~own_ok).unsqueeze(1) & ~end_child
    if filters.distinct:
        # The list's last entry ends with the end token: after a separator the row must start another entry, so the
        # separator needs room in the list and another usable entry: besides this one and the entries that are one
        # item with it (add_denied denies them all), the ranks [0, m1), [m1 + 1, m2), ..., [mG + 1, E) around them.
        mates = filters.same_item(r.clamp(min=0))  # ascending, padded with E: [E, E) intervals are empty
        e = filters.order.num_entries
        everything = torch.full_like(mates[:, :1], e)
        bounds = torch.stack([mates, (mates + 1).clamp(max=e)], 2).reshape(len(mates), -1)
        around = filters.usable(torch.cat([torch.zeros_like(everything), bounds, everything], 1))
        other = around[:, 0::2].any(1)
        last = terminal & ((filters.deny_limit - filters.deny_count == 1) | ~other) & ~end_child[:, 1]
        block_end = block_end | torch.stack([torch.zeros_like(last), last], 1)
    # A blocked child whose token is also an end column the row keeps (its entry is usable) keeps that column.
    at_end = torch.stack([(tok == ends[:, k : k + 1]) for k in range(ends.shape[1])], 0)  # (ends, R, K)
    kept_end = at_end.any(0) & own_ok.unsqueeze(1)
    # One decision per column, a block winning: an end column is blocked if a child with its token is, and then so
    # are all its entries (children, empty slots), so every write to a column agrees and a blocked NaN is blocked.
    kill_child = blocked & ~kept_end
    block_end = block_end | (at_end & (kill_child & valid).unsqueeze(0)).any(2).t()
    kill_child = kill_child | (at_end & block_end.t().unsqueeze(2)).any(0)
    cols = torch.cat([tok, ends], dim=1)
    kill = torch.cat([kill_child, block_end], dim=1)
    before = x.gather(1, cols)
    lost = None if every_child else (kept_alive(before) & kill).any(1)  # rows the filter took a value from
    x.scatter_(1, cols, torch.where(kill, NEG_INF, before))
    # The floor rule (trie_decode.kernels.rules) over what the row keeps now: if another processor set all of it to
    # -inf (while a column the filter took away was finite), the kept columns get the floor; a row the filter left
    # with nothing keeps the end token, at the floor.
    # Counting some children, whether a row has one left is not known here: such rows are counted again below.
    left = (open_child.any(1) | (terminal & own_ok)) if every_child else torch.ones_like(inside)
    if every_child:
        # What the row keeps is what the filter did not kill: a blocked child kept for its end column is not kept
        # where that column is blocked too (the separator at a list's last entry), or the floor would revive it.
        keep = torch.cat([(open_child | (valid & kept_end)) & ~kill_child,
                          (terminal & own_ok).unsqueeze(1) & ~block_end], dim=1)
        vals = x.gather(1, cols)
        alive = ~inside | (kept_alive(vals) & keep).any(1)
        # amax of a value with itself leaves it, with the floor raises a -inf one: duplicate columns resolve the
        # same way.
        x.scatter_reduce_(1, cols, floor_rule(vals, alive.unsqueeze(1) | ~keep), reduce="amax")
    stuck = inside & ~left
    end = ends[:, :1]
    x.scatter_(1, end, floor_rule(x.gather(1, end), ~stuck.unsqueeze(1)))
    if not every_child:
        # Counted again with every child: full lists (every child blocked), and rows that may need the floor over
        # children not counted, or have none left: they lost a live value to the filter, and their largest is now
        # -inf (the trie mask left -inf at every column a row does not keep; a NaN is no ban).
        redo = full.clone()
        check = inside & lost
        if bool(check.any()):
            idx = check.nonzero().squeeze(1)
            redo[idx] |= ~kept_alive(x.index_select(0, idx).amax(1))
        if bool(redo.any()):
            idx = redo.nonzero().squeeze(1)
            sub = x.index_select(0, idx)
            _filter_rows_(sub, node[idx], filters.select(idx, keep_list=False), dtrie, rules, None)
            x.index_copy_(0, idx, sub)


_END_COLUMNS: dict[tuple, torch.Tensor] = {}


def _end_columns(rules: Any, device: torch.device) -> torch.Tensor:
    """The columns a terminal node keeps besides its children: the end token (and the separator in repeat mode).
    Shape: (1, 1 or 2), int64; cached per (columns, device): keyed by the token ids, not the rules, which the cache
    would keep alive (with their text spans' automata) for the life of the process."""
    cols = (rules.end_token_id,) + ((rules.separator[0],) if rules.on_complete == "repeat" else ())
    key = (cols, str(device))
    if key not in _END_COLUMNS:
        _END_COLUMNS[key] = torch.tensor([cols], device=device)
    return _END_COLUMNS[key]


def distinct_capacity(trie: TokenTrie, max_new_tokens: int, separator_length: int) -> int:
    """The most entries a distinct list can complete in ``max_new_tokens`` tokens: a ``max_entries`` with which no
    list ends early for want of capacity. Each entry but the last is followed by the separator and the last by one
    token (the end token), so ``k`` entries of the shortest length ``s`` take at least
    ``k * s + (k - 1) * separator_length + 1`` tokens; and a list holds each entry once.

    Args:
        trie: the list's trie (its shortest entry sets the bound).
        max_new_tokens: the generation budget.
        separator_length: tokens of the separator between entries.

    Example:
        >>> from trie_decode import TokenTrie
        >>> trie = TokenTrie.from_sequences([[5], [6], [7], [8, 9]], vocab_size=12)
        >>> distinct_capacity(trie, 5, 1)     # 5 SEP 6 END fits in 5 tokens; 5 SEP 6 SEP 7 END does not
        2
        >>> distinct_capacity(trie, 100, 1)   # never more than the trie's entries
        4
    """
    check_positive(max_new_tokens, "max_new_tokens")
    check_positive(separator_length, "separator_length")
    depth = np.searchsorted(trie.level_ptr, trie.entry_node, side="right") - 1
    shortest = int(depth.min())
    fit = (int(max_new_tokens) - 1 + int(separator_length)) // (shortest + int(separator_length))
    return max(1, min(fit, trie.num_entries))


def completed_ranks(node_before: Any, node_after: Any, dtrie: Any, order: EntryOrder) -> tuple[Any, Any]:
    """Which rows completed an entry with their last token (they stood at its end and did not go down to a child)
    and the entry's rank. Both Shape: (R,). Torch tensors, or numpy arrays of CPU state (no torch op per step)."""
    t = dtrie.tensors
    if isinstance(node_before, np.ndarray):
        r = order.node_rank[np.maximum(node_before, 0)]
        return completes_entry(node_before, node_after, t.terminal.numpy(), dtrie.parent_tensor.numpy()), r
    _, _, node_rank = order.on(node_before.device)
    r = node_rank[node_before.clamp(min=0)]
    return completes_entry(node_before, node_after, t.terminal, dtrie.parent_tensor), r
