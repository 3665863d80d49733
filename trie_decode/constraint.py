"""Per-row constraint state and its vectorized transitions: which trie node each row is at, and what it may emit.

Why this exists: the transformers processor, the fast-forward loop and the vLLM processors all need the same
thing: a batch of rows, each constrained by one of several tries, each at some point of a span (inside an entry,
after it, waiting for a trigger), advanced by one token per step and masked accordingly. ``TrieConstraint`` is that
one object; the integrations only keep their framework's bookkeeping.

Where the pieces live: the span rules and the state codes (DONE, FREE, separator positions) in
:mod:`trie_decode.spans`; the trie's arrays and step tables on the logits' device in :mod:`trie_decode.device`; the
per-step work, picked once per device, in :mod:`trie_decode.kernels`. Host-side questions about finished or
running rows (which entries a row generated, which tokens are forced next) are answered here too, from the same
rules.

Dimension letters: R state rows, B logits rows, V vocabulary width, L generated tokens.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from . import kernels
from .device import DeviceTrie
from .entries import Entry
from .errors import ConstraintConfigError, InvalidTokenError
from .filters import (CHILD_EXCLUDED, END_EXCLUDED, EntryOrder, ItemGroups, RowFilters, apply_filters_,
                      completed_ranks, entry_indices, usable_count)
from .kernels.grouped import row_groups
from .kernels.interface import check_logits, check_row_range, check_rows, described, is_index_tensor
from .kernels.vectorized import plans_to_bool, plans_to_lists
from .bitmask import pack_bitmask
from .options import check_distinct, check_filter_mode, given_filters, row_specs
from .spans import ANCHOR, DONE, FREE, ON_COMPLETE_MODES, ON_TOKEN, OTHERWISE, SpanRules, completes_entry, forced_tokens, span_moves
from .trie import TokenTrie

__all__ = ["SpanRules", "RowState", "TrieConstraint", "DONE", "FREE", "ON_COMPLETE_MODES"]

#: In the trigger table, a place before a shorter form's first token: it matches any token, and the -1 that pads a
#: short history.
_ANY_TOKEN = -2


def _count(value: Any, what: str) -> int:
    """``value`` as a count (an int >= 0: a Python or numpy int, or a 0-d integer tensor; not a bool), or a
    ConstraintConfigError naming ``what`` (torch's own errors named neither, and read True as 1)."""
    try:
        count = operator.index(value) if not isinstance(value, bool) else -1
    except TypeError:
        count = -1
    if count < 0:
        raise ConstraintConfigError(f"{what} must be an int >= 0, got {value!r:.40}")
    return count


def _misfit_tails(tails: Any, num_rows: int) -> Optional[str]:
    """None when ``tails`` is a (num_rows, T) tensor (each row's last tokens), else how an error names what it is
    (its shape, or its type)."""
    if isinstance(tails, torch.Tensor):
        return None if tails.dim() == 2 and tails.shape[0] == num_rows else str(tuple(tails.shape))
    return type(tails).__name__


def _excluded_moves(node: Any, new: Any, parent_of_new: Any, own_bits: Any, new_bits: Any) -> tuple[Any, Any]:
    """The filter rule's moves (see :data:`~trie_decode.filters.CHILD_EXCLUDED`), numpy arrays or torch tensors alike:
    which rows went down to a child whose subtree their filter excludes (the token moves as one off the trie does),
    and which left an excluded entry's end other than down a usable child (the row ends).

    Args:
        node, new: each row's state before and after the trie move. parent_of_new: the parent of each row's
            ``new`` node (any value where ``new`` < 1). own_bits, new_bits: the filter bits at ``node`` and at
            ``new`` (any value where negative). All Shape: (R,).
    Returns:
        (off_child, excluded_end), Shape: (R,), bool.
    """
    went_down = (new >= 1) & (node >= 0) & (parent_of_new == node)
    off_child = went_down & ((new_bits & CHILD_EXCLUDED) != 0)
    excluded_end = (node >= 0) & ((own_bits & END_EXCLUDED) != 0) & ~(went_down & ~off_child)
    return off_child, excluded_end


def check_stop_tokens_outside_entries(trie: TokenTrie, stop_ids: Sequence[int], *, change: Optional[str] = None,
                                      denied: Optional[np.ndarray] = None) -> None:
    """Refuse a trie with an entry that holds a token generation stops at (``stop_ids``: the end token where it
    ends generation, and any other stop token of the loop) before its last token: a row would stop inside the entry,
    and its output would be no entry, whatever ``on_complete`` is (a span's value that contains its end is refused
    the same way, :func:`trie_decode.fields.value_trie`). An entry that ends with a stop token, and a separator inside
    an entry, are fine.

    One numpy pass over the trie's edge tokens, kept on the trie (a flag per vocabulary id: does an entry go on past
    it?); then each stop token is one look-up, so a request may name any number of them. Called where the stop
    tokens are known: vLLM's admission, for a request's trie (a 400: the model's EOS and the request's
    ``stop_token_ids``), and the transformers processor and fast-forward with ``generate``'s stop ids
    (:meth:`~trie_decode.integrations.transformers.TrieLogitsProcessor.check_stop_ids`). The core's constraint does
    not call it (a trie decoded in a loop that does not stop at its end token, or token-level tests, may hold it).

    Args:
        stop_ids: the tokens the generation loop stops a row at.
        change: the options by which the caller's user picks those tokens (e.g. ``"end_token_id="``), named in the
            fix; None where they are not the user's to pick (vLLM: the model's EOS).
        denied: entry indices no row can write (a live catalog's removed entries, which its view's trie still holds
            until the next compaction): such an entry is no reason to refuse the trie. None: every entry counts.

    Raises:
        ConstraintConfigError: naming one such entry, the stop token and the fix.
    """

    def inner_tokens() -> np.ndarray:
        # The tokens that lead to a node with children: what lies past such a token could never be written if
        # generation stopped at it. An entry that ends with a stop token is fine (generation stops where it ends).
        inner = np.zeros(trie.vocab_size, dtype=np.bool_)
        tok = trie.token[trie.child_ptr[1:] > trie.child_ptr[:-1]]
        inner[tok[tok >= 0]] = True  # the root's token is -1
        return inner

    inner = trie.derived("inner_tokens", inner_tokens)
    for stop in dict.fromkeys(int(t) for t in stop_ids):
        if not 0 <= stop < len(inner) or not inner[stop]:
            continue
        nodes = np.flatnonzero((trie.token == stop) & (trie.child_ptr[1:] > trie.child_ptr[:-1]))
        if denied is None or not len(denied):
            node = int(trie.child_ptr[nodes[0]])  # an entry past the stop token: down first children to a terminal
            while trie.node_entry[node] < 0:
                node = int(trie.child_ptr[node])
            index = int(trie.node_entry[node])
        else:  # the entries past the stop token are the ranks below each such node, its own entry's excepted
            order = EntryOrder.of(trie)
            ranks = order.sorted_ranks(np.asarray(denied, dtype=np.int64))
            bounds = np.stack([order.lo[nodes] + (order.node_rank[nodes] >= 0), order.hi[nodes]], 1)
            usable = np.flatnonzero(usable_count(bounds, None, ranks)[:, 0] > 0)
            if not usable.size:
                continue
            first = int(bounds[usable[0], 0])  # the first rank there that is not denied
            rank = int(np.setdiff1d(np.arange(first, first + len(ranks) + 1), ranks)[0])
            index = int(np.flatnonzero(order.rank == rank)[0])
        entry = trie.entry(index)
        label = "" if entry.name is None and entry.key is None else f" ({entry.name if entry.key is None else entry.key!r})"
        fix = (f"stop at a token no entry contains ({change}), or " if change else "") + "build the trie without such entries"
        raise ConstraintConfigError(
            f"entry {entry.index}{label}, tokens {list(entry.tokens)[:20]}, contains token {stop}, at which generation "
            f"stops: a row would stop inside this entry and its output would be no entry; {fix}")


@dataclass
class RowState:
    """The state of R rows: ``node`` (see the module docstring), ``tree`` (trie index) and, with text spans, ``text``
    (each row's trigger-automaton state, see :mod:`trie_decode.fields`); Shape: (R,), int64."""

    node: torch.Tensor
    tree: torch.Tensor
    text: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return self.node.numel()

    def select(self, index: torch.Tensor) -> "RowState":
        """Rows ``index`` of this state (a gather: used when rows are reordered, e.g. by beam search)."""
        return RowState(self.node[index], self.tree[index], None if self.text is None else self.text[index])

    def clone(self) -> "RowState":
        return RowState(self.node.clone(), self.tree.clone(), None if self.text is None else self.text.clone())

    def assign(self, index: Any, other: "RowState") -> None:
        """Write ``other``'s rows into rows ``index`` of this state (in place)."""
        self.node[index] = other.node
        self.tree[index] = other.tree
        if self.text is not None:
            self.text[index] = other.text

    @staticmethod
    def cat(states: Sequence["RowState"]) -> "RowState":
        text = None if states[0].text is None else torch.cat([s.text for s in states])
        return RowState(torch.cat([s.node for s in states]), torch.cat([s.tree for s in states]), text)

    @property
    def done(self) -> torch.Tensor:
        """Rows that may only emit the end token. Shape: (R,), bool."""
        return self.node == DONE


class TrieConstraint:
    """A set of tries plus span rules: starts, advances and masks rows, all rows at once.

    Args:
        tries: one trie, or several (each row then names its trie by index).
        rules: the :class:`SpanRules`.
        device: the logits' device.
        dense_min_fanout: nodes with at least this many children are masked from a dense row (default
            max(256, V // 16)).
        kernel: force a kernel (``"native"``, ``"numpy"`` or ``"torch"``; see :mod:`trie_decode.kernels`); by
            default the fastest one for the device.

    Example:
        >>> import torch
        >>> from trie_decode import TokenTrie
        >>> from trie_decode.constraint import SpanRules, TrieConstraint
        >>> trie = TokenTrie.from_sequences([[3, 4], [3, 5], [6]], vocab_size=8)
        >>> c = TrieConstraint(trie, SpanRules(end_token_id=0), "cpu")
        >>> state = c.start(2)
        >>> logits = torch.zeros(2, 8)
        >>> c.mask_(logits, state)[0].isfinite().nonzero().flatten().tolist()
        [3, 6]
        >>> state = c.advance(state, torch.tensor([3, 6]))
        >>> c.mask_(torch.zeros(2, 8), state).isfinite().nonzero().tolist()
        [[0, 4], [0, 5], [1, 0]]
    """

    def __init__(
        self,
        tries: Union[TokenTrie, Sequence[TokenTrie]],
        rules: SpanRules,
        device: torch.device | str,
        *,
        dense_min_fanout: Optional[int] = None,
        kernel: Optional[str] = None,
    ) -> None:
        tries = [tries] if isinstance(tries, TokenTrie) else list(tries)
        if not tries:
            raise ConstraintConfigError("a constraint needs at least one trie")
        for i, t in enumerate(tries):
            if not isinstance(t, TokenTrie):
                raise TypeError(f"tries[{i}] is {type(t).__name__}, not a TokenTrie")
        if not isinstance(rules, SpanRules):
            raise TypeError(f"rules must be SpanRules, not {type(rules).__name__}")
        self.tries = tries
        self.rules = rules
        self.device = torch.device(device)
        self.vocab_size = max(t.vocab_size for t in tries)
        rules.check_vocab(self.vocab_size)
        if rules.fields is not None and len(tries) != len(rules.fields.ends):  # span k's values are tries[k]
            raise ConstraintConfigError(f"the rules' fields have {len(rules.fields.ends)} spans (or slots), and "
                                        f"{len(tries)} tries were given: give each span's trie, in the order of the "
                                        "spans (FieldRules.build and Template.build return both)")
        # The narrowest logits this constraint can mask: every trie token and every rule token must fit.
        self.needed_width = 1 + max([t.max_token for t in tries] + [rules.end_token_id]
                                    + list(rules.separator) + rules.trigger_tokens
                                    + ([rules.fields.max_token] if rules.fields is not None else []))
        if dense_min_fanout is None:
            self.dtries = [DeviceTrie.get(t, self.device) for t in tries]
        else:
            self.dtries = [DeviceTrie(t, self.device, dense_min_fanout=dense_min_fanout) for t in tries]
        self.tables = [d.table(rules, i) for i, d in enumerate(self.dtries)]
        self.kernel = kernels.select(self.device, kernel)
        self._prepared = self.kernel.prepare(self.tables)
        # Plans (allowed sets, bitmasks) come from the vectorized kernel of the device's array backend.
        self._planner = kernels.planner(self.device)
        # Every trigger form right-aligned in one (forms, longest) table; a shorter form's head matches any token.
        forms = np.full((len(rules.triggers), rules.trigger_len), _ANY_TOKEN, dtype=np.int64)
        for k, form in enumerate(rules.triggers):
            forms[k, forms.shape[1] - len(form):] = form
        self._trigger = torch.from_numpy(forms).to(self.device)
        self._trigger_any = self._trigger == _ANY_TOKEN
        self._trigger_len = forms.shape[1]  # read at every step: not the rules' property
        self._one_trigger = self._trigger[0] if len(forms) == 1 else None  # ids as given: the cheaper compare
        # Read from the step tables: a FREE row (text spans: outside every value) is unconstrained by the trie and
        # stays FREE on any token, so the batch-1 loop of text spans skips the kernel for it.
        free_rows = [t.tensor[FREE].tolist() for t in self.tables]
        self._free_row_is_free = rules.fields is not None and all(
            r[ANCHOR] < 0 and r[ON_TOKEN] < 0 and r[OTHERWISE] == FREE for r in free_rows)
        self._text_runs_on_device: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # see _text_runs

    def with_kernel(self, kernel: str) -> "TrieConstraint":
        """The same constraint (same tries, rules and dense rows) stepping with another kernel (to compare them)."""
        other = copy.copy(self)
        other.kernel = kernels.select(self.device, kernel)
        other._prepared = other.kernel.prepare(self.tables)
        return other

    # ------------------------------------------------------------------ state
    def start(self, num_rows: int, tree: Optional[torch.Tensor] = None, tails: Optional[torch.Tensor] = None) -> RowState:
        """The state of rows about to generate their first token.

        Args:
            num_rows: R, an int >= 0 (else ConstraintConfigError).
            tree: each row's trie index (default 0). Shape: (R,), int64.
            tails: the rows' last tokens before generation (at least ``len(trigger)`` columns; a shorter prompt
                padded on the left with -1); used only with a trigger: a prompt that already ends with the trigger
                starts inside the entry (without tails, every row waits for the trigger).
        """
        num_rows = _count(num_rows, "num_rows")
        dev = self.device
        if tree is None:
            tree = torch.zeros(num_rows, dtype=torch.long, device=dev)
        else:
            if not is_index_tensor(tree, (num_rows,)):  # a list or a numpy array failed on its attributes
                raise ConstraintConfigError(f"tree must hold one integer trie index per row: ({num_rows},), got "
                                            f"{described(tree)}")
            tree = tree.to(dev, torch.long)
            if tree.numel() and (int(tree.min()) < 0 or int(tree.max()) >= len(self.tries)):  # the caller's indices
                raise ConstraintConfigError(f"row trie indices must be in [0, {len(self.tries)})")
        node = torch.zeros(num_rows, dtype=torch.long, device=dev)
        if self.rules.trigger:
            self._check_tails(tails, num_rows, "start")
            node = torch.where(self._tail_is_trigger(tails, num_rows), node, torch.full_like(node, FREE))
        if self.rules.fields is not None:
            return self._start_fields(num_rows, tails)
        return RowState(node, tree)

    def _start_fields(self, num_rows: int, tails: Optional[torch.Tensor]) -> RowState:
        """Text spans: each row where its prompt's tail leaves it (``tails``: token ids, Shape: (R, T)): FREE with its
        automaton fed the tail, or in the span whose ``after`` (and the start of a value) the prompt ends with
        (:meth:`FieldRules.start_state`)."""
        f = self.rules.fields
        got = None if tails is None else _misfit_tails(tails, num_rows)
        if got is not None:
            raise ConstraintConfigError(f"tails must hold each row's last prompt tokens (the span automaton reads "
                                        f"them): ({num_rows}, T) for {num_rows} rows, got {got}")
        starts = [f.start_state(ids) for ids in (tails.tolist() if tails is not None else [[]] * num_rows)]
        text = [state for state, _, _ in starts]
        tree = [max(span, 0) for _, span, _ in starts]
        node = [node for _, _, node in starts]
        return RowState(*(torch.tensor(v, dtype=torch.long, device=self.device) for v in (node, tree, text)))

    def _fields_move(self, state: RowState, tokens: torch.Tensor, new: torch.Tensor) -> RowState:
        """Text spans after the trie move: FREE rows feed the token to their automaton (a row that just closed a
        value restarts it from the closing token, from that span's ``FieldRules.resume`` state), and a completed ``after`` enters its span's trie (at the root
        child the token's bytes past ``after`` spell, when it carries some). Rows inside a value keep their text
        state. On the host (numpy views, a scalar path at one row); other devices round-trip through it."""
        f = self.rules.fields
        if new.numel() == 1 and new.is_cpu:  # the batch-1 decode loop: Python ints
            if int(new) != FREE:
                return RowState(new, state.tree, state.text)
            token = int(tokens)
            was_free = new is state.node or int(state.node) == FREE  # (advance passes a FREE row's node itself)
            src = int(state.text) if was_free else int(f.resume[int(state.tree)])
            nxt, k, past = f.text_move(src, token)
            # An automaton that stays put keeps its tensor (states share unchanged tensors, as they share ``tree``).
            text = state.text if was_free and nxt == src else torch.full((1,), nxt, dtype=torch.long)
            if k < 0:
                return RowState(new, state.tree, text)
            start = f.entry_node(k, token, past)
            if start < 0:  # a dead trigger token (masked: see FieldRules.dead_tokens)
                return RowState(new, state.tree, text)
            return RowState(torch.full((1,), start, dtype=torch.long), torch.full((1,), k, dtype=torch.long), text)
        node_np, before = new.cpu().numpy(), state.node.cpu().numpy()
        idx = np.flatnonzero(node_np == FREE)
        if not len(idx):
            return RowState(new, state.tree, state.text)
        text = state.text.cpu().numpy().copy()
        src = np.where(before[idx] == FREE, text[idx], f.resume[state.tree.cpu().numpy()[idx]])
        toks = tokens.cpu().numpy()[idx]
        nxt, fired, past = f.text_moves(src, toks)
        text[idx] = nxt
        tree = state.tree
        if (fired >= 0).any():
            node_np, tree_np = node_np.copy(), tree.cpu().numpy().copy()
            for j in np.flatnonzero(fired >= 0).tolist():
                r, k = int(idx[j]), int(fired[j])
                start = f.entry_node(k, int(toks[j]), int(past[j]))
                if start >= 0:  # else a dead trigger token (masked: see FieldRules.dead_tokens)
                    node_np[r], tree_np[r] = start, k
            new, tree = torch.from_numpy(node_np).to(self.device), torch.from_numpy(tree_np).to(self.device)
        return RowState(new, tree, torch.from_numpy(text).to(self.device))

    def _check_tails(self, tails: Optional[torch.Tensor], num_rows: int, where: str) -> None:
        """With a trigger: ConstraintConfigError unless ``tails`` holds each row's last tokens, Shape: (R, T) (T below
        ``len(trigger)`` only for a history that short: it cannot end with the trigger yet). Without them the
        trigger would never fire; ``start`` may go without: no prompt then ends with the trigger."""
        t = self._trigger_len
        if tails is None:
            if where == "start":
                return
            raise ConstraintConfigError(
                f"{where} needs tails= with a trigger: each row's last {t} tokens, the new one included, Shape: "
                f"({num_rows}, >= {t}) (all of a shorter history); without them the trigger never fires")
        got = _misfit_tails(tails, num_rows)
        if got is not None:
            raise ConstraintConfigError(
                f"tails must hold each row's last tokens, {t} (the longest trigger form) or more, or all of a shorter "
                f"history: ({num_rows}, T), got {got}")

    def _tail_is_trigger(self, tails: Optional[torch.Tensor], num_rows: int) -> torch.Tensor:
        """Rows whose ``tails`` (checked: :meth:`_check_tails`) end with a form of the trigger. Shape: (R,), bool."""
        if tails is None:
            return torch.zeros(num_rows, dtype=torch.bool, device=self.device)
        t = self._trigger_len
        tail = tails[:, -t:].to(self.device)
        if tail.shape[1] < t:  # a history shorter than the longest form may still end with a shorter one
            tail = torch.nn.functional.pad(tail, (t - tail.shape[1], 0), value=-1)
        if self._one_trigger is not None:
            return (tail == self._one_trigger).all(dim=1)
        return ((tail[:, None, :] == self._trigger) | self._trigger_any).all(dim=2).any(dim=1)

    def _groups(self, tree: torch.Tensor) -> list[tuple[int, Optional[torch.Tensor]]]:
        return row_groups(tree, len(self.tries))

    def advance(
        self, state: RowState, tokens: torch.Tensor, tails: Optional[torch.Tensor] = None, *,
        filters: Optional[RowFilters] = None,
    ) -> RowState:
        """The state after each row appends ``tokens`` (a new RowState; ``state`` is unchanged).

        Args:
            state: the rows' state before the tokens.
            tokens: the token each row appended. Shape: (R,), int64.
            tails: the rows' last tokens *including* ``tokens`` (at least ``len(trigger)`` columns; a shorter
                history padded on the left with -1); required with a trigger, unused without. Shape: (R, T).
            filters: the rows' filters; when they are ``distinct``, each entry a row completes is denied to it
                from now on (updated in place).
        """
        # Every kernel's inputs, checked here once (attributes only; written out, not is_index_tensor: each read of a
        # tensor attribute is a call into torch, and this runs at every step).
        dtype = tokens.dtype if isinstance(tokens, torch.Tensor) else None
        if dtype is None or tokens.shape != state.node.shape or (dtype is not torch.long and (
                dtype.is_floating_point or dtype.is_complex or dtype is torch.bool)):
            raise ConstraintConfigError(f"tokens must hold one integer token per state row: ({len(state)},) for the "
                                        f"state's {len(state)} rows, got {described(tokens)}")
        if self.rules.trigger:
            self._check_tails(tails, len(state), "advance")
        if dtype is not torch.long or tokens.device != self.device:
            tokens = tokens.to(self.device, torch.long)
        if filters is not None:
            filters.check_rows(len(tokens))
        if (self._free_row_is_free and filters is None and tokens.numel() == 1 and state.node.is_cpu
                and int(state.node) == FREE):
            return self._fields_move(state, tokens, state.node)  # only its text moves
        flags = None
        if filters is not None and self.kernel.supports_filters:
            flags = filters.list_flags(self.tries[0]) if filters.distinct else filters.built_node_flags(len(tokens))
        # A kernel that supports filters moves over the trie each row's filter leaves it, in the same call.
        try:
            new = self.kernel.advance_rows(self._prepared, state.node, state.tree, tokens, flags)
        except IndexError:
            self._check_state(state)
            raise
        if filters is not None and flags is None:
            new = self._off_excluded_children(state.node, tokens, new, filters)
        if filters is not None and filters.distinct and flags is None:
            done, rank = completed_ranks(state.node, new, self.dtries[0], filters.order)
            filters.add_denied(rank, done)
        elif filters is not None and filters.distinct:
            # With a list's flags (on the CPU): counted on the host, and a step that completes no entry changes no set.
            done, rank = completed_ranks(state.node.numpy(), new.numpy(), self.dtries[0], filters.order)
            if done.any():
                filters.add_denied(torch.from_numpy(rank), torch.from_numpy(done))
        if self.rules.trigger:
            fires = (new == FREE) & self._tail_is_trigger(tails, len(tokens))
            new = torch.where(fires, torch.zeros_like(new), new)
        if self.rules.fields is not None:
            return self._fields_move(state, tokens, new)
        return RowState(new, state.tree)

    def fused_step(self, state: RowState, filters: Optional[RowFilters] = None) -> Optional[Any]:
        """A one-call step (advance by each row's last token, then mask) for ``state``'s rows, or None where it does
        not apply: it needs a kernel that ``supports_fused_step`` (the C kernel, on a CPU), one trie and no trigger,
        and static ``filters`` if any (no distinct list).

        The returned step (the kernel's, e.g. :class:`~trie_decode.kernels.native.FusedStep`) keeps ``state.node``
        and updates it in place: it is for a caller that owns the state, such as the transformers processor inside
        ``generate``. With filters, each row's filter follows its parent row as ``filters.select`` would; the
        step's ``filters`` holds each row's filter index (into ``filters.node_flags(trie).rows``).

        >>> import torch
        >>> from trie_decode import TokenTrie
        >>> from trie_decode.constraint import SpanRules, TrieConstraint
        >>> c = TrieConstraint(TokenTrie.from_sequences([[5, 6], [5, 7]], vocab_size=10), SpanRules(end_token_id=0), "cpu")
        >>> state = c.start(1)
        >>> step = c.fused_step(state)
        >>> step(None, torch.zeros(1, 10))[0].isfinite().nonzero().flatten().tolist()   # the first step: mask only
        [5]
        >>> step(torch.tensor([[9, 5]]), torch.zeros(1, 10))[0].isfinite().nonzero().flatten().tolist()
        [6, 7]
        """
        if not self.kernel.supports_fused_step or len(self.tries) != 1 or self.rules.starts_late:
            return None
        if state.node.dtype is not torch.long or not state.node.is_contiguous():
            return None
        if filters is None:
            return self.kernel.fused_step(self.tables[0], state.node, self.needed_width)
        if filters.distinct or not self.kernel.supports_filters:
            return None
        filters.node_flags(self.tries[0])
        return self.kernel.fused_step(self.tables[0], state.node, self.needed_width,
                                      filters.built_node_flags(len(state)))

    def _off_excluded_children(self, node: torch.Tensor, tokens: torch.Tensor, new: torch.Tensor,
                               filters: RowFilters) -> torch.Tensor:
        """Moves over the trie a row's filters leave it (what its mask shows): a child whose subtree they exclude is
        no child, so a token that reaches one moves as a token off the trie does (e.g. the separator's first token
        when it also starts an excluded entry); an excluded entry is no entry end, so a row leaving its node ends
        (DONE). Fixed shapes, no host read."""
        d = self.dtries[0]
        flags = None if filters.distinct else filters.built_node_flags(len(node))  # a list's are its static part
        if flags is not None and node.is_cpu:
            # CPU state, with the filters' per-node bits: a few numpy gathers, and nothing more when every row
            # followed its mask (the usual case).
            n_np, new_np = node.numpy(), new.numpy()
            up = np.maximum(new_np, 0)
            own_np, new_bits_np = flags.at(np.maximum(n_np, 0)), flags.at(up)
            off, excluded = _excluded_moves(n_np, new_np, d.trie.parent[up], own_np, new_bits_np)
            if not (off | excluded).any():
                return new
            off_child, excluded_end = torch.from_numpy(off), torch.from_numpy(excluded)
        else:  # the same bits, counted for these nodes only
            n, child = node.clamp(min=0), new.clamp(min=0)
            both = filters.bits(torch.stack([n, child], 1))
            off_child, excluded_end = _excluded_moves(node, new, d.parent_tensor[child], both[:, 0], both[:, 1])
        moved = span_moves(self.tables[0].tensor, self.rules, node, tokens, torch.full_like(new, -1))
        new = torch.where(off_child, moved, new)
        return torch.where(excluded_end, torch.full_like(new, DONE), new)

    # ------------------------------------------------------------------ masks
    def mask_(
        self,
        logits: torch.Tensor,
        state: RowState,
        rows: Optional[torch.Tensor] = None,
        *,
        inplace: bool = True,
        out: Optional[torch.Tensor] = None,
        filters: Optional[RowFilters] = None,
    ) -> torch.Tensor:
        """Set every disallowed logit of the constrained rows to -inf; return the masked logits.

        Args:
            logits: Shape: (B, V), float, V >= the tries' vocabulary (wider logits, e.g. padded embeddings, are
                masked too); not requiring grad (the mask is not recorded by autograd).
            state: the state of the rows to mask.
            rows: logits row of each state row (default: state row i is logits row i; logits rows no state row
                names are left as they are), each a different row. Shape: (R,), integer; a CPU tensor is checked
                against B, and a logits row it gives to two state rows is refused (ValueError).
            inplace: modify ``logits`` (default) or return a new tensor and leave ``logits`` unchanged.
            out: write the result into this tensor (same shape, dtype and device; its contents are overwritten)
                and leave ``logits`` unchanged: out-of-place masking without an allocation per step.
            filters: per-row allow/deny sets (:meth:`filters`): children whose entries are all excluded are
                blocked too.
        """
        # Every kernel's inputs, checked here once (attributes only; the rows' range only where no device is read).
        check_logits(logits)
        InvalidTokenError.check_logits_width(logits.shape[1], self.needed_width)
        if rows is not None:
            rows = check_rows(rows, len(state), logits.shape[0], logits.device, self.kernel.reads_host)
        if filters is not None:
            filters.check_rows(len(state))
        if (self._free_row_is_free and filters is None and out is None and inplace and state.node.numel() == 1
                and state.node.is_cpu and int(state.node) == FREE):
            self.rules.fields.free_rows_(logits, state.node, state.text, rows)  # the kernel would leave it as it is
            return logits
        src = logits
        covers_all = self.kernel.writes_every_row and rows is None and len(state) == logits.shape[0]
        if out is not None:
            if out.shape != logits.shape or out.dtype != logits.dtype or out.device != logits.device:
                raise ConstraintConfigError(f"out must match the logits ({tuple(logits.shape)}, {logits.dtype}, {logits.device}), "
                                 f"got {tuple(out.shape)}, {out.dtype}, {out.device}")
            if out is not logits and not covers_all:
                out.copy_(logits)  # rows no state covers must be copied: copy, then mask in place
                src = out
        elif inplace:
            out = logits
        elif covers_all:
            out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        else:
            out = src = logits.clone()  # rows no state covers must be copied: clone, then mask in place
        flags = whole = None
        if filters is not None and self.kernel.supports_filters and self.kernel.takes_filters(out, src):
            # A distinct list's whole filter in the kernel's own pass where its flags are kept (list_flags), its own
            # rules after (apply_filters_); else static filters (their per-node bits, built once per filter), a
            # distinct list's static filter too, its emitted entries after.
            flags = whole = filters.list_flags(self.tries[0]) if filters.distinct else None
            if flags is None and (filters.has_static or not filters.distinct):
                filters.node_flags(self.tries[0])
                flags = filters.built_node_flags(len(state))
        try:
            self.kernel.mask_rows(self._prepared, out, src, state.node, state.tree, rows, flags)
        except IndexError:
            if rows is not None:  # a kernel that reads no host (torch) indexed a row out of range: name it (an error
                check_row_range(rows, logits.shape[0])  # path, where reading the rows is fine)
            self._check_state(state)
            raise
        if flags is not None and not filters.distinct:
            return out
        if filters is not None:
            apply_filters_(out, state.node, filters, self.dtries[0], self.rules, rows, static_applied=flags is not None,
                           whole_applied=whole is not None)
        if self.rules.fields is not None:
            self.rules.fields.free_rows_(out, state.node, state.text, rows)
        return out

    def _check_state(self, state: RowState) -> None:
        """Name a state no :meth:`start`/:meth:`advance` made (read on an error path: a kernel indexed out of range)."""
        node, tree = state.node.cpu(), state.tree.cpu()
        if len(tree) and (int(tree.min()) < 0 or int(tree.max()) >= len(self.tries)):
            raise ConstraintConfigError(f"state.tree holds {tree.tolist()[:8]}: trie indices must lie in [0, "
                                        f"{len(self.tries)}) (this constraint's tries); build states with start()")
        for i, t in enumerate(self.tries):
            mine = node[tree == i] if len(self.tries) > 1 else node
            if len(mine) and int(mine.max()) >= t.num_nodes:
                raise ConstraintConfigError(f"state.node holds node {int(mine.max())}, past the {t.num_nodes} nodes "
                                            f"of trie {i}: build states with start() and advance()")

    def _plans(self, state: RowState, width: int) -> list:
        """The vectorized planner's mask plans of every trie's rows (see :mod:`trie_decode.kernels.vectorized`)."""
        InvalidTokenError.check_logits_width(width, self.needed_width)
        planner = self._planner
        plans = []
        for i, pos in self._groups(state.tree):
            nodes = state.node if pos is None else state.node[pos]
            rows = pos
            if planner.ops.name == "numpy":
                nodes, rows = nodes.cpu().numpy(), None if pos is None else pos.cpu().numpy()
            try:
                plan = planner.plan(self.tables[i], nodes, rows)
            except IndexError:
                self._check_state(state)
                raise
            if plan is not None:
                plans.append(plan)
        return plans

    def allowed(self, state: RowState, width: Optional[int] = None, *,
                filters: Optional[RowFilters] = None) -> torch.Tensor:
        """Boolean mask of each row's allowed tokens (unconstrained rows allow all). Shape: (R, width), bool.

        With the rows' ``filters`` (:meth:`filters`), what the filtered mask leaves: the tokens :meth:`mask_` keeps
        finite in a row of zeros, the one filter rule (:mod:`trie_decode.filters`).
        """
        width = self.vocab_size if width is None else _count(width, "width")
        if filters is not None:
            return self.mask_(torch.zeros(len(state), width, device=self.device), state, filters=filters).isfinite()
        out = plans_to_bool(self._plans(state, width), len(state), width)
        free = self._free_rows_allowed(state, width)
        if free is not None:
            out[free[0]] = free[1].to(out.device)
        return out

    def allowed_tokens(self, state: RowState, width: Optional[int] = None) -> list[Optional[list[int]]]:
        """Each row's allowed token ids, sorted, read on the host (None: the row is unconstrained): the sparse
        form of :meth:`allowed`, for host-side callers (a ``prefix_allowed_tokens_fn``, beam bookkeeping).

        Example:
            >>> from trie_decode import TokenTrie
            >>> trie = TokenTrie.from_sequences([[3, 4], [3, 5], [6]], vocab_size=8)
            >>> c = TrieConstraint(trie, SpanRules(end_token_id=0), "cpu")
            >>> c.allowed_tokens(c.advance(c.start(2), torch.tensor([3, 6])))
            [[4, 5], [0]]
        """
        width = self.vocab_size if width is None else _count(width, "width")
        out = plans_to_lists(self._plans(state, width), len(state), width)
        free = self._free_rows_allowed(state, width)
        if free is not None:
            for r, row in zip(free[0].tolist(), free[1]):
                out[r] = None if bool(row.all()) else row.nonzero().flatten().tolist()
        return out

    def _free_rows_allowed(self, state: RowState, width: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """Text spans' FREE rows (which the step tables leave unconstrained): their rows and allowed tokens under
        the fields' own rule (:meth:`FieldRules.free_rows_`: a template's fixed token, dead triggers blocked), read
        by masking zeros with it. None when no row is FREE. Shapes: (F,) and (F, width), bool."""
        if self.rules.fields is None:
            return None
        free = (state.node == FREE).nonzero().flatten()
        if not len(free):
            return None
        zeros = torch.zeros(len(free), width, device=self.device)
        self.rules.fields.free_rows_(zeros, state.node[free], state.text[free])
        return free, zeros.isfinite()

    def bitmask(self, state: RowState, width: Optional[int] = None) -> torch.Tensor:
        """The allowed tokens as an int32 bitmask. Shape: (R, ceil(width / 32)), int32 (XGrammar's format)."""
        return pack_bitmask(self.allowed(state, width))

    def filters(
        self,
        num_rows: int,
        allow: Optional[Sequence[Any]] = None,
        deny: Optional[Sequence[Any]] = None,
        *,
        distinct: bool = False,
        max_entries: Optional[int] = None,
    ) -> RowFilters:
        """Per-row filters over this constraint's trie (one shared trie: filters restrict it per row, no rebuild).

        Args:
            num_rows: R.
            allow: per row, the entries it may use (entry keys or indices; None: all), or one spec for every row.
            deny: per row, the entries it may not use, or one spec for every row.
            distinct: in ``"repeat"`` lists, each entry a row emits is denied to it for the rest of the list, with
                every entry that shares its key (the other forms of its string: :class:`~trie_decode.filters.ItemGroups`).
            max_entries: with ``distinct`` (only), room for that many emitted entries per row (default 64).

        Example:
            >>> import torch
            >>> from trie_decode import TokenTrie
            >>> from trie_decode.constraint import SpanRules, TrieConstraint
            >>> trie = TokenTrie.from_sequences([[3, 4], [3, 5], [6]], vocab_size=8, keys=["a", "b", "c"])
            >>> c = TrieConstraint(trie, SpanRules(end_token_id=0), "cpu")
            >>> f = c.filters(1, deny=["a", "c"])
            >>> c.mask_(torch.zeros(1, 8), c.start(1), filters=f).isfinite().nonzero()[:, 1].tolist()
            [3]
        """
        if len(self.tries) != 1:
            raise ConstraintConfigError("filters restrict one shared trie: this constraint has several tries")
        # A released row is unconstrained, so no filter could apply to it: refused even before any set is given.
        check_filter_mode(self.rules.on_complete, given_filters(allow, deny) or ["allow", "deny"])
        capacity = check_distinct(self.rules.on_complete, distinct, max_entries)
        trie = self.tries[0]

        def per_row(spec: Any, what: str) -> list[Optional[np.ndarray]]:
            seen: dict[int, np.ndarray] = {}  # rows repeating one spec object (a shared spec, a prompt's beams): once
            out = []
            for s in row_specs(spec, num_rows, what):
                if s is not None and id(s) not in seen:
                    seen[id(s)] = entry_indices(trie, s, what)
                out.append(None if s is None else seen[id(s)])
            return out

        flagged = not capacity and self.kernel.supports_filters  # the kernel masks and moves with node flags
        out = RowFilters(EntryOrder.of(trie), per_row(allow, "allow"), per_row(deny, "deny"), self.device,
                         distinct_capacity=capacity, same_item=ItemGroups.of(trie) if capacity else None,
                         defer_sets=flagged)
        if flagged:
            out.node_flags(trie)  # built now, as part of the filters' setup (the padded sets only if read)
        return out

    def stop_at_forced(self, state: RowState, min_run: torch.Tensor, tail_only: torch.Tensor) -> RowState:
        """The state to mask with when rows must end where a forced run begins (vLLM's fast-forward driver).

        A row inside an entry, at a node from which at least ``min_run`` tokens are forced (and, where
        ``tail_only``, where that run completes the entry) is shown as DONE: only the end token is allowed, which
        at a non-terminal node unambiguously means "stopped here". So is a FREE row of a template whose fixed text
        from here (:meth:`FieldRules.forced_text_runs`) is at least ``min_run`` tokens (where ``tail_only``, only
        when it ends the output); the end token is not allowed there either. Rows with ``min_run`` 0 are unchanged.

        Args:
            min_run: Shape: (R,), int64. tail_only: Shape: (R,), bool.
        """
        node = state.node
        if getattr(min_run, "shape", None) != node.shape or getattr(tail_only, "shape", None) != node.shape:
            raise ConstraintConfigError(f"min_run and tail_only must hold one value per state row ({len(state)},), "
                                        f"got {described(min_run)} and {described(tail_only)}")
        at = node.clamp(min=0)
        stop = torch.zeros_like(node, dtype=torch.bool)
        for i, d in enumerate(self.dtries):  # T static: element-wise per trie, no grouping read on the host
            length, ends_entry = d.forced_runs()
            mine = state.tree == i if len(self.dtries) > 1 else torch.ones_like(stop)
            a = torch.where(mine, at, 0).clamp(max=d.num_nodes - 1)
            # With text spans an entry's end is not the output's: where tail_only, no run inside a value stops.
            tail = ends_entry[a] & (self.rules.fields is None)
            stop = stop | (mine & (node >= 0) & (min_run > 0) & (length[a] >= min_run) & (tail | ~tail_only))
        runs = self._text_runs()
        if runs is not None:
            length, ends_output = runs
            t = state.text.clamp(0, len(length) - 1)
            stop = stop | ((node == FREE) & (min_run > 0) & (length[t] >= min_run) & (ends_output[t] | ~tail_only))
        return RowState(torch.where(stop, torch.full_like(node, DONE), node), state.tree, state.text)

    def _text_runs(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The rules' forced fixed text per automaton state on this device (None: no text is forced)."""
        runs = None if self.rules.fields is None else self.rules.fields.forced_text_runs()
        if runs is None:
            return None
        if self._text_runs_on_device is None:
            self._text_runs_on_device = tuple(torch.from_numpy(a).to(self.device) for a in runs)
        return self._text_runs_on_device

    # ------------------------------------------------------------------ host-side answers
    def forced_tokens(self, state: RowState, max_tokens: int = 1 << 30) -> list[list[int]]:
        """Per row, the tokens forced from its state, host-side (used by fast-forward): the trie's forced run, plus
        the end token where an entry ends with no way on in ``"eos"`` mode, or the rest of the separator (see
        :func:`trie_decode.spans.forced_tokens`); with text spans, a FREE row's forced text
        (:meth:`FieldRules.forced_text`: a template's fixed text)."""
        nodes = state.node.cpu().numpy()
        tree = state.tree.cpu().numpy()
        out: list[list[int]] = [[] for _ in range(len(nodes))]
        for i in np.unique(tree).tolist():
            pos = np.flatnonzero(tree == i)
            for p, run in zip(pos.tolist(), forced_tokens(self.tries[i], self.rules, nodes[pos], max_tokens)):
                out[p] = run
        if self.rules.fields is not None:
            text = state.text.cpu().numpy()
            for p in np.flatnonzero(nodes == FREE).tolist():
                out[p] = self.rules.fields.forced_text(int(text[p]))[:max_tokens]
        return out

    def replay(
        self,
        generated: Union[torch.Tensor, Sequence[Sequence[int]]],
        tree: Optional[Sequence[int]] = None,
        prompt_tails: Optional[Sequence[Sequence[int]]] = None,
    ) -> list[list[Entry]]:
        """The entries each row completed, in order, by running the rows through this constraint's own transitions.

        An entry counts as completed when a row at its terminal node takes a token that is not a child (the end
        token, a separator, any token in ``"release"`` mode), or when the row ends there.

        Args:
            generated: each row's generated tokens (no prompt); rows may differ in length. Shape: (R, L).
            tree: each row's trie index (default 0; with text spans each row enters the trie of the span it is in).
            prompt_tails: each row's prompt (or its last ``len(trigger)`` tokens), for a trigger at the prompt's end
                (with text spans, for a span's ``after`` that the prompt ends in: give enough of the prompt).
        """
        rows = generated.tolist() if isinstance(generated, torch.Tensor) else [list(r) for r in generated]
        r = len(rows)
        found: list[list[Entry]] = [[] for _ in range(r)]
        if prompt_tails is not None and len(prompt_tails) != r:
            raise ConstraintConfigError(f"prompt_tails must give one prompt per row: {len(prompt_tails)} for {r} rows")
        if r == 0:
            return found
        width = max((len(x) for x in rows), default=0)
        t = self.rules.trigger_len
        tails = np.full((r, t), -1, dtype=np.int64)
        if t and prompt_tails is not None:
            for i, tail in enumerate(prompt_tails):
                tail = list(tail)[-t:]
                if tail:
                    tails[i, t - len(tail) :] = tail
        pad = np.full((r, width), -1, dtype=np.int64)
        lengths = np.array([len(x) for x in rows], dtype=np.int64)
        for i, x in enumerate(rows):
            pad[i, : len(x)] = x
        full = np.concatenate([tails, pad], axis=1)
        tree_t = torch.zeros(r, dtype=torch.long) if tree is None else torch.as_tensor(list(tree), dtype=torch.long)
        host = self if self.device.type == "cpu" else TrieConstraint(self.tries, self.rules, "cpu")
        if self.rules.fields is not None and prompt_tails is not None:
            # Text spans read the whole prompt tail (a span's ``after`` may end in it), one row at a time.
            state = RowState.cat([host.start(1, tails=torch.tensor([list(p)], dtype=torch.long)) for p in prompt_tails])
        else:
            state = host.start(r, tree_t, torch.from_numpy(tails) if t else None)

        def entry_at(tree_i: int, node: int) -> Optional[Entry]:
            idx = int(self.tries[tree_i].node_entry[node]) if node >= 0 else -1
            return self.tries[tree_i].entry(idx) if idx >= 0 else None

        for j in range(width):
            live = np.flatnonzero(lengths > j)
            if len(live) < r:
                sub = state.select(torch.from_numpy(live))
            else:
                sub = state
            tok = torch.from_numpy(pad[live, j])
            tail = torch.from_numpy(full[live, j + 1 : j + 1 + t]) if t else None
            new = host.advance(sub, tok, tail)
            # The trie each row stood in before the token: with text spans a row changes tries between values.
            old_n, new_n, old_tree = sub.node.numpy(), new.node.numpy(), sub.tree.numpy()
            for ti in np.unique(old_tree).tolist():
                mine = np.flatnonzero(old_tree == ti)
                tr = self.tries[ti]
                ended = completes_entry(old_n[mine], new_n[mine], tr.node_entry >= 0, tr.parent)
                for k in mine[ended].tolist():
                    found[int(live[k])].append(entry_at(ti, int(old_n[k])))
            if len(live) < r:
                state.assign(torch.from_numpy(live), new)
            else:
                state = new
        for i, (n, ti) in enumerate(zip(state.node.tolist(), state.tree.tolist())):
            e = entry_at(ti, n)
            if e is not None:
                found[i].append(e)
        return found
