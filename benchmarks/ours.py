"""trie_decode itself, as peers of the benchmark suites.

Why this exists: our implementation must be measured through exactly the same protocol as every peer, both the
core and the path users run:

    trie_decode            the core: ``TrieConstraint.advance`` + ``mask_`` (what the vLLM processors run per step)
    trie_decode-torch      the same core with the torch kernel forced (the CUDA/MPS code path, timed on this device)
    trie_decode-repeat     the core under the processor peers' rules (below), the reference of their overhead
    trie_decode-processor  the transformers ``TrieLogitsProcessor.__call__`` on a growing ``input_ids``, called the way
                           ``generate``'s greedy/sampling loop calls it
    trie_decode-processor-beam  the same, called the way beam search calls it (every row looks up its parent)

In the protocol a row starts a new name after EOS. The processor follows it in ``"repeat"`` mode with EOS as the
separator (a new entry starts at the root after it), which allows the same tokens at every step as the core's
restart; its end token is a token the walk never chooses.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from trie_decode.constraint import SpanRules, TrieConstraint
from trie_decode.trie import TokenTrie
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


class TrieDecodeTorchPeer(TrieDecodePeer):
    name = "trie_decode-torch"
    description = "trie_decode core with the torch kernel (the CUDA/MPS path), advance + mask_"

    def start(self, batch_size: int, device: Any) -> None:
        self._c = TrieConstraint(self._trie, SpanRules(end_token_id=self._eos), device, kernel="torch")
        self._state = self._c.start(batch_size)
        self._root = self._c.start(batch_size)


class TrieDecodeRepeatPeer(TrieDecodePeer):
    name = "trie_decode-repeat"
    description = "trie_decode core under the processor peers' rules (repeat mode, EOS as separator), advance + mask_"

    def start(self, batch_size: int, device: Any) -> None:
        never = 0 if self._eos != 0 else 1
        self._c = TrieConstraint(self._trie, SpanRules(never, on_complete="repeat", separator=(self._eos,)), device)
        self._state = self._c.start(batch_size)

    def step(self, logits: Any, tokens: Any | None) -> Any:
        if tokens is not None:
            self._state = self._c.advance(self._state, tokens)
        return self._c.mask_(logits, self._state)


def _sample(processors: Any, input_ids: Any, scores: Any) -> Any:
    """Calls the processors the way ``generate``'s greedy/sampling loop does (same function name and locals, so the
    processor takes the path it takes inside ``generate``: rows never move, masking in place)."""
    output_logits = False  # noqa: F841 - read by TrieLogitsProcessor from this frame, as in generate
    return_dict_in_generate = False  # noqa: F841
    return processors(input_ids, scores)


def _beam_search(processors: Any, input_ids: Any, scores: Any, running_beam_indices: Any = None) -> Any:
    """Calls the processors the way ``generate``'s beam search does: rows may move, and the loop's
    ``running_beam_indices`` names each row's parent (here every row continues itself, as in the protocol)."""
    return processors(input_ids, scores)


class TrieDecodeProcessorPeer(TrieDecodePeer):
    name = "trie_decode-processor"
    description = "transformers TrieLogitsProcessor.__call__ as generate's greedy/sampling loop calls it"
    MAX_STEPS = 4096
    loop = staticmethod(_sample)

    def start(self, batch_size: int, device: Any) -> None:
        from transformers import LogitsProcessorList

        from trie_decode.integrations.transformers import TrieLogitsProcessor

        never = 0 if self._eos != 0 else 1  # an end token the walk never picks (it ends names with EOS)
        proc = TrieLogitsProcessor(self._trie, end_token_id=never, on_complete="repeat", separator=[self._eos])
        self._procs = LogitsProcessorList([proc])
        self._ids = torch.zeros((batch_size, self.MAX_STEPS + 1), dtype=torch.long, device=device)
        self._len = 1
        self._view = self._ids[:, :1]

    def feed(self, tokens: Any | None) -> None:
        """Append the step's tokens to ``input_ids``: ``generate``'s own work between processor calls (the harness
        calls it outside the timed region)."""
        if tokens is not None:
            if self._len > self.MAX_STEPS:
                raise RuntimeError(f"the processor peer runs at most {self.MAX_STEPS} steps per start")
            self._ids[:, self._len] = tokens
            self._len += 1
        self._view = self._ids[:, : self._len]

    def step(self, logits: Any, tokens: Any | None) -> Any:
        return self.loop(self._procs, self._view, logits)


class TrieDecodeProcessorBeamPeer(TrieDecodeProcessorPeer):
    name = "trie_decode-processor-beam"
    description = "transformers TrieLogitsProcessor.__call__ as generate's beam search calls it (parents by beam index)"

    def start(self, batch_size: int, device: Any) -> None:
        super().start(batch_size, device)
        # generate's layout: (prompts, beams, max new tokens), the columns not written yet -1 (the processor checks
        # this layout at a generation's first beam step, and takes its general path on any other)
        self._parents = torch.full((1, batch_size, self.MAX_STEPS), -1, dtype=torch.int32, device=device)
        self._rows = torch.arange(batch_size, dtype=torch.int32, device=device)

    def feed(self, tokens: Any | None) -> None:
        """:meth:`TrieDecodeProcessorPeer.feed`, and the appended tokens' parents (every row continues itself), as
        beam search writes them between processor calls."""
        super().feed(tokens)
        if tokens is not None:
            self._parents[0, :, self._len - 2] = self._rows

    def loop(self, processors: Any, input_ids: Any, scores: Any) -> Any:
        return _beam_search(processors, input_ids, scores, self._parents)


class TrieDecodeBuildPeer(BuildPeer):
    name = "trie_decode"
    description = "trie_decode TokenTrie.from_sequences (vectorized CSR build)"

    def build(self, token_seqs: list[list[int]], vocab_size: int, eos_id: int) -> Any:
        return TokenTrie.from_sequences(token_seqs, vocab_size)


__all__ = [
    "TrieDecodePeer", "TrieDecodeRepeatPeer", "TrieDecodeTorchPeer", "TrieDecodeProcessorPeer", "TrieDecodeProcessorBeamPeer",
    "TrieDecodeBuildPeer",
]
