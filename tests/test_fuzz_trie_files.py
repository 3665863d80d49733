"""Fuzzed trie files (issue 13): whatever bytes a trie file holds, ``TokenTrie.load`` either returns a trie that is
safe to decode with, or raises ``TrieFileError``; never another exception, a crash or a hang.

Files come from small valid tries, broken in every way a file can be: truncated, bytes flipped, header lengths,
dtypes, shapes and offsets that lie (huge, negative, floats, strings), arrays dropped or added, array values
corrupted with the checksums recomputed (so only the structural checks can catch them: child pointers out of
range, non-monotone offsets, cycles through corrupted ids, bad level pointers, entries that point anywhere), and
metadata that lies (vocabulary size, counts, options). Every file that loads is then used the way decoding uses
it: ``TrieConstraint(trie, SpanRules(end_token_id=0), "cpu")``, start, mask, advance, to the bottom of the trie,
with the C kernel and with the numpy kernel (``TRIE_DECODE_NATIVE=0``), which must agree.
"""

from __future__ import annotations

import json
import struct
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trie_decode import TokenTrie, TrieFileError
from trie_decode.constraint import SpanRules, TrieConstraint
from trie_decode.errors import InvalidTokenError
from trie_decode.fileio import write_arrays

ARRAYS = ("child_ptr", "token", "node_entry", "entry_node", "level_ptr")
TABLES = ("names_blob", "names_offsets", "keys_blob", "keys_offsets")
DTYPES = (np.int32, np.int64, np.uint8, np.float32, np.bool_)
SETTINGS = settings(
    max_examples=250, deadline=2000, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
MAX_MASK_WIDTH = 1 << 16


# ------------------------------------------------------------------ what every file must satisfy


def _exercise(trie: TokenTrie) -> None:
    """Decode with a loaded trie: every row, every step, both CPU kernels agree, and allowed tokens are children."""
    rules = SpanRules(end_token_id=0)
    constraint = TrieConstraint(trie, rules, "cpu")
    width = trie.vocab_size
    if width > MAX_MASK_WIDTH:
        # A valid structure with a (truthful or lying) huge vocabulary: logits as narrow as its tokens are masked
        # over their own width (no vocabulary-wide copy); narrower ones are a named error.
        with pytest.raises(InvalidTokenError, match="logits have"):
            constraint.mask_(torch.zeros(1, constraint.needed_width - 1), constraint.start(1))
        width = constraint.needed_width
    kernels = [constraint]
    if hasattr(constraint, "with_kernel"):
        kernels.append(constraint.with_kernel("numpy"))
    rows = 4
    state = constraint.start(rows)
    for step in range(trie.max_depth + 2):
        masks = []
        for kernel in kernels:
            logits = torch.zeros(rows, width)
            kernel.mask_(logits, state)
            masks.append(torch.isfinite(logits))
        for other in masks[1:]:
            assert torch.equal(masks[0], other), "the C and numpy kernels disagree"
        allowed = masks[0]
        assert bool(allowed.any(dim=1).all()), "a row allows nothing"
        tokens = []
        for i in range(rows):
            ids = torch.nonzero(allowed[i]).flatten().tolist()
            node = int(state.node[i])
            if node >= 0:
                children = set(trie.children(node)[0].tolist())
                assert set(ids) <= children | {0}, (node, ids, children)
            tokens.append(ids[(i * 7 + step) % len(ids)])
        state = constraint.advance(state, torch.tensor(tokens, dtype=torch.long))
    for i in range(min(trie.num_entries, 8)):  # and the entries' payloads are readable
        trie.entry(i)


def _check_file(path: Path) -> Optional[TokenTrie]:
    start = time.perf_counter()
    try:
        trie = TokenTrie.load(path)
    except TrieFileError:
        trie = None
    assert time.perf_counter() - start < 5, "loading took too long"
    if trie is not None:
        _exercise(trie)
    return trie


def _check_bytes(raw: bytes) -> Optional[TokenTrie]:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "f.trie"
        path.write_bytes(raw)
        return _check_file(path)


# ------------------------------------------------------------------ building files


def _parts(trie: TokenTrie) -> tuple[dict, dict]:
    arrays = {name: np.array(getattr(trie, name)) for name in ARRAYS}
    for label, table in (("names", trie._names), ("keys", trie._keys)):
        if table is not None:
            arrays[f"{label}_blob"] = np.array(table.blob)
            arrays[f"{label}_offsets"] = np.array(table.offsets)
    meta = {
        "vocab_size": str(trie.vocab_size), "fingerprint": trie.fingerprint, "options": json.dumps(trie.options),
        "num_entries": str(trie.num_entries), "num_nodes": str(trie.num_nodes), "num_duplicates": "0",
    }
    return arrays, meta


def _serialize(arrays: dict, meta: dict) -> bytes:
    """A CRC-consistent file: the checksums are recomputed over whatever the arrays now hold."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "f.trie"
        write_arrays(path, arrays, meta)
        return path.read_bytes()


def _split(raw: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _join(header: dict, data: bytes) -> bytes:
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + data


@st.composite
def tries(draw) -> TokenTrie:
    vocab = draw(st.integers(2, 40))
    seqs = draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6), min_size=1, max_size=12))
    with_names = draw(st.booleans())
    names = [draw(st.text(max_size=4)) for _ in seqs] if with_names else None
    keys = [str(i) for i in range(len(seqs))] if draw(st.booleans()) else None
    return TokenTrie.from_sequences(seqs, vocab, names=names, keys=keys, fingerprint=draw(st.sampled_from(["", "abc"])))


_INTS = st.one_of(
    st.sampled_from([-(2**31), -(2**31) + 1, -2, -1, 0, 1, 2, 3, 2**31 - 1, 2**31, 2**32 + 1, 2**62, -(2**62)]),
    st.integers(-50, 50),
)
_JSON_LIES = st.one_of(
    _INTS, st.floats(allow_nan=False), st.just(float("inf")).map(lambda _: 1e400), st.text(max_size=4), st.booleans(),
    st.none(), st.lists(st.integers(-3, 3), max_size=3), st.just({"a": 1}),
)


def _corrupt_array(draw, arrays: dict) -> None:
    name = draw(st.sampled_from(sorted(arrays)))
    a = arrays[name]
    op = draw(st.sampled_from(["set", "swap", "shift", "dtype", "shape", "drop", "append", "reverse", "cycle"]))
    if op == "set" and a.size:
        i = draw(st.integers(0, a.size - 1))
        value = draw(_INTS)
        flat = a.reshape(-1).copy()
        flat[i] = np.array(value).astype(np.int64).astype(a.dtype) if a.dtype != np.bool_ else bool(value % 2)
        arrays[name] = flat.reshape(a.shape)
    elif op == "swap" and a.size >= 2:
        i, j = draw(st.integers(0, a.size - 1)), draw(st.integers(0, a.size - 1))
        flat = a.reshape(-1).copy()
        flat[[i, j]] = flat[[j, i]]
        arrays[name] = flat.reshape(a.shape)
    elif op == "shift" and a.size and a.dtype.kind in "iu":
        i = draw(st.integers(0, a.size - 1))
        delta = draw(st.sampled_from([-2, -1, 1, 2, 1000]))
        flat = a.reshape(-1).astype(np.int64)
        flat[i:] += delta  # e.g. child pointers past the end, offsets that no longer start at 0
        arrays[name] = flat.astype(a.dtype).reshape(a.shape)
    elif op == "dtype":
        arrays[name] = a.astype(draw(st.sampled_from(DTYPES)))
    elif op == "shape" and a.size >= 2 and a.size % 2 == 0:
        arrays[name] = a.reshape(2, -1) if draw(st.booleans()) else a.reshape(-1, 1)
    elif op == "drop":
        if draw(st.booleans()):
            del arrays[name]
        else:
            arrays[name] = a[: draw(st.integers(0, max(a.size - 1, 0)))]
    elif op == "append":
        extra = np.array(draw(st.lists(st.integers(-3, 300), min_size=1, max_size=3))).astype(a.dtype)
        arrays[name] = np.concatenate([a.reshape(-1), extra]) if a.ndim == 1 else a
    elif op == "reverse" and a.ndim == 1:
        arrays[name] = a[::-1].copy()
    elif op == "cycle" and "child_ptr" in arrays and arrays["child_ptr"].size >= 3:
        # A node whose children range points back at itself or an ancestor (a cycle through corrupted ids).
        ptr = arrays["child_ptr"].copy()
        i = draw(st.integers(1, ptr.size - 2))
        ptr[i] = draw(st.integers(0, i))
        arrays["child_ptr"] = ptr


def _corrupt_meta(draw, meta: dict) -> None:
    key = draw(st.sampled_from(
        ["vocab_size", "num_nodes", "num_entries", "num_duplicates", "options", "fingerprint", "format_version", "crc32"]
    ))
    lies = {
        "vocab_size": st.sampled_from(["0", "-5", "1", "2", "41", "2147483648", "2147483647", "1e3", "abc", "", "99999999999"]),
        "options": st.sampled_from(["[1, 2]", "3", "{oops", '"text"', "null", "{}", "[" * 5000 + "]" * 5000]),
        "format_version": st.sampled_from(["0", "2", "1.0", ""]),
        "crc32": st.sampled_from(["{}", "[]", "not json", '{"token": "x"}', "null"]),
    }.get(key, st.one_of(st.integers(-3, 100).map(str), st.just("many")))
    if draw(st.integers(0, 9)) == 0:
        meta.pop(key, None)
    else:
        meta[key] = draw(lies)


def _corrupt_header(draw, raw: bytes) -> bytes:
    header, data = _split(raw)
    names = [k for k in header if k != "__metadata__"]
    op = draw(st.sampled_from(["dtype", "shape", "offsets", "entry", "metadata", "length", "huge"]))
    name = draw(st.sampled_from(names)) if names else "token"
    info = header.setdefault(name, {"dtype": "I32", "shape": [1], "data_offsets": [0, 4]})
    if op == "dtype":
        info["dtype"] = draw(st.sampled_from(["I32", "I64", "U8", "F32", "BOOL", "F64", "I8", "", "i32", 5]))
    elif op == "shape":
        info["shape"] = draw(st.one_of(st.lists(_JSON_LIES, max_size=3), _JSON_LIES))
    elif op == "offsets":
        info["data_offsets"] = draw(st.one_of(st.lists(_JSON_LIES, max_size=3), _JSON_LIES))
    elif op == "entry":
        header[name] = draw(_JSON_LIES)
    elif op == "metadata":
        header["__metadata__"] = draw(st.one_of(_JSON_LIES, st.just({"format": "trie_decode.TokenTrie", "format_version": 1})))
    elif op == "huge":  # a declared array far larger than the file, with consistent shape and offsets
        n = draw(st.sampled_from([2**20, 2**31, 2**40, 2**61]))
        info.update(dtype="I64", shape=[n], data_offsets=[0, 8 * n])
    out = _join(header, data)
    if op == "length":
        claim = draw(st.one_of(st.integers(0, len(out)), st.sampled_from([2**63, 2**64 - 1, 100 * 2**20 + 1])))
        out = struct.pack("<Q", claim) + out[8:]
    return out


@st.composite
def broken_files(draw) -> bytes:
    arrays, meta = _parts(draw(tries()))
    for _ in range(draw(st.integers(0, 3))):
        _corrupt_array(draw, arrays)
    if draw(st.booleans()):
        _corrupt_meta(draw, meta)
    raw = _serialize(arrays, meta)
    stage = draw(st.sampled_from(["none", "header", "truncate", "flip"]))
    if stage == "header":
        raw = _corrupt_header(draw, raw)
    elif stage == "truncate":
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    elif stage == "flip":
        buf = bytearray(raw)
        for _ in range(draw(st.integers(1, 4))):
            buf[draw(st.integers(0, len(buf) - 1))] ^= 1 << draw(st.integers(0, 7))
        raw = bytes(buf)
    return raw


# ------------------------------------------------------------------ properties


@SETTINGS
@given(tries())
def test_valid_files_load_and_decode(trie):
    arrays, meta = _parts(trie)
    loaded = _check_bytes(_serialize(arrays, meta))
    assert loaded is not None and loaded.sequences() == trie.sequences()


@SETTINGS
@given(broken_files())
def test_broken_files_load_safely_or_raise_trie_file_error(raw):
    _check_bytes(raw)


@settings(max_examples=60, deadline=2000, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_random_bytes_raise_trie_file_error(raw):
    _check_bytes(raw)


# ------------------------------------------------------------------ hand-crafted files


def _small() -> TokenTrie:
    return TokenTrie.from_sequences([[1, 2], [1, 3, 4], [5]], 8, names=["a", "b", "c"])


def _with(**changes) -> bytes:
    arrays, meta = _parts(_small())
    for key, value in changes.items():
        if key in arrays or key in ARRAYS or key in TABLES:
            if value is None:
                arrays.pop(key)
            else:
                arrays[key] = value
        elif value is None:
            meta.pop(key)
        else:
            meta[key] = value
    return _serialize(arrays, meta)


# The small trie: root 0 -> 1 (tok 1), 2 (tok 5); 1 -> 3 (tok 2), 4 (tok 3); 4 -> 5 (tok 4).
# child_ptr [1, 3, 3, 5, 5, 6, 6], level_ptr [0, 1, 3, 5, 6].
CRAFTED = {
    "child pointer past the end": (dict(child_ptr=np.array([1, 3, 3, 5, 5, 6, 9], np.int32)), "child_ptr"),
    "child pointer negative": (dict(child_ptr=np.array([1, 3, 3, -5, 5, 6, 6], np.int32)), "child_ptr"),
    "non-monotone child pointers": (dict(child_ptr=np.array([1, 3, 5, 3, 5, 6, 6], np.int32)), "child_ptr"),
    "cycle: node 4 is its own child": (dict(child_ptr=np.array([1, 3, 3, 4, 5, 6, 6], np.int32),
                                            level_ptr=np.array([0, 1, 3, 6], np.int64)), "breadth-first|leaf|level_ptr"),
    "cycle: a child points back at the root": (dict(child_ptr=np.array([1, 3, 3, 5, 5, 6, 6], np.int32),
                                                    token=np.array([-1, 1, 5, 2, 3, -1], np.int32)), "token id"),
    "level pointers out of range": (dict(level_ptr=np.array([0, 1, 3, 5, 60], np.int64)), "level_ptr"),
    "level pointers too short": (dict(level_ptr=np.array([0], np.int64)), "level_ptr"),
    "level pointers empty": (dict(level_ptr=np.zeros(0, np.int64)), "level_ptr"),
    "entry points past the nodes": (dict(entry_node=np.array([3, 5, 99], np.int32)), "entry points outside"),
    "entry id past the entries": (dict(node_entry=np.array([-1, -1, 2, 0, -1, 7], np.int32)), "terminal|disagree"),
    "token past the vocabulary": (dict(token=np.array([-1, 1, 5, 2, 3, 8], np.int32)), "token id"),
    "child_ptr as float32": (dict(child_ptr=np.array([1, 3, 3, 5, 5, 6, 6], np.float32)), "child_ptr"),
    "token as int64": (dict(token=np.array([-1, 1, 5, 2, 3, 4], np.int64)), "token"),
    "level_ptr as int32": (dict(level_ptr=np.array([0, 1, 3, 5, 6], np.int32)), "level_ptr"),
    "token as 2-D": (dict(token=np.array([[-1, 1, 5], [2, 3, 4]], np.int32)), "token"),
    "names offsets past the blob": (dict(names_offsets=np.array([0, 1, 2, 30], np.int64)), "names"),
    "names offsets as int32": (dict(names_offsets=np.array([0, 1, 2, 3], np.int32)), "names_offsets"),
    "names blob not UTF-8": (dict(names_blob=np.array([0xFF, 0xFE, 0x41], np.uint8)), "names"),
    "names split inside a character": (dict(names_blob=np.frombuffer("éa".encode(), np.uint8).copy()), "names"),
    "names blob missing": (dict(names_blob=None), "half of the names table"),
    # An offsets array without even its end: len() of the table is -1 (was a bare ValueError from __len__).
    "names offsets empty": (dict(names_offsets=np.zeros(0, np.int64)), "names table does not match"),
    "no nodes": (dict(child_ptr=np.array([0], np.int32), token=np.array([-1], np.int32),
                      node_entry=np.array([-1], np.int32), entry_node=np.zeros(0, np.int32),
                      level_ptr=np.array([0, 1], np.int64), names_blob=None, names_offsets=None,
                      num_nodes=None, num_entries=None), "no nodes|level_ptr"),
    "vocab_size zero": (dict(vocab_size="0"), "vocab_size"),
    "vocab_size negative": (dict(vocab_size="-1"), "vocab_size"),
    "vocab_size over 2**31": (dict(vocab_size=str(2**31 + 1)), "vocab_size"),
    "vocab_size below the tokens": (dict(vocab_size="4"), "token id"),
    "vocab_size not a number": (dict(vocab_size="many"), "malformed metadata"),
    "node count lies": (dict(num_nodes="7"), "num_nodes"),
    "entry count lies": (dict(num_entries="2"), "num_entries"),
    "options not an object": (dict(options="[1, 2]"), "options"),
    "options deeply nested": (dict(options="[" * 100_000 + "]" * 100_000), "malformed metadata"),
    "negative duplicates": (dict(num_duplicates="-1"), "num_duplicates"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_crc_consistent_files(case):
    changes, message = CRAFTED[case]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "f.trie"
        path.write_bytes(_with(**changes))
        with pytest.raises(TrieFileError, match=message):
            TokenTrie.load(path)


def test_crafted_raw_headers():
    raw = _with()
    header, data = _split(raw)
    cases = {
        "huge shape": {"token": dict(header["token"], shape=[2**40], data_offsets=[0, 2**42])},
        "wrapping shape": {"token": dict(header["token"], shape=[2**32, 2**32], data_offsets=[0, 0])},
        "negative shape": {"token": dict(header["token"], shape=[-1, -6], data_offsets=header["token"]["data_offsets"])},
        "float shape": {"token": dict(header["token"], shape=[6.0])},
        "bool shape": {"token": dict(header["token"], shape=[True])},
        "string offsets": {"token": dict(header["token"], data_offsets=["0", "24"])},
        "reversed offsets": {"token": dict(header["token"], data_offsets=header["token"]["data_offsets"][::-1])},
        "unknown dtype": {"token": dict(header["token"], dtype="F64")},
        "entry not an object": {"token": [1, 2, 3]},
        "metadata of numbers": {"__metadata__": dict(header["__metadata__"], vocab_size=8)},
        "crc table not a string": {"__metadata__": dict(header["__metadata__"], crc32={"token": 1})},
    }
    for label, change in cases.items():
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "f.trie"
            path.write_bytes(_join({**header, **change}, data))
            with pytest.raises(TrieFileError):
                TokenTrie.load(path)
    for claim in (0, 1, 2**63, 2**64 - 1, len(raw)):
        assert _check_bytes(struct.pack("<Q", claim) + raw[8:]) is None, claim
    # An array the checksum table does not cover is refused (verify=True checks every array).
    meta = dict(header["__metadata__"])
    crcs = json.loads(meta["crc32"])
    del crcs["token"]
    meta["crc32"] = json.dumps(crcs)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "f.trie"
        path.write_bytes(_join({**header, "__metadata__": meta}, data))
        with pytest.raises(TrieFileError, match="no CRC-32"):
            TokenTrie.load(path)


def test_misaligned_arrays_are_copied_not_misread():
    arrays, meta = _parts(_small())
    raw = _serialize(arrays, meta)
    header, data = _split(raw)
    # Shift every array by one byte (a writer other than safetensors could do this) and fix the offsets.
    shifted = {k: (dict(v, data_offsets=[v["data_offsets"][0] + 1, v["data_offsets"][1] + 1]) if k != "__metadata__" else v)
               for k, v in header.items()}
    loaded = _check_bytes(_join(shifted, b"\x00" + data))
    assert loaded is not None and loaded.sequences() == _small().sequences()
    assert all(getattr(loaded, name).flags.aligned for name in ARRAYS)


def test_huge_vocabulary_that_loads_masks_logits_as_narrow_as_its_tokens():
    trie = _check_bytes(_with(vocab_size=str(2**31)))
    assert trie is not None and trie.vocab_size == 2**31
