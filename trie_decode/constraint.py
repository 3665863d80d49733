"""Per-row constraint state and its vectorized transitions: which trie node each row is at, and what it may emit.

Why this exists: the transformers processor, the fast-forward loop and the vLLM processors all need the same
thing: a batch of rows, each constrained by one of several tries, each at some point of a span (inside an entry,
after it, waiting for a trigger), advanced by one token per step and masked accordingly. That logic lives here,
as array operations over all rows at once, so the integrations stay thin and behave identically.

A row's state is one int64 ``node`` (plus the index of its trie):

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

Each (trie, rules) pair gets a *step table*: per node and per negative code, the row's child range, dense slot, a
token it surely keeps (the padding anchor) and its extra tokens (end, separator). Masking a batch is then one table
gather plus the kernel of :mod:`trie_decode.masking` (CUDA, MPS), or one call of the fused C kernel that reads the
same table (CPU, :mod:`trie_decode._native`); rows whose anchor is -1 are unconstrained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from . import _native
from ._backend import NUMPY, TORCH, Ops
from .device import DeviceTrie
from .errors import ConstraintConfigError, InvalidTokenError
from .masking import MaskPlan, apply_plans_, pack_bitmask, plans_to_bool
from .trie import TokenTrie

__all__ = ["SpanRules", "RowState", "TrieConstraint", "DONE", "FREE"]

DONE, FREE = -1, -2
ON_COMPLETE_MODES = ("eos", "release", "repeat")
# Step table columns.
_START, _COUNT, _SLOT, _ANCHOR, _EXTRA0, _EXTRA1 = range(6)


def _token_tuple(value: Any, what: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,)
    try:
        out = tuple(value)
    except TypeError as exc:
        raise ConstraintConfigError(f"{what} must be a token id or a sequence of token ids, got {value!r}") from exc
    for tok in out:
        if isinstance(tok, bool) or not isinstance(tok, (int, np.integer)):
            raise ConstraintConfigError(f"{what} must hold integer token ids, got {tok!r}")
        if tok < 0:
            raise ConstraintConfigError(f"{what} holds a negative token id {tok}")
    return tuple(int(t) for t in out)


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
        end = self.end_token_id
        if isinstance(end, bool) or not isinstance(end, (int, np.integer)) or end < 0:
            raise ConstraintConfigError(f"end_token_id must be a non-negative token id, got {end!r}")
        object.__setattr__(self, "end_token_id", int(end))
        if self.on_complete not in ON_COMPLETE_MODES:
            raise ConstraintConfigError(f"on_complete must be one of {ON_COMPLETE_MODES}, got {self.on_complete!r}")
        object.__setattr__(self, "separator", _token_tuple(self.separator, "separator"))
        object.__setattr__(self, "trigger", _token_tuple(self.trigger, "trigger"))
        if self.on_complete == "repeat" and not self.separator:
            raise ConstraintConfigError('on_complete="repeat" needs a separator (token ids between entries)')
        if self.on_complete != "repeat" and self.separator:
            raise ConstraintConfigError(f'a separator is only used with on_complete="repeat", not {self.on_complete!r}')

    def check_vocab(self, width: int) -> None:
        """Raise :class:`InvalidTokenError` if a configured token is outside ``[0, width)``."""
        for what, toks in (("end_token_id", (self.end_token_id,)), ("separator", self.separator), ("trigger", self.trigger)):
            for tok in toks:
                if tok >= width:
                    raise InvalidTokenError(f"{what} token {tok} is outside the vocabulary [0, {width})")


@dataclass
class RowState:
    """The state of R rows: ``node`` (see the module docstring) and ``tree`` (trie index); Shape: (R,), int64."""

    node: torch.Tensor
    tree: torch.Tensor

    def __len__(self) -> int:
        return self.node.numel()

    def select(self, index: torch.Tensor) -> "RowState":
        """Rows ``index`` of this state (a gather: used when rows are reordered, e.g. by beam search)."""
        return RowState(self.node[index], self.tree[index])

    def clone(self) -> "RowState":
        return RowState(self.node.clone(), self.tree.clone())

    def assign(self, index: Any, other: "RowState") -> None:
        """Write ``other``'s rows into rows ``index`` of this state (in place)."""
        self.node[index] = other.node
        self.tree[index] = other.tree

    @staticmethod
    def cat(states: Sequence["RowState"]) -> "RowState":
        return RowState(torch.cat([s.node for s in states]), torch.cat([s.tree for s in states]))

    @property
    def done(self) -> torch.Tensor:
        """Rows that may only emit the end token. Shape: (R,), bool."""
        return self.node == DONE


class _StepTable:
    """The step table of one (trie, rules) pair on one device. Shape: (N + K, 6), int32 (K code rows at the end,
    so that a negative code indexes its own row)."""

    def __init__(self, dtrie: DeviceTrie, rules: SpanRules) -> None:
        trie = dtrie.trie
        n = trie.num_nodes
        sep = rules.separator
        fanout = trie.fanout
        slot = dtrie.tensors.dense_slot.cpu().numpy()
        terminal = trie.node_entry >= 0
        end = rules.end_token_id
        table = np.full((n, 6), -1, dtype=np.int32)
        table[:, _START] = trie.child_ptr[:-1]
        table[:, _COUNT] = np.where(slot >= 0, 0, fanout)
        table[:, _SLOT] = slot
        first_child = trie.token[np.minimum(trie.child_ptr[:-1], n - 1)]
        table[:, _ANCHOR] = np.where(fanout > 0, first_child, end)
        if rules.on_complete == "release":
            table[terminal, _ANCHOR] = -1  # an entry is complete: the row is unconstrained
        else:
            table[terminal, _EXTRA0] = end
            if rules.on_complete == "repeat":
                table[terminal, _EXTRA1] = sep[0]
        # Code rows, for codes -K .. -1 in this order (so that table[code] is the code's row).
        codes = {DONE: (0, 0, -1, end, end, -1), FREE: (0, 0, -1, -1, -1, -1)}
        for k in range(1, len(sep)):
            codes[-2 - k] = (0, 0, -1, sep[k], sep[k], -1)
        self.num_codes = len(codes)
        code_rows = np.array([codes[c] for c in range(-self.num_codes, 0)], dtype=np.int32)
        full = np.concatenate([table, code_rows])
        self.tensor = torch.from_numpy(full).to(dtrie.device)
        self.array = self.tensor.numpy() if dtrie.device.type == "cpu" else None
        self.max_width = int(table[:, _COUNT].max()) if n else 0
        self.dtrie = dtrie
        self.kernel_args = _native.static_args(self) if dtrie.device.type == "cpu" else None

    @classmethod
    def get(cls, dtrie: DeviceTrie, rules: SpanRules) -> "_StepTable":
        """The table of (dtrie, rules), built once and kept with the DeviceTrie (so per request it costs nothing)."""
        cache = dtrie.__dict__.setdefault("_step_tables", {})
        table = cache.get(rules)
        if table is None:
            table = cache[rules] = cls(dtrie, rules)
        return table

    def on(self, ops: Ops) -> Any:
        return self.array if ops is NUMPY else self.tensor


class TrieConstraint:
    """A set of tries plus span rules: starts, advances and masks rows, all rows at once.

    Args:
        tries: one trie, or several (each row then names its trie by index).
        rules: the :class:`SpanRules`.
        device: the logits' device.
        dense_min_fanout: nodes with at least this many children are masked from a dense row (default 2048).

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
    ) -> None:
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
        rules.check_vocab(self.vocab_size)
        if dense_min_fanout is None:
            self.dtries = [DeviceTrie.get(t, self.device) for t in tries]
        else:
            self.dtries = [DeviceTrie(t, self.device, dense_min_fanout=dense_min_fanout) for t in tries]
        self.tables = [_StepTable.get(d, rules) for d in self.dtries]
        # Index arithmetic runs in numpy on CPU (10x less dispatch overhead than torch), in torch elsewhere; on CPU
        # the whole step runs in the C kernel when it was built (see trie_decode._native).
        self._ops = NUMPY if self.device.type == "cpu" else TORCH
        self._native = self.device.type == "cpu" and _native.enabled()
        self._plain = rules.on_complete == "eos" and not rules.trigger  # the next state is the trie's child
        self._trigger = torch.tensor(rules.trigger, dtype=torch.long, device=self.device)

    # ------------------------------------------------------------------ state
    def start(self, num_rows: int, tree: Optional[torch.Tensor] = None, tails: Optional[torch.Tensor] = None) -> RowState:
        """The state of rows about to generate their first token.

        Args:
            num_rows: R.
            tree: each row's trie index (default 0). Shape: (R,), int64.
            tails: the rows' last tokens before generation (at least ``len(trigger)`` columns); used only with a
                trigger: a prompt that already ends with the trigger starts inside the entry.
        """
        dev = self.device
        tree = torch.zeros(num_rows, dtype=torch.long, device=dev) if tree is None else tree.to(dev, torch.long)
        if tree.numel() and (int(tree.min()) < 0 or int(tree.max()) >= len(self.tries)):
            raise ConstraintConfigError(f"row trie indices must be in [0, {len(self.tries)})")
        node = torch.zeros(num_rows, dtype=torch.long, device=dev)
        if self.rules.trigger:
            node = torch.where(self._tail_is_trigger(tails, num_rows), node, torch.full_like(node, FREE))
        return RowState(node, tree)

    def _tail_is_trigger(self, tails: Optional[torch.Tensor], num_rows: int) -> torch.Tensor:
        t = len(self.rules.trigger)
        if tails is None or tails.shape[-1] < t:
            return torch.zeros(num_rows, dtype=torch.bool, device=self.device)
        return (tails[:, -t:].to(self.device) == self._trigger).all(dim=1)

    def _groups(self, tree: torch.Tensor) -> list[tuple[int, Optional[torch.Tensor]]]:
        """(trie index, row positions or None for all rows) for every trie that has rows."""
        if len(self.tries) == 1:
            return [(0, None)]
        present = torch.unique(tree).tolist()
        return [(i, (tree == i).nonzero().squeeze(1)) for i in present]

    def advance(self, state: RowState, tokens: torch.Tensor, tails: Optional[torch.Tensor] = None) -> RowState:
        """The state after each row appends ``tokens`` (a new RowState; ``state`` is unchanged).

        Args:
            state: the rows' state before the tokens.
            tokens: the token each row appended. Shape: (R,), int64.
            tails: the rows' last tokens *including* ``tokens`` (at least ``len(trigger)`` columns); needed only
                with a trigger.
        """
        if tokens.dtype is not torch.long or tokens.device != self.device:
            tokens = tokens.to(self.device, torch.long)
        node = state.node
        ops = self._ops
        groups = self._groups(state.tree)
        new = None if groups[0][1] is None else torch.full_like(node, DONE)
        for i, rows in groups:
            n = node if rows is None else node[rows]
            t = tokens if rows is None else tokens[rows]
            if self._native:
                out = _native.child(self.dtries[i], n, t)  # torch in and out
                if not self._plain:
                    out = torch.from_numpy(self._span_moves(i, n.numpy(), t.numpy(), out.numpy(), NUMPY))
            elif ops is NUMPY:
                n_, t_ = n.numpy(), t.numpy()
                out = torch.from_numpy(self._span_moves(i, n_, t_, self.dtries[i].step(n_, t_, ops), ops))
            else:
                out = self._span_moves(i, n, t, self.dtries[i].step(n, t, ops), ops)
            if rows is None:
                new = out
            else:
                new[rows] = out
        if self.rules.trigger:
            fires = (new == FREE) & self._tail_is_trigger(tails, len(tokens))
            new = torch.where(fires, torch.zeros_like(new), new)
        return RowState(new, state.tree)

    def _span_moves(self, i: int, node: Any, tok: Any, child: Any, ops: Ops) -> Any:
        """The span rules on top of the trie step: ``child`` (the child of each node by each token, -1 for
        non-children and for every negative code) becomes each row's next state code (modified in place)."""
        rules = self.rules
        mode = rules.on_complete
        if self._plain:
            return child
        table = self.tables[i].on(ops)
        row = table[node]
        left = child < 0
        if mode == "eos":
            child[left & (node == FREE)] = FREE
        elif mode == "release":
            released = left & (((node >= 0) & (row[:, _ANCHOR] < 0)) | (node == FREE))
            child[released] = FREE
        else:  # repeat
            sep = rules.separator
            at_end = left & (node >= 0) & (row[:, _EXTRA1] >= 0) & (tok == sep[0])
            child[at_end] = 0 if len(sep) == 1 else -3
            in_sep = left & (node <= -3)
            k = -2 - node  # separator position expected next, for rows in the separator
            ok = in_sep & (tok == row[:, _ANCHOR])
            child[ok & (k + 1 >= len(sep))] = 0
            more = ok & (k + 1 < len(sep))
            child[more] = node[more] - 1
            child[left & (node == FREE)] = FREE
        return child

    # ------------------------------------------------------------------ masks
    def plans(self, state: RowState, rows: Optional[torch.Tensor], ops: Ops) -> list[MaskPlan]:
        """Mask plans of the constrained rows of ``state`` (unconstrained rows are left out).

        Args:
            rows: logits row of each state row; None means state row i is logits row i.
            ops: the backend of the index arithmetic (the plans hold torch tensors either way).
        """
        plans = []
        node_all = state.node.numpy() if ops is NUMPY else state.node
        rows_all = None if rows is None else (rows.numpy() if ops is NUMPY else rows)
        for i, pos in self._groups(state.tree):
            if pos is not None:
                pos = pos.numpy() if ops is NUMPY else pos
            node = node_all if pos is None else node_all[pos]
            lrows = (rows_all if pos is None else (pos if rows_all is None else rows_all[pos]))
            plan = self._plan_group(i, node, lrows, ops)
            if plan is not None:
                plans.append(plan)
        return plans

    def _plan_group(self, i: int, node: Any, rows: Optional[Any], ops: Ops) -> Optional[MaskPlan]:
        """Plan the mask of the rows of one trie (arrays of ``ops``' backend in, torch tensors out).

        Steps:
          1. Gather each row's step-table row (child range, dense slot, anchor, extras).
          2. One host read: the number of child tokens to keep, of unconstrained rows, of dense rows.
          3. Drop unconstrained rows.
          4. Lay the kept (row, token) pairs out flat: every child of every sparse row (a ragged gather, so the
             cost is the number of allowed tokens, not rows x widest row), then each row's anchor and extras.
        """
        table = self.tables[i].on(ops)
        info = ops.int64(table[node])
        count, anchor, slot = info[:, _COUNT], info[:, _ANCHOR], info[:, _SLOT]
        if ops is NUMPY:
            total, n_free, n_dense = int(count.sum()), int((anchor < 0).sum()), int((slot >= 0).sum())
        else:
            total, n_free, n_dense = torch.stack([count.sum(), (anchor < 0).sum(), (slot >= 0).sum()]).tolist()
        masked_rows = rows
        if n_free:
            keep = ops.nonzero(anchor >= 0)
            if len(keep) == 0:
                return None
            info = info[keep]
            masked_rows = keep if rows is None else rows[keep]
            count, anchor, slot = info[:, _COUNT], info[:, _ANCHOR], info[:, _SLOT]
            total = int(count.sum())
        r = info.shape[0]
        extras = info[:, _ANCHOR : _EXTRA1 + 1 if self.rules.on_complete == "repeat" else _EXTRA0 + 1]
        x = extras.shape[1]
        local = ops.arange(r, info)
        if total:
            a = self.dtries[i].on(ops)
            row_of = ops.repeat(local, count, total)
            ends = ops.cumsum(count)
            child = info[:, _START][row_of] + (ops.arange(total, info) - (ends - count)[row_of])
            row_flat = ops.cat([row_of, ops.repeat(local, None, x)], 0)
            col_flat = ops.cat([ops.int64(a.child_token[child]), extras.reshape(-1)], 0)
        else:
            row_flat, col_flat = ops.repeat(local, None, x), extras.reshape(-1)
        # Extras of -1 (none) point at the row's anchor: a column the row keeps anyway.
        missing = col_flat < 0
        col_flat = col_flat + missing * (anchor[row_flat] - col_flat)
        logits_rows = row_flat if masked_rows is None else masked_rows[row_flat]
        plan = MaskPlan(
            rows=_to_torch(logits_rows),
            cols=_to_torch(col_flat),
            masked_rows=None if masked_rows is None else _to_torch(masked_rows),
        )
        if n_dense:
            dense_pos = ops.nonzero(slot >= 0)
            dense_rows = dense_pos if masked_rows is None else masked_rows[dense_pos]
            plan.dense_rows = _to_torch(dense_rows)
            plan.dense_blocked = _to_torch(self.dtries[i].on(ops).dense_blocked[slot[dense_pos]])
        return plan

    def mask_(
        self, logits: torch.Tensor, state: RowState, rows: Optional[torch.Tensor] = None, *, inplace: bool = True
    ) -> torch.Tensor:
        """Set every disallowed logit of the constrained rows to -inf; return the masked logits.

        Args:
            logits: Shape: (B, V), V >= the tries' vocabulary (wider logits, e.g. padded embeddings, are masked too).
            state: the state of the rows to mask.
            rows: logits row of each state row (default: state row i is logits row i).
            inplace: modify ``logits`` (default) or return a new tensor and leave ``logits`` unchanged.
        """
        if logits.shape[-1] < self.vocab_size:
            raise InvalidTokenError(
                f"logits have {logits.shape[-1]} columns but the trie's vocabulary has {self.vocab_size} tokens: "
                "the trie was built for a larger vocabulary than this model's"
            )
        if self._native and _native.usable_logits(logits):
            return self._mask_native(logits, state, rows, inplace)
        return apply_plans_(logits, self.plans(state, rows, self._ops), inplace=inplace)

    def _mask_native(
        self, logits: torch.Tensor, state: RowState, rows: Optional[torch.Tensor], inplace: bool
    ) -> torch.Tensor:
        """:meth:`mask_` through the fused CPU kernel (one pass per row; see :mod:`trie_decode._native`)."""
        src = logits
        if inplace:
            out = logits
        elif rows is None and len(state) == logits.shape[0]:
            out = torch.empty(logits.shape, dtype=logits.dtype)  # every row is written: masked, or copied through
        else:
            out = src = logits.clone()  # rows no state covers must be copied: clone, then mask in place
        for i, pos in self._groups(state.tree):
            nodes = state.node if pos is None else state.node[pos]
            lrows = rows if pos is None else (pos if rows is None else rows[pos])
            _native.mask_rows(out, src, nodes, lrows, self.tables[i])
        return out

    def allowed(self, state: RowState, width: Optional[int] = None) -> torch.Tensor:
        """Boolean mask of each row's allowed tokens (unconstrained rows allow all). Shape: (R, width), bool."""
        width = width or self.vocab_size
        return plans_to_bool(self.plans(state, None, self._ops), len(state), width)

    def bitmask(self, state: RowState, width: Optional[int] = None) -> torch.Tensor:
        """The allowed tokens as an int32 bitmask. Shape: (R, ceil(width / 32)), int32 (XGrammar's format)."""
        return pack_bitmask(self.allowed(state, width))

    def forced_tokens(self, state: RowState, max_tokens: int = 1 << 30) -> list[list[int]]:
        """Per row, the tokens forced from its state, host-side (used by fast-forward): the trie's unique run,
        plus the end token where an entry ends with no way on in ``"eos"`` mode, or the rest of the separator."""
        rules = self.rules
        out: list[list[int]] = []
        for n, t in zip(state.node.tolist(), state.tree.tolist()):
            run: list[int] = []
            if n >= 0:
                trie = self.tries[t]
                run = trie.forced_run(n)[:max_tokens]
                if rules.on_complete == "eos" and len(run) < max_tokens:
                    last = trie.walk(run, n) if run else n
                    if trie.child_ptr[last + 1] == trie.child_ptr[last]:
                        run.append(rules.end_token_id)
            elif n <= -3:
                run = list(rules.separator[-2 - n :])[:max_tokens]
            elif n == DONE:
                run = [rules.end_token_id][:max_tokens]
            out.append(run)
        return out


def _to_torch(x: Any) -> Any:
    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x
