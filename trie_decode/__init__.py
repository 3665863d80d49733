"""trie_decode: constrain a language model's output to exactly one of a set of token sequences."""
__version__ = "0.1.0"
