"""Kernels: the per-step work of constrained decoding (state update and mask), one implementation per device kind.

Why this exists: the same step runs as a fused C kernel on CPU logits, as numpy index arithmetic when that kernel
is not built, and as fixed-shape torch ops with no host synchronization on CUDA and MPS. The choice is made once,
by :func:`select`, when a :class:`~trie_decode.constraint.TrieConstraint` is made; the constraint then calls one
interface:

    prepared = kernel.prepare(step_tables)                              (once per constraint)
    kernel.advance_rows(prepared, node, tree, tokens) -> next codes     (before the trigger check)
    kernel.mask_rows(prepared, out, src, node, tree, rows)              (writes masked rows of src into out)

Each kernel declares what it can do (:class:`~.interface.Kernel` holds the defaults), and the constraint asks
these, never a kernel's name:

    name                 "native", "numpy" or "torch" (what ``TrieConstraint(kernel=...)`` names)
    device_kinds         the device types it runs on (None: any); runs_on(device), available() (built),
                         default_on(device) (chosen by default there)
    writes_every_row     out of place, it writes every row itself (no copy of the logits first)
    reads_host           its step reads on the host anyway (CPU kernels): a CPU row map's range is checked before
                         dispatch; the torch kernel reads nothing on the host, wherever it runs
    supports_filters     it applies static filters in its own pass, from their per-node bits
                         (``advance_rows``/``mask_rows`` take ``filter_bits``; ``takes_filters(out, src)`` says
                         whether it can for these logits); otherwise trie_decode.filters' pass applies them
    supports_fused_step  ``fused_step(table, nodes, needed_width)`` gives a one-call step (advance, then mask) for
                         a caller that owns its rows' state

The inputs every kernel takes are checked once, before dispatch (``TrieConstraint.mask_``/``advance``, with
:func:`.interface.check_logits` and :func:`.interface.check_rows`): (B, V) float logits not requiring grad, a row
map of one integer row per state row, one token per state row. A kernel states none of these checks again.

The mask contract, as a reference loop (``table`` holds a trie and its span rules, see :mod:`trie_decode.spans`)::

    for each state row i, logits row r = rows[i] (or i):
        if the row is unconstrained (FREE, or released): out[r] = src[r]
        else:
            allowed = children of node[i] + the row's extra tokens (end token, separator) per the span rules
            for every column j: out[r, j] = src[r, j] if j in allowed else -inf

Columns past the trie's vocabulary (padded embeddings) are never allowed. Each kernel has a parity test against the
others (tests/test_native.py) and against the brute-force reference (tests/reference.py).

A row whose kept values are all -inf already (another processor banned every token the trie allows) gets the
finite floor in its kept columns instead, in every kernel, so it still emits a token of the trie: the floor rule,
stated once in :mod:`.rules` and applied by every kernel.

Kernels:
    :mod:`.native`      CPU, fused C (``trie_decode/_kernel.c``); turned off by ``TRIE_DECODE_NATIVE=0``; supports
                        filters and the fused step (``TrieConstraint.fused_step``: the transformers processor
                        inside ``generate``)
    :mod:`.vectorized`  numpy index arithmetic on CPU without the C kernel (``NUMPY_KERNEL``); also the planner of
                        allowed sets and bitmasks on every device
    :mod:`.fixed`       fixed-shape torch ops, no host synchronization: CUDA, MPS (``FIXED_KERNEL``)
    :mod:`.grouped`     how the per-trie kernels (native, numpy) run a batch that mixes tries
    :mod:`.rules`       the rules every kernel applies (the floor rule, the columns of a row's extra kept tokens)
    :mod:`.interface`   the capabilities every kernel declares, and their defaults
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from . import native
from .fixed import FIXED_KERNEL
from .rules import ALL_MASKED_FLOOR, floor_rule, kept_alive
from .vectorized import NUMPY_KERNEL, TORCH_KERNEL

__all__ = ["select", "planner", "mask_end_only_", "KERNELS", "ALL_MASKED_FLOOR", "floor_rule"]

KERNELS = ("native", "numpy", "torch")
_NATIVE = native.NativeKernel()
#: Every per-step kernel, in order of preference: the default for a device is the first whose ``default_on`` holds.
_REGISTRY = (_NATIVE, NUMPY_KERNEL, FIXED_KERNEL)


def planner(device: torch.device | str) -> Any:
    """The kernel that plans allowed sets and bitmasks (``TrieConstraint.allowed``/``bitmask``/``allowed_tokens``)
    for logits on ``device``: the vectorized kernel over numpy on CPU, over torch elsewhere."""
    return NUMPY_KERNEL if NUMPY_KERNEL.runs_on(torch.device(device)) else TORCH_KERNEL


def select(device: torch.device | str, name: Optional[str] = None) -> Any:
    """The kernel for logits on ``device``, from the kernels' declared capabilities: by default the first kernel
    that is chosen there (native C on CPU when built and enabled, else numpy on CPU, torch elsewhere). ``name``
    ("native", "numpy" or "torch") forces one; it must run on ``device`` and be built."""
    device = torch.device(device)
    if name is None:
        return next(k for k in _REGISTRY if k.default_on(device))
    if name not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {name!r}")
    kernel = next(k for k in _REGISTRY if k.name == name)
    if not kernel.runs_on(device):
        raise ValueError(f"the {name} kernel runs on CPU logits only, not on {device}")
    if not kernel.available():
        raise ValueError(f"the {name} kernel (trie_decode._kernel) is not built in this install")
    return kernel


def mask_end_only_(logits: torch.Tensor, rows: torch.Tensor, end_token_id: int) -> torch.Tensor:
    """The DONE state's mask for rows that have no trie (e.g. a vLLM request refused in the engine, which must end):
    every logit of logits rows ``rows`` but the end token's becomes -inf; an end token another processor banned
    gets the floor (the floor rule, :mod:`.rules`), as in every kernel. Any device, no host read.

    Args:
        logits: Shape: (B, V), modified in place. rows: Shape: (R,), int64, on the logits' device.
    """
    keep = logits[rows, end_token_id]
    logits.index_fill_(0, rows, float("-inf"))
    logits[rows, end_token_id] = floor_rule(keep, kept_alive(keep))
    return logits
