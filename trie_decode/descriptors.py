"""Tries from JSON descriptors: the TokenTreePayload format and RTP-LLM's prefix dictionary.

Why this exists: tries are often produced by another system (a retrieval index, a catalogue service, an RTP-LLM
deployment) as JSON. These readers turn them into :class:`~trie_decode.TokenTrie` objects and reject malformed input
with a :class:`~trie_decode.DescriptorError` (or :class:`~trie_decode.InvalidTokenError` for an id out of range)
that names the field and the entry.

TokenTreePayload::

    {"modelId": "...", "descriptors": [{"path": "tools/search", "leaves": [{"name": "web", "tokens": [12, 7]}]}]}

One trie per descriptor ``path``; each leaf is an entry whose name is the leaf's ``name``.

RTP-LLM prefix dictionary (the ``tree_decode_config`` file of RTP-LLM's ``TreeLogitsProcessor``)::

    {"start_token_id": 225, "end_token_id": 2, "sep": "_",
     "prefix_dict": {"225": [64000, 64003], "225_64003": [64001], "225_64003_64001": [2]}}

RTP-LLM decodes with a string-keyed automaton (``TreeDFA`` in ``DFAUtil.h``): its state is the start token and the
generated tokens joined by ``sep``; the allowed tokens are the state's candidates, or the end token alone when the
state has no candidates (no key, ``[]``) or after a token whose key is missing (its error state). By default
:func:`trie_from_prefix_dict` reads a dictionary exactly that way, so RTP-LLM's real files (most candidates have no
key of their own) load and mask as they do in RTP-LLM; ``strict=True`` refuses every case RTP-LLM accepts
silently. The semantics, side by side with the trie's, are in ``docs/trie-format.md``.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import numpy as np

from ._build import RaggedTokens, token_paths
from .errors import DescriptorError, InvalidEntryError, InvalidTokenError
from .trie import VOCAB_SIZE, TokenTrie, check_fingerprint, check_vocab_size

__all__ = ["read_json", "tries_from_token_tree_payload", "trie_from_prefix_dict"]

JsonSource = Union[str, bytes, os.PathLike, dict, list]


def read_json(source: JsonSource, what: str) -> Any:
    """Parse ``source``: an already-parsed object, JSON text, or a path to a JSON file (UTF-8; a byte-order mark at
    its start is skipped, as in the command line's other input files).

    Raises:
        DescriptorError: no such file, an unreadable one, text that is not UTF-8 or not JSON, or JSON nested too
            deeply to parse.
    """
    if isinstance(source, (dict, list)):
        return source
    if isinstance(source, str):
        source = source.removeprefix("\ufeff")  # text read from a file with a byte-order mark: not part of it
        if not source.strip():  # as a path it would be the current folder ("no such file '.'")
            raise DescriptorError(f"{what}: got an empty string, neither JSON text nor a file path")
    if isinstance(source, os.PathLike) or (isinstance(source, str) and not source.lstrip().startswith(("{", "["))):
        path = Path(source)
        try:
            if path.is_dir():
                raise DescriptorError(f"{what}: {str(path)!r} is a folder, not a file")
            if path.exists() and not path.is_file():  # reading a FIFO would block
                raise DescriptorError(f"{what}: {str(path)!r} is not a regular file (a pipe or a device)")
            if not path.is_file():
                raise DescriptorError(f"{what}: no such file {str(path)!r}")
            text = path.read_bytes()
        except OSError as exc:  # stat() or the read refused it (a name too long, no permission)
            raise DescriptorError(f"{what}: cannot read {str(path)!r} ({exc.strerror})") from exc
    elif isinstance(source, (bytes, str)):
        text = source
    else:
        raise DescriptorError(f"{what}: expected a dict, JSON text or a file path, got {type(source).__name__}")
    try:
        return json.loads(text.decode("utf-8-sig") if isinstance(text, bytes) else text)
    except UnicodeDecodeError as exc:
        raise DescriptorError(f"{what}: not UTF-8 text ({exc})") from exc
    except json.JSONDecodeError as exc:
        raise DescriptorError(f"{what}: invalid JSON ({exc})") from exc
    except RecursionError as exc:
        raise DescriptorError(f"{what}: invalid JSON (nested too deeply to parse)") from exc


def _token_list(value: Any, where: str) -> list[int]:
    if not isinstance(value, list):
        raise DescriptorError(f"{where} must be a list of token ids, got {type(value).__name__}")
    for tok in value:
        if not _is_int(tok):  # a numpy integer is one too (a payload built in Python), as in a prefix dict
            raise DescriptorError(f"{where} holds {tok!r}, not an integer token id")
    return value


def tries_from_token_tree_payload(payload: JsonSource, vocab_size: int, *, fingerprint: str = "") -> dict[str, TokenTrie]:
    """Build one :class:`TokenTrie` per descriptor path of a TokenTreePayload.

    Raises:
        DescriptorError: not an object, ``descriptors`` missing or empty, a descriptor without ``path`` or with no
            leaves, a leaf without ``name`` or ``tokens``, a duplicated path, a ``modelId`` JSON cannot hold.
        InvalidTokenError / InvalidEntryError: as :meth:`TokenTrie.from_sequences` (the message names the entry);
            ``vocab_size`` not in [1, 2**31]; a ``fingerprint`` that is not a string.
    """
    check_vocab_size(vocab_size, VOCAB_SIZE)  # here, not as a leaf's problem below
    check_fingerprint(fingerprint)
    data = read_json(payload, "TokenTreePayload")
    if not isinstance(data, dict):
        raise DescriptorError(f"TokenTreePayload must be a JSON object, got {type(data).__name__}")
    descriptors = data.get("descriptors")
    if not isinstance(descriptors, list) or not descriptors:
        raise DescriptorError("TokenTreePayload: field 'descriptors' is missing or is not a non-empty list")
    model_id = data.get("modelId")
    try:  # recorded in every trie's options (JSON in the trie file): a payload built in Python may hold anything
        json.dumps(model_id)
    except (TypeError, ValueError) as exc:
        raise DescriptorError(f"TokenTreePayload: 'modelId' is {type(model_id).__name__} {model_id!r:.40}, not JSON "
                              "(give a string)") from exc
    tries: dict[str, TokenTrie] = {}
    for i, desc in enumerate(descriptors):
        if not isinstance(desc, dict):
            raise DescriptorError(f"TokenTreePayload: descriptors[{i}] is not an object")
        path = desc.get("path")
        if not isinstance(path, str) or not path:
            raise DescriptorError(f"TokenTreePayload: descriptors[{i}] has no 'path' string")
        if path in tries:
            raise DescriptorError(f"TokenTreePayload: path {path!r} appears twice (descriptors[{i}])")
        leaves = desc.get("leaves")
        if not isinstance(leaves, list) or not leaves:
            raise DescriptorError(
                f"TokenTreePayload: descriptor {path!r} has no leaves: a constraint with nothing to generate"
            )
        names, sequences = [], []
        for j, leaf in enumerate(leaves):
            where = f"TokenTreePayload: descriptor {path!r} leaves[{j}]"
            if not isinstance(leaf, dict):
                raise DescriptorError(f"{where} is not an object")
            if not isinstance(leaf.get("name"), str):
                raise DescriptorError(f"{where} has no 'name' string")
            if "tokens" not in leaf:
                raise DescriptorError(f"{where} ({leaf['name']!r}) has no 'tokens'")
            tokens = _token_list(leaf["tokens"], f"{where} ({leaf['name']!r}) 'tokens'")
            if not tokens:
                raise DescriptorError(f"{where} ({leaf['name']!r}) has an empty 'tokens' list")
            names.append(leaf["name"])
            sequences.append(tokens)
        options = {"source": "TokenTreePayload", "path": path, "modelId": model_id}
        try:
            tries[path] = TokenTrie.from_sequences(
                sequences, vocab_size, names=names, fingerprint=fingerprint, options=options
            )
        except (InvalidTokenError, InvalidEntryError) as exc:
            # "entry j" alone does not say which descriptor: name it (entry j is its leaves[j]).
            raise type(exc)(f"TokenTreePayload: descriptor {path!r}, leaves as entries: {exc}") from exc
    return tries


# ------------------------------------------------------------------ RTP-LLM prefix dictionary

INT32_MAX = 2**31 - 1
# RTP-LLM's TreeDecodeConfig fills these in when a field is absent (PrefixToCandidateTokens.h).
RTP_DEFAULTS = {"start_token_id": 225, "end_token_id": 2, "sep": "_"}
_FIELDS = ("start_token_id", "end_token_id", "sep", "prefix_dict")
_SHIFT = np.int64(1 << 31)  # a (key, token) pair packed as key * 2**31 + token (token <= INT32_MAX)
_EXAMPLES = 5


@dataclass
class _Parsed:
    """A type-checked prefix dict (K keys, T candidate ids over all keys, in key order)."""

    start: int
    end: int
    sep: str
    keys: list[str]  # (K,)
    index: dict[str, int]  # key -> its position in ``keys``
    values: np.ndarray  # (T,) int64; ids beyond int64 are clipped to +-2**62 (still out of range)
    offsets: np.ndarray  # (K+1,) int64; the candidates of key k are values[offsets[k]:offsets[k+1]]
    defaulted: list[str]  # fields absent from the file (RTP-LLM's defaults are used)
    ignored: list[str]  # top-level fields this reader does not use


@dataclass
class _Tables:
    """What each key allows, computed once for all keys (vectorized).

    RTP-LLM drops negative and beyond-int32 ids and repeats when it loads the file, falls back to the end token when
    nothing is left, and drops ids outside the logits (``>= vocab_size``) when it masks.
    """

    key_of: np.ndarray  # (T,) int64: the key of each candidate id
    usable: np.ndarray  # (T,) bool: 0 <= id <= INT32_MAX (what RTP-LLM keeps at load time)
    allowed_ptr: np.ndarray  # (K+1,) int64: allowed tokens of key k are allowed_tok[allowed_ptr[k]:allowed_ptr[k+1]]
    allowed_tok: np.ndarray  # sorted, unique, usable and below vocab_size
    no_candidates: np.ndarray  # (K,) bool: nothing usable ([] or only skipped ids): RTP-LLM allows the end token
    allows_nothing: np.ndarray  # (K,) bool: usable ids, all outside the vocabulary: RTP-LLM masks every logit
    has_end: np.ndarray  # (K,) bool: the end token is among the allowed tokens


@dataclass
class _Walk:
    """The trie's nodes, found by following candidates from the start key level by level (N nodes)."""

    parent: np.ndarray  # (N,) int64, -1 for the root
    token: np.ndarray  # (N,) int64, -1 for the root
    level_ptr: list[int]  # first node of each depth
    terminal: np.ndarray  # sorted node ids after which the end token is allowed
    visits: np.ndarray  # (K,) int64: how many token paths reach each key
    num_missing: int = 0  # candidates whose key is missing (RTP-LLM's error state follows them)
    missing: list[str] = field(default_factory=list)  # examples
    nothing: list[str] = field(default_factory=list)  # reached keys that allow nothing inside the vocabulary
    after_end: list[str] = field(default_factory=list)  # keys of the form "<reached key><sep><end>"


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _parse_prefix_dict(payload: JsonSource) -> _Parsed:
    """Read and type-check a prefix dict; what RTP-LLM's loader refuses raises here in both modes."""
    data = read_json(payload, "prefix dict")
    if not isinstance(data, dict):
        raise DescriptorError(f"prefix dict must be a JSON object, got {type(data).__name__}")
    if "prefix_dict" not in data:
        raise DescriptorError("prefix dict: field 'prefix_dict' is missing")
    defaulted = [f for f in ("start_token_id", "end_token_id") if f not in data]
    ids = {}
    for name in ("start_token_id", "end_token_id"):
        value = data.get(name, RTP_DEFAULTS[name])
        if not _is_int(value):
            raise DescriptorError(f"prefix dict: {name} must be an integer, got {value!r}")
        value = int(value)
        if value < 0:
            raise InvalidTokenError(f"prefix dict: {name} {value} is negative")
        if value > INT32_MAX:
            raise InvalidTokenError(
                f"prefix dict: {name} {value} does not fit in int32 (at most {INT32_MAX}); RTP-LLM refuses it"
            )
        ids[name] = value
    sep = data.get("sep", RTP_DEFAULTS["sep"])
    if not isinstance(sep, str) or not sep:
        raise DescriptorError(f"prefix dict: 'sep' must be a non-empty string, got {sep!r}")
    prefix_dict = data["prefix_dict"]
    if not isinstance(prefix_dict, dict):
        raise DescriptorError("prefix dict: 'prefix_dict' must be an object of prefix -> candidate list")
    keys = list(prefix_dict)
    lists = list(prefix_dict.values())
    for key, value in zip(keys, lists):
        if not isinstance(key, str):
            raise DescriptorError(f"prefix dict: key {key!r} is {type(key).__name__}, not a string")
        if not isinstance(value, (list, tuple)):
            raise DescriptorError(f"prefix dict: candidates of {key!r} must be a list of token ids, got "
                                  f"{type(value).__name__}")
    lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    offsets = np.zeros(len(lists) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = list(itertools.chain.from_iterable(lists))
    types = set(map(type, flat))
    if any(t in (bool, np.bool_) or not issubclass(t, (int, np.integer)) for t in types):
        for key, value in zip(keys, lists):
            for tok in value:
                if not _is_int(tok):
                    raise DescriptorError(f"prefix dict: candidates of {key!r} holds {tok!r}, not an integer token id")
    try:
        values = np.array(flat, dtype=np.int64)
    except OverflowError:  # an id beyond int64: keep it out of range (it is skipped like any id beyond int32)
        big = 1 << 62
        values = np.array([min(max(int(v), -big), big) for v in flat], dtype=np.int64)
    return _Parsed(
        start=ids["start_token_id"],
        end=ids["end_token_id"],
        sep=sep,
        keys=keys,
        index={k: i for i, k in enumerate(keys)},
        values=values,
        offsets=offsets,
        defaulted=defaulted,
        ignored=sorted(str(k) for k in data if k not in _FIELDS),
    )


def _key_tables(p: _Parsed, vocab_size: int) -> _Tables:
    k = len(p.keys)
    key_of = np.repeat(np.arange(k, dtype=np.int64), np.diff(p.offsets))
    usable = (p.values >= 0) & (p.values <= INT32_MAX)
    n_usable = np.bincount(key_of[usable], minlength=k)
    keep = usable & (p.values < vocab_size)
    packed = np.unique(key_of[keep] * _SHIFT + p.values[keep])
    akey, atok = packed // _SHIFT, packed % _SHIFT
    ptr = np.searchsorted(akey, np.arange(k + 1, dtype=np.int64))
    has_end = np.zeros(k, dtype=bool)
    has_end[akey[atok == p.end]] = True
    return _Tables(
        key_of=key_of,
        usable=usable,
        allowed_ptr=ptr,
        allowed_tok=atok,
        no_candidates=n_usable == 0,
        allows_nothing=(n_usable > 0) & (np.diff(ptr) == 0),
        has_end=has_end,
    )


def _walk(p: _Parsed, t: _Tables, max_nodes: int) -> _Walk:
    """Follow RTP-LLM's TreeDFA from the start key over every allowed token, one depth at a time.

    A state with a key allows that key's tokens (the end token alone when it has none, nothing when all are outside
    the vocabulary); a token whose key ``state + sep + token`` exists leads to that key; any other token leads to
    RTP-LLM's error state, where only the end token is allowed: a leaf of the trie. The end token ends the walk
    (its node is terminal). Each reached path is one trie node, so a key that two paths spell (possible only when
    ``sep`` holds digits) is expanded twice, exactly as RTP-LLM would follow it.
    """
    k = len(p.keys)
    sep, end, get = p.sep, p.end, p.index.get
    # Per key, plus one last row (index k) for a missing key: no candidates, so the end token only.
    terminal_key = np.append(t.no_candidates | t.allows_nothing | t.has_end, True)
    ends_here = np.append(t.no_candidates | t.has_end, True)  # the end token is allowed (RTP-LLM appends it to the key)
    allows_nothing = np.append(t.allows_nothing, False)
    allowed_ptr = np.append(t.allowed_ptr, t.allowed_ptr[-1])
    root = str(p.start)
    walk = _Walk(
        parent=np.empty(0, np.int64), token=np.empty(0, np.int64), level_ptr=[0, 1],
        terminal=np.empty(0, np.int64), visits=np.zeros(k, dtype=np.int64),
    )
    parents, tokens, terminal = [np.array([-1])], [np.array([-1])], []
    f_nodes = np.zeros(1, dtype=np.int64)
    f_keys = np.array([get(root, -1)], dtype=np.int64)
    f_strs = [root]
    next_id = 1
    while len(f_nodes):
        present = f_keys >= 0  # only the start key can be missing: a missing child key is an error leaf
        kk = np.where(present, f_keys, k)
        walk.visits += np.bincount(f_keys[present], minlength=k)
        terminal.append(f_nodes[terminal_key[kk]])
        for i in np.flatnonzero(ends_here[kk]):
            after = f_strs[i] + sep + str(end)
            if after in p.index:
                walk.after_end.append(after)
        if len(walk.nothing) < _EXAMPLES:
            walk.nothing += [f_strs[i] for i in np.flatnonzero(allows_nothing[kk])[:_EXAMPLES]]
        lo = allowed_ptr[kk]
        counts = allowed_ptr[kk + 1] - lo
        total = int(counts.sum())
        pos = np.repeat(np.arange(len(f_nodes), dtype=np.int64), counts)
        tok = t.allowed_tok[lo[pos] + np.arange(total, dtype=np.int64) - (np.cumsum(counts) - counts)[pos]]
        keep = tok != end
        pos, tok = pos[keep], tok[keep]
        n = len(tok)
        if n == 0:
            break
        ids = np.arange(next_id, next_id + n, dtype=np.int64)
        next_id += n
        if next_id > max_nodes:
            raise DescriptorError(
                f"prefix dict: following the candidates gives more than {max_nodes:,} trie nodes; with sep "
                f"{sep!r} one key can be spelled by several token paths, and this dictionary's paths multiply"
            )
        parents.append(f_nodes[pos])
        tokens.append(tok)
        strs = [f_strs[a] + sep + str(b) for a, b in zip(pos.tolist(), tok.tolist())]
        child_key = np.fromiter((get(s, -1) for s in strs), dtype=np.int64, count=n)
        error = child_key < 0
        terminal.append(ids[error])
        n_error = int(np.count_nonzero(error))
        if n_error:
            for i in np.flatnonzero(error)[: 2 * _EXAMPLES]:
                if len(walk.missing) < _EXAMPLES:
                    example = f"candidate {int(tok[i])} of {f_strs[pos[i]]!r} -> {strs[i]!r}"
                    walk.missing += [] if example in walk.missing else [example]
            walk.num_missing += n_error
        ok = np.flatnonzero(~error)
        f_nodes, f_keys, f_strs = ids[ok], child_key[ok], [strs[i] for i in ok]
        walk.level_ptr.append(next_id)
    walk.parent = np.concatenate(parents)
    walk.token = np.concatenate(tokens)
    walk.terminal = np.sort(np.concatenate(terminal))
    return walk


def _entries(walk: _Walk, end: int) -> RaggedTokens:
    """The token path of every terminal node (vectorized: one pass per depth), in node order. A terminal root (the
    end token allowed right after the start token) becomes the one-token entry ``[end]``."""
    nodes = walk.terminal[walk.terminal > 0]
    paths = token_paths(nodes, walk.parent, walk.token, np.asarray(walk.level_ptr))
    if len(nodes) == len(walk.terminal):
        return paths
    values = np.concatenate([np.array([end], dtype=np.int64), paths.values])
    return RaggedTokens(values, np.concatenate([np.zeros(1, dtype=np.int64), paths.offsets + 1]))


def _examples(items: list[str], count: int) -> str:
    shown = ", ".join(items[:_EXAMPLES])
    return f"{shown}, ..." if count > _EXAMPLES else shown


def _strict_problems(p: _Parsed, t: _Tables, walk: _Walk, vocab_size: int) -> list[str]:
    """Everything RTP-LLM accepts without a word, one line per kind (with a count and examples)."""
    out: list[str] = []
    keys, values, key_of = p.keys, p.values, t.key_of
    for name in p.defaulted:
        out.append(f"{name} is missing (RTP-LLM silently uses {RTP_DEFAULTS[name]})")
    if p.ignored:
        out.append(f"fields this reader ignores: {p.ignored} (RTP-LLM ignores them too, or reads logit weights "
                   "from them in some versions)")
    if p.end == 0:
        out.append("end_token_id is 0: RTP-LLM's TreeDFA starts with ten 0 tokens in its history, so it counts "
                   "itself finished from the first step and never leaves the start key")
    if p.start == p.end:
        out.append(f"start_token_id and end_token_id are both {p.start}")
    if p.start >= vocab_size:
        out.append(f"start_token_id {p.start} is outside the vocabulary [0, {vocab_size})")
    if any(c.isdigit() for c in p.sep):
        out.append(f"sep {p.sep!r} holds a digit: one key can spell several token paths")
    root = str(p.start)
    if root not in p.index:
        out.append(f"the start key {root!r} is missing: RTP-LLM allows only the end token")
    if walk.terminal[:1].tolist() == [0] and root in p.index:
        out.append(f"the end token is allowed right after the start token (key {root!r}): an empty answer "
                   f"(the trie stores it as the one-token entry [{p.end}])")

    def per_id(mask: np.ndarray, what: str) -> None:
        idx = np.flatnonzero(mask)
        if len(idx):
            shown = [f"{keys[key_of[i]]!r}: {int(values[i])}" for i in idx[:_EXAMPLES]]
            out.append(f"{len(idx)} {what}, e.g. {_examples(shown, len(idx))}")

    def per_key(idx: Any, what: str) -> None:
        if len(idx):
            shown = [repr(keys[i]) for i in idx[:_EXAMPLES]]
            out.append(f"{len(idx)} {what}, e.g. {_examples(shown, len(idx))}")

    per_id(values < 0, "negative candidate ids (RTP-LLM skips them)")
    per_id(values > INT32_MAX, "candidate ids beyond int32 (RTP-LLM skips them)")
    per_id(t.usable & (values >= vocab_size),
           f"candidate ids outside the vocabulary [0, {vocab_size}) (RTP-LLM skips them when it masks)")
    usable_idx = np.flatnonzero(t.usable)
    packed, first, counts = np.unique(key_of[usable_idx] * _SHIFT + values[usable_idx], return_index=True,
                                      return_counts=True)
    if np.any(counts > 1):
        rep = usable_idx[first[counts > 1]]
        shown = [f"{keys[key_of[i]]!r}: {int(values[i])}" for i in rep[:_EXAMPLES]]
        out.append(f"{int((counts - 1).sum())} repeated candidates (RTP-LLM keeps one), e.g. "
                   f"{_examples(shown, len(rep))}")
    per_key(np.flatnonzero(t.no_candidates), "keys without a usable candidate ([] or only skipped ids; RTP-LLM "
            "allows only the end token there)")
    nothing = np.flatnonzero(t.allows_nothing & (walk.visits > 0))
    if len(nothing):
        out.append(f"{len(nothing)} reachable keys allow no token inside the vocabulary (RTP-LLM masks every logit; "
                   f"the trie allows the end token), e.g. {_examples([repr(s) for s in walk.nothing], len(nothing))}")
    if walk.num_missing:
        out.append(f"{walk.num_missing} candidates lead to a missing key (RTP-LLM then allows only the end token), "
                   f"e.g. {_examples(walk.missing, walk.num_missing)}")
    after = sorted(set(walk.after_end))
    if after:
        out.append(f"{len(after)} keys continue after the end token (RTP-LLM allows their candidates once the end "
                   f"token is out; the trie allows only the end token), e.g. "
                   f"{_examples([repr(s) for s in after], len(after))}")
    after_idx = {p.index[s] for s in after}
    per_key([i for i in np.flatnonzero(walk.visits == 0).tolist() if i not in after_idx],
            f"keys are not reachable from the start key {root!r} through candidates (RTP-LLM never uses them)")
    per_key(np.flatnonzero(walk.visits > 1), "keys are spelled by more than one token path")
    return out


def trie_from_prefix_dict(
    payload: JsonSource, vocab_size: int, *, strict: bool = False, fingerprint: str = ""
) -> TokenTrie:
    """Build a :class:`TokenTrie` from an RTP-LLM prefix dictionary, with RTP-LLM's semantics.

    The trie allows, after every token path, exactly the tokens RTP-LLM's ``TreeDFA`` allows (masking with
    ``TrieConstraint`` and ``SpanRules(end_token_id=<the dict's end_token_id>)``, ``on_complete="eos"``): an
    entry is a token path after which the end token is allowed. Read the way RTP-LLM reads it:

    - the state is the key ``start + sep + t1 + sep + t2 ...``; the start token is never generated;
    - a state allows its candidates (repeats merged; negative and beyond-int32 ids skipped; ids outside
      ``[0, vocab_size)`` skipped); a missing key, ``[]`` or a list of skipped ids allows the end token only;
    - after a candidate whose key is missing (RTP-LLM's error state) only the end token may follow;
    - the end token among the candidates ends an entry there; keys not reachable from the start are unused.

    Where a trie cannot say what RTP-LLM does, it says the closest thing (``docs/trie-format.md``): a key whose
    ids are all outside the vocabulary allows nothing in RTP-LLM and the end token here; the end token right after
    the start token is the one-token entry ``[end]``; keys after the end token and RTP-LLM's ``end_token_id == 0``
    quirk are not reproduced. ``strict=True`` refuses all of these.

    Args:
        payload: the dict, JSON text, or a path to a JSON file.
        vocab_size: the model's logits width; every id of the trie is below it.
        strict: raise :class:`DescriptorError` listing everything RTP-LLM would accept silently: missing
            ``start_token_id``/``end_token_id`` (RTP-LLM defaults to 225 and 2), a missing start key, empty or
            skipped candidate lists, negative, beyond-int32, out-of-vocabulary or repeated ids, candidates without
            a key, unreachable keys, keys after the end token, the end token right after the start, ``end_token_id``
            0, a start equal to the end, an ambiguous ``sep``, and top-level fields this reader ignores.
        fingerprint: the tokenizer's fingerprint, if known (recorded in the trie).

    Raises:
        DescriptorError: not a JSON object, ``prefix_dict`` missing or not an object, a candidate list that is
            not a list of integers, ``start_token_id``/``end_token_id`` not integers, ``sep`` not a non-empty
            string (RTP-LLM's loader refuses these too); with ``strict=True``, any of the cases above; ``strict``
            that is not a bool.
        InvalidTokenError: ``vocab_size`` not in [1, 2**31]; ``start_token_id`` or ``end_token_id`` negative or
            beyond int32; ``end_token_id`` outside the vocabulary.
        InvalidEntryError: a ``fingerprint`` that is not a string.

    Example:
        >>> from trie_decode.descriptors import trie_from_prefix_dict
        >>> rtp = {"start_token_id": 225, "end_token_id": 2,
        ...        "prefix_dict": {"225": [64000, 64003, 64006], "225_64003": [64001, 64004], "225_64003_64001": [2]}}
        >>> sorted(trie_from_prefix_dict(rtp, vocab_size=70000).sequences())
        [(64000,), (64003, 64001), (64003, 64004), (64006,)]
    """
    vocab_size = check_vocab_size(vocab_size, VOCAB_SIZE)
    check_fingerprint(fingerprint)
    if not isinstance(strict, (bool, np.bool_)):  # "no" or "false" would read as True
        raise DescriptorError(f"strict must be True or False, got {type(strict).__name__} {strict!r:.40}")
    parsed = _parse_prefix_dict(payload)
    if parsed.end >= vocab_size:
        raise InvalidTokenError(f"prefix dict: end_token_id {parsed.end} is outside the vocabulary [0, {vocab_size})")
    tables = _key_tables(parsed, vocab_size)
    # Without ambiguous keys there is at most one node per candidate id; past 8x that, paths are multiplying.
    walk = _walk(parsed, tables, max_nodes=max(8 * (len(parsed.values) + 1), 1 << 20))
    if strict:
        problems = _strict_problems(parsed, tables, walk, vocab_size)
        if problems:
            raise DescriptorError(
                f"prefix dict (strict): {len(problems)} kind{'s' if len(problems) > 1 else ''} of input RTP-LLM "
                "accepts silently:\n  - "
                + "\n  - ".join(problems)
            )
    options: dict[str, Any] = {
        "source": "rtp_llm_prefix_dict",
        "start_token_id": parsed.start,
        "end_token_id": parsed.end,
        "sep": parsed.sep,
        "strict": bool(strict),
    }
    if walk.terminal[:1].tolist() == [0]:
        options["end_at_start"] = True
    return TokenTrie.from_sequences(_entries(walk, parsed.end), vocab_size, fingerprint=fingerprint, options=options)
