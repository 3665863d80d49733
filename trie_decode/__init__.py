"""trie_decode: make a language model's output land exactly on one of a set of token sequences.

The core (this package) needs numpy, torch and safetensors only. Framework glue lives in
``trie_decode.integrations`` (transformers, vLLM).
"""

from .entries import Entry
from .errors import (
    ConstraintConfigError,
    DescriptorError,
    EmptyTrieError,
    InvalidEntryError,
    InvalidTokenError,
    TokenizerMismatchError,
    TrieDecodeError,
    TrieFileError,
)
from .tokenizers import tokenize_strings, tokenizer_fingerprint, tokenizer_vocab_size
from .trie import TokenTrie, TrieStats

__version__ = "0.1.0"

__all__ = [
    "TokenTrie",
    "TrieStats",
    "Entry",
    "tokenizer_fingerprint",
    "tokenizer_vocab_size",
    "tokenize_strings",
    "TrieDecodeError",
    "EmptyTrieError",
    "InvalidTokenError",
    "InvalidEntryError",
    "DescriptorError",
    "TrieFileError",
    "TokenizerMismatchError",
    "ConstraintConfigError",
]
