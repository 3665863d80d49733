"""The one brute-force reference of the test suite: a trie and its span rules written plainly over tuples.

Every test that checks the trie, the constraint's masks and transitions, the processors' per-step allowed sets or
the replay of finished rows imports these models (as XGrammar's tests import ``xgrammar.testing``), so the
expected behaviour is written once.
"""

from __future__ import annotations

from trie_decode.constraint import SpanRules

__all__ = ["SpanReference", "TrieReference", "allowed_after", "first_refused", "SPAN_RULE_CASES"]


#: The span rules every state-machine test runs (with END = 1 and tokens 3..7 for separators and triggers): each
#: end of an entry, multi-token separators, triggers in each mode, a trigger of several forms.
SPAN_RULE_CASES = [
    dict(on_complete="eos"),
    dict(on_complete="release"),
    dict(on_complete="repeat", separator=(3,)),
    dict(on_complete="repeat", separator=(3, 4)),
    dict(on_complete="eos", trigger=(5, 6)),
    dict(on_complete="release", trigger=(7,)),
    dict(on_complete="repeat", separator=(3,), trigger=(5,)),
    dict(on_complete="release", trigger=(5, 6), trigger_forms=((7,), (4, 5, 6))),  # a text trigger's other ids
]


class SpanReference:
    """One row's constraint, written plainly over a set of token tuples: what it may emit (:meth:`allowed`), and
    the entries it has completed so far (``completed``, in order).

    Filters are the entry set itself: an allow/deny filter is the reference over the allowed entries minus the
    denied ones; ``distinct`` removes each entry from the set once the row completes it, with the entries that are
    one item with it (``same_item``: entry -> the entries that share its key, itself included; default: itself)."""

    def __init__(self, entries: set[tuple[int, ...]], rules: SpanRules, prompt_tail: tuple[int, ...] = (),
                 distinct: bool = False, same_item: dict | None = None):
        self.entries, self.rules, self.distinct = set(entries), rules, distinct
        self.same_item = same_item or {}
        self.history = list(prompt_tail)
        self.state = ("entry", ()) if not rules.trigger or self._ends_with_trigger() else ("free",)
        self.completed: list[tuple[int, ...]] = []

    def item(self, p) -> set:
        """The entries that are one item with ``p`` (itself included)."""
        return set(self.same_item.get(p, ())) | {p}

    def children(self, p):
        return {e[len(p)] for e in self.entries if len(e) > len(p) and e[: len(p)] == p}

    def allowed(self) -> set[int] | None:
        """None means unconstrained."""
        kind = self.state[0]
        r = self.rules
        if kind == "free":
            return None
        if kind == "done":
            return {r.end_token_id}
        if kind == "sep":
            return {r.separator[self.state[1]]}
        p = self.state[1]
        kids, terminal = self.children(p), p in self.entries
        if r.on_complete == "release" and terminal:
            return None
        if terminal:
            kids.add(r.end_token_id)
            # A separator starts another entry: in a distinct list only while one is left besides this one.
            if r.on_complete == "repeat" and (not self.distinct or self.entries - self.item(p)):
                kids.add(r.separator[0])
        return kids or {r.end_token_id}

    def step(self, tok: int) -> None:
        r, kind = self.rules, self.state[0]
        if kind == "entry":
            p = self.state[1]
            terminal, kids = p in self.entries, self.children(p)
            if terminal and tok not in kids:
                self.completed.append(p)
                if self.distinct:
                    self.entries -= self.item(p)
            if tok in kids:
                self.state = ("entry", p + (tok,))
            elif terminal and r.on_complete == "release":
                self.state = ("free",)
            elif terminal and r.on_complete == "repeat" and tok == r.separator[0]:
                self.state = ("entry", ()) if len(r.separator) == 1 else ("sep", 1)
            else:
                self.state = ("done",)
        elif kind == "sep":
            k = self.state[1]
            if tok != r.separator[k]:
                self.state = ("done",)
            else:
                self.state = ("entry", ()) if k + 1 == len(r.separator) else ("sep", k + 1)
        self.history.append(tok)
        if r.trigger and self.state == ("free",) and self._ends_with_trigger():
            self.state = ("entry", ())

    def _ends_with_trigger(self) -> bool:
        """Whether the history ends with any form of the trigger."""
        return any(len(self.history) >= len(f) and tuple(self.history[-len(f):]) == f for f in self.rules.triggers)


    def finish(self) -> list[tuple[int, ...]]:
        """The completed entries, counting the one the row stands at the end of (generation stopped there)."""
        if self.state[0] == "entry" and self.state[1] in self.entries:
            return self.completed + [self.state[1]]
        return list(self.completed)


def allowed_after(entries, rules: SpanRules, generated, prompt_tail=()) -> set[int] | None:
    """The allowed set of a row after ``generated`` (None: unconstrained), by the brute-force reference."""
    ref = SpanReference({tuple(e) for e in entries}, rules, tuple(prompt_tail))
    for tok in generated:
        ref.step(int(tok))
    return ref.allowed()


def first_refused(entries, rules: SpanRules, generated, prompt_tail=()) -> tuple[int, int, set[int] | None] | None:
    """The first token of ``generated`` the brute-force reference does not allow, as (position, token, allowed set),
    or None when it allows every one (a framework's output checked token by token; filters: pass the usable entries).
    """
    ref = SpanReference({tuple(e) for e in entries}, rules, tuple(prompt_tail))
    for i, tok in enumerate(generated):
        allowed = ref.allowed()
        if allowed is not None and int(tok) not in allowed:
            return i, int(tok), allowed
        ref.step(int(tok))
    return None


class TrieReference:
    """What a trie must answer (children, entries, forced runs), computed from plain tuples."""

    def __init__(self, sequences: list[list[int]]) -> None:
        tuples = [tuple(s) for s in sequences]
        self.first_index: dict[tuple[int, ...], int] = {}
        for i, t in enumerate(tuples):
            self.first_index.setdefault(t, i)
        # Entries are numbered by first appearance in the input.
        self.entries = list(self.first_index)
        self.entry_number = {t: n for n, t in enumerate(self.entries)}
        self.prefixes = {t[:k] for t in tuples for k in range(len(t) + 1)}
        self.next_tokens: dict[tuple[int, ...], set[int]] = {p: set() for p in self.prefixes}
        for p in self.prefixes:
            if p:
                self.next_tokens[p[:-1]].add(p[-1])
        # Breadth-first with siblings sorted by token == sorted by (depth, tokens).
        self.bfs_order = sorted(self.prefixes, key=lambda p: (len(p), p))

    def forced_run(self, prefix: tuple[int, ...]) -> list[int]:
        run, p = [], prefix
        while p not in self.first_index and len(self.next_tokens[p]) == 1:
            (tok,) = self.next_tokens[p]
            run.append(tok)
            p = p + (tok,)
        return run

    def forced_token_share(self) -> float:
        forced = total = 0
        for entry in self.entries:
            for k in range(len(entry)):
                p = entry[:k]
                total += 1
                forced += p not in self.first_index and len(self.next_tokens[p]) == 1
        return round(forced / total, 4)


class FieldReference:
    """Brute-force model of text spans (:mod:`trie_decode.fields`), on bytes and token lists, no automaton.

    Outside a value a row is free (every token allowed) and keeps the text written since its last value closed (the
    prompt's text at first). A token after which that text first ends with a span's ``after`` (the earliest byte,
    then the lowest span) enters the span, at its root, or at the root child whose bytes are what the token carries
    past ``after`` (a token carrying bytes no value starts with is not allowed). Inside a value: the children of its prefix, and where the prefix is an
    entry the ``end`` tokens (all of them at a leaf, only the bare one beside children). An end token closes the
    value; the free text restarts with that token's bytes.

    ``values[k]``: span k's entries (token tuples); ``afters[k]``: bytes; ``end``: bytes, or one per span;
    ``vocab``: token bytes.
    """

    def __init__(self, values, afters, end, vocab):
        self.values = [{tuple(v) for v in span} for span in values]
        self.afters, self.vocab = list(afters), list(vocab)
        ends = [end] * len(self.values) if isinstance(end, bytes) else list(end)
        self.end_ids = [{t for t, b in enumerate(self.vocab) if b.startswith(e)} for e in ends]
        self.bare = [min(ids, key=lambda t: (len(self.vocab[t]), t)) for ids in self.end_ids]

    def start(self, prompt: bytes):
        return self._scan(b"", prompt, None)

    def _scan(self, text: bytes, new: bytes, token):
        for i in range(1, len(new) + 1):
            for k, after in enumerate(self.afters):
                if (text + new[:i]).endswith(after):
                    carried = new[i:]
                    if not carried:
                        return ("in", k, ())
                    first = [t for t in self._children(k, ()) if self.vocab[t] == carried]
                    return ("in", k, (first[0],)) if first else ("dead",)
        return ("free", text + new)

    def _children(self, k, prefix):
        n = len(prefix)
        return {v[n] for v in self.values[k] if len(v) > n and v[:n] == prefix}

    def allowed(self, state):
        if state[0] == "free":
            # Everything but the tokens that complete an ``after`` carrying bytes no value of it starts with.
            dead = {t for t in range(len(self.vocab)) if self._scan(state[1], self.vocab[t], t) == ("dead",)}
            return None if not dead else set(range(len(self.vocab))) - dead
        _, k, prefix = state
        kids = self._children(k, prefix)
        if prefix in self.values[k]:
            return kids | (self.end_ids[k] if not kids else {self.bare[k]})
        return kids

    def step(self, state, token):
        if state[0] == "free":
            return self._scan(state[1], self.vocab[token], token)
        _, k, prefix = state
        if token in self._children(k, prefix):
            return ("in", k, prefix + (token,))
        assert prefix in self.values[k] and token in self.end_ids[k], "a token the reference does not allow"
        return self._scan(b"", self.vocab[token], token)
