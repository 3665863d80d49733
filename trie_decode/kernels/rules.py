"""The masking rules every kernel applies, each stated once: the floor of a row whose kept values were all banned,
and which step-table columns hold the tokens a row keeps besides its children (:func:`extras_end`).

Why this exists: a rule written into every kernel (C, vectorized, fixed-shape, the filters' pass) is a rule that
drifts. As in XGrammar, the kernels only apply; the semantics live here. The C kernel receives the floor's bit
pattern in each logits dtype and applies this rule in its one function ``floor_rule`` (``trie_decode/_kernel.c``);
every torch pass calls :func:`floor_rule` below. tests/test_native.py checks the kernels against each other and
against the reference loop.

The floor rule, as a reference loop (a masked row r keeps the columns ``kept(r)``: its children, its extras)::

    for each masked row r:
        if kept(r) is empty:                      (a filter left the row no usable column)
            logits[r, end_token] = ALL_MASKED_FLOOR
        elif logits[r, j] == -inf for every j in kept(r):   (another processor banned them all)
            logits[r, j] = ALL_MASKED_FLOOR for every j in kept(r)

so that the row still emits a token of the trie (greedy: the first; sampling: uniformly among them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..spans import EXTRA0, EXTRA1

if TYPE_CHECKING:
    from ..spans import SpanRules

__all__ = ["NEG_INF", "ALL_MASKED_FLOOR", "floor_rule", "kept_alive", "extras_end"]

NEG_INF = float("-inf")
#: The logit a row's allowed tokens get when another processor already set all of them to -inf: finite, so a token
#: of the trie is still chosen, and low, so that under beam search such a beam ranks below every beam that has a real
#: choice (transformers' PrefixConstrainedLogitsProcessor uses 0, which would make it the best beam).
ALL_MASKED_FLOOR = -1.0e4


def kept_alive(values: torch.Tensor) -> torch.Tensor:
    """Which kept values still offer a choice: those that are not -inf (a NaN counts as alive: it is not a ban).
    Same shape as ``values``, bool."""
    return values != NEG_INF


def floor_rule(values: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
    """The floor rule (see the module docstring) on kept values: ``values`` where their row is alive, else
    :data:`ALL_MASKED_FLOOR`. The caller says which rows are alive (any value it keeps passes :func:`kept_alive`);
    for a row that keeps nothing, the kept value is its end token's and ``alive`` is False.

    Args:
        values: the kept values of some rows (any layout: a row's values, a flat ragged list, a dense block).
        alive: whether the row of each value is alive; broadcast against ``values``. bool.
    Returns:
        A new tensor like ``values``. Any device, no host read.
    """
    return torch.where(alive, values, torch.full_like(values, ALL_MASKED_FLOOR))


def extras_end(rules: "SpanRules") -> int:
    """The end of the step-table columns ``ANCHOR:extras_end(rules)`` that hold what a constrained row keeps besides
    its children (:func:`trie_decode.spans.step_table`): its anchor and EXTRA0 (the end token), and EXTRA1 (the
    separator's first token) only under ``on_complete="repeat"``, the one mode that writes it (elsewhere it is -1,
    none: the C kernel reads it anyway, the vectorized and torch kernels skip the column)."""
    return EXTRA1 + 1 if rules.on_complete == "repeat" else EXTRA0 + 1
