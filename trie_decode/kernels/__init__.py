"""Kernels: the per-step work of constrained decoding (state update and mask), one implementation per device kind.

Why this exists: the same step runs as a fused C kernel on CPU logits, as numpy index arithmetic when that kernel
is not built, and as fixed-shape torch ops with no host synchronization on CUDA and MPS. The choice is made once,
by :func:`select`, when a :class:`~trie_decode.constraint.TrieConstraint` is made; the constraint then calls one
interface:

    prepared = kernel.prepare(step_tables)                              (once per constraint)
    kernel.advance_rows(prepared, node, tree, tokens) -> next codes     (before the trigger check)
    kernel.mask_rows(prepared, out, src, node, tree, rows)              (writes masked rows of src into out)

The mask contract, as a reference loop (``table`` holds a trie and its span rules, see :mod:`trie_decode.spans`)::

    for each state row i, logits row r = rows[i] (or i):
        if the row is unconstrained (FREE, or released): out[r] = src[r]
        else:
            allowed = children of node[i] + the row's extra tokens (end token, separator) per the span rules
            for every column j: out[r, j] = src[r, j] if j in allowed else -inf

Columns past the trie's vocabulary (padded embeddings) are never allowed. Each kernel has a parity test against the
others (tests/test_native.py) and against the brute-force reference (tests/reference.py).

A row whose kept values are all -inf already (another processor banned every token the trie allows) gets the
finite floor ``ALL_MASKED_FLOOR`` in its kept columns instead, in every kernel, so it still emits a token of the
trie.

Kernels:
    :mod:`.native`      CPU, fused C (``trie_decode/_kernel.c``); turned off by ``TRIE_DECODE_NATIVE=0``. Its
                        ``FusedStep`` runs advance and mask in one call for a caller that owns the rows' state
                        (``TrieConstraint.fused_step``: the transformers processor inside ``generate``)
    :mod:`.vectorized`  numpy index arithmetic on CPU without the C kernel (``NUMPY_KERNEL``); also the planner of
                        allowed sets and bitmasks on every device
    :mod:`.fixed`       fixed-shape torch ops, no host synchronization: CUDA, MPS (``FIXED_KERNEL``)
    :mod:`.grouped`     how the per-trie kernels (native, numpy) run a batch that mixes tries
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from . import native
from .fixed import FIXED_KERNEL
from .vectorized import ALL_MASKED_FLOOR, NUMPY_KERNEL, TORCH_KERNEL

__all__ = ["select", "planner", "mask_end_only_", "KERNELS"]

KERNELS = ("native", "numpy", "torch")
_NATIVE = native.NativeKernel()


def planner(device: torch.device | str) -> Any:
    """The kernel that plans allowed sets and bitmasks (``TrieConstraint.allowed``/``bitmask``/``allowed_tokens``)
    for logits on ``device``: the vectorized kernel over numpy on CPU, over torch elsewhere."""
    return NUMPY_KERNEL if torch.device(device).type == "cpu" else TORCH_KERNEL


def select(device: torch.device | str, name: Optional[str] = None) -> Any:
    """The kernel for logits on ``device``: native C on CPU when built and enabled, else numpy on CPU, torch
    elsewhere. ``name`` ("native", "numpy" or "torch") forces one (numpy and native need a CPU device)."""
    device = torch.device(device)
    if name is None:
        if device.type != "cpu":
            return FIXED_KERNEL
        return _NATIVE if native.enabled() else NUMPY_KERNEL
    if name not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {name!r}")
    if name == "torch":
        return FIXED_KERNEL
    if device.type != "cpu":
        raise ValueError(f"the {name} kernel runs on CPU logits only, not on {device}")
    if name == "native" and not native.AVAILABLE:
        raise ValueError("the native kernel (trie_decode._kernel) is not built in this install")
    return _NATIVE if name == "native" else NUMPY_KERNEL


def mask_end_only_(logits: torch.Tensor, rows: torch.Tensor, end_token_id: int) -> torch.Tensor:
    """The DONE state's mask for rows that have no trie (e.g. a vLLM request refused in the engine, which must end):
    every logit of logits rows ``rows`` but the end token's becomes -inf; an end token another processor banned
    gets the floor (``ALL_MASKED_FLOOR``), as in every kernel. Any device, no host read.

    Args:
        logits: Shape: (B, V), modified in place. rows: Shape: (R,), int64, on the logits' device.
    """
    keep = logits[rows, end_token_id]
    logits.index_fill_(0, rows, float("-inf"))
    logits[rows, end_token_id] = torch.where(keep == float("-inf"), torch.full_like(keep, ALL_MASKED_FLOOR), keep)
    return logits
