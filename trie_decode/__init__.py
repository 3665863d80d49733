"""trie_decode: make a language model's output land exactly on one of a set of token sequences.

The core (this package) needs numpy, torch and safetensors only. Framework glue lives in
``trie_decode.integrations`` (transformers, vLLM).

Example:
    >>> import torch
    >>> from trie_decode import SpanRules, TokenTrie, TrieConstraint
    >>> trie = TokenTrie.from_sequences([[3, 4], [3, 5], [6]], vocab_size=8)
    >>> c = TrieConstraint(trie, SpanRules(end_token_id=0), "cpu")
    >>> state = c.advance(c.start(1), torch.tensor([3]))
    >>> c.allowed(state)[0].nonzero().flatten().tolist()
    [4, 5]
"""

from .catalogs import catalog_from_codes
from .constraint import RowState, TrieConstraint
from .descriptors import trie_from_prefix_dict
from .entries import Entry
from .fields import Span
from .templates import Template
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
from .spans import SpanRules
from .trie import TokenTrie, TrieStats

__version__ = "0.1.0"

__all__ = [
    # catalog-valued fields inside free text, and whole outputs with catalog-valued slots
    "Span",
    "Template",
    # the trie and its builders
    "TokenTrie",
    "TrieStats",
    "catalog_from_codes",
    "trie_from_prefix_dict",
    "LiveCatalog",
    "CatalogSnapshot",
    # decoding: the rules of a span and the per-row state machine every front door uses
    "SpanRules",
    "TrieConstraint",
    "RowState",
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
