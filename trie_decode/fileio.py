"""Trie files: safetensors on disk, memory-mapped on load, checked before use.

Why this exists: a trie of millions of entries should load in milliseconds and be shared between processes (vLLM
workers) through the page cache, without pickle. safetensors is a JSON header followed by raw little-endian
arrays; we write it with the ``safetensors`` package and map it back with ``numpy.memmap`` so no array is copied.
Every array is covered by a CRC-32 in the header metadata, so a truncated or corrupted file is reported as such
instead of producing a wrong constraint.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path
from typing import Mapping

import numpy as np

from .errors import TrieFileError

__all__ = ["write_arrays", "read_arrays", "FORMAT_NAME", "FORMAT_VERSION"]

FORMAT_NAME = "trie_decode.TokenTrie"
FORMAT_VERSION = 1
_MAX_HEADER = 100 * 1024 * 1024
_DTYPES = {"I32": np.int32, "I64": np.int64, "U8": np.uint8, "F32": np.float32, "BOOL": np.bool_}


def _crc(array: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(array).view(np.uint8).reshape(-1)) & 0xFFFFFFFF


def write_arrays(path: str | os.PathLike[str], arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> None:
    """Write ``arrays`` and ``metadata`` as a safetensors file, adding the format tag and per-array CRC-32s."""
    from safetensors.numpy import save_file

    meta = dict(metadata)
    meta["format"] = FORMAT_NAME
    meta["format_version"] = str(FORMAT_VERSION)
    meta["crc32"] = json.dumps({name: _crc(a) for name, a in arrays.items()}, sort_keys=True)
    tmp = Path(str(path) + ".tmp")
    save_file({name: np.ascontiguousarray(a) for name, a in arrays.items()}, str(tmp), metadata=meta)
    os.replace(tmp, path)


def read_arrays(path: str | os.PathLike[str], *, verify: bool = True) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Memory-map the arrays of a trie file.

    Args:
        path: the file written by :func:`write_arrays`.
        verify: recompute every array's CRC-32 (reads the whole file once; ~0.1 s per 100 MB). Turn off only for
            files you just wrote yourself.

    Returns:
        (arrays, metadata): read-only arrays backed by the file, and the header's metadata.

    Raises:
        TrieFileError: missing file, not a safetensors file, truncated, CRC mismatch, wrong format or version.
    """
    path = Path(path)
    if not path.is_file():
        raise TrieFileError(f"trie file not found: {path}")
    size = path.stat().st_size
    if size < 8:
        raise TrieFileError(f"{path} is not a trie file: {size} bytes, too short for a safetensors header")
    with open(path, "rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        if header_len > min(_MAX_HEADER, size - 8):
            raise TrieFileError(f"{path} is truncated or not a safetensors file (header of {header_len} bytes)")
        try:
            header = json.loads(handle.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise TrieFileError(f"{path} has a corrupted safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise TrieFileError(f"{path} has a corrupted safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise TrieFileError(f"{path} has a corrupted safetensors header (__metadata__ is not an object)")
    if metadata.get("format") != FORMAT_NAME:
        raise TrieFileError(f"{path} is a safetensors file but not a trie_decode trie (format={metadata.get('format')!r})")
    version = metadata.get("format_version")
    if version != str(FORMAT_VERSION):
        raise TrieFileError(f"{path} has trie format version {version!r}; this trie_decode reads version {FORMAT_VERSION}")
    data_start = 8 + header_len
    data_len = size - data_start
    whole = np.memmap(path, dtype=np.uint8, mode="r") if size > data_start else np.zeros(0, np.uint8)
    arrays: dict[str, np.ndarray] = {}
    for name, info in header.items():
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise TrieFileError(f"{path}: malformed header entry for array {name!r}: {info!r}") from exc
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if end > data_len or begin < 0 or end - begin != nbytes:
            raise TrieFileError(
                f"{path} is truncated or corrupted: array {name!r} needs bytes {begin}..{end} of {data_len}"
            )
        raw = whole[data_start + begin : data_start + end]
        arrays[name] = raw.view(dtype).reshape(shape) if nbytes else np.zeros(shape, dtype=dtype)
    if verify:
        try:
            expected = json.loads(metadata.get("crc32", ""))
        except json.JSONDecodeError as exc:
            raise TrieFileError(f"{path}: corrupted checksum table in the metadata") from exc
        if not isinstance(expected, dict):
            raise TrieFileError(f"{path}: corrupted checksum table in the metadata")
        for name, crc in expected.items():
            if name not in arrays:
                raise TrieFileError(f"{path} is missing array {name!r}")
            if _crc(arrays[name]) != crc:
                raise TrieFileError(f"{path} is corrupted: array {name!r} fails its CRC-32 check")
    return arrays, metadata
