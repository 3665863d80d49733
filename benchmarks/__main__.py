"""``python -m trie_decode.bench``: same as ``trie-decode bench``."""

from . import main

raise SystemExit(main(prog="python -m trie_decode.bench"))
