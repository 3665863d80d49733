"""Name lists for the benchmark: real names at 1k/10k, realistic synthetic names and ids at 100k/1M.

Why this exists: every peer must see the same strings under the same tokenizer, and the lists must be the same
from run to run (seeded) so that numbers from two runs are comparable. Three kinds:

- ``real``: country, subdivision and language names from pycountry (13,166 distinct strings), a seeded sample.
- ``titles``: unique titles made of real words (adjectives, nouns, country and subdivision names) in a few
  title-like patterns ("The Harbor of Bavaria", "Silent River", ...). Shared prefixes are common, as in real
  catalogues of titles.
- ``semantic-ids``: semantic-id style tuples, one word per level from four disjoint codebooks of 256 words each,
  every word a single token of the tokenizer, so each id is exactly four tokens (like the codebook tuples of
  generative retrieval), written as text so that string-based peers can take them too.

``auto`` picks ``real`` up to 13,166 entries, ``titles`` up to 100k and ``semantic-ids`` above.

Lists and canonical tokenizations are cached under ``$TRIE_DECODE_CACHE/bench`` (default
``~/.cache/trie_decode/bench``) because the benchmark's worker processes all need them and a million names take
seconds to make and tokenize.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

__all__ = [
    "NAME_KINDS",
    "NameList",
    "cache_dir",
    "resolve_kind",
    "make_names",
    "load_names",
    "names_path",
    "read_names_file",
    "canonical_tokens",
    "parse_size",
    "format_size",
]

NAME_KINDS = ("auto", "real", "titles", "semantic-ids")
_REAL_MAX = 13_166

_ADJECTIVES = (
    "Ancient Bitter Black Blue Broken Burning Crimson Dark Deep Distant Early Empty Eternal Fallen Final First "
    "Forgotten Frozen Golden Gray Great Green Hidden High Hollow Holy Iron Last Late Little Lonely Lost Lower "
    "Middle Modern New Northern Old Open Pale Quiet Red Royal Sacred Secret Silent Silver Southern Stone Strange "
    "Sunken Upper Wild Winter White Western Eastern Young Bright Cold Wandering Lesser Outer Inner Twin"
).split()
_NOUNS = (
    "Abbey Academy Archive Arrow Bay Bell Bridge Brook Canyon Castle Cathedral Chronicle City Coast Council Court "
    "Crown Dawn Delta Desert Dream Empire Falls Field Fire Forest Fortress Garden Gate Glacier Harbor Heart "
    "Highway Hill Horizon House Island Journey Kingdom Lake Legacy Library Light Line Market Meadow Memory Mill "
    "Mirror Mission Monastery Moon Mountain Museum Night Ocean Orchard Palace Passage Path Peak Pier Plain Port "
    "Prairie Quarry Rain Ranch Republic Ridge River Road Rock Rose Saga School Sea Season Shadow Shore Sky Song "
    "Spring Square Star Station Stone Storm Story Stream Summer Sun Symphony Temple Theatre Tide Tower Town "
    "Trail Treaty Union Valley Village Voyage Wall War Water Wave Well Wind Wood World Year Affair Society"
).split()
_TITLE_PATTERNS = (
    # (weight, pattern); {A} adjective, {N} noun, {P} place
    (3, "{A} {N}"),
    (3, "The {N} of {P}"),
    (3, "{P} {N}"),
    (2, "{A} {N} of {P}"),
    (1, "{N} and {N}"),
    (1, "The {A} {N}"),
    (1, "{P} {A} {N}"),
    (1, "A {N} in {P}"),
)


@dataclass(frozen=True)
class NameList:
    """A benchmark name list and its canonical tokenization.

    Attributes:
        kind: ``real``, ``titles`` or ``semantic-ids``.
        names: the strings, in a fixed seeded order. Length N.
        flat: all token ids, concatenated. Shape: (sum of lengths,), int32.
        offsets: where each name's tokens start in ``flat``. Shape: (N + 1,), int64.
    """

    kind: str
    names: list[str]
    flat: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.names)

    def tokens(self, i: int) -> list[int]:
        """The canonical tokenization of name ``i``."""
        return self.flat[self.offsets[i] : self.offsets[i + 1]].tolist()

    def token_lists(self) -> list[list[int]]:
        """All canonical tokenizations as Python lists (what GENRE-style builders take)."""
        flat = self.flat.tolist()
        offs = self.offsets.tolist()
        return [flat[offs[i] : offs[i + 1]] for i in range(len(self.names))]

    def mean_tokens(self) -> float:
        return float((self.offsets[-1] - self.offsets[0]) / max(1, len(self.names)))


def parse_size(text: str) -> int:
    """``"1k"`` -> 1000, ``"1M"`` -> 1000000, ``"2500"`` -> 2500."""
    t = text.strip().lower().replace("_", "")
    mult = 1
    if t.endswith("k"):
        mult, t = 1_000, t[:-1]
    elif t.endswith("m"):
        mult, t = 1_000_000, t[:-1]
    try:
        value = int(float(t) * mult)
    except ValueError:
        raise ValueError(f"size must look like 1000, 10k or 1M, got {text!r}") from None
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


def format_size(n: int) -> str:
    """1000 -> ``"1k"``, 1000000 -> ``"1M"``, 2500 -> ``"2500"``."""
    if n >= 1_000_000 and n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    if n >= 1_000 and n % 1_000 == 0:
        return f"{n // 1_000}k"
    return str(n)


def cache_dir() -> Path:
    """``$TRIE_DECODE_CACHE/bench``, default ``~/.cache/trie_decode/bench``."""
    root = Path(os.environ.get("TRIE_DECODE_CACHE", Path.home() / ".cache" / "trie_decode"))
    return root / "bench"


def resolve_kind(kind: str, n: int) -> str:
    """The concrete kind for ``auto`` at size ``n``; other kinds are returned unchanged."""
    if kind not in NAME_KINDS:
        raise ValueError(f"names kind must be one of {NAME_KINDS}, got {kind!r}")
    if kind != "auto":
        return kind
    if n <= _REAL_MAX:
        return "real"
    if n <= 100_000:
        return "titles"
    return "semantic-ids"


# ---------------------------------------------------------------------------------------------------------------
# Generators


def _real_pool() -> list[str]:
    import pycountry

    pool: set[str] = set()
    for c in pycountry.countries:
        for attr in ("name", "official_name", "common_name"):
            v = getattr(c, attr, None)
            if v:
                pool.add(v)
    for s in pycountry.subdivisions:
        pool.add(s.name)
    for lang in pycountry.languages:
        pool.add(lang.name)
    return sorted(pool)


def _places() -> list[str]:
    import pycountry

    places = {c.name for c in pycountry.countries} | {s.name for s in pycountry.subdivisions}
    # Keep the place names readable in a title: no parentheses or slashes (bilingual subdivision names).
    return sorted(p for p in places if all(ch not in p for ch in "()/[]"))


def _real(n: int, seed: int) -> list[str]:
    pool = _real_pool()
    if n > len(pool):
        raise ValueError(f"only {len(pool)} real names are available, asked for {n}; use names kind 'titles'")
    rng = random.Random(seed)
    return rng.sample(pool, n)


def _titles(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    places = _places()
    weights = [w for w, _ in _TITLE_PATTERNS]
    patterns = [p for _, p in _TITLE_PATTERNS]
    out: dict[str, None] = {}
    # Each pattern draw fills its slots independently; uniqueness by dict insertion keeps the order seeded.
    while len(out) < n:
        for pat in rng.choices(patterns, weights, k=max(1024, n - len(out))):
            title = pat
            while "{A}" in title:
                title = title.replace("{A}", rng.choice(_ADJECTIVES), 1)
            while "{N}" in title:
                title = title.replace("{N}", rng.choice(_NOUNS), 1)
            while "{P}" in title:
                title = title.replace("{P}", rng.choice(places), 1)
            out[title] = None
            if len(out) == n:
                break
    return list(out)


def _codebook_words(tokenizer: Any, count: int, seed: int) -> list[str]:
    """``count`` lowercase words that are a single token both bare and after a space."""
    vocab = tokenizer.get_vocab()
    candidates = sorted(
        tok[1:] for tok in vocab if tok.startswith("\u0120") and tok[1:].isalpha() and tok[1:].islower()
        and 4 <= len(tok) - 1 <= 9 and tok[1:] in vocab
    )
    rng = random.Random(seed)
    rng.shuffle(candidates)
    words: list[str] = []
    # Confirm with the tokenizer itself: both forms must encode to exactly one id.
    for w in candidates:
        if len(tokenizer(w, add_special_tokens=False)["input_ids"]) == 1 and len(
            tokenizer(" " + w, add_special_tokens=False)["input_ids"]
        ) == 1:
            words.append(w)
            if len(words) == count:
                return words
    raise ValueError(f"the tokenizer has only {len(words)} single-token words, need {count}")


def _semantic_ids(n: int, seed: int, tokenizer: Any, levels: int = 4, codebook: int = 256) -> list[str]:
    if n > codebook**levels // 2:
        raise ValueError(f"{n} semantic ids do not fit {levels} levels of {codebook} codes")
    words = _codebook_words(tokenizer, levels * codebook, seed)
    books = [words[i * codebook : (i + 1) * codebook] for i in range(levels)]
    rng = np.random.default_rng(seed)
    # Real semantic ids are skewed at the first levels (popular clusters); a Zipf-like first level mimics that.
    p0 = 1.0 / np.arange(1, codebook + 1) ** 0.8
    p0 /= p0.sum()
    seen: dict[tuple[int, ...], None] = {}
    while len(seen) < n:
        m = (n - len(seen)) * 2 + 1024
        cols = [rng.choice(codebook, size=m, p=p0)] + [rng.integers(0, codebook, size=m) for _ in range(levels - 1)]
        for row in zip(*(c.tolist() for c in cols)):
            seen[row] = None
            if len(seen) == n:
                break
    return [" ".join(books[lvl][code] for lvl, code in enumerate(t)) for t in seen]


def make_names(kind: str, n: int, seed: int = 0, tokenizer: Any = None) -> list[str]:
    """Make ``n`` distinct names of a kind (``auto`` resolved by size). Deterministic for a given seed.

    Args:
        kind: one of :data:`NAME_KINDS`.
        n: number of names.
        seed: the list's seed.
        tokenizer: needed for ``semantic-ids`` only (its codebook words must be single tokens).
    """
    kind = resolve_kind(kind, n)
    if kind == "real":
        return _real(n, seed)
    if kind == "titles":
        return _titles(n, seed)
    if tokenizer is None:
        raise ValueError("semantic-ids need the tokenizer (their codebook words must be single tokens)")
    return _semantic_ids(n, seed, tokenizer)


# ---------------------------------------------------------------------------------------------------------------
# Cached lists and tokenizations


def _tokenizer_key(tokenizer: Any) -> str:
    vocab = tokenizer.get_vocab()
    blob = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _tokenize(names: Sequence[str], tokenizer: Any, chunk: int = 50_000) -> tuple[np.ndarray, np.ndarray]:
    lengths: list[int] = []
    parts: list[np.ndarray] = []
    for i in range(0, len(names), chunk):
        ids = tokenizer(list(names[i : i + chunk]), add_special_tokens=False)["input_ids"]
        lengths.extend(len(x) for x in ids)
        parts.append(np.fromiter((t for x in ids for t in x), dtype=np.int32))
    flat = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64), out=offsets[1:])
    return flat, offsets


def names_path(kind: str, n: int, tokenizer: Any, seed: int = 0) -> Path:
    """Where :func:`load_names` caches a list (the file exists once it has been made)."""
    return cache_dir() / f"{resolve_kind(kind, n)}-{n}-s{seed}-{_tokenizer_key(tokenizer)}.npz"


def read_names_file(path: str | os.PathLike[str]) -> NameList:
    """Read a list cached by :func:`load_names` (no tokenizer needed)."""
    path = Path(path)
    kind = path.name.split("-")[0] if not path.name.startswith("semantic-ids") else "semantic-ids"
    with np.load(path, allow_pickle=False) as z:
        names = json.loads(bytes(z["names"]).decode("utf-8"))
        return NameList(kind, names, z["flat"].copy(), z["offsets"].copy())


def load_names(kind: str, n: int, tokenizer: Any, seed: int = 0, *, use_cache: bool = True) -> NameList:
    """The name list of a kind and size with its canonical tokenization (no special tokens, no leading space).

    Cached on disk per (kind, n, seed, tokenizer vocabulary); the first call for a million names takes tens of
    seconds, later calls well under a second.
    """
    kind = resolve_kind(kind, n)
    path = names_path(kind, n, tokenizer, seed)
    if use_cache and path.is_file():
        return read_names_file(path)
    names = make_names(kind, n, seed, tokenizer)
    flat, offsets = _tokenize(names, tokenizer)
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        blob = np.frombuffer(json.dumps(names, ensure_ascii=False).encode("utf-8"), dtype=np.uint8)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp.npz")
        np.savez(tmp, names=blob, flat=flat, offsets=offsets)
        os.replace(tmp, path)
    return NameList(kind, names, flat, offsets)


def canonical_tokens(names: Sequence[str], tokenizer: Any) -> list[list[int]]:
    """Canonical tokenization of arbitrary names (uncached): what a tokenizer produces without special tokens."""
    flat, offsets = _tokenize(names, tokenizer)
    f, o = flat.tolist(), offsets.tolist()
    return [f[o[i] : o[i + 1]] for i in range(len(names))]
