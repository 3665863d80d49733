"""``DeviceTrie``: a trie's arrays as torch tensors on the device where the logits live.

Why this exists: masking must run where the logits are (CUDA, MPS or CPU) without copying state back to the host.
Three tensors per trie are enough, 13 bytes per node:

    child_ptr: (N+1,) int32  children of node n are the node ids child_ptr[n]..child_ptr[n+1]-1
    edge_key:  (N,)   int64  parent * V + token for the edge into each node (-1 for the root); sorted ascending
                             because nodes are numbered breadth-first with siblings sorted by token
    terminal:  (N,)   bool   an entry ends at the node

``edge_key`` turns "child of node n by token t" into one ``torch.searchsorted`` for a whole batch, and the child
tokens of n are ``edge_key[child_ptr[n]:child_ptr[n+1]] - n * V``. Nodes with very many children (the root of a
big trie) also get a precomputed dense boolean row, so masking them costs one row copy instead of a scatter of
tens of thousands of tokens (STATIC's dense first levels, chosen by fanout instead of by depth).

Dimension letters: R rows being masked, N nodes, V the trie's vocabulary size, H dense nodes.
"""

from __future__ import annotations

import weakref
import numpy as np
import torch

from .trie import TokenTrie

__all__ = ["DeviceTrie"]

DEFAULT_DENSE_MIN_FANOUT = 1024
DEFAULT_DENSE_BUDGET_BYTES = 64 * 1024 * 1024

_CACHE: "weakref.WeakKeyDictionary[TokenTrie, dict]" = weakref.WeakKeyDictionary()


class DeviceTrie:
    """The tensors of one :class:`TokenTrie` on one device (build once, reuse: see :meth:`get`).

    Args:
        trie: the trie.
        device: where the tensors live (the logits' device).
        dense_min_fanout: nodes with at least this many children get a dense mask row.
        dense_budget_bytes: cap on the dense rows' memory (V bytes each); the widest nodes are kept first.
    """

    def __init__(
        self,
        trie: TokenTrie,
        device: torch.device | str,
        *,
        dense_min_fanout: int = DEFAULT_DENSE_MIN_FANOUT,
        dense_budget_bytes: int = DEFAULT_DENSE_BUDGET_BYTES,
    ) -> None:
        self.trie = trie
        self.device = torch.device(device)
        self.vocab_size = trie.vocab_size
        self.num_nodes = trie.num_nodes
        v = np.int64(trie.vocab_size)
        key = trie.parent.astype(np.int64) * v + trie.token.astype(np.int64)
        key[0] = -1
        self.child_ptr = torch.from_numpy(np.array(trie.child_ptr, dtype=np.int32)).to(self.device)
        self.edge_key = torch.from_numpy(key).to(self.device)
        self.terminal = torch.from_numpy(trie.node_entry >= 0).to(self.device)

        fanout = trie.fanout
        max_rows = max(dense_budget_bytes // max(trie.vocab_size, 1), 0)
        wide = np.flatnonzero(fanout >= dense_min_fanout)
        if len(wide) > max_rows:
            wide = np.sort(wide[np.argsort(-fanout[wide], kind="stable")[:max_rows]])
        self.dense_nodes = torch.from_numpy(wide.astype(np.int64)).to(self.device)  # (H,) sorted
        dense = np.zeros((len(wide), trie.vocab_size), dtype=np.bool_)
        for row, node in enumerate(wide):  # H is tiny (a few wide nodes); each row is one vectorized assignment
            lo, hi = trie.child_ptr[node], trie.child_ptr[node + 1]
            dense[row, trie.token[lo:hi]] = True
        self.dense_mask = torch.from_numpy(dense).to(self.device)  # (H, V)
        is_dense = np.zeros(trie.num_nodes, dtype=np.bool_)
        is_dense[wide] = True
        # Widest child list that is served by the sparse path (sets the padded width of the gather).
        self.sparse_max_fanout = int(fanout[~is_dense].max()) if (~is_dense).any() else 0

    @classmethod
    def get(cls, trie: TokenTrie, device: torch.device | str) -> "DeviceTrie":
        """The cached ``DeviceTrie`` of ``trie`` on ``device`` (built on first use, freed with the trie)."""
        device = torch.device(device)
        per_trie = _CACHE.setdefault(trie, {})
        key = str(device)
        found = per_trie.get(key)
        if found is None:
            found = per_trie[key] = cls(trie, device)
        return found

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.child_ptr, self.edge_key, self.terminal, self.dense_mask))

    def step(self, nodes: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Child of each node by each token, -1 where there is none (or where ``nodes`` < 0).

        Args:
            nodes: Shape: (R,), int64. tokens: Shape: (R,), int64.
        Returns:
            Shape: (R,), int64.
        """
        key = nodes.clamp(min=0) * self.vocab_size + tokens
        pos = torch.searchsorted(self.edge_key, key)
        pos_c = pos.clamp(max=self.num_nodes - 1)
        ok = (nodes >= 0) & (tokens >= 0) & (tokens < self.vocab_size) & (self.edge_key[pos_c] == key)
        return torch.where(ok, pos_c, torch.full_like(pos_c, -1))

    def is_terminal(self, nodes: torch.Tensor) -> torch.Tensor:
        """Whether an entry ends at each node (False for negative nodes). Shape: (R,), bool."""
        return self.terminal[nodes.clamp(min=0)] & (nodes >= 0)

    def fanout(self, nodes: torch.Tensor) -> torch.Tensor:
        """Number of children of each node (0 for negative nodes). Shape: (R,), int64."""
        n = nodes.clamp(min=0)
        count = (self.child_ptr[n + 1] - self.child_ptr[n]).long()
        return torch.where(nodes >= 0, count, torch.zeros_like(count))

    def dense_slot(self, nodes: torch.Tensor) -> torch.Tensor:
        """Row of ``dense_mask`` for each node, -1 for nodes served by the sparse path. Shape: (R,), int64."""
        if self.dense_nodes.numel() == 0:
            return torch.full_like(nodes, -1)
        slot = torch.searchsorted(self.dense_nodes, nodes)
        slot_c = slot.clamp(max=self.dense_nodes.numel() - 1)
        return torch.where((nodes >= 0) & (self.dense_nodes[slot_c] == nodes), slot_c, torch.full_like(slot_c, -1))

    def child_tokens(self, nodes: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``width`` child tokens of each node, padded.

        Returns:
            (tokens, valid): Shape: (R, width) int64 and bool; ``tokens`` is 0 where ``valid`` is False.
        """
        n = nodes.clamp(min=0)
        start = self.child_ptr[n].long()
        count = self.fanout(nodes)
        j = torch.arange(width, device=nodes.device)
        valid = j.unsqueeze(0) < count.unsqueeze(1)
        idx = (start.unsqueeze(1) + j.unsqueeze(0)).clamp(max=self.num_nodes - 1)
        tokens = self.edge_key[idx] - n.unsqueeze(1) * self.vocab_size
        return torch.where(valid, tokens, torch.zeros_like(tokens)), valid

    def __repr__(self) -> str:
        return (
            f"DeviceTrie(nodes={self.num_nodes}, device={self.device}, dense_nodes={self.dense_nodes.numel()}, "
            f"sparse_max_fanout={self.sparse_max_fanout})"
        )
