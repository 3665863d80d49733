"""Masking logits with trie nodes: the per-step kernel, in plain torch ops on the logits' device.

Why this exists: this is the hot path of constrained decoding. Its contract, as a reference loop::

    for each masked row i:
        allowed = children_tokens(nodes[i]) ∪ {extra[i, k] for k if extra[i, k] >= 0}
        if allowed is empty: allowed = {fallback}
        for every column j of logits: if j not in allowed: logits[rows[i], j] = -inf

Rows not listed in ``rows`` are left untouched. The implementation costs one ``fill_(-inf)`` of the masked rows
(the physical floor of any masking) plus O(R * width) gathers and scatters, where width is the widest child list
in the batch; nodes with a dense row (see :class:`~trie_decode.device.DeviceTrie`) cost one row copy. One small
device-to-host read per call (the batch's widest child list and whether any row is dense) sizes the gather.

Also here: the allowed set as a boolean mask or as an int32 bitmask of shape (R, ceil(V / 32)), the format that
XGrammar's and llguidance's kernels consume, and the reference ``apply_token_bitmask_inplace``.

Dimension letters: B logits rows, R masked rows, V logits width (may exceed the trie's vocabulary), X extra
tokens per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .device import DeviceTrie

__all__ = ["RowMaskPlan", "plan_rows", "apply_plans_", "allowed_mask", "pack_bitmask", "apply_token_bitmask_inplace"]


@dataclass
class RowMaskPlan:
    """What to keep in some rows of the logits: built by :func:`plan_rows`, applied by :func:`apply_plans_`.

    Attributes:
        rows: logits rows. Shape: (R,), int64.
        cols: kept columns per row, padded with a column that is kept anyway. Shape: (R, W), int64.
        dense_rows: rows served by dense masks. Shape: (H_r,), int64.
        dense_mask: their allowed columns. Shape: (H_r, V_trie), bool.
        dense_cols: extra kept columns of the dense rows (already in ``cols`` too).
    """

    rows: torch.Tensor
    cols: torch.Tensor
    dense_rows: Optional[torch.Tensor] = None
    dense_mask: Optional[torch.Tensor] = None


def plan_rows(
    dtrie: DeviceTrie,
    rows: torch.Tensor,
    nodes: torch.Tensor,
    extra: Optional[torch.Tensor],
    fallback: int,
) -> RowMaskPlan:
    """Plan the mask of ``rows``: the children of ``nodes`` plus ``extra`` tokens, ``fallback`` if nothing else.

    Args:
        dtrie: the rows' trie on the logits' device.
        rows: logits rows to mask. Shape: (R,), int64.
        nodes: each row's trie node; a negative node has no children. Shape: (R,), int64.
        extra: extra allowed tokens per row, -1 for none. Shape: (R, X), int64, or None.
        fallback: the token allowed when a row would otherwise allow nothing (the end token).
    """
    r = rows.numel()
    slot = dtrie.dense_slot(nodes)
    is_dense = slot >= 0
    count = torch.where(is_dense, torch.zeros_like(nodes), dtrie.fanout(nodes))
    # The one host read of the call: the widest sparse child list, and whether any row is dense.
    width, any_dense = (int(x) for x in torch.stack([count.max(), is_dense.any().long()]).tolist()) if r else (0, 0)
    children, valid = dtrie.child_tokens(nodes, width)
    if extra is None:
        extra = torch.full((r, 0), -1, dtype=torch.long, device=rows.device)
    extra_valid = extra >= 0
    # Anchor: a column every row keeps for sure, used to pad. First child if any (dense rows included), else the
    # first extra token, else the fallback.
    first_child = dtrie.child_tokens(nodes, 1)[0][:, 0]
    has_child = dtrie.fanout(nodes) > 0
    first_extra = extra[:, 0] if extra.shape[1] else torch.full_like(nodes, -1)
    anchor = torch.where(
        has_child, first_child, torch.where(first_extra >= 0, first_extra, torch.full_like(nodes, fallback))
    )
    cols = torch.cat([torch.where(valid, children, anchor.unsqueeze(1)), torch.where(extra_valid, extra, anchor.unsqueeze(1)), anchor.unsqueeze(1)], dim=1)
    plan = RowMaskPlan(rows=rows, cols=cols)
    if any_dense:
        which = is_dense.nonzero().squeeze(1)
        plan.dense_rows = rows[which]
        plan.dense_mask = dtrie.dense_mask[slot[which]]
    return plan


def apply_plans_(logits: torch.Tensor, plans: Sequence[RowMaskPlan]) -> torch.Tensor:
    """Apply mask plans in place: every column not kept by its row's plan becomes ``-inf``.

    Args:
        logits: Shape: (B, V), any float dtype, any device. Modified in place and returned.
        plans: from :func:`plan_rows`; their rows must be disjoint.
    """
    plans = [p for p in plans if p.rows.numel()]
    if not plans:
        return logits
    neg_inf = float("-inf")
    kept = [logits[p.rows.unsqueeze(1), p.cols] for p in plans]
    dense_vals = [logits[p.dense_rows] if p.dense_rows is not None else None for p in plans]
    all_rows = torch.cat([p.rows for p in plans]) if len(plans) > 1 else plans[0].rows
    if all_rows.numel() == logits.shape[0]:
        logits.fill_(neg_inf)
    else:
        logits.index_fill_(0, all_rows, neg_inf)
    for plan, vals in zip(plans, dense_vals):
        if vals is not None:
            v = plan.dense_mask.shape[1]
            vals[:, v:] = neg_inf
            vals[:, :v].masked_fill_(~plan.dense_mask[:, : vals.shape[1]], neg_inf)
            logits[plan.dense_rows] = vals
    for plan, vals in zip(plans, kept):
        logits[plan.rows.unsqueeze(1), plan.cols] = vals
    return logits


def allowed_mask(plans: Sequence[RowMaskPlan], batch_size: int, width: int, device: torch.device) -> torch.Tensor:
    """The allowed set of planned rows as a boolean mask; rows without a plan allow everything.

    Returns:
        Shape: (batch_size, width), bool.
    """
    mask = torch.ones((batch_size, width), dtype=torch.bool, device=device)
    for plan in plans:
        if not plan.rows.numel():
            continue
        mask[plan.rows] = False
        if plan.dense_rows is not None:
            v = min(plan.dense_mask.shape[1], width)
            dense = torch.zeros((plan.dense_rows.numel(), width), dtype=torch.bool, device=device)
            dense[:, :v] = plan.dense_mask[:, :v]
            mask[plan.dense_rows] = dense
        mask[plan.rows.unsqueeze(1), plan.cols] = True
    return mask


def pack_bitmask(mask: torch.Tensor) -> torch.Tensor:
    """Pack a boolean mask into XGrammar's int32 bitmask: bit j % 32 of word j // 32 is set iff column j is allowed.

    Args:
        mask: Shape: (B, V), bool.
    Returns:
        Shape: (B, ceil(V / 32)), int32.
    """
    b, v = mask.shape
    words = (v + 31) // 32
    padded = torch.zeros((b, words * 32), dtype=torch.int64, device=mask.device)
    padded[:, :v] = mask
    weights = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int64, device=mask.device), torch.arange(32, device=mask.device))
    packed = (padded.view(b, words, 32) * weights).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # reinterpret as two's-complement int32
    return packed.to(torch.int32)


def apply_token_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor, *, indices: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reference torch implementation of XGrammar's bitmask contract.

    If bit j % 32 of ``bitmask[i, j // 32]`` is 0, ``logits[i, j] = -inf``; columns past ``32 * bitmask.shape[1]``
    are set to -inf. With ``indices``, row k of ``bitmask`` applies to logits row ``indices[k]``.

    Args:
        logits: Shape: (B, V), float. bitmask: Shape: (R, ceil(V / 32)), int32. indices: Shape: (R,), int64.
    """
    rows = indices if indices is not None else torch.arange(logits.shape[0], device=logits.device)
    v = logits.shape[1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :v].to(torch.bool)
    if allowed.shape[1] < v:
        allowed = torch.cat([allowed, allowed.new_zeros((allowed.shape[0], v - allowed.shape[1]))], dim=1)
    logits[rows] = logits[rows].masked_fill(~allowed.to(logits.device), float("-inf"))
    return logits
