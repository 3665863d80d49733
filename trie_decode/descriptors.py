"""Tries from JSON descriptors: the TokenTreePayload format and RTP-LLM's prefix dictionary.

Why this exists: tries are often produced by another system (a retrieval index, a catalogue service, an RTP-LLM
deployment) as JSON. These readers turn them into :class:`~trie_decode.TokenTrie` objects and reject malformed input
with a :class:`~trie_decode.DescriptorError` that names the field and the entry.

TokenTreePayload::

    {"modelId": "...", "descriptors": [{"path": "tools/search", "leaves": [{"name": "web", "tokens": [12, 7]}]}]}

One trie per descriptor ``path``; each leaf is an entry whose name is the leaf's ``name``.

RTP-LLM prefix dictionary::

    {"start_token_id": 225, "end_token_id": 2, "sep": "_",
     "prefix_dict": {"225": [64000, 64003], "225_64000": [2], "225_64003": [64001], "225_64003_64001": [2]}}

Keys are token paths joined by ``sep`` starting at the start token; values list the next tokens, where the end
token marks the end of an entry. The start token is not part of the entries (it is the prompt's last token).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Union

from .errors import DescriptorError, InvalidEntryError, InvalidTokenError
from .trie import TokenTrie

__all__ = ["read_json", "tries_from_token_tree_payload", "trie_from_prefix_dict"]

JsonSource = Union[str, bytes, os.PathLike, dict, list]


def read_json(source: JsonSource, what: str) -> Any:
    """Parse ``source``: an already-parsed object, JSON text, or a path to a JSON file."""
    if isinstance(source, (dict, list)):
        return source
    if isinstance(source, os.PathLike) or (isinstance(source, str) and not source.lstrip().startswith(("{", "["))):
        path = Path(source)
        if not path.is_file():
            raise DescriptorError(f"{what}: no such file {str(path)!r}")
        text = path.read_text(encoding="utf-8")
    elif isinstance(source, bytes):
        text = source.decode("utf-8")
    elif isinstance(source, str):
        text = source
    else:
        raise DescriptorError(f"{what}: expected a dict, JSON text or a file path, got {type(source).__name__}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise DescriptorError(f"{what}: invalid JSON ({exc})") from exc


def _token_list(value: Any, where: str) -> list[int]:
    if not isinstance(value, list):
        raise DescriptorError(f"{where} must be a list of token ids, got {type(value).__name__}")
    for tok in value:
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise DescriptorError(f"{where} holds {tok!r}, not an integer token id")
    return value


def tries_from_token_tree_payload(payload: JsonSource, vocab_size: int, *, fingerprint: str = "") -> dict[str, TokenTrie]:
    """Build one :class:`TokenTrie` per descriptor path of a TokenTreePayload.

    Raises:
        DescriptorError: not an object, ``descriptors`` missing or empty, a descriptor without ``path`` or with no
            leaves, a leaf without ``name`` or ``tokens``, a duplicated path.
        InvalidTokenError / InvalidEntryError: as :meth:`TokenTrie.from_sequences` (the message names the entry).
    """
    data = read_json(payload, "TokenTreePayload")
    if not isinstance(data, dict):
        raise DescriptorError(f"TokenTreePayload must be a JSON object, got {type(data).__name__}")
    descriptors = data.get("descriptors")
    if not isinstance(descriptors, list) or not descriptors:
        raise DescriptorError("TokenTreePayload: field 'descriptors' is missing or is not a non-empty list")
    model_id = data.get("modelId")
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


def trie_from_prefix_dict(payload: JsonSource, vocab_size: int, *, fingerprint: str = "") -> TokenTrie:
    """Build a :class:`TokenTrie` from an RTP-LLM prefix dictionary.

    Raises:
        DescriptorError: a missing field, a key that does not start at the start token, a candidate that leads to
            a prefix missing from the dictionary, a reachable prefix with no candidates (no entry reaches the end
            token through it), or keys not reachable from the start token.
    """
    data = read_json(payload, "prefix dict")
    if not isinstance(data, dict):
        raise DescriptorError(f"prefix dict must be a JSON object, got {type(data).__name__}")
    for field in ("start_token_id", "end_token_id", "prefix_dict"):
        if field not in data:
            raise DescriptorError(f"prefix dict: field {field!r} is missing")
    start, end = data["start_token_id"], data["end_token_id"]
    for field, value in (("start_token_id", start), ("end_token_id", end)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise DescriptorError(f"prefix dict: {field} must be an integer, got {value!r}")
    sep = data.get("sep", "_")
    if not isinstance(sep, str) or not sep:
        raise DescriptorError(f"prefix dict: 'sep' must be a non-empty string, got {sep!r}")
    prefix_dict = data["prefix_dict"]
    if not isinstance(prefix_dict, dict):
        raise DescriptorError("prefix dict: 'prefix_dict' must be an object of prefix -> candidate list")
    root_key = str(start)
    if root_key not in prefix_dict:
        raise DescriptorError(f"prefix dict: the start prefix {root_key!r} is missing from 'prefix_dict'")
    sequences: list[list[int]] = []
    # Depth-first over the prefixes reachable from the start token (keys only grow, so no cycles).
    stack: list[tuple[str, list[int]]] = [(root_key, [])]
    reached: set[str] = set()
    while stack:
        key, path = stack.pop()
        reached.add(key)
        candidates = _token_list(prefix_dict[key], f"prefix dict: candidates of {key!r}")
        if not candidates:
            raise DescriptorError(
                f"prefix dict: {key!r} has no candidates, so no entry reaches the end token through it"
            )
        # A repeated candidate would walk the same subtree again (exponentially often if repeated at every depth).
        for tok in dict.fromkeys(candidates):
            if tok == end:
                if not path:
                    raise DescriptorError(f"prefix dict: the end token directly after the start token ({key!r}) "
                                          "would be an empty entry")
                sequences.append(path)
                continue
            child = key + sep + str(tok)
            if child not in prefix_dict:
                raise DescriptorError(f"prefix dict: candidate {tok} of {key!r} leads to {child!r}, which is missing")
            stack.append((child, path + [tok]))
    if not sequences:
        raise DescriptorError("prefix dict: no entry reaches the end token")
    if len(reached) < len(prefix_dict):
        unreachable = sorted(set(prefix_dict) - reached)[:3]
        raise DescriptorError(f"prefix dict: keys not reachable from the start token, e.g. {unreachable}")
    sequences.reverse()
    options = {"source": "rtp_llm_prefix_dict", "start_token_id": start, "end_token_id": end, "sep": sep}
    return TokenTrie.from_sequences(sequences, vocab_size, fingerprint=fingerprint, options=options)
