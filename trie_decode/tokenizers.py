"""Tokenizer helpers: the vocabulary fingerprint, each token's bytes, and tokenization of entry strings in context.

Why this exists: a trie is a set of token ids, meaningless under any other tokenizer. Every trie records a
fingerprint of the vocabulary it was built with, and every consumer (processor, vLLM, ``TokenTrie.load``) checks
it, so a mismatch is an error at construction instead of garbage at generation time. The fingerprint hashes what
each id *means* (its bytes), not how a loader spells it, so the same model files give the same fingerprint through
any loader (a Hugging Face fast tokenizer, ``MistralCommonBackend``, a converted tiktoken or SentencePiece file).

The second half is tokenization: a model writes an entry with different ids depending on what precedes it
(``"France"`` vs ``" France"``, SentencePiece's dummy prefix ``"▁"``). :func:`tokenize_in_context` returns the ids
the tokenizer produces for an entry *after a given text*, which is what the model writes there.

Only duck typing is used (``get_vocab``, ``__call__``, ``len``, a fast tokenizer's ``backend_tokenizer``): the core
never imports transformers.

Example:
    >>> from tokenizers import Tokenizer, models, pre_tokenizers
    >>> from transformers import PreTrainedTokenizerFast
    >>> backend = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    >>> backend.pre_tokenizer = pre_tokenizers.Whitespace()
    >>> tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    >>> token_bytes(tok)
    [b'[UNK]', b'a', b'b']
    >>> len(tokenizer_fingerprint(tok))
    32
    >>> tokenize_in_context(["b", "a b"], tok, "a")   # after the word "a", the model writes " b" and " a b"
    [[2], [1, 2]]
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from typing import Any, Callable, Collection, Optional, Sequence

import numpy as np

from .entries import entry_strings, utf8_bytes
from .errors import InvalidEntryError, TrieDecodeError
from .options import (
    KEYWORDS,
    NORMAL_FORMS,
    OptionNames,
    check_normalize,
    check_on_unstable,
    check_on_unstable_context,
)

__all__ = [
    "tokenizer_fingerprint",
    "legacy_tokenizer_fingerprint",
    "fingerprint_matches",
    "tokenizer_vocab_size",
    "tokenize_strings",
    "tokenize_in_context",
    "separator_after",
    "special_token_strings",
    "markup_ids",
    "ends_with_special_token",
    "token_bytes",
    "byte_scheme",
    "byte_piece_ids",
    "spelling_ids",
    "encode_texts",
    "normalize_strings",
    "ContextError",
    "NORMAL_FORMS",
    "SPACE_ANCHOR",
    "LINE_ANCHOR",
]

#: The text an entry is tokenized after for ``leading_space=True`` (as ``" " + entry``): a word.
SPACE_ANCHOR = "x"
#: The text an entry is tokenized after for ``leading_space=False``: a newline (the entry starts a line).
LINE_ANCHOR = "\n"

_CACHE: dict[int, tuple[Any, int, str]] = {}
_BYTES_CACHE: dict[int, tuple[Any, int, tuple[np.ndarray, bytes, Optional[list[bytes]]]]] = {}
_SPECIAL_CACHE: dict[int, tuple[Any, int, frozenset[str]]] = {}
_MARKUP_CACHE: dict[int, tuple[Any, int, frozenset[int]]] = {}


def _cached(cache: dict, tokenizer: Any, size: int, build: Callable[[], Any]) -> Any:
    """``build()`` for ``tokenizer``, kept in ``cache`` per tokenizer object and rebuilt when ``size`` changes."""
    cached = cache.get(id(tokenizer))
    if cached is not None and cached[0] is tokenizer and cached[1] == size:
        return cached[2]
    value = build()
    cache[id(tokenizer)] = (tokenizer, size, value)
    return value


class ContextError(TrieDecodeError, ValueError):
    """The text before the entries merges with them: the context's own tokens change when an entry follows.

    Typical causes: a prompt that ends with a space (the model writes the space *inside* the entry's first token,
    ``" France"``), or a prompt whose last character glues to the entry (``'"'`` before a name in Llama 3's
    pre-tokenizer). The message names the first entry affected and the fix, with ``from_strings``' keywords
    (``context=``, ``leading_space=True``, ``on_unstable='raw'``); :meth:`message_for` spells the fix for another
    front door (the command line's ``--context``, ``--leading-space``, ``--on-unstable raw``).
    """

    def __init__(self, message: str, *, details: Optional[tuple] = None) -> None:
        super().__init__(message)
        self.details = details  # (context, entry, index, context ids, ids with the entry): for message_for

    def message_for(self, names: OptionNames) -> str:
        """The message, its fix naming the options as ``names`` spells them (:data:`~trie_decode.options.FLAGS`)."""
        return _unstable_message(*self.details, names) if self.details is not None else str(self)


# ---------------------------------------------------------------------------------------------------------------
# Each token's bytes


def byte_decoder_table() -> dict[int, int]:
    """GPT-2's byte-level alphabet, inverted (code point of a printable stand-in -> its byte); shared with the
    benchmark's outlines-core vocabulary."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {c: b for b, c in zip(bs, cs)}


_BYTE_DECODER = byte_decoder_table()
_BYTE_ENCODER = {b: chr(c) for c, b in _BYTE_DECODER.items()}
_TO_LATIN1 = str.maketrans({c: chr(b) for c, b in _BYTE_DECODER.items()})
_BYTE_PIECES = {f"<0x{b:02X}>": bytes([b]) for b in range(256)}


def byte_scheme(tokenizer: Any) -> str:
    """How a tokenizer's token strings map to bytes: ``"bytelevel"`` (GPT-2 style: SmolLM2, Llama 3, Qwen, DeepSeek,
    Tekken), ``"sentencepiece"`` (``"▁"`` for a space, ``<0xNN>`` byte-fallback pieces: Llama 2, Mistral, Gemma),
    ``"mistral-common"`` (a ``MistralCommonBackend``, read through mistral_common) or ``"text"`` (token strings are
    the text itself, e.g. WordPiece).

    Example:
        >>> byte_scheme(object())
        'text'
    """
    if _mistral_inner(tokenizer) is not None:
        return "mistral-common"
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None) if backend is not None else None
    if decoder is not None:
        try:
            spec = decoder.__getstate__()
            spec = spec.decode("utf-8") if isinstance(spec, bytes) else str(spec)
        except Exception:  # noqa: BLE001 - an exotic decoder: fall back to its class name
            spec = type(decoder).__name__
        if "ByteLevel" in spec:
            return "bytelevel"
        if "ByteFallback" in spec or "Metaspace" in spec or "\u2581" in spec or "\\u2581" in spec:
            return "sentencepiece"
    return "text"


def _mistral_inner(tokenizer: Any) -> Any:
    """The mistral_common tokenizer (Tekkenizer or SentencePieceTokenizer) inside a ``MistralCommonBackend``."""
    inner = getattr(getattr(getattr(tokenizer, "tokenizer", None), "instruct_tokenizer", None), "tokenizer", None)
    return inner if inner is not None and hasattr(inner, "n_words") else None


def added_tokens_decoder(tokenizer: Any) -> dict[int, Any]:
    """The tokenizer's ``added_tokens_decoder`` (id -> ``AddedToken`` or text), or {} where it has none: a
    ``MistralCommonBackend`` exposes it as a method that raises (its special tokens are ``all_special_tokens``)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    if callable(decoder):
        try:
            decoder = decoder()
        except Exception:  # noqa: BLE001 - not implemented by this loader
            decoder = None
    return decoder if isinstance(decoder, dict) else {}


def _added_tokens(tokenizer: Any) -> dict[int, str]:
    return {int(i): str(getattr(t, "content", t)) for i, t in added_tokens_decoder(tokenizer).items()}


def _mistral_bytes(inner: Any) -> list[bytes]:
    n = int(inner.n_words)
    model = getattr(inner, "_model", None)
    num_special = int(getattr(inner, "num_special_tokens", 0) or 0)
    ranks = getattr(model, "_mergeable_ranks", None)
    if isinstance(ranks, dict) and num_special:  # Tekken: a tiktoken encoding behind the special tokens
        out = [b""] * n
        for i in range(num_special):
            out[i] = str(inner.id_to_piece(i)).encode("utf-8")
        for piece, rank in ranks.items():
            if 0 <= rank + num_special < n:
                out[rank + num_special] = bytes(piece)
        return out
    if model is not None and hasattr(model, "is_byte"):  # SentencePiece
        pieces = [model.id_to_piece(i) for i in range(n)]
        out = []
        for i, p in enumerate(pieces):
            if model.is_byte(i) and p in _BYTE_PIECES:
                out.append(_BYTE_PIECES[p])
            elif model.is_control(i) or model.is_unknown(i):
                out.append(p.encode("utf-8"))
            else:
                out.append(p.replace("\u2581", " ").encode("utf-8"))
        return out
    from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy  # pragma: no cover - other backends

    return [bytes(inner.id_to_byte_piece(i, SpecialTokenPolicy.KEEP)) for i in range(n)]  # pragma: no cover


def byte_piece_ids(tokenizer: Any, ids: Sequence[int]) -> list[int]:
    """Of ``ids``, the byte-fallback pieces (``<0xNN>``: SentencePiece tokenizers such as Llama 2, Mistral v1/v3 and
    Gemma): tokens whose bytes an ordinary piece often spells too, and which the tokenizer (and so the model) only
    writes for bytes no other piece spells. Empty for other tokenizers.

    Example:
        >>> byte_piece_ids(object(), [1, 2])
        []
    """
    scheme = byte_scheme(tokenizer)
    ids = [int(i) for i in ids]
    if scheme == "mistral-common":
        model = getattr(_mistral_inner(tokenizer), "_model", None)
        is_byte = getattr(model, "is_byte", None)
        return [i for i in ids if 0 <= i < int(model.get_piece_size()) and is_byte(i)] if is_byte else []
    if scheme != "sentencepiece":
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    id_to_token = backend.id_to_token if backend is not None and hasattr(backend, "id_to_token") else (
        lambda i: tokenizer.convert_ids_to_tokens(i))
    added = _added_tokens(tokenizer)
    return [i for i in ids if i not in added and id_to_token(i) in _BYTE_PIECES]


def _token_strings(tokenizer: Any, n: int) -> list[Optional[str]]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "id_to_token"):
        id_to_token = backend.id_to_token
        return [id_to_token(i) for i in range(n)]
    vocab = tokenizer.get_vocab()
    out: list[Optional[str]] = [None] * n
    for t, i in vocab.items():
        if 0 <= int(i) < n:
            out[int(i)] = str(t)
    return out


def token_bytes(tokenizer: Any) -> list[bytes]:
    """The bytes each token id stands for, by id (``b""`` for an id with no token).

    Ordinary tokens give the bytes they decode to (a byte-level token its bytes, a SentencePiece piece its text
    with ``"▁"`` as a space, a ``<0xNN>`` byte-fallback piece its byte); added and special tokens give their text.
    The result is the same whichever loader read the model files (a fast tokenizer, ``MistralCommonBackend``).
    Cached per tokenizer object (recomputed when its length changes).

    Example:
        >>> from transformers import AutoTokenizer                         # doctest: +SKIP
        >>> from trie_decode.integrations.smollm2 import smollm2_path      # doctest: +SKIP
        >>> tok = AutoTokenizer.from_pretrained(smollm2_path())             # doctest: +SKIP
        >>> token_bytes(tok)[tok.convert_tokens_to_ids("ĠParis")]          # doctest: +SKIP
        b' Paris'
    """
    lengths, blob, parts = _bytes_table(tokenizer)
    if parts is None:  # byte-level: sliced from the one decoded blob on first use
        ends = np.cumsum(lengths).tolist()
        parts = [blob[a:b] for a, b in zip([0] + ends[:-1], ends)]
        _BYTES_CACHE[id(tokenizer)] = _BYTES_CACHE[id(tokenizer)][:2] + ((lengths, blob, parts),)
    return parts


def _bytes_table(tokenizer: Any) -> tuple[np.ndarray, bytes, Optional[list[bytes]]]:
    """(byte length of each id, all ids' bytes concatenated, the per-id list if already built); cached."""
    size = tokenizer_vocab_size(tokenizer)
    return _cached(_BYTES_CACHE, tokenizer, size, lambda: _build_bytes_table(tokenizer, size))


def _build_bytes_table(tokenizer: Any, size: int) -> tuple[np.ndarray, bytes, Optional[list[bytes]]]:
    scheme = byte_scheme(tokenizer)
    out: Optional[list[bytes]] = None
    if scheme == "mistral-common":
        out = _mistral_bytes(_mistral_inner(tokenizer))
        out += [b""] * (size - len(out))
    else:
        pieces = _token_strings(tokenizer, size)
        added = _added_tokens(tokenizer)
        if scheme == "bytelevel":
            # Added tokens hold plain text: re-spell them in the byte-level alphabet so that one translate() over
            # the whole vocabulary decodes everything (a per-token loop costs 3x more).
            for i, content in added.items():
                if 0 <= i < size:
                    pieces[i] = "".join(_BYTE_ENCODER[b] for b in content.encode("utf-8"))
            texts = [p or "" for p in pieces]
            try:
                blob = "".join(texts).translate(_TO_LATIN1).encode("latin-1")
                return np.fromiter(map(len, texts), dtype=np.int64, count=size), blob, None
            except UnicodeEncodeError:  # a piece outside the byte-level alphabet: decode what can be decoded
                out = [bytes(_BYTE_DECODER.get(ord(c), 0) for c in t) for t in texts]
        else:
            if scheme == "sentencepiece":  # "▁" for a space, <0xNN> byte-fallback pieces
                out = [_BYTE_PIECES[p] if p in _BYTE_PIECES else (p or "").replace("\u2581", " ").encode("utf-8")
                       for p in pieces]
            else:
                out = [(p or "").encode("utf-8") for p in pieces]
            for i, content in added.items():  # added and special tokens: their text
                if 0 <= i < size:
                    out[i] = content.encode("utf-8")
    return np.fromiter(map(len, out), dtype=np.int64, count=len(out)), b"".join(out), out


# ---------------------------------------------------------------------------------------------------------------
# Fingerprints


def _require_get_vocab(tokenizer: Any) -> None:
    """Raise ``TypeError`` unless ``tokenizer`` has ``get_vocab`` (a Hugging Face-style tokenizer; not its name)."""
    if not hasattr(tokenizer, "get_vocab"):
        raise TypeError(f"expected a Hugging Face tokenizer with get_vocab(), got {type(tokenizer).__name__}")


def _size_key(tokenizer: Any) -> int:
    return len(tokenizer) if hasattr(tokenizer, "__len__") else -1


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short, stable hash of a tokenizer's vocabulary: the bytes of every token id, in id order.

    Two tokenizers with the same fingerprint give every id the same meaning, whichever loader read them (a Hugging
    Face fast tokenizer and ``MistralCommonBackend`` over the same Mistral files agree, although the latter's
    ``get_vocab`` is lossy). Adding a token changes it. ~20-50 ms for a 50k vocabulary (one pass over the token
    strings); cached per tokenizer object (recomputed if its length changes).

    Tries saved before this version recorded :func:`legacy_tokenizer_fingerprint`; :func:`fingerprint_matches`
    (used by ``TokenTrie.check_tokenizer`` and ``TokenTrie.load``) accepts both.

    Raises:
        TypeError: not a tokenizer (no ``get_vocab``).
    """

    def build() -> str:
        lengths, blob, _ = _bytes_table(tokenizer)  # TypeError for what has no get_vocab (tokenizer_vocab_size)
        h = hashlib.sha256(b"trie_decode token bytes v2\0")
        h.update(lengths.astype("<i8").tobytes())
        h.update(blob)
        return h.hexdigest()[:32]

    return _cached(_CACHE, tokenizer, _size_key(tokenizer), build)


def legacy_tokenizer_fingerprint(tokenizer: Any) -> str:
    """The fingerprint tries recorded before token-bytes fingerprints: a hash of ``get_vocab()`` (string -> id).

    Kept so that old trie files still load with the tokenizer they were built with; ~0.3 s for 50k tokens.
    """
    _require_get_vocab(tokenizer)
    items = sorted((int(i), str(t)) for t, i in tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode("utf-8")).hexdigest()[:32]


def fingerprint_matches(fingerprint: str, tokenizer: Any) -> bool:
    """Whether a recorded fingerprint is ``tokenizer``'s: the current one, or the legacy one of older tries.

    Example:
        >>> from tokenizers import Tokenizer, models
        >>> from transformers import PreTrainedTokenizerFast
        >>> tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")))
        >>> fingerprint_matches(tokenizer_fingerprint(tok), tok), fingerprint_matches(legacy_tokenizer_fingerprint(tok), tok)
        (True, True)
        >>> fingerprint_matches("0" * 32, tok)
        False
    """
    if fingerprint == tokenizer_fingerprint(tokenizer):
        return True
    return fingerprint == legacy_tokenizer_fingerprint(tokenizer)


def tokenizer_vocab_size(tokenizer: Any) -> int:
    """Number of token ids the tokenizer can produce (base vocabulary plus added tokens): the largest id + 1.

    This is the tokenizer's width, which may exceed the model's logits (Llama 3.2 ships 128,257 ids for 128,256
    logits); the constraint accepts narrower logits as long as every trie token and the end token fit.

    Raises:
        TypeError: not a tokenizer (no ``get_vocab``; e.g. its name, whose ``len`` is the name's length).
    """
    _require_get_vocab(tokenizer)
    size = len(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "get_vocab_size"):
        # A fast tokenizer: its sizes and added ids, without building the whole string -> id dict (~5x faster).
        size = max(size, int(backend.get_vocab_size(with_added_tokens=True)))
        added = _added_tokens(tokenizer)
        if added:
            size = max(size, max(added) + 1)
        return int(size)
    vocab = tokenizer.get_vocab()
    if vocab:
        size = max(size, max(vocab.values()) + 1)
    return int(size)


# ---------------------------------------------------------------------------------------------------------------
# Tokenization


#: ``TokenTrie.from_strings``'s keywords; a bad one is an :class:`InvalidEntryError` (how the entries are read).
_ENTRY_OPTIONS = OptionNames(error=InvalidEntryError)


def normalize_strings(strings: Sequence[str], normalize: Optional[str]) -> list[str]:
    """``strings`` in Unicode normal form ``normalize`` (None: unchanged).

    Raises:
        InvalidEntryError: ``normalize`` is not one of :data:`NORMAL_FORMS`.

    Example:
        >>> normalize_strings(["Co\\u0302te"], "NFC") == ["C\\u00f4te"]
        True
    """
    if check_normalize(normalize, _ENTRY_OPTIONS) is None:
        return list(strings)
    return [unicodedata.normalize(normalize, s) for s in strings]


def encode_texts(tokenizer: Any, texts: Sequence[str], *, text_only: bool = False) -> list[list[int]]:
    """Token ids of each text, without special tokens, in one batched call (any Hugging Face-style tokenizer);
    with ``text_only``, a special token's text in a text is read as text (``split_special_tokens``), as a model
    writes it (``MistralCommonBackend`` always reads it so, and refuses the keyword)."""
    if not texts:
        return []
    split = {"split_special_tokens": True} if text_only and byte_scheme(tokenizer) != "mistral-common" else {}
    encoded = tokenizer(list(texts), add_special_tokens=False, **split)
    ids = encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded
    return [[int(t) for t in x] for x in ids]


_NO_SPACE_AFTER = frozenset("\"'([{<`/\u00ab\u201c\u2018")


def separator_after(context: str) -> str:
    """The text a model writes between ``context`` and an entry: ``" "`` after a word or punctuation that ends a
    phrase (``"The answer is"``, ``"Answer:"``, ``"[/INST]"``), ``""`` at the start of a text, after whitespace (a
    newline, a chat header ending with one) and after an opening quote or bracket (``'"'``, ``"("``).

    Chinese and Japanese put no space between words: none after a wide letter, digit or punctuation mark
    (``"答案是"``, ``"答え："``); Korean, which does, gets one after Hangul.

    Example:
        >>> [separator_after(c) for c in ("The answer is", "Answer:", "\\n", '"', "", "答案是", "정답은")]
        [' ', ' ', '', '', '', '', ' ']
    """
    if not context or context[-1].isspace() or context[-1] in _NO_SPACE_AFTER:
        return ""
    last = context[-1]
    if (unicodedata.east_asian_width(last) in ("W", "F") and unicodedata.category(last)[0] in "LNP"
            and "HANGUL" not in unicodedata.name(last, "")):
        return ""
    return " "


def tokenize_in_context(
    strings: Sequence[str],
    tokenizer: Any,
    context: str,
    *,
    separator: Optional[str] = None,
    on_unstable: str = "raise",
) -> list[list[int]]:
    """The ids the tokenizer gives each string right after ``context``: the ids a model writes there.

    Each ``context + separator + s`` is tokenized (one batched call) and the context's own ids are cut off the
    front. That holds only when the context's ids are a prefix of the result (a *stable* context); otherwise the
    end of the context and the start of the entry share a token, and the model, having the context's ids in its
    prompt already, cannot write the entry's canonical ids.

    Args:
        strings: the entries' texts.
        tokenizer: a Hugging Face-style tokenizer (``MistralCommonBackend`` included).
        context: the text the entries follow (the end of the prompt, or a trigger). ``""``, or a context that ends
            with a special token (``"[/INST]"``), means the entry starts a text of its own, which for SentencePiece
            tokenizers adds the dummy prefix ``"▁"``.
        separator: the text between context and entry; by default :func:`separator_after` (a space after a word,
            nothing after a newline or an opening quote). Entries that start with whitespace get none.
        on_unstable: ``"raise"`` (:class:`ContextError` naming the first such entry and the fix) or ``"raw"`` (use
            the entry's own tokenization, ``separator + s`` as if the context were absent, for those entries: its ids
            after a newline, so without SentencePiece's dummy-prefix ``"▁"``).

    Raises:
        ContextError: with ``on_unstable="raise"``, the context merges with an entry.

    Example:
        >>> from transformers import AutoTokenizer                                    # doctest: +SKIP
        >>> tok = AutoTokenizer.from_pretrained(smollm2_path())                        # doctest: +SKIP
        >>> tokenize_in_context(["Paris"], tok, "The answer is") == [tok(" Paris")["input_ids"]]  # doctest: +SKIP
        True
        >>> tokenize_in_context(["Paris"], tok, "Answer:\\n") == [tok("Paris")["input_ids"]]         # doctest: +SKIP
        True
    """
    check_on_unstable(on_unstable, _ENTRY_OPTIONS)
    strings = entry_strings(strings)
    texts, split, head = _split_after(strings, tokenizer, context, separator)
    out: list[list[int]] = []
    raw_needed: list[int] = []
    for i, ids in enumerate(split):
        if ids is not None:
            out.append(ids)
            continue
        if on_unstable == "raise":
            details = (context, texts[i], i, head, encode_texts(tokenizer, [context + texts[i]])[0])
            raise ContextError(_unstable_message(*details), details=details)
        out.append([])
        raw_needed.append(i)
    if raw_needed:
        # The entry's own ids: after a newline, which merges with nothing else, so that SentencePiece's dummy prefix
        # adds no "▁" the entry does not have ("▁'Are'are" after '"'); alone where the newline merges with it too.
        own = [texts[i] for i in raw_needed]
        if context == LINE_ANCHOR and separator == "":
            own_ids = [ids or [] for ids in _split_after(own, tokenizer, "", "")[1]]
        else:
            own_ids = tokenize_in_context(own, tokenizer, LINE_ANCHOR, separator="", on_unstable="raw")
        for i, ids in zip(raw_needed, own_ids):
            out[i] = ids
    return out


def spelling_ids(data: bytes, vocab: Sequence[bytes], avoid: Collection[int] = ()) -> Optional[list[int]]:
    """Token ids whose bytes (``vocab``, by id) are exactly ``data``: the longest token at each position (of tokens
    with the same bytes, one not in ``avoid``, such as byte-fallback pieces, then the lowest id); None when no token
    begins the rest. The last resort of callers whose tokenizer's own ids do not spell
    a text (fixed text a normalizer rewrote, a value SentencePiece would open with its dummy-prefix space).

    Example:
        >>> spelling_ids(b"abc", [b"a", b"ab", b"c", b"bc"])
        [1, 2]
    """
    by_bytes: dict[bytes, int] = {}
    for i, b in enumerate(vocab):
        if b and (b not in by_bytes or (by_bytes[b] in avoid and i not in avoid)):
            by_bytes[b] = i
    longest = max(map(len, by_bytes), default=0)
    out, pos = [], 0
    while pos < len(data):
        for n in range(min(longest, len(data) - pos), 0, -1):
            tok = by_bytes.get(data[pos:pos + n])
            if tok is not None:
                out.append(tok)
                pos += n
                break
        else:
            return None
    return out


def special_token_strings(tokenizer: Any) -> frozenset[str]:
    """The text of every special or added token (``all_special_tokens``, ``added_tokens_decoder``); cached.

    Hugging Face tokenizers split text at every added token, special or not (DeepSeek's ``"<｜Assistant｜>"``,
    Gemma's ``"\\n"``), so the text after one is tokenized on its own.
    """

    def build() -> frozenset[str]:
        found = {str(t) for t in (getattr(tokenizer, "all_special_tokens", None) or [])}
        found |= set(_added_tokens(tokenizer).values())
        return frozenset(t for t in found if t)

    return _cached(_SPECIAL_CACHE, tokenizer, _size_key(tokenizer), build)


def ends_with_special_token(tokenizer: Any, context: str) -> bool:
    """Whether ``context`` ends with a special or added token's text (``"[/INST]"``, ``"<｜Assistant｜>"``).

    After a special token the model starts a new segment: chat formats encode the reply on its own (mistral_common
    encodes a Mistral reply with SentencePiece's dummy prefix: ``"▁France"``), and Hugging Face tokenizers split
    text at special tokens. So an entry after one is tokenized as a text of its own.
    """
    return bool(context) and any(context.endswith(t) for t in special_token_strings(tokenizer))


def markup_ids(tokenizer: Any) -> frozenset[int]:
    """Ids whose text is markup, not output text: special ids, added tokens flagged special, unk/bos/eos/pad; cached.

    A fast tokenizer reads such a token's text in its input as the token (``"</s>"`` as the end token), a model
    writes that text with ordinary tokens; non-special added tokens (Gemma's ``"\\n"`` tokens) are text.
    """

    def build() -> frozenset[int]:
        found = {int(i) for i in (getattr(tokenizer, "all_special_ids", None) or [])}
        found |= {int(i) for i, t in added_tokens_decoder(tokenizer).items() if getattr(t, "special", False)}
        for name in ("unk_token_id", "bos_token_id", "eos_token_id", "pad_token_id"):
            try:
                value = getattr(tokenizer, name, None)
            except Exception:  # noqa: BLE001 - some loaders raise for a token they do not have
                value = None
            if isinstance(value, int) and value >= 0:
                found.add(value)
        return frozenset(found)

    return _cached(_MARKUP_CACHE, tokenizer, _size_key(tokenizer), build)


def _split_after(
    strings: Sequence[str], tokenizer: Any, context: str, separator: Optional[str], text_only: bool = False
) -> tuple[list[str], list[Optional[list[int]]], list[int]]:
    """(texts with their separator, in-context ids of each text or None where the context merges, context ids).

    A text that spells a special token's text (``"</s>"``, the HTML tag ``"<s>"``) is text, which the model writes
    with ordinary tokens: where its ids hold a :func:`markup_ids` token, it is tokenized again reading special
    tokens' text as text (``text_only``: see :func:`encode_texts`).
    """
    if not isinstance(context, str):
        raise InvalidEntryError(f"context must be a string (the text the entries follow), got {type(context).__name__}")
    if not context.isascii():  # a lone surrogate (a non-UTF-8 byte of a command line) fails inside the tokenizer
        utf8_bytes(context, "context")
    _require_get_vocab(tokenizer)
    fresh = not context or ends_with_special_token(tokenizer, context)
    if separator is None:
        separator = "" if fresh else separator_after(context)
    texts = [s if s[:1].isspace() else separator + s for s in strings]
    if fresh:
        split: list[Optional[list[int]]] = list(encode_texts(tokenizer, texts, text_only=text_only))
        head: list[int] = []
    else:
        head = encode_texts(tokenizer, [context], text_only=text_only)[0]
        full = encode_texts(tokenizer, [context + t for t in texts], text_only=text_only)
        k = len(head)
        split = [ids[k:] if ids[:k] == head and len(ids) > k else None for ids in full]
    if not text_only:
        markup = markup_ids(tokenizer)
        marked = [i for i, ids in enumerate(split) if ids is not None and not markup.isdisjoint(ids)]
        if marked:
            again = _split_after([strings[i] for i in marked], tokenizer, context, separator, text_only=True)[1]
            for i, ids in zip(marked, again):
                split[i] = ids
    return texts, split, head


def _unstable_message(
    context: str, entry: str, index: int, head: list[int], ids: list[int], names: OptionNames = KEYWORDS
) -> str:
    """:class:`ContextError`'s message; the fix names ``from_strings``' options as ``names`` spells them."""
    stripped = context.rstrip(" \t")
    if stripped != context:
        fix = (
            f"the context ends with whitespace ({context[len(stripped):]!r}); the model writes the space inside the "
            f"entry's first token. End the prompt without it (prompt.rstrip(' ')) and build with "
            f"{names.given('context', stripped[-40:])} or {names.given('leading_space', True)}"
        )
    else:
        fix = (
            f"its last token merges with the entry. Either end the prompt one token earlier and start the entries "
            f"with that text (token healing), or build with {names.given('on_unstable', 'raw')} to keep the entry's "
            "own tokens there (the ids the model writes after the context's own)"
        )
    return (
        f"context {context[-40:]!r} is not a stable prefix of entry {index} ({entry!r:.60}): alone it is {head[-4:]} "
        f"at its end, but followed by the entry it tokenizes to {ids[max(0, len(head) - 4):len(head) + 2]}...: {fix}"
    )


def tokenize_strings(
    strings: Sequence[str],
    tokenizer: Any,
    *,
    leading_space: bool = False,
    context: Optional[str] = None,
    on_unstable: str = "raise",
) -> list[list[int]]:
    """Tokenize entry strings in one batched call, without special tokens, as the model writes them in context.

    Args:
        strings: the entries' texts.
        tokenizer: a Hugging Face tokenizer (a fast one tokenizes a million names in seconds), or a
            ``MistralCommonBackend``.
        leading_space: the form after a word and a space (``"... is France"``: byte-level ``"ĠFrance"``,
            SentencePiece ``"▁France"``); False: the form at the start of a line, i.e. after a newline or a chat
            header that ends with one (``"France"``). Both are computed after an anchor text (:data:`SPACE_ANCHOR`,
            :data:`LINE_ANCHOR`), so SentencePiece's dummy prefix never adds a ``"▁"`` of its own; an entry that
            merges with the anchor keeps its own tokenization (``" " + s`` or ``s``).
        context: instead of ``leading_space``, the exact text the entries follow (see :func:`tokenize_in_context`;
            raises :class:`ContextError` when the context merges with an entry).
        on_unstable: with a ``context``, ``"raise"`` or ``"raw"`` (see :func:`tokenize_in_context`).

    Raises:
        InvalidEntryError: ``leading_space=True`` with a ``context`` (one form per string: ``from_strings`` stores
            several), or ``on_unstable="raw"`` without one.

    Example:
        >>> from transformers import AutoTokenizer                                       # doctest: +SKIP
        >>> tok = AutoTokenizer.from_pretrained(smollm2_path())                           # doctest: +SKIP
        >>> tokenize_strings(["Paris"], tok, leading_space=True) == [tok(" Paris")["input_ids"]]  # doctest: +SKIP
        True
    """
    if not isinstance(leading_space, (bool, np.bool_)):  # "no" would read as True
        raise InvalidEntryError(f"leading_space must be True or False, got {leading_space!r:.40}")
    check_on_unstable(on_unstable, _ENTRY_OPTIONS)
    check_on_unstable_context(on_unstable, context is not None, _ENTRY_OPTIONS)
    if context is not None:
        if leading_space:
            raise InvalidEntryError(f"{_ENTRY_OPTIONS.given('leading_space', True)} and {_ENTRY_OPTIONS('context')}= "
                                    "ask for two forms of each string: give one (TokenTrie.from_strings stores both)")
        return tokenize_in_context(strings, tokenizer, context, on_unstable=on_unstable)
    # An entry that merges with the anchor keeps its own tokenization (of " " + s, or s).
    anchor, separator = (SPACE_ANCHOR, " ") if leading_space else (LINE_ANCHOR, "")
    return tokenize_in_context(strings, tokenizer, anchor, separator=separator, on_unstable="raw")
