"""Running a per-trie kernel over a batch whose rows use several tries: one call per distinct trie in the batch.

Why this exists: the native (C) and numpy kernels read one trie's step table per call. A batch may mix tries (one
per prompt in transformers, one per request in vLLM); this base class splits the rows by trie and calls the kernel
once per trie present, in one place for both kernels. Finding the tries present reads the row-to-trie map on the
host, which is free on a CPU. The torch kernel for CUDA and MPS (:mod:`.fixed`) merges the tries' tables instead,
so that its step has no host read.

Dimension letters: R state rows, B logits rows, T tries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np
import torch

from ..spans import DONE
from .interface import Kernel, check_state_rows

if TYPE_CHECKING:
    from ..filters import NodeFlags

__all__ = ["GroupedKernel", "row_groups"]


def row_groups(tree: torch.Tensor, num_tries: int) -> list[tuple[int, Optional[torch.Tensor]]]:
    """(trie index, row positions, or None when every row uses that trie) for every trie that has rows.

    Args:
        tree: each row's trie index. Shape: (R,), int64.
    """
    if num_tries == 1:
        return [(0, None)]
    if tree.is_cpu:  # one sort on the host (many tries present, e.g. 100 spans, cost one pass, not one each)
        t = tree.numpy()
        if not len(t) or (t == t[0]).all():
            return [(int(t[0]) if len(t) else 0, None)]
        order = np.argsort(t, kind="stable")
        ts = t[order]
        cuts = (np.flatnonzero(ts[1:] != ts[:-1]) + 1).tolist()
        return [(int(ts[a]), torch.from_numpy(order[a:b])) for a, b in zip([0] + cuts, cuts + [len(t)])]
    present = torch.unique(tree).tolist()
    return [(i, (tree == i).nonzero().squeeze(1)) for i in present]


class GroupedKernel(Kernel):
    """A kernel that works one step table at a time; subclasses define :meth:`advance` and :meth:`mask` for one
    table, this class runs them over the tries of a batch. The capabilities are declared as in every kernel (see
    :class:`~.interface.Kernel`); by default these kernels run on the CPU only."""

    device_kinds: Optional[frozenset] = frozenset({"cpu"})
    reads_host = True  # the rows are grouped by trie on the host

    def advance(self, table: Any, node: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def mask(self, out: torch.Tensor, src: torch.Tensor, node: torch.Tensor, rows: Optional[torch.Tensor], table: Any) -> None:
        raise NotImplementedError

    def prepare(self, tables: Sequence[Any]) -> Sequence[Any]:
        """Per-constraint data: the step tables themselves."""
        return tables

    def advance_rows(self, tables: Sequence[Any], node: torch.Tensor, tree: torch.Tensor, tokens: torch.Tensor,
                     filter_bits: Optional["NodeFlags"] = None) -> torch.Tensor:
        """Each row's next state code (before the trigger check). Shape: (R,), int64. With ``filter_bits`` (a
        kernel that ``supports_filters``, one trie), over the trie each row's filter leaves it."""
        if filter_bits is not None:
            self._check_filters(tables)
            return self.advance(tables[0], node, tokens, filter_bits)
        groups = row_groups(tree, len(tables))
        if groups[0][1] is None:  # every row in one trie
            return self.advance(tables[groups[0][0]], node, tokens)
        new = torch.full_like(node, DONE)
        for i, rows in groups:
            new[rows] = self.advance(tables[i], node[rows], tokens[rows])
        return new

    def mask_rows(
        self, tables: Sequence[Any], out: torch.Tensor, src: torch.Tensor, node: torch.Tensor, tree: torch.Tensor,
        rows: Optional[torch.Tensor], filter_bits: Optional["NodeFlags"] = None,
    ) -> None:
        """Mask logits rows ``rows`` (default: row i for state row i) of ``src`` into ``out``, every trie's rows.
        With ``filter_bits`` (see :meth:`takes_filters`), the rows' static filters in the same pass."""
        if rows is None:
            check_state_rows(node.shape[0], src.shape[0])
        if filter_bits is not None:
            self._check_filters(tables)
            self.mask(out, src, node, rows, tables[0], filter_bits)
            return
        for i, pos in row_groups(tree, len(tables)):
            nodes = node if pos is None else node[pos]
            lrows = rows if pos is None else (pos if rows is None else rows[pos])
            self.mask(out, src, nodes, lrows, tables[i])

    def _check_filters(self, tables: Sequence[Any]) -> None:
        if not self.supports_filters or len(tables) != 1:
            raise ValueError(f"the {self.name} kernel does not apply filter bits (over {len(tables)} tries)")
