"""What every kernel declares about itself, and the defaults: one base class for the per-step kernels.

Why this exists: :func:`trie_decode.kernels.select` and the constraint ask a kernel what it can do (see
:mod:`trie_decode.kernels` for what each capability means), never its name. The capabilities and their defaults are
declared here once; each kernel states only where it differs.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["Kernel", "check_state_rows"]


def check_state_rows(num_states: int, batch: int) -> None:
    """Without a row map, state row i masks logits row i: IndexError unless there are at most as many state rows
    as logits rows (the C kernel's own check, ``_kernel.c``, with its message). Sizes only: no host read."""
    if num_states > batch:
        raise IndexError(f"{num_states} states for a batch of {batch} logits rows")


class Kernel:
    """The capabilities of a kernel, as class attributes, and the methods that answer from them. The defaults: a
    kernel that runs on any device, is always built, is chosen wherever it runs, needs a copy of the logits for
    out-of-place masking, and has neither its own filter pass nor a fused step."""

    name = "abstract"
    #: The device types it runs on (None: any).
    device_kinds: Optional[frozenset] = None
    writes_every_row = False
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
