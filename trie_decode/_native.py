"""The fused CPU kernel (``trie_decode/_kernel.c``), behind checks that make its raw pointers safe.

Why this exists: on a CPU, the vectorized numpy/torch step spends most of its time in the fixed cost of a few dozen
array operations, not in the fill of the logits (the floor). The C kernel does the same work in one pass per row.
It is optional (an install without a C compiler has no ``_kernel``); :data:`AVAILABLE` says whether it loaded, and
``TRIE_DECODE_NATIVE=0`` in the environment turns it off (to compare both paths, or to rule it out when debugging).

Every public function here takes tensors, checks device, dtype, contiguity and shape, and only then hands data
pointers to C; the kernel itself bounds-checks every per-step node id, row and token it reads.
"""

from __future__ import annotations

import os
import struct
from typing import Any, Optional

import torch

try:  # built by setup.py when a C compiler was available at install time
    from . import _kernel
except ImportError:  # pragma: no cover - exercised only on installs without a compiler
    _kernel = None

__all__ = ["AVAILABLE", "ENABLED", "enabled", "usable_logits", "static_args", "mask_rows", "child"]

AVAILABLE = _kernel is not None

# The bit pattern of -inf in each float dtype the kernel handles (it copies elements, it never computes on them).
_NEG_INF_BITS = {
    torch.float32: struct.unpack("<I", struct.pack("<f", float("-inf")))[0],
    torch.float64: struct.unpack("<Q", struct.pack("<d", float("-inf")))[0],
    torch.float16: 0xFC00,
    torch.bfloat16: 0xFF80,
}


def enabled() -> bool:
    """Whether the CPU step uses the kernel: it loaded and ``TRIE_DECODE_NATIVE`` was not ``0`` at import (a
    :class:`~trie_decode.constraint.TrieConstraint` decides when it is made)."""
    return ENABLED


ENABLED = AVAILABLE and os.environ.get("TRIE_DECODE_NATIVE", "1") != "0"


def usable_logits(logits: torch.Tensor) -> bool:
    """True when ``logits`` suit the kernel: a CPU (B, V) tensor of a handled float dtype with unit column stride
    and rows that do not overlap."""
    return (
        logits.dtype in _NEG_INF_BITS
        and logits.is_cpu
        and logits.dim() == 2
        and (logits.stride(1) == 1 or logits.shape[1] <= 1)
        and (logits.stride(0) >= logits.shape[1] or logits.shape[0] <= 1)
    )


def static_args(table: Any) -> tuple:
    """The kernel's arguments that depend only on a CPU step table and its trie (computed once per table; the
    table keeps the arrays alive)."""
    d = table.dtrie
    t = d.tensors
    for name, arr, dtype in (("step table", table.tensor, torch.int32), ("child_token", t.child_token, torch.int32),
                             ("child_ptr", t.child_ptr, torch.int32), ("dense_blocked", t.dense_blocked, torch.bool)):
        if arr.device.type != "cpu" or arr.dtype != dtype or not arr.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {dtype} CPU tensor")
    if tuple(table.tensor.shape) != (d.num_nodes + table.num_codes, 6) or t.child_token.numel() != d.num_nodes:
        raise ValueError("step table and trie sizes disagree")
    if t.child_ptr.numel() != d.num_nodes + 1 or tuple(t.dense_blocked.shape) != (d.num_dense, d.vocab_size):
        raise ValueError("trie arrays have inconsistent shapes")
    return (
        table.tensor.data_ptr(), d.num_nodes, table.num_codes, t.child_token.data_ptr(), d.num_nodes,
        t.dense_blocked.data_ptr(), d.vocab_size, d.num_dense,
    )


def _index(t: torch.Tensor, n: int, what: str) -> torch.Tensor:
    """``t`` as a contiguous (n,) int64 CPU tensor (a copy only if it is a strided view), or ValueError."""
    if t.dtype is not torch.int64 or not t.is_cpu or t.dim() != 1 or t.numel() != n:
        raise ValueError(f"{what} must be a (n={n},) int64 CPU tensor, got {t.dtype} {tuple(t.shape)} on {t.device}")
    return t if t.is_contiguous() else t.contiguous()


def mask_rows(out: torch.Tensor, src: torch.Tensor, nodes: torch.Tensor, rows: Optional[torch.Tensor], table: Any) -> int:
    """Mask rows of ``src`` into ``out`` (they may be the same tensor) by their trie states; returns rows masked.

    Args:
        out, src: Shape: (B, W), same shape and dtype, W >= the trie's vocabulary (see :func:`usable_logits`).
        nodes: each state row's node or code. Shape: (R,), int64.
        rows: logits row of each state row (None: state row i is logits row i; R must then be <= B).
        table: the CPU ``_StepTable`` of (trie, rules).
    """
    n = nodes.numel()
    nodes = _index(nodes, n, "nodes")
    if rows is not None:
        rows = _index(rows, n, "rows")
    if not usable_logits(src) or (out is not src and (out.shape != src.shape or out.dtype != src.dtype or not usable_logits(out))):
        raise ValueError("the kernel takes 2-D CPU float logits with unit column stride, out and src alike")
    batch, width = src.shape
    if width < table.dtrie.vocab_size:
        raise ValueError(f"logits have {width} columns, fewer than the trie's vocabulary ({table.dtrie.vocab_size})")
    return _kernel.mask(
        out.data_ptr(), src.data_ptr(), batch, out.stride(0), src.stride(0), width, src.element_size(),
        _NEG_INF_BITS[src.dtype], n, 0 if rows is None else rows.data_ptr(), nodes.data_ptr(), *table.kernel_args,
    )


def child(dtrie: Any, nodes: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The child of each node by each token, -1 where there is none (``DeviceTrie.step`` for a CPU trie).

    Args:
        nodes, tokens: Shape: (R,), int64, CPU.
    Returns:
        Shape: (R,), int64.
    """
    n = nodes.numel()
    nodes, tokens = _index(nodes, n, "nodes"), _index(tokens, n, "tokens")
    out = torch.empty(n, dtype=torch.int64)
    trie_args = dtrie.__dict__.get("_kernel_child_args")
    if trie_args is None:
        t = dtrie.tensors
        if not (t.child_ptr.is_cpu and t.child_token.is_cpu):
            raise ValueError("the kernel needs a CPU DeviceTrie")
        trie_args = dtrie._kernel_child_args = (t.child_ptr.data_ptr(), t.child_token.data_ptr(), dtrie.num_nodes)
    _kernel.child(out.data_ptr(), nodes.data_ptr(), tokens.data_ptr(), n, *trie_args)
    return out
