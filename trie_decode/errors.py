"""Named errors of trie_decode.

Why this exists: a constraint that is built wrong gives wrong answers silently, so every bad input is rejected
early with an error that names the argument, the entry and the value. All errors subclass both ``TrieDecodeError``
(catch-all for this package) and the built-in ``ValueError`` or ``TypeError`` users already catch. A problem has one
class at every front door, even one whose refusals have a class of their own (:func:`raised_as`).
"""

from __future__ import annotations

import functools

__all__ = [
    "TrieDecodeError",
    "EmptyTrieError",
    "InvalidTokenError",
    "InvalidEntryError",
    "DescriptorError",
    "TrieFileError",
    "TokenizerMismatchError",
    "TokenizerNotFoundError",
    "ConstraintConfigError",
    "CatalogUpdateError",
    "FilterSpecError",
    "UnknownEntryError",
    "FilterModeError",
    "EmptyFilterError",
    "raised_as",
]


class TrieDecodeError(Exception):
    """Base class of every error raised by trie_decode."""


class EmptyTrieError(TrieDecodeError, ValueError):
    """The set of entries is empty (nothing could ever be generated)."""


class InvalidTokenError(TrieDecodeError, ValueError):
    """A token id is negative, not below the vocabulary size, or not an integer."""

    @classmethod
    def check_logits_width(cls, width: int, needed: int) -> None:
        """Raise unless logits of ``width`` columns hold every token a constraint can keep (ids below ``needed``).

        Narrower logits than the vocabulary are fine (a tokenizer wider than the model's output: Llama 3.2 has
        128,257 ids and 128,256 logits) as long as every token a row can keep lies inside them; the kernels mask
        their width."""
        if width < needed:
            raise cls(f"logits have {width} columns but the trie uses token ids up to {needed - 1}: "
                      "the trie was built for a larger vocabulary than this model's")


class InvalidEntryError(TrieDecodeError, TypeError):
    """An entry is not a sequence of integer token ids (or a string where one is needed), or is empty; or an entry
    index or node id is not an integer."""


class DescriptorError(TrieDecodeError, ValueError):
    """A JSON descriptor (TokenTreePayload, RTP-LLM prefix dict, JSONL entries) is malformed or incomplete."""


class TrieFileError(TrieDecodeError, ValueError):
    """A trie file is missing, truncated, corrupted, or of an unknown format version."""


class TokenizerMismatchError(TrieDecodeError, ValueError):
    """A trie was built for another tokenizer than the one it is used with."""


class TokenizerNotFoundError(TrieDecodeError, ValueError):
    """A tokenizer name is neither a local folder nor in the Hugging Face cache, and the hub is off or does not
    answer (raised at once instead of after the hub's retries: :func:`trie_decode.hub.load_tokenizer`)."""


class ConstraintConfigError(TrieDecodeError, ValueError):
    """A decoding constraint's options are invalid (unknown on_complete mode, bad end token, ...)."""


class CatalogUpdateError(TrieDecodeError, ValueError):
    """A live catalog change names an entry the catalog does not hold, or does not fit the base trie (names,
    keys, tokenizer)."""


class FilterSpecError(ConstraintConfigError, TypeError):
    """A filter is no list of entry keys or indices (a string, a number, a 2-D array, a bool or float item)."""


class UnknownEntryError(ConstraintConfigError):
    """A filter names a key the trie never held, or an index (an entry number) outside its entries."""


class FilterModeError(ConstraintConfigError):
    """Filters are given with ``on_complete="release"``: a released row is unconstrained."""


class EmptyFilterError(ConstraintConfigError):
    """A filter leaves no entry: nothing could be generated."""


@functools.lru_cache(maxsize=None)
def raised_as(kind: type, front: type) -> type:
    """The class a front door raises for the problem ``kind`` (:class:`UnknownEntryError`, ...) when its refusals
    have a class of their own, ``front`` (a vLLM request's ``TrieRequestError``, its HTTP 400): one that is both, so
    that a problem has one class at every front door and ``except front`` still catches it. Made once per pair."""
    if issubclass(kind, front):
        return kind
    body = {"__module__": front.__module__, "__reduce__": lambda self: (_rebuilt, (kind, front, self.args))}
    return type(kind.__name__, (kind, front), body)  # pickled as what it is: (kind, front, message)


def _rebuilt(kind: type, front: type, args: tuple) -> Exception:
    return raised_as(kind, front)(*args)
