"""``DeviceTrie``: a trie's arrays as tensors on the device where the logits live.

Why this exists: masking must run where the logits are (CUDA, MPS or CPU) without copying state to the host.
Per trie node the device keeps up to 21 bytes:

    child_ptr:   (N+1,) int32  children of node n are the node ids child_ptr[n]..child_ptr[n+1]-1
    child_token: (N,)   int32  token on the edge into each node (-1 for the root)
    edge_key:    (N,)   int64  parent * V + token of the edge into each node (-1 for the root); ascending, because
                               nodes are numbered breadth-first with siblings sorted by token
    terminal:    (N,)   bool   an entry ends at the node
    dense_slot:  (N,)   int32  each node's dense row, -1 for none

On a CPU device ``child_ptr`` and ``child_token`` are the trie's own arrays, not copies: for a trie loaded from a
file, views of the memory-mapped file, whose pages every process that maps it shares (a tensor-parallel engine's
workers, its frontend). They are read-only (the kernels read them through ``const`` pointers; the numpy views keep
``writeable=False``). The derived arrays (``edge_key``, ``terminal``, ``dense_slot``) are built on first use: the C
kernel needs none of them (it searches the CSR children and reads the step table), so a CPU engine never pays for
them; the vectorized kernels and the ``distinct`` filters build what they read.

``edge_key`` turns "the child of node n by token t" into one ``searchsorted`` for a whole batch (the vectorized
kernel; the C kernel searches the CSR children directly). Nodes with very
many children (the root of a big trie) also get a dense boolean row, so masking them is one row copy instead of a
scatter of tens of thousands of tokens (STATIC's dense first levels, chosen by fanout rather than by depth).

On a CPU device the same arrays are also exposed as zero-copy numpy views, for the numpy backend of the kernel
(see :mod:`trie_decode.kernels.arrays`). A :class:`StepTable` per set of span rules lives beside the arrays.

Dimension letters: R rows, N nodes, V the trie's vocabulary size, H dense nodes.
"""

from __future__ import annotations

import copy

import warnings
from types import SimpleNamespace
from typing import Any, Callable, Optional

import numpy as np
import torch

from .errors import ConstraintConfigError
from .kernels.arrays import NUMPY, Ops
from .spans import SpanRules, step_table
from .trie import TokenTrie

__all__ = ["DeviceTrie", "StepTable"]

# A dense row costs ~3 passes over V; a sparse row one gather and one scatter per child: past ~V/16 children
# the dense row is cheaper (see docs/performance.md).
DEFAULT_DENSE_MIN_FANOUT = None  # None: max(256, V // 16)
DEFAULT_DENSE_BUDGET_BYTES = 64 * 1024 * 1024


def default_dense_min_fanout(vocab_size: int) -> int:
    """The default fanout from which a node gets a dense row: max(256, V // 16)."""
    return max(256, vocab_size // 16)


_DERIVED = ("edge_key", "terminal", "dense_slot")


class _Arrays(SimpleNamespace):
    """A namespace of arrays whose derived members (``_DERIVED``) are built on first access by ``build(name)``."""

    def __init__(self, build: Callable[[str], None], **arrays: Any) -> None:
        super().__init__(**arrays)
        object.__setattr__(self, "_build", build)

    def __getattr__(self, name: str) -> Any:  # only reached when the attribute is not set yet
        if name in _DERIVED:
            self._build(name)
            return self.__dict__[name]
        raise AttributeError(name)

    def items(self) -> list[tuple[str, Any]]:
        """The arrays built so far."""
        return [(k, v) for k, v in vars(self).items() if not k.startswith("_")]


def _shared_tensor(array: np.ndarray, dtype: np.dtype) -> torch.Tensor:
    """A CPU tensor over ``array``'s memory when its dtype and layout allow (no copy: a memory-mapped file's pages
    stay shared between processes), else over a copy. The tensor may be read-only memory: never write to it."""
    if array.dtype == dtype and array.flags.c_contiguous and array.flags.aligned:
        with warnings.catch_warnings():  # torch warns that it cannot mark the tensor read-only
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.from_numpy(array)
    return torch.from_numpy(np.array(array, dtype=dtype, order="C"))  # a writable copy


class DeviceTrie:
    """The tensors of one :class:`TokenTrie` on one device (build once, reuse: see :meth:`get`).

    Args:
        trie: the trie.
        device: where the tensors live (the logits' device).
        dense_min_fanout: nodes with at least this many children get a dense row (default max(256, V // 16)); an
            int >= 1, else ConstraintConfigError.
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
        if dense_min_fanout is not None and (isinstance(dense_min_fanout, bool)
                                             or not isinstance(dense_min_fanout, (int, np.integer)) or dense_min_fanout < 1):
            # a string failed inside numpy's comparison; a float, a bool or a fanout below 1 was taken as it was
            raise ConstraintConfigError(f"dense_min_fanout must be a number of children, an int >= 1 (or None for "
                                        f"the default), got {dense_min_fanout!r:.40}")
        self.trie = trie
        self.device = torch.device(device)
        self.vocab_size = trie.vocab_size
        self.num_nodes = trie.num_nodes
        fanout = trie.fanout
        if dense_min_fanout is None:
            dense_min_fanout = default_dense_min_fanout(trie.vocab_size)
        max_rows = max(dense_budget_bytes // max(trie.vocab_size, 1), 0)
        wide = np.flatnonzero(fanout >= dense_min_fanout)
        if len(wide) > max_rows:
            wide = np.sort(wide[np.argsort(-fanout[wide], kind="stable")[:max_rows]])
        dense = np.zeros((len(wide), trie.vocab_size), dtype=np.bool_)
        for row, node in enumerate(wide):  # H is a handful of wide nodes; each row is one vectorized assignment
            lo, hi = trie.child_ptr[node], trie.child_ptr[node + 1]
            dense[row, trie.token[lo:hi]] = True
        self._wide = wide

        cpu = self.device.type == "cpu"
        ptr, tok = np.asarray(trie.child_ptr), np.asarray(trie.token)
        int32 = np.dtype(np.int32)
        eager = {"child_ptr": _shared_tensor(ptr, int32), "child_token": _shared_tensor(tok, int32),
                 "dense_blocked": torch.from_numpy(~dense)}  # dense rows stored inverted: the kernel masks with them
        self.tensors = _Arrays(self._build, **{k: v.to(self.device) for k, v in eager.items()})
        # Numpy views for the numpy backend (CPU only): the trie's own read-only arrays where the tensors share them.
        self.arrays = None
        if cpu:
            views = {k: v.numpy() for k, v in eager.items()}
            for name, array in (("child_ptr", ptr), ("child_token", tok)):
                if eager[name].data_ptr() == array.ctypes.data:
                    views[name] = array
            self.arrays = _Arrays(self._build, **views)
        self.num_dense = len(wide)
        self._tables: dict[Any, StepTable] = {}  # rules, or (rules, span) with text spans
        self._forced: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        sparse = np.ones(len(fanout), dtype=np.bool_)
        sparse[wide] = False
        self.sparse_max_fanout = int(fanout[sparse].max()) if sparse.any() else 0
        self.max_fanout = int(fanout.max()) if len(fanout) else 0
        self._parent: Optional[torch.Tensor] = None

    def with_extra_row(self, blocked: np.ndarray) -> "DeviceTrie":
        """This trie's tensors with one more dense row (``blocked``: True where a column is blocked, Shape: (V',),
        bool, cut or padded to V), as a new object sharing every other array; the new row's slot is the last."""
        for name in _DERIVED:  # built now, on this object's namespaces, so that the copies share them
            getattr(self.tensors, name)
            if self.arrays is not None:
                getattr(self.arrays, name)
        row = np.ones(self.vocab_size, dtype=np.bool_)
        n = min(len(blocked), self.vocab_size)
        row[:n] = blocked[:n]
        other = copy.copy(self)
        extra = torch.from_numpy(row[None, :]).to(self.device)
        blocked_rows = torch.cat([self.tensors.dense_blocked, extra])
        other.tensors = _Arrays(self._build, **{**dict(self.tensors.items()), "dense_blocked": blocked_rows})
        if self.arrays is not None:
            other.arrays = _Arrays(self._build, **{**dict(self.arrays.items()), "dense_blocked": blocked_rows.numpy()})
        other.num_dense = self.num_dense + 1
        other._tables = {}
        return other

    def dense_slots(self) -> np.ndarray:
        """Each node's dense row, -1 for none (a fresh array). Shape: (N,), int32."""
        slot = np.full(self.num_nodes, -1, dtype=np.int32)
        slot[self._wide] = np.arange(len(self._wide), dtype=np.int32)
        return slot

    def _build(self, name: str) -> None:
        """Build a derived array (see the module docstring) into ``tensors`` (and ``arrays`` on CPU)."""
        trie = self.trie
        if name == "edge_key":
            host = trie.parent.astype(np.int64) * np.int64(trie.vocab_size) + trie.token.astype(np.int64)
            host[0] = -1
        elif name == "terminal":
            host = trie.node_entry >= 0
        else:
            host = self.dense_slots()
        tensor = torch.from_numpy(host).to(self.device)
        setattr(self.tensors, name, tensor)
        if self.arrays is not None:
            setattr(self.arrays, name, tensor.numpy())

    @classmethod
    def get(cls, trie: TokenTrie, device: torch.device | str) -> "DeviceTrie":
        """The cached ``DeviceTrie`` of ``trie`` on ``device`` (built on first use, freed with the trie)."""
        device = torch.device(device)
        return trie.derived(("DeviceTrie", str(device)), lambda: cls(trie, device))

    def on(self, ops: Ops) -> Any:
        """The arrays for a backend: numpy views with the numpy backend, tensors otherwise."""
        return self.arrays if ops is NUMPY else self.tensors

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors built so far, those shared with the trie's own arrays included."""
        return sum(t.numel() * t.element_size() for _, t in self.tensors.items())

    def table(self, rules: SpanRules, span: int = 0) -> "StepTable":
        """The step table of ``rules`` over this trie on this device (built once per rules, kept with the trie);
        with text spans, as the trie of span number ``span`` (its end tokens)."""
        key = (rules, span) if rules.fields is not None else rules
        found = self._tables.get(key)
        if found is None:
            found = self._tables[key] = StepTable(self, rules, span)
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
        tensor: the table on the device. Shape: (N + K, TABLE_COLUMNS), int32 (36 bytes per node).
        array: a zero-copy numpy view of it on CPU, else None.
        dtrie, rules: what it was built from.
        num_codes: K.
        kernel_cache: per-kernel data derived from the table (e.g. the C kernel's packed trie fields).
    """

    def __init__(self, dtrie: DeviceTrie, rules: SpanRules, span: int = 0) -> None:
        end_slot = -1
        if rules.fields is not None:
            # Text spans: the trie's dense rows plus one, a complete leaf entry's end tokens (this span's).
            dtrie = dtrie.with_extra_row(rules.fields.end_rows[span])
            end_slot = dtrie.num_dense - 1
        host = step_table(dtrie.trie, rules, dtrie.dense_slots(), end_slot, span)
        self.dtrie, self.rules = dtrie, rules
        self.num_codes = rules.num_codes
        self.tensor = torch.from_numpy(host).to(dtrie.device)
        self.array = self.tensor.numpy() if dtrie.device.type == "cpu" else None
        self.kernel_cache: dict[str, Any] = {}

    def on(self, ops: Ops) -> Any:
        return self.array if ops is NUMPY else self.tensor
