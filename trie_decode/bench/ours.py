"""trie_decode itself, as peers of the benchmark suites.

Why this exists: our implementation must be measured through exactly the same protocol as every peer. The step
peer is the core (``TrieConstraint``: advance + mask), which is what the vLLM processors run per step and what the
transformers ``TrieLogitsProcessor`` runs after its row-lineage hash. The processor itself cannot follow this
protocol (rows restart one by one, which never happens inside ``generate``); it is measured inside real
``generate`` calls by the ``generate`` suite.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..constraint import SpanRules, TrieConstraint
from ..trie import TokenTrie
from .peers import BuildPeer, StepPeer


class TrieDecodePeer(StepPeer):
    name = "trie_decode"
    description = "trie_decode core: TrieConstraint.advance + mask_ (CSR trie, step table, gather/fill/scatter)"

    def setup(self, names: Sequence[str], tokenizer: Any) -> None:
        self._trie = TokenTrie.from_strings(list(names), tokenizer)
        self._eos = int(tokenizer.eos_token_id)
        self.info["nodes"] = self._trie.num_nodes
        self.info["bytes_per_node"] = round(self._trie.nbytes / self._trie.num_nodes, 2)

    def start(self, batch_size: int, device: Any) -> None:
        self._c = TrieConstraint(self._trie, SpanRules(end_token_id=self._eos), device)
        self._state = self._c.start(batch_size)
        self._root = self._c.start(batch_size)

    def step(self, logits: Any, tokens: Any | None) -> Any:
        if tokens is not None:
            state = self._c.advance(self._state, tokens)
            restart = tokens == self._eos  # a new request takes the row
            state.node = torch.where(restart, self._root.node, state.node)
            self._state = state
        return self._c.mask_(logits, self._state)


class TrieDecodeBuildPeer(BuildPeer):
    name = "trie_decode"
    description = "trie_decode TokenTrie.from_sequences (vectorized CSR build)"

    def build(self, token_seqs: list[list[int]], vocab_size: int, eos_id: int) -> Any:
        return TokenTrie.from_sequences(token_seqs, vocab_size)


__all__ = ["TrieDecodePeer", "TrieDecodeBuildPeer"]
