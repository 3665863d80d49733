"""trie_decode: make a language model's output land exactly on one of a set of token sequences.

The core (this package) needs numpy, torch and safetensors only. Framework glue lives in
``trie_decode.integrations`` (transformers, vLLM).
"""

from .descriptors import trie_from_prefix_dict
from .entries import Entry
from .errors import (
    CatalogUpdateError,
    ConstraintConfigError,
    DescriptorError,
    EmptyTrieError,
    InvalidEntryError,
    InvalidTokenError,
    TokenizerMismatchError,
    TrieDecodeError,
    TrieFileError,
)
from .forms import PromptMismatchWarning, check_prompt, heal_prompt, warn_prompt
from .tokenizers import tokenize_strings, tokenizer_fingerprint, tokenizer_vocab_size
from .live import CatalogSnapshot, LiveCatalog
from .trie import TokenTrie, TrieStats

__version__ = "0.1.0"

__all__ = [
    "TokenTrie",
    "TrieStats",
    "LiveCatalog",
    "CatalogSnapshot",
    "trie_from_prefix_dict",
    "Entry",
    "tokenizer_fingerprint",
    "tokenizer_vocab_size",
    "tokenize_strings",
    "check_prompt",
    "heal_prompt",
    "warn_prompt",
    "PromptMismatchWarning",
    "TrieDecodeError",
    "EmptyTrieError",
    "InvalidTokenError",
    "InvalidEntryError",
    "DescriptorError",
    "TrieFileError",
    "TokenizerMismatchError",
    "ConstraintConfigError",
    "CatalogUpdateError",
]
