"""Framework integrations of trie_decode: transformers, vLLM, and the embedded default model.

Each integration lives in its own module and imports its framework only when that module is imported, so
``import trie_decode`` never pulls in transformers or vLLM.
"""
