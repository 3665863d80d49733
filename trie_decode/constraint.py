"""Per-row constraint state and its vectorized transitions: which trie node a row is at, and what is allowed.

Why this exists: the transformers processor, the fast-forward loop and the vLLM processors all need the same
thing: a batch of rows, each constrained by one of several tries, each at some point of a span (inside an entry,
after it, waiting for a trigger), advanced by one token per step and masked accordingly. Keeping that logic here,
in tensor operations over all rows at once, makes the integrations thin and identical in behaviour.

A row's state is three int64 numbers (kept as tensors on the logits' device, see :class:`RowState`):

    phase  IN_ENTRY (inside the trie, at ``node``), FREE (unconstrained: released, or waiting for the trigger),
           DONE (only the end token), SEPARATOR (emitting separator token number ``aux``, repeat mode)
    node   the trie node (IN_ENTRY), else -1
    tree   which trie of the constraint the row uses

End of an entry (``on_complete``):
    "eos"     the end token is allowed at terminal nodes (with the children, if the entry prefixes another);
              once chosen, the row allows only the end token.
    "release" at a terminal node every token is allowed; a child continues the entry, anything else ends the span
              and the row is unconstrained (or waits for the trigger again).
    "repeat"  lists of entries: at a terminal node the separator's first token starts the separator (its remaining
              tokens are forced), after which a new entry starts at the root; the end token ends the list.
A trigger (a token sequence) makes the constraint start only after it appears; the row is FREE until then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence, Union

import torch

from .device import DeviceTrie
from .errors import ConstraintConfigError, InvalidTokenError
from .masking import RowMaskPlan, allowed_mask, apply_plans_, pack_bitmask, plan_rows
from .trie import TokenTrie

__all__ = ["SpanRules", "RowState", "TrieConstraint", "IN_ENTRY", "FREE", "DONE", "SEPARATOR"]

IN_ENTRY, FREE, DONE, SEPARATOR = 0, 1, 2, 3
ON_COMPLETE_MODES = ("eos", "release", "repeat")


def _token_tuple(value: Any, what: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (int,)) and not isinstance(value, bool):
        return (int(value),)
    try:
        out = tuple(value)
    except TypeError as exc:
        raise ConstraintConfigError(f"{what} must be a token id or a sequence of token ids, got {value!r}") from exc
    for tok in out:
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise ConstraintConfigError(f"{what} must hold integer token ids, got {tok!r}")
        if tok < 0:
            raise ConstraintConfigError(f"{what} holds a negative token id {tok}")
    return out


@dataclass(frozen=True)
class SpanRules:
    """How a constrained span starts and ends.

    Args:
        end_token_id: the token that ends an entry (``"eos"``/``"repeat"``) and the fallback of any row that would
            otherwise allow nothing; usually the model's EOS id.
        on_complete: ``"eos"`` (default), ``"release"`` or ``"repeat"`` (see the module docstring).
        separator: token ids between entries in ``"repeat"`` mode (e.g. the tokens of ``", "``).
        trigger: token ids after which the constraint starts; empty = it starts with generation.
    """

    end_token_id: int
    on_complete: str = "eos"
    separator: tuple[int, ...] = ()
    trigger: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.end_token_id, bool) or not isinstance(self.end_token_id, int) or self.end_token_id < 0:
            raise ConstraintConfigError(f"end_token_id must be a non-negative token id, got {self.end_token_id!r}")
        if self.on_complete not in ON_COMPLETE_MODES:
            raise ConstraintConfigError(f"on_complete must be one of {ON_COMPLETE_MODES}, got {self.on_complete!r}")
        object.__setattr__(self, "separator", _token_tuple(self.separator, "separator"))
        object.__setattr__(self, "trigger", _token_tuple(self.trigger, "trigger"))
        if self.on_complete == "repeat" and not self.separator:
            raise ConstraintConfigError('on_complete="repeat" needs a separator (token ids between entries)')
        if self.on_complete != "repeat" and self.separator:
            raise ConstraintConfigError(f'a separator is only used with on_complete="repeat", not {self.on_complete!r}')

    def check_vocab(self, width: int) -> None:
        """Raise if a configured token is outside ``[0, width)``."""
        for what, toks in (("end_token_id", (self.end_token_id,)), ("separator", self.separator), ("trigger", self.trigger)):
            for tok in toks:
                if tok >= width:
                    raise InvalidTokenError(f"{what} token {tok} is outside the vocabulary [0, {width})")


@dataclass
class RowState:
    """The state of R rows, each field Shape: (R,), int64, on the logits' device."""

    phase: torch.Tensor
    node: torch.Tensor
    aux: torch.Tensor
    tree: torch.Tensor

    def select(self, index: torch.Tensor) -> "RowState":
        """Rows ``index`` of this state (a gather: used when rows are reordered, e.g. by beam search)."""
        return RowState(self.phase[index], self.node[index], self.aux[index], self.tree[index])

    def __len__(self) -> int:
        return self.phase.numel()

    def clone(self) -> "RowState":
        return RowState(self.phase.clone(), self.node.clone(), self.aux.clone(), self.tree.clone())

    def assign(self, index: torch.Tensor, other: "RowState") -> None:
        """Write ``other``'s rows into rows ``index`` of this state (in place)."""
        self.phase[index] = other.phase
        self.node[index] = other.node
        self.aux[index] = other.aux
        self.tree[index] = other.tree

    @staticmethod
    def cat(states: Sequence["RowState"]) -> "RowState":
        return RowState(*(torch.cat([getattr(s, f) for s in states]) for f in ("phase", "node", "aux", "tree")))


class TrieConstraint:
    """A set of tries plus span rules: starts, advances and masks rows, all rows at once.

    Args:
        tries: one trie, or several (each row then names its trie by index).
        rules: the :class:`SpanRules`.
        device: the logits' device.

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

    def __init__(self, tries: Union[TokenTrie, Sequence[TokenTrie]], rules: SpanRules, device: torch.device | str) -> None:
        tries = [tries] if isinstance(tries, TokenTrie) else list(tries)
        if not tries:
            raise ConstraintConfigError("a constraint needs at least one trie")
        for i, t in enumerate(tries):
            if not isinstance(t, TokenTrie):
                raise TypeError(f"tries[{i}] is {type(t).__name__}, not a TokenTrie")
        self.tries = tries
        self.rules = rules
        self.device = torch.device(device)
        self.vocab_size = max(t.vocab_size for t in tries)
        rules.check_vocab(max(self.vocab_size, rules.end_token_id + 1))
        self.dtries = [DeviceTrie.get(t, self.device) for t in tries]
        self._sep = torch.tensor(rules.separator or (0,), dtype=torch.long, device=self.device)
        self._trigger = torch.tensor(rules.trigger, dtype=torch.long, device=self.device)

    # ------------------------------------------------------------------ state
    def start(self, num_rows: int, tree: Optional[torch.Tensor] = None, tails: Optional[torch.Tensor] = None) -> RowState:
        """The state of rows about to generate their first token.

        Args:
            num_rows: R.
            tree: each row's trie index (default 0). Shape: (R,), int64.
            tails: the last tokens before generation (the prompt's tail, at least ``len(trigger)`` columns), used
                only with a trigger: a prompt that ends with the trigger starts inside the entry.
        """
        dev = self.device
        tree = torch.zeros(num_rows, dtype=torch.long, device=dev) if tree is None else tree.to(dev, torch.long)
        if tree.numel() and (int(tree.min()) < 0 or int(tree.max()) >= len(self.tries)):
            raise ConstraintConfigError(f"row trie indices must be in [0, {len(self.tries)})")
        phase = torch.full((num_rows,), IN_ENTRY, dtype=torch.long, device=dev)
        node = torch.zeros(num_rows, dtype=torch.long, device=dev)
        if self.rules.trigger:
            triggered = self._tail_is_trigger(tails, num_rows)
            phase = torch.where(triggered, phase, torch.full_like(phase, FREE))
            node = torch.where(triggered, node, torch.full_like(node, -1))
        return RowState(phase, node, torch.zeros_like(node), tree)

    def _tail_is_trigger(self, tails: Optional[torch.Tensor], num_rows: int) -> torch.Tensor:
        t = len(self.rules.trigger)
        if tails is None or tails.shape[-1] < t:
            return torch.zeros(num_rows, dtype=torch.bool, device=self.device)
        return (tails[:, -t:].to(self.device) == self._trigger).all(dim=1)

    def _step_nodes(self, state: RowState, tokens: torch.Tensor) -> torch.Tensor:
        if len(self.dtries) == 1:
            return self.dtries[0].step(state.node, tokens)
        child = torch.full_like(state.node, -1)
        for i, dt in enumerate(self.dtries):
            rows = (state.tree == i).nonzero().squeeze(1)
            if rows.numel():
                child[rows] = dt.step(state.node[rows], tokens[rows])
        return child

    def _terminal(self, state: RowState) -> torch.Tensor:
        if len(self.dtries) == 1:
            return self.dtries[0].is_terminal(state.node)
        out = torch.zeros_like(state.node, dtype=torch.bool)
        for i, dt in enumerate(self.dtries):
            rows = (state.tree == i).nonzero().squeeze(1)
            if rows.numel():
                out[rows] = dt.is_terminal(state.node[rows])
        return out

    def advance(self, state: RowState, tokens: torch.Tensor, tails: Optional[torch.Tensor] = None) -> RowState:
        """The state after each row appends ``tokens`` (a new RowState; ``state`` is not modified).

        Args:
            state: the rows' state before the tokens.
            tokens: the token each row appended. Shape: (R,), int64.
            tails: the rows' last tokens *including* ``tokens`` (at least ``len(trigger)`` columns); needed only
                with a trigger.
        """
        rules = self.rules
        tokens = tokens.to(self.device, torch.long)
        phase, node, aux = state.phase, state.node, state.aux
        in_entry = phase == IN_ENTRY
        child = self._step_nodes(state, tokens)
        moved = in_entry & (child >= 0)
        terminal = in_entry & self._terminal(state) & ~moved
        left = in_entry & ~moved  # the token is not a child: the entry ended here (or the row is junk)

        new_phase = torch.where(left, torch.full_like(phase, DONE), phase)
        new_node = torch.where(moved, child, torch.where(left, torch.full_like(node, -1), node))
        new_aux = aux.clone()
        mode = rules.on_complete
        if mode == "release":
            new_phase = torch.where(terminal, torch.full_like(phase, FREE), new_phase)
        elif mode == "repeat":
            sep = self._sep
            starts_sep = terminal & (tokens == sep[0])
            if len(rules.separator) == 1:
                new_phase = torch.where(starts_sep, torch.full_like(phase, IN_ENTRY), new_phase)
                new_node = torch.where(starts_sep, torch.zeros_like(node), new_node)
            else:
                new_phase = torch.where(starts_sep, torch.full_like(phase, SEPARATOR), new_phase)
                new_aux = torch.where(starts_sep, torch.ones_like(aux), new_aux)
            in_sep = phase == SEPARATOR
            expected = sep[aux.clamp(0, len(rules.separator) - 1)]
            ok = in_sep & (tokens == expected)
            finished_sep = ok & (aux + 1 >= len(rules.separator))
            new_phase = torch.where(in_sep & ~ok, torch.full_like(phase, DONE), new_phase)
            new_phase = torch.where(finished_sep, torch.full_like(phase, IN_ENTRY), new_phase)
            new_node = torch.where(finished_sep, torch.zeros_like(node), new_node)
            new_aux = torch.where(ok & ~finished_sep, aux + 1, torch.where(finished_sep, torch.zeros_like(aux), new_aux))
        # eos mode: any token that is not a child (the end token or junk) leaves the row DONE, as set above.
        if rules.trigger:
            fires = (new_phase == FREE) & self._tail_is_trigger(tails, len(tokens))
            new_phase = torch.where(fires, torch.full_like(phase, IN_ENTRY), new_phase)
            new_node = torch.where(fires, torch.zeros_like(node), new_node)
        return RowState(new_phase, new_node, new_aux, state.tree)

    # ------------------------------------------------------------------ masks
    def plans(self, state: RowState, rows: Optional[torch.Tensor] = None) -> list[RowMaskPlan]:
        """Mask plans of the constrained rows of ``state`` (FREE rows and released terminal rows are left out).

        Args:
            rows: logits row of each state row (default: the identity). Shape: (R,), int64.
        """
        rules = self.rules
        r = len(state)
        rows = torch.arange(r, device=self.device) if rows is None else rows
        phase, node = state.phase, state.node
        in_entry = phase == IN_ENTRY
        terminal = in_entry & self._terminal(state)
        constrained = phase != FREE
        if rules.on_complete == "release":
            constrained = constrained & ~terminal
        end = torch.full_like(node, rules.end_token_id)
        none = torch.full_like(node, -1)
        if rules.on_complete == "eos":
            extra0 = torch.where(terminal | (phase == DONE), end, none)
            extra = extra0.unsqueeze(1)
        elif rules.on_complete == "repeat":
            sep_tok = self._sep[state.aux.clamp(0, len(rules.separator) - 1)]
            extra0 = torch.where(terminal | (phase == DONE), end, torch.where(phase == SEPARATOR, sep_tok, none))
            extra1 = torch.where(terminal, self._sep[0].expand_as(node), none)
            extra = torch.stack([extra0, extra1], dim=1)
        else:
            extra = torch.where(phase == DONE, end, none).unsqueeze(1)
        masked_nodes = torch.where(in_entry, node, none)
        plans = []
        for i, dt in enumerate(self.dtries):
            pick = constrained if len(self.dtries) == 1 else constrained & (state.tree == i)
            idx = pick.nonzero().squeeze(1)
            if idx.numel() == 0:
                continue
            if idx.numel() == r:
                plans.append(plan_rows(dt, rows, masked_nodes, extra, rules.end_token_id))
            else:
                plans.append(plan_rows(dt, rows[idx], masked_nodes[idx], extra[idx], rules.end_token_id))
        return plans

    def mask_(self, logits: torch.Tensor, state: RowState, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Set every disallowed logit of the constrained rows to -inf, in place; return ``logits``.

        Args:
            logits: Shape: (B, V) with V >= the tries' vocabulary (padded embedding columns are masked too).
            state: the state of the rows to mask.
            rows: logits row of each state row (default: row i of the state is logits row i).
        """
        if logits.shape[-1] < self.vocab_size:
            raise InvalidTokenError(
                f"logits have {logits.shape[-1]} columns but the trie's vocabulary has {self.vocab_size} tokens: "
                "the trie was built for a larger vocabulary than this model's"
            )
        return apply_plans_(logits, self.plans(state, rows))

    def allowed(self, state: RowState, width: Optional[int] = None) -> torch.Tensor:
        """Boolean mask of the allowed tokens of every row (FREE rows allow everything). Shape: (R, width)."""
        width = width or max(self.vocab_size, self.rules.end_token_id + 1)
        return allowed_mask(self.plans(state), len(state), width, self.device)

    def bitmask(self, state: RowState, width: Optional[int] = None) -> torch.Tensor:
        """The allowed tokens as an int32 bitmask. Shape: (R, ceil(width / 32)), int32 (XGrammar's format)."""
        return pack_bitmask(self.allowed(state, width))

    def forced_tokens(self, state: RowState, max_tokens: int = 1 << 30) -> list[list[int]]:
        """Per row, the tokens forced from its state: the trie's unique run (plus the end token where an entry
        ends with no way on in ``"eos"`` mode, or the remaining separator tokens). Host-side; used by fast-forward.
        """
        out: list[list[int]] = []
        phase, node, aux, tree = (t.tolist() for t in (state.phase, state.node, state.aux, state.tree))
        rules = self.rules
        for p, n, a, t in zip(phase, node, aux, tree):
            run: list[int] = []
            if p == IN_ENTRY:
                trie = self.tries[t]
                run = trie.forced_run(n)[:max_tokens]
                if rules.on_complete == "eos" and len(run) < max_tokens:
                    end_node = trie.walk(run, n) if run else n
                    if trie.fanout[end_node] == 0:
                        run.append(rules.end_token_id)
            elif p == SEPARATOR:
                run = list(rules.separator[a:])[:max_tokens]
            out.append(run)
        return out
