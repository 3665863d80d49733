"""The allowed set as an int32 token bitmask: XGrammar's and llguidance's exchange format.

Why this exists: other engines (vLLM's structured outputs, XGrammar's and llguidance's kernels) take the allowed
tokens as an int32 bitmask of shape (B, ceil(V / 32)). ``TrieConstraint.bitmask`` produces it; this module packs
it and holds a reference ``apply_token_bitmask_inplace``. The masking kernels themselves are in
:mod:`trie_decode.kernels`.

Dimension letters: B rows, V logits width.
"""

from __future__ import annotations

from typing import Optional

import torch

from .kernels.rules import NEG_INF

__all__ = ["pack_bitmask", "apply_token_bitmask_inplace"]


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

