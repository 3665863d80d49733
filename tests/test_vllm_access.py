"""The vLLM integration's access policy and cost bounds, without an engine (issue 13).

A request's ``"trie"`` string comes from any HTTP client: it may name only a registered trie or a file inside an
allowed directory; every other string gets one and the same refusal, whatever the path is; files that fail to
load give categorized messages without their bytes or sizes; a FIFO never blocks; inline lists are capped per
request and their building is budgeted per process; caches are bounded in bytes; the frontend hands built inline
tries to the engine core.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading

import pytest

from trie_decode import TokenTrie
from trie_decode.integrations import vllm_access
from trie_decode.integrations.vllm_access import (
    ENV_ALLOWED_DIRS,
    ENV_NAMED_TRIES,
    AccessPolicy,
    BuildBudget,
    TrieAccessError,
    current_policy,
)
from trie_decode.integrations.vllm_requests import TrieRequestError, TrieResolver, _LRU, parse_trie_request

COLORS = ["red", "green", "blue"]
_ENV = [v for v in vllm_access._ALL_ENV]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(vllm_access.ENV_HANDOFF_DIR, str(tmp_path / "handoff"))


@pytest.fixture()
def tree(tmp_path, tokenizer):
    """allowed/ holds a valid trie, junk, a FIFO, a folder and links; outside/ holds a valid trie too."""
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    TokenTrie.from_strings(COLORS, tokenizer).save(allowed / "colors.trie")
    TokenTrie.from_strings(COLORS, tokenizer).save(outside / "secret.trie")
    (outside / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n" * 40)
    (allowed / "junk.trie").write_bytes(b"root:x:0:0:root:/root:/bin/bash\n" * 40)
    (allowed / "short.trie").write_bytes(b"abc")
    os.mkfifo(allowed / "fifo.trie")
    (allowed / "folder.trie").mkdir()
    (allowed / "to_outside.trie").symlink_to(outside / "secret.trie")
    (allowed / "to_inside.trie").symlink_to(allowed / "colors.trie")
    (allowed / "to_dev.trie").symlink_to("/dev/zero")
    return allowed, outside


@pytest.fixture()
def resolver(tokenizer):
    return TrieResolver(tokenizer)


def _trie(resolver, value, **extra):
    return resolver.trie(parse_trie_request({"trie": value, **extra}), admit=True)


def _refusal_of(resolver, value) -> str:
    with pytest.raises(TrieRequestError) as info:
        _trie(resolver, value)
    return str(info.value)


def _without_label(message: str, value: str) -> str:
    return message.replace(repr(value[:200]), "<label>")


# ------------------------------------------------------------------ closed by default


def test_default_refuses_every_path_with_the_same_message(resolver, tree, tmp_path):
    allowed, outside = tree
    values = [
        "/etc/passwd", "/etc/hostname", "/etc/shadow", "/proc/self/environ", "/dev/zero", str(tmp_path / "missing"),
        str(allowed / "colors.trie"), str(outside / "secret.trie"), str(allowed / "fifo.trie"), str(allowed),
        "~/colors.trie", "~root/.bashrc", "relative/colors.trie", "colors", "a\x00b", "x" * 5000,
    ]
    messages = {_without_label(_refusal_of(resolver, v), v) for v in values}
    assert len(messages) == 1, messages
    (message,) = messages
    assert "serves no trie files" in message and "inline" in message
    assert not re.search(r"\d{2,}", message), message  # no sizes, no header values


def test_outside_paths_get_the_same_message_when_dirs_are_allowed(resolver, tree, tmp_path, monkeypatch):
    allowed, outside = tree
    monkeypatch.setenv(ENV_ALLOWED_DIRS, str(allowed))
    monkeypatch.setenv("HOME", str(allowed))  # '~' is never expanded, even when it would land inside
    values = [
        "/etc/passwd", "/etc/hostname", str(tmp_path / "missing.trie"), str(outside / "secret.trie"),
        str(outside / "passwd"), str(allowed / ".." / "outside" / "secret.trie"), str(allowed) + "/../outside/passwd",
        str(allowed / "to_outside.trie"), str(allowed / "to_dev.trie"), str(allowed), "~/colors.trie",
        "colors.trie", "cities", str(allowed) + "x/colors.trie",
    ]
    messages = {_without_label(_refusal_of(resolver, v), v) for v in values}
    assert len(messages) == 1, messages
    assert ENV_ALLOWED_DIRS in messages.pop()


def test_allowed_dir_serves_its_files_and_symlinks_that_stay_inside(resolver, tree, monkeypatch):
    allowed, _ = tree
    monkeypatch.setenv(ENV_ALLOWED_DIRS, os.pathsep.join([str(allowed), "/nonexistent/dir"]))
    assert _trie(resolver, str(allowed / "colors.trie")).num_entries == 3
    assert _trie(resolver, str(allowed / "sub" / ".." / "colors.trie")).num_entries == 3
    assert _trie(resolver, str(allowed / "to_inside.trie")).num_entries == 3


def test_relative_paths_resolve_against_the_working_directory(resolver, tree, monkeypatch):
    allowed, _ = tree
    monkeypatch.setenv(ENV_ALLOWED_DIRS, str(allowed))
    monkeypatch.chdir(allowed)
    assert _trie(resolver, "colors.trie").num_entries == 3
    monkeypatch.chdir(allowed.parent)
    assert "not a trie file this server makes available" in _refusal_of(resolver, "colors.trie")


def test_files_inside_that_fail_get_categorized_messages_without_content(resolver, tree, monkeypatch, caplog):
    allowed, _ = tree
    monkeypatch.setenv(ENV_ALLOWED_DIRS, str(allowed))
    caplog.set_level(logging.WARNING, logger="trie_decode.vllm")
    cases = {
        "junk.trie": "is not a valid trie file",
        "short.trie": "is not a valid trie file",
        "folder.trie": "cannot be opened as a trie file",
        "missing.trie": "no trie file",
    }
    for name, expected in cases.items():
        message = _refusal_of(resolver, str(allowed / name))
        assert expected in message, (name, message)
        label_free = _without_label(message, str(allowed / name))
        assert not re.search(r"\d", label_free), message  # neither sizes nor header values
        assert "root" not in label_free and "bash" not in label_free
    # The operator sees why, in the server log.
    assert "header of" in caplog.text and "3 bytes" in caplog.text


def test_a_fifo_is_refused_without_blocking(resolver, tree, monkeypatch):
    allowed, _ = tree
    monkeypatch.setenv(ENV_ALLOWED_DIRS, str(allowed))
    result: list = []

    def run():
        try:
            _trie(resolver, str(allowed / "fifo.trie"))
        except TrieRequestError as exc:
            result.append(str(exc))

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "opening a FIFO blocked"
    assert result and "cannot be opened as a trie file" in result[0]


def test_open_regular_file_checks_the_opened_descriptor(tree):
    from trie_decode import TrieFileError
    from trie_decode.fileio import open_regular_file

    allowed, _ = tree
    with open_regular_file(allowed / "colors.trie") as handle:
        assert TokenTrie.load(handle).num_entries == 3
    for name, message in [("fifo.trie", "not a regular file"), ("folder.trie", "directory")]:
        with pytest.raises(TrieFileError, match=message):
            open_regular_file(allowed / name)
    with pytest.raises(TrieFileError, match="symbolic link"):
        open_regular_file(allowed / "to_inside.trie", follow_symlinks=False)
    with pytest.raises(TrieFileError, match="not a regular file"):
        TokenTrie.load("/dev/null")


# ------------------------------------------------------------------ named tries


def test_named_tries_in_every_format(resolver, tree, tmp_path, monkeypatch):
    allowed, outside = tree
    secret = str(outside / "secret.trie")
    table = tmp_path / "named.json"
    table.write_text(json.dumps({"secret": secret}))
    for raw in (f"secret={secret}", f" secret = {secret} ,", json.dumps({"secret": secret}), str(table)):
        monkeypatch.setenv(ENV_NAMED_TRIES, raw)
        assert current_policy().named == {"secret": os.path.realpath(secret)}
        assert _trie(resolver, "secret").num_entries == 3  # named: outside any allowed directory is fine
    # The name's file is the operator's; the path itself stays closed.
    assert "registered names: ['secret']" in _refusal_of(resolver, secret)


@pytest.mark.parametrize(
    "raw, message",
    [
        ("bad name=/x.trie", "trie name 'bad name'"),
        ("a=relative.trie", "must be absolute"),
        ("a=/x.trie,a=/y.trie", "given twice"),
        ("a", "cannot read it"),
        ('{"a": 1}', "JSON object of name -> trie file path"),
        ("{oops", "not valid JSON"),
        ("a=", "is not name=path"),
    ],
)
def test_named_tries_configuration_errors(monkeypatch, raw, message):
    monkeypatch.setenv(ENV_NAMED_TRIES, raw)
    with pytest.raises(ValueError, match=message):
        current_policy()


def test_allowed_dirs_must_be_absolute(monkeypatch):
    monkeypatch.setenv(ENV_ALLOWED_DIRS, "relative/dir")
    with pytest.raises(ValueError, match="not an absolute directory"):
        current_policy()
    with pytest.raises(ValueError, match="not an absolute directory"):
        AccessPolicy(allowed_dirs=("",))


def test_a_named_trie_that_cannot_be_opened_reveals_nothing(resolver, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_NAMED_TRIES, f"gone={tmp_path / 'gone.trie'}")
    message = _refusal_of(resolver, "gone")
    assert "registered but cannot be opened" in message and str(tmp_path) not in message


# ------------------------------------------------------------------ cost bounds


def test_inline_caps_default_and_environment(monkeypatch):
    assert vllm_access.current_limits().max_inline_entries == 2_000
    with pytest.raises(TrieRequestError, match="over the limit of 2000"):
        parse_trie_request({"trie": ["x"] * 2_001})
    with pytest.raises(TrieRequestError, match="bytes of inline strings"):
        parse_trie_request({"trie": ["x" * 1000] * 300})
    with pytest.raises(TrieRequestError, match=r"extra_args\[.trie.\] holds \d+ characters of JSON"):
        parse_trie_request({"trie": "[" + " " * (1 << 20) + "]"})
    for key in ("spans", "slots"):  # refused unparsed, as the trie's JSON is
        with pytest.raises(TrieRequestError, match=rf"extra_args\['{key}'\] holds \d+ characters of JSON"):
            parse_trie_request({key: "[" + " " * (1 << 20) + "]", **({"template": "City: {city}"} if key == "slots" else {})})
    monkeypatch.setenv("TRIE_DECODE_VLLM_MAX_INLINE_ENTRIES", "20000")
    assert parse_trie_request({"trie": ["x"] * 10_001}).source == "strings"
    monkeypatch.setenv("TRIE_DECODE_VLLM_MAX_INLINE_ENTRIES", "lots")
    with pytest.raises(ValueError, match="not a whole number"):
        parse_trie_request({"trie": ["x"]})


def test_deeply_nested_inline_json_is_a_named_error():
    with pytest.raises(TrieRequestError, match="does not parse"):
        parse_trie_request({"trie": "[" * 100_000 + "]" * 100_000})
    for key in ("allow", "deny"):  # a filter as JSON text: the same named error, not a RecursionError
        with pytest.raises(TrieRequestError, match=rf"extra_args\['{key}'\] .* got invalid JSON"):
            parse_trie_request({"trie": ["red"], key: "[" * 100_000})


def test_build_budget_refuses_uncached_builds_only(resolver, monkeypatch):
    monkeypatch.setenv("TRIE_DECODE_VLLM_BUILD_BUDGET", "0.000001")
    monkeypatch.setenv("TRIE_DECODE_VLLM_BUILD_WINDOW", "3600")
    first = _trie(resolver, ["alpha", "beta"])  # the window is empty: allowed, and it spends the budget
    with pytest.raises(TrieRequestError, match="busy building tries"):
        _trie(resolver, ["gamma", "delta"])
    assert _trie(resolver, ["alpha", "beta"]) is first  # cached: free
    # The engine side (admit=False) never refuses for cost: the frontend already admitted the request.
    assert resolver.trie(parse_trie_request({"trie": ["gamma", "delta"]})).num_entries == 2


def test_build_budget_window_slides():
    budget = BuildBudget(budget_s=1.0, window_s=0.05)
    budget.check("a")
    budget.spend(2.0)
    with pytest.raises(TrieAccessError, match="busy building"):
        budget.check("b")
    import time

    time.sleep(0.08)
    budget.check("c")
    assert budget.refused == 1


def test_lru_is_bounded_by_count_and_bytes():
    lru = _LRU(3, max_bytes=100, sizeof=lambda v: v)
    for key, size in [("a", 10), ("b", 10), ("c", 10), ("d", 10)]:
        lru.put(key, size)
    assert list(lru.items) == ["b", "c", "d"] and lru.nbytes == 30
    lru.put("big", 90)
    assert list(lru.items) == ["d", "big"] and lru.nbytes == 100
    lru.put("huge", 500)  # alone over the bound: kept (in use), everything else goes
    assert list(lru.items) == ["huge"] and lru.nbytes == 500
    assert lru.get("huge") == 500 and lru.get("a") is None


def test_resolver_inline_cache_is_bounded_in_bytes(tokenizer, monkeypatch):
    monkeypatch.setenv("TRIE_DECODE_VLLM_INLINE_CACHE_MB", "1")
    resolver = TrieResolver(tokenizer)
    monkeypatch.setenv("TRIE_DECODE_VLLM_MAX_INLINE_ENTRIES", "8000")
    monkeypatch.setenv("TRIE_DECODE_VLLM_BUILD_BUDGET", "inf")
    for i in range(12):
        _trie(resolver, [[i + 1, j + 1] for j in range(8000)])  # ~0.2 MB each
    assert resolver._inline.nbytes <= (1 << 20) and 1 < len(resolver._inline) < 12


# ------------------------------------------------------------------ handoff to the engine core


def test_frontend_hands_inline_tries_to_the_engine(tokenizer, tmp_path, monkeypatch):
    frontend, engine = TrieResolver(tokenizer), TrieResolver(tokenizer)
    built = _trie(frontend, COLORS, leading_space=True)
    files = list((tmp_path / "handoff").iterdir())
    assert len(files) == 1 and (tmp_path / "handoff").stat().st_mode & 0o777 == 0o700

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("the engine tokenized the list again")

    monkeypatch.setattr("trie_decode.integrations.vllm_requests.TokenTrie.from_strings", no_tokenizing)
    got = engine.trie(parse_trie_request({"trie": COLORS, "leading_space": True}))
    assert got.sequences() == built.sequences() and got.names() == COLORS
    # A corrupted handoff file is ignored (the engine builds the list itself), never trusted.
    files[0].write_bytes(files[0].read_bytes()[:-3] + b"\x00\x00\x00")
    monkeypatch.undo()
    monkeypatch.setenv(vllm_access.ENV_HANDOFF_DIR, str(tmp_path / "handoff"))
    again = TrieResolver(tokenizer).trie(parse_trie_request({"trie": COLORS, "leading_space": True}))
    assert again.sequences() == built.sequences()


def test_handoff_directory_must_be_private(tmp_path, monkeypatch, caplog):
    shared = tmp_path / "shared" / "inline"
    shared.mkdir(parents=True)
    shared.chmod(0o777)
    monkeypatch.setenv(vllm_access.ENV_HANDOFF_DIR, str(shared))
    with caplog.at_level(logging.WARNING, logger="trie_decode.vllm"):
        assert vllm_access.handoff_store().directory is None
    assert "not a private directory" in caplog.text
    monkeypatch.setenv(vllm_access.ENV_HANDOFF_DIR, "off")
    assert vllm_access.handoff_store().directory is None


def test_a_file_swapped_between_the_check_and_the_open_is_refused(resolver, tree, monkeypatch):
    allowed, _ = tree
    monkeypatch.setenv(ENV_ALLOWED_DIRS, str(allowed))
    real_readlink = os.readlink
    # The kernel reports what the descriptor really is: pretend a directory above it became a link to /etc.
    monkeypatch.setattr(vllm_access.os, "readlink",
                        lambda p: "/etc/passwd" if p.startswith("/proc/self/fd/") else real_readlink(p))
    value = str(allowed / "colors.trie")
    message = _refusal_of(resolver, value)
    assert "is not a trie file this server makes available" in message


def test_lru_keeps_what_is_in_use_and_drops_idle_values_first():
    used = {"a"}
    lru = _LRU(2, max_bytes=100, sizeof=lambda v: v, in_use=lambda: used)
    lru.put("a", 60)
    lru.put("b", 30)
    lru.put("c", 30)  # over both bounds: "a" is in use, so the idle "b" goes
    assert list(lru.items) == ["a", "c"] and lru.nbytes == 90
    lru.put("d", 50)  # still "a" stays; everything idle but the newest goes, even over the byte bound
    assert list(lru.items) == ["a", "d"] and lru.nbytes == 110
    used.clear()
    lru.put("e", 10)
    assert list(lru.items) == ["d", "e"] and "a" not in lru and lru["e"] == 10
    with pytest.raises(KeyError):
        lru["a"]


def test_filter_cap_is_a_limit_read_at_call_time(monkeypatch):
    assert vllm_access.current_limits().max_filter_items == 100_000
    before = vllm_access.settings_digest()
    monkeypatch.setenv("TRIE_DECODE_VLLM_MAX_FILTER_ITEMS", "3")
    with pytest.raises(TrieRequestError, match="names 4 entries, over the limit of 3"):
        parse_trie_request({"trie": COLORS, "deny": [0, 1, 2, 0]})
    assert parse_trie_request({"trie": COLORS, "deny": [0, 1, 2]}).deny == (0, 1, 2)
    assert vllm_access.settings_digest() != before  # the engine can tell that its filter cap differs


# ------------------------------------------------------------------ front-end stamp and engine-side refusals


def _admit(resolver, value, **extra) -> dict:
    """What the front-end does with a request: check it completely and stamp it."""
    args = {"trie": value, **extra}
    args[vllm_access.STAMP_KEY] = resolver.admit(parse_trie_request(args))
    return args


def test_stamp_records_settings_and_the_loaded_file(resolver, tree, monkeypatch):
    allowed, _ = tree
    monkeypatch.setenv(ENV_ALLOWED_DIRS, str(allowed))
    args = _admit(resolver, str(allowed / "to_inside.trie"))
    stamp = json.loads(args[vllm_access.STAMP_KEY])
    st = os.stat(allowed / "colors.trie")
    assert stamp["settings"] == vllm_access.settings_digest()
    assert stamp["file"] == [str((allowed / "colors.trie").resolve()), st.st_dev, st.st_ino, st.st_mtime_ns]
    assert "file" not in json.loads(_admit(resolver, COLORS)[vllm_access.STAMP_KEY])
    # The stamp is not a client option: parsing accepts it, a misspelling of it is still refused.
    assert parse_trie_request(args).source == "file"
    with pytest.raises(TrieRequestError, match="unknown trie option"):
        parse_trie_request({"trie": COLORS, "trie_check": "x"})


def _engine_refusal(resolver, args, caplog) -> tuple[str, str]:
    """Resolve a request as the engine does; it must fail; return (cause, what was logged at ERROR)."""
    caplog.clear()
    with pytest.raises(TrieRequestError) as info:
        req = parse_trie_request(args)
        resolver.filters(req, resolver.resolve(req)[0])
    with caplog.at_level(logging.DEBUG, logger="trie_decode.vllm"):
        cause = resolver.refused_in_engine(args, info.value)
    return cause, "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)


def test_engine_refusal_names_a_settings_mismatch_once_and_counts_every_one(tokenizer, tree, monkeypatch, caplog):
    allowed, _ = tree
    frontend, engine = TrieResolver(tokenizer), TrieResolver(tokenizer)
    monkeypatch.setenv(ENV_ALLOWED_DIRS, str(allowed))
    args = _admit(frontend, str(allowed / "colors.trie"))
    monkeypatch.delenv(ENV_ALLOWED_DIRS)  # the engine process's environment lacks the setting
    cause, logged = _engine_refusal(engine, args, caplog)
    assert cause == "settings_mismatch" and engine.engine_refusals == {"settings_mismatch": 1}
    assert "differ from the front-end's" in logged and "TRIE_DECODE_ALLOWED_DIRS" in logged
    assert "before starting the server" in logged and "empty text" in logged
    cause, logged = _engine_refusal(engine, args, caplog)  # the same cause again: counted, not logged again
    assert cause == "settings_mismatch" and engine.engine_refusals["settings_mismatch"] == 2 and logged == ""
    # Another limit that differs is a settings mismatch as well (an inline list over the engine's cap).
    inline = _admit(frontend, COLORS)
    monkeypatch.setenv("TRIE_DECODE_VLLM_MAX_INLINE_ENTRIES", "2")
    assert _engine_refusal(engine, inline, caplog)[0] == "settings_mismatch"


def test_engine_refusal_names_a_file_changed_since_the_check(tokenizer, tree, monkeypatch, caplog):
    allowed, _ = tree
    frontend, engine = TrieResolver(tokenizer), TrieResolver(tokenizer)
    monkeypatch.setenv(ENV_ALLOWED_DIRS, str(allowed))
    target = allowed / "colors.trie"
    args = _admit(frontend, str(target))
    link_args = _admit(frontend, str(allowed / "to_inside.trie"))
    # Replaced by something that does not load (a new inode: an atomic rename of a bad file).
    (allowed / "new.tmp").write_bytes(b"junk" * 100)
    os.replace(allowed / "new.tmp", target)
    cause, logged = _engine_refusal(engine, args, caplog)
    assert cause == "file_changed" and "replaced or modified" in logged and "rename" in logged
    cause, logged = _engine_refusal(engine, args, caplog)
    assert cause == "file_changed" and logged == ""  # the same cause: logged once
    os.unlink(target)
    cause, logged = _engine_refusal(engine, args, caplog)
    assert cause == "file_changed" and "gone" in logged  # another way of changing: logged too
    # A link whose target moved out of the allowed directory.
    (allowed / "to_inside.trie").unlink()
    (allowed / "to_inside.trie").symlink_to(tree[1] / "secret.trie")
    cause, logged = _engine_refusal(engine, link_args, caplog)
    assert cause == "file_changed" and "no longer inside the allowed directories" in logged
    assert engine.engine_refusals == {"file_changed": 4}


def test_engine_refusal_without_a_stamp_or_with_a_forged_one(tokenizer, tree, monkeypatch, caplog):
    allowed, _ = tree
    engine = TrieResolver(tokenizer)
    for stamp in (None, "forged", json.dumps({"v": 1, "settings": 5}), json.dumps({"v": 1, "settings": "x", "file": [1]})):
        args = {"trie": str(allowed / "colors.trie")}  # refused: no directory is allowed in this process
        if stamp is not None:
            args[vllm_access.STAMP_KEY] = stamp
        assert _engine_refusal(engine, args, caplog)[0] == "not_checked_by_frontend"
    assert engine.engine_refusals == {"not_checked_by_frontend": 4}
    # Same settings, same file, and still refused (here: the engine cannot open what the front-end could).
    monkeypatch.setenv(ENV_ALLOWED_DIRS, str(allowed))
    args = _admit(TrieResolver(tokenizer), str(allowed / "colors.trie"))
    monkeypatch.setattr(vllm_access, "open_regular_file", lambda *a, **k: (_ for _ in ()).throw(
        vllm_access.TrieFileError("permission denied")))
    cause, logged = _engine_refusal(engine, args, caplog)
    assert cause == "unexpected" and "please report it" in logged


def test_lru_live_sizes_measure_values_that_grew():
    grown = {"a": 10, "b": 10}
    lru = _LRU(10, max_bytes=100, sizeof=lambda k: grown[k], live_sizes=True)
    lru.put("a", "a")
    lru.put("b", "b")
    grown["a"] = 95  # "a" built more arrays after it was put
    grown["c"] = 10
    lru.put("c", "c")  # measured again: 95 + 10 + 10 > 100, so the oldest goes
    assert list(lru.items) == ["b", "c"] and lru.nbytes == 20


# ------------------------------------------------------------------ filter files


def _filters(resolver, **extra):
    req = parse_trie_request({"trie": COLORS, **extra})
    trie, _ = resolver.resolve(req)
    resolver.admit(req)
    return resolver.filters(req, trie)


def test_filter_files_under_the_same_policy(resolver, tree, monkeypatch):
    """``{"file": PATH}`` names a filter file: keys one per line, or a .npy of entry indices, read from an allowed
    directory only; refusals say the same for every path outside it, and a bad file's bytes never reach the client."""
    import time

    import numpy as np

    allowed, outside = tree
    (allowed / "seen.txt").write_text("red\nblue\n")
    np.save(allowed / "ids.npy", np.array([1]))
    (allowed / "bad.npy").write_bytes(b"root:x:0:0:" * 20)
    (outside / "seen.txt").write_text("red\n")
    assert _refusal_of(resolver, str(allowed / "colors.trie")).startswith("extra_args['trie']")  # closed by default
    monkeypatch.setenv(ENV_ALLOWED_DIRS, str(allowed))
    allow, deny = _filters(resolver, deny={"file": str(allowed / "seen.txt")})
    assert allow is None and deny.tolist() == [0, 2]
    allow, deny = _filters(resolver, allow=json.dumps({"file": str(allowed / "ids.npy")}))  # over HTTP: a JSON string
    assert allow.tolist() == [1] and deny is None
    real_load, loads = np.load, []
    monkeypatch.setattr(np, "load", lambda *a, **k: loads.append(1) or real_load(*a, **k))
    for _ in range(2):  # a file seen before is opened and checked, not read again
        assert _filters(resolver, allow={"file": str(allowed / "ids.npy")})[0].tolist() == [1]
    assert loads == []
    time.sleep(0.01)
    (allowed / "seen.txt").write_text("green\n")  # a replaced file is read again
    assert _filters(resolver, deny={"file": str(allowed / "seen.txt")})[1].tolist() == [1]
    outside_msgs = set()
    for path in (outside / "seen.txt", outside / "missing.txt", "/etc/passwd"):
        with pytest.raises(TrieRequestError) as info:
            _filters(resolver, deny={"file": str(path)})
        outside_msgs.add(_without_label(str(info.value), str(path)))
    assert len(outside_msgs) == 1 and "not a file this server makes available" in outside_msgs.pop()
    with pytest.raises(TrieRequestError, match="is not a filter file") as info:
        _filters(resolver, deny={"file": str(allowed / "bad.npy")})
    assert "root:x" not in str(info.value) and "bytes" not in str(info.value)
    with pytest.raises(TrieRequestError, match=r"must be \{'file': PATH\}"):
        parse_trie_request({"trie": COLORS, "deny": {"path": "x"}})
    (allowed / "unknown.txt").write_text("purple\n")
    with pytest.raises(TrieRequestError, match="not entries of the trie"):
        _filters(resolver, deny={"file": str(allowed / "unknown.txt")})
    # A byte-order mark is skipped (it was read as part of the first key, which was then no entry), and "\r\n" ends
    # a line; "\x0c" does not (str.splitlines split there).
    (allowed / "bom.txt").write_bytes(b"\xef\xbb\xbfred\r\nblue\r\n")
    assert _filters(resolver, deny={"file": str(allowed / "bom.txt")})[1].tolist() == [0, 2]
    (allowed / "ff.txt").write_bytes(b"red\x0cblue\n")
    with pytest.raises(TrieRequestError, match="not entries of the trie"):
        _filters(resolver, deny={"file": str(allowed / "ff.txt")})


# ------------------------------------------------------------------ live catalog delta files
def _delta_beside(path, tokenizer, add=("purple",), remove=("red",)) -> str:
    """Write a delta file for the trie file ``path`` (added and removed colors); return the delta's path."""
    from trie_decode.live import LiveCatalog, delta_path_for

    catalog = LiveCatalog.open(path)
    catalog.add(list(add), tokenizer=tokenizer)
    catalog.remove(list(remove))
    target = delta_path_for(path)
    catalog.save_delta(target)
    return target


def _names(trie) -> list:
    return sorted(trie.names())


def test_a_delta_file_beside_a_trie_file_is_read_from_the_descriptor_the_policy_opened(resolver, tree, tokenizer,
                                                                                        monkeypatch):
    allowed, _ = tree
    monkeypatch.setenv(ENV_ALLOWED_DIRS, str(allowed))
    value = str(allowed / "colors.trie")
    delta = _delta_beside(allowed / "colors.trie", tokenizer)
    opened = []
    real_open = vllm_access.open_regular_file

    def spy(path, *, follow_symlinks=True):
        opened.append((os.fspath(path), follow_symlinks))
        return real_open(path, follow_symlinks=follow_symlinks)

    monkeypatch.setattr(vllm_access, "open_regular_file", spy)
    assert _names(_trie(resolver, value)) == ["blue", "green", "purple"]
    assert (delta, False) in opened  # once, O_NOFOLLOW
    assert _names(vllm_access.load_allowed_file(value)) == ["blue", "green", "purple"]  # the uncached check too
    os.replace(_delta_beside(allowed / "colors.trie", tokenizer, add=("teal",), remove=("blue",)), delta)
    assert _names(_trie(resolver, value)) == ["green", "red", "teal"]  # a replaced delta is a new cache key
    os.unlink(delta)
    assert _names(_trie(resolver, value)) == sorted(COLORS)  # no delta: the trie file alone


def test_a_delta_file_that_is_a_link_or_not_a_file_is_refused(resolver, tree, tokenizer, monkeypatch):
    allowed, outside = tree
    monkeypatch.setenv(ENV_ALLOWED_DIRS, str(allowed))
    value = str(allowed / "colors.trie")
    # A valid delta for this very trie, outside the allowed directories, linked in beside the trie file.
    TokenTrie.load(allowed / "colors.trie").save(outside / "colors.trie")
    secret = _delta_beside(outside / "colors.trie", tokenizer, add=("secret",), remove=())
    os.symlink(secret, allowed / "colors.trie.delta.safetensors")
    message = _refusal_of(resolver, value)
    assert "delta file beside it" in message and "symbolic link" in message and "secret" not in message
    with pytest.raises(TrieAccessError, match="delta file beside it"):
        vllm_access.load_allowed_file(value)
    os.unlink(allowed / "colors.trie.delta.safetensors")
    os.mkdir(allowed / "colors.trie.delta.safetensors")
    assert "not a regular file" in _refusal_of(resolver, value)
    os.rmdir(allowed / "colors.trie.delta.safetensors")
    (allowed / "colors.trie.delta.safetensors").write_bytes(b"not a delta file")
    message = _refusal_of(resolver, value)
    assert "is not a valid delta for it" in message and "not a delta file" not in message  # no file bytes


def test_a_delta_file_swapped_for_a_link_between_check_and_open_is_refused(resolver, tree, tokenizer, monkeypatch):
    """The race of an lstat-then-open: the delta is a regular file when the request arrives and a link to a file
    outside the allowed directories when it is opened. The one O_NOFOLLOW open refuses it, and nothing outside is
    read."""
    allowed, outside = tree
    monkeypatch.setenv(ENV_ALLOWED_DIRS, str(allowed))
    value = str(allowed / "colors.trie")
    delta = _delta_beside(allowed / "colors.trie", tokenizer)
    TokenTrie.load(allowed / "colors.trie").save(outside / "colors.trie")
    secret = _delta_beside(outside / "colors.trie", tokenizer, add=("secret",), remove=())
    real_open = vllm_access.open_regular_file
    read = []

    def swap_then_open(path, *, follow_symlinks=True):
        if os.fspath(path) == delta:  # between the check of the request's files and this open
            os.unlink(delta)
            os.symlink(secret, delta)
        handle = real_open(path, follow_symlinks=follow_symlinks)
        read.append(os.readlink(f"/proc/self/fd/{handle.fileno()}"))
        return handle

    monkeypatch.setattr(vllm_access, "open_regular_file", swap_then_open)
    message = _refusal_of(resolver, value)
    assert "delta file beside it" in message and "symbolic link" in message
    assert secret not in read and os.path.realpath(secret) not in read


def test_a_delta_opened_outside_the_allowed_directories_is_refused(resolver, tree, tokenizer, monkeypatch):
    """A directory above the delta swapped for a link between the trie's open and the delta's: the kernel's account
    of the opened descriptor is outside the allowed directories, so the request gets the generic refusal."""
    allowed, _ = tree
    monkeypatch.setenv(ENV_ALLOWED_DIRS, str(allowed))
    delta = _delta_beside(allowed / "colors.trie", tokenizer)
    real_open, real_readlink = vllm_access.open_regular_file, os.readlink
    delta_fds = []

    def record(path, *, follow_symlinks=True):
        handle = real_open(path, follow_symlinks=follow_symlinks)
        if os.fspath(path) == delta:
            delta_fds.append(f"/proc/self/fd/{handle.fileno()}")
        return handle

    monkeypatch.setattr(vllm_access, "open_regular_file", record)
    monkeypatch.setattr(vllm_access.os, "readlink",
                        lambda p: "/etc/passwd" if p in delta_fds else real_readlink(p))
    assert "is not a trie file this server makes available" in _refusal_of(resolver, str(allowed / "colors.trie"))
    assert delta_fds


def test_filters_over_a_delta_file_mean_what_they_mean_in_process(resolver, tree, tokenizer, monkeypatch):
    """A request's allow/deny over a trie file with a delta beside it names the entries the catalog's snapshot
    names in-process (``LiveCatalog.open(trie, delta)``, what the transformers processor decodes): entry numbers
    (inline or a .npy filter file) are the snapshot's, a removed key (base or added) is accepted and names nothing,
    and a semantic-id catalog's second item key names its entry."""
    import numpy as np
    import torch

    from trie_decode.catalogs import catalog_from_codes
    from trie_decode.live import LiveCatalog, delta_path_for

    allowed, _ = tree
    monkeypatch.setenv(ENV_ALLOWED_DIRS, str(allowed))
    colors = allowed / "keyed.trie"
    TokenTrie.from_strings([" red", " green", " blue", " yellow"], tokenizer, keys=["r", "g", "b", "y"]).save(colors)
    catalog = LiveCatalog.open(colors)
    catalog.add([" azure", " teal"], tokenizer=tokenizer, keys=["az", "t"])
    catalog.remove(["r", "t"])
    catalog.save_delta(delta_path_for(colors))
    codes = allowed / "codes.trie"
    catalog_from_codes(np.array([[1, 2], [1, 3], [1, 2], [2, 0]]), vocab_size=len(tokenizer), codebook_size=4,
                       token_offset=1000, keys=["s0", "s1", "s2", "s3"]).save(codes)
    catalog = LiveCatalog.open(codes)
    catalog.add([[1000, 1007]], keys=["new"])
    catalog.remove(["s3"])
    catalog.save_delta(delta_path_for(codes))
    np.save(allowed / "one.npy", np.array([1]))

    from trie_decode.constraint import TrieConstraint
    from trie_decode.integrations.vllm import _engine_constraint

    def first_tokens(c, filters):
        return c.mask_(torch.zeros(1, c.vocab_size), c.start(1), filters=filters).isfinite().nonzero()[:, 1].tolist()

    def served(path, **extra):
        """The entries the request's filters name, and the first tokens the engine's step allows with them."""
        req = parse_trie_request({"trie": str(path), **extra})
        resolver.admit(req)
        trie, rules, allow, deny = _engine_constraint(resolver, req)  # what the engine decodes
        c = TrieConstraint(trie, rules, "cpu")
        named = [None if f is None else sorted(trie.entry(int(i)).key for i in f) for f in (allow, deny)]
        return named, first_tokens(c, c.filters(1, allow=[allow], deny=[deny]))

    def in_process(path, allow=None, deny=None):
        """The same for the transformers processor: the catalog's view of LiveCatalog.open(trie, delta)."""
        live = LiveCatalog.open(path, delta_path_for(path))
        assert live.wait_compacted()
        view = live.snapshot().view()
        named = [None if s is None else sorted(view.trie.entry(int(i)).key
                                               for i in np.setdiff1d(view.entry_indices(s, what), view.deny))
                 for s, what in ((allow, "allow"), (deny, "deny"))]
        c = view.constraint(resolver.rules(parse_trie_request({"trie": str(path)})), "cpu")
        return named, first_tokens(c, view.filters(c, 1, allow=allow, deny=deny))

    cases = [
        (colors, {"allow": [1]}, [["g"], None]),
        (colors, {"allow": [4, 2]}, [["az", "b"], None]),
        (colors, {"deny": ["r", "t"]}, [None, []]),
        (colors, {"allow": ["g", "r"], "deny": ["t"]}, [["g"], []]),
        (codes, {"deny": ["s2", "s3"]}, [None, ["s0"]]),
        (codes, {"allow": ["s2", "new"]}, [["new", "s0"], None]),
    ]
    for path, extra, expected in cases:
        got = served(path, **extra)
        assert got == in_process(path, **extra) and got[0] == expected, (path, extra)
    assert served(colors, allow={"file": str(allowed / "one.npy")}) == served(colors, allow=[1])
    assert served(colors, allow=[1])[0] == [["g"], None]
    with pytest.raises(TrieRequestError, match="entry number 6 is outside"):
        served(colors, allow=[6])
    with pytest.raises(TrieRequestError, match="not entries of the trie"):
        served(colors, deny=["zzz"])
    with pytest.raises(TrieRequestError, match=r"leaves no entry .*\(the catalog is live: its removed entries name"):
        served(colors, allow=[0])  # the removed red
