"""User-facing options, parsed once for every front door (transformers processor, fast-forward, vLLM requests).

Why this exists: every integration takes the same options (one trie or one per prompt, an end token that defaults
to the tokenizer's or model's EOS, a separator and a trigger given as text or token ids) and must reject the same
mistakes with the same messages. They are parsed here, framework-free: a tokenizer is anything callable like a
Hugging Face tokenizer (``tokenizer(text, add_special_tokens=False)["input_ids"]``).

Example:
    >>> from trie_decode import TokenTrie
    >>> from trie_decode.options import build_rules, prompt_groups
    >>> build_rules(None, end_token_id=2, on_complete="repeat", separator=[5], trigger=None).separator
    (5,)
    >>> prompt_groups(6, 2).tolist()   # 2 prompts x 3 beams: rows 0-2 use trie 0, rows 3-5 trie 1
    [0, 0, 0, 1, 1, 1]
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch

from .errors import ConstraintConfigError
from .filters import is_per_row
from .spans import SpanRules, token_tuple
from .trie import TokenTrie

__all__ = ["TrieArg", "as_tries", "tokens_arg", "build_rules", "first_eos", "prompt_groups", "prompt_filters", "filter_rows"]

TrieArg = Union[TokenTrie, Sequence[TokenTrie]]


def as_tries(tries: TrieArg, tokenizer: Any = None) -> list[TokenTrie]:
    """``tries`` as a non-empty list of tries, each checked against ``tokenizer`` (when given).

    Raises:
        ConstraintConfigError: no trie. TypeError: an item that is not a TokenTrie.
        TokenizerMismatchError: a trie built for another tokenizer.
    """
    if isinstance(tries, TokenTrie):
        tries = [tries]
    if tries is None or isinstance(tries, (str, bytes)):
        raise ConstraintConfigError(f"tries must be a TokenTrie or a list of them (one per prompt), got {tries!r:.60}")
    tries = list(tries)
    if not tries:
        raise ConstraintConfigError("tries is empty: pass one TokenTrie, or one per prompt")
    for i, t in enumerate(tries):
        if not isinstance(t, TokenTrie):
            raise TypeError(f"tries[{i}] is {type(t).__name__}, not a TokenTrie")
        if tokenizer is not None:
            t.check_tokenizer(tokenizer)
    return tries


def tokens_arg(value: Any, tokenizer: Any, what: str) -> tuple[int, ...]:
    """A separator or trigger given as text (tokenized without special tokens) or token ids, as a tuple of ids."""
    if value is None:
        return ()
    if isinstance(value, str):
        if not value:
            raise ConstraintConfigError(f"{what} is the empty string")
        if tokenizer is None:
            raise ConstraintConfigError(f"{what} given as text needs a tokenizer; pass tokenizer= or token ids")
        ids = tokenizer(value, add_special_tokens=False)["input_ids"]
        if not ids:
            raise ConstraintConfigError(f"{what} {value!r} tokenizes to nothing")
        return tuple(int(i) for i in ids)
    return token_tuple(value, what)


def first_eos(value: Any) -> Optional[int]:
    """The first id of an EOS setting (an int, a list of ints, a tensor, or None)."""
    if isinstance(value, torch.Tensor):
        value = value.flatten().tolist()
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return None if value is None else int(value)


def build_rules(
    tokenizer: Any,
    end_token_id: Optional[int],
    on_complete: str,
    separator: Any,
    trigger: Any,
    *,
    default_end: Optional[int] = None,
) -> SpanRules:
    """Span rules from user-facing options.

    Args:
        tokenizer: tokenizes text options; its ``eos_token_id`` is the end token when ``end_token_id`` is None.
        end_token_id: the end token; None takes the tokenizer's EOS, else ``default_end`` (e.g. the model's).
        on_complete, separator, trigger: see :class:`~trie_decode.spans.SpanRules` (text or token ids).

    Raises:
        ConstraintConfigError: no end token can be found, or an option is malformed.
    """
    if end_token_id is None and tokenizer is not None:
        end_token_id = first_eos(getattr(tokenizer, "eos_token_id", None))
    if end_token_id is None:
        end_token_id = default_end
    if end_token_id is None:
        raise ConstraintConfigError("no end token: pass end_token_id=, or a tokenizer that has an eos_token_id")
    return SpanRules(
        end_token_id=end_token_id,
        on_complete=on_complete,
        separator=tokens_arg(separator, tokenizer, "separator"),
        trigger=tokens_arg(trigger, tokenizer, "trigger"),
    )


def prompt_groups(batch: int, num_tries: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The trie index of each row when ``num_tries`` tries are given one per prompt: the rows of a prompt (its beams
    or return sequences) are contiguous, as in ``generate``. Shape: (batch,), int64.

    Raises:
        ConstraintConfigError: ``batch`` is not a multiple of ``num_tries``.
    """
    if num_tries == 1:
        return torch.zeros(batch, dtype=torch.long, device=device)
    if batch % num_tries:
        raise ConstraintConfigError(
            f"{num_tries} tries were given (one per prompt) but the batch has {batch} rows, not a multiple of {num_tries}"
        )
    return torch.arange(batch, device=device) // (batch // num_tries)


def prompt_filters(allow: Any, deny: Any) -> int:
    """How many per-prompt filter specs ``allow``/``deny`` give: 0 when each is one spec shared by every row (see
    :func:`trie_decode.filters.is_per_row`).

    Raises:
        ConstraintConfigError: ``allow`` and ``deny`` give different numbers of per-prompt specs.
    """
    counts = {len(spec) for spec in (allow, deny) if is_per_row(spec)}
    if len(counts) > 1:
        raise ConstraintConfigError(f"allow and deny give different numbers of per-prompt filters: {sorted(counts)}")
    return counts.pop() if counts else 0


def filter_rows(spec: Any, prompts: int, batch: int) -> Any:
    """A filter spec for every row of a batch: a shared spec as it is; ``prompts`` per-prompt specs (``prompts`` > 0)
    each repeated over its prompt's contiguous rows (beams, return sequences), laid out as :func:`prompt_groups`.

    Example:
        >>> filter_rows([["a"], ["b"]], 2, 4)
        [['a'], ['a'], ['b'], ['b']]

    Raises:
        ConstraintConfigError: ``batch`` is not a multiple of ``prompts``.
    """
    if spec is None or not prompts:
        return spec
    if batch % prompts:
        raise ConstraintConfigError(f"allow/deny give {prompts} per-prompt filters but the batch has {batch} rows")
    per = batch // prompts
    specs = list(spec) if is_per_row(spec) else [spec] * prompts
    return [s for s in specs for _ in range(per)]
