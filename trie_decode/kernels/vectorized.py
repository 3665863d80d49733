"""The vectorized kernel: the per-step state update and mask as a few dozen array operations.

Why this exists: it is the CPU fallback when the C kernel is not built (numpy index arithmetic on zero-copy views,
torch for the big operations on the logits), and the planner of every allowed-set query
(``TrieConstraint.allowed``/``bitmask``) on any device (through the :mod:`.arrays` shim, numpy or torch). Its plans
have data-dependent sizes (the number of allowed tokens), so on a GPU it reads sizes on the host: the per-step
kernel there is :mod:`.fixed`.

Masking is planned, then applied. A :class:`MaskPlan` lists the kept (row, column) pairs flat (a ragged layout: the
cost follows the number of allowed tokens, not rows x widest row) plus the rows that keep a dense mask row. Applying
it: read the kept values and the dense rows, ``-inf`` over every masked row (the floor of any masking), write the
dense rows with their blocked columns at ``-inf``, write the kept values back.

Dimension letters: R state rows, B logits rows, K kept (row, column) pairs, D dense rows, V logits width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from ..spans import ANCHOR, COUNT, SLOT, START, span_moves
from .arrays import NUMPY, TORCH, Ops
from .grouped import GroupedKernel
from .rules import ALL_MASKED_FLOOR, NEG_INF, extras_end, floor_rule, kept_alive

__all__ = ["MaskPlan", "VectorizedKernel", "apply_plans_", "plans_to_bool", "plans_to_lists", "NUMPY_KERNEL", "TORCH_KERNEL", "ALL_MASKED_FLOOR"]

@dataclass
class MaskPlan:
    """Which columns some logits rows keep.

    Attributes:
        rows: logits row of each kept pair. Shape: (K,), int64.
        cols: column of each kept pair (duplicates allowed). Shape: (K,), int64.
        masked_rows: the logits rows this plan masks, or None for "logits rows 0 .. num_rows - 1" (state row i is
            logits row i; logits rows past them are no state's and are left as they are). Shape: (R,), int64.
        dense_rows: logits rows that also keep a dense row. Shape: (D,), int64, or None.
        dense_blocked: the columns those rows block. Shape: (D, V_trie), bool.
        num_rows: R, the number of state rows planned.
    """

    rows: torch.Tensor
    cols: torch.Tensor
    masked_rows: Optional[torch.Tensor] = None
    dense_rows: Optional[torch.Tensor] = None
    dense_blocked: Optional[torch.Tensor] = None
    num_rows: int = 0


class VectorizedKernel(GroupedKernel):
    """The kernel written against an :class:`~.arrays.Ops` backend (numpy on CPU, torch anywhere)."""

    writes_every_row = False  # out-of-place masking needs a copy of the logits first

    def __init__(self, ops: Ops) -> None:
        self.ops = ops
        self.name = ops.name
        # numpy views need CPU tensors; torch runs anywhere (as a per-step kernel it is the fixed kernel's fallback
        # only through the planner: see trie_decode.kernels.select)
        self.device_kinds = frozenset({"cpu"}) if ops is NUMPY else None

    # ------------------------------------------------------------------ state
    def child(self, dtrie: Any, nodes: Any, tokens: Any) -> Any:
        """The child of each node by each token, -1 where there is none or where the node is negative.

        One ``searchsorted`` over the trie's ascending edge keys (parent * V + token) for the whole batch.

        Args:
            nodes, tokens: Shape: (R,), int64, arrays of this kernel's backend.
        Returns:
            Shape: (R,), int64.
        """
        ops, a = self.ops, dtrie.on(self.ops)
        key = nodes * dtrie.vocab_size + tokens
        pos = ops.searchsorted(a.edge_key, key)
        pos[pos >= dtrie.num_nodes] = 0  # the root's key (-1) never matches a real key
        hit = (a.edge_key[pos] == key) & (nodes >= 0) & (tokens >= 0) & (tokens < dtrie.vocab_size)
        pos[~hit] = -1
        return pos

    def advance(self, table: Any, node: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Each row's next state code (before the trigger check). Shape: (R,), int64 tensors in and out."""
        if self.ops is NUMPY:
            n, t = node.numpy(), tokens.numpy()
            return torch.from_numpy(span_moves(table.array, table.rules, n, t, self.child(table.dtrie, n, t)))
        return span_moves(table.tensor, table.rules, node, tokens, self.child(table.dtrie, node, tokens))

    # ------------------------------------------------------------------ masks
    def plan(self, table: Any, node: Any, rows: Optional[Any]) -> Optional[MaskPlan]:
        """Plan the mask of rows of one trie, or None when none of them is constrained.

        Args:
            table: the (trie, rules) step table on the logits' device.
            node: each row's state code. Shape: (R,), int64, an array of this kernel's backend.
            rows: logits row of each state row (same backend), or None for "state row i is logits row i".

        Steps:
          1. Gather each row's step-table row (child range, dense slot, anchor, extras).
          2. One host read: the number of child tokens to keep, of unconstrained rows, of dense rows.
          3. Drop unconstrained rows.
          4. Lay the kept (row, token) pairs out flat: every child of every sparse row, then each row's anchor and
             extras (an extra of -1, none, points at the row's anchor: a column the row keeps anyway).
        """
        ops = self.ops
        info = ops.int64(table.on(ops)[node])
        count, anchor, slot = info[:, COUNT], info[:, ANCHOR], info[:, SLOT]
        if ops is NUMPY:
            total, n_free, n_dense = int(count.sum()), int((anchor < 0).sum()), int((slot >= 0).sum())
        else:
            total, n_free, n_dense = torch.stack([count.sum(), (anchor < 0).sum(), (slot >= 0).sum()]).tolist()
        masked_rows = rows
        num_rows = info.shape[0]
        if n_free:
            keep = ops.nonzero(anchor >= 0)
            if len(keep) == 0:
                return None
            info = info[keep]
            masked_rows = keep if rows is None else rows[keep]
            count, anchor, slot = info[:, COUNT], info[:, ANCHOR], info[:, SLOT]
            total = int(count.sum())
        r = info.shape[0]
        extras = info[:, ANCHOR : extras_end(table.rules)]
        x = extras.shape[1]
        local = ops.arange(r, info)
        arrays = table.dtrie.on(ops)
        if total:
            row_of = ops.repeat(local, count, total)
            ends = ops.cumsum(count)
            child = info[:, START][row_of] + (ops.arange(total, info) - (ends - count)[row_of])
            row_flat = ops.cat([row_of, ops.repeat(local, None, x)], 0)
            col_flat = ops.cat([ops.int64(arrays.child_token[child]), extras.reshape(-1)], 0)
        else:
            row_flat, col_flat = ops.repeat(local, None, x), extras.reshape(-1)
        missing = col_flat < 0
        col_flat = col_flat + missing * (anchor[row_flat] - col_flat)
        logits_rows = row_flat if masked_rows is None else masked_rows[row_flat]
        plan = MaskPlan(_to_torch(logits_rows), _to_torch(col_flat), None if masked_rows is None else _to_torch(masked_rows),
                        num_rows=num_rows)
        if n_dense:
            dense_pos = ops.nonzero(slot >= 0)
            plan.dense_rows = _to_torch(dense_pos if masked_rows is None else masked_rows[dense_pos])
            plan.dense_blocked = _to_torch(arrays.dense_blocked[slot[dense_pos]])
        return plan

    def mask(self, out: torch.Tensor, src: torch.Tensor, node: torch.Tensor, rows: Optional[torch.Tensor], table: Any) -> None:
        """Mask the state rows' logits rows in place (``out`` is ``src``: this kernel writes no other tensor)."""
        if out is not src:
            raise ValueError("the vectorized kernel masks in place: pass out=src")
        n = node.numpy() if self.ops is NUMPY else node
        r = None if rows is None else (rows.numpy() if self.ops is NUMPY else rows)
        plan = self.plan(table, n, r)
        if plan is not None:
            apply_plans_(out, [plan])


def apply_plans_(logits: torch.Tensor, plans: Sequence[MaskPlan]) -> torch.Tensor:
    """Apply mask plans in place (``logits``: Shape (B, V), any float dtype, any device; plans' rows disjoint).

    Steps: 1. read the kept values and the dense rows; 2. -inf over every masked row (the floor); 3. write the
    dense rows with their blocked columns at -inf; 4. write the kept values. A row whose kept values are all -inf
    already (another processor banned them) gets the floor instead (:func:`~.rules.floor_rule`). No step reads a
    value back to the host.
    """
    if not plans:
        return logits
    device = logits.device
    plans = [_on(p, device) for p in plans]
    # Flat positions into the logical row-major layout: torch.take / put_ are the cheapest gather and scatter.
    width = logits.shape[1]
    flat = [p.rows * width + p.cols for p in plans]
    kept = [torch.take(logits, f) for f in flat]
    dense = [logits.index_select(0, p.dense_rows) if p.dense_rows is not None else None for p in plans]
    for p in plans:
        if p.masked_rows is None:  # the first num_rows rows: rows past them are no state's, left as they are
            (logits if p.num_rows == logits.shape[0] else logits[: p.num_rows]).fill_(NEG_INF)
        else:
            logits.index_fill_(0, p.masked_rows, NEG_INF)
    for i, (p, d) in enumerate(zip(plans, dense)):
        # How many kept values of each row are not -inf (Shape: (B,)): rows with none get the floor.
        alive = torch.zeros(logits.shape[0], dtype=torch.int32, device=device)
        alive.index_add_(0, p.rows, kept_alive(kept[i]).to(torch.int32))
        if d is not None:
            v = min(p.dense_blocked.shape[1], width)  # logits may be narrower than the trie's vocabulary
            blocked = p.dense_blocked[:, :v]
            d[:, :v].masked_fill_(blocked, NEG_INF)
            d[:, v:] = NEG_INF
            alive.index_add_(0, p.dense_rows, kept_alive(d[:, :v]).any(1).to(torch.int32))
            d[:, :v] = floor_rule(d[:, :v], (alive[p.dense_rows] > 0).unsqueeze(1) | blocked)
            logits.index_copy_(0, p.dense_rows, d)
        kept[i] = floor_rule(kept[i], alive[p.rows] > 0)
    for f, vals in zip(flat, kept):
        logits.put_(f, vals)
    return logits


def _on(plan: MaskPlan, device: torch.device) -> MaskPlan:
    if plan.rows.device == device:
        return plan
    move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
    return MaskPlan(move(plan.rows), move(plan.cols), move(plan.masked_rows), move(plan.dense_rows), move(plan.dense_blocked),
                    plan.num_rows)


def plans_to_bool(plans: Sequence[MaskPlan], batch_size: int, width: int) -> torch.Tensor:
    """The allowed set of every row as a boolean mask; rows no plan covers allow everything.

    Returns:
        Shape: (batch_size, width), bool.
    """
    device = plans[0].cols.device if plans else torch.device("cpu")
    mask = torch.ones((batch_size, width), dtype=torch.bool, device=device)
    for p in plans:
        if p.masked_rows is None:
            mask[: p.num_rows] = False
        else:
            mask[p.masked_rows] = False
        if p.dense_rows is not None:
            v = min(p.dense_blocked.shape[1], width)
            mask[p.dense_rows, :v] = ~p.dense_blocked[:, :v]
        mask[p.rows, p.cols] = True
    return mask


def plans_to_lists(plans: Sequence[MaskPlan], batch_size: int, width: int) -> list[Optional[list[int]]]:
    """The allowed set of every row as a sorted list of token ids (None: the row is unconstrained); the host-side,
    sparse reading of the same plans :func:`plans_to_bool` reads densely.
    """
    out: list[Optional[list[int]]] = [None] * batch_size
    for p in plans:
        masked = range(p.num_rows) if p.masked_rows is None else p.masked_rows.tolist()
        for r in masked:
            out[r] = []
        rows, cols = p.rows.cpu(), p.cols.cpu()
        keep = cols < width
        key = torch.unique(rows[keep] * width + cols[keep])  # sorted: by row, then token
        for r, c in zip((key // width).tolist(), (key % width).tolist()):
            out[r].append(c)
        if p.dense_rows is not None:
            v = min(p.dense_blocked.shape[1], width)
            for r, blocked in zip(p.dense_rows.tolist(), p.dense_blocked[:, :v].cpu()):
                out[r] = sorted(set(out[r]) | set(torch.nonzero(~blocked).flatten().tolist()))
    return out


def _to_torch(x: Any) -> Any:
    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x


NUMPY_KERNEL = VectorizedKernel(NUMPY)
TORCH_KERNEL = VectorizedKernel(TORCH)
