"""Trie files: safetensors on disk, memory-mapped on load, checked before use.

Why this exists: a trie of millions of entries should load in milliseconds and be shared between processes (vLLM
workers) through the page cache, without pickle. safetensors is a JSON header followed by raw little-endian
arrays; we write it with the ``safetensors`` package and map it back with ``numpy.memmap`` so no array is copied.
Every array is covered by a CRC-32 in the header metadata, so a truncated or corrupted file is reported as such
instead of producing a wrong constraint.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
import struct
import threading
import zlib
from pathlib import Path
from typing import BinaryIO, Mapping

import numpy as np

from .errors import TrieFileError

__all__ = [
    "write_arrays",
    "check_writable",
    "read_arrays",
    "check_vectors",
    "open_regular_file",
    "text_lines",
    "FORMAT_NAME",
    "FORMAT_VERSION",
]

FORMAT_NAME = "trie_decode.TokenTrie"
FORMAT_VERSION = 1
#: The ``kind`` of a live catalog's delta file (:mod:`trie_decode.live`), which ``TokenTrie.load`` names as such.
DELTA_KIND = "trie_decode.live_delta"
_MAX_HEADER = 100 * 1024 * 1024
_DTYPES = {"I32": np.int32, "I64": np.int64, "U8": np.uint8, "F32": np.float32, "BOOL": np.bool_}
_READABLE = tuple(np.dtype(d) for d in _DTYPES.values())  # what write_arrays may write (little-endian)


_LINE_END = re.compile(r"\r\n|\r|\n")


def text_lines(data: bytes | str) -> list[str]:
    r"""The lines of a text file of one item per line (entries, keys, filter keys): UTF-8 with a byte-order mark at
    its start skipped, lines ended by ``"\n"``, ``"\r\n"`` or ``"\r"`` only (a key may hold any other character,
    U+2028 or a form feed included, which ``str.splitlines`` would split at); a last line without its end counts.

    Raises:
        UnicodeDecodeError: ``data`` is bytes that are not UTF-8.

    >>> text_lines("\ufeffa\r\nb\u2028c\n".encode())
    ['a', 'b\u2028c']
    """
    text = data.decode("utf-8-sig") if isinstance(data, bytes) else data.removeprefix("\ufeff")
    lines = _LINE_END.split(text)
    return lines[:-1] if lines and lines[-1] == "" else lines


def _crc(array: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(array).view(np.uint8).reshape(-1)) & 0xFFFFFFFF


def check_writable(path: str | bytes | os.PathLike[str]) -> str:
    """``path`` as text, once a file can be written there: not a folder, in a folder that exists; else
    :class:`TrieFileError` (a path that is no str, bytes or ``os.PathLike`` too, as :func:`read_arrays` refuses it).

    ``trie-decode build`` calls it before building, so that a wrong ``-o`` fails before the work, not after it.
    """
    try:
        text = os.fsdecode(path)
    except TypeError:  # None, a number: pathlib's TypeError named neither the call nor the argument
        raise TrieFileError(f"cannot write to {path!r:.60}: a path is a str, bytes or os.PathLike, got "
                            f"{type(path).__name__}") from None
    target = Path(text)
    if "\x00" in text:  # pathlib's checks read it as a missing file, and the write failed inside os.unlink
        raise TrieFileError(f"cannot write {text!r}: a file name holds no NUL byte")
    try:
        if target.is_dir():
            raise TrieFileError(f"cannot write {text}: it is a folder (give a file name in it)")
        if text.endswith(("/", os.sep)):  # a name ending with a slash names a folder (Path drops the slash)
            problem = "is a file" if target.exists() else "does not exist"
            raise TrieFileError(f"cannot write {text}: a name ending with a slash is a folder, and {target} {problem} "
                                "(give a file name, without the slash)")
        folder = target.parent
        if not folder.is_dir():
            problem = "is not a folder" if folder.exists() else "does not exist"
            raise TrieFileError(f"cannot write {target}: the folder {folder} {problem}")
    except OSError as exc:  # a name too long, a folder that cannot be searched: what stat() says
        raise TrieFileError(f"cannot write {target}: {exc.strerror or exc}") from exc
    return text


def _write_failure(exc: BaseException) -> str:
    """What the OS said: safetensors wraps it (``... I/O error: Permission denied (os error 13) at path
    "<its own temporary file>"``), a name the user never gave."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    found = re.search(r"\(os error (\d+)\)", str(exc))
    return os.strerror(int(found.group(1))) if found else str(exc)


def write_arrays(path: str | os.PathLike[str], arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> None:
    """Write ``arrays`` and ``metadata`` as a safetensors file, adding the format tag and per-array CRC-32s.

    Raises:
        TrieFileError: ``path`` cannot be written (a folder, a missing folder, no permission, a full disk), or an
            array has a dtype :func:`read_arrays` does not read (it would write a file that cannot be loaded).
    """
    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    path = check_writable(path)
    # The bytes on disk are little-endian: the CRC-32s are of those bytes (a big-endian array's own bytes differ).
    arrays = {name: np.ascontiguousarray(a, dtype=np.asarray(a).dtype.newbyteorder("<")) for name, a in arrays.items()}
    for name, a in arrays.items():
        if name == "__metadata__":  # safetensors' own header key: the file's metadata would be unreadable
            raise TrieFileError(f"cannot write {os.fspath(path)}: '__metadata__' is not a name an array can have")
        if a.dtype not in _READABLE:
            raise TrieFileError(f"cannot write {os.fspath(path)}: array {name!r:.80} is {a.dtype}, and a trie file "
                                f"holds only {', '.join(d.name for d in _READABLE)} arrays")

    meta = dict(metadata)
    meta["format"] = FORMAT_NAME
    meta["format_version"] = str(FORMAT_VERSION)
    meta["crc32"] = json.dumps({name: _crc(a) for name, a in arrays.items()}, sort_keys=True)
    # A temporary name of this process and thread: concurrent writers of the same path never share one.
    tmp = Path(f"{os.fspath(path)}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        save_file(arrays, str(tmp), metadata=meta)
        os.replace(tmp, path)
    except (OSError, SafetensorError) as exc:  # safetensors reports an I/O failure as a SafetensorError
        tmp.unlink(missing_ok=True)
        raise TrieFileError(f"cannot write {os.fspath(path)}: {_write_failure(exc)}") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def check_vectors(arrays: Mapping[str, np.ndarray], dtypes: Mapping[str, type], label: object) -> None:
    """Raise :class:`TrieFileError` unless every array of ``arrays`` named in ``dtypes`` is 1-D of its dtype (arrays
    that are absent are the caller's to require)."""
    for name, dtype in dtypes.items():
        if name in arrays and (arrays[name].ndim != 1 or arrays[name].dtype != np.dtype(dtype)):
            raise TrieFileError(f"{label}: array {name!r} is {arrays[name].dtype} of shape {arrays[name].shape}, "
                                f"expected a 1-D {np.dtype(dtype).name} array")


def open_regular_file(path: str | os.PathLike[str], *, follow_symlinks: bool = True) -> BinaryIO:
    """Open ``path`` for reading only if it is a regular file, without ever blocking on it.

    The file is opened with ``O_NONBLOCK`` (opening a FIFO does not wait for a writer) and the *opened* descriptor is
    checked with ``fstat``, so a path swapped for something else between a check and the open cannot slip through.
    With ``follow_symlinks=False`` the last component must not be a symbolic link (``O_NOFOLLOW``).

    Raises:
        TrieFileError: missing, not a regular file (directory, FIFO, device, socket), or unreadable.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError as exc:
        raise TrieFileError(f"trie file not found: {path!r}" if not os.fsdecode(path) else
                            f"trie file not found: {path}") from exc
    except ValueError as exc:  # what open() says of a name holding a NUL byte ("embedded null byte")
        raise TrieFileError(f"cannot open trie file {path!r}: a file name holds no NUL byte") from exc
    except IsADirectoryError as exc:  # pragma: no cover - Linux opens directories read-only; the fstat below catches it
        raise TrieFileError(f"{path} is a directory, not a trie file") from exc
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_symlinks:
            raise TrieFileError(f"{path} is a symbolic link, not a regular trie file") from exc
        raise TrieFileError(f"cannot open trie file {path}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise TrieFileError(f"{path} is a directory, not a trie file")
        if not stat.S_ISREG(st.st_mode):
            raise TrieFileError(f"{path} is not a regular file (a FIFO, device or socket): not a trie file")
        handle = os.fdopen(fd, "rb")
        try:
            handle.raw.name = os.fsdecode(path)  # error messages name the path, not the descriptor number
        except (AttributeError, TypeError):  # pragma: no cover
            pass
        return handle
    except BaseException:
        os.close(fd)
        raise


def _strict_int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{value!r:.40} is not an integer")
    return value


def read_arrays(
    source: str | os.PathLike[str] | BinaryIO, *, verify: bool = True
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Memory-map the arrays of a trie file.

    Args:
        source: the file written by :func:`write_arrays`: a path, or a binary file object opened on it (e.g. by
            :func:`open_regular_file`; the caller keeps ownership and may close it afterwards, the mapping stays).
        verify: recompute every array's CRC-32 (reads the whole file once; ~0.1 s per 100 MB) and require one for
            every array. Turn off only for files you just wrote yourself.

    Returns:
        (arrays, metadata): read-only arrays backed by the file, and the header's metadata (strings).

    Raises:
        TrieFileError: missing or not a regular file, not a safetensors file, truncated, CRC mismatch, wrong format
            or version, a malformed header (bad dtypes, shapes or offsets).
    """
    if isinstance(source, (str, bytes, os.PathLike)):
        with open_regular_file(source) as handle:
            return _read_open(handle, str(os.fsdecode(source)), verify)
    if not hasattr(source, "read"):
        raise TrieFileError(f"cannot read a trie file from {source!r:.60}: give a path (str, bytes, os.PathLike) or a "
                            f"binary file object, got {type(source).__name__}")
    label = getattr(source, "name", None)
    return _read_open(source, label if isinstance(label, str) else "<trie file>", verify)


def _read_open(handle: BinaryIO, path: str, verify: bool) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    try:
        st = os.fstat(handle.fileno())
    except (OSError, AttributeError, ValueError) as exc:
        raise TrieFileError(f"{path}: cannot read the trie file ({exc})") from exc
    if not stat.S_ISREG(st.st_mode):
        raise TrieFileError(f"{path} is not a regular file: not a trie file")
    size = st.st_size
    if size < 8:
        raise TrieFileError(f"{path} is not a trie file: {size} bytes, too short for a safetensors header")
    try:
        head = os.pread(handle.fileno(), 8, 0)
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(_MAX_HEADER, size - 8):
            raise TrieFileError(f"{path} is truncated or not a safetensors file (header of {header_len} bytes)")
        raw_header = os.pread(handle.fileno(), header_len, 8)
    except (OSError, struct.error) as exc:
        raise TrieFileError(f"{path}: cannot read the trie file header ({exc})") from exc
    if len(raw_header) != header_len:
        raise TrieFileError(f"{path} is truncated (it changed while being read)")
    try:
        header = json.loads(raw_header)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise TrieFileError(f"{path} has a corrupted safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise TrieFileError(f"{path} has a corrupted safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise TrieFileError(f"{path} has a corrupted safetensors header (__metadata__ is not an object of strings)")
    if metadata.get("format") != FORMAT_NAME:
        raise TrieFileError(
            f"{path} is a safetensors file but not a trie_decode trie (format={metadata.get('format')!r:.80})"
        )
    version = metadata.get("format_version")
    if version != str(FORMAT_VERSION):
        raise TrieFileError(
            f"{path} has trie format version {version!r:.40}; this trie_decode reads version {FORMAT_VERSION}"
        )
    data_start = 8 + header_len
    data_len = size - data_start
    whole = None
    arrays: dict[str, np.ndarray] = {}
    for name, info in header.items():
        try:
            if not isinstance(info, dict):
                raise TypeError("not an object")
            dtype = np.dtype(_DTYPES[info["dtype"]])
            shape = tuple(_strict_int(d) for d in info["shape"])
            begin, end = (_strict_int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise TrieFileError(f"{path}: malformed header entry for array {name!r:.80}: {info!r:.200}") from exc
        if any(d < 0 for d in shape) or len(shape) > 8:
            raise TrieFileError(f"{path}: malformed header entry for array {name!r:.80}: shape {list(shape)}")
        nbytes = math.prod(shape) * dtype.itemsize  # Python ints: a huge declared shape cannot wrap around
        if begin < 0 or end > data_len or end - begin != nbytes:
            raise TrieFileError(
                f"{path} is truncated or corrupted: array {name!r:.80} needs bytes {begin}..{end} of {data_len}"
            )
        if nbytes == 0:
            arrays[name] = np.zeros(shape, dtype=dtype)
            continue
        if whole is None:
            try:
                whole = np.memmap(handle, dtype=np.uint8, mode="r", shape=(size,))
            except (OSError, ValueError) as exc:
                raise TrieFileError(f"{path}: cannot memory-map the trie file ({exc})") from exc
        raw = whole[data_start + begin : data_start + end]
        if (data_start + begin) % dtype.itemsize:
            raw = np.array(raw)  # misaligned (a valid writer never does this): copy, so every array is aligned
            raw.flags.writeable = False
        arrays[name] = raw.view(dtype).reshape(shape)
    if verify:
        table = metadata.get("crc32")
        try:
            expected = json.loads(table) if table is not None else None
        except (json.JSONDecodeError, RecursionError) as exc:
            raise TrieFileError(f"{path}: corrupted checksum table in the metadata") from exc
        if not isinstance(expected, dict):
            raise TrieFileError(f"{path}: corrupted checksum table in the metadata")
        for name, crc in expected.items():
            if name not in arrays:
                raise TrieFileError(f"{path} is missing array {name!r:.80}")
            if _crc(arrays[name]) != crc:
                raise TrieFileError(f"{path} is corrupted: array {name!r:.80} fails its CRC-32 check")
        unchecked = sorted(set(arrays) - set(expected))
        if unchecked:
            raise TrieFileError(f"{path}: arrays {unchecked[:8]} have no CRC-32 in the checksum table")
    return arrays, metadata
