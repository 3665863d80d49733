"""Per-request trie arguments for the vLLM processors: parsing, validation, and the trie caches.

Why this exists: in vLLM a request names its constraint through ``SamplingParams.extra_args`` (``vllm_xargs``
over HTTP), so everything a client sends must be checked before it reaches the batch (a bad value in the engine
core would take every other request down with it), and the tries must be cheap to reuse: a file is loaded once
per path and modification time, an inline list is built once per content hash. This module has no vLLM import, so
it is shared by the frontend validation and the engine-side processors.

Request keys (in ``extra_args``; see :func:`trie_args` for a typed builder):

    trie            a trie the operator registered by name, a trie file path (``TokenTrie.save``) inside a directory
                    the operator allows (closed by default: see :mod:`.vllm_access`), an inline list of strings, an
                    inline list of token-id lists, or (over HTTP, where values cannot nest) a JSON string of either
                    list: ``"[[1, 2], [3]]"``
    on_complete     "eos" (default), "release" or "repeat" (see :mod:`trie_decode.constraint`)
    trigger         text or token ids after which the constraint starts
    separator       text or token ids between entries (``on_complete="repeat"``)
    leading_space   tokenize inline strings as ``" " + s`` (default False); a list ``[true, false]`` stores both forms
    context         inline strings: the text they follow (the end of the prompt), or a list of such texts: the trie
                    holds the ids the model writes there (``TokenTrie.from_strings(..., context=)``)
    normalize       inline strings: "NFC" (or "NFKC", "NFD", "NFKD") before tokenizing (Qwen's tokenizers)
    on_unstable     inline strings with a context: "raise" (default: an entry that merges with the context's last
                    token is refused) or "raw" (it keeps its own tokens there)
    prefix          token ids of the output that are already at the end of the prompt: the state starts after
                    them (used by the fast-forward driver, :mod:`trie_decode.integrations.vllm_fastforward`)
    stop_at_forced  an int k >= 1: end the request with the end token as soon as it reaches a state (inside an
                    entry, not an entry's end; in a template, its fixed text) from which at least k tokens are
                    forced (fast-forward driver)
    forced_tail_only  with stop_at_forced: stop only where the forced run completes the entry (in a template, the
                    output) (default False)
    allow, deny     entry keys or indices the request may / may not use, or {"file": PATH}: a file on the server
                    (inside an allowed directory) of entry indices (.npy) or keys (text, one per line)
    spans           catalog-valued fields inside free text (:mod:`trie_decode.fields`), instead of ``trie``: a list
                    of ``{"after": TEXT, "values": [str, ...] | "trie": NAME_OR_PATH, "end": TEXT, "escape": ...,
                    "whitespace": "exact" | "any", "allow": [KEY, ...], "deny": [KEY, ...]}``
                    (or, over HTTP, its JSON string); each maps to a :class:`trie_decode.fields.Span`. Combines with
                    no other option: every span says where its value starts and ends
    template, slots instead of ``trie``: the whole output as fixed text with slots (:class:`trie_decode.Template`):
                    ``template`` the text (``'{"city": "{city}"}'``), ``slots`` an object of each slot's values, a
                    list of strings or a trie name or path (over HTTP, its JSON string); combines with no other
                    option but ``prefix``, ``stop_at_forced`` and ``forced_tail_only``

Keys that start with ``trie`` or look like a misspelling of one of these are rejected; other keys are left to other
processors. ``trie_checked`` is not a client's option: the front-end sets it on every request it admits (replacing
what a client sent) to tell the engine core what it checked (:func:`.vllm_access.make_stamp`).

vLLM's server-side beam search (``use_beam_search``, on the completions, chat and speech-to-text routes) drops
``vllm_xargs``: :class:`TrieBeamSearchGuard`, an ASGI middleware for ``vllm serve --middleware``, refuses such a
request with HTTP 400 instead of unconstrained text (after vLLM's own ``--api-key`` check).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import os
import threading
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import (Any, Awaitable, Callable, Collection, Hashable, Iterable, Mapping, MutableMapping, Optional,
                    Sequence, Union)

import numpy as np
import torch

from trie_decode.constraint import SpanRules, TrieConstraint, check_stop_tokens_outside_entries
from trie_decode.entries import filter_number_map, utf8_bytes
from trie_decode.errors import ConstraintConfigError, TrieDecodeError, UnknownEntryError, raised_as
from trie_decode.fields import ESCAPES, FieldRules, Span
from trie_decode.templates import Template, template_slots
from trie_decode.filters import check_allow_leaves_entries, entry_indices, spec_items
from trie_decode.options import (OptionNames, check_alone, check_filter_mode, check_normalize, check_on_complete,
                                  check_on_unstable, check_on_unstable_context, check_separator, first_eos,
                                  given_filters, rule_args, text_or_ids, token_tuple)
from trie_decode.text_spans import WHITESPACE_MODES, Trigger
from trie_decode.tokenizers import ContextError, fingerprint_matches, tokenizer_fingerprint, tokenizer_vocab_size
from trie_decode.trie import TokenTrie

from .vllm_access import (
    FILE_CACHE_SIZE,
    INLINE_CACHE_SIZE,
    STAMP_KEY,
    TrieAccessError,
    _log as _access_log,
    charged,
    current_limits,
    current_policy,
    diagnose_engine_refusal,
    file_identity,
    handoff_store,
    make_stamp,
    read_filter_file,
)
from .vllm_internals import api_key_middleware, api_key_refuses

__all__ = [
    "TrieRequestError",
    "TrieRequest",
    "TrieResolver",
    "parse_trie_request",
    "trie_args",
    "OPTION_KEYS",
    "SPAN_KEYS",
    "SpanRequest",
    "is_trie_request",
    "check_stray_options",
    "beam_search_refusal",
    "form_beam_search_refusal",
    "TrieBeamSearchGuard",
]

OPTION_KEYS = (
    "trie", "on_complete", "trigger", "separator", "leading_space", "context", "normalize", "on_unstable", "prefix",
    "stop_at_forced", "forced_tail_only",
    "allow", "deny", "spans", "template", "slots",
)
#: The keys that ask for a constraint: a request with none of them is not this processor's.
MAIN_KEYS = ("trie", "spans", "template")
#: Options no other processor is likely to name: without a main key they mean a trie request that lost its trie
#: (refused). Generic names (``allow``, ``deny``, ``prefix``, ``context``, ``distinct``, ...) are left to other
#: processors when no main key is given.
OWN_KEYS = ("on_complete", "leading_space", "stop_at_forced", "forced_tail_only")
#: Options of trie_decode's Python front doors that a vLLM request does not take: refused by name (silently ignored,
#: the request would run without what the client asked for).
NOT_REQUEST_OPTIONS = {
    "distinct": "distinct lists are the transformers processor's (TrieLogitsProcessor(..., distinct=True))",
    "max_entries": "distinct lists are the transformers processor's (TrieLogitsProcessor(..., distinct=True))",
    "end_token_id": "the end token is the model's EOS on vLLM",
    "check_prompt": "check the prompt before sending it (trie_decode.check_prompt)",
    "keys": "an inline list has no keys; give a trie file built with keys (trie-decode build) to filter by key",
}
#: The keys of one span dict in ``extra_args["spans"]`` (a :class:`trie_decode.fields.Span`).
SPAN_KEYS = ("after", "values", "trie", "end", "escape", "whitespace", "allow", "deny")
logger = logging.getLogger("trie_decode.vllm")


class TrieRequestError(TrieDecodeError, ValueError):
    """A request's trie arguments are invalid (vLLM turns it into an HTTP 400 / a validation error offline)."""


#: A request's options as the client wrote them, for the shared rules of :mod:`trie_decode.options`.
EXTRA_ARGS = OptionNames("extra_args[{!r}]", TrieRequestError)
#: :func:`trie_args`' keywords, for the rules it checks before building the request.
TRIE_ARGS = OptionNames("trie_args({}=...)", TrieRequestError)


TokensArg = Union[str, int, Sequence[int], None]


@dataclass(frozen=True)
class TrieRequest:
    """A request's parsed (not yet resolved) trie arguments.

    Attributes:
        source: ``"file"`` (``payload`` is the string as sent: a registered name or a path, resolved against the
            access policy only when the trie is needed), ``"strings"`` or ``"sequences"`` (``payload`` is a tuple).
        payload: the name or path, or the inline entries as a tuple of str / tuple of tuples of int.
        on_complete, trigger, separator: the options (text or token ids; tokenized on resolve).
        leading_space, context, normalize, on_unstable: how inline strings are tokenized (``TokenTrie.from_strings``'s
            options; ``leading_space`` a bool or a tuple of bools, ``context`` a string or a tuple of them, or None).
    """

    source: str
    payload: Any
    on_complete: str = "eos"
    trigger: Any = None
    separator: Any = None
    leading_space: Any = False
    context: Any = None
    normalize: Optional[str] = None
    on_unstable: str = "raise"
    prefix: tuple = ()
    stop_at_forced: int = 0
    forced_tail_only: bool = False
    allow: Optional[Union[tuple, "FilterFile"]] = None
    deny: Optional[Union[tuple, "FilterFile"]] = None
    spans: tuple = ()  # of SpanRequest (source "spans", payload None; source "template", payload the text and
    #                    each span a slot: its ``after`` is the slot's name)

    def files(self) -> list[tuple[int, str, Optional[str]]]:
        """Each trie file the request names: ``(span index or -1, path, the option it was sent in)`` (None:
        ``extra_args['trie']``)."""
        if self.source == "file":
            return [(-1, self.payload, None)]
        return [(i, s.payload, f"extra_args['slots'][{s.after!r}]" if self.source == "template"
                 else f"extra_args['spans'][{i}]['trie']") for i, s in enumerate(self.spans) if s.source == "file"]

    def trie_key(self) -> Hashable:
        """A key that identifies the trie (content hash for inline payloads; for spans, of the whole span list)."""
        if self.source == "file":
            return ("file", self.payload)
        if self.source in ("spans", "template"):
            kind, content = self.source, [self.payload] + [
                [s.after, s.end, s.escape, s.whitespace, s.source, s.payload, s.allow, s.deny] for s in self.spans]
        else:
            forms = [self.leading_space, self.context, self.normalize, self.on_unstable]
            kind, content = "inline", [self.source, forms, self.payload]
        # surrogatepass: a lone surrogate (a JSON "\\ud800") is refused by the build, naming it
        blob = json.dumps(content, ensure_ascii=False).encode("utf-8", "surrogatepass")
        return (kind, hashlib.sha256(blob).hexdigest())


#: Every refusal of a request's options (a :class:`TrieRequestError`).
_fail = EXTRA_ARGS.fail


def is_trie_request(extra_args: Optional[dict]) -> bool:
    """Whether a request's ``extra_args`` asks for a constraint (``"trie"``, ``"spans"`` or ``"template"``)."""
    return bool(extra_args) and any(key in extra_args for key in MAIN_KEYS)  # type: ignore[operator]


def _meant_option(key: Any, among: Sequence[str] = OPTION_KEYS, near: bool = True) -> Optional[str]:
    """The option of ``among`` that ``key`` looks like a misspelling of: another case (``"Trie"``), one of them with
    more after it (``"tries"``, ``"denylist"``, ``"allow_list"``) or without its last letter (``"span"``), or, with
    ``near``, a near match of a name of five letters or more (``"spanz"``, ``"seperator"``); else None. Shorter names
    get no near matches: one letter off ``"trie"`` or ``"deny"`` is another word (``"tier"``, ``"time"``, ``"true"``,
    ``"tree"``), which another processor may take."""
    if not isinstance(key, str):
        return None
    lower = key.lower()
    for name in among:
        if lower == name or (len(name) >= 4 and lower.startswith(name)) or (
                len(lower) >= 4 and len(name) == len(lower) + 1 and name.startswith(lower)):
            return name
    close = difflib.get_close_matches(lower, [n for n in among if len(n) >= 5], n=1, cutoff=0.75) if near else []
    return close[0] if close else None


def check_stray_options(extra_args: Optional[dict]) -> None:
    """Refuse a request that is not a trie request (:func:`is_trie_request`) but carries options only this
    processor takes (:data:`OWN_KEYS`) or a misspelling of ``trie``, ``spans`` or ``template``: it would run
    unconstrained. Keys other processors may use too (``allow``, ``deny``, ``prefix``, ...) pass.

    Raises:
        TrieRequestError: naming the keys, and the key meant where one is close.
    """
    if not extra_args:
        return
    for key in extra_args:  # not a request of ours: only clear misspellings, other processors' keys pass
        meant = _meant_option(key, MAIN_KEYS, near=False)
        if meant is not None:
            _fail(f"unknown option extra_args[{key!r}] (did you mean {meant!r}?): without 'trie', 'spans' or "
                  "'template' the request would not be constrained")
    ours = sorted(k for k in extra_args if k in OWN_KEYS)
    if ours:
        _fail(f"extra_args has {ours} but none of 'trie', 'spans', 'template': the request would not be constrained")


@dataclass(frozen=True)
class SpanRequest:
    """One parsed span of ``extra_args["spans"]``: ``after``, ``end`` and ``escape`` as :class:`Span` takes them;
    ``source`` ``"strings"`` (``payload``: the values, a tuple of str) or ``"file"`` (a registered trie name or a
    path, resolved against the access policy like ``extra_args["trie"]``); ``whitespace`` ``"any"`` makes
    ``after`` a :class:`~trie_decode.text_spans.Trigger` whose whitespace runs match any whitespace (JSON whose
    spacing the model or grammar chooses)."""

    after: str
    source: str
    payload: Any
    end: str = '"'
    escape: Optional[str] = "auto"
    whitespace: str = "exact"
    allow: Optional[tuple] = None  # entry keys or indices the span's values may use (a static filter)
    deny: Optional[tuple] = None  # ... and those they may not

    def after_pattern(self) -> Any:
        """``after`` as :class:`~trie_decode.fields.Span` takes it."""
        return self.after if self.whitespace == "exact" else Trigger(self.after, whitespace=self.whitespace)


def _json_option(text: str, what: str, max_bytes: Optional[int] = None,
                 failure: str = "as a string must be JSON, and does not parse") -> Any:
    """A value a client sent as JSON text (over HTTP, where values cannot nest) for the option ``what``, parsed;
    ``what`` and ``failure`` start the message when it does not parse (too deeply nested included). With
    ``max_bytes`` (the request's inline limit), text far longer than the JSON of that many bytes of values is
    refused unparsed."""
    if max_bytes is not None and len(text) > 8 * max_bytes + 4096:
        _fail(f"{what} holds {len(text)} characters of JSON, over the limit of {max_bytes} bytes")
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        _fail(f"{what} {failure}: {exc}")


def _spans_option(value: Any, max_entries: int, max_bytes: int, key: str = "spans", slots: bool = False) -> tuple:
    """``extra_args["spans"]`` checked: a non-empty list (or its JSON text) of span dicts, inline values within the
    request's inline limits (counted over all spans). ``key``: the option the messages name; ``slots``: the spans
    are a template's slots (each span's ``after`` is the slot's name; the messages name ``extra_args[key][name]``,
    where its values or trie were sent)."""
    if isinstance(value, str):
        value = _json_option(value, f"extra_args[{key!r}]", max_bytes)
    if not isinstance(value, (list, tuple)) or not value:
        _fail(f"extra_args[{key!r}] must be a non-empty list of span objects, got {value!r:.80}")
    if len(value) > MAX_SPANS:
        _fail(f"extra_args[{key!r}] has {len(value)} {'slots' if slots else 'spans'}, over the limit of {MAX_SPANS}")
    out, entries, size = [], 0, 0
    for i, item in enumerate(value):
        what = f"extra_args[{key!r}][{i}]"
        if not isinstance(item, dict):
            _fail(f"{what} must be an object with the keys {list(SPAN_KEYS)}, got {type(item).__name__}")
        unknown = [k for k in item if k not in SPAN_KEYS]
        if unknown:
            _fail(f"{what} has unknown keys {unknown}; known keys: {list(SPAN_KEYS)}")
        after = item.get("after")
        if not isinstance(after, str) or not after:
            _fail(f"{what}['after'] (the text a value follows) must be a non-empty string, got {after!r:.60}")
        end = item.get("end", '"')
        if end is not None and (not isinstance(end, str) or not end):
            _fail(f"{what}['end'] must be a non-empty string, or null (the end token ends the value and the "
                  f"output), got {end!r:.60}")
        escape = item.get("escape", "auto")
        if escape != "auto" and escape not in ESCAPES:
            _fail(f"{what}['escape'] must be 'auto', 'json' or null, got {escape!r:.40}")
        for name, text in (("after", after), ("end", end)):
            length = len(text.encode("utf-8", "surrogatepass")) if text is not None and not slots else 0
            if length > MAX_RULE_LENGTH:
                _fail(f"{what}[{name!r}] holds {length} bytes of text, over the limit of {MAX_RULE_LENGTH}")
        whitespace = item.get("whitespace", "exact")
        if whitespace not in WHITESPACE_MODES:
            _fail(f"{what}['whitespace'] must be one of {list(WHITESPACE_MODES)}, got {whitespace!r:.40}")
        try:
            if whitespace != "exact":
                Trigger(after, whitespace=whitespace)
        except TrieDecodeError as exc:
            _fail(f"{what}['after']: {exc}")
        if ("values" in item) == ("trie" in item):
            _fail(f"{what} needs exactly one of 'values' (a list of strings) and 'trie' (a trie name or file path)")
        filters = {name: _filter_option(item.get(name), f"{what}[{name!r}]", files=False) for name in ("allow", "deny")}
        given = "trie" if "trie" in item else "values"
        # Where the values or trie were sent: a slot's under its name.
        sent = f"extra_args[{key!r}][{after!r}]" if slots else f"{what}[{given!r}]"
        if given == "trie":
            path = item["trie"]
            if not isinstance(path, str) or not path.strip():
                _fail(f"{sent} must be a registered trie name or a trie file path, got {path!r:.60}")
            out.append(SpanRequest(after, "file", path, end, escape, whitespace, **filters))
            continue
        values = item["values"]
        if not isinstance(values, (list, tuple)) or not values or not all(isinstance(v, str) and v for v in values):
            _fail(f"{sent} must be a non-empty list of non-empty strings"
                  + (" (or a registered trie name or trie file path)" if slots else ""))
        entries += len(values)
        size += sum(len(v.encode("utf-8", "surrogatepass")) for v in values)
        if entries > max_entries:
            _fail(f"extra_args[{key!r}] has {entries} inline values, over the limit of {max_entries}: use trie files")
        if size > max_bytes:
            _fail(f"extra_args[{key!r}] holds {size} bytes of inline values, over the limit of {max_bytes}")
        out.append(SpanRequest(after, "strings", tuple(values), end, escape, whitespace, **filters))
    return tuple(out)


def _spans_request(extra_args: dict, max_entries: int, max_bytes: int) -> TrieRequest:
    """A request of ``extra_args["spans"]``: checked, and refused with every option it was combined with named."""
    check_alone("spans", [k for k in OPTION_KEYS if k != "spans" and extra_args.get(k) is not None], EXTRA_ARGS)
    return TrieRequest(source="spans", payload=None, on_complete="release",
                       spans=_spans_option(extra_args["spans"], max_entries, max_bytes))


def _template_request(extra_args: dict, max_entries: int, max_bytes: int) -> TrieRequest:
    """A request of ``extra_args["template"]`` and ``["slots"]`` (:class:`trie_decode.Template`): the text's slots
    checked against the slot names, each slot's values (a list of strings, or a trie name or path) checked as a
    span's are (inline limits counted over all slots)."""
    check_alone("template", [k for k in OPTION_KEYS if k not in ("template", "slots", *FAST_FORWARD_KEYS)
                             and extra_args.get(k) is not None], EXTRA_ARGS)
    text, slots = extra_args["template"], extra_args.get("slots")
    if not isinstance(text, str) or not text:
        _fail(f"extra_args['template'] must be a non-empty string, got {text!r:.60}")
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > max_bytes:  # its text is built (tokenized, its forced-text table) as an inline list's entries are
        _fail(f"extra_args['template'] holds {size} bytes of text, over the limit of {max_bytes}")
    if isinstance(slots, str):
        slots = _json_option(slots, "extra_args['slots']", max_bytes)
    if not isinstance(slots, dict) or not slots:
        _fail("extra_args['template'] needs extra_args['slots']: an object of each slot's values (a list of strings) "
              f"or trie (a name or path), got {slots!r:.60}")
    try:
        names = list(dict.fromkeys(template_slots(text)[1]))
    except TrieDecodeError as exc:
        _fail(f"extra_args['template']: {exc}")
    missing = [n for n in names if n not in slots]
    if missing:
        _fail(f"extra_args['template']: template slots without values: {missing}; add them to extra_args['slots'] "
              f"({{{missing[0]!r}: [...]}})")
    unused = [n for n in slots if n not in names]
    if unused:
        _fail(f"extra_args['slots'] holds values for slots the template does not have: {unused} (its slots: {names})")
    as_spans = [{"after": name, "trie" if isinstance(v, str) else "values": v} for name, v in slots.items()]
    parsed = _spans_option(as_spans, max_entries, max_bytes, "slots", slots=True)
    prefix, stop_at, tail_only = _fast_forward_options(extra_args)
    return TrieRequest(source="template", payload=text, on_complete="release", spans=parsed, prefix=prefix,
                       stop_at_forced=stop_at, forced_tail_only=tail_only)


#: The options of the fast-forward driver (:mod:`.vllm_fastforward`): a trie request in ``"eos"`` mode without a
#: trigger, or a template, may carry them.
FAST_FORWARD_KEYS = ("prefix", "stop_at_forced", "forced_tail_only")


def _fast_forward_options(extra_args: dict) -> tuple[tuple, int, bool]:
    """``extra_args["prefix"]`` (the output tokens already at the end of the prompt, replayed before the first step),
    ``["stop_at_forced"]`` and ``["forced_tail_only"]``, checked."""
    prefix = extra_args.get("prefix")
    if isinstance(prefix, str):
        _fail("extra_args['prefix'] must be token ids")
    prefix = token_tuple(prefix, "prefix", EXTRA_ARGS)
    stop_at = extra_args.get("stop_at_forced", 0)
    # Bounded: the engine's step layout holds it as an int64 (a larger one stopped the engine core: OverflowError).
    if isinstance(stop_at, bool) or not isinstance(stop_at, int) or not 0 <= stop_at < 2**31:
        _fail(f"extra_args['stop_at_forced'] must be a non-negative integer below 2**31, got {stop_at!r:.40}")
    tail_only = _flag(extra_args.get("forced_tail_only", False), "extra_args['forced_tail_only'] must be a boolean")
    return prefix, stop_at, tail_only


def _flag(value: Any, must: str) -> bool:
    """A boolean option, or ``must`` (what it must be) refused. 0 and 1 count: over HTTP vLLM reads JSON ``true`` in
    ``vllm_xargs`` (values ``str | int | float | list``) as 1."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    _fail(f"{must}, got {value!r:.40}")


#: The most spans (or template slots) one request may have: each is built on the front-end's event loop and again in
#: the engine (1,000 slots of two values took 17.6 s; 50 took 0.7 s).
MAX_SPANS = 64
#: The most tokenizations (forms) one inline request may ask for.
MAX_FORMS = 8
#: The longest trigger or separator (token ids, or bytes of text), span ``after`` or ``end`` and ``context`` (bytes) a
#: request may send: the engine reads a row's last ``len(trigger)`` tokens at every step (a trigger of 50,000 ids cost
#: 24 ms per step of the whole batch), the span automaton's build grows faster than the length of its texts (an
#: ``after`` of 10,000 bytes took 8 s, of 40,000 over two minutes, on the front-end's event loop and again in the
#: engine), and every entry is tokenized after every context (7 contexts of 69 KB before 2,000 entries: 90 s).
MAX_RULE_LENGTH = 256


def _string_forms(extra_args: dict) -> tuple[Any, Any, Optional[str], str]:
    """The inline strings' ``leading_space`` (a bool, or a tuple of them), ``context`` (None, a string, or a tuple),
    ``normalize`` and ``on_unstable`` options, checked (the values themselves are checked again by
    ``TokenTrie.from_strings``)."""
    def flag(v: Any) -> bool:
        return _flag(v, "extra_args['leading_space'] must be a boolean or a list of them")

    raw = extra_args.get("leading_space", False)
    leading_space: Any = tuple(flag(v) for v in raw) if isinstance(raw, (list, tuple)) else flag(raw)
    context = extra_args.get("context")
    if isinstance(context, (list, tuple)):
        context = tuple(context)
    items = context if isinstance(context, tuple) else (() if context is None else (context,))
    if any(not isinstance(c, str) or not c for c in items) or (isinstance(context, tuple) and not context):
        _fail(f"extra_args['context'] must be a non-empty string or a list of them, got {context!r:.60}")
    for c in items:  # each entry is tokenized after each context: its length multiplies the build's cost
        size = len(utf8_bytes(c, "extra_args['context']", TrieRequestError))
        if size > MAX_RULE_LENGTH:
            _fail(f"extra_args['context'] holds {size} bytes of text, over the limit of {MAX_RULE_LENGTH}: send the "
                  "end of the prompt only (the last words before the entries)")
    n = (len(leading_space) if isinstance(leading_space, tuple) else 1) + len(items)
    if isinstance(leading_space, tuple) and not leading_space:
        _fail("extra_args['leading_space'] is an empty list")
    if n > MAX_FORMS:
        _fail(f"extra_args asks for {n} forms of every string, over the limit of {MAX_FORMS}")
    on_unstable = check_on_unstable(extra_args.get("on_unstable", "raise"), EXTRA_ARGS)
    check_on_unstable_context(on_unstable, context is not None, EXTRA_ARGS)
    return leading_space, context, check_normalize(extra_args.get("normalize"), EXTRA_ARGS), on_unstable


def _inline_payload(value: list, max_entries: int, max_bytes: int) -> tuple[str, tuple]:
    if not value:
        _fail("extra_args['trie'] is an empty list: a trie needs at least one entry")
    if len(value) > max_entries:
        _fail(f"extra_args['trie'] has {len(value)} inline entries, over the limit of {max_entries}: use a trie file")
    if all(isinstance(v, str) for v in value):
        size = 0
        for i, s in enumerate(value):
            if not s:
                _fail(f"extra_args['trie'][{i}] is the empty string")
            size += len(s.encode("utf-8", "surrogatepass"))
        if size > max_bytes:
            _fail(f"extra_args['trie'] holds {size} bytes of inline strings, over the limit of {max_bytes}")
        return "strings", tuple(value)
    if all(isinstance(v, (list, tuple)) for v in value):
        out, size = [], 0
        for i, seq in enumerate(value):
            if not seq:
                _fail(f"extra_args['trie'][{i}] is an empty token sequence")
            for tok in seq:
                if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                    _fail(f"extra_args['trie'][{i}] holds {tok!r:.40}, not a non-negative token id")
            size += 4 * len(seq)
            if size > max_bytes:
                _fail(f"extra_args['trie'] holds more than {max_bytes} bytes of inline token ids")
            out.append(tuple(int(t) for t in seq))
        return "sequences", tuple(out)
    kinds = sorted({type(v).__name__ for v in value})
    _fail(f"extra_args['trie'] must be a list of strings or a list of token-id lists, got a list of {kinds}")


def parse_trie_request(
    extra_args: Optional[dict], *, max_entries: Optional[int] = None, max_bytes: Optional[int] = None
) -> Optional[TrieRequest]:
    """Parse a request's ``extra_args``; None when it has none of the keys ``"trie"``, ``"spans"`` and
    ``"template"`` (the request is not constrained).

    Raises:
        TrieRequestError: a malformed or oversized value, or an unknown ``trie*`` option.
    """
    if not is_trie_request(extra_args):
        check_stray_options(extra_args)
        return None  # not ours: untouched
    if max_entries is None or max_bytes is None:
        limits = current_limits()
        max_entries = limits.max_inline_entries if max_entries is None else max_entries
        max_bytes = limits.max_inline_bytes if max_bytes is None else max_bytes
    for key in extra_args:
        if key in OPTION_KEYS or key == STAMP_KEY or not isinstance(key, str):
            continue
        if key in NOT_REQUEST_OPTIONS:
            _fail(f"extra_args[{key!r}] is not a vLLM request option: {NOT_REQUEST_OPTIONS[key]}")
        meant = _meant_option(key)
        if meant is not None or key.lower().startswith("trie"):
            hint = f" (did you mean {meant!r}?)" if meant else ""
            _fail(f"unknown trie option extra_args[{key!r}]{hint}; known options: {list(OPTION_KEYS)}")
    if "slots" in extra_args and "template" not in extra_args:
        _fail("extra_args['slots'] holds a template's slot values: it needs extra_args['template']")
    if "spans" in extra_args:
        return _spans_request(extra_args, max_entries, max_bytes)
    if "template" in extra_args:
        return _template_request(extra_args, max_entries, max_bytes)
    value = extra_args["trie"]
    if isinstance(value, str) and value.lstrip().startswith("["):
        # What parses is a list: JSON skips no whitespace that str.lstrip does not.
        value = _json_option(value, "extra_args['trie']", max_bytes, "looks like inline JSON but does not parse")
    if isinstance(value, str):
        if not value.strip():
            _fail("extra_args['trie'] is an empty path")
        # Kept as sent: a registered trie name or a path, resolved against the server's access policy when the
        # trie is needed (TrieResolver.trie; see .vllm_access). Never '~'-expanded: the value comes from a client.
        source, payload = "file", value
    elif isinstance(value, (list, tuple)):
        source, payload = _inline_payload(list(value), max_entries, max_bytes)
    else:
        _fail(f"extra_args['trie'] must be a file path or a list of entries, got {type(value).__name__}")
    on_complete = check_on_complete(extra_args.get("on_complete", "eos"), EXTRA_ARGS)
    # Text stays text: the engine's tokenizer tokenizes it when the request is resolved (TrieResolver.rules).
    trigger = text_or_ids(extra_args.get("trigger"), "trigger", EXTRA_ARGS)
    separator = text_or_ids(extra_args.get("separator"), "separator", EXTRA_ARGS)
    for key, value in (("trigger", trigger), ("separator", separator)):
        size = len(utf8_bytes(value, f"extra_args[{key!r}]", TrieRequestError)) if isinstance(value, str) else len(
            value or ())
        if size > MAX_RULE_LENGTH:  # text: at most one token per byte
            _fail(f"extra_args[{key!r}] holds {size} {'bytes of text' if isinstance(value, str) else 'token ids'}, "
                  f"over the limit of {MAX_RULE_LENGTH}: a {key} is a few tokens")
    check_separator(on_complete, separator is not None, EXTRA_ARGS)
    leading_space, context, normalize, on_unstable = _string_forms(extra_args)
    if (leading_space or context is not None or normalize is not None) and source != "strings":
        _fail("extra_args['leading_space'], ['context'] and ['normalize'] apply only to an inline list of strings")
    prefix, stop_at, tail_only = _fast_forward_options(extra_args)
    if (prefix or stop_at) and (trigger is not None or on_complete != "eos"):
        _fail("extra_args['prefix'] and ['stop_at_forced'] need on_complete='eos' and no trigger")
    allow = _filter_option(extra_args.get("allow"), "extra_args['allow']")
    deny = _filter_option(extra_args.get("deny"), "extra_args['deny']")
    check_filter_mode(on_complete, given_filters(allow, deny), EXTRA_ARGS)
    return TrieRequest(
        source=source,
        payload=payload,
        on_complete=on_complete,
        trigger=trigger,
        separator=separator,
        leading_space=leading_space,
        context=context,
        normalize=normalize,
        on_unstable=on_unstable,
        prefix=prefix,
        stop_at_forced=stop_at,
        forced_tail_only=tail_only,
        allow=allow,
        deny=deny,
    )


@dataclass(frozen=True)
class FilterFile:
    """A request's allow/deny filter named as a file on the server (``{"file": PATH}``): a ``.npy`` array of entry
    indices or a text file of keys, one per line, inside a directory the operator allows (the trie files' access
    policy, :mod:`.vllm_access`); read when the request is resolved, cached by the file's identity."""

    path: str


def _filter_option(value: Any, what: str, files: bool = True) -> Optional[Union[tuple, FilterFile]]:
    """An ``allow``/``deny`` filter: entry keys (strings) or entry indices (ints), or both mixed, as a list (a 1-D
    numpy array in process; the spec rule of every front door, :func:`trie_decode.filters.spec_items`); a file on
    the server, ``{"file": PATH}`` (unless ``files`` is false: a span's filter); or, over HTTP where values cannot
    nest, a JSON string of either. ``what``: the option as the messages name it (``extra_args['allow']``, or a
    span's)."""
    if value is None:
        return None
    if isinstance(value, str) and value.lstrip().startswith(("[", "{")):  # other text is a single key (refused)
        value = _json_option(value, what,
                             failure="must be a list of entry keys or indices (or its JSON), got invalid JSON")
    if isinstance(value, dict) and not files:
        _fail(f"{what} must be a list of entry keys or indices (a span takes no filter file)")
    if isinstance(value, dict):
        path = value.get("file")
        if set(value) != {"file"} or not isinstance(path, str) or not path:
            _fail(f"{what} as an object must be {{'file': PATH}}, got {value!r:.80}")
        return FilterFile(path)
    # The spec rule of every front door: keys, indices or both mixed (one request is one prompt: one spec, 1-D).
    spec_items(value, what, error=TrieRequestError)
    cap = current_limits().max_filter_items
    if len(value) > cap:
        _fail(f"{what} names {len(value)} entries, over the limit of {cap}")
    items = value.tolist() if isinstance(value, np.ndarray) else value
    return tuple(v if isinstance(v, str) else int(v) for v in items)


def prompt_trie_values(tries: Any, n: int) -> list:
    """The ``extra_args["trie"]`` of each of ``n`` prompts from a driver's ``tries=`` (beam search, fast-forward):
    one trie file path for all, or one spec per prompt, each a path or an inline list of strings or token-id lists.

    Raises:
        ValueError: a count that is not ``n``, or a spec that is no path or list (a dict, such as a
            :func:`trie_args` result, would be read as the list of its keys).
    """
    if isinstance(tries, (str, os.PathLike)):
        return [os.fspath(tries)] * n
    if isinstance(tries, Mapping) or not isinstance(tries, Iterable):
        raise ValueError(f"tries is a {type(tries).__name__}: pass one trie spec per prompt, or one file path for all")
    specs = list(tries)
    if len(specs) != n:
        raise ValueError(f"tries has {len(specs)} items for {n} prompts: pass one trie spec per prompt (or one file "
                         "path for all)")
    out = []
    for i, spec in enumerate(specs):
        if isinstance(spec, (str, os.PathLike)):
            out.append(os.fspath(spec))
        elif isinstance(spec, Mapping) or not isinstance(spec, Iterable):
            raise ValueError(f"tries[{i}] is a {type(spec).__name__}: pass a trie file path or an inline list of "
                             "strings or token-id lists (not trie_args(...))")
        else:  # JSON-able: a token-id tuple or array becomes a list
            out.append([e if isinstance(e, str) or not isinstance(e, Iterable) else list(e) for e in spec])
    return out


def trie_args(
    trie: Union[str, os.PathLike, Sequence[str], Sequence[Sequence[int]], None] = None,
    *,
    spans: Optional[Sequence[dict]] = None,
    template: Optional[str] = None,
    slots: Optional[dict] = None,
    on_complete: str = "eos",
    trigger: TokensArg = None,
    separator: TokensArg = None,
    leading_space: Union[bool, Sequence[bool]] = False,
    context: Union[str, Sequence[str], None] = None,
    normalize: Optional[str] = None,
    on_unstable: str = "raise",
    allow: Union[Sequence[Union[str, int]], dict, None] = None,
    deny: Union[Sequence[Union[str, int]], dict, None] = None,
) -> dict[str, Any]:
    """The ``extra_args`` dict of a constrained request (validated here, so mistakes surface at the call site).

    ``allow``/``deny``: entry keys (or names) or entry indices the request may / may not use, or
    ``{"file": PATH}`` for a file of them on the server (see :class:`FilterFile`).

    ``spans``: instead of ``trie``, catalog-valued fields inside free text, one dict per field:
    ``{"after": '"city": "', "values": [...], "end": '"'}`` or ``{"after": ..., "trie": NAME_OR_PATH}`` (see
    :class:`SpanRequest`); combines with no other option.

    ``template`` and ``slots``: instead of ``trie``, the whole output as fixed text with slots
    (:class:`trie_decode.Template`): ``trie_args(template='{"city": "{city}"}', slots={"city": ["Paris", "Rome"]})``;
    a slot's values are a list of strings or a trie name or path.

    Example:
        >>> from vllm import SamplingParams                                          # doctest: +SKIP
        >>> SamplingParams(max_tokens=16, extra_args=trie_args(["Paris", "Rome"]))  # doctest: +SKIP
        >>> trie_args(spans=[{"after": '"city": "', "values": ["Paris", "Rome"]}])["spans"][0]["after"]
        '"city": "'
    """
    # The options given besides template and slots, in the order the messages name them.
    given = [key for key, is_set in {
        "trie": trie is not None, "spans": spans is not None, "on_complete": on_complete != "eos",
        "trigger": trigger is not None, "separator": separator is not None,
        "leading_space": leading_space is not False, "context": context is not None,
        "normalize": normalize is not None, "on_unstable": on_unstable != "raise", "allow": allow is not None,
        "deny": deny is not None,
    }.items() if is_set]
    if template is not None or slots is not None:
        check_alone("template", given, TRIE_ARGS)
        if template is None:
            _fail("trie_args(slots=...) holds a template's slot values: it needs template=")
        out: dict[str, Any] = {"template": template, "slots": {
            k: list(v) if isinstance(v, tuple) else v for k, v in slots.items()} if isinstance(slots, dict) else slots}
    elif spans is not None:
        check_alone("spans", [k for k in given if k != "spans"], TRIE_ARGS)
        if not isinstance(spans, (list, tuple)):
            _fail(f"trie_args(spans=...) must be a list of span dicts, got {type(spans).__name__}")
        out = {"spans": [dict(s) if isinstance(s, dict) else s for s in spans]}
        for s in out["spans"]:
            if isinstance(s, dict) and isinstance(s.get("values"), tuple):
                s["values"] = list(s["values"])
    elif trie is None:
        _fail("trie_args needs a trie (a name, a path or an inline list) or spans=")
    else:
        out = {"trie": os.fspath(trie) if isinstance(trie, os.PathLike) else trie}
        if isinstance(out["trie"], tuple):
            out["trie"] = list(out["trie"])
        if on_complete != "eos":
            out["on_complete"] = on_complete
        if trigger is not None:
            out["trigger"] = trigger if isinstance(trigger, (str, int)) else list(trigger)
        if separator is not None:
            out["separator"] = separator if isinstance(separator, (str, int)) else list(separator)
        # Checked, not made truthy (bool("false") is True): numpy's bools become bools, the rest is parsed below.
        if isinstance(leading_space, (list, tuple)):
            out["leading_space"] = [bool(v) if isinstance(v, np.bool_) else v for v in leading_space]
        elif leading_space is not False:
            out["leading_space"] = bool(leading_space) if isinstance(leading_space, np.bool_) else leading_space
        if context is not None:
            out["context"] = context if isinstance(context, str) else list(context)
        if normalize is not None:
            out["normalize"] = normalize
        if on_unstable != "raise":
            out["on_unstable"] = on_unstable
        for name, value in (("allow", allow), ("deny", deny)):
            if value is not None:  # the request's filter rules, then plain JSON values ({"file": PATH}, or a list)
                spec = _filter_option(value, TRIE_ARGS(name))
                out[name] = {"file": spec.path} if isinstance(spec, FilterFile) else list(spec)
    parse_trie_request(out)
    return out


class _LRU:
    """A least-recently-used cache bounded by count and by bytes (``sizeof`` of each value); the newest value stays
    even when it alone is over the byte bound (it is in use), and so do the keys ``in_use()`` returns (called once
    per eviction pass), so the bounds may be exceeded by what is in use, never by what is idle. With
    ``live_sizes``, every value is measured again before each eviction pass (values that grow after they are put,
    like constraints whose kernels build arrays on first use)."""

    def __init__(
        self,
        size: int,
        max_bytes: int,
        sizeof: Callable[[Any], int],
        in_use: Optional[Callable[[], Collection[Hashable]]] = None,
        live_sizes: bool = False,
    ) -> None:
        self.size = size
        self.max_bytes = max_bytes
        self.sizeof = sizeof
        self.in_use = in_use
        self.live_sizes = live_sizes
        self.items: "OrderedDict[Hashable, tuple[Any, int]]" = OrderedDict()
        self.nbytes = 0
        self.lock = threading.Lock()

    def get(self, key: Hashable) -> Any:
        with self.lock:
            found = self.items.get(key)
            if found is None:
                return None
            self.items.move_to_end(key)
            return found[0]

    def put(self, key: Hashable, value: Any) -> None:
        size = int(self.sizeof(value))
        with self.lock:
            old = self.items.pop(key, None)
            if old is not None:
                self.nbytes -= old[1]
            self.items[key] = (value, size)
            self.nbytes += size
            if self.live_sizes:
                for k in list(self.items):
                    v = self.items[k][0]
                    self.items[k] = (v, int(self.sizeof(v)))
                self.nbytes = sum(n for _, n in self.items.values())
            if not self._over():
                return
            keep = self.in_use() if self.in_use is not None else ()
            for old_key in list(self.items):  # oldest first
                if not self._over():
                    break
                if old_key == key or old_key in keep:
                    continue
                self.nbytes -= self.items.pop(old_key)[1]

    def _over(self) -> bool:
        return len(self.items) > self.size or self.nbytes > self.max_bytes

    def __len__(self) -> int:
        return len(self.items)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.items

    def __getitem__(self, key: Hashable) -> Any:
        """The value of ``key`` without refreshing it (a lookup on a hot path; raises KeyError)."""
        return self.items[key][0]


def _trie_nbytes(trie: TokenTrie) -> int:
    """Bytes of a trie's arrays, names and keys included (for file tries: the mapped size)."""
    total = trie.nbytes
    for table in (getattr(trie, "_names", None), getattr(trie, "_keys", None)):
        if table is not None:
            total += table.blob.nbytes + table.offsets.nbytes
    return total


@dataclass(frozen=True)
class _RequestSpan(Span):
    """A request's span: its messages name the request's options (``option``: where the span was sent,
    ``extra_args['spans'][i]``), not :class:`Span`'s keywords."""

    option: str = "extra_args['spans']"

    def value_fixes(self) -> tuple[str, Optional[str]]:
        return (f"give the span another end ({self.option}['end'])",
                f"set {self.option}['escape'] to 'json' (the value is then written JSON-escaped)")

    def label(self) -> str:
        return self.option


class _RequestTemplate(Template):
    """A request's template: its messages name the request's options (a request has no ``escape``)."""

    def value_fixes(self, k: int) -> tuple[str, Optional[str]]:
        name = self.slot_names[k]
        return (f"change the text after {{{name}}} in extra_args['template'], or leave the value out of "
                f"extra_args['slots'][{name!r}]", None)


class TrieResolver:
    """Turns :class:`TrieRequest` s into tries and span rules for one tokenizer, with LRU caches.

    Args:
        tokenizer: the engine's Hugging Face tokenizer (fingerprint checks, inline strings, text options).
        end_token_id: the end token (default: the tokenizer's EOS).
        logits_width: the model's logits width; a trie with a larger vocabulary is rejected.

    Attributes:
        engine_refusals: requests the engine core refused after the front-end admitted them, by cause
            (:meth:`refused_in_engine`; a ``collections.Counter``, for tests and operators).
    """

    #: Distinct refusal causes logged at ERROR per resolver; beyond that, refusals are counted and logged at DEBUG.
    MAX_LOGGED_CAUSES = 256

    def __init__(self, tokenizer: Any, end_token_id: Optional[int] = None, logits_width: Optional[int] = None) -> None:
        self.tokenizer = tokenizer
        if end_token_id is None:
            end_token_id = first_eos(getattr(tokenizer, "eos_token_id", None))
        if end_token_id is None:
            raise TrieRequestError("the engine's tokenizer has no eos_token_id: the end token is unknown")
        self.end_token_id = int(end_token_id)
        self.vocab_size = tokenizer_vocab_size(tokenizer)
        self.logits_width = logits_width
        self.fingerprint = tokenizer_fingerprint(tokenizer)  # ~50 ms once
        limits = current_limits()
        self._files = _LRU(FILE_CACHE_SIZE, limits.file_cache_bytes, _trie_nbytes)
        self._inline = _LRU(INLINE_CACHE_SIZE, limits.inline_cache_bytes, _trie_nbytes)
        # Filter files' items by the file's identity: a few files (a category, a user's history), bounded in bytes.
        self._filter_files = _LRU(FILE_CACHE_SIZE, limits.file_cache_bytes, lambda items: 64 * len(items) + 64)
        # Spans' tries and field rules by the span list's content hash and its files' identities (FieldRules keys
        # the groups' step tables by identity: one object per distinct span list keeps them shared).
        self._spans = _LRU(INLINE_CACHE_SIZE, limits.inline_cache_bytes, lambda v: sum(_trie_nbytes(t) for t in v[0]))
        self.engine_refusals: Counter = Counter()
        self._logged_causes: set = set()
        self._refusal_lock = threading.Lock()

    # Loading a file: only a registered name or a file inside an allowed directory (.vllm_access); the cache key
    # holds the file's identity and modification time (from the opened descriptor), so a rewritten file is reloaded.
    # Returns the trie and that key (its first four fields are the stamp's file origin).
    def _load_file(self, value: str, admit: bool = False, option: Optional[str] = None) -> tuple[TokenTrie, tuple]:
        policy = current_policy()
        # The same refusal for every path outside the allowed directories.
        resolved = policy.resolve(value, option=option)
        # Regular files only, never blocking; a live catalog's delta file beside the trie file (trie_decode.live)
        # is opened once through the same policy and read from that descriptor.
        with policy.open(resolved) as handle, policy.open_delta(resolved) as delta:
            # The delta's identity is part of the key: a new or replaced delta reloads, and new requests decode the
            # base with its changes folded in.
            key = (resolved.path, *file_identity(handle), file_identity(delta) if delta is not None else None)
            found = self._files.get(key)
            if found is not None:
                return found, key
            # Named tries are the operator's: always loaded (their time is still spent).
            with charged(f"loading {resolved.label}", admit, refusable=resolved.kind != "named", option=option):
                trie = policy.load(resolved, handle, delta)
        self._files.put(key, trie)
        return trie, key

    def _build(self, req: TrieRequest) -> TokenTrie:
        if req.source == "strings":  # the one tokenization path of strings (forms, contexts, normalization)
            spaces = list(req.leading_space) if isinstance(req.leading_space, tuple) else req.leading_space
            context = list(req.context) if isinstance(req.context, tuple) else req.context
            if context is not None and spaces is False:
                spaces = None  # only the context's form
            try:
                return TokenTrie.from_strings(list(req.payload), self.tokenizer, leading_space=spaces,
                                              context=context, normalize=req.normalize, on_unstable=req.on_unstable)
            except ContextError as exc:  # its fix, in the request's own options
                raise TrieRequestError(exc.message_for(EXTRA_ARGS)) from exc
        return TokenTrie.from_sequences([list(s) for s in req.payload], self.vocab_size, fingerprint=self.fingerprint)

    def _build_inline(self, req: TrieRequest, admit: bool = False) -> TokenTrie:
        key = req.trie_key()
        found = self._inline.get(key)
        if found is not None:
            return found
        handoff = handoff_store()
        handoff_key = f"{self.fingerprint[:16]}-{key[1]}"
        # The engine core (not admit): the frontend that admitted the request has usually built it already.
        trie = None if admit else handoff.get(handoff_key, self.fingerprint)
        if trie is None:
            with charged(f"an inline list of {len(req.payload)} entries", admit):
                try:
                    trie = self._build(req)
                except TrieDecodeError as exc:
                    raise TrieRequestError(f"extra_args['trie']: {exc}") from exc
            if admit:
                handoff.put(handoff_key, trie)
        self._inline.put(key, trie)
        return trie

    def trie(self, req: TrieRequest, *, admit: bool = False) -> TokenTrie:
        """The request's trie (cached); raises :class:`TrieRequestError` for anything unusable.

        Args:
            req: the parsed request. A ``"file"`` payload must be a registered trie name or a file inside an allowed
                directory (:mod:`.vllm_access`); anything else gets the same refusal, which says nothing about the file.
            admit: the call admits a new request (vLLM's frontend, ``validate_params``): work on a trie that is not
                cached yet counts against the process's build budget (over it: refused), and a built inline trie is
                handed to the engine core. The engine side (``admit=False``) never refuses for cost.
        """
        return self._trie(req, admit)[0]

    def _trie(self, req: TrieRequest, admit: bool, option: Optional[str] = None
              ) -> tuple[TokenTrie, Optional[tuple]]:
        """:meth:`trie`, and for a file its origin ``(real_path, st_dev, st_ino, st_mtime_ns, st_size)``.
        ``option``: where in the request a file's name was sent, as messages name it (default
        ``extra_args['trie']``; a span's or a template slot's own key)."""
        origin = None
        where = option or "extra_args['trie']"
        try:
            if req.source == "file":
                trie, origin = self._load_file(req.payload, admit, option)
            else:
                trie = self._build_inline(req, admit)
        except TrieAccessError as exc:
            raise TrieRequestError(str(exc)) from None
        # A trie saved with the previous fingerprint computation may still match the engine's tokenizer.
        if trie.fingerprint and trie.fingerprint != self.fingerprint and (
                not fingerprint_matches(trie.fingerprint, self.tokenizer)):
            raise TrieRequestError(
                f"{where}: the trie was built for a tokenizer with fingerprint {trie.fingerprint}, "
                f"the engine's tokenizer has {self.fingerprint}: rebuild it with the served model's tokenizer"
            )
        top = trie.max_token + 1  # the trie's tokens must fit the logits; its vocab_size may be wider
        if trie.vocab_size > self.vocab_size or (self.logits_width is not None and top > self.logits_width):
            raise TrieRequestError(
                f"{where}: the trie's vocabulary ({trie.vocab_size}, tokens up to {top - 1}) exceeds the "
                f"engine's ({self.vocab_size} tokens, logits width {self.logits_width})"
            )
        return trie, origin

    def spans(self, req: TrieRequest, *, admit: bool = False) -> tuple[list[TokenTrie], SpanRules]:
        """A ``spans`` (or ``template``) request's tries (one per span or slot, the tree index is the span's) and its
        rules ``SpanRules(end_token_id=eos, on_complete="release", fields=FieldRules)`` (a template's
        ``TemplateRules``), cached per span list (and, for spans naming trie files, per file identity). ``admit``: as in :meth:`trie` (cost-bounded, front-end).

        Raises:
            TrieRequestError: a file outside the access policy, a value that contains the end, a tokenizer mismatch.
        """
        file_tries: dict[int, TokenTrie] = {}
        origins = []
        for i, path, option in req.files():
            trie, origin = self._trie(TrieRequest(source="file", payload=path), admit, option)
            file_tries[i] = trie
            origins.append(origin)
        key = (req.trie_key(), tuple(origins))
        found = self._spans.get(key)
        if found is not None:
            return found
        option = "slots" if req.source == "template" else "spans"
        try:
            with charged(f"the tries of {len(req.spans)} spans", admit, option=f"extra_args[{option!r}]"):
                try:
                    values = [file_tries[i] if s.source == "file" else list(s.payload)
                              for i, s in enumerate(req.spans)]
                    if req.source == "template":  # each span is a slot, named by its ``after``
                        template = _RequestTemplate.from_slots(req.payload,
                                                               {s.after: v for s, v in zip(req.spans, values)})
                        tries, fields = template.build(self.tokenizer, self.end_token_id)
                    else:
                        spans = [_RequestSpan(v, after=s.after_pattern(), end=s.end, escape=s.escape, allow=s.allow,
                                              deny=s.deny, option=f"extra_args['spans'][{i}]")
                                 for i, (s, v) in enumerate(zip(req.spans, values))]
                        tries, fields = FieldRules.build(spans, self.tokenizer, self.end_token_id)
                    rules = SpanRules(end_token_id=self.end_token_id, on_complete="release", fields=fields)
                    rules.check_vocab(max(self.vocab_size, self.end_token_id + 1))
                except TrieDecodeError as exc:
                    raise TrieRequestError(f"extra_args[{option!r}]: {exc}") from exc
        except TrieAccessError as exc:  # the build budget is spent
            raise TrieRequestError(str(exc)) from None
        self._spans.put(key, (tries, rules))
        return tries, rules

    def rules(self, req: TrieRequest) -> SpanRules:
        """The request's span rules (text options tokenized with the engine's tokenizer)."""
        try:
            rules = SpanRules(**rule_args(self.tokenizer, self.end_token_id, req.on_complete, req.separator,
                                          req.trigger, names=EXTRA_ARGS))
            rules.check_vocab(max(self.vocab_size, self.end_token_id + 1))
        except TrieRequestError:
            raise
        except TrieDecodeError as exc:
            raise TrieRequestError(f"extra_args: {exc}") from exc
        return rules

    def resolve(self, req: TrieRequest) -> tuple[TokenTrie, SpanRules]:
        """The request's trie and span rules, as the engine core uses them (never refused for cost)."""
        trie, rules = self.trie(req), self.rules(req)
        self._check_rules_fit(trie, rules)
        self._check_prefix(req, trie)
        return trie, rules

    @staticmethod
    def _check_rules_fit(trie: TokenTrie, rules: SpanRules) -> None:
        """The check the request's constraint makes (:class:`TrieConstraint` takes its width from the trie): the end,
        separator and trigger tokens inside the trie's vocabulary, which a trie file may have built narrower than the
        engine's. Refused here, as a 400, instead of failing where the engine adds the request."""
        try:
            rules.check_vocab(trie.vocab_size)
        except TrieDecodeError as exc:
            raise TrieRequestError(
                f"extra_args['trie']: the trie was built with vocab_size={trie.vocab_size}, too narrow for the request's "
                f"tokens ({exc}; the end token is the model's EOS): send a trie built with the served model's vocabulary "
                "size (TokenTrie.from_strings, trie-decode build)"
            ) from None

    @staticmethod
    def _check_prefix(req: TrieRequest, trie: TokenTrie) -> None:
        if req.prefix and trie.walk(req.prefix) < 0:
            raise TrieRequestError(f"extra_args['prefix'] {list(req.prefix)[:20]} is not a path of the trie")

    @staticmethod
    def _check_template_prefix(req: TrieRequest, tries: Sequence[TokenTrie], rules: SpanRules) -> None:
        """A template request's ``prefix`` (output tokens already at the prompt's end) refused unless the template
        could have written it: each token allowed by the mask of the state before it (the constraint's own rule,
        replayed on one CPU row). Without this check a stray prefix leaves the row where it may only end."""
        if not req.prefix:
            return
        constraint = TrieConstraint(tries, rules, "cpu")
        state = constraint.start(1)
        for i, token in enumerate(req.prefix):
            allowed = constraint.allowed_tokens(state)[0]
            if allowed is not None and token not in allowed:
                raise TrieRequestError(
                    f"extra_args['prefix'] {list(req.prefix)[:20]} is not what the template writes: token {token} "
                    f"(at {i}) is not allowed there")
            state = constraint.advance(state, torch.tensor([token]))

    def admit(self, req: TrieRequest, stop_ids: Sequence[int] = (), model_stop_ids: Sequence[int] = ()) -> str:
        """The front-end's complete check of a request (trie within the build budget, rules, prefix, filters, no
        entry or span value cut by the model's EOS, by one of ``model_stop_ids`` (the EOS ids of its generation
        config) or by one of ``stop_ids``, the request's ``stop_token_ids``); returns the stamp to put in
        ``extra_args[STAMP_KEY]`` (:func:`.vllm_access.make_stamp`).

        Raises:
            TrieRequestError: anything unusable (the client gets it as a 400).

        Example:
            >>> resolver = TrieResolver(tokenizer)                                          # doctest: +SKIP
            >>> stamp = resolver.admit(parse_trie_request({"trie": ["red", "green"]}))      # doctest: +SKIP
        """
        if req.source in ("spans", "template"):
            tries, rules = self.spans(req, admit=True)
            self._check_template_prefix(req, tries, rules)
            for i, trie in enumerate(tries):  # a value a stop token would cut (one tree per span, in order)
                self._check_end_inside(trie, (rules.end_token_id, *model_stop_ids), stop_ids,
                                       "extra_args['slots']" if req.source == "template" else f"extra_args['spans'][{i}]")
            return make_stamp(None)
        trie, origin = self._trie(req, admit=True)
        rules = self.rules(req)
        self._check_rules_fit(trie, rules)
        self._check_end_inside(trie, (rules.end_token_id, *model_stop_ids), stop_ids, "extra_args['trie']")
        self._check_prefix(req, trie)
        self.filters(req, trie)
        return make_stamp(origin[:4] if origin is not None else None)

    @staticmethod
    def _check_end_inside(trie: TokenTrie, model_stop_ids: Sequence[int], stop_ids: Sequence[int], where: str) -> None:
        """Refuse, as a 400 naming ``where``, a trie with an entry that holds one of the model's EOS ids or one of
        the request's ``stop_ids`` before its end: generation would stop inside it (one look-up per token, the trie
        keeps its flags)."""
        try:
            check_stop_tokens_outside_entries(trie, model_stop_ids)
            check_stop_tokens_outside_entries(trie, stop_ids, change="stop_token_ids")
        except ConstraintConfigError as exc:
            raise TrieRequestError(f"{where}: {exc}") from None

    def refused_in_engine(self, extra_args: Optional[dict], exc: BaseException) -> str:
        """Record that the engine core refused a request the front-end admitted: count it by cause in
        :attr:`engine_refusals` and log an ERROR that names the cause and the fix, once per distinct cause
        (:func:`.vllm_access.diagnose_engine_refusal`). Returns the cause.

        Example:
            >>> resolver.refused_in_engine({"trie": "/x.trie"}, ValueError("refused"))     # doctest: +SKIP
            'not_checked_by_frontend'
        """
        extra = extra_args or {}
        try:
            cause, key, message = diagnose_engine_refusal(extra.get("trie"), extra.get(STAMP_KEY), exc)
        except Exception as err:  # noqa: BLE001 - the diagnosis must never take the engine down
            cause, key, message = "unexpected", ("diagnosis", type(err).__name__), f"{exc!r} (diagnosis failed: {err!r})"
        with self._refusal_lock:
            self.engine_refusals[cause] += 1
            first = key not in self._logged_causes and len(self._logged_causes) < self.MAX_LOGGED_CAUSES
            if first:
                self._logged_causes.add(key)
            count = self.engine_refusals[cause]
        if first:
            logger.error(
                "trie_decode: the engine refused a request the front-end had admitted; the client gets HTTP 200 with "
                "empty text and finish_reason 'stop' (a logits processor cannot fail one request). Cause: %s. %s "
                "(logged once per distinct cause; TrieResolver.engine_refusals counts them)", cause, message,
            )
        else:
            logger.debug("trie_decode: engine refusal #%d (%s): %s", count, cause, exc)
        return cause

    def _filter(self, trie: TokenTrie, spec: Union[None, tuple, FilterFile], what: str) -> Optional[np.ndarray]:
        """One filter's entry indices, of its keys or indices as sent or read from its file (cached by the file's
        identity, so a replaced file is read again); a file's keys or indices that are no entries are logged, never
        quoted to the client (its lines are the file's bytes, and any text file in an allowed directory can be
        named)."""
        if spec is None:
            return None
        items = read_filter_file(spec.path, what, self._filter_files) if isinstance(spec, FilterFile) else spec
        try:
            return entry_indices(trie, list(items), f"extra_args[{what!r}]")
        except UnknownEntryError as exc:
            if not isinstance(spec, FilterFile):
                raise
            _access_log("load", logging.WARNING, "trie_decode: filter file %s: %s", spec.path[:300], exc)
            raise TrieAccessError(f"extra_args[{what!r}]: {spec.path[:200]!r} holds keys or entry indices that are not "
                                  "entries of the trie (details in the server log)") from None

    def filters(self, req: TrieRequest, trie: TokenTrie) -> tuple[Optional[Any], Optional[Any]]:
        """The request's allow and deny filters as entry-index arrays of ``trie`` (None where not given)."""
        try:
            allow, deny = self._filter(trie, req.allow, "allow"), self._filter(trie, req.deny, "deny")
        except TrieAccessError as exc:
            raise TrieRequestError(str(exc)) from None
        except TrieDecodeError as exc:  # the filter rule's own class, and a request's
            raise raised_as(type(exc), TrieRequestError)(str(exc)) from exc
        check_allow_leaves_entries(None if allow is None else len(np.setdiff1d(allow, () if deny is None else deny)),
                                   "extra_args['allow']", "extra_args['deny']", TrieRequestError,
                                   live=filter_number_map(trie.extra) is not None)
        return allow, deny


# --- vLLM's server-side beam search -------------------------------------------------------------------------------

#: The routes whose JSON body may ask for vLLM's own beam search (``use_beam_search``): the OpenAI completions and
#: chat completions, and SageMaker's ``/invocations``, which hands a body to one of them.
JSON_BEAM_SEARCH_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/invocations"})
#: The speech-to-text routes (vLLM 0.32, ``vllm/entrypoints/speech_to_text/``): their form fields take
#: ``use_beam_search`` and ``vllm_xargs`` (JSON text), and ``to_beam_search_params`` drops the latter too.
FORM_BEAM_SEARCH_ROUTES = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"})
#: Every route :class:`TrieBeamSearchGuard` checks. vLLM 0.32's other routes take no ``use_beam_search``, or refuse
#: it themselves (``/v1/chat/completions/batch``, the ``render`` routes).
BEAM_SEARCH_ROUTES = JSON_BEAM_SEARCH_ROUTES | FORM_BEAM_SEARCH_ROUTES
#: Bodies larger than this are passed on unchecked (logged): vLLM sets no limit of its own, so a larger one must not
#: become a new failure; a constrained request is a few KiB, or some MiB with long ``allow``/``deny`` lists.
MAX_CHECKED_BODY_BYTES = 64 << 20
#: The strings pydantic reads as False (vLLM parses ``use_beam_search`` as a bool in lax mode: ``"false"`` is off).
_FALSE_STRINGS = frozenset({"0", "off", "f", "false", "n", "no"})
BEAM_SEARCH_FIX = (
    "send it without use_beam_search, or run the beam search with trie_decode.integrations.vllm_beam: beam_search() "
    "offline, async_beam_search() in a process that owns the AsyncLLM, or a client-driven search with "
    "\"raw_logprobs\" (docs/vllm.md, \"Beam search\")"
)

#: ASGI's types, written out so that this module imports neither vLLM nor Starlette.
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def _asks_beam_search(value: Any) -> bool:
    """Whether a body's ``use_beam_search`` turns vLLM's beam search on (or is a value vLLM refuses anyway)."""
    return bool(value) and not (isinstance(value, str) and value.lower() in _FALSE_STRINGS)


def beam_search_refusal(body: bytes) -> Optional[str]:
    """Why a completions or chat-completions request body must be refused before vLLM runs it, or None.

    vLLM's server-side beam search (``use_beam_search``) runs every step as a new engine request built without the
    client's ``vllm_xargs`` (``vllm/entrypoints/generate/beam_search/online.py``), so the trie processor never sees
    it: a request that asks for a constraint (:func:`is_trie_request`) would get HTTP 200 with unconstrained text.
    Such a request, and one with options only this processor takes but no constraint (:func:`check_stray_options`,
    refused without beam search too), gets this message. A body that is not a JSON object, or whose
    ``use_beam_search`` or ``vllm_xargs`` vLLM refuses itself, is left to vLLM (None).
    """
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # not JSON (UnicodeDecodeError is a ValueError): vLLM's own 400
        return None
    if not isinstance(data, dict):
        return None
    return _fields_refusal(data.get("use_beam_search"), data.get("vllm_xargs"))


async def form_beam_search_refusal(scope: Scope, body: bytes) -> Optional[str]:
    """:func:`beam_search_refusal` for a speech-to-text request (:data:`FORM_BEAM_SEARCH_ROUTES`), whose fields come
    as a form (``multipart/form-data`` with the audio file, or urlencoded), ``vllm_xargs`` as JSON text.

    The form is read by Starlette's own parser with the limits FastAPI uses (``Request.form()``), so the guard sees
    the fields vLLM will (the last of a repeated field; an empty one is absent). A body that does not parse, or a
    field vLLM refuses itself, is left to vLLM (None).
    """
    from starlette.requests import Request  # vLLM's server runs on Starlette; this module imports it only here

    request = Request(dict(scope), _replay([{"type": "http.request", "body": body, "more_body": False}], _gone))
    try:
        form = await request.form()
    except Exception:  # noqa: BLE001  a form the parser cannot read: vLLM's own 400, never a 500 of the guard's
        return None
    try:
        use, xargs = form.get("use_beam_search"), form.get("vllm_xargs")
    finally:
        await form.close()
    if not isinstance(use, str) or not isinstance(xargs, str) or not xargs:
        return None  # absent, or a file: vLLM refuses the latter itself
    try:
        parsed = json.loads(xargs)
    except (ValueError, RecursionError):  # vLLM's own 400 ("Failed to parse vllm_xargs")
        return None
    return _fields_refusal(use, parsed)


async def _gone() -> Message:
    """The ``receive`` after a whole body: the client has nothing more to send."""
    return {"type": "http.disconnect"}


def _fields_refusal(use_beam_search: Any, xargs: Any) -> Optional[str]:
    """The refusal of :func:`beam_search_refusal` for a request's ``use_beam_search`` and parsed ``vllm_xargs``."""
    if not _asks_beam_search(use_beam_search):
        return None
    if not isinstance(xargs, dict):
        return None  # absent, or not an object: vLLM refuses the latter itself
    if is_trie_request(xargs):
        asked = ", ".join(repr(key) for key in MAIN_KEYS if key in xargs)
        return (f"use_beam_search cannot be combined with vllm_xargs {asked}: vLLM's beam search runs without "
                f"vllm_xargs, so the output would not be constrained; {BEAM_SEARCH_FIX}")
    try:
        check_stray_options(xargs)
    except TrieRequestError as exc:
        return str(exc)
    return None


def _content_length(scope: Scope) -> Optional[int]:
    for name, value in scope.get("headers") or ():
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class TrieBeamSearchGuard:
    """ASGI middleware for ``vllm serve``: refuses a beam-search request that asks for a trie, instead of letting
    vLLM answer it with unconstrained text (:func:`beam_search_refusal`).

    Load it with vLLM's own ``--middleware`` flag, beside the processor::

        vllm serve MODEL --logits-processors trie_decode.integrations.vllm:TrieLogitsProcessor \\
            --middleware trie_decode.integrations.vllm_requests.TrieBeamSearchGuard

    A POST to :data:`BEAM_SEARCH_ROUTES` is read whole (up to :attr:`max_body_bytes`), checked, and either refused
    with HTTP 400 in vLLM's error format (``{"error": {"message", "type": "BadRequestError", "param", "code": 400}}``)
    or handed on with the same body bytes; every other request goes through untouched. The speech-to-text routes
    are read as forms (:func:`form_beam_search_refusal`).

    vLLM adds ``--middleware`` classes after its own, so Starlette runs this one outside vLLM's ``--api-key``
    check. That check still answers first: a request it would refuse (a 401) is handed on unread, and vLLM refuses
    it as it would without the guard (:func:`.vllm_internals.api_key_refuses`, which runs vLLM's own check). On a
    vLLM that module was not verified against, the guard refuses without asking (its 400 then comes before the 401).
    Either way the 400 has no CORS headers (vLLM's CORS middleware runs inside its authentication, so its 401 has
    none either).
    """

    #: Bodies larger than this are handed on unchecked (and logged).
    max_body_bytes: int = MAX_CHECKED_BODY_BYTES

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        #: vLLM's --api-key middleware beneath this one (None: no --api-key, or a vLLM not verified).
        self._api_key = api_key_middleware(app)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or self._route(scope) not in BEAM_SEARCH_ROUTES:
            await self.app(scope, receive, send)
            return
        if self._api_key is not None and await api_key_refuses(self._api_key, scope):
            await self.app(scope, receive, send)  # vLLM's 401, as without the guard; the body is not read
            return
        length = _content_length(scope)
        if length is not None and length > self.max_body_bytes:
            self._unchecked(scope, length)
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # the client went away: vLLM sees it as it would have
                break
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                self._unchecked(scope, size)
                break
            if not message.get("more_body", False):
                body = b"".join(m.get("body", b"") for m in messages)
                refusal = await self._refusal(scope, body)
                if refusal is not None:
                    await self._refuse(send, refusal)
                    return
                messages = [{"type": "http.request", "body": body, "more_body": False}]
                break
        await self.app(scope, _replay(messages, receive), send)

    @staticmethod
    def _route(scope: Scope) -> str:
        """The request's path without vLLM's ``--root-path`` (Starlette keeps it in ``path``)."""
        path: str = scope.get("path", "")
        root = scope.get("root_path", "")
        return path[len(root):] if root and path.startswith(root) else path

    @classmethod
    async def _refusal(cls, scope: Scope, body: bytes) -> Optional[str]:
        if cls._route(scope) in FORM_BEAM_SEARCH_ROUTES:
            return await form_beam_search_refusal(scope, body)
        return beam_search_refusal(body)

    @staticmethod
    def _unchecked(scope: Scope, size: int) -> None:
        logger.warning("trie_decode: %s body of %d bytes is over TrieBeamSearchGuard.max_body_bytes: passed on "
                       "without checking use_beam_search against vllm_xargs", scope.get("path"), size)

    @staticmethod
    async def _refuse(send: Send, message: str) -> None:
        error = {"error": {"message": message, "type": "BadRequestError", "param": "use_beam_search", "code": 400}}
        payload = json.dumps(error, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode("ascii"))]})
        await send({"type": "http.response.body", "body": payload, "more_body": False})


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that returns ``messages`` first, then the client's own (a disconnect, for vLLM's watchers)."""
    pending = deque(messages)

    async def replay() -> Message:
        if pending:
            return pending.popleft()
        return await receive()

    return replay
