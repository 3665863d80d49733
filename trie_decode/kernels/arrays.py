"""Array backends of the vectorized kernel: torch on any device, numpy views of CPU tensors.

Why this exists: on a CPU the per-step index arithmetic of constrained decoding is a few dozen tiny array
operations, and torch's dispatch costs ~3 us per operation against numpy's ~0.3 us. Writing that arithmetic once
against this small shim lets CPU state run through zero-copy numpy views (``tensor.numpy()`` shares memory) while
CUDA and MPS state runs the very same code in torch: one implementation, not two copies that could drift apart.
The big operations on the logits (fill, gather, scatter) are always torch (see :mod:`.vectorized`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["Ops", "TORCH", "NUMPY"]


class Ops:
    """The operations the kernel needs, spelled once per backend."""

    name = "abstract"

    def int64(self, x: Any) -> Any: ...
    def cat(self, xs: list, axis: int) -> Any: ...
    def arange(self, n: int, like: Any) -> Any: ...
    def nonzero(self, x: Any) -> Any: ...
    def searchsorted(self, a: Any, v: Any) -> Any: ...
    def repeat(self, x: Any, counts: Any, total: int) -> Any:
        """Each x[i] repeated counts[i] times (counts None: every element ``total`` times, interleaved)."""
    def cumsum(self, x: Any) -> Any: ...


class _TorchOps(Ops):
    name = "torch"

    def int64(self, x):
        return x.long()

    def cat(self, xs, axis):
        return torch.cat(xs, dim=axis)

    def arange(self, n, like):
        return torch.arange(n, device=like.device)

    def nonzero(self, x):
        return x.nonzero().squeeze(1)

    def searchsorted(self, a, v):
        return torch.searchsorted(a, v)

    def repeat(self, x, counts, total):
        if counts is None:
            return x.repeat_interleave(total)
        return torch.repeat_interleave(x, counts, output_size=total)

    def cumsum(self, x):
        return torch.cumsum(x, 0)


class _NumpyOps(Ops):
    name = "numpy"

    def int64(self, x):
        return x.astype(np.int64, copy=False)

    def cat(self, xs, axis):
        return np.concatenate(xs, axis=axis)

    def arange(self, n, like):
        return np.arange(n, dtype=np.int64)

    def nonzero(self, x):
        return np.flatnonzero(x)

    def searchsorted(self, a, v):
        return np.searchsorted(a, v)

    def repeat(self, x, counts, total):
        return np.repeat(x, total if counts is None else counts)

    def cumsum(self, x):
        return np.cumsum(x)


TORCH: Ops = _TorchOps()
NUMPY: Ops = _NumpyOps()
