"""The peers of the benchmark, each used the way its own users use it, behind one small interface.

Why this exists: a comparison is only fair if every library does the same job (mask a batch of logits so that each
row can only continue one of N names) through its own documented path, and if our implementation plugs in as just
another entry. Every peer here is a :class:`StepPeer` (the ``step`` suite) and some are also a
:class:`BuildPeer` (the ``build`` suite); the registries map a peer's name to ``"module:Class"`` and import it
lazily, so a missing library (or our core, while it is being written) shows up as "unavailable: <reason>" instead
of breaking the run.

The decode protocol a :class:`StepPeer` implements (dimension letters: B batch rows, V vocabulary, W = ceil(V/32)
bitmask words):

1. ``prepare(tokenizer)``: per-tokenizer work a server does once per model (vocabulary tables, kernel warmup);
   timed separately from setup.
2. ``setup(names, tokenizer)``: per-name-list work (compile, index, build); timed as the setup cost.
3. ``start(batch_size, device)``: fresh per-row states for B new requests.
4. ``step(logits, tokens)``: advance every row by its token of the previous step (``tokens is None`` on the first
   step after ``start``), then mask ``logits`` to the tokens each row may take next and return the masked logits
   (the same tensor for in-place peers). A row whose previous token is the EOS id finished its name; its slot is
   taken by a new request at once, so the row restarts at the root (continuous batching). The harness only ever
   feeds a token the peer's own mask allowed, or EOS.

Peers (names in :data:`STEP_PEERS`):

- ``genre-dict``: the GENRE recipe: nested-dict token trie (sequences end with EOS) and transformers
  ``PrefixConstrainedLogitsProcessor``, whose user function walks the trie from the root for every row at every
  step.
- ``genre-marisa``: GENRE's ``MarisaTrie`` variant: sequences as strings of ``chr(token)`` in a ``marisa_trie.Trie``,
  the root branch cached, deeper branches found by enumerating the keys under the prefix.
- ``xgrammar``: choice grammar ``root ::= "a" | "b" | ...`` (vLLM's ``choice_as_grammar`` escaping), one
  ``GrammarMatcher`` per row, ``fill_next_token_bitmask`` per row, ``apply_token_bitmask_inplace``.
- ``llguidance``: ``llguidance.grammar_from("choice", names)`` (a lark alternation), one ``LLMatcher`` per row,
  ``llguidance.torch.fill_next_token_bitmask`` per row, ``llguidance.torch.apply_token_bitmask_inplace``
  (torch.compile'd, warmed in ``prepare``).
- ``llguidance-lexeme``: the same with the alternation as one lexeme (``start: NAME``, ``NAME: "a" | ...``), the
  form llguidance recommends for large alternations (the plain choice grammar hits its parser limits at 10k).
- ``outlines-core``: alternation regex (longest name first: Rust regex alternation is leftmost-first), ``Index``,
  one ``Guide`` per row, ``write_mask_into`` per row, ``outlines_core.kernels.torch.apply_token_bitmask_inplace``.
- ``lm-format-enforcer``: ``UnionParser([StringParser(n) ...])`` in a ``TokenEnforcer`` behind transformers
  ``PrefixConstrainedLogitsProcessor`` (its transformers integration), one distinct prompt per request.
- ``trie_decode``: ours, from ``benchmarks/ours.py`` (the core's advance + mask).
"""

from __future__ import annotations

import importlib
import json
import time
from typing import Any, ClassVar, Sequence

from trie_decode.tokenizers import byte_decoder_table

__all__ = [
    "StepPeer",
    "BuildPeer",
    "FloorPeer",
    "PeerError",
    "PeerUnavailable",
    "STEP_PEERS",
    "BUILD_PEERS",
    "register_step_peer",
    "register_build_peer",
    "load_peer",
    "availability",
    "REQUIRES",
    "vocab_size_of",
]


class PeerError(RuntimeError):
    """A peer failed in a way its library reports (grammar error state, limit exceeded...)."""


class PeerUnavailable(ImportError):
    """A peer cannot run here (library not installed, our core not importable yet)."""


def vocab_size_of(tokenizer: Any) -> int:
    """The number of logits columns V: base vocabulary plus added tokens (the core's own definition)."""
    from trie_decode.tokenizers import tokenizer_vocab_size

    return tokenizer_vocab_size(tokenizer)


# ---------------------------------------------------------------------------------------------------------------
# Interfaces


class StepPeer:
    """One constrained-decoding implementation, driven through the decode protocol of this module.

    Subclasses set ``name`` and implement :meth:`setup`, :meth:`start` and :meth:`step`; :meth:`prepare`,
    :meth:`rejects` and :meth:`close` are optional. ``prepare_parts`` and ``setup_parts`` may hold named
    sub-timings (seconds) and ``info`` any facts worth reporting (counts, sizes, warnings); all end up in the JSON.
    """

    name: ClassVar[str] = "?"
    description: ClassVar[str] = ""

    def __init__(self) -> None:
        self.prepare_parts: dict[str, float] = {}
        self.setup_parts: dict[str, float] = {}
        self.info: dict[str, Any] = {}

    def prepare(self, tokenizer: Any) -> None:
        """Per-tokenizer work, done once per process and timed apart from :meth:`setup`."""

    def setup(self, names: Sequence[str], tokenizer: Any) -> None:
        """Build whatever the peer needs to constrain to exactly ``names``."""
        raise NotImplementedError

    def start(self, batch_size: int, device: Any) -> None:
        """Create fresh states for ``batch_size`` new requests on ``device``."""
        raise NotImplementedError

    def step(self, logits: Any, tokens: Any | None) -> Any:
        """Advance by ``tokens``, then mask ``logits``; return the masked logits.

        Args:
            logits: the next-token scores. Shape: (B, V), float32, on the decode device. May be modified in place.
            tokens: each row's token from the previous step, or ``None`` on the first step after :meth:`start`.
                Shape: (B,), int64, same device. The EOS id means "finished; a new request takes this row".

        Returns:
            The masked logits, shape (B, V): disallowed tokens are ``-inf``, allowed ones keep their score.
        """
        raise NotImplementedError

    def rejects(self, token_seqs: Sequence[Sequence[int]]) -> list[int] | None:
        """Indices of names whose canonical tokenization (then EOS) the peer does not accept; ``None`` if the peer
        has no cheap way to check (the decode walk still checks every step it takes)."""
        return None

    def close(self) -> None:
        """Release per-run resources."""


class BuildPeer:
    """A structure built from token sequences (the ``build`` suite): build time and memory."""

    name: ClassVar[str] = "?"
    description: ClassVar[str] = ""

    def build(self, token_seqs: list[list[int]], vocab_size: int, eos_id: int) -> Any:
        """Build the peer's structure for ``token_seqs`` and return it (kept alive while memory is read)."""
        raise NotImplementedError


class FloorPeer(StepPeer):
    """The floor: ``logits.fill_(-inf)`` on the same (B, V) tensor, the least any masking step can cost."""

    name = "floor"
    description = "logits.fill_(float('-inf')) on the same (B, V) tensor"

    def setup(self, names: Sequence[str], tokenizer: Any) -> None:
        pass

    def start(self, batch_size: int, device: Any) -> None:
        pass

    def step(self, logits: Any, tokens: Any | None) -> Any:
        return logits.fill_(float("-inf"))


# ---------------------------------------------------------------------------------------------------------------
# GENRE: nested-dict trie and the marisa-trie variant (re-implemented from the recipe in facebookresearch/GENRE,
# genre/trie.py: recursive insertion and a recursive lookup that walks from the root on every call)


class _GenreDictTrie:
    def __init__(self, sequences: Sequence[list[int]]) -> None:
        self.trie_dict: dict[int, dict] = {}
        for seq in sequences:
            _genre_add(seq, self.trie_dict)

    def get(self, prefix: list[int]) -> list[int]:
        return _genre_get(prefix, self.trie_dict)


def _genre_add(seq: list[int], node: dict) -> None:
    if seq:
        if seq[0] not in node:
            node[seq[0]] = {}
        _genre_add(seq[1:], node[seq[0]])


def _genre_get(prefix: list[int], node: dict) -> list[int]:
    if len(prefix) == 0:
        return list(node.keys())
    if prefix[0] in node:
        return _genre_get(prefix[1:], node[prefix[0]])
    return []


class _GenreMarisaTrie:
    def __init__(self, sequences: Sequence[list[int]], vocab_size: int) -> None:
        import marisa_trie

        # GENRE maps ids to code points and skips the surrogate block; ids below 55000 map to themselves.
        self.int2char = [chr(i) for i in range(min(vocab_size, 55000))] + (
            [chr(i) for i in range(65000, vocab_size + 10000)] if vocab_size >= 55000 else []
        )
        self.char2int = {self.int2char[i]: i for i in range(vocab_size)}
        # GENRE caches the first branch (all its sequences share a start token); here the root is that branch.
        self.zero_iter = list({seq[0] for seq in sequences if seq})
        self.trie = marisa_trie.Trie("".join(self.int2char[i] for i in seq) for seq in sequences)

    def get(self, prefix: list[int]) -> list[int]:
        if len(prefix) == 0:
            return self.zero_iter
        key = "".join(self.int2char[i] for i in prefix)
        n = len(key)
        return list({self.char2int[k[n]] for k in self.trie.keys(key) if len(k) > n})


def _batch_tokenize(tokenizer: Any, names: Sequence[str]) -> list[list[int]]:
    return [list(x) for x in tokenizer(list(names), add_special_tokens=False)["input_ids"]]


class _PrefixFnPeer(StepPeer):
    """Shared driver for peers used through transformers' ``PrefixConstrainedLogitsProcessor``.

    Keeps ``input_ids`` like ``generate`` does (one column appended per step, all rows the same length) and, per
    row, where the current request's generated part starts, so a row restarts after EOS.
    """

    def __init__(self) -> None:
        super().__init__()
        self._ids: Any = None
        self._len = 0
        self._starts: list[int] = []
        self._processor: Any = None
        self._eos = -1

    def _prefix_fn(self, batch_id: int, sent: Any) -> list[int]:
        raise NotImplementedError

    def _on_restart(self, row: int) -> None:
        """A new request takes ``row`` (its generated part starts at the current length)."""

    def _make_processor(self) -> None:
        from transformers.generation.logits_process import PrefixConstrainedLogitsProcessor

        self._processor = PrefixConstrainedLogitsProcessor(self._prefix_fn, num_beams=1)

    def start(self, batch_size: int, device: Any) -> None:
        import torch

        self._ids = torch.zeros((batch_size, 64), dtype=torch.long, device=device)
        self._len = 0
        self._starts = [0] * batch_size
        for row in range(batch_size):
            self._on_restart(row)

    def step(self, logits: Any, tokens: Any | None) -> Any:
        import torch

        if tokens is not None:
            if self._len == self._ids.shape[1]:
                grown = torch.zeros((self._ids.shape[0], 2 * self._len), dtype=self._ids.dtype, device=self._ids.device)
                grown[:, : self._len] = self._ids
                self._ids = grown
            self._ids[:, self._len] = tokens
            self._len += 1
            for row in (tokens == self._eos).nonzero().flatten().tolist():
                self._starts[row] = self._len
                self._on_restart(row)
        return self._processor(self._ids[:, : self._len], logits)


class GenreDictPeer(_PrefixFnPeer):
    name = "genre-dict"
    description = "GENRE nested-dict trie + transformers PrefixConstrainedLogitsProcessor"

    def setup(self, names: Sequence[str], tokenizer: Any) -> None:
        self._eos = int(tokenizer.eos_token_id)
        t0 = time.perf_counter()
        seqs = [s + [self._eos] for s in _batch_tokenize(tokenizer, names)]
        t1 = time.perf_counter()
        self.trie = _GenreDictTrie(seqs)
        self.setup_parts = {"tokenize_s": t1 - t0, "build_s": time.perf_counter() - t1}
        self._make_processor()

    def _prefix_fn(self, batch_id: int, sent: Any) -> list[int]:
        return self.trie.get(sent[self._starts[batch_id] :].tolist())

    def rejects(self, token_seqs: Sequence[Sequence[int]]) -> list[int] | None:
        bad = []
        for i, seq in enumerate(token_seqs):
            node = self.trie.trie_dict
            for t in list(seq) + [self._eos]:
                node = node.get(t)
                if node is None:
                    bad.append(i)
                    break
        return bad


class GenreMarisaPeer(GenreDictPeer):
    name = "genre-marisa"
    description = "GENRE MarisaTrie (marisa-trie, root branch cached) + PrefixConstrainedLogitsProcessor"

    def setup(self, names: Sequence[str], tokenizer: Any) -> None:
        self._eos = int(tokenizer.eos_token_id)
        t0 = time.perf_counter()
        seqs = [s + [self._eos] for s in _batch_tokenize(tokenizer, names)]
        t1 = time.perf_counter()
        self.trie = _GenreMarisaTrie(seqs, vocab_size_of(tokenizer))
        self.setup_parts = {"tokenize_s": t1 - t0, "build_s": time.perf_counter() - t1}
        self._make_processor()

    def rejects(self, token_seqs: Sequence[Sequence[int]]) -> list[int] | None:
        keys = self.trie.trie
        c = self.trie.int2char
        return [i for i, seq in enumerate(token_seqs) if "".join(c[t] for t in list(seq) + [self._eos]) not in keys]


# ---------------------------------------------------------------------------------------------------------------
# Grammar engines


def _ebnf_literal(s: str) -> str:
    """A double-quoted EBNF string literal, escaped as vLLM's ``choice_as_grammar`` does."""
    escapes = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}
    out = []
    for ch in s:
        if ch in escapes:
            out.append(escapes[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _device_bitmask(bitmask: Any, device: Any) -> Any:
    # Engines fill a CPU bitmask; on CUDA it is copied over like vLLM does (pinned, non-blocking).
    if getattr(device, "type", "cpu") == "cpu":
        return bitmask
    return bitmask.to(device, non_blocking=True)


class _BitmaskPeer(StepPeer):
    """The lifecycle shared by the bitmask engines (XGrammar, llguidance): one matcher per row, fed each row's token
    (reset at EOS, the next name starts), then every row's bitmask filled and applied to the logits in one call.

    Subclasses define the engine's verbs: :meth:`_matcher`, :meth:`_accept`, :meth:`_fill`, :meth:`_allocate`,
    :meth:`_apply`.
    """

    def _matcher(self) -> Any:
        raise NotImplementedError

    def _accept(self, matcher: Any, token: int) -> bool:
        raise NotImplementedError

    def _fill(self, matcher: Any, bitmask: Any, row: int) -> None:
        raise NotImplementedError

    def _allocate(self, batch_size: int) -> Any:
        raise NotImplementedError

    def _apply(self, logits: Any, bitmask: Any) -> None:
        raise NotImplementedError

    def start(self, batch_size: int, device: Any) -> None:
        self._matchers = [self._matcher() for _ in range(batch_size)]
        self._bitmask = self._allocate(batch_size)
        self.info.setdefault("advance_failures", 0)

    def step(self, logits: Any, tokens: Any | None) -> Any:
        ms = self._matchers
        if tokens is not None:
            eos = self._eos
            for m, t in zip(ms, tokens.tolist()):
                if t == eos:
                    m.reset()
                elif not self._accept(m, t):
                    self.info["advance_failures"] += 1
        bitmask = self._bitmask
        for i, m in enumerate(ms):
            self._fill(m, bitmask, i)
        self._apply(logits, _device_bitmask(bitmask, logits.device))
        return logits


class XGrammarPeer(_BitmaskPeer):
    name = "xgrammar"
    description = 'XGrammar choice grammar root ::= "a" | ..., GrammarMatcher per row, bitmask fill + apply'

    def prepare(self, tokenizer: Any) -> None:
        import torch
        import xgrammar as xgr

        self._xgr = xgr
        self._vocab = vocab_size_of(tokenizer)
        self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self._vocab)
        self._compiler = xgr.GrammarCompiler(self._info)
        # The apply kernel picks a backend on first use; warm it so the first timed step does not pay for it.
        logits = torch.zeros((2, self._vocab))
        xgr.apply_token_bitmask_inplace(logits, xgr.allocate_token_bitmask(2, self._vocab))

    def setup(self, names: Sequence[str], tokenizer: Any) -> None:
        self._eos = int(tokenizer.eos_token_id)
        t0 = time.perf_counter()
        grammar = "root ::= " + " | ".join(_ebnf_literal(n) for n in names)
        t1 = time.perf_counter()
        self._compiled = self._compiler.compile_grammar(grammar)
        self.setup_parts = {"grammar_text_s": t1 - t0, "compile_s": time.perf_counter() - t1}
        self.info["grammar_chars"] = len(grammar)

    def _matcher(self) -> Any:
        return self._xgr.GrammarMatcher(self._compiled)

    def _accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def _fill(self, matcher: Any, bitmask: Any, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def _allocate(self, batch_size: int) -> Any:
        return self._xgr.allocate_token_bitmask(batch_size, self._vocab)

    def _apply(self, logits: Any, bitmask: Any) -> None:
        self._xgr.apply_token_bitmask_inplace(logits, bitmask)

    def rejects(self, token_seqs: Sequence[Sequence[int]]) -> list[int] | None:
        m = self._xgr.GrammarMatcher(self._compiled)
        bad = []
        for i, seq in enumerate(token_seqs):
            m.reset()
            if not (all(m.accept_token(t) for t in seq) and m.accept_token(self._eos)):
                bad.append(i)
        return bad


class LLGuidancePeer(_BitmaskPeer):
    name = "llguidance"
    description = "llguidance choice (lark alternation), LLMatcher per row, bitmask fill + torch apply"

    def prepare(self, tokenizer: Any) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch
        import torch

        self._ll = llguidance
        self._llt = llguidance.torch
        self._vocab = vocab_size_of(tokenizer)
        t0 = time.perf_counter()
        self._tok = llguidance.hf.from_tokenizer(tokenizer, self._vocab)  # ~1 s: done once per model
        t1 = time.perf_counter()
        # apply_token_bitmask_inplace is torch.compile'd: its first call compiles for seconds; batch 1 is
        # specialized, batch 2 compiles the dynamic-shape kernel every larger batch reuses.
        for b in (1, 2):
            logits = torch.zeros((b, self._vocab))
            self._llt.apply_token_bitmask_inplace(logits, self._llt.allocate_token_bitmask(b, self._vocab))
        self.prepare_parts = {"tokenizer_s": t1 - t0, "kernel_warmup_s": time.perf_counter() - t1}

    def _grammar_text(self, names: Sequence[str]) -> str:
        # What vLLM's guidance backend does for a choice request.
        return self._ll.grammar_from("choice", list(names))

    def setup(self, names: Sequence[str], tokenizer: Any) -> None:
        self._eos = int(tokenizer.eos_token_id)
        t0 = time.perf_counter()
        self._grammar = self._grammar_text(names)
        t1 = time.perf_counter()
        # The matcher compiles the grammar; a server does this per request, the first one pays the most.
        probe = self._ll.LLMatcher(self._tok, self._grammar, log_level=1)
        _ll_check(probe)
        self._probe = probe
        self.setup_parts = {"grammar_text_s": t1 - t0, "first_matcher_s": time.perf_counter() - t1}
        self.info["grammar_chars"] = len(self._grammar)

    def _matcher(self) -> Any:
        m = self._ll.LLMatcher(self._tok, self._grammar, log_level=1)
        _ll_check(m)
        return m

    def _accept(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)

    def _fill(self, matcher: Any, bitmask: Any, row: int) -> None:
        self._llt.fill_next_token_bitmask(matcher, bitmask, row)
        if matcher.is_error():  # vLLM checks after each fill too (and logs); a matcher in error never recovers
            _ll_check(matcher)

    def _allocate(self, batch_size: int) -> Any:
        return self._llt.allocate_token_bitmask(batch_size, self._vocab)

    def _apply(self, logits: Any, bitmask: Any) -> None:
        self._llt.apply_token_bitmask_inplace(logits, bitmask)

    def rejects(self, token_seqs: Sequence[Sequence[int]]) -> list[int] | None:
        m = self._probe
        m.reset()
        return [i for i, seq in enumerate(token_seqs) if m.validate_tokens(list(seq) + [self._eos]) != len(seq) + 1]


class LLGuidanceLexemePeer(LLGuidancePeer):
    name = "llguidance-lexeme"
    description = "llguidance with the names as one lexeme (start: NAME; NAME: \"a\" | ...), otherwise as llguidance"

    def _grammar_text(self, names: Sequence[str]) -> str:
        # Upper-case rules are lexemes: the alternation becomes one lazily built lexer DFA instead of N parser
        # items, the form llguidance's docs recommend for large alternations.
        lark = "start: NAME\nNAME: " + " | ".join(json.dumps(n) for n in names)
        return self._ll.LLMatcher.grammar_from_lark(lark)


def _ll_check(m: Any) -> None:
    if m.is_error():
        err = m.get_error()
        # The error text embeds the parser state and the whole grammar; keep the lines that say what went wrong.
        keep = [ln for ln in err.splitlines() if ln.startswith(("Stop:", "Error:"))] or err.splitlines()[:1]
        raise PeerError("LLMatcher error: " + " | ".join(keep)[:500])


def _outlines_vocabulary(tokenizer: Any) -> tuple[Any, int]:
    """outlines-core ``Vocabulary`` built by hand: raw token bytes -> ids, special tokens (EOS included) left out."""
    import outlines_core as oc

    byte_decoder = {chr(c): b for c, b in byte_decoder_table().items()}
    special = set(tokenizer.all_special_tokens)
    mapping: dict[bytes, list[int]] = {}
    for tok, idx in tokenizer.get_vocab().items():
        if tok in special:
            continue
        try:
            raw = bytes(byte_decoder[ch] for ch in tok)
        except KeyError:  # an added token that is not byte-level: take its text
            raw = tok.encode("utf-8")
        mapping.setdefault(raw, []).append(int(idx))
    eos = int(tokenizer.eos_token_id)
    return oc.Vocabulary(eos, mapping), len(mapping)


def _rust_regex_escape(s: str) -> str:
    try:
        import regex  # what vLLM uses for its outlines choice regex

        return regex.escape(s)
    except ImportError:
        meta = set("\\.+*?()|[]{}^$#&-~ ")
        return "".join("\\" + ch if ch in meta else ch for ch in s)


class OutlinesCorePeer(_BitmaskPeer):
    name = "outlines-core"
    description = "outlines-core alternation regex Index (longest first), Guide per row, write_mask_into + apply"

    def prepare(self, tokenizer: Any) -> None:
        import outlines_core as oc
        import torch
        from outlines_core.kernels import torch as oc_torch

        self._oc = oc
        self._kernel = oc_torch.apply_token_bitmask_inplace
        self._vocab = vocab_size_of(tokenizer)
        t0 = time.perf_counter()
        self._vocabulary, n_keys = _outlines_vocabulary(tokenizer)
        t1 = time.perf_counter()
        for b in (1, 2):  # torch.compile'd: batch 1 is specialized, 2 compiles the dynamic-shape kernel
            self._kernel(torch.zeros((b, self._vocab)), torch.full((b, (self._vocab + 31) // 32), -1, dtype=torch.int32))
        self.prepare_parts = {"vocabulary_s": t1 - t0, "kernel_warmup_s": time.perf_counter() - t1}

    def setup(self, names: Sequence[str], tokenizer: Any) -> None:
        self._eos = int(tokenizer.eos_token_id)
        t0 = time.perf_counter()
        # Rust regex alternation is leftmost-first: a name that extends an earlier alternative would be cut off.
        ordered = sorted(names, key=len, reverse=True)
        pattern = "(" + "|".join(_rust_regex_escape(n) for n in ordered) + ")"
        t1 = time.perf_counter()
        self._index = self._oc.Index(pattern, self._vocabulary)
        self.setup_parts = {"regex_text_s": t1 - t0, "index_s": time.perf_counter() - t1}
        self.info["regex_chars"] = len(pattern)

    def _matcher(self) -> Any:
        return self._oc.Guide(self._index)

    def _accept(self, guide: Any, token: int) -> bool:
        try:
            guide.advance(token, return_tokens=False)  # advance(EOS) in a final state raises: EOS resets instead
            return True
        except ValueError:
            return False

    def _allocate(self, batch_size: int) -> Any:
        import torch

        self._words = (self._vocab + 31) // 32
        bitmask = torch.full((batch_size, self._words), -1, dtype=torch.int32)
        self._row_ptrs = [bitmask[i].data_ptr() for i in range(batch_size)]
        return bitmask

    def _fill(self, guide: Any, bitmask: Any, row: int) -> None:
        guide.write_mask_into(self._row_ptrs[row], self._words, 4)

    def _apply(self, logits: Any, bitmask: Any) -> None:
        self._kernel(logits, bitmask)

    def rejects(self, token_seqs: Sequence[Sequence[int]]) -> list[int] | None:
        g = self._oc.Guide(self._index)
        bad = []
        for i, seq in enumerate(token_seqs):
            g.reset()
            try:
                ok = g.accepts_tokens(list(seq))
                if ok:
                    for t in seq:
                        g.advance(t, return_tokens=False)
                    ok = g.is_finished()
            except (ValueError, RuntimeError):
                ok = False
            if not ok:
                bad.append(i)
        return bad


def _lmfe_transformers() -> Any:
    """Import lm-format-enforcer's transformers integration, shimming the import it does that transformers 5 moved."""
    import transformers

    tu = importlib.import_module("transformers.tokenization_utils")
    if not hasattr(tu, "PreTrainedTokenizerBase"):
        tu.PreTrainedTokenizerBase = transformers.PreTrainedTokenizerBase
    return importlib.import_module("lmformatenforcer.integrations.transformers")


class LMFormatEnforcerPeer(_PrefixFnPeer):
    name = "lm-format-enforcer"
    description = "lm-format-enforcer UnionParser of StringParsers, TokenEnforcer via PrefixConstrainedLogitsProcessor"

    def prepare(self, tokenizer: Any) -> None:
        self._lt = _lmfe_transformers()
        t0 = time.perf_counter()
        self._tokdata = self._lt.build_token_enforcer_tokenizer_data(tokenizer, vocab_size=vocab_size_of(tokenizer))
        self.prepare_parts = {"tokenizer_data_s": time.perf_counter() - t0}
        self._request = 0

    def setup(self, names: Sequence[str], tokenizer: Any) -> None:
        import lmformatenforcer as lmfe

        self._eos = int(tokenizer.eos_token_id)
        self._vocab = vocab_size_of(tokenizer)
        parser = lmfe.UnionParser([lmfe.StringParser(n) for n in names])
        self._enforcer = lmfe.TokenEnforcer(self._tokdata, parser)
        self._make_processor()

    def start(self, batch_size: int, device: Any) -> None:
        self._prompts: list[list[int]] = [[] for _ in range(batch_size)]
        super().start(batch_size, device)

    def _on_restart(self, row: int) -> None:
        # The enforcer keys its states by the whole token sequence, prompt included; every request has its own
        # prompt, so a new request starts from the root instead of reusing a finished request's cached states.
        self._request += 1
        self._prompts[row] = [1, self._request // self._vocab, self._request % self._vocab]

    def _prefix_fn(self, batch_id: int, sent: Any) -> list[int]:
        # lm-format-enforcer's TransformersPrefixAllowedTokensFn, with this row's request prompt in front.
        seq = self._prompts[batch_id] + sent[self._starts[batch_id] :].tolist()
        return self._enforcer.get_allowed_tokens(seq).allowed_tokens


# ---------------------------------------------------------------------------------------------------------------
# Build peers


class GenreDictBuild(BuildPeer):
    name = "genre-dict"
    description = "GENRE nested-dict trie (sequences + EOS)"

    def build(self, token_seqs: list[list[int]], vocab_size: int, eos_id: int) -> Any:
        return _GenreDictTrie([s + [eos_id] for s in token_seqs])


class GenreMarisaBuild(BuildPeer):
    name = "genre-marisa"
    description = "GENRE MarisaTrie (marisa-trie of chr(token) strings + EOS)"

    def build(self, token_seqs: list[list[int]], vocab_size: int, eos_id: int) -> Any:
        return _GenreMarisaTrie([s + [eos_id] for s in token_seqs], vocab_size)


# ---------------------------------------------------------------------------------------------------------------
# Registries

STEP_PEERS: dict[str, str] = {
    "trie_decode": "benchmarks.ours:TrieDecodePeer",
    "trie_decode-repeat": "benchmarks.ours:TrieDecodeRepeatPeer",
    "trie_decode-processor": "benchmarks.ours:TrieDecodeProcessorPeer",
    "trie_decode-processor-beam": "benchmarks.ours:TrieDecodeProcessorBeamPeer",
    "trie_decode-torch": "benchmarks.ours:TrieDecodeTorchPeer",
    "genre-dict": "benchmarks.peers:GenreDictPeer",
    "genre-marisa": "benchmarks.peers:GenreMarisaPeer",
    "xgrammar": "benchmarks.peers:XGrammarPeer",
    "llguidance": "benchmarks.peers:LLGuidancePeer",
    "llguidance-lexeme": "benchmarks.peers:LLGuidanceLexemePeer",
    "outlines-core": "benchmarks.peers:OutlinesCorePeer",
    "lm-format-enforcer": "benchmarks.peers:LMFormatEnforcerPeer",
}
"""Step-suite peers: name -> ``"module:Class"`` of a :class:`StepPeer` subclass, imported on use."""

BUILD_PEERS: dict[str, str] = {
    "trie_decode": "benchmarks.ours:TrieDecodeBuildPeer",
    "genre-dict": "benchmarks.peers:GenreDictBuild",
    "genre-marisa": "benchmarks.peers:GenreMarisaBuild",
}
"""Build-suite peers: name -> ``"module:Class"`` of a :class:`BuildPeer` subclass, imported on use."""

# The third-party modules each peer needs; checked before a worker process is started for it.
REQUIRES: dict[str, tuple[str, ...]] = {
    "trie_decode-processor": ("transformers",),
    "trie_decode-processor-beam": ("transformers",),
    "genre-dict": ("transformers",),
    "genre-marisa": ("transformers", "marisa_trie"),
    "xgrammar": ("xgrammar",),
    "llguidance": ("llguidance",),
    "llguidance-lexeme": ("llguidance",),
    "outlines-core": ("outlines_core",),
    "lm-format-enforcer": ("lmformatenforcer", "transformers"),
}


def register_step_peer(name: str, target: str | type[StepPeer]) -> None:
    """Add or replace a step peer: ``target`` is a class or ``"module:Class"`` (imported lazily)."""
    STEP_PEERS[name] = target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


def register_build_peer(name: str, target: str | type[BuildPeer]) -> None:
    """Add or replace a build peer: ``target`` is a class or ``"module:Class"`` (imported lazily)."""
    BUILD_PEERS[name] = target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


def availability(name: str, registry: dict[str, str]) -> str | None:
    """``None`` if the peer looks runnable, else the reason it is not (cheap: no heavy imports)."""
    import importlib.util

    if name not in registry:
        return f"unknown peer {name!r}"
    for mod in REQUIRES.get(name, ()):
        if importlib.util.find_spec(mod) is None:
            return f"unavailable: module {mod!r} is not installed"
    module = registry[name].partition(":")[0]
    try:
        if importlib.util.find_spec(module) is None:
            return f"unavailable: module {module!r} not found"
    except ImportError as exc:
        return f"unavailable: {exc}"
    return None


def load_peer(name: str, registry: dict[str, str]) -> type:
    """Import a peer class from a registry.

    Raises:
        PeerUnavailable: the peer's module or one of its dependencies cannot be imported, with the reason.
        KeyError: ``name`` is not in the registry.
    """
    if name not in registry:
        raise KeyError(f"unknown peer {name!r}; known: {', '.join(registry)}")
    module_name, _, cls_name = registry[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PeerUnavailable(f"unavailable: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:  # a half-written module must not take the whole benchmark down
        raise PeerUnavailable(f"unavailable: importing {module_name} failed: {type(exc).__name__}: {exc}") from exc
    try:
        return getattr(module, cls_name)
    except AttributeError:
        raise PeerUnavailable(f"unavailable: {module_name} has no {cls_name}") from None

