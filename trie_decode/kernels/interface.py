"""What every kernel declares about itself, and the defaults: one base class for the per-step kernels.

Why this exists: :func:`trie_decode.kernels.select` and the constraint ask a kernel what it can do (see
:mod:`trie_decode.kernels` for what each capability means), never its name. The capabilities and their defaults are
declared here once; each kernel states only where it differs.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from ..errors import ConstraintConfigError

__all__ = ["Kernel", "LOGITS_DTYPES", "check_state_rows", "check_logits", "check_rows", "check_row_range",
           "is_index_tensor", "described"]


#: The logits dtypes every kernel masks: float8 dtypes are floating point too, but torch has no gather or scatter
#: for them on the CPU, and float8_e4m3fn has no -inf to mask with.
LOGITS_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def check_logits(logits: Any) -> None:
    """The logits every kernel takes, checked once before dispatch (``TrieConstraint.mask_``): a (B, V) tensor of a
    dtype in :data:`LOGITS_DTYPES` that masking may write outside autograd (the C kernel writes its memory, so no
    kernel records the mask in a graph). Attributes only: no host read.

    Raises:
        TypeError: ``logits`` is not a tensor.
        ConstraintConfigError: not two dimensions, not one of those dtypes, or a tensor that requires grad while grad
            mode is on.
    """
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor of Shape (B, V), got {type(logits).__name__}")
    if len(logits.shape) != 2:
        raise ConstraintConfigError(f"logits must be Shape (B, V), one row per sequence, got {tuple(logits.shape)} "
                                    "(for (B, L, V) model outputs pass the last position, logits[:, -1, :])")
    if logits.dtype not in LOGITS_DTYPES:
        raise ConstraintConfigError(f"logits must be a floating-point tensor of float16, bfloat16, float32 or float64 "
                                    f"(-inf marks a masked token), got {logits.dtype}")
    if logits.requires_grad and torch.is_grad_enabled():
        raise ConstraintConfigError("logits require grad: the mask is written outside autograd and would not be "
                                    "differentiable; pass logits.detach(), or mask under torch.no_grad()")


def is_index_tensor(x: Any, shape: tuple) -> bool:
    """Whether ``x`` is a tensor of ``shape`` with an integer dtype (bool is none): a row map, the rows' tries.
    Attributes only: no host read."""
    if not isinstance(x, torch.Tensor) or x.shape != shape:
        return False
    dtype = x.dtype  # each tensor attribute read is a call into torch: read once, int64 (the usual one) first
    return dtype is torch.int64 or not (dtype.is_floating_point or dtype.is_complex or dtype is torch.bool)


def described(x: Any) -> str:
    """How an error names an argument it refuses: a tensor's shape and dtype, else its type."""
    return f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__


def check_rows(rows: Any, num_states: int, batch: int, device: torch.device, host_range: bool) -> torch.Tensor:
    """The row map of ``TrieConstraint.mask_`` (logits row of each state row), checked once before dispatch and
    returned as int64 on the logits' device. Its shape and dtype are always checked; its range, and that no logits
    row is given to two state rows, only where that reads no device: a CPU tensor, for a kernel that reads its step
    on the host anyway (``host_range``: the kernel's ``reads_host``); the C kernel checks both itself. The torch
    kernel's step reads nothing on the host wherever it runs (no GPU synchronization): there the kernel's indexing is
    the range check, and a repeated row is not looked for.

    Args:
        rows: Shape: (R,), an integer tensor. num_states: R. batch: B, the logits rows.
    Raises:
        ConstraintConfigError: not an (R,) integer tensor; a CPU row map that gives one logits row to two state
            rows. IndexError: a CPU row outside ``[0, B)`` (the C kernel's own message, ``_kernel.c``).
    """
    if not is_index_tensor(rows, (num_states,)):
        raise ConstraintConfigError(f"rows must hold one integer logits row per state row: ({num_states},), got "
                                    f"{described(rows)}")
    if host_range and num_states and rows.is_cpu:
        check_row_range(rows, batch)
    if rows.device != device or rows.dtype is not torch.int64:
        rows = rows.to(device, torch.int64)
    return rows


def check_state_rows(num_states: int, batch: int) -> None:
    """Without a row map, state row i masks logits row i: IndexError unless there are at most as many state rows
    as logits rows (the C kernel's own check, ``_kernel.c``, with its message). Sizes only: no host read."""
    if num_states > batch:
        raise IndexError(f"{num_states} states for a batch of {batch} logits rows")


def check_row_range(rows: torch.Tensor, batch: int) -> None:
    """IndexError naming the first of ``rows`` outside ``[0, batch)`` (the C kernel's message, ``_kernel.c``), or one
    given to two state rows (the kernels would disagree on what that row keeps). Reads the rows on the host: before
    dispatch only for CPU rows (:func:`check_rows`), else on an error path."""
    if not rows.numel():
        return
    host = rows.numpy() if rows.is_cpu else rows.cpu().numpy()
    order = np.sort(host)  # one sort: the range from its ends, a repeat from neighbours
    if order[0] < 0 or order[-1] >= batch:
        bad = int(host[(host < 0) | (host >= batch)][0])
        raise IndexError(f"logits row {bad} is outside the batch of {batch} rows")
    same = order[1:] == order[:-1]
    if same.any():
        twice = int(order[1:][same][0])
        raise ConstraintConfigError(f"rows gives logits row {twice} to state rows "
                                    f"{np.flatnonzero(host == twice)[:2].tolist()}: each state row masks a row of "
                                    "its own")


class Kernel:
    """The capabilities of a kernel, as class attributes, and the methods that answer from them. The defaults: a
    kernel that runs on any device, is always built, is chosen wherever it runs, needs a copy of the logits for
    out-of-place masking, and has neither its own filter pass nor a fused step."""

    name = "abstract"
    #: The device types it runs on (None: any).
    device_kinds: Optional[frozenset] = None
    writes_every_row = False
    #: Its step reads the rows on the host anyway (a CPU kernel): a CPU row map's range is checked before dispatch
    #: (:func:`check_rows`). False for a kernel whose step must never read on the host (no GPU synchronization).
    reads_host = False
    supports_filters = False
    supports_fused_step = False

    def runs_on(self, device: torch.device) -> bool:
        return self.device_kinds is None or device.type in self.device_kinds

    def available(self) -> bool:
        return True

    def default_on(self, device: torch.device) -> bool:
        return self.runs_on(device)

    def takes_filters(self, out: torch.Tensor, src: torch.Tensor) -> bool:
        """Whether static filter bits are applied in this kernel's own pass over these logits."""
        return False

    def fused_step(self, table: Any, nodes: torch.Tensor, needed_width: int, node_flags: Any = None) -> Any:
        raise NotImplementedError(f"the {self.name} kernel has no fused step")
