"""The per-step masking kernel and the bitmask formats, on the logits' device.

Why this exists: this is the hot path of constrained decoding. Its contract, as a reference loop::

    for each masked row i:
        allowed = {cols[k] for every k with rows[k] == i}         # children of the row's node + extra tokens
        if i is a dense row: allowed |= {j : not dense_blocked[i, j]}
        for every column j of logits: if j not in allowed: logits[i, j] = -inf

Rows that are not masked are left untouched. The cost is one ``fill(-inf)`` of the masked rows (the physical floor
of any masking), a gather and a scatter of the kept (row, column) pairs (ragged: the number of allowed tokens, not
rows x widest row), and three passes over V for each dense row.

Also here: the allowed set as an int32 bitmask of shape (R, ceil(V / 32)) (the format of XGrammar's and
llguidance's kernels) and a reference ``apply_token_bitmask_inplace``.

Dimension letters: B logits rows, K kept (row, column) pairs, D dense rows, V logits width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = ["MaskPlan", "apply_plans_", "plans_to_bool", "pack_bitmask", "apply_token_bitmask_inplace"]

NEG_INF = float("-inf")


@dataclass
class MaskPlan:
    """Which columns some logits rows keep.

    Attributes:
        rows: logits row of each kept pair. Shape: (K,), int64.
        cols: column of each kept pair (duplicates allowed). Shape: (K,), int64.
        masked_rows: the logits rows this plan masks, or None for "every row". Shape: (R,), int64.
        dense_rows: logits rows that also keep a dense row. Shape: (D,), int64, or None.
        dense_blocked: the columns those rows block. Shape: (D, V_trie), bool.
    """

    rows: torch.Tensor
    cols: torch.Tensor
    masked_rows: Optional[torch.Tensor] = None
    dense_rows: Optional[torch.Tensor] = None
    dense_blocked: Optional[torch.Tensor] = None


def apply_plans_(logits: torch.Tensor, plans: Sequence[MaskPlan], *, inplace: bool = True) -> torch.Tensor:
    """Apply mask plans (``logits``: Shape (B, V), any float dtype, any device; plans' rows disjoint).

    Args:
        inplace: write into ``logits``; otherwise return a new tensor and leave ``logits`` as it was (same cost
            when every row is masked: the new tensor is created already filled with -inf).

    Steps: 1. read the kept values and the dense rows; 2. -inf over every masked row (the floor); 3. write the
    dense rows with their blocked columns at -inf; 4. write the kept values.
    """
    if not plans:
        return logits if inplace else logits.clone()
    device = logits.device
    plans = [_on(p, device) for p in plans]
    # Flat positions into the logical row-major layout: torch.take / put_ are the cheapest gather and scatter.
    width = logits.shape[1]
    flat = [p.rows * width + p.cols for p in plans]
    kept = [torch.take(logits, f) for f in flat]
    dense = [logits.index_select(0, p.dense_rows) if p.dense_rows is not None else None for p in plans]
    every_row = any(p.masked_rows is None for p in plans)
    if inplace:
        target = logits
    elif every_row:
        target = torch.full_like(logits, NEG_INF, memory_format=torch.contiguous_format)
    else:
        target = logits.clone()
    if inplace or not every_row:
        if every_row:
            target.fill_(NEG_INF)
        else:
            for p in plans:
                target.index_fill_(0, p.masked_rows, NEG_INF)
    for p, d in zip(plans, dense):
        if d is not None:
            v = p.dense_blocked.shape[1]
            d[:, :v].masked_fill_(p.dense_blocked, NEG_INF)
            d[:, v:] = NEG_INF
            target.index_copy_(0, p.dense_rows, d)
    for f, vals in zip(flat, kept):
        target.put_(f, vals)
    return target


def _on(plan: MaskPlan, device: torch.device) -> MaskPlan:
    if plan.rows.device == device:
        return plan
    move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
    return MaskPlan(move(plan.rows), move(plan.cols), move(plan.masked_rows), move(plan.dense_rows), move(plan.dense_blocked))


def plans_to_bool(plans: Sequence[MaskPlan], batch_size: int, width: int) -> torch.Tensor:
    """The allowed set of every row as a boolean mask; rows no plan covers allow everything.

    Returns:
        Shape: (batch_size, width), bool.
    """
    device = plans[0].cols.device if plans else torch.device("cpu")
    mask = torch.ones((batch_size, width), dtype=torch.bool, device=device)
    for p in plans:
        if p.masked_rows is None:
            mask[:] = False
        else:
            mask[p.masked_rows] = False
        if p.dense_rows is not None:
            v = min(p.dense_blocked.shape[1], width)
            mask[p.dense_rows, :v] = ~p.dense_blocked[:, :v]
        mask[p.rows, p.cols] = True
    return mask


def pack_bitmask(mask: torch.Tensor) -> torch.Tensor:
    """Pack a boolean mask into the int32 bitmask format: bit j % 32 of word j // 32 is set iff j is allowed.

    Args:
        mask: Shape: (B, V), bool.
    Returns:
        Shape: (B, ceil(V / 32)), int32.
    """
    b, v = mask.shape
    words = (v + 31) // 32
    padded = torch.zeros((b, words * 32), dtype=torch.int64, device=mask.device)
    padded[:, :v] = mask
    weights = torch.ones(32, dtype=torch.int64, device=mask.device) << torch.arange(32, device=mask.device)
    packed = (padded.view(b, words, 32) * weights).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # two's-complement int32
    return packed.to(torch.int32)


def apply_token_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor, *, indices: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reference torch implementation of the int32 bitmask contract (XGrammar's ``apply_token_bitmask_inplace``).

    If bit j % 32 of ``bitmask[k, j // 32]`` is 0, ``logits[i, j] = -inf`` where i = ``indices[k]`` (default k);
    columns past ``32 * bitmask.shape[1]`` become -inf.

    Args:
        logits: Shape: (B, V), float. bitmask: Shape: (R, ceil(V / 32)), int32. indices: Shape: (R,), int64.
    """
    rows = indices if indices is not None else torch.arange(bitmask.shape[0], device=logits.device)
    v = logits.shape[1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(bitmask.shape[0], -1).to(torch.bool)
    if allowed.shape[1] < v:
        allowed = torch.cat([allowed, allowed.new_zeros((allowed.shape[0], v - allowed.shape[1]))], dim=1)
    logits[rows] = logits[rows].masked_fill(~allowed[:, :v].to(logits.device), NEG_INF)
    return logits

