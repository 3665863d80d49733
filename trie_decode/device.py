"""``DeviceTrie``: a trie's arrays as tensors on the device where the logits live.

Why this exists: masking must run where the logits are (CUDA, MPS or CPU) without copying state to the host.
Per trie node the device keeps 17 bytes:

    child_ptr:   (N+1,) int32  children of node n are the node ids child_ptr[n]..child_ptr[n+1]-1
    child_token: (N,)   int32  token on the edge into each node (-1 for the root)
    edge_key:    (N,)   int64  parent * V + token of the edge into each node (-1 for the root); ascending, because
                               nodes are numbered breadth-first with siblings sorted by token
    terminal:    (N,)   bool   an entry ends at the node

``edge_key`` turns "the child of node n by token t" into one ``searchsorted`` for a whole batch (the vectorized
kernel; the C kernel searches the CSR children directly). Nodes with very
many children (the root of a big trie) also get a dense boolean row, so masking them is one row copy instead of a
scatter of tens of thousands of tokens (STATIC's dense first levels, chosen by fanout rather than by depth).

On a CPU device the same arrays are also exposed as zero-copy numpy views, for the numpy backend of the kernel
(see :mod:`trie_decode.kernels.arrays`). A :class:`StepTable` per set of span rules lives beside the arrays.

Dimension letters: R rows, N nodes, V the trie's vocabulary size, H dense nodes.
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np
import torch

from .kernels.arrays import NUMPY, Ops
from .spans import SpanRules, step_table
from .trie import TokenTrie

__all__ = ["DeviceTrie", "StepTable"]

# A dense row costs ~3 passes over V; a sparse row one gather and one scatter per child: past ~V/16 children
# the dense row is cheaper (see docs/performance.md).
DEFAULT_DENSE_MIN_FANOUT = None  # None: max(256, V // 16)
DEFAULT_DENSE_BUDGET_BYTES = 64 * 1024 * 1024

_CACHE: "weakref.WeakKeyDictionary[TokenTrie, dict]" = weakref.WeakKeyDictionary()


class DeviceTrie:
    """The tensors of one :class:`TokenTrie` on one device (build once, reuse: see :meth:`get`).

    Args:
        trie: the trie.
        device: where the tensors live (the logits' device).
        dense_min_fanout: nodes with at least this many children get a dense row (default max(256, V // 16)).
        dense_budget_bytes: cap on the dense rows' memory (V bytes each); the widest nodes are kept first.
    """

    def __init__(
        self,
        trie: TokenTrie,
        device: torch.device | str,
        *,
        dense_min_fanout: Optional[int] = DEFAULT_DENSE_MIN_FANOUT,
        dense_budget_bytes: int = DEFAULT_DENSE_BUDGET_BYTES,
    ) -> None:
        self.trie = trie
        self.device = torch.device(device)
        self.vocab_size = trie.vocab_size
        self.num_nodes = trie.num_nodes
        key = trie.parent.astype(np.int64) * np.int64(trie.vocab_size) + trie.token.astype(np.int64)
        key[0] = -1
        fanout = trie.fanout
        if dense_min_fanout is None:
            dense_min_fanout = max(256, trie.vocab_size // 16)
        max_rows = max(dense_budget_bytes // max(trie.vocab_size, 1), 0)
        wide = np.flatnonzero(fanout >= dense_min_fanout)
        if len(wide) > max_rows:
            wide = np.sort(wide[np.argsort(-fanout[wide], kind="stable")[:max_rows]])
        dense = np.zeros((len(wide), trie.vocab_size), dtype=np.bool_)
        for row, node in enumerate(wide):  # H is a handful of wide nodes; each row is one vectorized assignment
            lo, hi = trie.child_ptr[node], trie.child_ptr[node + 1]
            dense[row, trie.token[lo:hi]] = True
        dense_slot = np.full(trie.num_nodes, -1, dtype=np.int32)
        dense_slot[wide] = np.arange(len(wide), dtype=np.int32)

        host = {
            "child_ptr": np.array(trie.child_ptr, dtype=np.int32),
            "child_token": np.array(trie.token, dtype=np.int32),
            "edge_key": key,
            "terminal": trie.node_entry >= 0,
            "dense_slot": dense_slot,
            "dense_blocked": ~dense,  # stored inverted: the kernel masks with it as is
        }
        self.tensors = SimpleNamespace(**{k: torch.from_numpy(v).to(self.device) for k, v in host.items()})
        # Zero-copy numpy views for the numpy backend (CPU only).
        self.arrays = (
            SimpleNamespace(**{k: v.numpy() for k, v in vars(self.tensors).items()})
            if self.device.type == "cpu"
            else None
        )
        self.num_dense = len(wide)
        self._tables: dict[SpanRules, StepTable] = {}
        self._forced: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self.sparse_max_fanout = int(fanout[dense_slot < 0].max()) if (dense_slot < 0).any() else 0
        self.max_fanout = int(fanout.max()) if len(fanout) else 0
        self._parent: Optional[torch.Tensor] = None

    @classmethod
    def get(cls, trie: TokenTrie, device: torch.device | str) -> "DeviceTrie":
        """The cached ``DeviceTrie`` of ``trie`` on ``device`` (built on first use, freed with the trie)."""
        device = torch.device(device)
        per_trie = _CACHE.setdefault(trie, {})
        found = per_trie.get(str(device))
        if found is None:
            found = per_trie[str(device)] = cls(trie, device)
        return found

    def on(self, ops: Ops) -> Any:
        """The arrays for a backend: numpy views with the numpy backend, tensors otherwise."""
        return self.arrays if ops is NUMPY else self.tensors

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self.tensors).values())

    def table(self, rules: SpanRules) -> "StepTable":
        """The step table of ``rules`` over this trie on this device (built once per rules, kept with the trie)."""
        found = self._tables.get(rules)
        if found is None:
            found = self._tables[rules] = StepTable(self, rules)
        return found

    @property
    def parent_tensor(self) -> torch.Tensor:
        """The parent of every node (-1 at the root) on this device. Shape: (N,), int64. Built on first use."""
        if self._parent is None:
            self._parent = torch.from_numpy(self.trie.parent.astype(np.int64)).to(self.device)
        return self._parent

    def forced_runs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The trie's forced runs on this device (:meth:`TokenTrie.forced_runs`): per node the run length,
        Shape: (N,), int64, and whether the run completes the entry, Shape: (N,), bool. Built on first use."""
        if self._forced is None:
            runs = self.trie.forced_runs()
            self._forced = (
                torch.from_numpy(runs.length.astype(np.int64)).to(self.device),
                torch.from_numpy(runs.ends_entry.copy()).to(self.device),
            )
        return self._forced

    def __repr__(self) -> str:
        return (
            f"DeviceTrie(nodes={self.num_nodes}, device={self.device}, dense_nodes={self.num_dense}, "
            f"sparse_max_fanout={self.sparse_max_fanout})"
        )


class StepTable:
    """The step table of one (trie, rules) pair on one device (:func:`trie_decode.spans.step_table`).

    Attributes:
        tensor: the table on the device. Shape: (N + K, 6), int32.
        array: a zero-copy numpy view of it on CPU, else None.
        dtrie, rules: what it was built from.
        num_codes: K.
        kernel_cache: per-kernel data derived from the table (e.g. the C kernel's static arguments).
    """

    def __init__(self, dtrie: DeviceTrie, rules: SpanRules) -> None:
        host = step_table(dtrie.trie, rules, dtrie.tensors.dense_slot.cpu().numpy())
        self.dtrie, self.rules = dtrie, rules
        self.num_codes = rules.num_codes
        self.tensor = torch.from_numpy(host).to(dtrie.device)
        self.array = self.tensor.numpy() if dtrie.device.type == "cpu" else None
        self.kernel_cache: dict[str, Any] = {}

    def on(self, ops: Ops) -> Any:
        return self.array if ops is NUMPY else self.tensor
