"""User-facing options: every check of an option's value, written once for every front door.

Why this exists: the same options reach the core through several front doors (``TrieLogitsProcessor`` and
``fast_forward_generate`` keywords, a vLLM request's ``extra_args``, the ``trie-decode`` command line, and the core's
own constructors such as :class:`~trie_decode.spans.SpanRules`), and each must reject the same mistakes with the
same message. Each rule is one function or constant here; a front door calls it with its :class:`OptionNames`, so
that the message names the option as that caller wrote it (``on_complete`` or ``template=`` for a keyword,
``extra_args['on_complete']`` in a vLLM request, ``--vocab-size`` on the command line: :data:`FLAGS`) and raises that
front door's error class. An error whose fix names an option (``ContextError``) spells it with
:meth:`OptionNames.given`, so each front door can recommend its own spelling.

The rules, and who calls them:

    modes            :data:`ON_COMPLETE_MODES`, :func:`check_on_complete`, :func:`check_separator` (a separator
                     exactly when ``on_complete="repeat"``): ``SpanRules``, :func:`rule_args` (transformers,
                     fast-forward, the vLLM resolver), vLLM request parsing.
    normalize forms  :data:`NORMAL_FORMS`, :func:`check_normalize`: ``TokenTrie.from_strings`` (through
                     ``tokenizers.normalize_strings``), vLLM request parsing, the CLI's ``--normalize`` choices.
    merging entries  :data:`ON_UNSTABLE_MODES`, :func:`check_on_unstable` (what ``from_strings`` does with an entry
                     that merges with its context): ``tokenizers.tokenize_in_context``, the CLI's ``--on-unstable``;
                     :func:`check_on_unstable_context` (a mode other than "raise" needs a context):
                     ``forms.tokenize_forms``, the CLI.
    vocabulary size  :func:`is_vocab_size`, :func:`check_vocab_size` (an integer in ``[1, 2**31]``): the trie
                     builders, the CLI's ``--vocab-size``.
    token arguments  :func:`token_tuple` (token ids), :func:`token_id` (one id), :func:`text_or_ids` (a trigger or
                     separator as text or ids), :func:`tokens_arg` (text tokenized now), :func:`trigger_forms`
                     (the other ids of a text trigger), :func:`end_token` and
                     :func:`first_eos` (the end token and its defaults), gathered by :func:`rule_args`:
                     ``SpanRules``, transformers, fast-forward, vLLM request parsing (``trigger``, ``separator``,
                     ``prefix``) and resolving.
    filter modes     :func:`check_filter_mode` (filters need ``on_complete`` "eos" or "repeat"): vLLM request
                     parsing; :func:`check_distinct` (``distinct`` is a bool and needs "repeat"; ``max_entries``
                     only with it, positive, :data:`DEFAULT_MAX_ENTRIES` when not given):
                     ``TrieLogitsProcessor``, ``TrieConstraint.filters``, so every front door that filters;
                     :func:`check_no_distinct` (what makes none names it), :func:`check_not_taken` (the
                     processor's other options a front door does not take): ``rank``, ``fast_forward_generate``;
                     :func:`check_positive` (a positive integer): ``max_entries``, ``distinct_capacity``'s token
                     budget.
    sources          :func:`check_one_source` (exactly one of ``tries``/``trie``, ``spans``, ``template``),
                     :func:`check_alone` (``spans`` and ``template`` combine with no other option),
                     :func:`check_instance`: transformers, fast-forward, vLLM requests and ``trie_args``.
    per-row          :func:`is_per_row` (one spec per row or prompt, or one for all), :func:`as_tries` (one trie or
    expansion        one per prompt), :func:`prompt_groups`, :func:`prompt_filters`, :func:`filter_rows` (per-prompt
                     specs over a prompt's rows: beams, return sequences), :func:`row_specs` (one spec per row):
                     transformers, fast-forward, ``TrieConstraint.filters``, live catalogs; :func:`check_prompts`
                     (one per-prompt spec per prompt, where the rows per prompt are known): transformers,
                     fast-forward.

Options only one front door has stay with it: a vLLM request's payload, limits and ``spans`` dicts
(:mod:`trie_decode.integrations.vllm_requests`), the CLI's flag combinations (:mod:`trie_decode.cli`).

This module sits at the bottom of the package (it imports only :mod:`~trie_decode.errors`, numpy and torch), so that
the core's own constructors can use its rules: the rules about a core class take that class as an argument
(:func:`as_tries`, :func:`check_instance`), and :func:`rule_args` returns ``SpanRules``' arguments. It is
framework-free: a tokenizer is anything callable like a Hugging Face tokenizer
(``tokenizer(text, add_special_tokens=False)["input_ids"]``).

Example:
    >>> from trie_decode import SpanRules
    >>> from trie_decode.options import KEYWORDS, OptionNames, check_on_complete, prompt_groups, rule_args
    >>> SpanRules(**rule_args(None, end_token_id=2, on_complete="repeat", separator=[5], trigger=None)).separator
    (5,)
    >>> prompt_groups(6, 2).tolist()   # 2 prompts x 3 beams: rows 0-2 use trie 0, rows 3-5 trie 1
    [0, 0, 0, 1, 1, 1]
    >>> check_on_complete("stop", KEYWORDS)
    Traceback (most recent call last):
    ...
    trie_decode.errors.ConstraintConfigError: on_complete must be one of ('eos', 'release', 'repeat'), got 'stop'
    >>> check_on_complete("stop", OptionNames("extra_args[{!r}]"))
    Traceback (most recent call last):
    ...
    trie_decode.errors.ConstraintConfigError: extra_args['on_complete'] must be one of ('eos', 'release', 'repeat'), got 'stop'
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from collections.abc import Collection, Iterable, Mapping
from typing import Any, NoReturn, Optional, Sequence, Union

import numpy as np
import torch

from .entries import utf8_bytes
from .errors import ConstraintConfigError, FilterModeError, raised_as

__all__ = [
    "OptionNames",
    "KEYWORDS",
    "KEYWORD_ARGS",
    "FLAGS",
    "ON_COMPLETE_MODES",
    "check_on_complete",
    "check_separator",
    "NORMAL_FORMS",
    "check_normalize",
    "ON_UNSTABLE_MODES",
    "check_on_unstable",
    "check_on_unstable_context",
    "MAX_VOCAB_SIZE",
    "is_vocab_size",
    "check_vocab_size",
    "token_tuple",
    "token_id",
    "text_or_ids",
    "tokens_arg",
    "trigger_forms",
    "first_eos",
    "end_token",
    "rule_args",
    "check_filter_mode",
    "check_distinct",
    "check_no_distinct",
    "check_not_taken",
    "DEFAULT_MAX_ENTRIES",
    "check_positive",
    "check_one_source",
    "check_alone",
    "check_instance",
    "TrieArg",
    "is_per_row",
    "as_tries",
    "prompt_groups",
    "check_prompts",
    "prompt_filters",
    "filter_rows",
    "row_specs",
]

#: The tries argument of the transformers front doors: one :class:`~trie_decode.TokenTrie`, or one per prompt.
TrieArg = Union["TokenTrie", Sequence["TokenTrie"]]

#: How a constrained span ends (see :mod:`trie_decode.spans`).
ON_COMPLETE_MODES = ("eos", "release", "repeat")
#: Unicode normal forms accepted by ``normalize=`` (recorded in the trie's options).
NORMAL_FORMS = ("NFC", "NFKC", "NFD", "NFKD")
#: What ``from_strings`` does with an entry that merges with its context: refuse it (:class:`ContextError`), or keep
#: the entry's own tokens for it.
ON_UNSTABLE_MODES = ("raise", "raw")
#: The largest vocabulary a trie holds: token ids are stored as int32 (a larger one would wrap ids around silently).
MAX_VOCAB_SIZE = 1 << 31


@dataclass(frozen=True)
class OptionNames:
    """How one front door spells its options in error messages, and the error it raises.

    Args:
        template: the spelling of an option ``key``, with ``{}`` (or ``{!r}``) where the key goes.
        error: the exception class of this front door's refusals.
        flag: command-line flags: the key's underscores are dashes, and a value follows the flag after a space.

    Example:
        >>> OptionNames("extra_args[{!r}]")("separator")
        "extra_args['separator']"
        >>> KEYWORDS.given("context", "The answer is"), FLAGS.given("context", "The answer is")
        ("context='The answer is'", "--context 'The answer is'")
        >>> KEYWORDS.given("leading_space", True), FLAGS.given("leading_space", True)
        ('leading_space=True', '--leading-space')
    """

    template: str = "{}"
    error: type = ConstraintConfigError
    flag: bool = False

    def __call__(self, key: str) -> str:
        return self.template.format(key.replace("_", "-") if self.flag else key)

    def given(self, key: str, value: Any) -> str:
        """Option ``key`` set to ``value``, as the caller writes it (``context='...'``, ``--context '...'``; a flag
        set to True is the flag alone)."""
        if not self.flag:
            return f"{self(key)}={value!r}"
        return self(key) if value is True else f"{self(key)} {shlex.quote(str(value))}"

    def fail(self, message: str, kind: Optional[type] = None) -> NoReturn:
        """Refuse: as ``kind`` when the problem has a class of its own (:func:`~trie_decode.errors.raised_as`)."""
        raise raised_as(kind or self.error, self.error)(message)


#: Python keyword arguments (``TrieLogitsProcessor``, ``fast_forward_generate``, ``SpanRules``, ...) inside a phrase:
#: ``on_complete must be one of ...``, ``on_complete="repeat" needs ...``.
KEYWORDS = OptionNames()
#: The same keyword arguments named on their own: ``template= does not combine with ...``, ``needs trie=``.
KEYWORD_ARGS = OptionNames("{}=")
#: The ``trie-decode`` command line's flags: ``--vocab-size``, ``--leading-space``.
FLAGS = OptionNames("--{}", flag=True)


# ------------------------------------------------------------------------------------------------- modes
def check_on_complete(value: Any, names: OptionNames = KEYWORDS) -> str:
    """``value`` if it is one of :data:`ON_COMPLETE_MODES`, else ``names``' error."""
    if not isinstance(value, str) or value not in ON_COMPLETE_MODES:
        names.fail(f"{names('on_complete')} must be one of {ON_COMPLETE_MODES}, got {value!r:.60}")
    return value


def check_separator(on_complete: str, has_separator: bool, names: OptionNames = KEYWORDS) -> None:
    """A separator is given exactly when ``on_complete`` is ``"repeat"`` (it goes between the entries of a list)."""
    if on_complete == "repeat" and not has_separator:
        names.fail(f'{names("on_complete")}="repeat" needs a separator: set {names("separator")} to the tokens '
                   "between entries")
    if on_complete != "repeat" and has_separator:
        names.fail(f'{names("separator")} is only used with {names("on_complete")}="repeat", not {on_complete!r}')


# ------------------------------------------------------------------------------------------------- normalize forms
def check_normalize(value: Any, names: OptionNames = KEYWORDS) -> Optional[str]:
    """``value`` if it is None or one of :data:`NORMAL_FORMS`, else ``names``' error."""
    if value is not None and (not isinstance(value, str) or value not in NORMAL_FORMS):
        names.fail(f"{names('normalize')} must be one of {NORMAL_FORMS} (or unset), got {value!r:.20}")
    return value


# ------------------------------------------------------------------------------------------------- merging entries
def check_on_unstable(value: Any, names: OptionNames = KEYWORDS) -> str:
    """``value`` if it is one of :data:`ON_UNSTABLE_MODES`, else ``names``' error."""
    if not isinstance(value, str) or value not in ON_UNSTABLE_MODES:
        names.fail(f"{names('on_unstable')} must be one of {ON_UNSTABLE_MODES}, got {value!r:.20}")
    return value


def check_on_unstable_context(value: str, has_context: bool, names: OptionNames = KEYWORDS) -> None:
    """``names``' error when ``on_unstable`` is ``value``, not "raise", without a context: it says what a context
    does with an entry that merges with the context's last token, and the other forms (``leading_space``) always
    keep such an entry's own tokens, so it would be ignored.

    Example:
        >>> check_on_unstable_context("raw", False, FLAGS)
        Traceback (most recent call last):
        ...
        trie_decode.errors.ConstraintConfigError: --on-unstable raw only applies with a context (it says what an entry that merges with the context's last token keeps): add --context TEXT (the text the entries follow) or leave --on-unstable out
    """
    if value != "raise" and not has_context:
        names.fail(f"{names.given('on_unstable', value)} only applies with a context (it says what an entry that "
                   f"merges with the context's last token keeps): add {names.given('context', 'TEXT')} (the text the "
                   f"entries follow) or leave {names('on_unstable')} out")


# ------------------------------------------------------------------------------------------------- vocabulary size
def is_vocab_size(value: Any) -> bool:
    """Whether ``value`` is a vocabulary size a trie can hold: an integer (not a bool) in ``[1, 2**31]`` (token ids
    are stored as int32: a larger vocabulary would wrap ids around silently)."""
    return (
        not isinstance(value, (bool, np.bool_))
        and isinstance(value, (int, np.integer))
        and 0 < value <= MAX_VOCAB_SIZE
    )


def check_vocab_size(value: Any, names: OptionNames = KEYWORDS) -> int:
    """``value`` as an int if :func:`is_vocab_size`, else ``names``' error.

    Example:
        >>> check_vocab_size(-1, FLAGS)
        Traceback (most recent call last):
        ...
        trie_decode.errors.ConstraintConfigError: --vocab-size must be an integer in [1, 2**31], got -1
    """
    if not is_vocab_size(value):
        names.fail(f"{names('vocab_size')} must be an integer in [1, 2**31], got {value!r:.40}")
    return int(value)


# ------------------------------------------------------------------------------------------------- token arguments
def token_tuple(value: Any, key: str, names: OptionNames = KEYWORDS) -> tuple[int, ...]:
    """``value`` (None, one token id, or a sequence of them) as a tuple of non-negative ints, or ``names``' error.

    Example:
        >>> token_tuple(7, "trigger"), token_tuple(None, "trigger"), token_tuple(np.array([1, 2]), "separator")
        ((7,), (), (1, 2))
    """
    what = names(key)
    if value is None:
        return ()
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = (value,)
    if isinstance(value, (bytes, bytearray)):  # its bytes would read as token ids (b", " as 44, 32)
        names.fail(f"{what} is {type(value).__name__} {value!r:.40}: give text as a str, or token ids")
    try:
        out = tuple(value)
    except TypeError:
        names.fail(f"{what} must be a token id or a sequence of token ids, got {value!r:.80}")
    for tok in out:
        if isinstance(tok, bool) or not isinstance(tok, (int, np.integer)):
            names.fail(f"{what} must hold integer token ids, got {tok!r:.40}")
        if tok < 0:
            names.fail(f"{what} holds a negative token id {tok}")
    return tuple(int(t) for t in out)


def token_id(value: Any, key: str, names: OptionNames = KEYWORDS, below: Optional[int] = None) -> int:
    """``value`` as one non-negative token id (an int or numpy integer, not a bool), below ``below`` when given (the
    vocabulary size), or ``names``' error."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0 or (
        below is not None and value >= below
    ):
        kind = "a non-negative token id" if below is None else f"a token id in [0, {below})"
        names.fail(f"{names(key)} must be {kind}, got {value!r:.40}")
    return int(value)


def text_or_ids(value: Any, key: str, names: OptionNames = KEYWORDS) -> Union[None, str, tuple[int, ...]]:
    """A trigger or separator as given: None, non-empty text (tokenized by the caller, with its tokenizer), or a
    non-empty sequence of token ids (a tuple; one int is a sequence of one).

    Example:
        >>> text_or_ids(", ", "separator"), text_or_ids([5, 6], "separator")
        (', ', (5, 6))
        >>> text_or_ids([], "trigger")
        Traceback (most recent call last):
        ...
        trie_decode.errors.ConstraintConfigError: trigger must be text or a non-empty list of token ids, got []
    """
    if value is None:
        return None
    if isinstance(value, str):
        if not value:
            names.fail(f"{names(key)} is the empty string")
        utf8_bytes(value, names(key), names.error)  # a lone surrogate: the tokenizer would fail deep inside
        return value
    ids = token_tuple(value, key, names)
    if not ids:
        names.fail(f"{names(key)} must be text or a non-empty list of token ids, got {value!r:.80}")
    return ids


def tokens_arg(value: Any, tokenizer: Any, key: str, names: OptionNames = KEYWORDS) -> tuple[int, ...]:
    """A trigger or separator (:func:`text_or_ids`) as token ids, text tokenized now without special tokens;
    ``()`` when not given. A separator follows an entry's last token: its ids are those after a word (``"x"``), so
    SentencePiece's dummy prefix adds no space (``","``, not ``" ,"``)."""
    value = text_or_ids(value, key, names)
    if value is None:
        return ()
    if not isinstance(value, str):
        return value
    if tokenizer is None:
        names.fail(f"{names(key)} given as text needs a tokenizer; pass tokenizer= or token ids")
    ids = tokenizer(value, add_special_tokens=False)["input_ids"]
    if key == "separator":
        ids = _ids_after(tokenizer, "x", value) or ids  # where "x" merges with it: its own ids
    if not ids:
        names.fail(f"{names(key)} {value!r} tokenizes to nothing")
    return tuple(int(i) for i in ids)


def _ids_after(tokenizer: Any, context: str, text: str) -> Optional[list[int]]:
    """The ids the tokenizer gives ``text`` right after ``context`` (``context + text`` tokenized, the context's
    own ids cut off), or None where the two share a token. (:func:`~trie_decode.tokenizers.tokenize_in_context`
    does this for entries, with their options; it imports this module.)"""
    head = list(tokenizer(context, add_special_tokens=False)["input_ids"])
    after = list(tokenizer(context + text, add_special_tokens=False)["input_ids"])
    return after[len(head):] if after[:len(head)] == head and len(after) > len(head) else None


def trigger_forms(value: Any, tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """The ids a trigger given as text is also written with: after a newline and after a word and a space,
    beside its own ids (:func:`tokens_arg`). Text means
    text wherever the model writes it: SentencePiece writes ``"Answer:"`` as ``▁Answer :`` alone or after a space
    and ``Answer :`` at a line's start; byte-level BPE as ``Answer :`` alone and ``ĠAnswer :`` after a space.
    A text that starts with whitespace keeps it (``" Answer:"`` is not written at a line's start). ``()`` for token
    ids or no trigger (ids are compared as given); ``SpanRules`` drops a repeated form.

    Example:
        >>> trigger_forms([5, 6], None)
        ()
    """
    if not isinstance(value, str) or tokenizer is None:
        return ()
    line = _ids_after(tokenizer, "\n", value)
    spaced = _ids_after(tokenizer, "x", value if value[:1].isspace() else " " + value)
    return tuple(tuple(int(i) for i in ids) for ids in (line, spaced) if ids)


def first_eos(value: Any) -> Optional[int]:
    """The first id of an EOS setting (an int, a list of ints, a tensor, or None)."""
    if isinstance(value, torch.Tensor):
        value = value.flatten().tolist()
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return None if value is None else int(value)


def end_token(end_token_id: Any, tokenizer: Any = None, default_end: Optional[int] = None) -> int:
    """The end token: the keyword ``end_token_id``, else the tokenizer's EOS, else ``default_end`` (e.g. the model's
    generation config's).

    Raises:
        ConstraintConfigError: none of them, or not a non-negative token id.

    Example:
        >>> end_token(None, default_end=2), end_token(7, default_end=2)
        (2, 7)
    """
    if end_token_id is None and tokenizer is not None:
        end_token_id = first_eos(getattr(tokenizer, "eos_token_id", None))
    if end_token_id is None:
        end_token_id = default_end
    if end_token_id is None:
        raise ConstraintConfigError("no end token: pass end_token_id=, or a tokenizer that has an eos_token_id")
    return token_id(end_token_id, "end_token_id")


def rule_args(
    tokenizer: Any,
    end_token_id: Optional[int],
    on_complete: str,
    separator: Any,
    trigger: Any,
    *,
    default_end: Optional[int] = None,
    names: OptionNames = KEYWORDS,
) -> dict[str, Any]:
    """The arguments of :class:`~trie_decode.spans.SpanRules` from user-facing options, each checked by its rule
    above with the caller's ``names``: ``SpanRules(**rule_args(...))``.

    Args:
        tokenizer: tokenizes text options; its ``eos_token_id`` is the end token when ``end_token_id`` is None.
        end_token_id, default_end: the end token, as :func:`end_token` finds it.
        on_complete, separator, trigger: see :class:`~trie_decode.spans.SpanRules` (text or token ids).
        names: how the caller spells these options (its error class too).

    Raises:
        ConstraintConfigError (or ``names.error``): no end token can be found, or an option is malformed.
    """
    mode = check_on_complete(on_complete, names)
    separator = tokens_arg(separator, tokenizer, "separator", names)
    trigger_ids = tokens_arg(trigger, tokenizer, "trigger", names)  # checks the text too
    check_separator(mode, bool(separator), names)
    return dict(end_token_id=end_token(end_token_id, tokenizer, default_end), on_complete=mode, separator=separator,
                trigger=trigger_ids, trigger_forms=trigger_forms(trigger, tokenizer))


# ------------------------------------------------------------------------------------------------- filter modes
def given_filters(allow: Any, deny: Any) -> list[str]:
    """The names of the filters given (``["allow"]``, ``["allow", "deny"]``, ...), for :func:`check_filter_mode`."""
    return [name for name, spec in (("allow", allow), ("deny", deny)) if spec is not None]


def check_filter_mode(on_complete: str, given: Sequence[str], names: OptionNames = KEYWORDS) -> None:
    """Filters (the options named in ``given``, e.g. ``["allow"]``) need ``on_complete`` "eos" or "repeat": a
    released row is unconstrained."""
    if given and on_complete == "release":
        filters = ", ".join(names(k) for k in given)
        names.fail(f'filters ({filters}) need on_complete="eos" or "repeat", not {names("on_complete")}='
                   f"{on_complete!r} (a released row is unconstrained)", FilterModeError)


#: How many entries a distinct list holds when ``max_entries`` is not given.
DEFAULT_MAX_ENTRIES = 64


def check_distinct(on_complete: str, distinct: Any, max_entries: Any, names: OptionNames = KEYWORDS) -> int:
    """``distinct`` is True or False; a distinct list needs ``on_complete="repeat"`` and room for a positive number
    of entries (``max_entries``, :data:`DEFAULT_MAX_ENTRIES` when None); ``max_entries`` is given (not None) only
    with ``distinct=True`` (it is the room of a distinct list: without one it would do nothing).

    Returns:
        The list's capacity: ``max_entries`` (or its default) with ``distinct``, 0 without.

    Example:
        >>> check_distinct("repeat", True, None), check_distinct("repeat", True, 3), check_distinct("eos", False, None)
        (64, 3, 0)
        >>> check_distinct("repeat", False, 3)
        Traceback (most recent call last):
        ...
        trie_decode.errors.ConstraintConfigError: max_entries=3 is the room of a distinct list and does nothing without one: set distinct=True, or leave max_entries out
    """
    if not isinstance(distinct, (bool, np.bool_)):
        names.fail(f"{names('distinct')} must be True or False, got {distinct!r:.40}")
    if not distinct:
        if max_entries is not None:
            names.fail(f"{names.given('max_entries', max_entries)} is the room of a distinct list and does nothing "
                       f"without one: set {names('distinct')}=True, or leave {names('max_entries')} out")
        return 0
    if on_complete != "repeat":
        names.fail(f'{names("distinct")}=True needs {names("on_complete")}="repeat" (a list of entries)')
    if max_entries is None:
        return DEFAULT_MAX_ENTRIES
    check_positive(max_entries, "max_entries", names)
    return int(max_entries)


def check_not_taken(caller: str, given: Mapping[str, Any], options: Sequence[str], why: str, fix: str) -> None:
    """``caller`` does not take ``options`` (``TrieLogitsProcessor``'s, which a user may carry over): those among
    its keyword arguments ``given`` that are set (not None) are refused by name, with ``why`` and ``fix`` (passed
    on, ``generate`` refuses them as model kwargs the model does not use, and names no fix)."""
    asked = " or ".join(f"{k}=" for k in options if given.get(k) is not None)
    if asked:
        raise ConstraintConfigError(f"{caller} does not take {asked} ({why}): {fix}")


def check_no_distinct(caller: str, given: Mapping[str, Any], why: str) -> None:
    """``caller`` makes no distinct list: ``distinct``/``max_entries`` are refused (:func:`check_not_taken`), with
    what makes one."""
    check_not_taken(caller, given, ("distinct", "max_entries"), why, "a distinct list is made by model.generate(..., "
                    "logits_processor=[TrieLogitsProcessor(trie, on_complete='repeat', separator=..., distinct=True)])")


def check_positive(value: Any, key: str, names: OptionNames = KEYWORDS) -> None:
    """``value`` is a positive integer (a bool is not one): ``max_entries``, a token budget."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        names.fail(f"{names(key)} must be a positive integer, got {value!r:.40}")


# ------------------------------------------------------------------------------------------------- sources
#: Why ``spans`` and ``template`` combine with no other option.
_ALONE = {
    "spans": "each span says where its value starts (after) and ends (end), and holds its own values",
    "template": "the template is the whole output, and its slots hold their own values",
}


def _either(spelled: Sequence[str]) -> str:
    return spelled[0] if len(spelled) == 1 else f"{', '.join(spelled[:-1])} or {spelled[-1]}"


def check_one_source(caller: str, sources: dict, names: OptionNames = KEYWORD_ARGS,
                     hints: Optional[dict] = None) -> str:
    """The one option of ``sources`` (its keys: the options that say what to decode, e.g. ``tries``, ``spans``,
    ``template``; its values: as given, None when not) that ``caller`` was given; none or several is ``names``'
    error (``hints``: what some of them are, for the message when none is given).

    Example:
        >>> check_one_source("f", {"trie": None, "template": "T"})
        'template'
        >>> check_one_source("f", {"trie": None, "template": None}, hints={"trie": "a TokenTrie, or one per prompt"})
        Traceback (most recent call last):
        ...
        trie_decode.errors.ConstraintConfigError: f needs trie= (a TokenTrie, or one per prompt) or template=
    """
    given = [k for k, v in sources.items() if v is not None]
    if not given:
        hints = hints or {}
        names.fail(f"{caller} needs {_either([names(k) + (f' ({hints[k]})' if k in hints else '') for k in sources])}")
    if len(given) > 1:
        spelled = _either([names(k) for k in given])
        names.fail(f"give either {spelled}, not both" if len(given) == 2 else f"give only one of {spelled}")
    return given[0]


def check_alone(key: str, given: Sequence[str], names: OptionNames = KEYWORD_ARGS) -> None:
    """``spans`` and ``template`` (``key``) combine with no other option (``given``: the other options the caller
    set, by their keys)."""
    if given:
        names.fail(f"{names(key)} does not combine with {list(given)}: {_ALONE[key]}")


def check_instance(value: Any, kind: type, key: str, names: OptionNames = KEYWORD_ARGS) -> Any:
    """``value`` if it is a ``kind`` (a class of the package, e.g. :class:`~trie_decode.Template`), else ``names``'
    error."""
    if not isinstance(value, kind):
        names.fail(f"{names(key)} must be a trie_decode.{kind.__name__}, got {type(value).__name__}")
    return value


# ------------------------------------------------------------------------------------------------- per-row expansion
def is_per_row(spec: Any) -> bool:
    """True when a filter spec is one spec per row or prompt (a list of lists, arrays or None, or a 2-D numpy array:
    one row per prompt), not one for all (a list or a 1-D array; an array of another shape, or what is no
    collection, is refused where it is read: :func:`trie_decode.filters.spec_items`).

    Example:
        >>> is_per_row(["a", "b"]), is_per_row([["a"], None]), is_per_row(None)
        (False, True, False)
        >>> is_per_row(np.array([0, 2])), is_per_row(np.array([[0], [2]]))
        (False, True)
    """
    if isinstance(spec, np.ndarray):
        return spec.ndim == 2
    if not isinstance(spec, Collection) or isinstance(spec, (str, bytes, Mapping)):
        return False  # None, or no filter at all (refused where it is read)
    items = list(spec)
    return bool(items) and all(x is None or isinstance(x, (list, tuple, np.ndarray)) for x in items)


def as_tries(tries: Any, kind: type, tokenizer: Any = None, key: str = "tries") -> list:
    """``tries`` (one ``kind``, i.e. :class:`~trie_decode.TokenTrie`, or one per prompt) as a non-empty list, each
    checked against ``tokenizer`` (when given); ``key`` is the caller's keyword (``trie`` for
    ``fast_forward_generate``).

    Raises:
        ConstraintConfigError: no trie, or neither a ``kind`` nor a list. TypeError: an item that is not a ``kind``.
        TokenizerMismatchError: a trie built for another tokenizer.
    """
    if isinstance(tries, kind):
        tries = [tries]
    if tries is None or isinstance(tries, (str, bytes)) or not isinstance(tries, Iterable):
        raise ConstraintConfigError(f"{key} must be a TokenTrie or a list of them (one per prompt), got {tries!r:.60}")
    tries = list(tries)
    if not tries:
        raise ConstraintConfigError(f"{key} is empty: pass one TokenTrie, or one per prompt")
    for i, t in enumerate(tries):
        if not isinstance(t, kind):
            raise TypeError(f"{key}[{i}] is {type(t).__name__}, not a {kind.__name__}")
        if tokenizer is not None:
            t.check_tokenizer(tokenizer)
    return tries


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


def check_prompts(batch: int, per_prompt: Optional[int], given: Mapping[str, int],
                  names: OptionNames = KEYWORDS) -> None:
    """Per-prompt options against a batch whose rows per prompt are known (``generate`` repeats each prompt for its
    beams or return sequences: ``per_prompt``): each option that gives more than one spec (``given``: its key and
    how many) must give exactly one per prompt. :func:`prompt_groups` and :func:`filter_rows` alone, which see only
    rows, would read 2 tries over 4 prompts as 2 prompts of 2 rows each, and decode prompt 1 with trie 0.

    Example:
        >>> check_prompts(6, 3, {"tries": 2})  # 2 prompts x 3 beams
        >>> check_prompts(4, 1, {"tries": 2})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        trie_decode.errors.ConstraintConfigError: tries gives 2, one per prompt, but the batch has 4 prompts ...

    Raises:
        ConstraintConfigError: an option whose per-prompt specs are not one per prompt.
    """
    if per_prompt is None or per_prompt < 1 or batch % per_prompt:
        return  # rows per prompt unknown: only prompt_groups' and filter_rows' divisibility is checked
    prompts = batch // per_prompt
    for key, count in given.items():
        if count > 1 and count != prompts:
            names.fail(f"{names(key)} gives {count}, one per prompt, but the batch has {prompts} prompts ({batch} "
                       f"rows, {per_prompt} per prompt): give one per prompt, or one for every prompt")


def prompt_filters(allow: Any, deny: Any, names: OptionNames = KEYWORDS) -> int:
    """How many per-prompt filter specs ``allow``/``deny`` give: 0 when each is one spec shared by every row (see
    :func:`is_per_row`).

    Raises:
        ConstraintConfigError: ``allow`` and ``deny`` give different numbers of per-prompt specs.
    """
    counts = {len(spec) for spec in (allow, deny) if is_per_row(spec)}
    if len(counts) > 1:
        names.fail(f"{names('allow')} and {names('deny')} give different numbers of per-prompt filters: "
                   f"{sorted(counts)}")
    return counts.pop() if counts else 0


def filter_rows(spec: Any, prompts: int, batch: int, names: OptionNames = KEYWORDS) -> Any:
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
        names.fail(f"{names('allow')}/{names('deny')} give {prompts} per-prompt filters but the batch has {batch} rows")
    per = batch // prompts
    specs = list(spec) if is_per_row(spec) else [spec] * prompts
    return [s for s in specs for _ in range(per)]


def row_specs(spec: Any, num_rows: int, key: str, names: OptionNames = KEYWORDS) -> list:
    """One filter spec per row: ``[None] * num_rows`` for None, a per-row spec (one item per row) as a list, a
    shared spec repeated (the same object, so a caller converts it once).

    Example:
        >>> row_specs(["a", "b"], 2, "allow"), row_specs([["a"], None], 2, "allow")
        ([['a', 'b'], ['a', 'b']], [['a'], None])

    Raises:
        ConstraintConfigError: a per-row spec whose length is not ``num_rows``.
    """
    if spec is None:
        return [None] * num_rows
    if not is_per_row(spec):
        return [spec] * num_rows
    if len(spec) != num_rows:
        names.fail(f"{names(key)} has {len(spec)} row specs for {num_rows} rows")
    return list(spec)
