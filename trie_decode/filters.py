"""Per-row allow and deny filters over a shared trie, and distinct lists: entries a row may not (or may only) emit.

Why this exists: retrieval and recommendation restrict each request to a category, exclude items the user has
already seen, and want a list without repeats, all over one big shared catalog that must not be rebuilt per
request. The mechanism, written once for every integration:

- entries are ranked in depth-first order (the lexicographic order of their token sequences), so that the entries
  below any node form one contiguous interval of ranks: ``[lo[n], hi[n])`` (:class:`EntryOrder`, built once per trie);
- a row's filter is a sorted array of ranks on the logits' device: the entries it may use (allow) and the entries
  it may not (deny; in ``distinct`` lists, the entries it has already emitted are added to it);
- a child is allowed when its interval still holds a usable entry: a count over the sorted arrays, one batched
  ``searchsorted`` per step, fixed shapes and no host read. A subtree whose entries are all denied is pruned.

An allow filter of k entries therefore behaves exactly like a trie of those k entries (tests/test_filters.py).

Dimension letters: R rows, N nodes, E entries, A allow capacity, D deny capacity, F the trie's largest fanout.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Optional, Sequence

import numpy as np
import torch

from .errors import ConstraintConfigError
from .kernels.vectorized import ALL_MASKED_FLOOR, NEG_INF
from .spans import completes_entry
from .trie import TokenTrie

__all__ = ["EntryOrder", "RowFilters", "entry_indices", "is_per_row", "apply_filters_"]

_ORDERS: "weakref.WeakKeyDictionary[TokenTrie, EntryOrder]" = weakref.WeakKeyDictionary()


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
        self.num_entries = e
        self._device: dict[str, tuple[torch.Tensor, ...]] = {}

    @classmethod
    def of(cls, trie: TokenTrie) -> "EntryOrder":
        """The cached order of ``trie`` (built on first use, freed with the trie)."""
        found = _ORDERS.get(trie)
        if found is None:
            found = _ORDERS[trie] = cls(trie)
        return found

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(lo, hi, node_rank) as int64 tensors on ``device`` (cached)."""
        key = str(device)
        if key not in self._device:
            self._device[key] = tuple(torch.from_numpy(a).to(device) for a in (self.lo, self.hi, self.node_rank))
        return self._device[key]


def entry_indices(trie: TokenTrie, spec: Any, what: str) -> np.ndarray:
    """Entry indices from a filter spec: entry indices (ints), entry keys (strings: the trie's keys, else its
    names), or a numpy array of indices. Raises a named error for an unknown key or an index out of range."""
    if spec is None:
        return np.zeros(0, dtype=np.int64)
    if isinstance(spec, np.ndarray):
        idx = spec.astype(np.int64, copy=False).ravel()
    else:
        items = list(spec)
        if items and all(isinstance(x, str) for x in items):
            lookup = _key_index(trie)
            missing = [x for x in items if x not in lookup]
            if missing:
                raise ConstraintConfigError(f"{what}: {len(missing)} keys are not entries of the trie, e.g. {missing[:3]}")
            idx = np.fromiter((lookup[x] for x in items), dtype=np.int64, count=len(items))
        else:
            for x in items:
                if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
                    raise ConstraintConfigError(f"{what} must hold entry keys (str) or entry indices (int), got {x!r:.40}")
            idx = np.asarray(items, dtype=np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= trie.num_entries):
        bad = int(idx[(idx < 0) | (idx >= trie.num_entries)][0])
        raise ConstraintConfigError(f"{what}: entry index {bad} is outside the trie's {trie.num_entries} entries")
    return idx


def is_per_row(spec: Any) -> bool:
    """True when a filter spec is one spec per row or prompt (a list of lists, arrays or None), not one for all."""
    if spec is None or isinstance(spec, (str, bytes, np.ndarray)):
        return False
    items = list(spec)
    return bool(items) and all(x is None or isinstance(x, (list, tuple, np.ndarray)) for x in items)


_KEYS: "weakref.WeakKeyDictionary[TokenTrie, dict]" = weakref.WeakKeyDictionary()


def _key_index(trie: TokenTrie) -> dict[str, int]:
    """key (or name) -> entry index, built once per trie (about 1 s per million entries)."""
    found = _KEYS.get(trie)
    if found is None:
        table = trie._keys if trie._keys is not None else trie._names
        if table is None:
            raise ConstraintConfigError("this trie has neither keys nor names: filter by entry index instead")
        found = {}
        for i, k in enumerate(table.to_list()):
            found.setdefault(k, i)
        _KEYS[trie] = found
    return found


class RowFilters:
    """The allow and deny rank sets of R rows on one device, with fixed capacities.

    Args:
        order: the trie's :class:`EntryOrder`.
        allow: per row, the entry indices it may use, or None for "every entry". Length R.
        deny: per row, the entry indices it may not use (None: none). Length R.
        distinct_capacity: room in each row's deny set for entries emitted later (``distinct`` lists).
        device: where the sets live.
    """

    def __init__(
        self,
        order: EntryOrder,
        allow: Sequence[Optional[np.ndarray]],
        deny: Sequence[Optional[np.ndarray]],
        device: torch.device | str,
        *,
        distinct_capacity: int = 0,
    ) -> None:
        r = len(allow)
        self.order = order
        self.device = torch.device(device)
        ranks = order.rank
        memo: dict[tuple, np.ndarray] = {}  # rows usually share one spec object: convert it once

        def sorted_ranks(spec: Optional[np.ndarray], minus: Optional[np.ndarray] = None) -> np.ndarray:
            key = (id(spec), id(minus))
            if key not in memo:
                got = np.unique(ranks[spec])
                memo[key] = got if minus is None or not len(minus) else got[~np.isin(got, minus, assume_unique=True)]
            return memo[key]

        empty = np.zeros(0, np.int64)
        deny_r = [empty if d is None else sorted_ranks(d) for d in deny]
        # An allow set holds only usable entries: the denied ones are taken out of it here.
        allow_r = [None if a is None else sorted_ranks(a, d) for a, d in zip(allow, deny_r)]
        a_cap = max((len(a) for a in allow_r if a is not None), default=0)
        d_cap = max((len(d) for d in deny_r), default=0) + max(int(distinct_capacity), 0)
        sentinel = order.num_entries  # pads the sorted rank arrays: above every rank, never below a query bound
        self.sentinel = sentinel
        has_allow = np.array([a is not None for a in allow_r], dtype=np.bool_)
        for i, a in enumerate(allow_r):
            if a is not None and len(a) == 0:
                raise ConstraintConfigError(f"row {i}: the allow filter is empty: nothing could be generated")
        # Rows that share one filter (a request's beams, one spec for every prompt) keep one copy: a (1, K) set is
        # searched by every row, which is also cheaper than R copies.
        shared = not distinct_capacity and r > 0 and all(a is allow_r[0] for a in allow_r) and all(
            d is deny_r[0] for d in deny_r)
        rows = 1 if shared else r
        allow_m = np.full((rows, max(a_cap, 1)), sentinel, dtype=np.int64)
        deny_m = np.full((rows, max(d_cap, 1)), sentinel, dtype=np.int64)
        for i in range(rows):
            if allow_r[i] is not None:
                allow_m[i, : len(allow_r[i])] = allow_r[i]
            deny_m[i, : len(deny_r[i])] = deny_r[i]
        t = lambda a: torch.from_numpy(a).to(self.device)  # noqa: E731
        self.allow, self.has_allow, self.deny = t(allow_m), t(has_allow), t(deny_m)
        self.deny_count = t(np.array([len(d) for d in deny_r], dtype=np.int64))
        self.distinct = False
        # Static (host) facts that let a step skip work: no row has an allow set / every row has one.
        self.any_allow, self.all_allow = bool(has_allow.any()), bool(has_allow.all())
    def select(self, index: torch.Tensor) -> "RowFilters":
        """Rows ``index`` of these filters (beam reordering)."""
        out = object.__new__(RowFilters)
        out.order, out.device, out.sentinel = self.order, self.device, self.sentinel
        out.has_allow, out.deny_count = self.has_allow[index], self.deny_count[index]
        shared = self.deny.shape[0] == 1 and len(self.has_allow) != 1
        out.allow = self.allow if shared else self.allow[index]
        out.deny = self.deny if shared else self.deny[index]
        out.distinct, out.any_allow, out.all_allow = self.distinct, self.any_allow, self.all_allow
        return out

    def usable(self, bounds: torch.Tensor) -> torch.Tensor:
        """Whether each rank interval ``[bounds[:, j], bounds[:, j + 1])`` of each row holds an entry the row may
        use: with an allow set, an allowed entry (denied ones were removed from it); without, an entry that is not
        denied. One batched ``searchsorted`` for all intervals.

        Args:
            bounds: non-decreasing along each row. Shape: (R, M), int64.
        Returns:
            Shape: (R, M - 1), bool.
        """
        def count(sets: torch.Tensor) -> torch.Tensor:
            pos = torch.searchsorted(sets[0] if sets.shape[0] == 1 else sets, bounds)  # shared: one 1-D set
            return pos[:, 1:] - pos[:, :-1]

        size = bounds[:, 1:] - bounds[:, :-1]
        if not self.any_allow:
            return (size - count(self.deny)) > 0
        if self.all_allow:
            return count(self.allow) > 0
        return torch.where(self.has_allow.unsqueeze(1), count(self.allow) > 0, (size - count(self.deny)) > 0)

    def add_denied(self, ranks: torch.Tensor, where: torch.Tensor) -> None:
        """Deny rank ``ranks[i]`` in row i where ``where[i]`` (a completed entry of a distinct list); also drop it
        from the row's allow set. Fixed shapes: written into the free slot, then each row is sorted again."""
        cap = self.deny.shape[1]
        col = torch.arange(cap, device=self.deny.device).unsqueeze(0)
        slot = self.deny_count.clamp(max=cap - 1).unsqueeze(1)
        write = where.unsqueeze(1) & (col == slot)
        self.deny = torch.sort(torch.where(write, ranks.unsqueeze(1), self.deny), dim=1).values
        self.deny_count = self.deny_count + where.long()
        drop = where.unsqueeze(1) & (self.allow == ranks.unsqueeze(1))
        self.allow = torch.sort(torch.where(drop, self.sentinel, self.allow), dim=1).values


def apply_filters_(
    logits: torch.Tensor, node: torch.Tensor, filters: RowFilters, dtrie: Any, rules: Any,
    rows: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """After a row's trie mask: block its children whose subtrees hold no usable entry, and its end token (and
    separator) where the entry ending at its node is not usable. A row left with nothing gets the end token at the
    floor value (a distinct list that used every entry ends there). Fixed shapes, no host read.

    Args:
        logits: masked logits, modified in place. Shape: (B, V).
        node: the state rows' codes. Shape: (R,), int64.
        rows: logits row of each state row (default: row i).
    """
    lo, hi, node_rank = filters.order.on(node.device)
    t = dtrie.tensors
    fanout_max = int(dtrie.max_fanout)
    inside = node >= 0
    n = node.clamp(min=0)
    start = t.child_ptr[n].long()
    count = torch.where(inside, t.child_ptr[n + 1].long() - start, 0)
    j = torch.arange(max(fanout_max, 1), device=node.device)
    valid = j < count.unsqueeze(1)
    child = (start.unsqueeze(1) + j).clamp(max=dtrie.num_nodes - 1)
    r = node_rank[n]
    terminal = inside & (r >= 0)
    # In depth-first rank order a node's own entry comes first, then its children's subtrees one after another:
    # the intervals are consecutive, so F + 2 bounds give all F + 1 (padding repeats the last bound: empty).
    kids_lo = torch.where(valid, lo[child], hi[n].unsqueeze(1))
    bounds = torch.cat([lo[n].unsqueeze(1), kids_lo, hi[n].unsqueeze(1)], 1)
    ok = filters.usable(bounds)
    own_ok = ok[:, 0] & terminal
    blocked = valid & ~ok[:, 1:]
    tok = t.child_token[child].long().clamp(min=0)
    ends = _end_columns(rules, node.device).expand(len(node), -1)
    open_child = valid & ~blocked
    end_child = torch.stack([((tok == ends[:, k : k + 1]) & open_child).any(1) for k in range(ends.shape[1])], 1)
    block_end = (terminal & ~own_ok).unsqueeze(1) & ~end_child
    cols = torch.cat([tok, ends], dim=1)
    kill = torch.cat([blocked, block_end], dim=1)
    x = logits if rows is None else logits.index_select(0, rows)
    # amin with +inf keeps a value, with -inf blocks it: duplicate columns resolve the same way in any order.
    x.scatter_reduce_(1, cols, torch.where(kill, NEG_INF, float("inf")).to(x.dtype), reduce="amin")
    left = open_child.any(1) | (terminal & own_ok)
    stuck = inside & ~left
    end = ends[:, :1]
    x.scatter_(1, end, torch.where(stuck.unsqueeze(1), ALL_MASKED_FLOOR, x.gather(1, end)))
    if rows is not None:
        logits.index_copy_(0, rows, x)
    return logits


_END_COLUMNS: dict[tuple, torch.Tensor] = {}


def _end_columns(rules: Any, device: torch.device) -> torch.Tensor:
    """The columns a terminal node keeps besides its children: the end token (and the separator in repeat mode).
    Shape: (1, 1 or 2), int64; cached per (rules, device)."""
    key = (rules, str(device))
    if key not in _END_COLUMNS:
        cols = [rules.end_token_id] + ([rules.separator[0]] if rules.on_complete == "repeat" else [])
        _END_COLUMNS[key] = torch.tensor([cols], device=device)
    return _END_COLUMNS[key]


def completed_ranks(node_before: torch.Tensor, node_after: torch.Tensor, dtrie: Any, order: EntryOrder) -> tuple[torch.Tensor, torch.Tensor]:
    """Which rows completed an entry with their last token (they stood at its end and did not go down to a child)
    and the entry's rank. Both Shape: (R,)."""
    _, _, node_rank = order.on(node_before.device)
    r = node_rank[node_before.clamp(min=0)]
    return completes_entry(node_before, node_after, dtrie.tensors.terminal, dtrie.parent_tensor), r
