"""``TokenTrie``: an immutable token trie in flat CSR arrays.

Why this exists: constrained decoding asks one question per row per step, "which tokens may come next from this
node?". A nested-dict trie answers it with Python objects (GENRE needs 8.5 GB for 5M titles). Here the answer is
an array slice: nodes are numbered breadth-first with siblings sorted by token, so the children of node ``n`` are
the node ids ``child_ptr[n] .. child_ptr[n+1]-1`` and their tokens are ``token[child_ptr[n]:child_ptr[n+1]]``.
Every node has exactly one incoming edge, so the edge arrays and the node arrays are the same arrays.

Layout (N nodes, E entries, D = max depth); 12 bytes per node:
    child_ptr:  (N+1,) int32  first child of each node; children of n are child_ptr[n]..child_ptr[n+1]-1
    token:      (N,)   int32  token on the edge into each node (-1 for the root, node 0)
    node_entry: (N,)   int32  entry index at terminal nodes, -1 elsewhere
    entry_node: (E,)   int32  terminal node of each entry
    level_ptr:  (D+2,) int64  first node id at each depth (nodes of depth d: level_ptr[d]..level_ptr[d+1]-1)

Example:
    >>> from trie_decode import TokenTrie
    >>> trie = TokenTrie.from_sequences([[5, 6], [5, 7, 8], [9]], vocab_size=10, names=["a", "b", "c"])
    >>> trie.children(trie.root)[0].tolist()
    [5, 9]
    >>> node = trie.walk([5, 7])
    >>> trie.forced_run(node), trie.entry_at(trie.walk([5, 7, 8])).name
    ([8], 'b')
"""

from __future__ import annotations

import json
import os
from typing import Any, BinaryIO, Callable, Hashable, Iterable, Mapping, Optional, Sequence

import numpy as np

from ._build import BuiltArrays, RaggedTokens, _is_integer, build_arrays, check_tokens, to_ragged, token_paths
from .entries import (FILTER_DTYPES, ITEM_DTYPES, Entry, StringTable, catalog_item_keys, catalog_problem,
                      check_keys, check_names, entry_column, entry_strings, filter_arrays_problem, utf8_bytes)
from .errors import EmptyTrieError, InvalidEntryError, InvalidTokenError, TokenizerMismatchError, TrieFileError
from .fileio import DELTA_KIND, check_vectors, read_arrays, write_arrays
from .forms import resolve_forms, tokenize_forms
from .options import OptionNames, check_vocab_size, is_vocab_size
from .tokenizers import fingerprint_matches, tokenizer_fingerprint, tokenizer_vocab_size

_MISSING = object()

__all__ = ["TokenTrie", "TrieStats"]

#: The trie's own arrays and their dtypes (the layout above): what save() writes, load() requires, validate() checks.
ARRAYS = {
    "child_ptr": np.int32,
    "token": np.int32,
    "node_entry": np.int32,
    "entry_node": np.int32,
    "level_ptr": np.int64,
}
#: The entry tables a trie may carry; each is saved as ``<label>_blob`` (uint8) and ``<label>_offsets`` (int64).
TABLES = ("names", "keys")


#: ``vocab_size`` of the builders; a bad one is an :class:`InvalidTokenError` (every token id is checked against it).
VOCAB_SIZE = OptionNames(error=InvalidTokenError)


def _index(value: Any, what: str, count: int, plural: str) -> int:
    """``value`` as an int in ``[0, count)``: a node id or an entry index (``what``, ``plural``) of a trie of ``count`` of them.

    Raises:
        InvalidEntryError: ``value`` is not an integer (a float would be truncated, a bool read as 0 or 1).
        IndexError: it is out of range.
    """
    if not _is_integer(value):
        raise InvalidEntryError(f"{what} {value!r:.40} is {type(value).__name__}, not an integer")
    index = int(value)
    if not 0 <= index < count:
        raise IndexError(f"{what} {index} is not in this trie (it has {count} {plural})")
    return index


def _options_json(options: Mapping[str, Any]) -> str:
    """``options`` as the JSON text a trie file records them in (what :meth:`TokenTrie.load` reads back).

    Raises:
        InvalidEntryError: ``options`` is not a dict with string keys, or a value is not JSON (a numpy scalar, a
            set, an array): the key is named.
    """
    if not isinstance(options, Mapping):
        raise InvalidEntryError(f"options must be a dict (recorded in the trie file as JSON), got "
                                f"{type(options).__name__}")
    for key, value in options.items():
        if not isinstance(key, str):
            raise InvalidEntryError(f"options key {key!r:.40} is {type(key).__name__}: the keys of options are strings "
                                    "(JSON would turn it into one)")
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise InvalidEntryError(f"options[{key!r:.40}] is {type(value).__name__} {value!r:.40}, which JSON cannot "
                                    "hold (options are recorded in the trie file as JSON): give a str, int, float, "
                                    "bool or None, or lists and dicts of them (int(x) for a numpy integer)") from exc
    return json.dumps(options, sort_keys=True)


def check_fingerprint(fingerprint: Any) -> str:
    """``fingerprint``, the builders' argument, once it is known to be text a trie file can record (a builder calls
    it before its work; a ``TokenTrie`` on construction).

    Raises:
        InvalidEntryError: not a string (None included: ``""`` is an unknown tokenizer), or a lone surrogate (save()
            failed inside safetensors on either).
    """
    what = "fingerprint must be UTF-8 text (the tokenizer's tokenizer_fingerprint, or \"\" when unknown), got"
    if not isinstance(fingerprint, str):
        raise InvalidEntryError(f"{what} {type(fingerprint).__name__} {fingerprint!r:.40}")
    utf8_bytes(fingerprint, what)
    return fingerprint


class TrieStats(dict):
    """Counts that describe a trie (a dict, printable and JSON-serializable)."""


class ForcedRuns:
    """Where the model has no choice: the one definition of a forced run, used by fast-forward (transformers and
    vLLM), the vLLM stop-at-forced option, ``TokenTrie.forced_run`` and ``TokenTrie.stats``.

    A node is *forced* when it has exactly one child and no entry ends there. The run from a node follows forced
    nodes down to the first node that is not forced.

    Attributes:
        forced: whether each node is forced. Shape: (N,), bool.
        length: number of tokens in the run from each node (0 at branching nodes, entry ends and leaves).
            Shape: (N,), int32.
        end: the node where the run from each node stops (the node itself when the length is 0). Shape: (N,), int32.
        ends_entry: whether the run from each node ends at a leaf, i.e. completes an entry with no way on.
            Shape: (N,), bool.
    """

    __slots__ = ("forced", "length", "end", "ends_entry")

    def __init__(self, forced: np.ndarray, length: np.ndarray, end: np.ndarray, ends_entry: np.ndarray) -> None:
        self.forced, self.length, self.end, self.ends_entry = forced, length, end, ends_entry
        for array in (forced, length, end, ends_entry):
            array.flags.writeable = False

    @classmethod
    def of(cls, trie: "TokenTrie") -> "ForcedRuns":
        """Computed one depth level at a time, deepest first (a child's run is known before its parent's)."""
        n = trie.num_nodes
        ptr = trie.child_ptr.astype(np.int64)
        fanout = np.diff(ptr)
        forced = (fanout == 1) & (trie.node_entry < 0)
        first_child = np.minimum(ptr[:-1], n - 1)
        length = np.zeros(n, dtype=np.int32)
        end = np.arange(n, dtype=np.int32)
        level = trie.level_ptr
        for depth in range(len(level) - 2, -1, -1):
            lo, hi = int(level[depth]), int(level[depth + 1])
            f = forced[lo:hi]
            child = first_child[lo:hi]
            length[lo:hi] = np.where(f, 1 + length[child], 0)
            end[lo:hi] = np.where(f, end[child], end[lo:hi])
        return cls(forced, length, end, fanout[end] == 0)


class TokenTrie:
    """An immutable trie over token-id sequences, stored as flat numpy arrays.

    Build it with :meth:`from_sequences` or :meth:`from_strings` (JSON descriptors: :mod:`trie_decode.descriptors`);
    save it with :meth:`save` and memory-map it back with :meth:`load`.

    An entry that is a prefix of another entry is a terminal node with children. Duplicate entries are merged
    (``stats()["duplicates"]`` counts them); an entry keeps the name and key of its first occurrence.
    """

    __slots__ = (
        "child_ptr",
        "token",
        "node_entry",
        "entry_node",
        "level_ptr",
        "vocab_size",
        "fingerprint",
        "options",
        "num_duplicates",
        "_names",
        "_keys",
        "_parent",
        "_forced",
        "_derived",
        "extra",
        "__weakref__",
    )

    def __init__(
        self,
        *,
        child_ptr: np.ndarray,
        token: np.ndarray,
        node_entry: np.ndarray,
        entry_node: np.ndarray,
        level_ptr: np.ndarray,
        vocab_size: int,
        names: Optional[StringTable] = None,
        keys: Optional[StringTable] = None,
        fingerprint: str = "",
        options: Optional[Mapping[str, Any]] = None,
        num_duplicates: int = 0,
    ) -> None:
        self.child_ptr = child_ptr
        self.token = token
        self.node_entry = node_entry
        self.entry_node = entry_node
        self.level_ptr = level_ptr
        self.vocab_size = int(vocab_size)
        self.fingerprint = check_fingerprint(fingerprint)
        self.options = dict(options or {})
        self.num_duplicates = int(num_duplicates)
        self._names = names
        self._keys = keys
        self._parent: Optional[np.ndarray] = None
        self._forced: Optional[ForcedRuns] = None
        self._derived: dict[Any, Any] = {}
        #: Arrays that ride along in the trie's file (e.g. a catalog's items per entry, :mod:`trie_decode.catalogs`).
        self.extra: dict[str, np.ndarray] = {}
        for array in (child_ptr, token, node_entry, entry_node, level_ptr):
            if array.flags.writeable:
                array.flags.writeable = False

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_sequences(
        cls,
        sequences: Any,
        vocab_size: int,
        *,
        names: Optional[Iterable[str]] = None,
        keys: Optional[Iterable[Any]] = None,
        fingerprint: str = "",
        options: Optional[Mapping[str, Any]] = None,
    ) -> "TokenTrie":
        """Build a trie from token-id sequences.

        Args:
            sequences: a list of token-id sequences (lists, tuples, 1-D arrays), a 2-D integer array, or
                :class:`~trie_decode._build.RaggedTokens`.
            vocab_size: every token id must be in ``[0, vocab_size)``.
            names: optional text per input sequence (same length as ``sequences``; a list, or any iterable, read
                once); each a ``str``.
            keys: optional external id per input sequence (converted with ``str``; None is refused, not ``"None"``).
            fingerprint: the tokenizer's :func:`~trie_decode.tokenizer_fingerprint`, if known.
            options: builder options recorded in the file's metadata (as JSON: str, int, float, bool, None, lists
                and dicts of them).

        Raises:
            EmptyTrieError: no sequences. InvalidEntryError: an empty or non-sequence entry, a name that is not a
                string, a key that is None; names or keys that are a single string, a set or a dict, or of another
                length; options that JSON cannot hold; a fingerprint that is not a string (None included).
            InvalidTokenError: a token id that is not an integer or is outside ``[0, vocab_size)``.
        """
        check_vocab_size(vocab_size, VOCAB_SIZE)
        check_fingerprint(fingerprint)  # refused before the build, not at save()
        if options is not None:
            _options_json(options)  # refused before the build, not at save()
        ragged = to_ragged(sequences)
        check_tokens(ragged, int(vocab_size))
        if names is not None:
            names = entry_column(names, "names", len(ragged), "sequences")
        if keys is not None:
            keys = entry_column(keys, "keys", len(ragged), "sequences")
        if names is not None:
            check_names(names)
        if keys is not None:
            check_keys(keys)
        built = build_arrays(ragged, int(vocab_size))
        source = built.entry_source.tolist()
        name_table = StringTable.from_strings([str(names[i]) for i in source], "name") if names is not None else None
        key_table = StringTable.from_strings([str(keys[i]) for i in source], "key") if keys is not None else None
        return cls._from_built(built, int(vocab_size), name_table, key_table, fingerprint, options)

    @classmethod
    def _from_built(
        cls,
        built: BuiltArrays,
        vocab_size: int,
        names: Optional[StringTable],
        keys: Optional[StringTable],
        fingerprint: str,
        options: Optional[Mapping[str, Any]],
    ) -> "TokenTrie":
        """A trie of ``built`` with the entry tables ``names`` and ``keys`` (in entry order)."""
        return cls(
            child_ptr=built.child_ptr,
            token=built.token,
            node_entry=built.node_entry,
            entry_node=built.entry_node,
            level_ptr=built.level_ptr,
            vocab_size=vocab_size,
            names=names,
            keys=keys,
            fingerprint=fingerprint,
            options=options,
            num_duplicates=built.num_duplicates,
        )

    @classmethod
    def from_strings(
        cls,
        strings: Sequence[str],
        tokenizer: Any,
        *,
        leading_space: Any = None,
        context: Any = None,
        keys: Optional[Iterable[Any]] = None,
        normalize: Optional[str] = None,
        on_unstable: str = "raise",
    ) -> "TokenTrie":
        """Build a trie from entry strings with the model's tokenizer, holding the ids the model writes in context.

        A model writes an entry with different ids depending on what precedes it. Say where the entries go and the
        trie holds those ids: ``context="The answer is"`` (the end of the prompt, or the trigger) tokenizes
        ``"The answer is France"`` and keeps the ids after the context's own (checking that the context's ids are
        unchanged by what follows, else :class:`~trie_decode.tokenizers.ContextError` with the fix). The shortcuts
        ``leading_space=True`` (after a word and a space) and ``False`` (at the start of a line: after a newline
        or a chat header ending with one) do the same after a fixed anchor text, so SentencePiece's dummy prefix
        is handled for every family. Several forms may be stored at once (lists for either argument): all forms of
        a string are entries with the same name and key, and ``match``/``rank`` report the entry, not the form.
        :func:`trie_decode.forms.check_prompt` tells whether a given prompt and the trie agree.

        Args:
            strings: the entries' texts; they become the entries' names. A special token's text in one (``"</s>"``)
                is text: the trie holds the ordinary tokens that write it, never the special token.
            tokenizer: the tokenizer of the model that will generate (its fingerprint is recorded).
            leading_space: a bool or a list of bools (see :func:`~trie_decode.tokenize_strings`). Default: False
                when no ``context`` is given.
            context: a string or a list of strings: the text the entries follow (see
                :func:`~trie_decode.tokenizers.tokenize_in_context`; a space is put between a context that ends
                with a word and the entry, none after a newline or an opening quote).
            keys: optional external id per string (shared by the string's forms).
            normalize: ``"NFC"`` (or ``"NFKC"``, ``"NFD"``, ``"NFKD"``): normalize each string before tokenizing,
                as Qwen's tokenizer does to its input; recorded in ``options``. Names stay as given.
            on_unstable: what a ``context`` does with an entry whose first characters merge with the context's last
                token (``'"'`` before ``"-hello"``): ``"raise"`` (:class:`~trie_decode.tokenizers.ContextError`
                naming it) or ``"raw"`` (store the entry's own tokens there, the ids the model can write after the
                context's own; recorded in ``options``). ``"raw"`` needs a ``context`` (the ``leading_space`` forms
                always keep such an entry's own tokens).

        Raises:
            InvalidEntryError: no tokenizer, not a list of non-empty strings (a set or a dict has no order of its
                own), or a bad option (``on_unstable="raw"`` without a ``context`` too); ``keys`` not a list of one
                per string; a string that tokenizes to no token in a form (its index and the form are named).
            EmptyTrieError: no strings.
            ContextError: a context merges with an entry (e.g. it ends with a space) and ``on_unstable="raise"``.

        Example:
            >>> from transformers import AutoTokenizer                      # doctest: +SKIP
            >>> tok = AutoTokenizer.from_pretrained(model_dir)              # doctest: +SKIP
            >>> trie = TokenTrie.from_strings(["France", "Germany"], tok, context="The answer is")  # doctest: +SKIP
            >>> both = TokenTrie.from_strings(["France"], tok, leading_space=[True, False])          # doctest: +SKIP
            >>> [both.entry(i).name for i in range(both.num_entries)]                                # doctest: +SKIP
            ['France', 'France']
        """
        if not callable(tokenizer) or not hasattr(tokenizer, "get_vocab"):  # a plain function failed when called
            raise InvalidEntryError(f"from_strings needs the model's tokenizer (a Hugging Face tokenizer: callable, "
                                    f"with get_vocab()) to tokenize the strings, got {type(tokenizer).__name__}")
        strings = entry_strings(strings)
        if not strings:
            raise EmptyTrieError("the set of entries is empty: a trie needs at least one entry")
        if keys is not None:
            keys = entry_column(keys, "keys", len(strings), "strings")
        forms = resolve_forms(leading_space, context)
        sequences, source = tokenize_forms(strings, tokenizer, forms, normalize=normalize, on_unstable=on_unstable)
        options: dict[str, Any] = {"source": "strings"}
        spaces = [v for kind, v in forms if kind == "leading_space"]
        contexts = [v for kind, v in forms if kind == "context"]
        if spaces:
            options["leading_space"] = spaces[0] if len(spaces) == 1 and not isinstance(leading_space, list) else spaces
        if contexts:
            options["context"] = contexts[0] if isinstance(context, str) else contexts
        if normalize is not None:
            options["normalize"] = normalize
        if contexts and on_unstable != "raise":
            options["on_unstable"] = on_unstable
        if len(forms) > 1:
            options["forms"] = len(forms)
        return cls.from_sequences(
            sequences,
            tokenizer_vocab_size(tokenizer),
            names=[strings[i] for i in source],
            keys=[keys[i] for i in source] if keys is not None else None,
            fingerprint=tokenizer_fingerprint(tokenizer),
            options=options,
        )

    # ------------------------------------------------------------------ sizes
    root: int = 0

    @property
    def num_nodes(self) -> int:
        return len(self.token)

    @property
    def num_entries(self) -> int:
        return len(self.entry_node)

    @property
    def max_depth(self) -> int:
        return len(self.level_ptr) - 2

    @property
    def max_token(self) -> int:
        """The largest token id in the trie, -1 when it has no edge (computed once: one pass over ``token``)."""
        return self.derived("max_token", lambda: int(self.token[1:].max()) if self.num_nodes > 1 else -1)

    def __len__(self) -> int:
        return self.num_entries

    @property
    def nbytes(self) -> int:
        """Bytes held by the trie structure (names and keys excluded)."""
        return sum(getattr(self, name).nbytes for name in ARRAYS)

    @property
    def fanout(self) -> np.ndarray:
        """Number of children of every node. Shape: (N,), dtype int32."""
        return np.diff(self.child_ptr)

    @property
    def parent(self) -> np.ndarray:
        """Parent of every node (-1 for the root), computed once on first use. Shape: (N,), dtype int32."""
        if self._parent is None:
            parent = np.repeat(np.arange(self.num_nodes, dtype=np.int32), self.fanout)
            self._parent = np.concatenate([np.array([-1], dtype=np.int32), parent])
            self._parent.flags.writeable = False
        return self._parent

    def stats(self) -> TrieStats:
        """Entries, nodes, depth, bytes per node, fanout histogram, and the share of forced (no-choice) steps."""
        fanout = self.fanout
        forced_nodes = self.forced_runs().forced
        hist_edges = [0, 1, 2, 3, 5, 9, 17, 33, 65, 129, 257, 1025, 4097, 1 << 62]
        counts, _ = np.histogram(fanout, bins=hist_edges)
        labels = [f"{lo}" if hi - lo == 1 else f"{lo}-{hi - 1}" for lo, hi in zip(hist_edges[:-1], hist_edges[1:])]
        labels[-1] = f">={hist_edges[-2]}"
        # Share of the tokens of all entries that are forced: an entry's token is forced when its parent node has
        # exactly one child and is not itself an entry end.
        parent = self.parent[1:]
        entries_below = self._entries_below()
        forced_tokens = int(entries_below[1:][forced_nodes[parent]].sum())
        total_tokens = int(entries_below[1:].sum())
        return TrieStats(
            entries=self.num_entries,
            duplicates_merged=self.num_duplicates,
            nodes=self.num_nodes,
            max_depth=self.max_depth,
            bytes=self.nbytes,
            bytes_per_node=round(self.nbytes / self.num_nodes, 2),
            root_fanout=int(fanout[0]),
            max_fanout=int(fanout.max()),
            fanout_histogram={k: int(v) for k, v in zip(labels, counts) if v},
            forced_token_share=round(forced_tokens / max(total_tokens, 1), 4),
            vocab_size=self.vocab_size,
            fingerprint=self.fingerprint,
        )

    def _entries_below(self) -> np.ndarray:
        """Number of entries whose token path passes through each node (the node itself included)."""
        count = (self.node_entry >= 0).astype(np.int64)
        parent = self.parent
        for depth in range(self.max_depth, 0, -1):
            lo, hi = int(self.level_ptr[depth]), int(self.level_ptr[depth + 1])
            np.add.at(count, parent[lo:hi], count[lo:hi])
        return count

    # ------------------------------------------------------------------ queries
    def _check_node(self, node: int) -> int:
        """``node`` as an int: a node id of this trie (an :class:`InvalidEntryError` for a non-integer, a float or
        a bool included; an ``IndexError`` out of range)."""
        return _index(node, "node", self.num_nodes, "nodes")

    def _check_entry(self, index: int) -> int:
        """``index`` as an int: an entry index of this trie (errors as :meth:`_check_node`'s); also what
        :func:`trie_decode.catalogs.items_of` takes."""
        return _index(index, "entry", self.num_entries, "entries")

    def children(self, node: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens (sorted, a view) and node ids of the children of ``node``.

        Raises:
            InvalidEntryError: ``node`` is not an integer (a float, a string, a bool). IndexError: it is out of range.
        """
        node = self._check_node(node)
        lo, hi = int(self.child_ptr[node]), int(self.child_ptr[node + 1])
        return self.token[lo:hi], np.arange(lo, hi, dtype=np.int32)

    def step(self, node: int, token: int) -> int:
        """The child of ``node`` reached by ``token``, or -1 when ``token`` is not a child (binary search).

        Raises:
            InvalidTokenError: ``token`` is not an integer (a float, a string, a bool). InvalidEntryError, IndexError:
                a bad ``node``, as :meth:`children`.
        """
        if not _is_integer(token):
            raise InvalidTokenError(f"token {token!r:.40} is {type(token).__name__}, not an integer token id")
        node = self._check_node(node)
        lo, hi = int(self.child_ptr[node]), int(self.child_ptr[node + 1])
        i = lo + int(np.searchsorted(self.token[lo:hi], token))
        return i if i < hi and int(self.token[i]) == int(token) else -1

    def walk(self, tokens: Iterable[int], node: int = 0) -> int:
        """The node reached from ``node`` (default: the root) by ``tokens``, or -1 if they leave the trie."""
        for tok in tokens:
            node = self.step(node, tok)
            if node < 0:
                return -1
        return node

    def is_terminal(self, node: int) -> bool:
        """Whether an entry ends at ``node``."""
        return bool(self.node_entry[self._check_node(node)] >= 0)

    def derived(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """Data another module derives from this trie (device arrays, filter indexes), built by ``build()`` on first
        use and kept on the trie: it lives exactly as long as the trie. (A cache keyed by the trie outside it would
        keep the trie alive when the data refers back to it.)

        Example:
            >>> trie = TokenTrie.from_sequences([[1, 2]], vocab_size=4)
            >>> trie.derived("depth", lambda: trie.max_depth + 1), trie.derived("depth", lambda: 0)
            (3, 3)
        """
        found = self._derived.get(key, _MISSING)
        if found is _MISSING:
            found = self._derived[key] = build()
        return found

    def forced_runs(self) -> "ForcedRuns":
        """Per node, the run of tokens forced from it (computed once, vectorized: see :class:`ForcedRuns`)."""
        if self._forced is None:
            self._forced = ForcedRuns.of(self)
        return self._forced

    def forced_run(self, node: int) -> list[int]:
        """The tokens that follow ``node`` while there is exactly one way on (one child and no entry ending)."""
        node = self._check_node(node)
        ptr, token = self.child_ptr, self.token
        run: list[int] = []
        for _ in range(int(self.forced_runs().length[node])):
            node = int(ptr[node])  # a forced node's only child is its first child
            run.append(int(token[node]))
        return run

    def tokens_of(self, node: int) -> tuple[int, ...]:
        """The token path from the root to ``node``."""
        node = self._check_node(node)
        parent, out = self.parent, []
        while node > 0:
            out.append(int(self.token[node]))
            node = int(parent[node])
        return tuple(reversed(out))

    def entry(self, index: int) -> Entry:
        """Entry number ``index`` with its name, key and tokens.

        Raises:
            InvalidEntryError: ``index`` is not an integer (a float, a string, a bool). IndexError: out of range.
        """
        index = self._check_entry(index)
        return Entry(
            index=index,
            name=self._names[index] if self._names is not None else None,
            key=self._keys[index] if self._keys is not None else None,
            tokens=self.tokens_of(int(self.entry_node[index])),
            item_keys=catalog_item_keys(self.extra, index) if self.extra else None,
        )

    def entry_at(self, node: int) -> Optional[Entry]:
        """The entry that ends at ``node``, or None if ``node`` is not terminal."""
        index = int(self.node_entry[self._check_node(node)])
        return self.entry(index) if index >= 0 else None

    def lookup(self, tokens: Iterable[int]) -> Optional[Entry]:
        """The entry whose tokens are exactly ``tokens``, or None."""
        node = self.walk(tokens)
        return self.entry_at(node) if node >= 0 else None

    def names(self) -> Optional[list[str]]:
        """All entry names in entry order, or None if the trie has no names."""
        return self._names.to_list() if self._names is not None else None

    def sequences(self) -> list[tuple[int, ...]]:
        """All entries' token sequences, in entry order."""
        return [self.tokens_of(int(n)) for n in self.entry_node]

    def entry_tokens(self, entries: np.ndarray) -> RaggedTokens:
        """The token sequences of entries ``entries``, packed, vectorized over entries (a loop over depth only).

        Args:
            entries: entry indices. Shape: (K,), int64.

        Raises:
            InvalidEntryError: ``entries`` is not a 1-D integer array. IndexError: an index is out of range.
        """
        nodes = self.entry_node[self._entry_indices(entries, "entry_tokens")]
        return token_paths(nodes, self.parent, self.token, self.level_ptr)

    def _entry_indices(self, entries: Any, what: str) -> np.ndarray:
        """``entries`` as int64 entry indices, checked: integers (a boolean mask is not a list of indices) and in
        range (numpy would read a negative index from the end without a word)."""
        index = np.asarray(entries)
        if index.ndim != 1 or (index.size and (index.dtype == np.bool_ or not np.issubdtype(index.dtype, np.integer))):
            raise InvalidEntryError(
                f"{what}: entries must be a 1-D array of entry indices, not {index.dtype} of shape {index.shape}"
            )
        if index.size and (index.min() < 0 or index.max() >= self.num_entries):  # in its own dtype: no wrapping
            bad = index[(index < 0) | (index >= self.num_entries)][0]
            raise IndexError(f"{what}: entry index {bad} is out of range for a trie of {self.num_entries} entries")
        return index.astype(np.int64, copy=False)

    def subset(self, entries: np.ndarray) -> "TokenTrie":
        """The trie of entries ``entries`` only, in that order (names, keys, fingerprint and options kept; ``extra``
        arrays are not): what a static allow or deny filter decodes as. Built by pruning: the nodes on no kept
        entry's path are dropped and the rest keep their order, which is the breadth-first, token-sorted numbering a
        build of those entries gives (a few passes over the nodes, about 12 ms per million nodes). A few entries of a
        large trie are built from their tokens instead: the same arrays, for less than a pass over every node.

        Args:
            entries: distinct entry indices. Shape: (K,), int64.

        Raises:
            EmptyTrieError: ``entries`` is empty.
            InvalidEntryError: ``entries`` is not a 1-D integer array (e.g. a boolean mask).
            IndexError: an index is out of range.
            ValueError: an index is given twice.

        Example:
            >>> trie = TokenTrie.from_sequences([[5, 6], [5, 7], [8]], vocab_size=9, keys=["a", "b", "c"])
            >>> small = trie.subset(np.array([2, 0]))
            >>> small.sequences(), [small.entry(i).key for i in range(2)]
            ([(8,), (5, 6)], ['c', 'a'])
        """
        entries = self._entry_indices(entries, "subset")
        if not len(entries):
            raise EmptyTrieError("a subset of no entries is an empty trie")
        ends = self.entry_node[entries]

        def column(table: Optional[StringTable]) -> Optional[StringTable]:
            return table.take(entries) if table is not None else None

        if len(entries) * (self.max_depth + 1) * 8 < self.num_nodes:  # a build costs about 8 node passes a token
            if len(np.unique(ends)) != len(entries):  # entries end at distinct nodes
                raise ValueError("subset: an entry index is given twice")
            built = build_arrays(self.entry_tokens(entries), self.vocab_size)  # distinct: entry i is entries[i]
            return self._rebuilt(built, column(self._names), column(self._keys))
        keep = np.zeros(self.num_nodes, dtype=np.bool_)
        keep[ends] = True
        if np.count_nonzero(keep) != len(entries):  # a repeat marks one node twice
            raise ValueError("subset: an entry index is given twice")
        keep[0] = True
        parent, level = self.parent, self.level_ptr
        for depth in range(self.max_depth, 0, -1):  # the kept nodes' parents, deepest level first
            lo, hi = int(level[depth]), int(level[depth + 1])
            keep[parent[lo:hi][keep[lo:hi]]] = True
        new_id = np.zeros(self.num_nodes + 1, dtype=np.int64)  # new_id[n]: the kept nodes before node n
        np.cumsum(keep, out=new_id[1:])
        num_nodes = int(new_id[-1])
        child_ptr = np.append(new_id[self.child_ptr[:-1]][keep], num_nodes)  # a node's kept children stay contiguous
        level_ptr = new_id[level]
        level_ptr = level_ptr[: np.count_nonzero(np.diff(level_ptr)) + 1]  # levels left with no node are gone
        entry_node = new_id[ends]
        node_entry = np.full(num_nodes, -1, dtype=np.int32)
        node_entry[entry_node] = np.arange(len(entries), dtype=np.int32)
        built = BuiltArrays(child_ptr=child_ptr.astype(np.int32), token=self.token[keep], node_entry=node_entry,
                            entry_node=entry_node.astype(np.int32), level_ptr=level_ptr, entry_source=entries,
                            num_duplicates=0)
        return self._rebuilt(built, column(self._names), column(self._keys))

    def _rebuilt(self, built: BuiltArrays, names: Optional[StringTable], keys: Optional[StringTable]) -> "TokenTrie":
        """A trie of ``built`` with ``names`` and ``keys`` and this trie's vocabulary, fingerprint and options (not its
        ``extra`` arrays): what :meth:`subset` and a live catalog's compaction (:mod:`trie_decode.live`) return."""
        return TokenTrie._from_built(built, self.vocab_size, names, keys, self.fingerprint, self.options)

    # ------------------------------------------------------------------ checks
    def check_tokenizer(self, tokenizer: Any) -> None:
        """Raise :class:`TokenizerMismatchError` if ``tokenizer`` is not the one this trie was built for."""
        if not self.fingerprint:
            vocab = tokenizer_vocab_size(tokenizer)
            if self.max_token >= vocab:  # not vocab_size: a trie as wide as a model's padded logits is fine
                raise TokenizerMismatchError(
                    f"the trie uses token ids up to {self.max_token} but the tokenizer has only {vocab} tokens"
                )
            return
        if not fingerprint_matches(self.fingerprint, tokenizer):  # the current or the legacy (pre-0.2) fingerprint
            actual = tokenizer_fingerprint(tokenizer)
            raise TokenizerMismatchError(
                f"this trie was built for a tokenizer with vocabulary fingerprint {self.fingerprint}, "
                f"but the tokenizer given has fingerprint {actual}: rebuild the trie with this tokenizer"
            )

    def validate(self) -> None:
        """Check every structural invariant in O(N) vectorized passes; raise :class:`TrieFileError` on failure.

        After it passes, every array has the dtype and shape the layout says, every pointer is in range, the nodes
        form a tree in breadth-first order (no cycles, no orphans), and every leaf ends an entry, so walking and
        masking cannot index out of bounds or loop.
        """

        def fail(msg: str) -> None:
            raise TrieFileError(f"invalid trie: {msg}")

        for label, dtype in ARRAYS.items():
            array = getattr(self, label)
            if not isinstance(array, np.ndarray) or array.ndim != 1 or array.dtype != np.dtype(dtype):
                got = f"{getattr(array, 'dtype', type(array).__name__)} of shape {getattr(array, 'shape', '?')}"
                fail(f"{label} must be a 1-D {np.dtype(dtype).name} array, not {got}")
        if not is_vocab_size(self.vocab_size):
            fail(f"vocab_size {self.vocab_size!r:.40} is not in [1, 2**31]")
        n = self.num_nodes
        if n < 2:
            fail("it has no nodes besides the root")
        if self.child_ptr.shape != (n + 1,) or self.node_entry.shape != (n,):
            fail("array lengths disagree")
        ptr = self.child_ptr.astype(np.int64)
        if ptr[0] != 1 or ptr[-1] != n or np.any(np.diff(ptr) < 0):
            fail("child_ptr is not a monotone pointer array from 1 to the node count")
        if int(self.token[0]) != -1:
            fail("the root's token is not -1")
        tok = self.token[1:]
        if tok.size and (int(tok.min()) < 0 or int(tok.max()) >= self.vocab_size):
            fail(f"a token id is outside [0, {self.vocab_size})")
        lp = self.level_ptr
        if lp.size < 3 or lp[0] != 0 or lp[1] != 1 or lp[-1] != n or np.any(np.diff(lp) <= 0):
            fail("level_ptr is inconsistent")
        # child_ptr is monotone from 1 to n, so every node but the root has exactly one parent (the cached parent
        # array is recomputed here: validate() must not trust a cache built before the arrays were checked).
        parent = np.concatenate([np.array([-1], dtype=np.int64), np.repeat(np.arange(n, dtype=np.int64), np.diff(ptr))])
        # Siblings strictly increasing: within each parent's run, token[i] < token[i+1].
        same_parent = parent[2:] == parent[1:-1]
        if np.any(same_parent & (self.token[2:] <= self.token[1:-1])):
            fail("children are not sorted by token or hold a duplicate")
        # Breadth-first numbering: each node's parent is one level up (so it comes first: no cycles, no orphans).
        depth = np.searchsorted(lp, np.arange(n), side="right") - 1
        if np.any(depth[parent[1:]] != depth[1:] - 1):
            fail("level_ptr does not match the parent links (nodes are not in breadth-first order)")
        e = self.num_entries
        if e == 0:
            fail("it has no entries")
        if int(self.entry_node.min()) < 1 or int(self.entry_node.max()) >= n:
            fail("an entry points outside the node range")
        if not np.array_equal(self.node_entry[self.entry_node], np.arange(e, dtype=self.node_entry.dtype)):
            fail("entry_node and node_entry disagree")
        if int(np.count_nonzero(self.node_entry >= 0)) != e:
            fail("a node is terminal without an entry")
        leaves = np.diff(ptr) == 0
        if np.any(leaves & (self.node_entry < 0)):
            fail("a leaf node is not the end of an entry")
        for label, table in zip(TABLES, (self._names, self._keys)):
            problem = table.problem(e) if table is not None else None
            if problem:
                fail(f"the {label} table {problem}")
        problem = catalog_problem(self.extra, e)  # a catalog's item lists (trie_decode.catalogs), when it is one
        if problem:
            fail(f"the catalog {problem}")
        problem = filter_arrays_problem(self.extra, e)  # a live catalog's retired keys and numbers (trie_decode.live)
        if problem:
            fail(f"the filter arrays: {problem}")

    # ------------------------------------------------------------------ files
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the trie as a safetensors file (arrays + metadata; never pickle)."""
        arrays = {name: getattr(self, name) for name in ARRAYS}
        for label, table in zip(TABLES, (self._names, self._keys)):
            if table is not None:
                arrays[f"{label}_blob"] = table.blob
                arrays[f"{label}_offsets"] = table.offsets
        metadata = {
            "vocab_size": str(self.vocab_size),
            "fingerprint": self.fingerprint,
            "options": _options_json(self.options),
            "num_entries": str(self.num_entries),
            "num_nodes": str(self.num_nodes),
            "num_duplicates": str(self.num_duplicates),
        }
        for name, array in self.extra.items():
            if name in arrays:
                raise TrieFileError(f"extra array {name!r} would replace one of the trie's own arrays")
            arrays[name] = array
        write_arrays(path, arrays, metadata)

    @classmethod
    def load(
        cls, path: str | os.PathLike[str] | BinaryIO, *, tokenizer: Any = None, verify: bool = True
    ) -> "TokenTrie":
        """Memory-map a trie file written by :meth:`save`.

        Args:
            path: the file, or a binary file object opened on it (see :func:`trie_decode.fileio.open_regular_file`).
                Only a regular file is read (a FIFO or device is refused without blocking).
            tokenizer: if given, raise :class:`TokenizerMismatchError` unless it is the trie's tokenizer.
            verify: check the arrays' CRC-32s and the structural invariants (reads the file once).

        Raises:
            TrieFileError: missing, truncated, corrupted, or not a trie file; arrays of the wrong dtype or shape;
                metadata that is malformed or disagrees with the arrays.
            TokenizerMismatchError: ``tokenizer`` differs from the one the trie was built with.
        """
        label = path if isinstance(path, (str, os.PathLike)) else getattr(path, "name", "<trie file>")
        arrays, meta = read_arrays(path, verify=verify)
        missing = [name for name in ARRAYS if name not in arrays]
        if missing:
            if meta.get("kind") == DELTA_KIND:  # "missing arrays ['child_ptr', ...]" did not say what it is
                raise TrieFileError(f"{label} is a live catalog's delta file (LiveCatalog.save_delta), not a trie: "
                                    "open it with its base, LiveCatalog.open(trie_path, delta_path)")
            raise TrieFileError(f"{label} is missing arrays {missing}")
        table_dtypes = {f"{t}_{part}": dt for t in TABLES for part, dt in (("blob", np.uint8), ("offsets", np.int64))}
        check_vectors(arrays, {**ARRAYS, **table_dtypes, **ITEM_DTYPES, **FILTER_DTYPES}, label)
        try:
            vocab_size = int(meta["vocab_size"])
            options = json.loads(meta.get("options", "{}"))
            num_duplicates = int(meta.get("num_duplicates", "0"))
            fingerprint = meta.get("fingerprint", "")
            if not isinstance(options, dict):
                raise ValueError("options is not a JSON object")
            if not is_vocab_size(vocab_size):
                raise ValueError(f"vocab_size {vocab_size} is not in [1, 2**31]")
            if num_duplicates < 0:
                raise ValueError(f"num_duplicates {num_duplicates} is negative")
            for key in ("num_nodes", "num_entries"):  # written by save(); must agree with the arrays when present
                if key in meta:
                    count = len(arrays["token" if key == "num_nodes" else "entry_node"])
                    if int(meta[key]) != count:
                        raise ValueError(f"{key} says {int(meta[key])} but the arrays hold {count}")
        except (KeyError, ValueError, TypeError, RecursionError) as exc:
            raise TrieFileError(f"{label}: malformed metadata ({exc})") from exc
        tables = {}
        for table_label in TABLES:
            if f"{table_label}_blob" in arrays or f"{table_label}_offsets" in arrays:
                if f"{table_label}_blob" not in arrays or f"{table_label}_offsets" not in arrays:
                    raise TrieFileError(
                        f"{label} has only half of the {table_label} table ({table_label}_blob/{table_label}_offsets)"
                    )
                tables[table_label] = StringTable(arrays[f"{table_label}_blob"], arrays[f"{table_label}_offsets"])
        trie = cls(
            **{name: arrays[name] for name in ARRAYS},
            vocab_size=vocab_size,
            names=tables.get("names"),
            keys=tables.get("keys"),
            fingerprint=fingerprint,
            options=options,
            num_duplicates=num_duplicates,
        )
        trie.extra = {name: a for name, a in arrays.items() if name not in ARRAYS and name not in table_dtypes}
        if verify:
            trie.validate()
        if tokenizer is not None:
            trie.check_tokenizer(tokenizer)
        return trie

    def __repr__(self) -> str:
        return (
            f"TokenTrie(entries={self.num_entries}, nodes={self.num_nodes}, max_depth={self.max_depth}, "
            f"vocab_size={self.vocab_size})"
        )
