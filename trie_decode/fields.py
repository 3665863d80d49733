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
so the first token is the one the model writes there; with ``escape="json"`` they are written JSON-escaped. A space
that ends ``after`` is the value's (``":"`` + ``" Berlin"``): the trie holds each value with it (:attr:`Span.lead`).

Each span has its own ``end`` (its own dense row of end tokens; spans with one ``end`` share it). A template
(:mod:`trie_decode.templates`) is spans whose free text is forced: it replaces the trigger automaton and resumes
after each value at the text that follows its slot (:attr:`FieldRules.resume`).

Limits of this version (documented): a complete entry that is also a prefix of a longer one allows only the bare
``end`` token (not ``",``) beside its children; an entry ending in punctuation that the tokenizer merges with the
closing quote (``)",``) is closed with the bare quote, not the merged token.

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
import re
import warnings
from dataclasses import dataclass
from typing import Any, Collection, Optional, Sequence, Union

import numpy as np
import torch

from .entries import Entry, utf8_bytes
from .errors import ConstraintConfigError, EmptyTrieError, InvalidEntryError, InvalidTokenError
from .filters import restricted_trie, spec_items
from .options import token_id
from .spans import FREE
from .text_spans import EndTokens, TextTriggers, TokenTriggers, Trigger, end_token_table, vocabulary_bytes
from .tokenizers import byte_piece_ids, spelling_ids, token_bytes, tokenize_in_context, tokenizer_vocab_size
from .trie import TokenTrie

__all__ = ["Span", "FieldRules", "ESCAPES"]

#: Prompt tokens every front door feeds :meth:`FieldRules.start_state` when a row starts (the transformers processor,
#: the vLLM processors, the vLLM fast-forward driver): an ``after``, with the start of a value after it, longer than
#: this many tokens that starts in the prompt is not seen.
SPAN_PROMPT_TAIL = 64

#: How a span's values may be written: ``None`` as given, ``"json"`` JSON-escaped (inside a JSON string).
ESCAPES = (None, "json")


def lead_space(after_text: str, values: Any, exact: bool = True) -> str:
    """The space that ends ``after_text`` and that a trie of ``values`` holds in front of them (``""``: none): the
    rule of :attr:`Span.lead`, and of the space a :class:`~trie_decode.templates.Template` leaves to its slot. Value
    strings take it; a prebuilt :class:`TokenTrie` is used as given; an ``after`` matched with any whitespace, or
    that is only a space, keeps it.

    >>> lead_space("City: ", ["Rome"]), lead_space(" ", ["Rome"]), lead_space("City:", ["Rome"])
    (' ', '', '')
    """
    takes = exact and len(after_text) > 1 and after_text.endswith(" ") and not isinstance(values, TokenTrie)
    return " " if takes else ""

@dataclass(frozen=True)
class Span:
    """One catalog-valued field: the text ``after`` which a value starts, its values, the text that ends one.

    Args:
        values: a :class:`TokenTrie` built for this position (in the context of ``after``), or the value strings
            (built with the tokenizer: in context, escaped per ``escape``).
        after: the text a value follows (a ``str``, exact), or a :class:`~trie_decode.text_spans.Trigger`
            (``Trigger('"city": "', whitespace="any")`` for JSON whose whitespace varies).
        end: the text that ends a value (default ``'"'``, the closing quote of a JSON string); None: the value ends
            the output, closed by the end token (EOS), as ``on_complete="eos"`` does for a trie (a reasoning trace,
            then ``"Final answer: "`` and one entry).
        escape: ``"json"`` writes the values JSON-escaped (a ``"`` in a value becomes ``\\"``); default ``"json"``
            when ``end`` is ``'"'``, else None.
        allow, deny: the values this span may use (default all) and those it may not: entry keys (the value
            strings, or the keys of a ``values`` trie) or entry indices; a static filter, built into the span's
            trie (:func:`~trie_decode.filters.restricted_trie`: the same allowed tokens at every step).

    Example:
        >>> Span(["Paris", "Rome"], after='"city": "').escape
        'json'
    """

    values: Union[TokenTrie, Sequence[str]]
    after: Union[str, Trigger]
    end: Optional[str] = '"'
    escape: Optional[str] = "auto"
    allow: Optional[Sequence[Union[str, int]]] = None
    deny: Optional[Sequence[Union[str, int]]] = None

    def __post_init__(self) -> None:
        if not isinstance(self.after, (str, Trigger)) or (isinstance(self.after, str) and not self.after):
            raise ConstraintConfigError(f"Span.after must be a non-empty str or a Trigger, got {self.after!r}")
        if self.end is not None and (not isinstance(self.end, str) or not self.end):
            raise ConstraintConfigError(f"Span.end must be a non-empty str or None (the end token), got {self.end!r}")
        for name, text in (("after", self.after), ("end", self.end)):
            if isinstance(text, str):
                utf8_bytes(text, f"Span.{name}", ConstraintConfigError)
        escape = ("json" if self.end == '"' else None) if self.escape == "auto" else self.escape
        if escape not in ESCAPES:
            raise ConstraintConfigError(f"Span.escape must be one of {ESCAPES}, got {self.escape!r}")
        object.__setattr__(self, "escape", escape)
        object.__setattr__(self, "values", check_values(self.values, "Span.values"))
        for name in ("allow", "deny"):  # the spec rule of every filter (trie_decode.filters)
            if getattr(self, name) is not None:
                spec_items(getattr(self, name), f"Span.{name}")

    @property
    def after_text(self) -> str:
        """The literal text of ``after`` (the context values are tokenized in)."""
        return self.after.text if isinstance(self.after, Trigger) else self.after

    def written(self, value: str) -> str:
        """``value`` as the model writes it between ``after`` and ``end``."""
        return _written(value, self.escape)

    @property
    def lead(self) -> str:
        """The space that ends ``after`` and that this span's trie holds in front of its values (``""``: none).

        A model writes ``"Final answer: Berlin"`` as ``":"`` + ``" Berlin"``: the space of ``after`` and the value's
        first letters share a token. So when ``after`` is an exact text ending in a space and the values are strings,
        the trie's root is the text before that space, and every value is in it twice: spelled with the space, in
        the tokens the model writes (``" Berlin"``), and after a lone space token (``" "``, ``"Ber"``, ``"lin"``)
        for a prompt that ends with ``after``, its space a token of its own. A token that completes ``after`` enters
        the trie at the node its bytes from that space on reach (:meth:`FieldRules.entry_node`); a lone space written
        by the model is blocked unless a value's own tokens begin with it.
        """
        return lead_space(self.after_text, self.values, isinstance(self.after, str) or self.after.whitespace == "exact")

    def build_trie(self, tokenizer: Any) -> TokenTrie:
        """This span's trie: ``values`` itself, or the strings tokenized in the context of ``after``; restricted
        to ``allow`` minus ``deny``.

        Raises:
            InvalidEntryError: a value whose written text contains ``end`` (it would end the value early).
            ConstraintConfigError: an unknown key in ``allow``/``deny``, or no value left.
        """
        fix, escape_fix = self.value_fixes()
        trie = value_trie(self.values, tokenizer, self.after_text, self.end, self.escape, self.label(),
                          end_name="the span's end", fix=fix, escape_fix=escape_fix, lead=self.lead)
        allow, deny = (self._both_forms(name) for name in ("allow", "deny"))
        return restricted_trie(trie, allow, deny, self.label())

    def value_fixes(self) -> tuple[str, Optional[str]]:
        """What the caller can change when a value contains ``end`` (the messages of :meth:`build_trie` say it): the
        fix, and how to ask for JSON escaping. A front door with other options (vLLM's requests, where a span is a
        dict in ``extra_args['spans']``) overrides it and :meth:`label`, as :meth:`Template.value_fixes`."""
        return "give the span another end (Span.end)", "give escape='json' (the value is then written JSON-escaped)"

    def label(self) -> str:
        """How messages about this span's values and its ``allow``/``deny`` name it (several spans may be given)."""
        return f"Span after {self.after_text!r}"

    def _both_forms(self, name: str) -> Optional[list[Union[str, int]]]:
        """``allow`` or ``deny`` in the trie's entries: for value strings, index ``i`` is the key ``values[i]``, which
        names every entry of that value (with a :attr:`lead`, its two forms; the trie keeps one entry per distinct
        token sequence, so entry numbers are not value numbers where values repeat or a value's forms coincide).

        Raises:
            ConstraintConfigError: an index that is not a value's.
        """
        items = getattr(self, name)
        if items is None or isinstance(self.values, TokenTrie):
            return items
        values, out = list(self.values), []
        for j, item in enumerate(items):
            if isinstance(item, (int, np.integer)) and not isinstance(item, bool):
                if not 0 <= int(item) < len(values):
                    raise ConstraintConfigError(f"Span.{name}[{j}] is {item}: not the index of one of the span's "
                                                f"{len(values)} values")
                out.append(values[int(item)])
            else:
                out.append(item)
        return out


def check_values(values: Any, what: str) -> Union[TokenTrie, Sequence[str]]:
    """``values`` as a field keeps them: a :class:`TokenTrie`, or the value strings as a list or tuple (any other
    iterable, a generator too, is read once here: the trie is built per tokenizer and ``allow``/``deny`` index it).

    Raises:
        ConstraintConfigError: a single string (it would be read as one value per character), or no iterable.
            ``what`` names the field in the message.
    """
    if isinstance(values, (str, bytes)):
        raise ConstraintConfigError(f"{what} must be a TokenTrie or a list of strings, not a single string")
    if not isinstance(values, TokenTrie) and not hasattr(values, "__iter__"):
        raise ConstraintConfigError(f"{what} must be a TokenTrie or a list of strings, got {type(values).__name__}")
    return values if isinstance(values, (TokenTrie, list, tuple)) else list(values)


def value_trie(values: Union[TokenTrie, Sequence[str]], tokenizer: Any, context: str, end: Optional[str],
               escape: Optional[str], what: str, *, end_name: str = "the end", fix: str = "",
               escape_fix: Optional[str] = None, lead: str = "", entered_after_lead: bool = True) -> TokenTrie:
    """The trie of a field's values: ``values`` itself, or the strings as written (escaped per ``escape``) and
    tokenized right after ``context``, so that the first token is the one the model writes there.

    Args:
        end: the text that ends a value (None: the end token); a value whose written text contains it is refused.
        what: how the caller names the field in errors (``"Span"``, ``"slot 'city'"``).
        end_name, fix: how the caller names ``end`` (``"the span's end"``) and what its user can change when a value
            contains it (an option that call really has); ``escape_fix``: how its user asks for JSON escaping, said
            only where escaping would take ``end`` out of the value (None: the call has no such option).
        lead: the space that ends ``context`` (:attr:`Span.lead`): the trie's root is then the text before it and
            holds each value as ``lead + value``, in the tokens written after that text.
        entered_after_lead: with ``lead``, a row may also enter the trie with the space written on its own (a span
            whose prompt ends with ``after``): each value is in the trie a second time, as the lone space token and
            the value's tokens after ``context`` (one key, two entries: a distinct list counts them as one item).
            The trie's ``options`` record ``lead`` and whether a value's own tokens begin with the lone space
            (``lead_alone``), which :class:`FieldRules` reads. False: a template, which forces its text up to the
            space.

    Raises:
        InvalidEntryError: an empty or non-string value, or one whose written text contains ``end``.
    """
    if isinstance(values, TokenTrie):
        return values
    names = list(values)
    if not names:
        raise EmptyTrieError(f"{what} has no values: give at least one")
    texts = [_written(v, escape) if isinstance(v, str) else v for v in names]
    for i, text in enumerate(texts):
        if not isinstance(text, str) or not text:
            raise InvalidEntryError(f"{what} value {i} must be a non-empty string, got {names[i]!r:.60}")
        utf8_bytes(names[i], f"{what} value {i}", InvalidEntryError)
        if _contains_end(text, end, escape):
            escaping_helps = escape != "json" and not _contains_end(_written(names[i], "json"), end, "json")
            fixes = ([escape_fix] if escape_fix and escaping_helps else []) + ([fix] if fix else [])
            raise InvalidEntryError(
                f"{what} value {i} ({text!r:.60}) contains {end_name} {end!r}: it would end the value early"
                + (f"; {' or '.join(fixes)}" if fixes else "")
            )
    vocab = token_bytes(tokenizer)
    options: dict[str, Any] = {}
    if not lead:
        seqs = _value_ids(texts, tokenizer, context, vocab)
    else:
        seqs = _value_ids([lead + t for t in texts], tokenizer, context[:-len(lead)], vocab)
        if entered_after_lead:
            space = _longest_pieces(lead, tokenizer, vocab)
            if space is None or len(space) != 1:
                raise InvalidEntryError(f"no single token of this vocabulary writes the space that ends {context!r:.60}")
            options = {"lead": lead, "lead_alone": any(seq[:1] == space for seq in seqs)}
            alone = _value_ids(texts, tokenizer, context, vocab)
            seqs, names = seqs + [space + seq for seq in alone], names + names
    return TokenTrie.from_sequences(seqs, vocab_size=tokenizer_vocab_size(tokenizer), names=names, options=options)


def check_values_can_end(tries: Sequence[TokenTrie], rules: "FieldRules", labels: Sequence[str],
                         fixes: Sequence[str]) -> None:
    """Refuse a value that could never be written: at a complete entry that a longer entry continues, the only token
    that ends the value is the field's bare end token (:attr:`FieldRules.bare_ends`); where the longer entry
    continues with that very token (values ``"Inc"`` and ``"Inc."`` before the text ``". "``), the row always goes
    on and the shorter value is lost. ``labels``, ``fixes``: per field, how its messages name it and what its caller
    can change.

    A field closed by the end token (``end=None``) is left to the stop-token check: a value that goes on past that
    token holds it inside, where generation stops (:func:`~trie_decode.constraint.check_stop_tokens_outside_entries`).

    Raises:
        InvalidEntryError: naming the lost value, the one that continues it, and the token.
    """
    def named(entry: Entry) -> str:
        return f"{entry.name!r:.60}" if entry.name is not None else f"of entry {entry.index} {list(entry.tokens)[:8]}"

    for k, trie in enumerate(tries):
        bare = rules.bare_ends[k]
        node = np.flatnonzero(trie.token == bare)
        lost = node[trie.node_entry[trie.parent[node]] >= 0]
        if len(lost) and rules.ends[k].end:
            short, below = trie.entry_at(int(trie.parent[lost[0]])), int(lost[0])
            while trie.node_entry[below] < 0:  # the first entry under that token
                below = int(trie.child_ptr[below])
            token = bytes(rules._vocab[bare]).decode("utf-8", "replace")
            raise InvalidEntryError(
                f"{labels[k]}: the value {named(short)} could never be written: the value "
                f"{named(trie.entry_at(below))} goes on from it with the token {token!r}, the only one that ends it "
                f"there; {fixes[k]}")


def _value_ids(texts: Sequence[str], tokenizer: Any, context: str, vocab: Sequence[bytes]) -> list[list[int]]:
    """Each text's ids right after ``context``, spelling exactly the text (a value that merges with its context
    gets its own ids, which never open with SentencePiece's dummy-prefix space where a newline before it merges with
    nothing: :func:`~trie_decode.tokenizers.tokenize_in_context`; else :func:`_spelled_exactly`)."""
    seqs = tokenize_in_context(texts, tokenizer, context, separator="", on_unstable="raw")
    for i, seq in enumerate(seqs):
        if _spelled(seq, vocab) == b" " + texts[i].encode("utf-8"):
            seqs[i] = _spelled_exactly(texts[i], tokenizer, vocab)
    return seqs


def _spelled(ids: Sequence[int], vocab: Sequence[bytes]) -> bytes:
    return b"".join(vocab[t] if 0 <= t < len(vocab) else b"" for t in ids)


def _spelled_exactly(text: str, tokenizer: Any, vocab: Sequence[bytes]) -> list[int]:
    """Ids writing exactly ``text``, for a value whose own ids open with SentencePiece's dummy-prefix space even
    after a newline (a value that starts with one): the longest tokens
    (:func:`_longest_pieces`)."""
    ids = _longest_pieces(text, tokenizer, vocab)
    if ids is None:
        raise InvalidEntryError(f"no tokens of this vocabulary write the value {text!r:.60}")
    return ids


def _longest_pieces(text: str, tokenizer: Any, vocab: Sequence[bytes]) -> Optional[list[int]]:
    """Ids writing exactly ``text``, the longest tokens first (:func:`~trie_decode.tokenizers.spelling_ids`),
    byte-fallback pieces only where no other token has their bytes; None where no tokens write it."""
    return spelling_ids(text.encode("utf-8"), vocab, avoid=set(byte_piece_ids(tokenizer, range(len(vocab)))))


def _contains_end(text: str, end: Optional[str], escape: Optional[str]) -> bool:
    """Whether a value written as ``text`` contains ``end`` (in a JSON-escaped value, an escaped character never ends
    it: ``\\"`` is not a closing quote)."""
    return bool(end) and end in (re.sub(r"\\.", "", text) if escape == "json" else text)


def _written(value: str, escape: Optional[str]) -> str:
    """``value`` as the model writes it (JSON-escaped inside a JSON string)."""
    return json.dumps(value, ensure_ascii=False)[1:-1] if escape == "json" else value


def _span_triggers(afters: Sequence[Union[str, Trigger]], ends: Sequence[Optional[str]], vocab: list[bytes]
                   ) -> TokenTriggers:
    """The automaton over the spans' ``after`` patterns (pattern ``k`` is span ``k``), lifted to ``vocab``, once
    every span can start and end (a completed ``after`` enters its span at once, whatever text was to follow).

    Raises:
        ConstraintConfigError: a span that could never start: its ``after`` text completes another span's on the
            way (that span is entered there), or wherever it completes, an earlier span's completes too (the same
            text, or a text it ends with; the earliest span is the one entered). A span whose ``end`` text
            completes an ``after``: each value would open another, and the output could never end.
    """
    triggers = TextTriggers(list(afters))
    texts = [p.text for p in triggers.patterns]
    reported = set(triggers.accept.tolist())
    for k, pattern in enumerate(triggers.patterns):
        text = pattern.text
        # An exact pattern is one text: a completion on its way is where every row that writes it is entered (a
        # whitespace-tolerant one may be written with other whitespace, which the earlier pattern need not match).
        first, at = triggers.find_all(text)[0] if pattern.whitespace == "exact" else (k, len(text.encode("utf-8")))
        if at < len(text.encode("utf-8")):
            raise ConstraintConfigError(
                f"span {k} (after {text!r}) can never start: its after text holds span {first}'s after text "
                f"{texts[first]!r}, and that span is entered there; give span {first} a longer after text (one its "
                f"text does not hold), or leave it out")
        if k not in reported:
            first = triggers.completed(triggers.start_state(text))
            raise ConstraintConfigError(
                f"span {k} (after {text!r}) can never start: wherever its after text completes, span "
                f"{first}'s (after {texts[first]!r}) completes too, and the earlier span is "
                f"entered; give each span its own after text, or put span {k} first")
    for k, end in enumerate(ends):
        reopened = triggers.find_all(end) if end is not None else []
        if reopened:
            j = reopened[0][0]
            raise ConstraintConfigError(
                f"span {k}'s end {end!r} completes span {j}'s after {texts[j]!r}: each value would open another "
                f"value at once, and the output could never end; give span {j} an after text its end does not "
                f"complete (e.g. one that starts with the key, '\"city\": \"')")
    return triggers.for_tokens(vocab)


def _end_tables(ends: Sequence[Optional[str]], vocab: list[bytes], end_token_id: Optional[int] = None
                ) -> list[EndTokens]:
    """Each span's end-token table; spans with one ``end`` share its table (and its dense row). ``end`` None: the end
    token alone (it carries no text).

    Raises:
        ConstraintConfigError: an ``end_token_id`` that is not a non-negative token id, or none where a span needs it.
    """
    if end_token_id is not None:
        end_token_id = token_id(end_token_id, "end_token_id")
    tables: dict[Optional[str], EndTokens] = {}
    for end in ends:
        if end not in tables:
            if end is not None:
                tables[end] = end_token_table(end, vocab)
            elif end_token_id is None:
                raise ConstraintConfigError("a Span with end=None is closed by the end token: give end_token_id")
            else:
                tables[end] = EndTokens.end_token(end_token_id)
    return [tables[end] for end in ends]


class FieldRules:
    """What the step engine reads for a set of spans: the shared trigger automaton, the end tokens, and per span
    the root child reached by the bytes a trigger-completing token carries past ``after``.

    Compared by identity (it keys cached step tables). Build it with :meth:`build` (spans and a tokenizer) or
    :meth:`from_tokens` (tries, ``after`` patterns and a token byte table).

    Attributes:
        triggers: the automaton over every span's ``after`` (pattern ``k`` is span ``k``).
        ends: per span, the tokens beginning with its ``end`` (:class:`~trie_decode.text_spans.EndTokens`).
        bare_ends, end_rows: per span, the shortest end token (what a complete entry that prefixes a longer one
            allows beside its children; not a byte-fallback piece where another token has its bytes) and the dense
            row of a complete leaf entry.
        resume: per span, the automaton state a closed value restarts from.
    """

    def __init__(self, triggers: TokenTriggers, end: Union[EndTokens, Sequence[EndTokens]], vocab: Sequence[bytes],
                 tries: Sequence[TokenTrie], *, resume: Optional[Sequence[int]] = None,
                 byte_pieces: Collection[int] = ()):
        ends = [end] * len(tries) if isinstance(end, EndTokens) else list(end)
        if len(ends) != len(tries):
            raise ConstraintConfigError(f"{len(ends)} end-token tables for {len(tries)} spans")
        for e in ends:
            if len(e.ids) == 0:
                raise ConstraintConfigError(f"no token of this vocabulary begins with the span end {e.end!r}")
            if int(e.ids.min()) < 0 or int(e.ids.max()) >= len(vocab):  # an end token id given by the caller
                bad = int(e.ids[(e.ids < 0) | (e.ids >= len(vocab))][0])
                raise InvalidTokenError(f"token {bad}, which closes a span's value, is outside the vocabulary "
                                        f"[0, {len(vocab)})")
        self.triggers, self.ends = triggers, ends
        self.vocab_size = len(vocab)
        #: The largest token id these rules allow of their own (an end token; a template's fixed text too): the
        #: logits must be wider (``TrieConstraint.needed_width``).
        self.max_token = max(int(e.ids.max()) for e in ends) if ends else -1
        #: Per span: the token a complete entry that prefixes a longer one allows beside its children (the shortest
        #: end token; of several, not one of ``byte_pieces``, the byte-fallback pieces ``<0x22>`` a model almost never
        #: writes where ``"`` spells the same byte, then the lowest id) and the dense row of a complete leaf entry
        #: (True where a column is blocked, Shape: (V,)).
        self.bare_ends: list[int] = []
        self.end_rows: list[np.ndarray] = []
        rows: dict[int, tuple[int, np.ndarray]] = {}  # spans sharing one table share its row
        for e in ends:
            if id(e) not in rows:
                lengths = [len(vocab[int(t)]) for t in e.ids]
                shortest = [int(t) for t, n in zip(e.ids, lengths) if n == min(lengths)]  # ids sorted
                bare = next((t for t in shortest if t not in byte_pieces), shortest[0])
                blocked = np.ones(self.vocab_size, dtype=np.bool_)
                blocked[e.ids] = False
                rows[id(e)] = (bare, blocked)
            self.bare_ends.append(rows[id(e)][0])
            self.end_rows.append(rows[id(e)][1])
        #: Per span: the automaton state a row restarts from when it closes that span's value (fed the closing
        #: token): the start state for free-text spans; in a template, the fixed text after the slot.
        self.resume = np.zeros(len(tries), dtype=np.int64) if resume is None else np.asarray(resume, dtype=np.int64)
        #: Per span: the space ending its ``after`` that its trie's root does not hold (:attr:`Span.lead`, recorded in
        #: the trie's ``options`` by :func:`value_trie`), and whether a row that writes that space on its own may
        #: enter (some value's own tokens begin with it; else the lone space is a dead trigger token, and only a
        #: prompt ending with the space starts on that path).
        self.leads: list[bytes] = [str(t.options.get("lead", "")).encode("utf-8") for t in tries]
        self.lead_alone: list[bool] = [bool(t.options.get("lead_alone", True)) for t in tries]
        # Per span (and False at index -1, no span): a lone space completing its ``after`` is dead.
        self._lone_dead = np.array([bool(lead) and not alone for lead, alone in zip(self.leads, self.lead_alone)]
                                   + [False])
        # Per span: bytes of each root child's token -> that child (a trigger token may carry the first bytes).
        self.root_by_bytes: list[dict[bytes, int]] = []
        for trie in tries:
            tokens, nodes = trie.children(trie.root)
            self.root_by_bytes.append({bytes(vocab[int(t)]): int(n) for t, n in zip(tokens, nodes) if int(t) < len(vocab)})
        for k, lead in enumerate(self.leads):  # a prompt ending with the space starts on the lone-space form
            if lead and lead not in self.root_by_bytes[k]:
                raise ConstraintConfigError(
                    f"span {k}'s trie starts before the space that ends its after text (options['lead']) but holds "
                    "no value after that space alone: build it with Span(values=[...strings]), not a subset of one")
        self._vocab = vocab
        self.tries = list(tries)
        self._end_sets = [frozenset(e.ids.tolist()) for e in ends]  # per span: the tokens that close its value
        self._dead: dict[int, np.ndarray] = {}
        self._dead_flag = np.full(triggers.num_states, -1, dtype=np.int8)  # per state: has dead tokens (-1: unknown)

    @property
    def end(self) -> EndTokens:
        """The end tokens of span 0 (every span's, for free-text spans, which share one ``end``)."""
        return self.ends[0]

    @property
    def bare_end(self) -> int:
        """Span 0's bare end token (see :attr:`bare_ends`)."""
        return self.bare_ends[0]

    def start_state(self, ids: Sequence[int]) -> tuple[int, int, int]:
        """Where a row whose prompt ends with the tokens ``ids`` starts: its automaton state, the span it is in (-1:
        none) and its node in that span's trie (FREE: none).

        The prompt is read as the row's own text: a prompt that ends with a span's ``after`` starts at that span's
        root; one that goes on into a value (``'"city": "Par'``) starts where the value's tokens lead in the trie,
        so the row writes the rest of an entry. A value the prompt closes (a few-shot example's ``"Paris"``) or
        leaves through a special token (the chat template's end of turn after an instruction that quotes the
        ``after``) leaves the row in free text. Tokens after the ``after`` that are no path of the trie start the
        row in free text too, with a warning for a span that an end text closes (its value is then not
        constrained: end the prompt with the ``after`` text)."""
        ids = [t for t in ids if 0 <= t < self.vocab_size]
        state, fired, span, past = 0, -1, -1, 0
        for i, token in enumerate(ids):
            state, k, p = self.text_move(state, token)
            if k >= 0:
                fired, span, past = i, k, p
        if span < 0:
            return state, -1, FREE
        node = self.start_node(span, self.carried(ids[fired], past))
        for token in ids[fired + 1:]:
            if not self._vocab[token] or token in self._end_sets[span]:
                return state, -1, FREE  # closed, or left through a special token: the prompt is in free text
            node = self.tries[span].step(node, token) if node >= 0 else -1
        if node < 0:  # the value's text is not a path of the trie: no value can follow
            if self.ends[span].end:
                value = b"".join(self._vocab[t] for t in ids[fired + 1:]).decode("utf-8", "replace")
                warnings.warn(f"the prompt ends inside a value of span {span} ({value!r:.60} after its after text), "
                              "which is no path of the span's trie: that value is not constrained; end the prompt "
                              "with the after text", stacklevel=3)
            return state, -1, FREE
        return state, span, node

    def free_rows_(self, logits: Any, node: Any, text: Any, rows: Any = None) -> None:
        """The span rule for rows outside every value (in place): see :meth:`block_dead_triggers_`."""
        self.block_dead_triggers_(logits, node, text, rows)

    def forced_text(self, state: int) -> list[int]:
        """The tokens a FREE row in automaton ``state`` is forced to write: none in free text."""
        return []

    def forced_text_runs(self) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """Per automaton state, the length of :meth:`forced_text` and whether it ends the output (ends with the end
        token), for the fast-forward stop (``TrieConstraint.stop_at_forced``); None when no state forces text."""
        return None

    def dead_tokens(self, state: int) -> np.ndarray:
        """The tokens that, written in automaton state ``state``, would complete a span's ``after`` and carry bytes
        that no value of that span starts with (``' "['`` before a catalog of names), or a space alone where the
        values carry it (:meth:`entry_node`): blocked, so that no row ever completes a trigger it cannot follow with
        a value in the model's own tokens. Cached per state. Shape: (D,), int64."""
        found = self._dead.get(state)
        if found is None:
            _, pattern, past = self.triggers.row(state)
            fired = np.flatnonzero((pattern >= 0) & ((past > 0) | self._lone_dead[pattern]))
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
        if node.numel() == 1 and node.is_cpu:  # the batch-1 decode loop: Python ints
            if int(node) != FREE:
                return
            state = int(text)
            dead = self._dead.get(state)  # the per-state cache itself (a dict read: no numpy scalar per step)
            if dead is None:
                dead = self.dead_tokens(state)
            if len(dead):
                logits[0 if rows is None else int(rows[0]), torch.from_numpy(dead[dead < logits.shape[-1]])] = float("-inf")
            return
        free = np.flatnonzero(node.cpu().numpy() == FREE)
        if not len(free):
            return
        states = text.cpu().numpy()[free]
        flags = self._dead_flag[states]
        for s in np.unique(states[flags < 0]).tolist():
            self._dead_flag[s] = len(self.dead_tokens(s)) > 0
        width = logits.shape[-1]
        for j in np.flatnonzero(self._dead_flag[states] == 1).tolist():
            i = int(free[j])
            dead = self.dead_tokens(int(states[j]))  # the host copy: no device read per row
            r = i if rows is None else int(rows[i])
            logits[r, torch.from_numpy(dead[dead < width]).to(logits.device)] = float("-inf")

    def text_move(self, src: int, token: int) -> tuple[int, int, int]:
        """A free row's text automaton fed ``token`` from state ``src``: (next state, span fired or -1, bytes past its
        ``after``). An id past the automaton's vocabulary (a model's padded logits, which a free row may sample)
        writes no text: the row stays where it was."""
        return self.triggers.step(src, token) if token < self.triggers.vocab_size else (src, -1, 0)

    def text_moves(self, src: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`text_move` for several rows (one batched automaton step, a scalar one for a single row).
        Shape: (R,) each."""
        if len(src) == 1:
            return tuple(np.array([v]) for v in self.text_move(int(src[0]), int(tokens[0])))  # type: ignore[return-value]
        known = tokens < self.triggers.vocab_size
        nxt, fired, past = (t.numpy() for t in self.triggers.advance(torch.from_numpy(src),
                                                                      torch.from_numpy(np.where(known, tokens, 0))))
        return np.where(known, nxt, src), np.where(known, fired, -1), past

    def entry_node(self, span: int, token: int, past: int) -> int:
        """Where a row enters ``span``'s trie after ``token`` completed its ``after`` with ``past`` bytes left: the
        root, the root child those bytes spell (after the span's :attr:`leads` space, which its root does not hold:
        ``" Berlin"``, or the lone space with nothing carried), or -1 (a dead trigger token, see :meth:`dead_tokens`).
        A lone space written where no value's own tokens begin with it is a dead trigger token: the model writes
        the space with the value (``" Berlin"``)."""
        carried = self.carried(token, past)
        if self.leads[span] and not carried and not self.lead_alone[span]:
            return -1
        return self.start_node(span, carried)

    def start_node(self, span: int, carried: bytes = b"") -> int:
        """The node of ``span``'s trie where a row that has written its ``after`` (and ``carried``, bytes past it)
        stands: the root, or the child those bytes spell from the span's :attr:`leads` space on (-1: none). A prompt
        that ends with ``after`` starts here with nothing carried."""
        key = self.leads[span] + carried
        return 0 if not key else self.root_by_bytes[span].get(key, -1)

    def carried(self, token: int, past: int) -> bytes:
        """The last ``past`` bytes of ``token``: what it carries past a completed ``after``."""
        data = self._vocab[token]
        return bytes(data[len(data) - past:]) if past else b""

    @classmethod
    def from_tokens(cls, tries: Sequence[TokenTrie], afters: Sequence[Union[str, Trigger]],
                    end: Union[None, str, Sequence[Optional[str]]], vocab: Sequence[bytes],
                    end_token_id: Optional[int] = None) -> "FieldRules":
        """From the spans' tries, their ``after`` patterns, their ``end`` (one for all, or one per span; None: the
        span is closed by ``end_token_id``) and a token byte table."""
        vocab = list(vocab)
        ends = [end] * len(tries) if end is None or isinstance(end, str) else list(end)
        triggers = _span_triggers(afters, ends, vocab)
        return cls(triggers, _end_tables(ends, vocab, end_token_id), vocab, tries)

    @classmethod
    def build(cls, spans: Sequence[Span], tokenizer: Any, end_token_id: Optional[int] = None,
              ) -> tuple[list[TokenTrie], "FieldRules"]:
        """The spans' tries and their field rules for ``tokenizer``.

        Args:
            end_token_id: the token that closes a span with ``end=None`` (default: the tokenizer's EOS).

        Raises:
            ConstraintConfigError: ``spans`` is not a list, no spans, an item that is not a :class:`Span`, or no
                end token for a span with ``end=None`` (or one that is not a non-negative token id).
        """
        if not isinstance(spans, Span) and not hasattr(spans, "__iter__"):
            raise ConstraintConfigError(f"spans must be a list of Span, got {type(spans).__name__}: {spans!r:.60}")
        spans = list(spans) if not isinstance(spans, Span) else [spans]
        if not spans:
            raise ConstraintConfigError("spans is empty: give at least one Span")
        for i, s in enumerate(spans):
            if not isinstance(s, Span):
                raise ConstraintConfigError(f"spans[{i}] is {type(s).__name__}, not a Span")
        tries = [s.build_trie(tokenizer) for s in spans]
        vocab = vocabulary_bytes(tokenizer)
        vocab += [b""] * max(0, max(t.vocab_size for t in tries) - len(vocab))
        triggers = _span_triggers([s.after for s in spans], [s.end for s in spans], vocab)
        if end_token_id is None and any(s.end is None for s in spans):
            end_token_id = getattr(tokenizer, "eos_token_id", None)
        ends = _end_tables([s.end for s in spans], vocab, end_token_id)
        pieces = byte_piece_ids(tokenizer, sorted({int(t) for e in ends for t in e.ids}))
        rules = cls(triggers, ends, vocab, tries, byte_pieces=set(pieces))
        check_values_can_end(tries, rules, [s.label() for s in spans], [s.value_fixes()[0] for s in spans])
        return tries, rules

    def __repr__(self) -> str:
        return (f"FieldRules(spans={len(self.root_by_bytes)}, ends={sorted({e.end for e in self.ends})!r}, "
                f"automaton_states={self.triggers.num_states})")
