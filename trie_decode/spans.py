"""Span rules: where a constrained span starts, how it ends, and what a row may do at each point of it.

Why this exists: a constrained span is more than a walk down a trie. It may start only after a trigger, end on the
end token, release the row into free text, or go on with a separator and another entry. These rules are written
once, here, as a *step table* (what a row at each node or code may emit) and a *transition* over arrays (where a row
goes on each token). Every consumer uses them: the per-step masking of every kernel, the state update, the host-side
replay that tells which entries a finished row generated (``TrieConstraint.replay``), and the forced tokens of
fast-forward (:func:`forced_tokens`).

A row's state is one int64 code (plus the index of its trie):

    node >= 0     inside an entry, at that trie node
    DONE (-1)     only the end token may follow
    FREE (-2)     unconstrained: released after an entry, or waiting for the trigger
    -2 - k        (k >= 1, repeat mode) emitting separator token number k

End of an entry (``on_complete``):
    "eos"     the end token is allowed at terminal nodes (with the children, if the entry prefixes another);
              once chosen, the row allows only the end token.
    "release" at a terminal node every token is allowed; a child continues the entry, anything else ends the span
              and the row is unconstrained (or waits for the trigger again).
    "repeat"  lists of entries: at a terminal node the separator's first token starts the separator (its remaining
              tokens are forced), after which a new entry starts at the root; the end token ends the list.
With a trigger (a token sequence) the constraint starts only after the trigger appears; the row is FREE until then.

Dimension letters: N trie nodes, K state codes (DONE, FREE, separator positions), R rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from .errors import ConstraintConfigError, InvalidTokenError
from .options import ON_COMPLETE_MODES, check_on_complete, check_separator, token_id, token_tuple
from .trie import TokenTrie

__all__ = ["SpanRules", "DONE", "FREE", "ON_COMPLETE_MODES", "TABLE_COLUMNS", "step_table", "span_moves", "completes_entry", "forced_tokens"]

DONE, FREE = -1, -2
# Step table columns. What a row may emit: child range start and count, dense slot, a token the row surely keeps
# (the anchor; -1 for an unconstrained row), and up to two extra tokens (end, separator). Where a row goes on a token
# that is not a child: to ON_MATCH on the token ON_TOKEN (-1: none), to OTHERWISE on any other.
START, COUNT, SLOT, ANCHOR, EXTRA0, EXTRA1, ON_TOKEN, ON_MATCH, OTHERWISE = range(9)
TABLE_COLUMNS = 9


#: What :class:`~trie_decode.constraint.TrieConstraint` reads of ``SpanRules.fields`` (a FieldRules or TemplateRules).
_FIELD_RULES_READ = ("ends", "max_token", "start_state", "free_rows_", "entry_node", "text_moves")


@dataclass(frozen=True)
class SpanRules:
    """How a constrained span starts and ends.

    Args:
        end_token_id: the token that ends an entry (``"eos"``/``"repeat"``) and the fallback of any row that would
            otherwise allow nothing; usually the model's EOS id.
        on_complete: ``"eos"`` (default), ``"release"`` or ``"repeat"`` (see the module docstring).
        separator: token ids between entries in ``"repeat"`` mode (e.g. the tokens of ``", "``).
        trigger: token ids after which the constraint starts; empty = it starts with generation.
        trigger_forms: other token ids of the same trigger; a row starts after any form. A trigger given as text
            gets the ids the model writes it with at a line's start and after a space
            (:func:`~trie_decode.options.trigger_forms`): SentencePiece writes ``"Answer:"`` as ``▁Answer :`` after
            a space but ``Answer :`` after a newline, byte-level BPE as ``Answer :`` and ``ĠAnswer :``.
        fields: text spans (a :class:`~trie_decode.fields.FieldRules`, or a template's
            :class:`~trie_decode.templates.TemplateRules`); needs ``on_complete="release"`` and no ``trigger``.

    Example:
        >>> rules = SpanRules(end_token_id=2, on_complete="repeat", separator=[5, 6])
        >>> rules.separator, rules.plain, rules.num_codes   # DONE, FREE, and one code for the separator's 2nd token
        ((5, 6), False, 3)
        >>> SpanRules(end_token_id=2, trigger=[7, 8], trigger_forms=[[9, 8], [7, 8]]).triggers  # the same form once
        ((7, 8), (9, 8))
        >>> SpanRules(end_token_id=2, on_complete="stop")
        Traceback (most recent call last):
        ...
        trie_decode.errors.ConstraintConfigError: on_complete must be one of ('eos', 'release', 'repeat'), got 'stop'
    """

    end_token_id: int
    on_complete: str = "eos"
    separator: tuple[int, ...] = ()
    trigger: tuple[int, ...] = ()
    fields: Any = None
    trigger_forms: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "end_token_id", token_id(self.end_token_id, "end_token_id"))
        check_on_complete(self.on_complete)
        object.__setattr__(self, "separator", token_tuple(self.separator, "separator"))
        object.__setattr__(self, "trigger", token_tuple(self.trigger, "trigger"))
        object.__setattr__(self, "trigger_forms", _other_forms(self.trigger, self.trigger_forms))
        check_separator(self.on_complete, bool(self.separator))
        if self.end_token_id in self.separator:
            raise ConstraintConfigError(
                f"the separator {list(self.separator)[:20]} holds the end token {self.end_token_id}, which ends the list: "
                "a list would end inside its separator; choose a separator without it")
        # What the constraint reads of the fields (fields imports this module: no isinstance without an import cycle).
        if self.fields is not None and not all(hasattr(self.fields, name) for name in _FIELD_RULES_READ):
            raise ConstraintConfigError(
                f"fields must be the FieldRules of the spans (FieldRules.build(spans, tokenizer)[1], or "
                f"Template.build(tokenizer, end_token_id)[1]), got {type(self.fields).__name__}")
        if self.fields is not None and (self.on_complete != "release" or self.trigger):
            raise ConstraintConfigError(
                'spans (fields) end each value with their end text and release the row: on_complete="release" and '
                "no token trigger (each span has its own after)"
            )

    def check_vocab(self, width: int) -> None:
        """Raise :class:`InvalidTokenError` if a configured token is outside ``[0, width)``."""
        for what, toks in (("end_token_id", (self.end_token_id,)), ("separator", self.separator),
                           ("trigger", self.trigger_tokens)):
            for tok in toks:
                if tok >= width:
                    raise InvalidTokenError(f"{what} token {tok} is outside the vocabulary [0, {width})")

    @property
    def triggers(self) -> tuple[tuple[int, ...], ...]:
        """Every form of the trigger, ``trigger`` first; ``()`` without a trigger."""
        return (self.trigger,) + self.trigger_forms if self.trigger else ()

    @property
    def trigger_len(self) -> int:
        """The longest trigger form: how many of a row's last tokens the trigger check reads (0 without one)."""
        return max([len(form) for form in self.triggers] + [0])

    @property
    def trigger_tokens(self) -> list[int]:
        """Every token of every trigger form (the vocabulary must hold them)."""
        return [t for form in self.triggers for t in form]

    @property
    def plain(self) -> bool:
        """True when a row's next state is simply the trie child (``"eos"`` without a trigger)."""
        return self.on_complete == "eos" and not self.trigger

    @property
    def starts_late(self) -> bool:
        """Whether rows may start outside the trie and enter it later (a token trigger, or text spans)."""
        return bool(self.trigger) or self.fields is not None

    @property
    def num_codes(self) -> int:
        """K: the negative state codes these rules use (DONE, FREE and one per separator token after the first)."""
        return 2 + max(len(self.separator) - 1, 0)


def _other_forms(trigger: tuple[int, ...], forms: Any) -> tuple[tuple[int, ...], ...]:
    """``trigger_forms`` checked: each a non-empty token sequence, none repeated nor equal to ``trigger``, and
    only beside a trigger."""
    if forms is None or isinstance(forms, (str, bytes, bytearray)) or not hasattr(forms, "__iter__"):
        raise ConstraintConfigError(f"trigger_forms must be a list of token-id lists, got {forms!r:.80}")
    out: list[tuple[int, ...]] = []
    for form in forms:
        if isinstance(form, (int, np.integer)):
            raise ConstraintConfigError(f"trigger_forms must be a list of token-id lists, got the id {form!r} in it")
        ids = token_tuple(form, "trigger_forms")
        if not ids:
            raise ConstraintConfigError("trigger_forms holds an empty form: each form is the token ids of the trigger")
        if ids != trigger and ids not in out:
            out.append(ids)
    if out and not trigger:
        raise ConstraintConfigError("trigger_forms are other forms of a trigger: give trigger= too")
    return tuple(out)


def step_table(trie: TokenTrie, rules: SpanRules, dense_slot: np.ndarray, end_slot: int = -1, span: int = 0) -> np.ndarray:
    """The span rules as one table: what a row may emit at each node and code, and where it goes on a token that
    is not a child of its node. Every kernel reads this table; none re-derives a rule.

    Args:
        dense_slot: each node's row in the dense masks, or -1 (a node with a dense row lists no children here).
            Shape: (N,), int32.
        end_slot: with text spans (``rules.fields``), the dense row of a complete leaf entry: its ``end`` tokens.
        span: with text spans, which span ``trie`` is (its end tokens).
    Returns:
        Shape: (N + K, 9), int32; the K code rows come last, in the order -K .. -1, so that a negative code indexes
        its own row. Columns: START, COUNT, SLOT, ANCHOR, EXTRA0, EXTRA1, ON_TOKEN, ON_MATCH, OTHERWISE.

    Moves on a token that is not a child (a child always continues the entry):
        inside an entry         -> DONE; at a terminal node in ``"release"`` mode -> FREE (the span ends); at a
                                   terminal node in ``"repeat"`` mode the separator's first token starts the
                                   separator (its code -3, or the root when it is one token long)
        at a complete entry of a text span (``rules.fields``): its ``end`` tokens are allowed (a leaf's dense row;
                                   beside children, the bare ``end`` token) and lead to FREE
        DONE                    -> DONE
        FREE                    -> FREE (the trigger check in ``TrieConstraint.advance`` may start an entry)
        separator code -2 - k   -> on the separator's token k, its next code (the root after the last), else DONE
    """
    n = trie.num_nodes
    sep = rules.separator
    fanout = trie.fanout
    terminal = trie.node_entry >= 0
    end = rules.end_token_id
    after_sep0 = 0 if len(sep) <= 1 else -3
    table = np.full((n, TABLE_COLUMNS), -1, dtype=np.int32)
    table[:, START] = trie.child_ptr[:-1]
    table[:, COUNT] = np.where(dense_slot >= 0, 0, fanout)
    table[:, SLOT] = dense_slot
    first_child = trie.token[np.minimum(trie.child_ptr[:-1], n - 1)]
    table[:, ANCHOR] = np.where(fanout > 0, first_child, end)
    table[:, ON_MATCH] = DONE
    table[:, OTHERWISE] = DONE
    if rules.fields is not None:
        # A complete entry keeps its children and the span's end tokens; an end token closes the value (FREE).
        leaf = terminal & (fanout == 0)
        if end_slot < 0:
            raise ConstraintConfigError("a text span's step table needs the dense row of its end tokens")
        table[leaf, SLOT] = end_slot
        table[leaf, COUNT] = 0
        table[leaf, ANCHOR] = rules.fields.bare_ends[span]
        table[terminal & ~leaf, EXTRA0] = rules.fields.bare_ends[span]
        table[terminal, OTHERWISE] = FREE
    elif rules.on_complete == "release":
        table[terminal, ANCHOR] = -1  # an entry is complete: the row is unconstrained
        table[terminal, OTHERWISE] = FREE
    else:
        table[terminal, EXTRA0] = end
        if rules.on_complete == "repeat":
            table[terminal, EXTRA1] = sep[0]
            table[terminal, ON_TOKEN] = sep[0]
            table[terminal, ON_MATCH] = after_sep0
    codes = {DONE: (0, 0, -1, end, end, -1, -1, DONE, DONE), FREE: (0, 0, -1, -1, -1, -1, -1, FREE, FREE)}
    for k in range(1, len(sep)):
        codes[-2 - k] = (0, 0, -1, sep[k], sep[k], -1, sep[k], -3 - k if k + 1 < len(sep) else 0, DONE)
    code_rows = np.array([codes[c] for c in range(-rules.num_codes, 0)], dtype=np.int32)
    return np.concatenate([table, code_rows])


def span_moves(table: Any, rules: SpanRules, node: Any, tok: Any, child: Any) -> Any:
    """Each row's next state: the trie child, else the step table's move (see :func:`step_table`); for numpy
    arrays or torch tensors alike (element-wise selects only: no host synchronization on a GPU).

    Args:
        table: the rules' step table (see :func:`step_table`), same backend as the other arguments.
        node: each row's state before the token. tok: the token. Shape: (R,), int64.
        child: the trie child of each node by each token, -1 for non-children and for every negative code.
            Shape: (R,), int64.
    Returns:
        Each row's next state (before the trigger check, see ``TrieConstraint.advance``). Shape: (R,), int64.
    """
    if rules.plain:
        return child  # every move off the trie goes to DONE (-1), which is what a missing child reads as
    where = torch.where if isinstance(child, torch.Tensor) else np.where
    row = table[node]
    on = row[:, ON_TOKEN]
    move = where((tok == on) & (on >= 0), row[:, ON_MATCH], row[:, OTHERWISE])
    return where(child >= 0, child, move)


def completes_entry(node_before: Any, node_after: Any, terminal: Any, parent: Any) -> Any:
    """Which rows completed an entry with their last token: they stood at a terminal node and did not go down to a
    child (the end token, a separator, a release, leaving the trie). numpy arrays or torch tensors alike.

    Args:
        node_before, node_after: each row's state code before and after the token. Shape: (R,), int64.
        terminal: whether an entry ends at each node. Shape: (N,), bool. parent: each node's parent. Shape: (N,).
    Returns:
        Shape: (R,), bool.
    """
    where = torch.where if isinstance(node_after, torch.Tensor) else np.where
    before = where(node_before >= 0, node_before, 0)
    after = where(node_after >= 1, node_after, 0)
    went_down = (node_after >= 1) & (parent[after] == node_before)
    return (node_before >= 0) & terminal[before] & ~went_down


def forced_tokens(trie: TokenTrie, rules: SpanRules, nodes: Sequence[int], max_tokens: int) -> list[list[int]]:
    """The tokens forced from each state: the trie's forced run (:meth:`TokenTrie.forced_runs`), then the end token
    where an entry ends with no way on in ``"eos"`` mode; the rest of the separator; the end token after DONE.

    Args:
        nodes: each row's state code (see the module docstring), all rows of ``trie``.
        max_tokens: cap on each row's run.
    """
    nodes = np.asarray(nodes, dtype=np.int64)
    runs = trie.forced_runs()
    inside = nodes >= 0
    at = np.where(inside, nodes, 0)
    length = np.where(inside, runs.length[at], 0).astype(np.int64)
    # Walk every row's run at once, one token per iteration (a forced node's only child is its first child).
    width = int(min(length.max(initial=0), max_tokens))
    cols = np.zeros((len(nodes), width), dtype=np.int64)
    cur = at.copy()
    for j in range(width):
        cur = np.where(j < length, trie.child_ptr[cur], cur)
        cols[:, j] = trie.token[cur]
    end = rules.end_token_id
    ends_here = inside & runs.ends_entry[at] if rules.on_complete == "eos" else np.zeros(len(nodes), dtype=bool)
    out: list[list[int]] = []
    for i, n in enumerate(nodes.tolist()):
        if n >= 0:
            run = cols[i, : min(int(length[i]), max_tokens)].tolist()
            if ends_here[i] and len(run) < max_tokens:
                run.append(end)
        elif n <= -3:
            run = list(rules.separator[-2 - n :])[:max_tokens]
        elif n == DONE:
            run = [end][:max_tokens]
        else:
            run = []
        out.append(run)
    return out
