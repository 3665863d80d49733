"""``python -m benchmarks``: same as ``trie-decode bench``."""

from . import main

raise SystemExit(main(prog="python -m benchmarks"))
