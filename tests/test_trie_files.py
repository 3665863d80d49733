"""Trie files: safetensors round trip, memory-mapping, and every way a file can be broken."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from trie_decode import TokenTrie, TrieFileError
from trie_decode import fileio
from trie_decode.fileio import FORMAT_NAME, write_arrays

ARRAYS = ("child_ptr", "token", "node_entry", "entry_node", "level_ptr")


@pytest.fixture()
def trie() -> TokenTrie:
    seqs = [[5, 6], [5, 7, 8], [9], [5, 6], [5]]
    names = ["Paris", "Zürich", "東京", "dup", ""]
    return TokenTrie.from_sequences(
        seqs, vocab_size=10, names=names, keys=["id-1", 2, "id-3", 4, "id-5"], fingerprint="abc123",
        options={"source": "test", "nested": [1, 2]},
    )


@pytest.fixture()
def saved(trie, tmp_path) -> Path:
    path = tmp_path / "trie.safetensors"
    trie.save(path)
    return path


def _header(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8 : 8 + n])


def _is_memmap_backed(array: np.ndarray) -> bool:
    while array is not None:
        if isinstance(array, np.memmap):
            return True
        array = array.base if isinstance(array.base, np.ndarray) else None
    return False


def test_round_trip_preserves_arrays_names_keys_and_metadata(trie, saved):
    loaded = TokenTrie.load(saved)
    for name in ARRAYS:
        a, b = getattr(trie, name), getattr(loaded, name)
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), name
    assert loaded.names() == ["Paris", "Zürich", "東京", ""]
    assert [loaded.entry(i).key for i in range(4)] == ["id-1", "2", "id-3", "id-5"]
    assert loaded.lookup([5, 6]).name == "Paris"  # first occurrence, not "dup"
    assert loaded.vocab_size == 10 and loaded.fingerprint == "abc123"
    assert loaded.options == {"source": "test", "nested": [1, 2]}
    assert loaded.num_duplicates == 1
    assert loaded.stats() == trie.stats()
    assert loaded.sequences() == trie.sequences()


def test_loaded_arrays_are_memory_mapped_and_read_only(saved):
    loaded = TokenTrie.load(saved)
    for name in ARRAYS:
        array = getattr(loaded, name)
        assert _is_memmap_backed(array), name
        assert not array.flags.writeable, name
        with pytest.raises(ValueError):
            array[0] = 1
    assert _is_memmap_backed(loaded._names.blob)


def test_cpu_device_trie_shares_the_mapped_arrays(saved):
    """On CPU, the DeviceTrie's child pointers and tokens are the file's mapped pages (no per-process copy; shared by
    every process that maps the file), its numpy views stay read-only, and the derived arrays are built only when
    read (the C kernel masks and advances without them)."""
    import torch

    from trie_decode.constraint import SpanRules, TrieConstraint

    loaded = TokenTrie.load(saved)
    c = TrieConstraint(loaded, SpanRules(0), "cpu", kernel="native", dense_min_fanout=3)
    d = c.dtries[0]
    assert d.tensors.child_ptr.data_ptr() == loaded.child_ptr.ctypes.data
    assert d.tensors.child_token.data_ptr() == loaded.token.ctypes.data
    for name, array in (("child_ptr", loaded.child_ptr), ("child_token", loaded.token)):
        view = getattr(d.arrays, name)
        assert np.shares_memory(view, array) and not view.flags.writeable, name
    state = c.advance(c.start(2), torch.tensor([5, 9]))
    assert c.mask_(torch.zeros(2, 10), state).isfinite().nonzero().tolist() == [[0, 0], [0, 6], [0, 7], [1, 0]]
    assert {k for k, _ in d.tensors.items()} == {"child_ptr", "child_token", "dense_blocked"}
    assert d.tensors.edge_key.tolist() == [-1, 5, 9, 16, 17, 48]  # parent * V + token, built on first read
    assert d.arrays.edge_key.tolist() == [-1, 5, 9, 16, 17, 48] and d.tensors.terminal.tolist() == [0, 1, 1, 1, 0, 1]
    assert d.tensors.dense_slot.tolist() == [-1, -1, -1, -1, -1, -1] and d.num_dense == 0


def test_trie_without_names_or_keys(tmp_path):
    trie = TokenTrie.from_sequences([[1], [2, 3]], vocab_size=4)
    trie.save(tmp_path / "t.safetensors")
    loaded = TokenTrie.load(tmp_path / "t.safetensors")
    assert loaded.names() is None
    assert loaded.entry(1).name is None and loaded.entry(1).key is None
    assert loaded.sequences() == [(1,), (2, 3)]
    assert loaded.fingerprint == "" and loaded.options == {}


def test_save_leaves_no_temporary_file_and_replaces_atomically(trie, tmp_path):
    path = tmp_path / "t.safetensors"
    trie.save(path)
    first = TokenTrie.load(path)  # memory-maps the first file
    other = TokenTrie.from_sequences([[1, 2, 3]], vocab_size=4)
    other.save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.safetensors"]
    # The old mapping still sees the old file (os.replace swaps the directory entry, not the bytes).
    assert first.sequences() == trie.sequences()
    assert TokenTrie.load(path).sequences() == [(1, 2, 3)]


def test_load_accepts_str_paths(saved):
    assert TokenTrie.load(str(saved)).num_entries == 4


# ------------------------------------------------------------------ broken files


def test_missing_file(tmp_path):
    with pytest.raises(TrieFileError, match="not found"):
        TokenTrie.load(tmp_path / "nope.safetensors")
    with pytest.raises(TrieFileError) as caught:
        TokenTrie.load(tmp_path)  # a folder is not a file: said as such, not "not found"
    assert str(caught.value) == f"{tmp_path} is a directory, not a trie file"


def test_truncated_file_at_many_points(saved, tmp_path):
    raw = saved.read_bytes()
    header_len, _ = _header(saved)
    cuts = {0, 3, 7, 8, 9, 8 + header_len // 2, 8 + header_len - 1, 8 + header_len, 8 + header_len + 1}
    cuts |= {len(raw) - 1, len(raw) - 4, (8 + header_len + len(raw)) // 2}
    for cut in sorted(cuts):
        assert cut < len(raw)
        path = tmp_path / f"cut{cut}.safetensors"
        path.write_bytes(raw[:cut])
        for verify in (True, False):  # truncation is found from the sizes, even without reading the data
            with pytest.raises(TrieFileError, match="truncated|too short|corrupted") as info:
                TokenTrie.load(path, verify=verify)
            assert str(path) in str(info.value)


def test_every_array_is_covered_by_its_crc(saved, tmp_path):
    raw = saved.read_bytes()
    header_len, header = _header(saved)
    names = [name for name in header if name != "__metadata__"]
    assert set(ARRAYS) <= set(names) and {"names_blob", "keys_offsets"} <= set(names)
    for name in names:
        begin, end = header[name]["data_offsets"]
        if end == begin:
            continue
        for where in (begin, (begin + end) // 2, end - 1):
            corrupted = bytearray(raw)
            corrupted[8 + header_len + where] ^= 0x40
            path = tmp_path / f"{name}-{where}.safetensors"
            path.write_bytes(bytes(corrupted))
            with pytest.raises(TrieFileError, match=f"array '{name}' fails its CRC-32 check"):
                TokenTrie.load(path)


def test_verify_false_does_not_read_the_data(saved, tmp_path, monkeypatch):
    raw = saved.read_bytes()
    header_len, header = _header(saved)
    begin, _ = header["names_blob"]["data_offsets"]
    corrupted = bytearray(raw)
    corrupted[8 + header_len + begin] ^= 0x01  # "Paris" -> "Qaris": only a CRC would notice
    path = tmp_path / "c.safetensors"
    path.write_bytes(bytes(corrupted))
    with pytest.raises(TrieFileError, match="CRC"):
        TokenTrie.load(path)

    def boom(*args, **kwargs):
        raise AssertionError("verify=False must not check the data")

    monkeypatch.setattr(fileio, "_crc", boom)
    monkeypatch.setattr(TokenTrie, "validate", boom)
    loaded = TokenTrie.load(path, verify=False)
    assert loaded.entry(0).name == "Qaris"
    with pytest.raises(AssertionError, match="must not check"):
        TokenTrie.load(path)  # and verify=True does


def _write_raw(path: Path, header: bytes, data: bytes = b"") -> Path:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\xff" * 64, "truncated or not a safetensors file"),  # absurd header length
        (struct.pack("<Q", 10) + b"\x00\xff garbage!", "corrupted safetensors header"),  # not UTF-8
        (struct.pack("<Q", 10) + b"{not json}", "corrupted safetensors header"),
        (struct.pack("<Q", 0), "corrupted safetensors header"),  # empty header
        (struct.pack("<Q", 6) + b"[1, 2]", "not a JSON object"),
        (struct.pack("<Q", 24) + b'{"__metadata__": [1, 2]}', "__metadata__ is not an object"),
        (b"PK\x03\x04 a zip file, not a trie", "truncated or not a safetensors file"),
        (b"abc", "too short"),
        (b"", "too short"),
    ],
    ids=[
        "huge-length", "not-utf8", "not-json", "empty-header", "json-list", "metadata-list", "zip", "3-bytes", "empty"
    ],
)
def test_garbage_header(tmp_path, content, message):
    path = tmp_path / "g.safetensors"
    path.write_bytes(content)
    with pytest.raises(TrieFileError, match=message):
        TokenTrie.load(path)


def test_safetensors_file_that_is_not_a_trie(tmp_path):
    from safetensors.numpy import save_file

    save_file({"weight": np.ones((2, 3), dtype=np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(TrieFileError, match="not a trie_decode trie"):
        TokenTrie.load(tmp_path / "model.safetensors")
    save_file({"weight": np.ones(2, dtype=np.float32)}, str(tmp_path / "m2.safetensors"), metadata={"format": "pt"})
    with pytest.raises(TrieFileError, match=r"not a trie_decode trie \(format='pt'\)"):
        TokenTrie.load(tmp_path / "m2.safetensors")


def test_other_format_version(tmp_path):
    from safetensors.numpy import save_file

    meta = {"format": FORMAT_NAME, "format_version": "99"}
    save_file({"token": np.zeros(2, dtype=np.int32)}, str(tmp_path / "v.safetensors"), metadata=meta)
    with pytest.raises(TrieFileError, match="format version '99'"):
        TokenTrie.load(tmp_path / "v.safetensors")


def _valid_arrays(trie: TokenTrie) -> dict:
    return {name: np.array(getattr(trie, name)) for name in ARRAYS}


def _meta(**extra) -> dict:
    meta = {"vocab_size": "10", "fingerprint": "", "options": "{}", "num_duplicates": "0"}
    meta.update(extra)
    return meta


def test_missing_array(trie, tmp_path):
    arrays = _valid_arrays(trie)
    del arrays["node_entry"]
    write_arrays(tmp_path / "m.safetensors", arrays, _meta())
    with pytest.raises(TrieFileError, match=r"missing arrays \['node_entry'\]"):
        TokenTrie.load(tmp_path / "m.safetensors")


def test_half_a_string_table(trie, tmp_path):
    arrays = _valid_arrays(trie)
    arrays["names_blob"] = np.frombuffer(b"abc", dtype=np.uint8)
    write_arrays(tmp_path / "h.safetensors", arrays, _meta())
    with pytest.raises(TrieFileError, match="only half of the names table"):
        TokenTrie.load(tmp_path / "h.safetensors")


@pytest.mark.parametrize("meta", [_meta(vocab_size="ten"), {"fingerprint": ""}, _meta(options="{oops")])
def test_malformed_metadata(trie, tmp_path, meta):
    write_arrays(tmp_path / "x.safetensors", _valid_arrays(trie), meta)
    with pytest.raises(TrieFileError, match="malformed metadata"):
        TokenTrie.load(tmp_path / "x.safetensors")


@pytest.mark.parametrize("crc", ["not json", "[1, 2]"])
def test_corrupted_checksum_table(trie, saved, tmp_path, crc):
    from safetensors.numpy import save_file

    _, header = _header(saved)
    meta = dict(header["__metadata__"], crc32=crc)
    save_file(_valid_arrays(trie), str(tmp_path / "c.safetensors"), metadata=meta)
    with pytest.raises(TrieFileError, match="corrupted checksum table"):
        TokenTrie.load(tmp_path / "c.safetensors")


def test_array_listed_in_crc_table_but_absent(trie, saved, tmp_path):
    from safetensors.numpy import save_file

    _, header = _header(saved)
    meta = dict(header["__metadata__"])
    save_file(_valid_arrays(trie), str(tmp_path / "a.safetensors"), metadata=meta)  # no names/keys arrays
    with pytest.raises(TrieFileError, match="missing array 'keys_blob'"):
        TokenTrie.load(tmp_path / "a.safetensors")


def test_header_with_bad_offsets(saved, tmp_path):
    raw = saved.read_bytes()
    header_len, header = _header(saved)
    data = raw[8 + header_len :]
    begin, end = header["token"]["data_offsets"]
    header["token"]["data_offsets"] = [begin, end + 4]  # size disagrees with shape
    with pytest.raises(TrieFileError, match="array 'token' needs bytes"):
        TokenTrie.load(_write_raw(tmp_path / "o.safetensors", json.dumps(header).encode(), data))
    header["token"]["data_offsets"] = [begin, end]
    header["token"]["dtype"] = "C64"
    with pytest.raises(TrieFileError, match="malformed header entry for array 'token'"):
        TokenTrie.load(_write_raw(tmp_path / "d.safetensors", json.dumps(header).encode(), data))


def test_structurally_invalid_file_with_valid_checksums(trie, tmp_path):
    arrays = _valid_arrays(trie)
    arrays["token"][[1, 2]] = arrays["token"][[2, 1]]  # root children out of order
    path = tmp_path / "s.safetensors"
    write_arrays(path, arrays, _meta())
    with pytest.raises(TrieFileError, match="invalid trie: children are not sorted"):
        TokenTrie.load(path)
    assert TokenTrie.load(path, verify=False).num_nodes == trie.num_nodes  # the caller opted out


def test_a_trie_and_what_is_derived_from_it_are_freed_together():
    """Device arrays, step tables and filter indexes are kept on the trie (TokenTrie.derived), not in module caches
    keyed by it: once the caller drops the trie and its constraint, all of it is collected."""
    import gc
    import weakref

    import torch

    from trie_decode.constraint import SpanRules, TrieConstraint

    trie = TokenTrie.from_sequences([[1, 2], [3]], vocab_size=5, keys=["a", "b"])
    c = TrieConstraint(trie, SpanRules(end_token_id=0), "cpu")
    f = c.filters(1, deny=["a"])
    c.mask_(torch.zeros(1, 5), c.start(1), filters=f)
    alive = weakref.ref(trie)
    del trie, c, f
    gc.collect()
    assert alive() is None


def test_saving_where_no_file_can_be_written_is_named(trie, tmp_path):
    with pytest.raises(TrieFileError, match="it is a folder"):
        trie.save(tmp_path)
    with pytest.raises(TrieFileError, match=r"the folder .*missing does not exist"):
        trie.save(tmp_path / "missing" / "t.trie")
    (tmp_path / "plain").write_text("x")
    with pytest.raises(TrieFileError, match="is not a folder"):
        trie.save(tmp_path / "plain" / "t.trie")
    assert list(tmp_path.iterdir()) == [tmp_path / "plain"]  # no temporary file left behind
    # What stat() refuses is named too (was: OSError from pathlib, a traceback out of `trie-decode build -o`).
    with pytest.raises(TrieFileError, match="cannot write .*: File name too long"):
        trie.save(tmp_path / ("x" * 300) / "t.trie")


def test_a_write_the_os_refuses_names_the_target_and_the_os_reason_only(trie, tmp_path):
    """safetensors wraps the OS error with its own temporary file's path ("... (os error 2) at path
    "/proc/.tmpXXXX""): the message names the file the user gave and what the OS said."""
    with pytest.raises(TrieFileError) as caught:
        trie.save("/proc/x.trie")  # a folder that exists, where no file can be made
    assert str(caught.value) == "cannot write /proc/x.trie: No such file or directory", str(caught.value)
    from trie_decode.fileio import _write_failure

    assert _write_failure(RuntimeError("I/O error: Permission denied (os error 13) at path \"/a/.tmpX\"")) == \
        "Permission denied"
    assert _write_failure(RuntimeError("something else")) == "something else"


def test_a_name_ending_with_a_slash_is_a_folder(trie, tmp_path):
    # Was: safetensors' "I/O error: No such file or directory ... at path .../missing/.tmpXXXX".
    with pytest.raises(TrieFileError, match=r"cannot write .*missing/: a name ending with a slash is a folder, and "
                                            r".*missing does not exist"):
        trie.save(f"{tmp_path}/missing/")
    (tmp_path / "plain").write_text("x")
    with pytest.raises(TrieFileError, match=r"plain/: a name ending with a slash is a folder, and .*plain is a file"):
        trie.save(f"{tmp_path}/plain/")
    with pytest.raises(TrieFileError, match="it is a folder"):
        trie.save(f"{tmp_path}/")
    assert list(tmp_path.iterdir()) == [tmp_path / "plain"]


def test_extra_arrays_save_only_what_load_reads(tmp_path):
    # A big-endian array was saved little-endian under the CRC-32 of its own bytes (load: "corrupted"), and a dtype
    # the loader does not read was saved without a word (load: "malformed header entry"): save refuses or fixes both.
    trie = TokenTrie.from_sequences([[1, 2], [3]], vocab_size=8)
    trie.extra = {"mine": np.arange(3, dtype=">i4")}
    trie.save(tmp_path / "be.trie")
    assert TokenTrie.load(tmp_path / "be.trie").extra["mine"].tolist() == [0, 1, 2]
    trie.extra = {"mine": np.zeros(3, dtype=np.float64)}
    with pytest.raises(TrieFileError, match=r"array 'mine' is float64, and a trie file holds only int32, int64"):
        trie.save(tmp_path / "f64.trie")
    assert not (tmp_path / "f64.trie").exists()
    trie.extra = {"__metadata__": np.zeros(3, dtype=np.int32)}  # was written, then refused as a corrupted header
    with pytest.raises(TrieFileError, match="'__metadata__' is not a name an array can have"):
        trie.save(tmp_path / "meta.trie")


def test_a_fingerprint_that_is_not_text_is_refused_when_the_trie_is_built(tmp_path):
    # fingerprint=None (or a number, bytes, a lone surrogate) built a trie whose save() failed inside safetensors
    # ("TypeError: argument 'metadata': 'None' is not an instance of 'str'", or a UnicodeEncodeError).
    from trie_decode import InvalidEntryError
    from trie_decode.catalogs import catalog_from_codes
    from trie_decode.descriptors import tries_from_token_tree_payload, trie_from_prefix_dict

    for fingerprint in (None, 123, b"abc", "\ud800"):
        with pytest.raises(InvalidEntryError, match="fingerprint must be UTF-8 text"):
            TokenTrie.from_sequences([[1, 2]], vocab_size=4, fingerprint=fingerprint)
        with pytest.raises(InvalidEntryError, match="fingerprint must be UTF-8 text"):
            catalog_from_codes(np.array([[1, 0]]), codebook_size=2, vocab_size=4, fingerprint=fingerprint)
        with pytest.raises(InvalidEntryError, match="^fingerprint must be UTF-8 text"):  # not "leaves as entries: ..."
            tries_from_token_tree_payload({"descriptors": [{"path": "p", "leaves": [{"name": "a", "tokens": [1]}]}]},
                                          4, fingerprint=fingerprint)
        with pytest.raises(InvalidEntryError, match="fingerprint must be UTF-8 text"):
            trie_from_prefix_dict({"start_token_id": 0, "end_token_id": 2, "prefix_dict": {"0": [1]}}, 4,
                                  fingerprint=fingerprint)
    TokenTrie.from_sequences([[1, 2]], vocab_size=4, fingerprint="").save(tmp_path / "t.trie")
    assert TokenTrie.load(tmp_path / "t.trie").fingerprint == ""


def test_a_file_name_with_a_nul_byte_is_refused_by_name(trie, tmp_path):
    # Loading failed with os.open's bare ValueError ("embedded null byte"), saving with one from os.unlink while it
    # cleaned up after safetensors; both are TrieFileErrors now (a delta file's too).
    from trie_decode.live import LiveCatalog

    name = str(tmp_path / "a\x00b.trie")
    with pytest.raises(TrieFileError, match="cannot open trie file .*a file name holds no NUL byte"):
        TokenTrie.load(name)
    with pytest.raises(TrieFileError, match="cannot write .*a file name holds no NUL byte"):
        trie.save(name)
    catalog = LiveCatalog(trie)
    with pytest.raises(TrieFileError, match="a file name holds no NUL byte"):
        catalog.save_delta(name)
    with pytest.raises(TrieFileError, match="a file name holds no NUL byte"):
        catalog.load_delta(name)
    assert list(tmp_path.iterdir()) == []


def test_a_path_is_text_bytes_or_a_path_object_to_save_and_load(trie, tmp_path):
    # save() took only str and os.PathLike: bytes (which load() takes) and None failed with pathlib's TypeError, and
    # load(None) with an AttributeError about fileno.
    import os

    name = os.fsencode(tmp_path / "b.trie")
    trie.save(name)
    assert TokenTrie.load(name).sequences() == trie.sequences()
    assert [p.name for p in tmp_path.iterdir()] == ["b.trie"]
    for bad in (None, 5):
        with pytest.raises(TrieFileError, match=f"a path is a str, bytes or os.PathLike, got {type(bad).__name__}"):
            trie.save(bad)
        with pytest.raises(TrieFileError, match=f"give a path .* or a binary file object, got {type(bad).__name__}"):
            TokenTrie.load(bad)
