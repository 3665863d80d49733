"""Catalog-valued fields inside free text: several spans per request, each with its own trie, matched on text.

Why this exists: users rarely want a bare name as the whole answer. They want a JSON object whose ``city`` is one of
133k places and whose ``country`` is one of 249 countries. A :class:`Span` says where a field's value starts (the text
``after`` it), the trie of its values, and the text that ends a value (``end``). :class:`FieldRules` is what the one
step engine reads for a set of spans (``SpanRules(..., fields=...)``), all of it data:

- outside a value every row is FREE (its logits untouched) and carries a text-automaton state
  (:class:`~trie_decode.text_spans.TokenTriggers`, one automaton for every span's ``after``): one gather per row and
  step, whatever the number of spans;
- when a span's ``after`` completes, the row enters that span's trie (``RowState.tree`` is the span's index) at its
  root, or, when the token that completed ``after`` carries the value's first bytes (``' "\\''`` in byte-level BPE),
  at the root child those bytes spell;
- inside a value only the trie's children are allowed; where an entry is complete, the tokens whose text begins
  with ``end`` are allowed too (``"``, ``",``, ``"}``, ``"\\n``: one shared dense row of the step table). ``end``
  is never allowed inside an incomplete entry, so a value cannot end early;
- a token beginning with ``end`` closes the value: the row is FREE again and its automaton restarts from that
  token's text, so a later span (or the same one: a list of tool calls) can start again.

Values are tokenized in the context of their ``after`` text (:func:`~trie_decode.tokenizers.tokenize_in_context`),
so the first token is the one the model writes there; with ``escape="json"`` they are written JSON-escaped.

Limits of this version (documented, checked where they can be): every span of a request shares one ``end``; a
complete entry that is also a prefix of a longer one allows only the bare ``end`` token (not ``",``) beside its
children; an entry ending in punctuation that the tokenizer merges with the closing quote (``)",``) is closed with
the bare quote, not the merged token.

Example:
    >>> from trie_decode import TokenTrie
    >>> vocab = [b"<eos>", b'{"', b"city", b'":', b' "', b"Paris", b"Rome", b'",', b'"}', b'"', b"x"]
    >>> trie = TokenTrie.from_sequences([[5], [6]], vocab_size=len(vocab), names=["Paris", "Rome"])
    >>> rules = FieldRules.from_tokens([trie], ['"city": "'], '"', vocab)
    >>> rules.end.ids.tolist(), rules.bare_end       # every token whose text begins with '"' (b'":' too)
    ([3, 7, 8, 9], 9)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from .errors import ConstraintConfigError, InvalidEntryError
from .spans import FREE
from .text_spans import EndTokens, TextTriggers, TokenTriggers, Trigger, end_token_table, vocabulary_bytes
from .tokenizers import tokenize_in_context, tokenizer_vocab_size
from .trie import TokenTrie

__all__ = ["Span", "FieldRules", "ESCAPES"]

#: How a span's values may be written: ``None`` as given, ``"json"`` JSON-escaped (inside a JSON string).
ESCAPES = (None, "json")


@dataclass(frozen=True)
class Span:
    """One catalog-valued field: the text ``after`` which a value starts, its values, the text that ends one.

    Args:
        values: a :class:`TokenTrie` built for this position (in the context of ``after``), or the value strings
            (built with the tokenizer: in context, escaped per ``escape``).
        after: the text a value follows (a ``str``, exact), or a :class:`~trie_decode.text_spans.Trigger`
            (``Trigger('"city": "', whitespace="any")`` for JSON whose whitespace varies).
        end: the text that ends a value (default ``'"'``, the closing quote of a JSON string).
        escape: ``"json"`` writes the values JSON-escaped (a ``"`` in a value becomes ``\\"``); default ``"json"``
            when ``end`` is ``'"'``, else None.

    Example:
        >>> Span(["Paris", "Rome"], after='"city": "').escape
        'json'
    """

    values: Union[TokenTrie, Sequence[str]]
    after: Union[str, Trigger]
    end: str = '"'
    escape: Optional[str] = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.after, (str, Trigger)) or (isinstance(self.after, str) and not self.after):
            raise ConstraintConfigError(f"Span.after must be a non-empty str or a Trigger, got {self.after!r}")
        if not isinstance(self.end, str) or not self.end:
            raise ConstraintConfigError(f"Span.end must be a non-empty str, got {self.end!r}")
        escape = ("json" if self.end == '"' else None) if self.escape == "auto" else self.escape
        if escape not in ESCAPES:
            raise ConstraintConfigError(f"Span.escape must be one of {ESCAPES}, got {self.escape!r}")
        object.__setattr__(self, "escape", escape)
        if isinstance(self.values, (str, bytes)):
            raise ConstraintConfigError("Span.values must be a TokenTrie or a list of strings, not a single string")

    @property
    def after_text(self) -> str:
        """The literal text of ``after`` (the context values are tokenized in)."""
        return self.after.text if isinstance(self.after, Trigger) else self.after

    def written(self, value: str) -> str:
        """``value`` as the model writes it between ``after`` and ``end``."""
        return json.dumps(value, ensure_ascii=False)[1:-1] if self.escape == "json" else value

    def build_trie(self, tokenizer: Any) -> TokenTrie:
        """This span's trie: ``values`` itself, or the strings tokenized in the context of ``after``.

        Raises:
            InvalidEntryError: a value whose written text contains ``end`` (it would end the value early).
        """
        if isinstance(self.values, TokenTrie):
            return self.values
        names = list(self.values)
        texts = [self.written(v) if isinstance(v, str) else v for v in names]
        for i, text in enumerate(texts):
            if not isinstance(text, str) or not text:
                raise InvalidEntryError(f"Span value {i} must be a non-empty string, got {names[i]!r:.60}")
            if self.end in text:
                raise InvalidEntryError(
                    f"Span value {i} ({text!r:.60}) contains the span's end {self.end!r}: it would end the value "
                    "early; give escape='json' (for a JSON string) or another end"
                )
        seqs = tokenize_in_context(texts, tokenizer, self.after_text, separator="", on_unstable="raw")
        return TokenTrie.from_sequences(seqs, vocab_size=tokenizer_vocab_size(tokenizer), names=names)


class FieldRules:
    """What the step engine reads for a set of spans: the shared trigger automaton, the end tokens, and per span
    the root child reached by the bytes a trigger-completing token carries past ``after``.

    Compared by identity (it keys cached step tables). Build it with :meth:`build` (spans and a tokenizer) or
    :meth:`from_tokens` (tries, ``after`` patterns and a token byte table).

    Attributes:
        triggers: the automaton over every span's ``after`` (pattern ``k`` is span ``k``).
        end: the tokens beginning with ``end`` (:class:`~trie_decode.text_spans.EndTokens`).
        bare_end: the token whose text is exactly ``end`` (or the shortest end token): what a complete entry that
            prefixes a longer one allows beside its children.
        end_blocked: the shared dense row of a complete leaf entry: True where a column is blocked.
            Shape: (V,), bool.
    """

    def __init__(self, triggers: TokenTriggers, end: EndTokens, vocab: Sequence[bytes], tries: Sequence[TokenTrie]):
        if len(end.ids) == 0:
            raise ConstraintConfigError(f"no token of this vocabulary begins with the span end {end.end!r}")
        self.triggers, self.end = triggers, end
        self.vocab_size = len(vocab)
        lengths = [len(vocab[int(t)]) for t in end.ids]
        self.bare_end = int(end.ids[int(np.argmin(lengths))])
        blocked = np.ones(self.vocab_size, dtype=np.bool_)
        blocked[end.ids] = False
        self.end_blocked = blocked
        # Per span: bytes of each root child's token -> that child (a trigger token may carry the first bytes).
        self.root_by_bytes: list[dict[bytes, int]] = []
        for trie in tries:
            tokens, nodes = trie.children(trie.root)
            self.root_by_bytes.append({bytes(vocab[int(t)]): int(n) for t, n in zip(tokens, nodes) if int(t) < len(vocab)})
        self._vocab = vocab
        self._dead: dict[int, np.ndarray] = {}
        self._dead_flag = np.full(triggers.num_states, -1, dtype=np.int8)  # per state: has dead tokens (-1: unknown)

    def dead_tokens(self, state: int) -> np.ndarray:
        """The tokens that, written in automaton state ``state``, would complete a span's ``after`` and carry bytes
        that no value of that span starts with (``' "['`` before a catalog of names): blocked, so that no row ever
        completes a trigger it cannot follow with a value. Cached per state. Shape: (D,), int64."""
        found = self._dead.get(state)
        if found is None:
            _, pattern, past = self.triggers.row(state)
            fired = np.flatnonzero((pattern >= 0) & (past > 0))
            dead = [t for t in fired.tolist() if self.entry_node(int(pattern[t]), t, int(past[t])) < 0]
            found = self._dead[state] = np.array(dead, dtype=np.int64)
        return found

    def block_dead_triggers_(self, logits: Any, node: Any, text: Any, rows: Any = None) -> None:
        """The span rule for rows in free text: -inf at their state's :meth:`dead_tokens` (in place). Most states
        have none (a per-state flag, one gather); only rows about to complete an ``after`` are written.

        Args:
            logits: Shape: (B, V'). node, text: the rows' state (``RowState.node``, ``.text``), Shape: (R,).
            rows: the logits row of each state row (default: row i).
        """
        if len(node) == 1 and node.is_cpu:  # the batch-1 decode loop: Python ints
            if int(node) != FREE:
                return
            state = int(text)
            if self._dead_flag[state] < 0:
                self._dead_flag[state] = len(self.dead_tokens(state)) > 0
            if self._dead_flag[state] == 1:
                dead = self.dead_tokens(state)
                logits[0 if rows is None else int(rows[0]), torch.from_numpy(dead[dead < logits.shape[-1]])] = float("-inf")
            return
        free = np.flatnonzero(node.cpu().numpy() == FREE)
        if not len(free):
            return
        states = text.cpu().numpy()[free]
        flags = self._dead_flag[states]
        for s in np.unique(states[flags < 0]).tolist():
            self._dead_flag[s] = len(self.dead_tokens(s)) > 0
        hit = free[self._dead_flag[states] == 1]
        width = logits.shape[-1]
        for i in hit.tolist():
            dead = self.dead_tokens(int(text[i]))
            r = i if rows is None else int(rows[i])
            logits[r, torch.from_numpy(dead[dead < width]).to(logits.device)] = float("-inf")

    def entry_node(self, span: int, token: int, past: int) -> int:
        """Where a row enters ``span``'s trie after ``token`` completed its ``after`` with ``past`` bytes left: the
        root, the root child those bytes spell, or -1 (a dead trigger token, see :meth:`dead_tokens`)."""
        carried = self.carried(token, past)
        return 0 if not carried else self.root_by_bytes[span].get(carried, -1)

    def carried(self, token: int, past: int) -> bytes:
        """The last ``past`` bytes of ``token``: what it carries past a completed ``after``."""
        data = self._vocab[token]
        return bytes(data[len(data) - past:]) if past else b""

    @classmethod
    def from_tokens(cls, tries: Sequence[TokenTrie], afters: Sequence[Union[str, Trigger]], end: str,
                    vocab: Sequence[bytes]) -> "FieldRules":
        """From the spans' tries, their ``after`` patterns, the shared ``end`` and a token byte table."""
        triggers = TextTriggers(list(afters)).for_tokens(list(vocab))
        return cls(triggers, end_token_table(end, list(vocab)), list(vocab), tries)

    @classmethod
    def build(cls, spans: Sequence[Span], tokenizer: Any) -> tuple[list[TokenTrie], "FieldRules"]:
        """The spans' tries and their field rules for ``tokenizer``.

        Raises:
            ConstraintConfigError: no spans, an item that is not a :class:`Span`, or spans with different ends.
        """
        spans = list(spans) if not isinstance(spans, Span) else [spans]
        if not spans:
            raise ConstraintConfigError("spans is empty: give at least one Span")
        for i, s in enumerate(spans):
            if not isinstance(s, Span):
                raise ConstraintConfigError(f"spans[{i}] is {type(s).__name__}, not a Span")
        ends = {s.end for s in spans}
        if len(ends) > 1:
            raise ConstraintConfigError(f"every span of a request must share one end; got {sorted(ends)}")
        tries = [s.build_trie(tokenizer) for s in spans]
        vocab = vocabulary_bytes(tokenizer)
        vocab += [b""] * max(0, max(t.vocab_size for t in tries) - len(vocab))
        triggers = TextTriggers([s.after for s in spans]).for_tokens(vocab)
        return tries, cls(triggers, end_token_table(spans[0].end, vocab), vocab, tries)

    def __repr__(self) -> str:
        return (f"FieldRules(spans={len(self.root_by_bytes)}, end={self.end.end!r}, end_tokens={len(self.end.ids)}, "
                f"automaton_states={self.triggers.num_states})")
