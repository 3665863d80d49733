"""Serving security of the vLLM integration: which trie files a request may make the server open, and what one
request may cost the server.

Why this exists: over HTTP, ``"vllm_xargs": {"trie": ...}`` comes from any client, and the value is acted on by the
server. A path there used to be opened as sent (``~`` expanded), and the errors told the client whether the path
existed, its size and its first bytes. vLLM's own rule for files named by clients is the opposite
(``--allowed-local-media-path``: off by default, only under directories the operator names), and so is this one:

* **Files only where the operator allows them.** A request names either a trie the operator *registered by name*
  (``{"trie": "cities"}``) or a file inside an *allowed directory*. Anything else is refused with the same message,
  whether the path exists or not, whatever it holds. Paths are taken as sent (no ``~`` expansion; relative paths
  are relative to the server's working directory); the path as sent *and* its real path (symbolic links and ``..``
  resolved) must be inside an allowed directory, so the server touches nothing outside them to answer. Only
  regular files are opened (``O_NONBLOCK``, ``O_NOFOLLOW`` on the last component, ``fstat`` of the opened
  descriptor: never a FIFO, device, directory or a symlink swapped in after the check). A live catalog's delta file
  beside a trie file (:func:`trie_decode.live.delta_path_for`) is opened the same way, once, and read from that
  descriptor (:meth:`AccessPolicy.open_delta`): it is a regular file beside the trie file, never a link.
* **Refusals reveal nothing.** Errors a client sees carry no file bytes, sizes or header values: a file inside an
  allowed directory that fails to load gets a categorized message ("not a valid trie file"); the full reason goes
  to the server log (logger ``trie_decode.vllm``, rate-limited).
* **Bounded cost per request.** Inline lists are capped per request (entries and bytes), and the time a server
  process spends building tries that are not cached yet (inline lists, and first loads of files) is capped per
  time window; a request over either gets a 400 that says so. Cached tries cost nothing against the budget.
  The frontend (which validates every request) also hands each inline trie it built to the engine core through
  a private directory, so the engine's busy loop maps a file instead of tokenizing the list again.

The default is closed: with nothing configured a server accepts inline lists only. There is no separate, more
open default for offline ``LLM(...)`` use: vLLM does not tell a logits processor whether the process serves
untrusted clients (``LLM`` can sit behind a web app, ``AsyncLLM`` is used both ways), so offline users set the
same environment variables (before creating the ``LLM``: its engine process inherits them).

Configuration (environment variables, read by every process of the server; see docs/vllm.md "Security"):

    TRIE_DECODE_ALLOWED_DIRS      directories (``os.pathsep``-separated, like PATH) whose trie files requests may
                                  name. Default: none.
    TRIE_DECODE_NAMED_TRIES       tries requests refer to by name: ``cities=/data/cities.trie,towns=/data/t.trie``,
                                  a JSON object ``{"cities": "/data/cities.trie"}``, or the path of a JSON file
                                  holding one. Names: letters, digits, ``_ . -`` (up to 128). Default: none.
    TRIE_DECODE_VLLM_MAX_INLINE_ENTRIES / _BYTES   per-request inline caps (default 2,000 entries, 64 KiB of
                                  UTF-8 text or 4 bytes per token id).
    TRIE_DECODE_VLLM_MAX_FILTER_ITEMS  entries one request's ``allow`` or ``deny`` may name (default 100,000).
    TRIE_DECODE_VLLM_BUILD_BUDGET seconds of uncached building/loading per window, per process (default 1.0;
                                  ``inf`` turns the budget off, e.g. for offline batch jobs).
    TRIE_DECODE_VLLM_BUILD_WINDOW the window in seconds (default 10): at most 10% of the frontend's time.
    TRIE_DECODE_VLLM_INLINE_CACHE_MB / _FILE_CACHE_MB  byte bounds of the trie caches (default 256 / 4096; the
                                  file cache counts mapped file sizes; counts: 64 inline, 32 files).
    TRIE_DECODE_VLLM_GROUP_CACHE_MB  byte bound of each engine processor's constraints (tries, device arrays and
                                  step tables of the (trie, rules) pairs requests used; default 1024, at most 256
                                  of them; the ones running requests use are never dropped).
    TRIE_DECODE_VLLM_HANDOFF_DIR  where the frontend hands built inline tries to the engine core (default
                                  ``$TMPDIR/trie_decode-<uid>/inline``, mode 0700, checked); ``off`` disables it.

**Front-end and engine must agree.** The front-end (API server) admits a request under its settings; the engine
core resolves the trie again under *its own* environment, and a logits processor cannot fail one request there
(vLLM 0.32 has no such hook: an exception would stop the engine), so a request the engine refuses only gets the
end token (HTTP 200, empty text, ``finish_reason`` ``"stop"``). To make that loud, the front-end stamps each
admitted request (``extra_args[STAMP_KEY]``: a digest of the settings that decide admission, and for a file the
real path and ``(st_dev, st_ino, st_mtime_ns)`` it loaded); the engine compares the stamp with its own view and
logs an ERROR naming the cause and the fix, once per distinct cause (:func:`diagnose_engine_refusal`). The stamp is
diagnostic only: the engine never opens anything because a stamp says so.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import io
import json
import logging
import os
import re
import stat
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Iterator, Optional

import numpy as np

from trie_decode.errors import TrieDecodeError, TrieFileError
from trie_decode.fileio import open_regular_file, text_lines
from trie_decode.live import apply_delta_file, delta_path_for
from trie_decode.trie import TokenTrie

__all__ = [
    "TrieAccessError",
    "AccessPolicy",
    "Limits",
    "BuildBudget",
    "HandoffStore",
    "current_policy",
    "load_allowed_file",
    "check_configuration",
    "current_limits",
    "build_budget",
    "handoff_store",
    "settings_digest",
    "make_stamp",
    "diagnose_engine_refusal",
    "STAMP_KEY",
    "ENV_ALLOWED_DIRS",
    "ENV_NAMED_TRIES",
]

logger = logging.getLogger("trie_decode.vllm")

ENV_ALLOWED_DIRS = "TRIE_DECODE_ALLOWED_DIRS"
ENV_NAMED_TRIES = "TRIE_DECODE_NAMED_TRIES"
ENV_MAX_INLINE_ENTRIES = "TRIE_DECODE_VLLM_MAX_INLINE_ENTRIES"
ENV_MAX_INLINE_BYTES = "TRIE_DECODE_VLLM_MAX_INLINE_BYTES"
ENV_BUILD_BUDGET = "TRIE_DECODE_VLLM_BUILD_BUDGET"
ENV_BUILD_WINDOW = "TRIE_DECODE_VLLM_BUILD_WINDOW"
ENV_INLINE_CACHE_MB = "TRIE_DECODE_VLLM_INLINE_CACHE_MB"
ENV_FILE_CACHE_MB = "TRIE_DECODE_VLLM_FILE_CACHE_MB"
ENV_HANDOFF_DIR = "TRIE_DECODE_VLLM_HANDOFF_DIR"
ENV_MAX_FILTER_ITEMS = "TRIE_DECODE_VLLM_MAX_FILTER_ITEMS"
ENV_GROUP_CACHE_MB = "TRIE_DECODE_VLLM_GROUP_CACHE_MB"
_ALL_ENV = (
    ENV_ALLOWED_DIRS, ENV_NAMED_TRIES, ENV_MAX_INLINE_ENTRIES, ENV_MAX_INLINE_BYTES, ENV_BUILD_BUDGET,
    ENV_BUILD_WINDOW, ENV_INLINE_CACHE_MB, ENV_FILE_CACHE_MB, ENV_HANDOFF_DIR, ENV_MAX_FILTER_ITEMS,
    ENV_GROUP_CACHE_MB,
)
#: The key of ``extra_args`` where the front-end records what it admitted (set by the front-end, replacing
#: whatever a client sent; read by the engine for diagnostics only).
STAMP_KEY = "trie_checked"

DEFAULT_MAX_INLINE_ENTRIES = 2_000
DEFAULT_MAX_INLINE_BYTES = 64 * 1024
DEFAULT_BUILD_BUDGET = 1.0
DEFAULT_BUILD_WINDOW = 10.0
DEFAULT_INLINE_CACHE_MB = 256
DEFAULT_FILE_CACHE_MB = 4096
DEFAULT_MAX_FILTER_ITEMS = 100_000
DEFAULT_GROUP_CACHE_MB = 1024
INLINE_CACHE_SIZE = 64
FILE_CACHE_SIZE = 32
GROUP_CACHE_SIZE = 256
MAX_PATH_CHARS = 4096
STALE_HANDOFF_S = 3600.0
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")


class TrieAccessError(TrieDecodeError, ValueError):
    """A request named a trie it may not use, or would cost more than the server allows (a client error: the
    vLLM integration turns it into ``TrieRequestError``, an HTTP 400). The message never describes a file the
    request may not read."""


class _ConfigError(TrieDecodeError, ValueError):
    """The operator's configuration is invalid (raised when the processor starts, never to a client)."""


# ---------------------------------------------------------------------------------------------- logging
class _RateLimitedLog:
    """At most ``burst`` messages per ``period`` seconds per category; the rest are counted and summarized."""

    def __init__(self, burst: int = 20, period: float = 60.0) -> None:
        self.burst, self.period = burst, period
        self.lock = threading.Lock()
        self.state: dict[str, list] = {}

    def __call__(self, category: str, level: int, msg: str, *args: Any) -> None:
        now = time.monotonic()
        with self.lock:
            start, count, dropped = self.state.get(category, (now, 0, 0))
            if now - start > self.period:
                if dropped:
                    logger.log(level, "trie_decode: %d more %s message(s) were not logged", dropped, category)
                start, count, dropped = now, 0, 0
            if count >= self.burst:
                self.state[category] = [start, count, dropped + 1]
                return
            self.state[category] = [start, count + 1, dropped]
        logger.log(level, msg, *args)


_log = _RateLimitedLog()


# ---------------------------------------------------------------------------------------------- configuration
def _env_number(name: str, default: float, kind: type = int, minimum: float = 0) -> Any:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise _ConfigError(f"{name}={raw!r} is not a {'number' if kind is float else 'whole number'}") from None
    if not value >= minimum:  # NaN too
        raise _ConfigError(f"{name}={raw!r} must be at least {minimum}")
    return value


@dataclass(frozen=True)
class Limits:
    """What one request, and one process per time window, may cost (see the module docstring for the knobs)."""

    max_inline_entries: int = DEFAULT_MAX_INLINE_ENTRIES
    max_inline_bytes: int = DEFAULT_MAX_INLINE_BYTES
    build_budget_s: float = DEFAULT_BUILD_BUDGET
    build_window_s: float = DEFAULT_BUILD_WINDOW
    inline_cache_bytes: int = DEFAULT_INLINE_CACHE_MB << 20
    file_cache_bytes: int = DEFAULT_FILE_CACHE_MB << 20
    max_filter_items: int = DEFAULT_MAX_FILTER_ITEMS
    group_cache_bytes: int = DEFAULT_GROUP_CACHE_MB << 20

    @classmethod
    def from_env(cls) -> "Limits":
        return cls(
            max_inline_entries=_env_number(ENV_MAX_INLINE_ENTRIES, DEFAULT_MAX_INLINE_ENTRIES, int, 1),
            max_inline_bytes=_env_number(ENV_MAX_INLINE_BYTES, DEFAULT_MAX_INLINE_BYTES, int, 1),
            build_budget_s=_env_number(ENV_BUILD_BUDGET, DEFAULT_BUILD_BUDGET, float, 0),
            build_window_s=_env_number(ENV_BUILD_WINDOW, DEFAULT_BUILD_WINDOW, float, 0.001),
            inline_cache_bytes=_env_number(ENV_INLINE_CACHE_MB, DEFAULT_INLINE_CACHE_MB, int, 0) << 20,
            file_cache_bytes=_env_number(ENV_FILE_CACHE_MB, DEFAULT_FILE_CACHE_MB, int, 0) << 20,
            max_filter_items=_env_number(ENV_MAX_FILTER_ITEMS, DEFAULT_MAX_FILTER_ITEMS, int, 1),
            group_cache_bytes=_env_number(ENV_GROUP_CACHE_MB, DEFAULT_GROUP_CACHE_MB, int, 0) << 20,
        )


def _is_inside(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory if directory.endswith(os.sep) else directory + os.sep)


def _parse_named(raw: str) -> dict[str, str]:
    raw = raw.strip()
    if not raw:
        return {}
    source = ENV_NAMED_TRIES
    if not raw.startswith("{") and "=" not in raw:  # the path of a JSON file
        source = f"{ENV_NAMED_TRIES} file {raw!r}"
        try:
            with open(raw, encoding="utf-8") as handle:
                raw = handle.read()
        except OSError as exc:
            raise _ConfigError(f"{source}: cannot read it ({exc.strerror})") from None
    if raw.lstrip().startswith("{"):
        try:
            table = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise _ConfigError(f"{source} is not valid JSON: {exc}") from None
        if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
            raise _ConfigError(f"{source} must be a JSON object of name -> trie file path")
        pairs = list(table.items())
    else:
        pairs = []
        for item in raw.split(","):
            if not item.strip():
                continue
            name, sep, path = item.partition("=")
            if not sep or not path.strip():
                raise _ConfigError(f"{source}: {item.strip()!r} is not name=path")
            pairs.append((name.strip(), path.strip()))
    named: dict[str, str] = {}
    for name, path in pairs:
        if not _NAME_RE.fullmatch(name):
            raise _ConfigError(f"{source}: trie name {name!r} must be letters, digits, '_', '.' or '-' (up to 128)")
        if name in named:
            raise _ConfigError(f"{source}: trie name {name!r} is given twice")
        if not os.path.isabs(os.path.expanduser(path)):
            raise _ConfigError(f"{source}: the path of {name!r} must be absolute, got {path!r}")
        named[name] = os.path.realpath(os.path.expanduser(path))  # the operator's own paths: ~ is fine here
    return named


@dataclass(frozen=True)
class Resolved:
    """Where a request's trie string points: ``kind`` is ``"named"`` or ``"file"``; ``path`` is the real path to
    open; ``value`` is the client's string (a registered name, or a path)."""

    kind: str
    path: str
    value: str
    what: str = "trie"  # the request option that named it (a filter file: "allow" or "deny")
    option: Optional[str] = None  # where in the request it was sent, when not extra_args[what] (a span's or slot's)

    @property
    def key(self) -> str:
        """Where the request sent the string, as messages name it (``extra_args['trie']``)."""
        return self.option or f"extra_args[{self.what!r}]"

    @property
    def label(self) -> str:
        """What messages to the client may say: the name, or the client's own string."""
        return f"named trie {self.value!r}" if self.kind == "named" else f"{self.value[:200]!r}"


@dataclass(frozen=True)
class AccessPolicy:
    """Which trie strings a request may use: registered names, and files inside allowed directories.

    Args:
        allowed_dirs: directories whose regular files requests may name (absolute; stored with their real paths).
        named: name -> trie file path, registered by the operator.
    """

    allowed_dirs: tuple[str, ...] = ()
    named: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        lexical, real = [], []
        for d in self.allowed_dirs:
            if not d or not os.path.isabs(os.path.expanduser(d)):
                raise _ConfigError(f"{ENV_ALLOWED_DIRS}: {d!r} is not an absolute directory path")
            d = os.path.abspath(os.path.expanduser(d))
            lexical.append(d)
            real.append(os.path.realpath(d))
            if real[-1] == os.sep:
                logger.warning("trie_decode: %s allows the whole file system ('/'): any client may name any file",
                               ENV_ALLOWED_DIRS)
        object.__setattr__(self, "_lexical", tuple(lexical))
        object.__setattr__(self, "_real", tuple(real))

    @classmethod
    def from_env(cls) -> "AccessPolicy":
        raw = os.environ.get(ENV_ALLOWED_DIRS, "")
        dirs = tuple(d.strip() for d in raw.split(os.pathsep) if d.strip())
        return cls(allowed_dirs=dirs, named=_parse_named(os.environ.get(ENV_NAMED_TRIES, "")))

    @property
    def serves_files(self) -> bool:
        return bool(self.allowed_dirs or self.named)

    def refusal(self, value: Any, what: str = "trie", option: Optional[str] = None) -> TrieAccessError:
        """The one message for every string that is neither a registered name nor inside an allowed directory
        (the same whether the path exists, whatever it is): it repeats the client's own string and nothing else.
        ``what``: the request option that named the file (``"trie"``, or a filter file's ``"allow"``/``"deny"``);
        ``option``: where in the request it was sent, when not ``extra_args[what]`` (a span's ``'trie'``, a
        template's slot), whose values may be sent inline as a list of strings instead."""
        label = f"{str(value)[:200]!r}"
        if what != "trie":
            how = (f"name a file inside a directory the operator allows ({ENV_ALLOWED_DIRS})" if self.allowed_dirs
                   else "this server serves no files: send the keys or entry indices inline")
            return TrieAccessError(f"extra_args[{what!r}]: {label} is not a file this server makes available; {how}")
        inline = "the values as an inline list of strings" if option else "an inline list of strings or token-id lists"
        if not self.serves_files:
            how = f"this server serves no trie files: send {inline}"
        else:
            names = sorted(self.named)
            shown = "none registered"
            if names:
                shown = f"registered names: {names[:20]}" + (" ..." if len(names) > 20 else "")
            how = (
                f"send a registered trie name ({shown}), a path inside a directory the operator allows "
                f"({ENV_ALLOWED_DIRS}), or {inline}"
            )
        where = option or "extra_args['trie']"
        return TrieAccessError(f"{where}: {label} is not a trie file this server makes available; {how}")

    def resolve(self, value: str, what: str = "trie", option: Optional[str] = None) -> Resolved:
        """Map a request's trie string to the file to open, or raise the generic refusal. ``option``: where in the
        request the string was sent, when not ``extra_args[what]`` (messages name it).

        The check is lexical first (the path as sent, made absolute and normalized, must be inside an allowed
        directory: nothing outside them is touched), then on the real path (symbolic links resolved).
        """
        if what == "trie" and value in self.named:
            return Resolved("named", self.named[value], value, what, option)
        if not self.allowed_dirs or not isinstance(value, str) or not value or len(value) > MAX_PATH_CHARS:
            raise self.refusal(value, what, option)
        try:
            lexical = os.path.abspath(value)  # no expanduser: '~' is an ordinary character in a request
            if not any(_is_inside(lexical, d) for d in self._lexical):  # type: ignore[attr-defined]
                _log("refused", logging.WARNING, "trie_decode: refused trie path %r: outside the allowed directories",
                     value[:300])
                raise self.refusal(value, what, option)
            real = os.path.realpath(lexical)
        except (ValueError, OSError):  # an embedded NUL byte, a path the OS cannot represent
            raise self.refusal(value, what, option) from None
        if not self._in_real_dirs(real):
            _log("refused", logging.WARNING,
                 "trie_decode: refused trie path %r: its real path %r is outside the allowed directories",
                 value[:300], real[:300])
            raise self.refusal(value, what, option)
        return Resolved("file", real, value, what, option)

    def _in_real_dirs(self, real: str) -> bool:
        """Whether a real path (links resolved) is strictly inside one of the allowed directories."""
        return any(_is_inside(real, d) and real != d for d in self._real)  # type: ignore[attr-defined]

    def open(self, resolved: Resolved) -> BinaryIO:
        """Open the resolved file (regular files only, never blocking). Errors name the category only; the reason
        is logged."""
        try:
            # Request paths: the real path was checked, so its last component must not be a link now.
            handle = open_regular_file(resolved.path, follow_symlinks=resolved.kind == "named")
        except TrieFileError as exc:
            _log("load", logging.WARNING, "trie_decode: cannot open %s (%s): %s", resolved.label, resolved.path, exc)
            noun = "trie file" if resolved.what == "trie" else "file"
            if resolved.kind == "named":
                why = (f"{resolved.label} is registered but cannot be opened on the server (the operator's "
                       "configuration; details in the server log)")
            elif isinstance(exc.__cause__, FileNotFoundError):  # by the cause: the path's own text may say anything
                why = f"no {noun} {resolved.label} in the allowed directories"
            else:
                why = f"{resolved.label} cannot be opened as a {noun} (not a regular readable file)"
            raise TrieAccessError(f"{resolved.key}: {why}") from None
        self._check_opened(handle, resolved)
        return handle

    def _check_opened(self, handle: BinaryIO, resolved: Resolved) -> None:
        """Refuse (and close) a descriptor opened for a request file that is not inside the allowed directories."""
        if resolved.kind != "file":
            return
        # What was opened, by the kernel's account: a directory above the file swapped for a link between the
        # check and the open would show here (Linux; elsewhere the O_NOFOLLOW open of the checked path stands).
        try:
            opened = os.readlink(f"/proc/self/fd/{handle.fileno()}")
        except OSError:
            opened = None
        if opened is not None and not self._in_real_dirs(opened):
            handle.close()
            _log("refused", logging.WARNING, "trie_decode: refused trie path %r: it opened %r, outside the "
                 "allowed directories (changed since the check)", resolved.value[:300], opened[:300])
            raise self.refusal(resolved.value, resolved.what, resolved.option)

    @contextlib.contextmanager
    def open_delta(self, resolved: Resolved) -> Iterator[Optional[BinaryIO]]:
        """Open the live catalog delta file beside a resolved trie file (:func:`~trie_decode.live.delta_path_for`)
        under this policy, or give None when there is none: one open (``O_NOFOLLOW``, ``O_NONBLOCK``, ``fstat`` of the
        opened descriptor, then the kernel's account of what it opened, as :meth:`open`); read the delta from the
        yielded descriptor, never by its path again. A delta file that is a symbolic link, a directory, a FIFO or a
        device is refused (the trie file would otherwise be served without its removals).

        Raises:
            TrieAccessError: the delta file is not a regular file inside the allowed directories.
        """
        path = delta_path_for(resolved.path)
        try:
            handle = open_regular_file(path, follow_symlinks=False)
        except TrieFileError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                yield None
                return
            _log("load", logging.WARNING, "trie_decode: refused the delta file %s of %s: %s", path, resolved.label, exc)
            raise TrieAccessError(
                f"{resolved.key}: {resolved.label} has a live catalog delta file beside it "
                f"({os.path.basename(path)!r}) that is not a regular file (a symbolic link, directory, FIFO or "
                "device): it is refused, and so is the trie; the operator must replace it by a regular file"
            ) from None
        with handle:
            self._check_opened(handle, resolved)
            yield handle

    def load(self, resolved: Resolved, handle: BinaryIO, delta: Optional[BinaryIO]) -> TokenTrie:
        """The trie of a file opened by :meth:`open`, verified, with the changes of its delta file (opened by
        :meth:`open_delta`, or None) folded in. Raises :class:`TrieAccessError` with a client-safe message that
        names the one that does not load (the trie file, or its delta file): its bytes never reach the client, the
        reason goes to the server log."""
        in_delta = False
        try:
            trie = TokenTrie.load(handle, verify=True)
            if delta is not None:
                in_delta = True
                trie = apply_delta_file(trie, delta)
            return trie
        except (TrieDecodeError, OSError, ValueError, KeyError, TypeError, IndexError, MemoryError) as exc:
            _log("load", logging.WARNING, "trie_decode: %s%s (%s) does not load: %s: %s",
                 "the delta file of " if in_delta else "", resolved.label, resolved.path, type(exc).__name__, exc)
            if in_delta:
                why = ("has a live catalog delta file beside it that is not a valid delta for it (corrupted, or "
                       "written for another trie; details in the server log)")
            else:
                why = ("is not a valid trie file (truncated, corrupted, or not written by TokenTrie.save / "
                       "trie-decode build; details in the server log)")
            raise TrieAccessError(f"{resolved.key}: {resolved.label} {why}") from None


# ---------------------------------------------------------------------------------------------- budget
class BuildBudget:
    """Seconds of uncached building or loading allowed per sliding window, in this process.

    ``check()`` before the work raises :class:`TrieAccessError` when the window is spent; ``spend(seconds)`` after
    it records the time. One build can overshoot by at most its own duration, which the per-request caps bound.
    """

    def __init__(self, budget_s: float, window_s: float) -> None:
        self.budget_s, self.window_s = float(budget_s), float(window_s)
        self.lock = threading.Lock()
        self.events: "deque[tuple[float, float]]" = deque()
        self.refused = 0

    def _spent(self, now: float) -> float:
        while self.events and self.events[0][0] <= now - self.window_s:
            self.events.popleft()
        return sum(d for _, d in self.events)

    def check(self, what: str, option: str = "extra_args['trie']") -> None:
        with self.lock:
            spent = self._spent(time.monotonic())
            if spent < self.budget_s:
                return
            self.refused += 1
        _log("budget", logging.WARNING, "trie_decode: build budget spent (%.2f s in the last %.0f s): refused %s",
             spent, self.window_s, what)
        raise TrieAccessError(
            f"{option}: the server is busy building tries ({self.budget_s:g} s of building per "
            f"{self.window_s:g} s is used up); retry in a few seconds, reuse a list the server has already seen "
            "(cached lists are free), or use a named trie"
        )

    def spend(self, seconds: float) -> None:
        with self.lock:
            self.events.append((time.monotonic(), float(seconds)))


@contextlib.contextmanager
def charged(what: str, admit: bool, refusable: bool = True, option: Optional[str] = None) -> Iterator[None]:
    """Charge the uncached work of the ``with`` block to the process's build budget when it admits a request
    (``admit``): refused before it starts when the budget is spent (unless not ``refusable``: the operator's named
    tries always load), its time spent after it, even when it fails. The engine side (``admit=False``) is free.
    ``option``: the request option the refusal names (default ``extra_args['trie']``)."""
    budget = build_budget() if admit else None
    if budget is not None and refusable:
        budget.check(what, option or "extra_args['trie']")
    start = time.perf_counter()
    try:
        yield
    finally:
        if budget is not None:
            budget.spend(time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------- handoff
class HandoffStore:
    """Built inline tries, handed from the frontend (which validates and builds) to the engine core (which would
    otherwise tokenize the same list again, inside its busy loop) through files in a private directory.

    The directory must be owned by this user and closed to others (mode 0700) and must not be a symbolic link;
    otherwise the store is off (logged). Files are named by the tokenizer fingerprint and the content hash, verified
    (CRC-32s and structure) when read, and removed when this process exits; at most ``max_files`` are kept.
    """

    def __init__(self, directory: Optional[str], max_files: int = 2 * INLINE_CACHE_SIZE) -> None:
        self.directory = self._prepare(directory) if directory else None
        self.max_files = max_files
        self.written: "deque[str]" = deque()
        self.lock = threading.Lock()
        if self.directory:
            atexit.register(self._cleanup)

    @staticmethod
    def _prepare(directory: str) -> Optional[str]:
        try:
            parent = os.path.dirname(directory.rstrip(os.sep))
            for d in (parent, directory):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(d, 0o700)
            for d in (parent, directory):
                st = os.lstat(d)
                if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                    logger.warning("trie_decode: handoff directory %s is not a private directory of this user "
                                   "(mode 0700); the engine builds inline tries itself", d)
                    return None
        except OSError as exc:
            logger.warning("trie_decode: no handoff directory (%s); the engine builds inline tries itself", exc)
            return None
        # Leftovers of servers that did not exit cleanly (files are content-addressed: removing one only means an
        # engine builds that list itself).
        cutoff = time.time() - STALE_HANDOFF_S
        with contextlib.suppress(OSError):
            for entry in os.scandir(directory):
                if entry.name.endswith((".trie", ".tmp")) and entry.stat(follow_symlinks=False).st_mtime < cutoff:
                    os.unlink(entry.path)
        return directory

    def _path(self, key: str) -> str:
        return os.path.join(self.directory or "", f"{key}.trie")

    def put(self, key: str, trie: TokenTrie) -> None:
        if not self.directory:
            return
        path = self._path(key)
        try:
            if os.path.exists(path):
                os.utime(path)
                return
            trie.save(path)
        except (OSError, TrieDecodeError) as exc:
            _log("handoff", logging.WARNING, "trie_decode: cannot write %s: %s", path, exc)
            return
        with self.lock:
            self.written.append(path)
            while len(self.written) > self.max_files:
                with contextlib.suppress(OSError):
                    os.unlink(self.written.popleft())

    def get(self, key: str, fingerprint: str) -> Optional[TokenTrie]:
        if not self.directory:
            return None
        try:
            with open_regular_file(self._path(key), follow_symlinks=False) as handle:
                trie = TokenTrie.load(handle, verify=True)
        except TrieFileError as exc:
            if "not found" not in str(exc):
                _log("handoff", logging.WARNING, "trie_decode: ignoring handoff file %s: %s", key, exc)
            return None
        if trie.fingerprint != fingerprint:
            return None
        return trie

    def _cleanup(self) -> None:
        for path in list(self.written):
            with contextlib.suppress(OSError):
                os.unlink(path)


def _default_handoff_dir() -> Optional[str]:
    raw = os.environ.get(ENV_HANDOFF_DIR, "").strip()
    if raw.lower() in ("off", "0", "none", "false"):
        return None
    if raw:
        return os.path.abspath(raw)
    return os.path.join(tempfile.gettempdir(), f"trie_decode-{os.getuid()}", "inline")


# ---------------------------------------------------------------------------------------------- process-wide
_LOCK = threading.RLock()  # re-entrant: a maker may read another current value
_CURRENT: dict[str, Any] = {}


def _env_key() -> tuple:
    return tuple(os.environ.get(k) for k in _ALL_ENV)


def _current(kind: str, make: Any) -> Any:
    key = _env_key()
    with _LOCK:
        found = _CURRENT.get(kind)
        if found is None or found[0] != key:
            found = _CURRENT[kind] = (key, make())
        return found[1]


def current_policy() -> AccessPolicy:
    """The access policy of this process, from the environment (re-read when the variables change).

    Raises:
        TrieDecodeError (a ValueError): the configuration is invalid; the processor raises it at startup.
    """
    return _current("policy", AccessPolicy.from_env)


def current_limits() -> Limits:
    """The cost limits of this process, from the environment (re-read when the variables change)."""
    return _current("limits", Limits.from_env)


def build_budget() -> BuildBudget:
    """The process-wide build budget (a new one when its environment variables change)."""
    return _current("budget", lambda: BuildBudget(current_limits().build_budget_s, current_limits().build_window_s))


def handoff_store() -> HandoffStore:
    """The process-wide handoff store (see :class:`HandoffStore`)."""
    return _current("handoff", lambda: HandoffStore(_default_handoff_dir()))


def load_allowed_file(value: str, option: Optional[str] = None) -> TokenTrie:
    """Resolve, open and load a request's trie string under the current policy, uncached (the check used when no
    tokenizer is at hand), with the changes of a live catalog delta file beside it (:meth:`AccessPolicy.open_delta`).
    Raises :class:`TrieAccessError` with the client-safe messages (naming ``option``, as
    :meth:`AccessPolicy.resolve`)."""
    policy = current_policy()
    resolved = policy.resolve(value, option=option)
    with policy.open(resolved) as handle, policy.open_delta(resolved) as delta:
        return policy.load(resolved, handle, delta)


def file_identity(handle: BinaryIO) -> tuple[int, int, int, int]:
    """``(st_dev, st_ino, st_mtime_ns, st_size)`` of an opened file, by its descriptor: a rewritten or replaced file
    has another (the caches' keys)."""
    st = os.fstat(handle.fileno())
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


#: The most bytes a filter file may hold (64 MiB: millions of keys).
MAX_FILTER_FILE_BYTES = 64 << 20


def read_filter_file(value: str, what: str, cache: Any) -> tuple:
    """A request's allow/deny filter named as a file (``{"file": PATH}``), under the same access policy as trie
    files: a ``.npy`` array of entry indices, or UTF-8 text with one entry key per line. Returns its items. Raises
    :class:`TrieAccessError` with client-safe messages (the file's bytes and size never reach the client).

    ``cache``: a store (``get``/``put``) of items by the file's identity (path, device, inode, modification time,
    size, from the opened descriptor): a file seen before is opened and checked but not read again, a replaced one is.
    """
    policy = current_policy()
    resolved = policy.resolve(value, what)
    with policy.open(resolved) as handle:
        identity = (resolved.path, *file_identity(handle))
        found = cache.get(identity)
        if found is not None:
            return found
        data = handle.read(MAX_FILTER_FILE_BYTES + 1)
    bad = TrieAccessError(
        f"extra_args[{what!r}]: {resolved.label} is not a filter file (a .npy array of entry indices, or UTF-8 text "
        f"with one key per line, at most {MAX_FILTER_FILE_BYTES >> 20} MiB; details in the server log)"
    )
    if len(data) > MAX_FILTER_FILE_BYTES:
        _log("load", logging.WARNING, "trie_decode: filter file %s is over %d bytes", resolved.path, MAX_FILTER_FILE_BYTES)
        raise bad
    try:
        if resolved.path.endswith(".npy"):
            arr = np.load(io.BytesIO(data), allow_pickle=False)
            if not isinstance(arr, np.ndarray):  # a .npz archive (np.load reads its zip whatever the name)
                raise ValueError(f"expected a .npy array, got a {type(arr).__name__}")
            if arr.ndim != 1 or arr.dtype.kind not in "iu":
                raise ValueError(f"expected a 1-D integer array, got {arr.dtype} {arr.shape}")
            items = tuple(int(i) for i in arr)
        else:
            items = tuple(line for line in text_lines(data) if line)
    except (ValueError, UnicodeDecodeError, OSError, EOFError, MemoryError, OverflowError) as exc:  # a lying shape
        _log("load", logging.WARNING, "trie_decode: filter file %s does not load: %s", resolved.path, exc)
        raise bad from None
    cache.put(identity, items)
    return items


# ---------------------------------------------------------------------------------------------- front-end stamp
def _settings() -> dict:
    """What decides whether a request is admitted (and is read from the environment by every process)."""
    policy, limits = current_policy(), current_limits()
    return {
        "allowed_dirs": [list(policy._lexical), list(policy._real)],  # type: ignore[attr-defined]
        "named": sorted(policy.named.items()),
        "max_inline_entries": limits.max_inline_entries,
        "max_inline_bytes": limits.max_inline_bytes,
        "max_filter_items": limits.max_filter_items,
    }


def settings_digest() -> str:
    """A short digest of the settings that decide admission (allowed directories, named tries, per-request caps).

    Equal in the front-end and the engine core when both read the same environment; :func:`make_stamp` records it
    so that the engine can tell "the processes disagree" from other causes of a refusal.

    Example:
        >>> len(settings_digest())
        16
    """
    return _current("digest", lambda: hashlib.sha256(json.dumps(_settings(), sort_keys=True).encode()).hexdigest()[:16])


def make_stamp(origin: Optional[tuple] = None) -> str:
    """The front-end's record of an admitted request, for ``extra_args[STAMP_KEY]`` (a string: it crosses process
    boundaries unchanged).

    Args:
        origin: for a trie file, ``(real_path, st_dev, st_ino, st_mtime_ns)`` of the descriptor it loaded.

    Example:
        >>> json.loads(make_stamp(("/data/a.trie", 1, 2, 3)))["file"]
        ['/data/a.trie', 1, 2, 3]
    """
    stamp: dict[str, Any] = {"v": 1, "settings": settings_digest()}
    if origin is not None:
        stamp["file"] = [str(origin[0]), int(origin[1]), int(origin[2]), int(origin[3])]
    return json.dumps(stamp)


def _read_stamp(raw: Any) -> Optional[dict]:
    """A well-formed stamp, or None."""
    if not isinstance(raw, str) or len(raw) > 2 * MAX_PATH_CHARS:
        return None
    try:
        stamp = json.loads(raw)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(stamp, dict) or stamp.get("v") != 1 or not isinstance(stamp.get("settings"), str):
        return None
    f = stamp.get("file")
    if f is not None and not (isinstance(f, list) and len(f) == 4 and isinstance(f[0], str)
                              and all(isinstance(x, int) and not isinstance(x, bool) for x in f[1:])):
        return None
    return stamp


#: Causes of an engine-side refusal (:func:`diagnose_engine_refusal`).
CAUSE_SETTINGS = "settings_mismatch"
CAUSE_FILE_CHANGED = "file_changed"
CAUSE_UNCHECKED = "not_checked_by_frontend"
CAUSE_OTHER = "unexpected"
_FIX_SETTINGS = (
    "set TRIE_DECODE_ALLOWED_DIRS, TRIE_DECODE_NAMED_TRIES and the TRIE_DECODE_VLLM_MAX_* limits in the environment "
    "before starting the server (offline: before creating the LLM; its engine process reads its own environment), "
    "the same for every process"
)


def diagnose_engine_refusal(value: Any, stamp: Any, exc: BaseException) -> tuple[str, tuple, str]:
    """Why the engine core refused a request that the front-end admitted, for the server log.

    Args:
        value: the request's ``extra_args["trie"]`` (a name or path for a file; anything else for inline lists).
        stamp: the request's ``extra_args[STAMP_KEY]`` (:func:`make_stamp`), or None.
        exc: the engine's error.

    Returns:
        ``(cause, key, message)``: ``cause`` one of ``"settings_mismatch"`` (the engine's settings differ from the
        front-end's), ``"file_changed"`` (the file is not the one the front-end loaded), ``"not_checked_by_frontend"``
        (no valid stamp), ``"unexpected"``; ``key`` identifies the distinct cause (log it once per key); ``message``
        names the cause and the fix.

    Example:
        >>> diagnose_engine_refusal("/x.trie", None, ValueError("refused"))[0]
        'not_checked_by_frontend'
    """
    why = f"{type(exc).__name__}: {str(exc)[:300]}"
    found = _read_stamp(stamp)
    if found is None:
        return CAUSE_UNCHECKED, (CAUSE_UNCHECKED,), (
            f"the request reached the engine without the front-end's stamp (extra_args[{STAMP_KEY!r}]): its front-end "
            "did not run this processor's validate_params (another trie_decode version in the API server, or a client "
            f"of the engine core that bypasses vLLM's InputProcessor); the engine refused it ({why}). Run the same "
            "trie_decode in every process and submit requests through vLLM's front-end"
        )
    ours = settings_digest()
    if found["settings"] != ours:
        policy, limits = current_policy(), current_limits()
        return CAUSE_SETTINGS, (CAUSE_SETTINGS, found["settings"], ours), (
            f"the engine process's trie settings differ from the front-end's (settings digest {found['settings']} in "
            f"the front-end, {ours} here: allowed directories {list(policy.allowed_dirs)}, named tries "
            f"{sorted(policy.named)}, inline limits {limits.max_inline_entries} entries / {limits.max_inline_bytes} "
            f"bytes, filter limit {limits.max_filter_items}); the front-end admitted the request, the engine refused "
            f"it ({why}). Fix: {_FIX_SETTINGS}"
        )
    if found.get("file") is not None and isinstance(value, str):
        path, dev, ino, mtime_ns = found["file"]
        how, now = "", ""
        try:
            resolved = current_policy().resolve(value)  # the engine's view of the same string: stats allowed paths only
        except TrieAccessError:
            resolved = None
        if resolved is None:
            how, now = "outside", "no longer inside the allowed directories (a link on its path changed)"
        elif resolved.path != path:
            how, now = "elsewhere", f"now resolves to {resolved.path}"
        else:
            try:
                st = os.stat(path)
                if (st.st_dev, st.st_ino, st.st_mtime_ns) != (dev, ino, mtime_ns):
                    how, now = "replaced", "replaced or modified"
            except OSError as err:
                how, now = "gone", f"gone ({err.strerror})"
        if how:
            return CAUSE_FILE_CHANGED, (CAUSE_FILE_CHANGED, path, how), (
                f"the trie file {path} changed between the front-end's check and the engine's load ({now}); the "
                f"engine refused the request ({why}). Fix: replace trie files atomically (write a new file and rename "
                "it over the old one: TokenTrie.save and trie-decode build do), never rewrite or delete one that "
                "requests may name"
            )
    return CAUSE_OTHER, (CAUSE_OTHER, type(exc).__name__, str(exc)[:200]), (
        f"the engine refused a request the front-end admitted, with the same settings and file ({why}); please "
        "report it"
    )


def check_configuration() -> AccessPolicy:
    """Parse the configuration now (the processors call it when they start, so a mistake stops the server with a
    clear message instead of failing requests), and log what is served."""
    policy, limits = current_policy(), current_limits()
    logger.info(
        "trie_decode: trie files from %d allowed director%s and %d named trie(s); inline lists up to %d entries / "
        "%d bytes; build budget %.3g s per %.3g s",
        len(policy.allowed_dirs), "y" if len(policy.allowed_dirs) == 1 else "ies", len(policy.named),
        limits.max_inline_entries, limits.max_inline_bytes, limits.build_budget_s, limits.build_window_s,
    )
    for name, path in policy.named.items():
        if not os.path.isfile(path):
            logger.warning("trie_decode: named trie %r points to %s, which is not a file", name, path)
    return policy
