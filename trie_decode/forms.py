"""Entry *forms* (the token ids of one entry after a given context) and the check that a prompt and a trie agree.

Why this exists: a model writes ``France`` with different ids after ``"The answer is"`` (``" France"``), after a
chat header or a newline (``"France"``), and a SentencePiece model again differently. A trie built with the wrong
form is a trie the model never follows: every answer is forced through unlikely tokens, and nothing says so. This
module

- turns *form specs* (``leading_space`` values and contexts) into token sequences, several forms per entry if
  asked, all carrying the entry's name and key (:func:`tokenize_forms`, used by ``TokenTrie.from_strings``);
- checks, before generating, that the trie holds the ids the model will write after *this* prompt, and that the
  prompt does not end inside the entry's first token (a trailing space): :func:`check_prompt` returns findings,
  each with the exact fix; :func:`heal_prompt` applies the fix for a trailing space.

Example:
    >>> from tokenizers import Tokenizer, models, pre_tokenizers
    >>> from transformers import PreTrainedTokenizerFast
    >>> from trie_decode import TokenTrie
    >>> vocab = {"[UNK]": 0, "is": 1, "Paris": 2, "Rome": 3}
    >>> backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    >>> backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    >>> tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    >>> trie = TokenTrie.from_strings(["Paris", "Rome"], tok, context="is")
    >>> check_prompt(trie, tok, "is")
    []
    >>> heal_prompt("The answer is ")
    'The answer is'
"""

from __future__ import annotations

import numbers
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import numpy as np

from .errors import InvalidEntryError, InvalidTokenError
from .options import check_on_unstable, check_on_unstable_context, check_positive
from .tokenizers import (
    _ENTRY_OPTIONS,
    ContextError,
    _split_after,
    normalize_strings,
    token_bytes,
    tokenize_in_context,
    tokenize_strings,
    tokenizer_vocab_size,
)

__all__ = [
    "FormSpec",
    "resolve_forms",
    "tokenize_forms",
    "Finding",
    "PromptMismatchWarning",
    "check_prompt",
    "warn_prompt",
    "heal_prompt",
    "entry_identity",
    "ContextError",
]

#: One form: ``("leading_space", bool)`` or ``("context", text)``.
FormSpec = tuple[str, Union[bool, str]]


def _as_list(value: Any, what: str, kind: type) -> list[Any]:
    """``value``, one ``kind`` (bool or str) or a non-empty list of them, as a list of plain ``kind`` values (numpy's
    bools, ``np.True_``, count as bools), or :class:`InvalidEntryError` naming ``what``."""
    if isinstance(value, kind) or (kind is bool and isinstance(value, np.bool_)):
        return [kind(value)]
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise InvalidEntryError(f"{what} must be a {kind.__name__} or a list of them, got {type(value).__name__}")
    items = list(value)
    if not items:
        raise InvalidEntryError(f"{what} is an empty list: give at least one")
    for i, item in enumerate(items):
        if not (isinstance(item, kind) or (kind is bool and isinstance(item, np.bool_))):
            raise InvalidEntryError(f"{what}[{i}] is {type(item).__name__} {item!r:.40}, not a {kind.__name__}")
    return [kind(item) for item in items]


def resolve_forms(leading_space: Any = None, context: Any = None) -> list[FormSpec]:
    """The forms asked for by ``from_strings``' ``leading_space`` and ``context`` arguments, in order, deduplicated.

    ``leading_space`` is a bool or a list of bools; ``context`` a string or a list of strings. Both may be given
    (their forms are combined); neither means ``leading_space=False``.

    Raises:
        InvalidEntryError: a value of the wrong type, or an empty list.

    Example:
        >>> resolve_forms()
        [('leading_space', False)]
        >>> resolve_forms([True, False], "The answer is")
        [('leading_space', True), ('leading_space', False), ('context', 'The answer is')]
    """
    forms: list[FormSpec] = []
    if leading_space is not None:
        forms += [("leading_space", b) for b in _as_list(leading_space, "leading_space", bool)]
    if context is not None:
        forms += [("context", c) for c in _as_list(context, "context", str)]
    if not forms:
        forms = [("leading_space", False)]
    return list(dict.fromkeys(forms))


def tokenize_forms(
    strings: Sequence[str],
    tokenizer: Any,
    forms: Sequence[FormSpec],
    *,
    normalize: Optional[str] = None,
    on_unstable: str = "raise",
) -> tuple[list[list[int]], list[int]]:
    """Token sequences of every (form, string) pair, form by form, and the string index of each sequence.

    Args:
        strings: the entries' texts.
        tokenizer: a Hugging Face-style tokenizer.
        forms: from :func:`resolve_forms`.
        normalize: a Unicode normal form applied to each string before tokenizing (``"NFC"`` for Qwen, whose
            tokenizer normalizes its input, so that ``decode(tokens)`` gives the normalized string back).
        on_unstable: what a context form does with an entry that merges with the context: ``"raise"`` or
            ``"raw"`` (see :func:`~trie_decode.tokenizers.tokenize_in_context`).

    Raises:
        ContextError: a context merges with an entry and ``on_unstable="raise"``.
        InvalidEntryError: ``on_unstable`` or ``normalize`` is not one of its values; ``on_unstable`` is not
            ``"raise"`` without a context form; a string tokenizes to no token in a form (the string's index and
            the form are named).
    """
    check_on_unstable(on_unstable, _ENTRY_OPTIONS)
    check_on_unstable_context(on_unstable, any(kind == "context" for kind, _ in forms), _ENTRY_OPTIONS)
    texts = normalize_strings(strings, normalize)
    sequences: list[list[int]] = []
    source: list[int] = []
    for kind, value in forms:
        if kind == "leading_space":
            seqs = tokenize_strings(texts, tokenizer, leading_space=bool(value))
            where = "after a space" if value else "at the start of a line"
        elif kind == "context":
            seqs = tokenize_in_context(texts, tokenizer, str(value), on_unstable=on_unstable)
            where = f"after the context {str(value)[-40:]!r}"
        else:
            raise InvalidEntryError(f"unknown form kind {kind!r}")
        empty = next((i for i, ids in enumerate(seqs) if not ids), None)
        if empty is not None:  # the builder would name it by its place among every form's sequences
            raise InvalidEntryError(f"entry {empty} ({strings[empty]!r:.60}) tokenizes to no token {where}: every "
                                    "entry needs at least one token")
        sequences += seqs
        source += range(len(texts))
    return sequences, source


# ---------------------------------------------------------------------------------------------------------------
# Prompt check


@dataclass(frozen=True)
class Finding:
    """A disagreement between a prompt and a trie, found before generating.

    Attributes:
        code: ``"trailing_space"`` (the prompt ends with a space or tab), ``"form_mismatch"`` (after this prompt
            the model writes ids the trie does not hold for some entries), ``"merges_with_prompt"`` (the prompt's
            last token merges with some entries' first characters) or ``"no_names"`` (the trie has no names to
            check with).
        message: what is wrong, with numbers.
        fix: the exact change that removes it.
        share: the share of the checked entries affected (1.0 for prompt-level findings).
        examples: up to three ``(name, ids the model writes, ids the trie holds or None)``.
    """

    code: str
    message: str
    fix: str
    share: float = 1.0
    examples: tuple = field(default_factory=tuple)

    def __str__(self) -> str:
        return f"{self.code}: {self.message} Fix: {self.fix}"


class PromptMismatchWarning(UserWarning):
    """Issued by :func:`warn_prompt`: the prompt and the trie disagree (see :class:`Finding`)."""


def _prompt_ids(prompt: Any) -> list[int]:
    """One prompt's token ids (a list, an array or a tensor; a batch of one is unwrapped), or
    :class:`InvalidEntryError`."""
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    if isinstance(prompt, (bytes, bytearray)) or not hasattr(prompt, "__iter__"):  # bytes would read as ids
        raise InvalidEntryError(f"prompt must be text or a list of token ids, got {type(prompt).__name__}")
    ids = list(prompt)
    if ids and isinstance(ids[0], (list, tuple)):
        if len(ids) != 1:
            raise InvalidEntryError(f"check one prompt at a time, got a batch of {len(ids)}")
        ids = list(ids[0])
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
        raise InvalidEntryError("prompt must be text or a list of token ids")
    return [int(t) for t in ids]


def _prompt_text(tokenizer: Any, prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    ids = _prompt_ids(prompt)
    size = tokenizer_vocab_size(tokenizer)
    bad = next((t for t in ids if not 0 <= t < size), None)
    if bad is not None:  # the tokenizer's decode would fail deep inside (OverflowError) or read it as another id
        raise InvalidTokenError(f"prompt id {bad} is outside the tokenizer's vocabulary [0, {size})")
    return tokenizer.decode(ids, skip_special_tokens=False)


def heal_prompt(prompt: Any, tokenizer: Any = None) -> Any:
    """The prompt without the spaces and tabs it ends with (text), or without its trailing whitespace tokens (ids).

    A prompt that ends with a space makes the model write an entry's first token *without* the space that every
    tokenizer puts inside it (``" France"``), i.e. ids it rarely saw in training. Healed, the prompt ends before
    the space and the trie's spaced form (``leading_space=True``) is what the model writes.

    Args:
        prompt: the prompt text, or its token ids (then ``tokenizer`` is needed to see which tokens are spaces; a
            batch of one prompt gives that prompt's ids).

    Raises:
        InvalidEntryError: ids that are not integers, a batch of several prompts, or ids without ``tokenizer``.

    Example:
        >>> heal_prompt("Answer: \\t ")
        'Answer:'
        >>> heal_prompt("Answer:\\n")
        'Answer:\\n'
    """
    if isinstance(prompt, str):
        return prompt.rstrip(" \t")
    if tokenizer is None:
        raise InvalidEntryError("healing a prompt given as token ids needs the tokenizer")
    ids = _prompt_ids(prompt)
    table = token_bytes(tokenizer)  # decode() of a lone "▁" is "" for SentencePiece tokenizers: use the bytes
    while ids and 0 <= ids[-1] < len(table) and table[ids[-1]] and not table[ids[-1]].strip(b" \t"):
        ids.pop()
    return ids


def entry_identity(entry: Any) -> tuple:
    """What makes two trie entries *the same entry* for a user: the key, else the name, else the index.

    The forms of one string (``from_strings(..., leading_space=[True, False])``) are distinct trie entries that
    share name and key; ``rank`` reports each identity once.

    Example:
        >>> from trie_decode import Entry
        >>> entry_identity(Entry(0, "France", "FR", (5,))) == entry_identity(Entry(7, "France", "FR", (9, 2)))
        True
        >>> entry_identity(Entry(3, None, None, (1,)))
        ('index', 3)
    """
    if entry.key is not None:
        return ("key", entry.key)
    if entry.name is not None:
        return ("name", entry.name)
    return ("index", entry.index)


def _suggest(tokenizer: Any, texts: list[str], wanted: list[list[int]], prompt: str, normalize: Optional[str]) -> str:
    """The simplest build option that reproduces ``wanted`` (the in-context ids) for every checked name."""
    for ls in (True, False):
        if tokenize_strings(texts, tokenizer, leading_space=ls) == wanted:
            return f"TokenTrie.from_strings(names, tokenizer, leading_space={ls}{_norm_arg(normalize)})"
    # The shortest tail of the prompt that gives the same ids: the last line, else the last 64 characters.
    candidates = []
    cut = prompt.rfind("\n", 0, len(prompt) - 1)
    if cut >= 0:
        candidates.append(prompt[cut:])
    candidates += [prompt[-64:], prompt]
    for tail in candidates:
        try:
            if tokenize_in_context(texts, tokenizer, tail) == wanted:
                return f"TokenTrie.from_strings(names, tokenizer, context={tail!r}{_norm_arg(normalize)})"
        except ContextError:
            continue
    return f"TokenTrie.from_strings(names, tokenizer, context=prompt{_norm_arg(normalize)})"


def _norm_arg(normalize: Optional[str]) -> str:
    return f", normalize={normalize!r}" if normalize else ""


def check_prompt(trie: Any, tokenizer: Any, prompt: Any, *, sample: int = 200) -> list[Finding]:
    """Check, before generating, that the trie holds the ids the model writes for its entries after ``prompt``.

    For up to ``sample`` entries (evenly spread), the entry's name is tokenized after the prompt's text exactly as
    the model would write it, and looked up in the trie; an entry agrees when those ids lead to an entry with the
    same key (or name). A prompt that ends with a space or tab is reported on its own (no trie can agree with it:
    see :func:`heal_prompt`). An empty list means prompt and trie agree.

    Args:
        trie: a :class:`~trie_decode.TokenTrie` built from strings (its names are what is checked).
        tokenizer: the model's tokenizer.
        prompt: the prompt text (e.g. ``apply_chat_template(..., tokenize=False) + "The answer is"``), or its ids.
        sample: how many entries to check (the cost is one batched tokenization of that many prompt + name).

    Returns:
        A list of :class:`Finding`, each with a message and the exact fix.

    Raises:
        InvalidEntryError: ``trie`` is not a :class:`~trie_decode.TokenTrie`, ``tokenizer`` not a tokenizer, or a
            prompt that is neither text nor token ids. InvalidTokenError: a prompt id outside the vocabulary.

    Example:
        >>> from transformers import AutoTokenizer                                        # doctest: +SKIP
        >>> tok = AutoTokenizer.from_pretrained(smollm2_path())                            # doctest: +SKIP
        >>> trie = TokenTrie.from_strings(["France", "Japan"], tok)                        # doctest: +SKIP
        >>> [f.code for f in check_prompt(trie, tok, "The answer is")]                     # doctest: +SKIP
        ['form_mismatch']
        >>> spaced = TokenTrie.from_strings(["France", "Japan"], tok, leading_space=True)   # doctest: +SKIP
        >>> check_prompt(spaced, tok, "The answer is")                                     # doctest: +SKIP
        []
    """
    # What it reads of a TokenTrie (the trie module imports this one: no isinstance without an import cycle).
    if not all(hasattr(trie, name) for name in ("entry", "lookup", "names", "options")):
        raise InvalidEntryError(f"check_prompt checks a TokenTrie, got {type(trie).__name__}: {trie!r:.60}")
    if not hasattr(tokenizer, "get_vocab"):
        raise InvalidEntryError(f"check_prompt needs the model's tokenizer (a Hugging Face tokenizer), got "
                                f"{type(tokenizer).__name__}")
    check_positive(sample, "sample", _ENTRY_OPTIONS)
    text = _prompt_text(tokenizer, prompt)
    findings: list[Finding] = []
    healed = heal_prompt(text)
    if healed != text:
        findings.append(Finding(
            "trailing_space",
            f"the prompt ends with {text[len(healed):]!r}: the model writes a space inside an entry's first token "
            "(' France'), so after a prompt that already holds the space it must write ids it rarely saw.",
            "end the prompt without it (trie_decode.forms.heal_prompt(prompt), i.e. prompt.rstrip(' \\t')) and build "
            "the trie with leading_space=True (or context= the healed prompt's end)",
        ))
        text = healed
    names = trie.names()
    if names is None:
        findings.append(Finding(
            "no_names", "the trie has no entry names, so the ids the model writes for them cannot be computed.",
            "build it with TokenTrie.from_strings (names are kept) to have it checked",
        ))
        return findings
    normalize = trie.options.get("normalize") if isinstance(getattr(trie, "options", None), dict) else None
    n = len(names)
    step = max(1, n // sample)
    picked = list(range(0, n, step))[:sample]
    texts = normalize_strings([names[i] for i in picked], normalize)
    in_context = _split_after(texts, tokenizer, text, None)[1]  # None where the prompt merges with the entry
    merged, mismatched = [], []
    for i, ids in zip(picked, in_context):
        if ids is None:
            merged.append(i)
            continue
        found = trie.lookup(ids)
        if found is None or entry_identity(found) != entry_identity(trie.entry(i)):
            mismatched.append((i, ids))
    checked = len(picked)
    if merged:
        share = len(merged) / checked
        examples = tuple((names[i], None, list(trie.entry(i).tokens)) for i in merged[:3])
        findings.append(Finding(
            "merges_with_prompt",
            f"{len(merged)} of {checked} checked entries ({share:.0%}) merge with the prompt's last token "
            f"(the prompt ends with {text[-12:]!r}; e.g. {names[merged[0]]!r}): the model cannot write their "
            "canonical ids after it.",
            "end the prompt one token earlier and start those entries with that text (token healing), or end the "
            "prompt with a newline or a space-free word before the entries",
            share, examples,
        ))
    if mismatched:
        share = len(mismatched) / checked
        examples = tuple(
            (names[i], ids, list(trie.entry(i).tokens)) for i, ids in mismatched[:3]
        )
        ok_texts = [t for t, ids in zip(texts, in_context) if ids is not None]
        ok_ids = [ids for ids in in_context if ids is not None]
        fix = _suggest(tokenizer, ok_texts, ok_ids, text, normalize)
        first_name, first_ids, first_trie = examples[0]
        findings.append(Finding(
            "form_mismatch",
            f"after this prompt the model writes ids the trie does not hold for {len(mismatched)} of {checked} "
            f"checked entries ({share:.0%}): e.g. {first_name!r} is {first_ids} in context but {first_trie} in the "
            "trie, so generation is forced through tokens the model would not choose.",
            f"rebuild with {fix} (several forms may be combined: leading_space=[True, False] or a list of contexts)",
            share, examples,
        ))
    return findings


def warn_prompt(trie: Any, tokenizer: Any, prompt: Any, *, sample: int = 200) -> list[Finding]:
    """:func:`check_prompt`, issuing a :class:`PromptMismatchWarning` per finding; returns the findings."""
    findings = check_prompt(trie, tokenizer, prompt, sample=sample)
    for f in findings:
        warnings.warn(str(f), PromptMismatchWarning, stacklevel=2)
    return findings
