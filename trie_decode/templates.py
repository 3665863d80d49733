"""Templates: an output that is fixed text with catalog-valued slots, built in one call, its fixed text forced.

Why this exists: often the whole answer has a known shape, ``'{"city": "{city}", "country": "{country}"}'``, and
only the slots are the model's choice. Writing that as free text plus spans (:mod:`trie_decode.fields`) leaves the
fixed text to the model; a template forces it: between slots exactly one token is allowed per step (the fixed text's
own tokens), so fast-forward decoding (``fast_forward_generate``, the vLLM driver) feeds it without a decision.

A template is text spans read by the same step engine, with two tables in place of the free-text ones:

- :class:`TemplateText`, an automaton over positions in the fixed texts, replaces the trigger automaton: a row
  outside every value is FREE and its text state is its position; the position's next token is the only one allowed
  (:meth:`TemplateRules.free_rows_`), and reaching the end of the text before slot ``k`` enters slot ``k``'s trie;
- each slot's values end with the tokens that begin the text after it (its own end row: ``",`` after ``city``,
  ``"}`` after ``country``), and a closed value resumes the automaton at the text after its slot
  (``FieldRules.resume``). A slot at the very end of the template ends with the end token (EOS).

Fixed text is written in its canonical tokens (tokenized in context); values are tokenized right after the text
before their slot, as spans are. The end of the template allows only the end token.

Example:
    >>> from trie_decode.templates import Template
    >>> t = Template('{"city": "{city}", "country": "{country}"}', city=["Paris", "Rome"], country=["France", "Italy"])
    >>> t.segments, t.slot_names
    (['{"city": "', '", "country": "', '"}'], ['city', 'country'])
"""

from __future__ import annotations

import re
from typing import Any, Collection, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from .entries import utf8_bytes
from .errors import ConstraintConfigError, InvalidTokenError
from .fields import FieldRules, check_values, check_values_can_end, lead_space, value_trie
from .kernels.rules import floor_rule, kept_alive
from .options import token_id
from .spans import FREE, SpanRules
from .text_spans import EndTokens, vocabulary_bytes
from .tokenizers import byte_piece_ids, spelling_ids, tokenize_in_context
from .trie import TokenTrie

__all__ = ["Template", "TemplateText", "TemplateRules", "template_slots"]

#: ``{name}`` (a Python identifier) is a slot; every other brace is text; ``{{name}}`` writes ``{name}`` literally.
SLOT = re.compile(r"\{\{([A-Za-z_][A-Za-z0-9_]*)\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}")
#: What a template's slot holds: a trie built for its position, or the value strings.
SlotValues = Union[TokenTrie, Sequence[str]]


def template_slots(text: str) -> tuple[list[str], list[str]]:
    """A template text's fixed segments (one more than the slots) and its slot names, in order.

    Raises:
        ConstraintConfigError: not a non-empty str (or one holding a lone surrogate), no slot, or two slots with no
            text between them (nothing would end the first).

    Example:
        >>> template_slots("A: {x}, {{y}} {z}.")
        (['A: ', ', {y} ', '.'], ['x', 'z'])
    """
    if not isinstance(text, str) or not text:
        raise ConstraintConfigError(f"a template must be a non-empty str, got {text!r:.60}")
    utf8_bytes(text, "the template", ConstraintConfigError)
    segments, names, pos = [], [], 0
    piece = ""
    for m in SLOT.finditer(text):
        if m.group(1) is not None:  # {{name}}: literal braces
            piece += text[pos:m.start()] + "{" + m.group(1) + "}"
        else:
            segments.append(piece + text[pos:m.start()])
            names.append(m.group(2))
            piece = ""
        pos = m.end()
    segments.append(piece + text[pos:])
    if not names:
        raise ConstraintConfigError(f"the template {text!r:.80} has no slot: mark one with {{name}}")
    for k in range(1, len(names)):
        if not segments[k]:
            raise ConstraintConfigError(f"slots {{{names[k - 1]}}} and {{{names[k]}}} are adjacent: put text "
                                        "between them (the text after a slot is what ends its value)")
    return segments, names


class Template:
    """Fixed text with slots, each filled from its own catalog.

    Args:
        text: the output's shape; ``{name}`` marks a slot (``{{name}}`` is the literal text ``{name}``; other
            braces, as in JSON, are text).
        escape: how values are written: ``"json"`` (JSON-escaped), None (as given), or ``"auto"`` (default:
            ``"json"`` for a slot right after a ``"``).
        slots: each slot's values, by name (a list of strings, or a :class:`TokenTrie` built for the position).
            A slot may be named ``text``; one named ``escape`` takes its values through :meth:`from_slots`
            (``Template.from_slots(text, {"escape": [...]})``), as do slots named at run time.

    Raises:
        ConstraintConfigError: no slot, a slot without values (or values for no slot), two slots with no text
            between them (nothing would end the first).

    Example:
        >>> Template("Capital: {city}.", city=["Paris"]).segments
        ['Capital: ', '.']
    """

    def __init__(self, text: str, /, *, escape: Optional[str] = "auto", **slots: SlotValues):
        self._init(text, escape, slots, keywords=True)

    @classmethod
    def from_slots(cls, text: str, slots: Mapping[str, SlotValues], /, *, escape: Optional[str] = "auto"
                   ) -> "Template":
        """A template whose slots' values are given as one mapping, by name: any slot name works, ``escape``
        included (``Template(text, escape=[...])`` would set the escaping mode).

        Example:
            >>> Template.from_slots('{"escape": "{escape}"}', {"escape": ["yes", "no"]}).slot_names
            ['escape']
        """
        if not isinstance(slots, Mapping):
            raise ConstraintConfigError(f"Template.from_slots takes the slots' values as a mapping (slot name -> "
                                        f"values), got {type(slots).__name__}")
        template = cls.__new__(cls)
        template._init(text, escape, dict(slots), keywords=False)
        return template

    def _init(self, text: str, escape: Optional[str], slots: dict, keywords: bool) -> None:
        """The constructor's work; ``keywords``: the values came as keywords (what the messages suggest)."""
        segments, names = template_slots(text)
        missing = [n for n in dict.fromkeys(names) if n not in slots]
        if missing:
            if keywords and "escape" not in missing:
                how = f"give them as keywords, e.g. Template(text, {missing[0]}=[...])"
            elif keywords:  # escape= is the escaping mode: the slot's values go in a mapping
                how = ("the slot {escape} takes its values through Template.from_slots(text, {'escape': [...]}) "
                       "(escape= is how values are written)")
            else:
                how = f"add them to the slots mapping, e.g. Template.from_slots(text, {{{missing[0]!r}: [...]}})"
            raise ConstraintConfigError(f"template slots without values: {missing}; {how}")
        unused = sorted(set(slots) - set(names))
        if unused:
            raise ConstraintConfigError(f"values given for slots the template does not have: {unused} "
                                        f"(its slots: {list(dict.fromkeys(names))})")
        slots = {name: check_values(slots[name], f"slot {name!r}") for name in dict.fromkeys(names)}
        if escape not in ("auto", "json", None):
            raise ConstraintConfigError(f"escape must be 'auto', 'json' or None, got {escape!r}")
        self.text, self.segments, self.slot_names, self.slots = text, segments, names, slots
        self.escape = escape
        self._built: dict[tuple[int, int], tuple[Any, list[TokenTrie], TemplateRules]] = {}

    def slot_escape(self, k: int) -> Optional[str]:
        """How slot ``k``'s values are written (see ``escape``)."""
        if self.escape != "auto":
            return self.escape
        return "json" if self.segments[k].endswith('"') else None

    def value_fixes(self, k: int) -> tuple[str, Optional[str]]:
        """What the caller can change when a value of slot ``k`` contains the text after the slot (the messages of
        :meth:`build` say it): the fix, and how to ask for JSON escaping (None: not offered). A front door with other
        options (vLLM's requests: no ``escape``) overrides it."""
        name = self.slot_names[k]
        return (f"change the template's text after {{{name}}}, or leave the value out",
                "give escape='json' (values are then written JSON-escaped)")

    def build(self, tokenizer: Any, end_token_id: int) -> tuple[list[TokenTrie], "TemplateRules"]:
        """The slots' tries and the rules the step engine reads (``SpanRules(..., fields=rules)``), built once per
        tokenizer and end token (kept with the template).

        Raises:
            InvalidEntryError: a value whose written text contains the text that ends its slot.
            ConstraintConfigError: a text after a slot that no token begins (nothing could end the value), or an
                ``end_token_id`` that is not a non-negative token id.
            InvalidTokenError: an ``end_token_id`` outside the vocabulary.
        """
        end = token_id(end_token_id, "end_token_id")
        key = (id(tokenizer), end)
        found = self._built.get(key)
        if found is None or found[0] is not tokenizer:
            found = self._built[key] = (tokenizer, *self._build(tokenizer, end))
        return found[1], found[2]

    def prebuilt(self, end_token_id: int, fix: str = "pass tokenizer=, or call template.build(tokenizer, "
                 "{end}) once before generate") -> tuple[list[TokenTrie], "TemplateRules"]:
        """What :meth:`build` made for ``end_token_id`` (for a caller without the tokenizer, such as
        ``generate(custom_generate=...)``, which keeps its ``tokenizer=`` argument).

        Args:
            fix: what the caller's own call can do, named in the error (``{end}``: the end token).

        Raises:
            ConstraintConfigError: the template was not built for that end token, or for several tokenizers; an
                ``end_token_id`` that is not a non-negative token id.
        """
        end = token_id(end_token_id, "end_token_id")
        found = [v for (_, built_end), v in self._built.items() if built_end == end]
        if len(found) != 1:
            what = (f"was built for {len(found)} tokenizers with end token {end} (which one is unknown)" if found
                    else f"was not built for end token {end}")
            raise ConstraintConfigError(f"this template {what}: {fix.format(end=end)}")
        return found[0][1], found[0][2]

    def fixed_texts(self) -> list[str]:
        """The texts the template forces: its segments, less the space that ends a text before a slot (``"City: "``
        before ``{city}`` is forced as ``"City:"``). That space belongs to the slot's values (:attr:`Span.lead`): the
        model writes ``":"`` + ``" Berlin"``, not a lone space and then ``"Ber"``. A segment that is only a space
        stays whole, and so does one before a slot given as a :class:`TokenTrie` (used as given, as a span's). The
        value before such a text ends where the forced text begins, so it may not contain that text without its
        space either (``"1,000"`` before ``", {unit}"``).

        Example:
            >>> Template("City: {city}, {country}.", city=["Rome"], country=["Italy"]).fixed_texts()
            ['City:', ',', '.']
        """
        return [s[:-1] if k < len(self.slot_names) and lead_space(s, self.slots[self.slot_names[k]]) else s
                for k, s in enumerate(self.segments)]

    def _build(self, tokenizer: Any, end_token_id: int) -> tuple[list[TokenTrie], "TemplateRules"]:
        vocab = vocabulary_bytes(tokenizer)
        fixed = self.fixed_texts()
        tries = []
        for k, name in enumerate(self.slot_names):
            # A value may not contain the text after its slot (a reader could not tell where it ends).
            after, end = self.segments[k], fixed[k + 1] or None
            fix, escape_fix = self.value_fixes(k)
            tries.append(value_trie(self.slots[name], tokenizer, after, end, self.slot_escape(k), f"slot {name!r}",
                                    end_name=f"the text after {{{name}}}", fix=fix, escape_fix=escape_fix,
                                    lead=after[len(fixed[k]):], entered_after_lead=False))
        width = max([len(vocab)] + [t.vocab_size for t in tries])
        if end_token_id >= width:  # padding the vocabulary up to it would hold one entry per id below it
            raise InvalidTokenError(f"end_token_id {end_token_id} is outside the vocabulary [0, {width}) of the "
                                    "tokenizer and the slots' tries: give the model's end token (its EOS)")
        vocab += [b""] * (width - len(vocab))
        segments = [s.encode("utf-8") for s in fixed]
        # The output's first tokens: SentencePiece tokenizers open a text with a space ("▁{"), which is written too.
        first = tokenize_in_context([fixed[0]], tokenizer, "", separator="")[0] if fixed[0] else []
        spelled = b"".join(vocab[i] for i in first)
        if spelled != segments[0]:
            if spelled == b" " + segments[0]:
                segments[0] = spelled
            else:  # the tokenizer rewrote the text (a normalizer: NFC, lowercase): spell its bytes as other segments
                first = []
        text = TemplateText(segments, vocab)
        text.learn_tokens(tokenizer, end_token_id, first)
        ends = {int(t) for k in range(len(self.slot_names)) for t in text.end_tokens(k).ids}
        pieces = set(byte_piece_ids(tokenizer, sorted(ends)))
        rules = TemplateRules(text, vocab, tries, end_token_id, self.slot_names, byte_pieces=pieces)
        check_values_can_end(tries, rules, [f"slot {name!r}" for name in self.slot_names],
                             [self.value_fixes(k)[0] for k in range(len(self.slot_names))])
        return tries, rules

    def rules(self, tokenizer: Any, end_token_id: int) -> tuple[list[TokenTrie], SpanRules]:
        """The slots' tries and the :class:`SpanRules` of a :class:`~trie_decode.constraint.TrieConstraint`.

        Example:
            >>> from trie_decode.constraint import TrieConstraint                       # doctest: +SKIP
            >>> TrieConstraint(*Template("A: {x}.", x=["b"]).rules(tok, tok.eos_token_id), "cpu")  # doctest: +SKIP
        """
        tries, fields = self.build(tokenizer, end_token_id)
        return tries, SpanRules(end_token_id=end_token_id, on_complete="release", fields=fields)

    def __repr__(self) -> str:
        return f"Template({self.text!r:.80}, slots={self.slot_names})"


class TemplateText:
    """Positions in a template's fixed texts, as an automaton over tokens (the interface of
    :class:`~trie_decode.text_spans.TokenTriggers` that the step engine uses: :meth:`step`, :meth:`advance`).

    State ``base[k] + j``: ``j`` bytes of segment ``k`` (the text before slot ``k``; the last segment follows the
    last slot) are written. A token that writes the rest of segment ``k`` fires slot ``k`` (past 0; one that runs
    on into the value fires it with the bytes past the segment); one that writes part of it moves on; any other
    token leads to :attr:`dead` (which the mask never allows). :attr:`keep` holds each state's next canonical
    token (:meth:`learn_tokens`).

    Args:
        segments: the fixed texts as UTF-8 bytes, one more than the slots.
        vocab: each token's bytes.
    """

    def __init__(self, segments: Sequence[bytes], vocab: Sequence[bytes]):
        self.segments = list(segments)
        self.vocab = list(vocab)
        self.num_slots = len(segments) - 1
        self.base = np.concatenate([[0], np.cumsum([len(s) + 1 for s in segments])]).astype(np.int64)
        #: A state no allowed token leads to (only the end token is allowed there).
        self.dead = int(self.base[-1])
        self.num_states = self.dead + 1
        #: Per state: the one token a FREE row may write (-1 until learned), and where it leads.
        self.keep = np.full(self.num_states, -1, dtype=np.int64)
        # Per state: its segment and the bytes of it written (host lists: the step is a Python-int path).
        self._keep_next = np.full(self.num_states, self.dead, dtype=np.int64)
        self._keep_fired = np.full(self.num_states, -1, dtype=np.int64)
        self._where = [(k, j) for k, seg in enumerate(self.segments) for j in range(len(seg) + 1)] + [(-1, 0)]

    @property
    def vocab_size(self) -> int:
        """The ids whose text is known (as :class:`~trie_decode.text_spans.TokenTriggers`'): an id past them (a
        model's padded logits) writes no text, and the step engine keeps the row's state."""
        return len(self.vocab)

    def position(self, state: int) -> tuple[int, int]:
        """(segment, bytes written of it) of ``state``; (-1, 0) for :attr:`dead`."""
        return self._where[state]

    def final(self, state: int) -> bool:
        """Whether ``state`` is the end of the template (every segment written)."""
        return state == self.dead - 1

    def step(self, state: int, token: int) -> tuple[int, int, int]:
        """(next state, slot fired or -1, bytes of ``token`` past the segment) for one row."""
        k, j = self.position(state)
        if k < 0 or self.final(state):
            return state, -1, 0
        rest, data = self.segments[k][j:], self.vocab[token] if 0 <= token < len(self.vocab) else b""
        if data and rest.startswith(data):
            nxt = state + len(data)
            fired = k if len(data) == len(rest) and k < self.num_slots else -1
            return nxt, fired, 0
        if data and k < self.num_slots and data.startswith(rest):
            return state + len(rest), k, len(data) - len(rest)
        return self.dead, -1, 0

    def advance(self, states: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`step` for R rows, vectorized over the rows that write their state's next fixed token (a table
        lookup); the others (a value's closing token, which may write more of the text) step one by one.
        Shape: (R,), int64 each."""
        st, tk = states.numpy(), tokens.numpy()
        nxt, fired, past = self._keep_next[st], self._keep_fired[st], np.zeros(len(st), dtype=np.int64)
        for i in np.flatnonzero(self.keep[st] != tk).tolist():
            nxt[i], fired[i], past[i] = self.step(int(st[i]), int(tk[i]))
        return torch.from_numpy(nxt), torch.from_numpy(fired), torch.from_numpy(past)

    def learn_tokens(self, tokenizer: Any, end_token_id: int, first: Sequence[int] = ()) -> None:
        """Fill :attr:`keep`: from every position a row can reach (a segment's start, or where a slot's end token
        leaves it), the fixed text's canonical tokens, tokenized in the context of the segment's written part
        (``first``: the tokens of the output's start, segment 0, when known)."""
        keep = self.keep
        keep[self.dead] = keep[self.dead - 1] = end_token_id
        entries = [(0, 0)] + [(k, len(self.vocab[int(t)])) for k in range(1, len(self.segments))
                              for t in self.end_tokens(k - 1).ids if self.vocab[int(t)]]
        for k, j in dict.fromkeys(entries):
            state = int(self.base[k]) + j
            for tok in (list(first) if (k, j) == (0, 0) and first else self._canonical(tokenizer, k, j)):
                if keep[state] >= 0:
                    break  # the rest from here is already learned
                keep[state] = tok
                state = self.step(state, tok)[0]
        moves = [self.step(s, int(t)) if t >= 0 else (self.dead, -1, 0) for s, t in enumerate(keep.tolist())]
        self._keep_next = np.array([m[0] for m in moves], dtype=np.int64)
        self._keep_fired = np.array([m[1] for m in moves], dtype=np.int64)

    def _canonical(self, tokenizer: Any, k: int, j: int) -> list[int]:
        """Token ids writing segment ``k`` from byte ``j``: the tokenizer's, in the context of the part written, when
        they spell the bytes exactly; else the longest matching token at each position."""
        data = self.segments[k]
        rest = data[j:]
        if not rest:
            return []
        try:
            context, text = data[:j].decode("utf-8"), rest.decode("utf-8")
            ids = tokenize_in_context([text], tokenizer, context, separator="", on_unstable="raw")[0]
            if b"".join(self.vocab[i] if i < len(self.vocab) else b"\0" for i in ids) == rest:
                return ids
        except UnicodeDecodeError:
            pass
        out = spelling_ids(rest, self.vocab)
        if out is None:
            raise ConstraintConfigError(f"no tokens write the template text {rest!r:.60}")
        return out

    def end_tokens(self, slot: int) -> EndTokens:
        """The tokens that close slot ``slot``'s value: those whose bytes are a non-empty prefix of the text after it
        (none when nothing follows the slot: :class:`TemplateRules` closes that value with the end token)."""
        after = self.segments[slot + 1]
        ids = [i for i, b in enumerate(self.vocab) if b and after.startswith(b)] if after else []
        text = after[:1].decode("utf-8", errors="replace")
        return EndTokens(text, np.asarray(ids, dtype=np.int32), tuple(self.vocab[i][1:] for i in ids),
                         np.zeros(0, dtype=np.int32))


class TemplateRules(FieldRules):
    """:class:`~trie_decode.fields.FieldRules` for a template: the :class:`TemplateText` automaton, each slot's own
    end tokens, and FREE rows held to their fixed text's next token.

    Args:
        text: the template's automaton (its :attr:`~TemplateText.keep` learned).
        vocab, tries: the token bytes and the slots' tries. end_token_id: ends the template (and a final slot).
        names: the slots' names (for messages). byte_pieces: the byte-fallback pieces among the end tokens (see
            :attr:`~trie_decode.fields.FieldRules.bare_ends`).
    """

    def __init__(self, text: TemplateText, vocab: Sequence[bytes], tries: Sequence[TokenTrie], end_token_id: int,
                 names: Sequence[str], byte_pieces: Collection[int] = ()):
        ends = []
        for k, name in enumerate(names):
            e = text.end_tokens(k)
            if not text.segments[k + 1]:
                e = EndTokens.end_token(end_token_id)
            elif len(e.ids) == 0:
                raise ConstraintConfigError(f"no token begins the text after slot {name!r}: "
                                            f"{text.segments[k + 1]!r:.40}")
            ends.append(e)
        resume = [int(text.base[k + 1]) for k in range(len(names))]
        super().__init__(text, ends, vocab, tries, resume=resume, byte_pieces=byte_pieces)  # type: ignore[arg-type]
        self.text, self.end_token_id = text, end_token_id
        self.max_token = max(self.max_token, int(text.keep.max()))
        self._keep = {torch.device("cpu"): torch.from_numpy(text.keep)}  # by device: copied once, not per step
        self._runs: Optional[tuple[np.ndarray, np.ndarray]] = None

    def start_state(self, ids: Sequence[int]) -> tuple[int, int, int]:
        """Every row starts at the template's start, whatever its prompt (at slot 0's root when the template opens
        with it)."""
        return (0, -1, FREE) if self.text.segments[0] else (0, 0, self.start_node(0))

    def free_rows_(self, logits: Any, node: Any, text: Any, rows: Any = None) -> None:
        """FREE rows keep only their position's next fixed token (the end token at the template's end)."""
        if len(node) == 1 and node.is_cpu:  # the batch-1 decode loop: Python ints
            if int(node) != FREE:
                return
            r, keep = 0 if rows is None else int(rows[0]), int(self.text.keep[int(text)])
            kept = logits[r, keep].clone()
            logits[r].fill_(float("-inf"))
            logits[r, keep] = floor_rule(kept, kept_alive(kept))
            return
        free = (node == FREE).nonzero().flatten()
        if not len(free):
            return
        keep = self._keep.get(logits.device)
        if keep is None:
            keep = self._keep[logits.device] = self._keep[torch.device("cpu")].to(logits.device)
        keep = keep[text[free]]
        r = free if rows is None else rows[free]
        kept = logits[r, keep]
        if len(r) == logits.shape[0] and rows is None:
            logits.fill_(float("-inf"))  # every row is FREE (rows in step): one fill
        else:
            for i in r.tolist():  # a fill per row (torch's indexed fills are far slower on CPU)
                logits[i].fill_(float("-inf"))
        logits[r, keep] = floor_rule(kept, kept_alive(kept))  # a token another processor banned gets the floor

    def forced_text(self, state: int) -> list[int]:
        """The fixed tokens from ``state`` up to the next slot (or to the end token, which ends the template): its
        run in :meth:`forced_text_runs`, followed through the automaton."""
        out = []
        for _ in range(int(self.forced_text_runs()[0][state])):
            out.append(int(self.text.keep[state]))
            state = int(self.text._keep_next[state])
        return out

    def forced_text_runs(self) -> tuple[np.ndarray, np.ndarray]:
        """Per automaton state, how many fixed tokens follow (each state's next canonical token, until a slot
        fires, the template ends, or no token is known) and whether they end the output (the last is the end
        token). Built once; :meth:`forced_text` and the fast-forward stop read it. Shape: (S,) int64 and (S,) bool."""
        if self._runs is None:
            t = self.text
            length = np.zeros(t.num_states, dtype=np.int64)
            ends = np.zeros(t.num_states, dtype=np.bool_)
            for s in range(t.num_states - 1, -1, -1):  # a forced token always moves forward: later states first
                tok = int(t.keep[s])
                if tok < 0:
                    continue
                nxt = int(t._keep_next[s])
                if t.final(s) or s == t.dead or t._keep_fired[s] >= 0 or nxt <= s:  # forced_text stops here
                    length[s], ends[s] = 1, tok == self.end_token_id
                else:
                    length[s], ends[s] = 1 + length[nxt], ends[nxt]
            self._runs = (length, ends)
        return self._runs

    def __repr__(self) -> str:
        return f"TemplateRules(slots={len(self.ends)}, states={self.text.num_states})"
