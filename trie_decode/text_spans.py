"""Where text-level spans start and end, as tables over the vocabulary: trigger detection without detokenizing.

Why this exists: a span (a catalog-valued field inside free text or JSON) starts when the text written so far ends
with its ``after`` text, however the model split that text into tokens, and ends when the model writes its ``end``
text. Comparing token ids fails (``'": "'`` is one token here, three there, and glued to the value's first letter
elsewhere), and re-decoding the output at every step costs time that grows with the output. Instead:

1. :class:`TextTriggers` compiles every span's ``after`` pattern into one deterministic byte automaton (an
   Aho-Corasick automaton when all patterns are literals), so 100 spans cost what one costs.
2. :class:`TokenTriggers` lifts it to one tokenizer's vocabulary: for an automaton state ``s`` and a token ``t``,
   the state after ``t``'s bytes, and whether a pattern completed inside ``t`` (which one, and how many of ``t``'s
   bytes lie past it). A state's row over the whole vocabulary is built the first time a row of the batch visits
   that state (one vectorized pass, one gather per byte position) and cached; most rows sit in a few states.
3. :func:`end_token_table` lists the tokens whose bytes begin with a span's ``end`` and what each carries past it.

Patterns (:class:`Trigger`):

- a plain ``str`` (or ``Trigger(text)``) is an exact literal, matched on its UTF-8 bytes;
- ``Trigger(text, whitespace="any")`` is whitespace-tolerant: the text is cut into maximal runs of JSON whitespace
  (:data:`WHITESPACE`: space, tab, LF, CR) and runs of other characters; each whitespace run matches any run of
  zero or more whitespace bytes (any mix), the other characters match exactly. ``'"city": "'`` matches
  ``'"city":"'``, ``'"city": "'`` and ``'"city":\\n  "'``, as the regular expression ``"city":[ \\t\\n\\r]*"`` does.
  A leading whitespace run is dropped (a match is a suffix of the text, so an optional prefix never moves where it
  ends); a trailing one is an error (the match would end before it, so the span would start with the whitespace).
  Other Unicode spaces (NBSP, ``"\\u3000"``) are ordinary characters. No whitespace is tolerated where the pattern
  has none (``'"city" : "'`` does not match ``'"city": "'``).

A match *completes* at the byte where the text (prompt tail included) first ends with the pattern. When several
patterns complete at the same byte, the lowest pattern index is reported; the automaton keeps running after a
completion (what the caller does with the row then, entering the span, is its business).

Token bytes come from :func:`trie_decode.tokenizers.token_bytes` (byte-level BPE and Tekken: the token's bytes;
SentencePiece: ``"▁"`` as a space, ``<0xNN>`` pieces as their byte), and special tokens (``all_special_ids``,
added tokens flagged special, the unk/bos/eos/pad ids) count as empty: they never advance or complete a pattern.
Non-special added tokens (Gemma's ``"\\n"`` tokens) keep their text. SentencePiece's dummy prefix makes a text's
first token carry a space that the decoded text does not show; seed rows from the prompt's decoded text
(:meth:`TokenTriggers.start_state`), not from its ids, when that matters.

Dimension letters: V vocabulary size, S automaton states, K materialized states, F firing (state, token) pairs,
R rows, P patterns, L the longest token in bytes.

Example:
    >>> import torch
    >>> vocab = [b"", b'{"', b"city", b'":', b' "', b'"Par', b"is", b'",', b' "\\'']
    >>> tt = TokenTriggers(TextTriggers([Trigger('"city": "', whitespace="any")]), vocab)
    >>> s = tt.start_state("Answer: ")
    >>> s = tt.feed_token_ids(s, [1, 2])                        # '{"city'
    >>> state, fired, past = tt.advance(torch.tensor([s]), torch.tensor([3]))      # '":'
    >>> fired.tolist()
    [-1]
    >>> state, fired, past = tt.advance(state, torch.tensor([8]))                  # ' "\\'': trigger + 1 byte
    >>> fired.tolist(), past.tolist()
    ([0], [1])
    >>> end = end_token_table('"', vocab)
    >>> end.ids.tolist(), end.tails
    ([3, 5, 7], (b':', b'Par', b','))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from .entries import utf8_bytes
from .errors import InvalidTokenError, TrieDecodeError
from .tokenizers import markup_ids, token_bytes

__all__ = [
    "Trigger",
    "TextTriggers",
    "TokenTriggers",
    "EndTokens",
    "end_token_table",
    "vocabulary_bytes",
    "TriggerPatternError",
    "TriggerTypeError",
    "TriggerStateError",
    "WHITESPACE",
    "WHITESPACE_MODES",
    "MAX_STATES",
]

#: The bytes a whitespace-tolerant pattern's whitespace runs match: JSON's whitespace (RFC 8259).
WHITESPACE = b" \t\n\r"
#: Values of ``Trigger.whitespace``.
WHITESPACE_MODES = ("exact", "any")
#: Most automaton states one :class:`TextTriggers` may have (the patterns are refused beyond it).
MAX_STATES = 1 << 16

_WS = frozenset(WHITESPACE)
_STAR = -1  # element code of a whitespace run in a compiled pattern (other elements are byte values 0..255)


class TriggerPatternError(TrieDecodeError, ValueError):
    """A trigger pattern is empty, ends with whitespace where whitespace is tolerated, has an unknown whitespace
    mode or a lone surrogate (no UTF-8 text), or the patterns compile to more than :data:`MAX_STATES` automaton
    states."""


class TriggerTypeError(TrieDecodeError, TypeError):
    """A trigger pattern, vocabulary, state or token argument has the wrong type (not a str, not bytes, not an
    integer tensor)."""


class TriggerStateError(TrieDecodeError, ValueError):
    """An automaton state is not one of the automaton's states (negative, or not below ``num_states``)."""


# ---------------------------------------------------------------------------------------------------------------
# Patterns and the byte automaton


@dataclass(frozen=True)
class Trigger:
    """One span's ``after`` pattern.

    Args:
        text: the text that starts the span (non-empty).
        whitespace: ``"exact"`` (default: the literal bytes) or ``"any"`` (each whitespace run of ``text`` matches
            zero or more of space, tab, LF, CR; see the module docstring).

    Example:
        >>> Trigger('"city": "', whitespace="any").regex()
        '"city":[ \\\\t\\\\n\\\\r]*"'
    """

    text: str
    whitespace: str = "exact"

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise TriggerTypeError(f"Trigger text must be a str, got {type(self.text).__name__}: {self.text!r}")
        if self.whitespace not in WHITESPACE_MODES:
            raise TriggerPatternError(
                f"Trigger whitespace must be one of {WHITESPACE_MODES}, got {self.whitespace!r} (text {self.text!r})")
        if not self.text:
            raise TriggerPatternError("Trigger text must be non-empty, got ''")
        data = utf8_bytes(self.text, "Trigger text", TriggerPatternError)
        if self.whitespace == "any":
            if all(b in _WS for b in data):
                raise TriggerPatternError(
                    f"Trigger text {self.text!r} with whitespace='any' is only whitespace: it would match everywhere")
            if data[-1] in _WS:
                raise TriggerPatternError(
                    f"Trigger text {self.text!r} with whitespace='any' ends with whitespace: a match ends before a "
                    "tolerated run, so the span would start with that whitespace; end the pattern with another "
                    "character or use whitespace='exact'")

    def elements(self) -> tuple[int, ...]:
        """The compiled pattern: byte values, and :data:`_STAR` (-1) for each tolerated whitespace run."""
        data = self.text.encode("utf-8")
        if self.whitespace == "exact":
            return tuple(data)
        out: list[int] = []
        for b in data.lstrip(WHITESPACE):
            if b in _WS:
                if not out or out[-1] != _STAR:
                    out.append(_STAR)
            else:
                out.append(b)
        return tuple(out)

    def regex(self) -> str:
        """The pattern as a Python regular expression over text (``re.search(regex + r"\\Z", text)`` holds exactly
        when the text ends with a match)."""
        import re

        if self.whitespace == "exact":
            return re.escape(self.text)
        parts = re.split(r"[ \t\n\r]+", self.text.lstrip(" \t\n\r"))
        return r"[ \t\n\r]*".join(re.escape(p) for p in parts)


def _as_trigger(value: Any, index: int) -> Trigger:
    if isinstance(value, Trigger):
        return value
    if isinstance(value, str):
        if not value:
            raise TriggerPatternError(f"patterns[{index}] is empty: a span's after text must be non-empty")
        return Trigger(value)
    raise TriggerTypeError(f"patterns[{index}] must be a str or a Trigger, got {type(value).__name__}: {value!r}")


class TextTriggers:
    """Every span's ``after`` pattern compiled into one deterministic byte automaton.

    The automaton reads the text as UTF-8 bytes; its state after a text says which pattern prefixes the text ends
    with. State 0 is the start (nothing matched). Built by subset construction over the patterns' positions (for
    literals this gives the Aho-Corasick automaton with its failure links folded into a full 256-way table); bytes
    that occur in no pattern (and are not tolerated whitespace) send every state back to 0. States are numbered so
    that the *accepting* ones (a pattern completed on the last byte) are the highest, ``>= first_accepting``.

    Args:
        patterns: one per span, in span order: a str (exact literal) or a :class:`Trigger`. Duplicates are allowed;
            the first one is reported.

    Raises:
        TriggerTypeError: ``patterns`` is a str, or an element is neither a str nor a Trigger.
        TriggerPatternError: no pattern, an empty one, or more than :data:`MAX_STATES` states.

    Example:
        >>> tt = TextTriggers(["ab", Trigger("b c", whitespace="any")])
        >>> tt.find_all("xab c  bc")                 # (pattern, byte offset just past the match)
        [(0, 3), (1, 5), (1, 9)]
        >>> tt.completed(tt.start_state("..ab")), tt.completed(tt.start_state("..a"))
        (0, -1)
    """

    def __init__(self, patterns: Sequence[Union[str, Trigger]]):
        if isinstance(patterns, (str, bytes, Trigger)):
            raise TriggerTypeError(
                f"patterns must be a sequence of str or Trigger (one per span), got a single {type(patterns).__name__}: "
                f"{patterns!r}; wrap it in a list")
        try:
            items = list(patterns)
        except TypeError as exc:
            raise TriggerTypeError(f"patterns must be a sequence of str or Trigger, got {patterns!r}") from exc
        if not items:
            raise TriggerPatternError("patterns is empty: give at least one span's after text")
        self.patterns: tuple[Trigger, ...] = tuple(_as_trigger(p, i) for i, p in enumerate(items))
        self._compile()

    # -- construction ---------------------------------------------------------------------------------------

    def _compile(self) -> None:
        """Subset construction. An NFA position is (pattern, elements matched), numbered globally; a DFA state is
        the set of non-start positions reached (start positions are always implied: a match may begin anywhere)."""
        elems = [p.elements() for p in self.patterns]
        base, kind, owner = [], [], []  # per position: element code (or -2 at a pattern's end), its pattern
        for p, el in enumerate(elems):
            base.append(len(kind))
            kind.extend(el)
            kind.append(-2)
            owner.extend([p] * (len(el) + 1))

        def closure(pos: int) -> tuple[int, ...]:
            # A whitespace run may be empty: being before it is also being after it (runs are never adjacent).
            return (pos, pos + 1) if kind[pos] == _STAR else (pos,)

        relevant = sorted({b for el in elems for b in el if b >= 0} | (_WS if any(_STAR in el for el in elems) else set()))
        from_start: dict[int, set[int]] = {b: set() for b in relevant}
        for p, el in enumerate(elems):
            if el[0] >= 0:  # patterns never begin with a run (it is stripped)
                from_start[el[0]].update(closure(base[p] + 1))

        states: list[frozenset[int]] = [frozenset()]
        index: dict[frozenset[int], int] = {frozenset(): 0}
        trans: list[dict[int, int]] = []
        i = 0
        while i < len(states):
            cur = states[i]
            row: dict[int, int] = {}
            for b in relevant:
                nxt = set(from_start[b])
                for pos in cur:
                    k = kind[pos]
                    if k == b:
                        nxt.update(closure(pos + 1))
                    elif k == _STAR and b in _WS:
                        nxt.update(closure(pos))
                if not nxt:
                    continue
                key = frozenset(nxt)
                j = index.get(key)
                if j is None:
                    if len(states) >= MAX_STATES:
                        raise TriggerPatternError(
                            f"the {len(self.patterns)} patterns compile to more than {MAX_STATES} automaton states; "
                            "give fewer or shorter patterns, or fewer of them whitespace-tolerant (whitespace='any')")
                    j = index[key] = len(states)
                    states.append(key)
                row[b] = j
            trans.append(row)
            i += 1

        # Accepting states last, so that "a pattern completed" is one comparison in the lifting loop.
        accept = [min((owner[pos] for pos in st if kind[pos] == -2), default=-1) for st in states]
        order = sorted(range(len(states)), key=lambda s: (accept[s] >= 0, s))  # state 0 stays first
        new_id = np.empty(len(states), dtype=np.int64)
        new_id[order] = np.arange(len(states))
        delta = np.zeros((len(states), 256), dtype=np.int32)
        for s, row in enumerate(trans):
            for b, j in row.items():
                delta[new_id[s], b] = new_id[j]
        self.num_states = len(states)
        #: Shape: (S, 256), int32: the state after a byte.
        self.delta = delta
        #: Shape: (S,), int32: the pattern completed on the last byte of the state's texts, -1 for none.
        self.accept = np.asarray([accept[s] for s in order], dtype=np.int32)
        self.first_accepting = int(np.searchsorted(self.accept >= 0, True))
        self._delta_rows: list[list[int]] = delta.tolist()  # feeding text byte by byte reads Python lists
        self._accept_list = self.accept.tolist()
        # A "reset" byte sends every state to 0: the state after a text is the state after what follows its last one.
        reset = np.all(delta == 0, axis=0)
        self._reset_table = bytes.maketrans(bytes(range(256)), bytes(0 if r else 1 for r in reset))
        # The state is the set of pattern prefixes that suffixes of the text match. Such a suffix has at most
        # `literals` bytes matched by literal elements (its whitespace runs match only whitespace) and begins with
        # one: if that byte is not whitespace, it lies at or after the text's `literals`-th last non-whitespace
        # byte; if it is (an exact pattern's leading space), the suffix holds at least one fewer non-whitespace
        # byte, so it starts after that byte. Either way the text before that byte never matters (feed_bytes).
        self._literals = max(sum(1 for e in el if e != _STAR) for el in elems)
        self._is_ws = np.zeros(256, dtype=bool)
        self._is_ws[list(WHITESPACE)] = True

    # -- feeding text ---------------------------------------------------------------------------------------

    @property
    def num_patterns(self) -> int:
        return len(self.patterns)

    def check_state(self, state: Any, what: str = "state") -> int:
        """``state`` as an int, or :class:`TriggerStateError` / :class:`TriggerTypeError` naming ``what``."""
        if isinstance(state, bool) or not isinstance(state, (int, np.integer)):
            raise TriggerTypeError(f"{what} must be an int automaton state, got {type(state).__name__}: {state!r}")
        state = int(state)
        if not 0 <= state < self.num_states:
            raise TriggerStateError(f"{what} must be in [0, {self.num_states}), got {state}")
        return state

    def feed_bytes(self, state: int, data: bytes) -> int:
        """The state after ``data``'s bytes, from ``state``.

        A Python loop over the tail that decides the state only: the bytes after the last byte that occurs in no
        pattern, and at most the bytes from the text's ``L``-th last non-whitespace byte (L: the most bytes a
        pattern matches outside its whitespace runs). A 100 kB prompt costs about what its last bytes cost."""
        state = self.check_state(state)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TriggerTypeError(f"data must be bytes, got {type(data).__name__}: {data!r:.80}")
        data = bytes(data)
        cut = data.translate(self._reset_table).rfind(0)
        if cut >= 0:
            state, data = 0, data[cut + 1:]
        if len(data) > 2 * self._literals:
            solid = np.flatnonzero(~self._is_ws[np.frombuffer(data, dtype=np.uint8)])
            if len(solid) >= self._literals and solid[-self._literals] > 0:
                state, data = 0, data[int(solid[-self._literals]):]
        rows = self._delta_rows
        for b in data:
            state = rows[state][b]
        return state

    def feed_text(self, state: int, text: str) -> int:
        """The state after ``text`` (its UTF-8 bytes), from ``state``."""
        if not isinstance(text, str):
            raise TriggerTypeError(f"text must be a str, got {type(text).__name__}: {text!r:.80}")
        return self.feed_bytes(state, text.encode("utf-8"))

    def start_state(self, text: str = "") -> int:
        """The state of a row whose text so far is ``text`` (the prompt, or its tail; ``""``: state 0).
        ``completed(start_state(prompt)) >= 0`` when the prompt itself ends with a pattern."""
        return self.feed_text(0, text)

    def completed(self, state: int) -> int:
        """The pattern that completed on the last byte fed (the lowest index if several), -1 for none."""
        return self._accept_list[self.check_state(state)]

    def find_all(self, text: Union[str, bytes], state: int = 0) -> list[tuple[int, int]]:
        """Every completion in ``text`` from ``state``: (pattern, byte offset just past it), in order. For tests and
        prompt inspection (Python loop over all bytes)."""
        data = text.encode("utf-8") if isinstance(text, str) else text
        if not isinstance(data, (bytes, bytearray)):
            raise TriggerTypeError(f"text must be a str or bytes, got {type(text).__name__}")
        state = self.check_state(state)
        rows, acc, out = self._delta_rows, self._accept_list, []
        for i, b in enumerate(data):
            state = rows[state][b]
            if acc[state] >= 0:
                out.append((acc[state], i + 1))
        return out

    def for_tokens(self, vocab: Sequence[bytes]) -> "TokenTriggers":
        """This automaton lifted to a vocabulary (token bytes by id): see :class:`TokenTriggers`."""
        return TokenTriggers(self, vocab)

    def __repr__(self) -> str:
        return f"TextTriggers({len(self.patterns)} patterns, {self.num_states} states)"


# ---------------------------------------------------------------------------------------------------------------
# The vocabulary as bytes


def vocabulary_bytes(tokenizer: Any, *, special_ids: Optional[Sequence[int]] = None) -> list[bytes]:
    """Each token id's bytes for text matching: :func:`~trie_decode.tokenizers.token_bytes`, with special tokens
    (``special_ids``, by default the tokenizer's own: see the module docstring) as ``b""``.

    Raises:
        TriggerTypeError: ``tokenizer`` has no ``get_vocab``.
    """
    if not hasattr(tokenizer, "get_vocab"):
        raise TriggerTypeError(f"tokenizer must be a Hugging Face-style tokenizer, got {type(tokenizer).__name__}")
    out = list(token_bytes(tokenizer))
    return _emptied(out, markup_ids(tokenizer) if special_ids is None else special_ids)


def _emptied(vocab: list[bytes], special_ids: Any) -> list[bytes]:
    """``vocab`` (changed in place) with the tokens ``special_ids`` as ``b""`` (ids outside it are ignored)."""
    for i in {int(i) for i in special_ids}:
        if 0 <= i < len(vocab):
            vocab[i] = b""
    return vocab


def _check_vocab(vocab: Any) -> list[bytes]:
    if isinstance(vocab, (str, bytes)) or not hasattr(vocab, "__len__"):
        raise TriggerTypeError(f"vocab must be a sequence of bytes (one per token id), got {type(vocab).__name__}")
    out = list(vocab)
    if not out:
        raise TriggerPatternError("vocab is empty: give the bytes of every token id")
    for i, b in enumerate(out):
        if not isinstance(b, (bytes, bytearray)):
            raise TriggerTypeError(f"vocab[{i}] must be bytes, got {type(b).__name__}: {b!r:.80}")
    return out


class _ByteColumns:
    """The vocabulary as byte columns, tokens sorted by length (longest first): column ``j`` holds byte ``j`` of
    the ``counts[j]`` tokens longer than ``j``, so the lifting loop shrinks as tokens end."""

    def __init__(self, vocab: list[bytes]):
        lengths = np.fromiter(map(len, vocab), dtype=np.int64, count=len(vocab))
        #: Shape: (V,), int64: token ids, longest first (ties by id).
        self.order = np.argsort(-lengths, kind="stable")
        self.sorted_lengths = lengths[self.order]
        blob = np.frombuffer(b"".join(vocab), dtype=np.uint8)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])[self.order]
        longest = int(lengths.max()) if len(vocab) else 0
        # counts[j]: how many tokens have more than j bytes (sorted_lengths is descending).
        self.counts = [int(np.count_nonzero(self.sorted_lengths > j)) for j in range(longest)]
        self.columns = [blob[offsets[:n] + j].astype(np.int64) for j, n in enumerate(self.counts)]


# ---------------------------------------------------------------------------------------------------------------
# The automaton lifted to tokens


class TokenTriggers:
    """A :class:`TextTriggers` automaton lifted to one vocabulary: per (state, token), the next state and whether
    (which pattern, how many bytes before the token's end) a trigger completed inside the token.

    A state's row over the vocabulary is built on first use (by :meth:`advance`, :meth:`feed_token_ids` or
    :meth:`materialize`) in one vectorized pass that loops over byte positions only (~L gathers of shrinking size),
    and cached: memory is 4 bytes per token per visited state (1 MB at V = 262k) plus the firing pairs. Not
    thread-safe while rows are being built.

    Args:
        triggers: a :class:`TextTriggers`, or the patterns to compile into one.
        vocab: the bytes of every token id (``b""`` for special tokens): see :func:`vocabulary_bytes`.

    Raises:
        TriggerTypeError: ``vocab`` is not a sequence of bytes.

    Example:
        >>> import torch
        >>> tt = TokenTriggers(["ab"], [b"", b"a", b"b", b"xab!", b"ab"])
        >>> state, fired, past = tt.advance(torch.tensor([0, 0, 0]), torch.tensor([1, 3, 4]))
        >>> fired.tolist(), past.tolist()
        ([-1, 0, 0], [0, 1, 0])
        >>> tt.num_materialized
        1
    """

    def __init__(self, triggers: Union[TextTriggers, Sequence[Union[str, Trigger]]], vocab: Sequence[bytes]):
        self.triggers = triggers if isinstance(triggers, TextTriggers) else TextTriggers(triggers)
        self.vocab = _check_vocab(vocab)
        self.vocab_size = len(self.vocab)
        self._cols = _ByteColumns(self.vocab)
        S = self.triggers.num_states
        self._S = S
        self._delta_flat = self.triggers.delta.astype(np.int64).ravel()
        self._slot = np.full(S, -1, dtype=np.int32)
        self._slot_list = [-1] * S
        self._codes = np.zeros((0, self.vocab_size), dtype=np.int32)
        self._k = 0
        self._fire_next = np.zeros(0, dtype=np.int32)
        self._fire_pattern = np.zeros(0, dtype=np.int32)
        self._fire_past = np.zeros(0, dtype=np.int32)
        self._fire_lists: tuple[list[int], list[int], list[int]] = ([], [], [])

    # -- lazy rows ------------------------------------------------------------------------------------------

    @property
    def num_states(self) -> int:
        return self._S

    @property
    def num_materialized(self) -> int:
        """How many states have their row built."""
        return self._k

    def _build(self, state: int) -> None:
        """One state's row. Steps: (1) every token starts in ``state``; (2) for each byte position j, the tokens
        longer than j take one transition (a gather from the flat (S*256,) table); (3) a token whose transition
        lands in an accepting state for the first time records the pattern and the byte offset; (4) tokens that
        fired get codes S + e into the firing arrays, the others the state they end in."""
        cols, S, first_acc = self._cols, self._S, self.triggers.first_accepting
        V = self.vocab_size
        cur = np.full(V, state, dtype=np.int64)  # in length order
        fire_at = np.full(V, -1, dtype=np.int64)
        fire_state = np.zeros(V, dtype=np.int64)
        delta = self._delta_flat
        for j, col in enumerate(cols.columns):
            n = len(col)
            nxt = delta[cur[:n] * 256 + col]
            cur[:n] = nxt
            if first_acc < S:
                hit = np.flatnonzero((nxt >= first_acc) & (fire_at[:n] < 0))
                if len(hit):
                    fire_at[hit] = j
                    fire_state[hit] = nxt[hit]
        fired = np.flatnonzero(fire_at >= 0)
        codes = cur.astype(np.int32)
        if len(fired):
            nexts, pats, pasts = self._fire_lists
            e0 = len(nexts)
            if S + e0 + len(fired) >= 2**31:  # ~2e9 firing pairs: thousands of states each firing on every token
                raise TriggerPatternError(
                    f"the firing pairs of {self._k + 1} built states over {V} tokens overflow int32 codes")
            codes[fired] = S + e0 + np.arange(len(fired), dtype=np.int32)
            nexts.extend(cur[fired].tolist())
            pats.extend(self.triggers.accept[fire_state[fired]].tolist())
            pasts.extend((cols.sorted_lengths[fired] - fire_at[fired] - 1).tolist())
            self._fire_next = np.asarray(nexts, dtype=np.int32)
            self._fire_pattern = np.asarray(pats, dtype=np.int32)
            self._fire_past = np.asarray(pasts, dtype=np.int32)
        if self._k == len(self._codes):
            grown = np.zeros((max(4, 2 * len(self._codes)), V), dtype=np.int32)
            grown[: self._k] = self._codes[: self._k]
            self._codes = grown
        self._codes[self._k, cols.order] = codes
        self._slot[state] = self._k
        self._slot_list[state] = self._k
        self._k += 1

    def materialize(self, states: Sequence[int]) -> None:
        """Build the rows of ``states`` now (e.g. the start state and the states of a batch's prompts).

        Raises:
            TriggerTypeError: ``states`` is not a sequence of ints. TriggerStateError: a state out of range.
        """
        if not hasattr(states, "__iter__"):
            raise TriggerTypeError(f"states must be a sequence of automaton states, got {type(states).__name__}: "
                                   f"{states!r:.60}")
        for s in sorted({self.triggers.check_state(s, "states[i]") for s in states}):
            if self._slot_list[s] < 0:
                self._build(s)

    def row(self, state: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One state's row, decoded: (next state, pattern fired or -1, bytes past the trigger). Shape: (V,), int32
        each. Builds the row if needed."""
        state = self.triggers.check_state(state)
        self.materialize([state])
        nxt = self._codes[self._slot_list[state]].copy()
        fired = np.flatnonzero(nxt >= self._S)
        e = nxt[fired] - self._S
        pat = np.full(self.vocab_size, -1, dtype=np.int32)
        past = np.zeros(self.vocab_size, dtype=np.int32)
        nxt[fired], pat[fired], past[fired] = self._fire_next[e], self._fire_pattern[e], self._fire_past[e]
        return nxt, pat, past

    # -- the step -------------------------------------------------------------------------------------------

    def advance(
        self, states: torch.Tensor, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One step for R rows: each row in ``states[i]`` writes ``tokens[i]``.

        Reference loop (what this computes, without the loop)::

            for i in range(R):
                s, fired[i], past[i] = states[i], -1, 0
                for k, byte in enumerate(vocab[tokens[i]]):
                    s = delta[s, byte]
                    if fired[i] < 0 and accept[s] >= 0:
                        fired[i], past[i] = accept[s], len(vocab[tokens[i]]) - k - 1
                new_states[i] = s

        Args:
            states: Shape: (R,), int64: the rows' automaton states.
            tokens: Shape: (R,), int64 (any integer dtype): the tokens written.

        Returns:
            (new_states, fired_pattern, bytes_past_trigger), each Shape: (R,), int64, on ``states``' device.
            ``new_states`` is the state after all of the token's bytes (the automaton keeps running after a match);
            ``fired_pattern`` is the first pattern completed inside the token (-1: none), ``bytes_past_trigger``
            how many of the token's last bytes follow that completion (0 when none fired).

        Costs: on CPU a few µs per call for R = 1 (a scalar path) once the rows' states are built; a state seen for
        the first time builds its row (~V·(mean token length) gathers). Tensors on another device are read to the
        host and the results written back (one transfer each way).

        Raises:
            TriggerTypeError: not 1-D integer tensors of one length. TriggerStateError: a state out of range.
            InvalidTokenError: a token id negative or not below the vocabulary size.
        """
        if not isinstance(states, torch.Tensor) or not isinstance(tokens, torch.Tensor):
            raise TriggerTypeError(
                f"states and tokens must be torch tensors, got {type(states).__name__} and {type(tokens).__name__}")
        if states.dim() != 1 or tokens.shape != states.shape:
            raise TriggerTypeError(
                f"states and tokens must be 1-D of the same length, got shapes {tuple(states.shape)} and "
                f"{tuple(tokens.shape)}")
        if states.dtype.is_floating_point or tokens.dtype.is_floating_point or states.dtype == torch.bool \
                or tokens.dtype == torch.bool:
            raise TriggerTypeError(f"states and tokens must be integer tensors, got {states.dtype} and {tokens.dtype}")
        device = states.device
        if device.type != "cpu" or tokens.device.type != "cpu":
            out = self.advance(states.cpu(), tokens.cpu())
            return tuple(x.to(device) for x in out)  # type: ignore[return-value]
        if states.shape[0] == 1:  # the batch-1 decode loop: Python ints, one array allocation
            out = np.array(self.step(int(states.item()), int(tokens.item())), dtype=np.int64)
            return torch.from_numpy(out.reshape(3, 1)).unbind()  # type: ignore[return-value]
        s = states.numpy()
        t = tokens.numpy()
        if len(s) == 0:
            empty = torch.zeros(0, dtype=torch.int64)
            return empty, empty.clone(), empty.clone()
        if s.min() < 0 or s.max() >= self._S:
            bad = s[(s < 0) | (s >= self._S)][0]
            raise TriggerStateError(f"states must be in [0, {self._S}), got {int(bad)}")
        if t.min() < 0 or t.max() >= self.vocab_size:
            bad = t[(t < 0) | (t >= self.vocab_size)][0]
            raise InvalidTokenError(f"tokens must be in [0, {self.vocab_size}) (the vocabulary), got {int(bad)}")
        slots = self._slot[s]
        if (slots < 0).any():
            self.materialize(np.unique(s[slots < 0]).tolist())
            slots = self._slot[s]
        codes = self._codes[slots, t].astype(np.int64)
        fired = codes >= self._S
        if not fired.any():
            return torch.from_numpy(codes), torch.full((len(s),), -1, dtype=torch.int64), \
                torch.zeros(len(s), dtype=torch.int64)
        e = np.where(fired, codes - self._S, 0)
        nxt = np.where(fired, self._fire_next[e], codes)
        pat = np.where(fired, self._fire_pattern[e], -1).astype(np.int64)
        past = np.where(fired, self._fire_past[e], 0).astype(np.int64)
        return torch.from_numpy(nxt.astype(np.int64)), torch.from_numpy(pat), torch.from_numpy(past)

    def step(self, state: int, token: int) -> tuple[int, int, int]:
        """:meth:`advance` for one row, on Python ints: (new state, pattern fired or -1, bytes past the trigger).

        Raises:
            TriggerTypeError: ``state`` or ``token`` is not an int. TriggerStateError: a state out of range.
            InvalidTokenError: a token id negative or not below the vocabulary size.
        """
        try:  # the types are checked where using them fails (no cost on the per-step path)
            if not 0 <= state < self._S:
                raise TriggerStateError(f"state must be in [0, {self._S}), got {state}")
            if not 0 <= token < self.vocab_size:
                raise InvalidTokenError(f"token must be in [0, {self.vocab_size}) (the vocabulary), got {token}")
            slot = self._slot_list[state]
            if slot < 0:
                self._build(state)
                slot = self._slot_list[state]
            code = int(self._codes[slot, token])
        except (TypeError, IndexError) as exc:
            raise TriggerTypeError(f"state and token must be ints, got {type(state).__name__} {state!r:.40} and "
                                   f"{type(token).__name__} {token!r:.40}") from exc
        if code < self._S:
            return code, -1, 0
        e = code - self._S
        nexts, pats, pasts = self._fire_lists
        return nexts[e], pats[e], pasts[e]

    # -- seeding rows ---------------------------------------------------------------------------------------

    def start_state(self, text: str = "") -> int:
        """The state of a row whose text so far is ``text`` (the prompt decoded once, or its tail)."""
        return self.triggers.start_state(text)

    def feed_text(self, state: int, text: str) -> int:
        """The state after ``text``, from ``state``."""
        return self.triggers.feed_text(state, text)

    def feed_token_ids(self, state: int, ids: Sequence[int]) -> int:
        """The state after the tokens ``ids`` (their bytes; special tokens are empty), from ``state``.

        Raises:
            InvalidTokenError: an id that is not an int in [0, V). TriggerTypeError: ``ids`` is not a sequence.
        """
        state = self.triggers.check_state(state)
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise TriggerTypeError(f"ids must be a sequence of token ids, got {type(ids).__name__}: {ids!r:.60}")
        data = []
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= int(t) < self.vocab_size:
                raise InvalidTokenError(f"ids[{i}] must be a token id in [0, {self.vocab_size}), got {t!r}")
            data.append(self.vocab[int(t)])
        return self.triggers.feed_bytes(state, b"".join(data))

    def __repr__(self) -> str:
        return (f"TokenTriggers({len(self.triggers.patterns)} patterns, {self._S} states, V={self.vocab_size}, "
                f"{self._k} rows built)")


# ---------------------------------------------------------------------------------------------------------------
# Where a value ends


@dataclass(frozen=True)
class EndTokens:
    """The tokens that close a span whose values end with ``end``.

    Attributes:
        end: the end text.
        ids: Shape: (M,), int32, sorted: tokens whose bytes begin with ``end`` (``'"'``, ``'",'``, ``'"}'``, ...).
        tails: per id, the bytes it carries past ``end`` (ordinary text after the span; may be a partial UTF-8
            character in byte-level vocabularies).
        partial_ids: Shape: (Q,), int32, sorted: tokens whose bytes are a non-empty proper prefix of ``end``. A
            multi-character ``end`` that the model writes in several tokens (``'"'`` then ``'}'`` for
            ``end='"}'``) starts with one of these; they are *not* end tokens and do not close the span on their
            own. A caller that must accept split ends has to track the rest of ``end`` itself (or choose a
            one-character ``end``, which no tokenizer splits).
    """

    end: str
    ids: np.ndarray
    tails: tuple[bytes, ...]
    partial_ids: np.ndarray

    @classmethod
    def end_token(cls, end_token_id: int) -> "EndTokens":
        """The end token alone (it carries no text): what closes a value that ends the output (``Span(end=None)``,
        a template's final slot)."""
        return cls("", np.asarray([end_token_id], dtype=np.int32), (b"",), np.zeros(0, dtype=np.int32))


def _vocab_of(tokenizer_or_vocab: Any, special_ids: Optional[Sequence[int]]) -> list[bytes]:
    if hasattr(tokenizer_or_vocab, "get_vocab"):
        return vocabulary_bytes(tokenizer_or_vocab, special_ids=special_ids)
    vocab = _check_vocab(tokenizer_or_vocab)  # a copy: emptying the special ids leaves the caller's list as it is
    return vocab if special_ids is None else _emptied(vocab, special_ids)


def end_token_table(end: str, tokenizer: Any, *, special_ids: Optional[Sequence[int]] = None) -> EndTokens:
    """The tokens that close a span at ``end``, what each carries past it, and the tokens that only begin it.

    Args:
        end: the text that ends a value (non-empty), compared as UTF-8 bytes with each token's bytes.
        tokenizer: a Hugging Face-style tokenizer, or the vocabulary's bytes by id (see :func:`vocabulary_bytes`).
        special_ids: ids to treat as empty (default: the tokenizer's special tokens; with a vocabulary, none).

    Raises:
        TriggerTypeError: ``end`` is not a str. TriggerPatternError: ``end`` is empty or holds a lone surrogate.

    Example:
        >>> t = end_token_table('"}', [b'"', b'"}', b'"},', b'}', b'x"}'])
        >>> t.ids.tolist(), t.tails, t.partial_ids.tolist()
        ([1, 2], (b'', b','), [0])
    """
    if not isinstance(end, str):
        raise TriggerTypeError(f"end must be a str, got {type(end).__name__}: {end!r}")
    if not end:
        raise TriggerPatternError("end must be non-empty, got ''")
    key = utf8_bytes(end, "end", TriggerPatternError)
    vocab = _vocab_of(tokenizer, special_ids)
    ids = [i for i, b in enumerate(vocab) if b.startswith(key)]
    partial = [i for i, b in enumerate(vocab) if b and len(b) < len(key) and key.startswith(b)]
    return EndTokens(end, np.asarray(ids, dtype=np.int32), tuple(vocab[i][len(key):] for i in ids),
                     np.asarray(partial, dtype=np.int32))
