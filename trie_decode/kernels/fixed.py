"""The fixed-shape torch kernel: the step of CUDA and MPS logits, with no host synchronization.

Why this exists: on a GPU every read of a device value on the host (``.item()``, ``.tolist()``, ``nonzero``, a
boolean index, ``torch.unique``) stalls the CPU until the GPU catches up, and rules out CUDA graphs and vLLM's
asynchronous scheduling. Here every shape is known when the constraint is made, from the tries alone:

- the tries of a constraint are merged into one table (node ids offset per trie), so a batch that mixes tries
  needs no grouping of its rows;
- a sparse row keeps at most ``W`` children, the largest fanout among nodes without a dense row (nodes with
  more children get a dense row: STATIC's dense first levels, chosen by fanout); its kept columns are one
  (R, W + 3) gather of the children's tokens, padded with the row's anchor (a token it keeps anyway);
- the child search is one ``searchsorted`` over the merged edge keys.

The mask is then: gather the kept values, ``-inf`` over the constrained rows, blend the dense rows, scatter the kept
values back. Every operation is element-wise, a gather or a scatter of static size, so the step also compiles with
``torch.compile(fullgraph=True)`` and can be captured in a CUDA graph (tests/test_device_step.py).

Dimension letters: R state rows, B logits rows, T tries, N nodes of all tries, H dense rows, V the widest trie
vocabulary, W the sparse fanout bound.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np
import torch

from ..spans import ANCHOR, COUNT, SLOT, START, TABLE_COLUMNS, span_moves
from .interface import Kernel, check_state_rows
from .rules import NEG_INF, extras_end, floor_rule, kept_alive

if TYPE_CHECKING:
    from ..filters import NodeFlags

__all__ = ["FixedShapeKernel", "MergedTables", "FIXED_KERNEL"]

KEEP = TABLE_COLUMNS  # the merged table's extra column (see MergedTables)


class MergedTables:
    """The step tables of a constraint's tries as one set of device arrays (built once per constraint).

    Attributes:
        table: every trie's node rows (child ranges and dense slots offset), then the rules' K code rows; the
            step table's columns plus KEEP. Shape: (N + K, 10), int64.
        child_token: token of the edge into each node, then W padding zeros. Shape: (N + W,), int64.
        parent: parent of each node, -1 at the roots. Shape: (N,), int64.
        edge_key: ``parent * V + token``, ascending (each root holds ``offset * V - 1``). Shape: (N,), int64.
        node_offset: first node id of each trie. Shape: (T,), int64.
        dense_allowed: the dense rows, True where a token is a child. Shape: (H, V), bool.
        width: W. vocab_size: V. rules: the span rules. num_codes: K.
    """

    def __init__(self, tables: Sequence[Any]) -> None:
        rules = tables[0].rules
        device = tables[0].tensor.device
        vocab = max(t.dtrie.vocab_size for t in tables)
        rows, tokens, parents, keys, dense, offsets = [], [], [], [], [], []
        node_off = dense_off = 0
        width = 0
        for t in tables:
            trie, d = t.dtrie.trie, t.dtrie
            n = trie.num_nodes
            host = t.tensor.cpu().numpy().astype(np.int64)[:n]
            host[:, START] += node_off
            host[:, SLOT] = np.where(host[:, SLOT] >= 0, host[:, SLOT] + dense_off, -1)
            rows.append(host)
            tokens.append(trie.token.astype(np.int64))
            parent = trie.parent.astype(np.int64)
            parents.append(np.where(parent >= 0, parent + node_off, -1))
            key = (parent + node_off) * vocab + trie.token.astype(np.int64)
            key[0] = node_off * vocab - 1  # below every key of this trie, above every key of the previous one
            keys.append(key)
            blocked = d.tensors.dense_blocked.cpu().numpy()
            allowed = np.zeros((blocked.shape[0], vocab), dtype=np.bool_)
            allowed[:, : blocked.shape[1]] = ~blocked
            dense.append(allowed)
            width = max(width, int(host[:, COUNT].max(initial=0)))
            offsets.append(node_off)
            node_off += n
            dense_off += blocked.shape[0]
        codes = tables[0].tensor.cpu().numpy().astype(np.int64)[tables[0].dtrie.num_nodes :]
        to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
        table = np.concatenate(rows + [codes])
        # One more column, KEEP: a column each row may read and write back unchanged (its anchor, or column 0 for
        # an unconstrained row), the padding of its kept columns.
        self.table = to(np.concatenate([table, np.maximum(table[:, ANCHOR : ANCHOR + 1], 0)], axis=1))
        # W padding tokens at the end, so that a row's W child positions never run past the array.
        self.child_token = to(np.concatenate(tokens + [np.zeros(width, dtype=np.int64)]))
        self.parent = to(np.concatenate(parents))
        self.edge_key = to(np.concatenate(keys))
        self.node_offset = to(np.array(offsets, dtype=np.int64))
        self.dense_allowed = to(np.concatenate(dense)) if dense_off else None
        self.num_nodes, self.num_codes = node_off, len(codes)
        self.width, self.vocab_size, self.rules = width, vocab, rules
        self.extra_end = extras_end(rules)

    def rows_of(self, node: torch.Tensor, tree: torch.Tensor) -> torch.Tensor:
        """The merged table row of each state: trie nodes offset by their trie, codes indexing the last K rows."""
        return torch.where(node >= 0, node + self.node_offset[tree], node + self.num_nodes + self.num_codes)


class FixedShapeKernel(Kernel):
    """The kernel interface of :mod:`trie_decode.kernels` in fixed-shape torch ops (any device; the default on
    CUDA and MPS). Its capabilities are :class:`~.interface.Kernel`'s defaults: any device, no fused step, and
    static filters applied after the mask, by trie_decode.filters' pass."""

    name = "torch"

    def prepare(self, tables: Sequence[Any]) -> MergedTables:
        return MergedTables(tables)

    def advance_rows(self, m: MergedTables, node: torch.Tensor, tree: torch.Tensor, tokens: torch.Tensor,
                     filter_bits: Optional["NodeFlags"] = None) -> torch.Tensor:
        """Each row's next state code (before the trigger check). Shape: (R,), int64."""
        if filter_bits is not None:
            raise ValueError("the torch kernel does not apply filter bits")
        offset = m.node_offset[tree]
        g = torch.where(node >= 0, node + offset, -1)
        key = g * m.vocab_size + tokens
        pos = torch.searchsorted(m.edge_key, key).clamp(max=m.num_nodes - 1)
        hit = (m.edge_key[pos] == key) & (m.parent[pos] == g) & (g >= 0) & (tokens >= 0) & (tokens < m.vocab_size)
        child = torch.where(hit, pos - offset, -1)
        if m.rules.plain:
            return child
        # span_moves reads the table row of each state: give it the merged rows (codes keep their negative value).
        return span_moves(_RowView(m, tree), m.rules, node, tokens, child)

    def mask_rows(
        self, m: MergedTables, out: torch.Tensor, src: torch.Tensor, node: torch.Tensor, tree: torch.Tensor,
        rows: Optional[torch.Tensor], filter_bits: Optional["NodeFlags"] = None,
    ) -> None:
        """Mask logits rows ``rows`` (default: row i for state row i) of ``src`` into ``out`` (in place: out is src).

        Steps (no host read, static shapes):
          1. The state rows' table rows; their kept columns: W child tokens (padded with the anchor) + extras.
          2. Gather the kept values; a row is alive when one of them (or of its dense row) is not -inf.
          3. -inf over the constrained rows; dense rows blended back; kept values scattered back, through the floor
             rule (:func:`~.rules.floor_rule`).
        """
        if filter_bits is not None:
            raise ValueError("the torch kernel does not apply filter bits")
        if out is not src:
            raise ValueError("the torch kernel masks in place: pass out=src")
        n = node.shape[0]
        if n == 0:  # no row to mask (and _fill_rows_ names a first row)
            return
        if rows is None:
            check_state_rows(n, src.shape[0])
            x = src if n == src.shape[0] else src[:n]  # a view: the first n rows, masked in place
        else:
            x = src.index_select(0, rows)
        info = m.table[m.rows_of(node, tree)]
        start, count, anchor, keep = info[:, START], info[:, COUNT], info[:, ANCHOR], info[:, KEEP : KEEP + 1]
        j = torch.arange(m.width, device=x.device)
        children = torch.where(j < count.unsqueeze(1), m.child_token[start.unsqueeze(1) + j], keep)
        extras = info[:, ANCHOR : m.extra_end]
        cols = torch.cat([children, torch.where(extras >= 0, extras, keep)], dim=1)
        constrained = anchor >= 0
        kept = x.gather(1, cols)
        alive = kept_alive(kept).any(dim=1)
        dense_vals = None
        if m.dense_allowed is not None:
            slot = info[:, SLOT]
            is_dense = (slot >= 0) & constrained
            v = min(m.vocab_size, x.shape[1])  # logits may be narrower than the tries' vocabulary
            allowed = m.dense_allowed[slot.clamp(min=0), :v] & is_dense.unsqueeze(1)
            alive = alive | (allowed & kept_alive(x[:, :v])).any(dim=1)
            dense_vals = torch.where(allowed, floor_rule(x[:, :v], alive.unsqueeze(1)), NEG_INF)
        kept = floor_rule(kept, (alive | ~constrained).unsqueeze(1))
        _fill_rows_(x, constrained)
        if dense_vals is not None:
            x[:, :v] = torch.where(is_dense.unsqueeze(1), dense_vals, x[:, :v])
        x.scatter_(1, cols, kept)
        if rows is not None:
            out.index_copy_(0, rows, x)


def _fill_rows_(x: torch.Tensor, rows: torch.Tensor) -> None:
    """``x[rows] = -inf`` for a boolean row mask, with a fixed-size index and no host read.

    Every row is named: a row outside the mask names the first row inside it instead (filled anyway). With no row
    inside, the first row is filled by mistake, so it is saved and put back. On a CPU this is about twice as fast as
    ``masked_fill_`` with a broadcast row mask, and NaN logits are masked too (a clamp would keep them).

    Args:
        x: Shape: (B, V), modified in place. rows: Shape: (B,), bool.
    """
    first = torch.argmax(rows.to(torch.uint8)).view(1)
    saved = x.index_select(0, first)
    x.index_fill_(0, torch.where(rows, torch.arange(x.shape[0], device=x.device), first), NEG_INF)
    x.index_copy_(0, first, torch.where(rows[first].unsqueeze(1), x.index_select(0, first), saved))


class _RowView:
    """``table[node]`` for :func:`~trie_decode.spans.span_moves`, on the merged table."""

    def __init__(self, m: MergedTables, tree: torch.Tensor) -> None:
        self.m, self.tree = m, tree

    def __getitem__(self, node: torch.Tensor) -> torch.Tensor:
        return self.m.table[self.m.rows_of(node, self.tree)]


FIXED_KERNEL = FixedShapeKernel()
