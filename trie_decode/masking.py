"""The per-step masking kernel and the bitmask formats, on the logits' device.

Why this exists: this is the hot path of constrained decoding. Its contract, as a reference loop::

    for each masked row i (logits row rows[i]):
        allowed = {cols[i, k] for every k}                   # children of the row's node + extra tokens
        if the row is dense: allowed |= {j : dense_allowed[slot[i], j]}
        for every column j of logits: if j not in allowed: logits[rows[i], j] = -inf

Rows that are not masked are left untouched. The cost is one ``fill(-inf)`` of the masked rows (the physical floor
of any masking) plus a gather and a scatter of R x W values, W being the widest child list in the batch; a dense
row costs one row copy. ``cols`` is padded with a column the row keeps anyway, so no validity mask is needed.

Also here: the allowed set as an int32 bitmask of shape (R, ceil(V / 32)) (the format of XGrammar's and
llguidance's kernels) and a reference ``apply_token_bitmask_inplace``.

Dimension letters: B logits rows, R masked rows, W kept columns per row, V logits width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch


__all__ = ["MaskPlan", "apply_plans_", "plans_to_bool", "pack_bitmask", "apply_token_bitmask_inplace"]

NEG_INF = float("-inf")


@dataclass
class MaskPlan:
    """Which columns some logits rows keep (arrays of one backend).

    Attributes:
        rows: logits rows, or None for "every row, in order". Shape: (R,), int64.
        cols: kept columns, padded with a kept column. Shape: (R, W), int64.
        dense_rows: positions (into ``rows``) of rows that also keep a dense row. Shape: (D,), int64, or None.
        dense_allowed: those dense rows. Shape: (D, V_trie), bool.
    """

    rows: Optional[Any]
    cols: Any
    dense_rows: Optional[Any] = None
    dense_allowed: Optional[Any] = None


def apply_plans_(logits: torch.Tensor, plans: Sequence[MaskPlan]) -> None:
    """Apply mask plans in place (``logits``: Shape (B, V), any float dtype and device; plans' rows disjoint).

    The plans' arrays may be torch tensors or numpy arrays (CPU); the big operations (fill, gather, scatter) always
    run in torch, whose fill is vectorized and multithreaded.
    """
    if not plans:
        return
    # 1. Save what is kept (before anything is overwritten).
    kept = []
    for p in plans:
        if p.rows is None:
            kept.append(torch.gather(logits, 1, p.cols))
        else:
            kept.append(logits[p.rows[:, None], p.cols])
    dense_saved = [logits[_rows_of(p, p.dense_rows)] if p.dense_rows is not None else None for p in plans]
    # 2. The floor: -inf over every masked row.
    if len(plans) == 1 and plans[0].rows is None:
        logits.fill_(NEG_INF)
    else:
        for p in plans:
            logits[p.rows if p.rows is not None else slice(None)] = NEG_INF
    # 3. Dense rows get their allowed columns back, then every row its kept columns.
    for p, saved in zip(plans, dense_saved):
        if saved is not None:
            v = p.dense_allowed.shape[1]
            saved[:, :v][~p.dense_allowed] = NEG_INF
            saved[:, v:] = NEG_INF
            logits[_rows_of(p, p.dense_rows)] = saved
    for p, vals in zip(plans, kept):
        if p.rows is None:
            logits.scatter_(1, p.cols, vals)
        else:
            logits[p.rows[:, None], p.cols] = vals


def _rows_of(plan: MaskPlan, positions: Any) -> Any:
    return positions if plan.rows is None else plan.rows[positions]


def plans_to_bool(plans: Sequence[MaskPlan], batch_size: int, width: int) -> torch.Tensor:
    """The allowed set of every row as a boolean mask; rows no plan covers allow everything (torch plans).

    Returns:
        Shape: (batch_size, width), bool.
    """
    device = plans[0].cols.device if plans else torch.device("cpu")
    mask = torch.ones((batch_size, width), dtype=torch.bool, device=device)
    for p in plans:
        rows = p.rows if p.rows is not None else torch.arange(p.cols.shape[0], device=device)
        mask[rows] = False
        if p.dense_rows is not None:
            v = min(p.dense_allowed.shape[1], width)
            mask[rows[p.dense_rows], :v] = p.dense_allowed[:, :v]
        mask[rows[:, None], p.cols] = True
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

