"""The native kernel: the fused CPU step (``trie_decode/_kernel.c``), behind checks that make its raw pointers safe.

Why this exists: on a CPU, the vectorized numpy/torch step spends most of its time in the fixed cost of a few dozen
array operations, not in the fill of the logits (the floor). The C kernel does the same work in one pass per row.
It is optional (an install without a C compiler has no ``_kernel``); :data:`AVAILABLE` says whether it loaded, and
``TRIE_DECODE_NATIVE=0`` in the environment turns it off (to compare both paths, or to rule it out when debugging).

Every public function here takes tensors, checks device, dtype, contiguity and shape, and only then hands data
pointers to C; the kernel itself bounds-checks every per-step node id, row and token it reads.

The C boundary: each C function takes two bytes objects of packed int64 fields, named by the tuples below (the C
side exports their lengths; a mismatch fails at import). The trie's fields are packed once per step table
(:func:`trie_fields`); a call packs only what changes: the logits, the rows' states, the filters. The one-call step
(:class:`FusedStep`, the hot path inside ``generate``) packs its job once per logits geometry and passes the six
fields that change at every step (logits, tokens, parents) as ints after it: packing all 17 fields at every step cost
about 5 us more per step inside ``generate``, on the cold caches a forward pass leaves (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import struct
import warnings
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np
import torch

from ..errors import InvalidTokenError
from ..spans import COUNT, START, TABLE_COLUMNS
from .grouped import GroupedKernel
from .interface import LOGITS_DTYPES, check_state_rows
from .rules import ALL_MASKED_FLOOR, NEG_INF
from .vectorized import NUMPY_KERNEL

if TYPE_CHECKING:
    from ..filters import NodeFlags

try:  # built by setup.py when a C compiler was available at install time
    from .. import _kernel
except ImportError:  # pragma: no cover - exercised only on installs without a compiler
    _kernel = None

__all__ = ["AVAILABLE", "ENABLED", "enabled", "usable_logits", "trie_fields", "mask_rows", "child", "FusedStep",
           "NativeKernel", "TRIE_FIELDS", "LOGITS_FIELDS", "MASK_FIELDS", "STEP_FIELDS", "CHILD_FIELDS"]

AVAILABLE = _kernel is not None

# The packed fields of each C call, in order (``_kernel.c``'s TF_/LF_/MF_/SF_/CF_ enums). Pointers are data
# addresses; 0 stands for "none".
#: The step table and the trie, packed once per step table.
#: With the bitmap pass (``_kernel.BITMAP_PASS``), the trie's bitmaps: ``bits`` (``num_bits`` rows, the dense rows
#: then one per wide node) and the wide nodes, ascending (``wide_nodes``, ``num_wide``); see :func:`kernel_bits`.
TRIE_FIELDS = ("table", "num_nodes", "num_codes", "child_token", "child_ptr", "dense_blocked", "vocab_size",
               "num_dense", "bits", "num_bits", "wide_nodes", "num_wide")
#: The logits of a mask or step call: out and src (B, W) arrays, their row strides, W, the element size and the bit
#: patterns of -inf and of the floor in their dtype.
LOGITS_FIELDS = ("out", "src", "batch", "out_stride", "src_stride", "width", "elsize", "neg_bits", "floor_bits")
#: ``mask(trie, job)``: the logits, then the state rows, their logits rows (0: row i), their nodes, the filter bits
#: (0: none), each row's filter and the number of filters.
MASK_FIELDS = LOGITS_FIELDS + ("n", "rows", "nodes", "flags", "row_filter", "num_filters")
#: ``step(trie, job)``: the logits, then the rows' nodes (updated in place), the new tokens and their stride, the
#: parent rows, their stride and element size (0: each row its own parent), and whether to take the rules' moves.
STEP_FIELDS = LOGITS_FIELDS + ("nodes", "tokens", "token_stride", "parents", "parent_stride", "parent_size", "moves",
                               "flags", "row_filter", "num_filters")
#: ``child(trie, job)``: the output, the nodes, the tokens, their number, whether to take the rules' moves, filters.
CHILD_FIELDS = ("out", "nodes", "tokens", "n", "moves", "flags", "row_filter", "num_filters")

_PACK = {name: struct.Struct(f"={len(fields)}q") for name, fields in (
    ("trie", TRIE_FIELDS), ("mask", MASK_FIELDS), ("step", STEP_FIELDS), ("child", CHILD_FIELDS))}
_COUNTS = ("TRIE_FIELDS", "LOGITS_FIELDS", "MASK_FIELDS", "STEP_FIELDS", "CHILD_FIELDS")
if AVAILABLE and tuple(getattr(_kernel, c, -1) for c in _COUNTS) != tuple(len(globals()[c]) for c in _COUNTS):
    # A kernel built from another version of _kernel.c would read its fields wrongly: it is not used at all.
    warnings.warn("trie_decode._kernel was built from another version of _kernel.c and is not used: rebuild it "
                  "(python setup.py build_ext --inplace, or reinstall)", RuntimeWarning, stacklevel=2)
    _kernel, AVAILABLE = None, False


def _bits(value: float, dtype: torch.dtype) -> int:
    """The bit pattern of ``value`` in ``dtype``, as a non-negative integer below 2**63 for 2- and 4-byte dtypes, and
    as the signed int64 of the same bits for 8-byte ones (how it is packed)."""
    size = torch.empty(0, dtype=dtype).element_size()
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    bits = int(torch.tensor([value], dtype=dtype).view(as_int).item())
    return bits if size == 8 else bits & ((1 << (8 * size)) - 1)


# The float dtypes the kernel handles (every logits dtype, interface.LOGITS_DTYPES: it copies elements, it never
# computes on them), each with the last three LOGITS_FIELDS: its element size, the bit pattern of -inf and that of
# the floor given to a row whose kept values were all -inf (the floor rule, kernels/rules.py).
_DTYPE_ARGS = {
    dtype: (torch.empty(0, dtype=dtype).element_size(), _bits(NEG_INF, dtype), _bits(ALL_MASKED_FLOOR, dtype))
    for dtype in LOGITS_DTYPES
}


def enabled() -> bool:
    """Whether the CPU step uses the kernel: it loaded and ``TRIE_DECODE_NATIVE`` was not ``0`` at import
    (:func:`trie_decode.kernels.select` decides when a constraint is made)."""
    return ENABLED


ENABLED = AVAILABLE and os.environ.get("TRIE_DECODE_NATIVE", "1") != "0"


def usable_logits(logits: torch.Tensor) -> bool:
    """True when ``logits`` suit the kernel: a CPU (B, V) tensor of a handled float dtype with unit column stride
    and rows that do not overlap."""
    # Each tensor attribute read is a call into torch (at batch 1 they cost as much as the kernel): each read once.
    if logits.dtype not in _DTYPE_ARGS or not logits.is_cpu:
        return False
    shape = logits.shape
    if len(shape) != 2:
        return False
    stride = logits.stride()
    return (stride[1] == 1 or shape[1] <= 1) and (stride[0] >= shape[1] or shape[0] <= 1)


def _pack_trie(**fields: int) -> bytes:
    """The packed :data:`TRIE_FIELDS`, given by name (a field not given is 0: none), so that their order is written
    once, in TRIE_FIELDS."""
    unknown = set(fields) - set(TRIE_FIELDS)
    if unknown:
        raise ValueError(f"no trie fields {sorted(unknown)}")
    return _PACK["trie"].pack(*(fields.get(name, 0) for name in TRIE_FIELDS))


def trie_fields(table: Any) -> bytes:
    """The packed :data:`TRIE_FIELDS` of a CPU step table and its trie, checked and packed once per table (kept
    with it; the table keeps the arrays alive)."""
    found = table.kernel_cache.get("native")
    if found is not None:
        return found
    d = table.dtrie
    t = _checked_tensors(d)
    _check_cpu_array("step table", table.tensor, torch.int32)
    if tuple(table.tensor.shape) != (d.num_nodes + table.num_codes, TABLE_COLUMNS):
        raise ValueError("step table and trie sizes disagree")
    found = kernel_bits(table)
    bits, wide = (None, None) if found is None else found
    packed = _pack_trie(
        table=table.tensor.data_ptr(), num_nodes=d.num_nodes, num_codes=table.num_codes,
        child_token=t.child_token.data_ptr(), child_ptr=t.child_ptr.data_ptr(), dense_blocked=t.dense_blocked.data_ptr(),
        vocab_size=d.vocab_size, num_dense=d.num_dense,
        bits=0 if bits is None else bits.ctypes.data, num_bits=0 if bits is None else len(bits),
        wide_nodes=0 if wide is None else wide.ctypes.data, num_wide=0 if wide is None else len(wide),
    )
    table.kernel_cache["native_bits"] = found  # kept alive with the packed pointers
    table.kernel_cache["native"] = packed
    return packed


def _check_cpu_array(name: str, arr: torch.Tensor, dtype: torch.dtype) -> None:
    """ValueError naming ``name`` unless ``arr`` is a contiguous CPU tensor of ``dtype`` (its pointer goes to C)."""
    if arr.device.type != "cpu" or arr.dtype != dtype or not arr.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dtype} CPU tensor")


def _checked_tensors(dtrie: Any) -> Any:
    """The tensors of a CPU :class:`~trie_decode.device.DeviceTrie`, checked for the kernel's pointers: contiguous
    CPU arrays, int32 ``child_token`` (N,) and ``child_ptr`` (N + 1,), bool ``dense_blocked`` (H, V); else
    ValueError."""
    t = dtrie.tensors
    for name, dtype in (("child_token", torch.int32), ("child_ptr", torch.int32), ("dense_blocked", torch.bool)):
        _check_cpu_array(name, getattr(t, name), dtype)
    if (t.child_token.numel() != dtrie.num_nodes or t.child_ptr.numel() != dtrie.num_nodes + 1
            or tuple(t.dense_blocked.shape) != (dtrie.num_dense, dtrie.vocab_size)):
        raise ValueError("trie arrays have inconsistent shapes")
    return t


#: The most memory the bitmaps of a trie's wide nodes take (the widest nodes first); the dense rows' bitmaps, an
#: eighth of their bytes, come on top.
WIDE_BITS_BUDGET_BYTES = 32 << 20


def kernel_bits(table: Any) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """The C kernel's bitmaps of a CPU step table's trie, for its bitmap pass (``_kernel.c``, bits_row): None when
    the kernel has no bitmap pass (``_kernel.BITMAP_PASS``) or nothing to build, else ``(bits, wide_nodes)``:

    - ``bits``: a row per dense row (its kept columns: those it does not block), then a row per wide node, a node
      without a dense row that has at least ``_kernel.BITS_MIN_KEPT`` children (its children's tokens). Bit c of a
      row is bit c % 64 of its word c // 64, 1 where column c is kept; the last word is padded with 0.
      Shape: (H + W, ceil(V / 64)), uint64.
    - ``wide_nodes``: the wide nodes, ascending (the widest that fit :data:`WIDE_BITS_BUDGET_BYTES`). Shape: (W,),
      int64.

    A row at a wide node then costs one pass through its bitmap, whatever its number of children (the kernel
    would otherwise list them and build the bitmap at every step).
    """
    if not AVAILABLE or not _kernel.BITMAP_PASS:
        return None
    d = table.dtrie
    t = d.tensors
    words = -(-d.vocab_size // 64)
    step = table.tensor.numpy()[:d.num_nodes]
    count = step[:, COUNT].astype(np.int64)  # 0 at dense nodes (their children are in the dense row)
    wide = np.flatnonzero(count >= _kernel.BITS_MIN_KEPT)
    fit = WIDE_BITS_BUDGET_BYTES // (8 * words)
    if len(wide) > fit:
        wide = np.sort(wide[np.argsort(-count[wide], kind="stable")[:fit]])
    blocked = t.dense_blocked.numpy()
    if len(blocked) + len(wide) == 0:
        return None
    bits = np.zeros((len(blocked) + len(wide), words * 8), dtype=np.uint8)
    if len(blocked):  # column c: bit c % 8 of byte c // 8; as little-endian words, bit c % 64 of word c // 64
        packed = np.packbits(~blocked, axis=1, bitorder="little")
        bits[:len(blocked), :packed.shape[1]] = packed
    bits = bits.view("<u8")
    if len(wide):
        n = count[wide]
        first = step[wide, START].astype(np.int64)
        at = np.repeat(first - np.cumsum(n) + n, n) + np.arange(int(n.sum()))  # every wide node's child positions
        tok = t.child_token.numpy()[at].astype(np.int64)
        row = np.repeat(np.arange(len(blocked), len(bits)), n)
        ok = (tok >= 0) & (tok < d.vocab_size)
        np.bitwise_or.at(bits, (row[ok], tok[ok] >> 6), np.left_shift(np.uint64(1), (tok[ok] & 63).astype(np.uint64)))
    return bits, wide.astype(np.int64)


def _index(t: torch.Tensor, n: int, what: str) -> torch.Tensor:
    """``t`` as a contiguous (n,) int64 CPU tensor (a copy only if it is a strided view), or ValueError."""
    if t.dtype is not torch.int64 or not t.is_cpu or t.shape != (n,):
        raise ValueError(f"{what} must be a (n={n},) int64 CPU tensor, got {t.dtype} {tuple(t.shape)} on {t.device}")
    return t if t.is_contiguous() else t.contiguous()


def _flag_fields(node_flags: "NodeFlags", num_nodes: int, n: int) -> tuple[int, int, int]:
    """The job's filter fields (the address table of the filters' flag rows, each row's filter, how many filters)
    for ``n`` state rows over a trie of ``num_nodes`` nodes; ValueError when the flags do not fit them. The
    filter indices are checked in C. The addresses are the arrays ``node_flags`` holds (contiguous int64 CPU tensors
    from its construction): the caller keeps it alive through the C call."""
    if node_flags.num_nodes != num_nodes:
        raise ValueError(f"node flags of {node_flags.num_nodes} nodes for a trie of {num_nodes}")
    filt = node_flags.filter_of_row
    if filt.shape != (n,):
        raise ValueError(f"row filters must be ({n},), got {tuple(filt.shape)}")
    if not node_flags.rows:  # no filter at all: only zero rows may have them
        if n:
            raise ValueError(f"{n} rows name filters, but the node flags hold none")
        return 0, 0, 0
    return node_flags.addresses.data_ptr(), filt.data_ptr(), len(node_flags.rows)


def mask_rows(out: torch.Tensor, src: torch.Tensor, nodes: torch.Tensor, rows: Optional[torch.Tensor], table: Any,
              node_flags: Optional["NodeFlags"] = None) -> int:
    """Mask rows of ``src`` into ``out`` (they may be the same tensor) by their trie states; returns rows masked.

    Args:
        out, src: Shape: (B, W), same shape and dtype (see :func:`usable_logits`); W may be narrower than the
            trie's vocabulary when every token the rows can keep lies below W (``TrieConstraint.needed_width``).
        nodes: each state row's node or code. Shape: (R,), int64.
        rows: logits row of each state row (None: state row i is logits row i; R must then be <= B).
        table: the CPU :class:`~trie_decode.device.StepTable` of (trie, rules).
        node_flags: static allow/deny filters in the same pass (:meth:`RowFilters.node_flags`): each filter's
            flags at every node and each state row's filter (:class:`~trie_decode.filters.NodeFlags`).
    """
    if not _takes(out, src):
        raise ValueError(_LOGITS_ERROR)
    return _mask_rows(out, src, nodes, rows, table, node_flags)


_LOGITS_ERROR = "the kernel takes 2-D CPU float logits with unit column stride, out and src alike"


def _takes(out: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether the kernel takes these logits: ``src`` and ``out`` (unless it is ``src``) pass :func:`usable_logits`
    (that they are alike is checked when their pointers are packed, :func:`_mask_job`)."""
    return usable_logits(src) and (out is src or usable_logits(out))


def _mask_rows(out: torch.Tensor, src: torch.Tensor, nodes: torch.Tensor, rows: Optional[torch.Tensor], table: Any,
               node_flags: Optional["NodeFlags"]) -> int:
    """:func:`mask_rows` for logits already checked (:func:`_takes`)."""
    n = nodes.numel()
    nodes = _index(nodes, n, "nodes")
    if rows is not None:
        rows = _index(rows, n, "rows")
    filters = (0, 0, 0) if node_flags is None else _flag_fields(node_flags, table.dtrie.num_nodes, n)
    return _kernel.mask(trie_fields(table), _mask_job(out, src, nodes, rows, filters))


def _mask_job(out: torch.Tensor, src: torch.Tensor, nodes: torch.Tensor, rows: Optional[torch.Tensor],
              filters: tuple[int, int, int]) -> bytes:
    """The packed MASK_FIELDS of a mask call (arrays already checked: the logits by :func:`_takes`, ``nodes`` and
    ``rows`` contiguous int64); ValueError unless ``out`` is ``src`` or has its shape and dtype (the kernel writes
    ``out`` with ``src``'s geometry: every C mask call's pointers are packed here, after this check)."""
    if out is not src and (out.shape != src.shape or out.dtype != src.dtype):
        raise ValueError(_LOGITS_ERROR)
    batch, width = src.shape
    return _PACK["mask"].pack(out.data_ptr(), src.data_ptr(), batch, out.stride(0), src.stride(0), width,
                              *_DTYPE_ARGS[src.dtype], nodes.numel(), 0 if rows is None else rows.data_ptr(),
                              nodes.data_ptr(), *filters)


def child(dtrie: Any, nodes: torch.Tensor, tokens: torch.Tensor, table: Any = None,
          node_flags: Optional["NodeFlags"] = None) -> torch.Tensor:
    """The child of each node by each token; where there is none, -1, or with a step ``table`` the span rules' move
    (:func:`trie_decode.spans.span_moves` in one C pass).

    Args:
        dtrie: a CPU :class:`~trie_decode.device.DeviceTrie`.
        nodes, tokens: Shape: (R,), int64, CPU.
        table: the CPU :class:`~trie_decode.device.StepTable` of (``dtrie``, rules), or None.
        node_flags: static filters (see :func:`mask_rows`), with ``table``: the row's moves over the trie its
            filter leaves it (as ``TrieConstraint`` does with filters on other kernels).
    Returns:
        Shape: (R,), int64.
    """
    n = nodes.numel()
    nodes, tokens = _index(nodes, n, "nodes"), _index(tokens, n, "tokens")
    out = torch.empty(n, dtype=torch.int64)
    if table is None:
        trie = dtrie.__dict__.get("_kernel_trie_fields")
        if trie is None:
            t = _checked_tensors(dtrie)
            trie = dtrie._kernel_trie_fields = _pack_trie(
                num_nodes=dtrie.num_nodes, child_token=t.child_token.data_ptr(), child_ptr=t.child_ptr.data_ptr(),
                vocab_size=dtrie.vocab_size)
    else:
        if table.dtrie is not dtrie:
            raise ValueError("the step table belongs to another trie")
        trie = trie_fields(table)  # checks the table's dtype, device and shape once
    filters = (0, 0, 0)
    if node_flags is not None:
        if table is None:
            raise ValueError("node flags need the step table (the moves off the trie a filter's rows take)")
        filters = _flag_fields(node_flags, dtrie.num_nodes, n)
    if n == 0:  # nothing to look up (and an empty tensor's data address is 0, which C reads as a missing array)
        return out
    _kernel.child(trie, _PACK["child"].pack(out.data_ptr(), nodes.data_ptr(), tokens.data_ptr(), n,
                                            int(table is not None), *filters))
    return out


_PACK_STEP = _PACK["step"].pack


class FusedStep:
    """A whole step of rows that keep their places, advance and mask, in one C call (``_kernel.step``).

    Why this exists: at small batches the step's cost is the Python around the kernel, not the kernel: the general
    path (``TrieConstraint.advance`` then ``mask_``) checks, copies and wraps its arguments twice per step. This
    object checks everything that never changes once, when it is made, keeps the rows' nodes in its own tensor
    (updated in place), and per step checks only what the caller passes: the generation's ``input_ids`` (the new
    tokens are read straight from its last column), the logits and, under beam search, the column of parent rows.
    Same rules and same C code as the general path (the kernel's ``child`` and ``mask``), static filters included,
    without distinct lists, triggers or row mappings: :meth:`trie_decode.TrieConstraint.fused_step` makes one only
    where it applies.

    Args:
        table: the CPU :class:`~trie_decode.device.StepTable` of (trie, rules).
        nodes: the rows' current nodes. Shape: (R,), int64, CPU (kept and updated in place).
        needed_width: the fewest logits columns that hold every token the rows can keep.
        node_flags: the rows' static filters (:class:`~trie_decode.filters.NodeFlags`), or None. Each row's filter
            follows its parent row as the nodes do (``filters``, updated in place).
    """

    __slots__ = ("nodes", "rows", "needed_width", "_filters", "_node_flags", "_filter_fields", "_nodes_ptr", "_moves",
                 "_trie", "_geometry", "_job")

    def __init__(self, table: Any, nodes: torch.Tensor, needed_width: int,
                 node_flags: Optional["NodeFlags"] = None) -> None:
        if not AVAILABLE:
            raise RuntimeError("the fused step needs the C kernel, which this install does not have")
        self.nodes = _index(nodes, nodes.numel(), "nodes")
        self.rows = self.nodes.numel()
        self._nodes_ptr = self.nodes.data_ptr()  # the tensor is kept: its storage does not move
        self.needed_width = needed_width
        self._trie = trie_fields(table)
        # the span rules' moves off the trie, from the step table (a filter's rows need them: see child)
        self._moves = 0 if table.rules.plain and node_flags is None else 1
        self._node_flags = node_flags  # keeps the filters' flag rows alive
        self._filter_fields = (0, 0, 0)
        self._filters: Optional[torch.Tensor] = None  # each row's filter, as its parent rows left it
        if node_flags is not None:
            addresses, _, num_filters = _flag_fields(node_flags, table.dtrie.num_nodes, self.rows)  # checks them
            self._filters = node_flags.filter_of_row.clone()  # this step's own: the C step updates it in place
            self._filter_fields = (addresses, self._filters.data_ptr() if num_filters else 0, num_filters)
        self._geometry: Optional[tuple] = None
        self._job = b""

    @property
    def filters(self) -> Optional[torch.Tensor]:
        """Each row's filter (an index into the node flags' rows) as its parent rows left it, or None without
        filters. Shape: (R,), int64 (read only: the C step writes it)."""
        return self._filters

    def __call__(self, input_ids: Optional[torch.Tensor], logits: torch.Tensor, out: Optional[torch.Tensor] = None,
                 parents: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Advance every row by its last token, then mask; returns the masked logits.

        Args:
            input_ids: the rows' tokens, the new one last. Shape: (R, L), int64, CPU. None: mask only.
            logits: Shape: (R, W), W >= ``needed_width``, masked in place unless ``out`` is given.
            out: a tensor like ``logits`` to write the result into (``logits`` is left unchanged).
            parents: the row each row continues (beam search). Shape: (R,), int32 or int64, CPU; None: itself.
        """
        # Each tensor attribute read is a call into torch, and inside generate every call runs on cold caches: each
        # attribute is read once.
        shape, stride, dtype = logits.shape, logits.stride(), logits.dtype
        bits = _DTYPE_ARGS.get(dtype)
        if (bits is None or not logits.is_cpu or len(shape) != 2 or shape[0] != self.rows
                or (stride[1] != 1 and shape[1] > 1) or (stride[0] < shape[1] and shape[0] > 1)):
            raise ValueError(f"the fused step takes ({self.rows}, V) CPU float logits with unit column stride, got "
                             f"{tuple(shape)} {dtype} on {logits.device}")
        InvalidTokenError.check_logits_width(shape[1], self.needed_width)
        src_ptr = logits.data_ptr()
        if out is None:
            out_ptr, out_stride = src_ptr, stride[0]
        elif out.shape != shape or out.dtype != dtype or not usable_logits(out):
            raise ValueError(f"out must match the logits ({tuple(shape)}, {dtype}), got "
                             f"{tuple(out.shape)}, {out.dtype} on {out.device}")
        else:
            out_ptr, out_stride = out.data_ptr(), out.stride(0)
        tokens = token_stride = parent_ptr = parent_stride = parent_size = 0
        if input_ids is not None:
            ids_shape = input_ids.shape
            if input_ids.dtype is not torch.int64 or not input_ids.is_cpu or len(ids_shape) != 2 \
                    or ids_shape[0] != self.rows or ids_shape[1] < 1:
                raise ValueError(f"input_ids must be a ({self.rows}, L >= 1) int64 CPU tensor, got {input_ids.dtype} "
                                 f"{tuple(ids_shape)} on {input_ids.device}")
            ids_stride = input_ids.stride()
            tokens = input_ids.data_ptr() + (ids_shape[1] - 1) * ids_stride[1] * 8
            token_stride = ids_stride[0]
            if parents is not None:
                if parents.dtype not in (torch.int32, torch.int64) or not parents.is_cpu or parents.dim() != 1 \
                        or parents.numel() != self.rows:
                    raise ValueError(f"parents must be a ({self.rows},) int32 or int64 CPU tensor, got {parents.dtype} "
                                     f"{tuple(parents.shape)} on {parents.device}")
                parent_ptr, parent_stride, parent_size = parents.data_ptr(), parents.stride(0), parents.element_size()
        geometry = (out_stride, stride[0], shape[1], bits, parent_size)
        if geometry != self._geometry:  # the job's fields that stay the same from step to step, packed once
            self._geometry = geometry
            self._job = _PACK_STEP(0, 0, self.rows, out_stride, stride[0], shape[1], *bits, self._nodes_ptr, 0, 0, 0,
                                   0, parent_size, self._moves, *self._filter_fields)
        _kernel.step(self._trie, self._job, out_ptr, src_ptr, tokens, token_stride, parent_ptr, parent_stride)
        return logits if out is None else out


class _Tables(list):
    """A constraint's step tables (a list), with their packed fields together once built (``packed``)."""

    packed: Optional[bytes] = None


class NativeKernel(GroupedKernel):
    """The kernel interface of :mod:`trie_decode.kernels` on top of the C functions (CPU only).

    Logits the C kernel does not take (another dtype, a column stride) are masked by the numpy kernel instead.
    """

    name = "native"
    device_kinds = frozenset({"cpu"})
    writes_every_row = True  # out of place, every row is written (masked, or copied through): no clone needed
    #: The C code names a row outside the batch itself (``_kernel.c``), so nothing is read before dispatch: a V2 or
    #: GPU-resident row map stays unread on the host.
    reads_host = False
    #: Static filters are applied in the kernel's own pass, from their per-node bits (see :func:`mask_rows`).
    supports_filters = True
    #: A caller that owns its rows' state can step them in one C call (:class:`FusedStep`).
    supports_fused_step = True

    def available(self) -> bool:
        return AVAILABLE

    def default_on(self, device: torch.device) -> bool:
        return ENABLED and self.runs_on(device)

    def takes_filters(self, out: torch.Tensor, src: torch.Tensor) -> bool:
        return _takes(out, src)

    def fused_step(self, table: Any, nodes: torch.Tensor, needed_width: int,
                   node_flags: Optional["NodeFlags"] = None) -> FusedStep:
        return FusedStep(table, nodes, needed_width, node_flags)

    def mask_rows(self, tables: Sequence[Any], out: torch.Tensor, src: torch.Tensor, node: torch.Tensor,
                  tree: torch.Tensor, rows: Optional[torch.Tensor],
                  filter_bits: Optional["NodeFlags"] = None) -> None:
        """As :meth:`GroupedKernel.mask_rows`; rows of several tries (per-prompt tries, many spans) go to C in one
        call with each row's trie: a batch spread over many tries costs one C call and no per-trie Python, numpy or
        tensor work."""
        n = node.numel()
        if n == 0:
            return
        if len(tables) == 1:  # one trie: straight to the C call (no grouping; filters go in the same pass)
            self.mask(out, src, node, rows, tables[0], filter_bits)
            return
        usable = _takes(out, src)
        if not usable and out is not src:
            # Logits the C kernel does not take are masked in place by the numpy kernel, one trie at a time: copied
            # into out once, here (a copy per trie would undo the rows of the tries masked before it).
            out.copy_(src)
            src = out
        if filter_bits is not None or n == 1 or not usable:
            super().mask_rows(tables, out, src, node, tree, rows, filter_bits)
            return
        nodes, tree = _index(node, n, "nodes"), _index(tree, n, "tree")
        if rows is not None:
            rows = _index(rows, n, "rows")  # each checked against the batch in C
        else:
            check_state_rows(n, src.shape[0])
        # One C call: each run of rows of one trie is masked with that trie's fields (_kernel.c, mask).
        _kernel.mask(self._all_fields(tables), _mask_job(out, src, nodes, rows, (0, 0, 0)), tree.data_ptr())

    @staticmethod
    def _all_fields(tables: Sequence[Any]) -> bytes:
        """Every table's packed fields, one after another (kept with the constraint's prepared tables, which keep
        the tables and so their arrays alive)."""
        found = getattr(tables, "packed", None)
        if found is None:
            found = b"".join(trie_fields(t) for t in tables)
            if isinstance(tables, _Tables):
                tables.packed = found
        return found

    def prepare(self, tables: Sequence[Any]) -> Sequence[Any]:
        """Per-constraint data: the step tables, and (once, on first use) their packed fields together. Each
        table's own fields (and its bitmaps, :func:`kernel_bits`) are packed now, when the constraint is made: a step
        never reads a table on the host."""
        for t in tables:
            trie_fields(t)
        return _Tables(tables)

    def advance(self, table: Any, node: torch.Tensor, tokens: torch.Tensor,
                node_flags: Optional["NodeFlags"] = None) -> torch.Tensor:
        """Each row's next state code (before the trigger check). Shape: (R,), int64 CPU tensors in and out.
        With ``node_flags`` (static filters), over the trie each row's filter leaves it."""
        plain = table.rules.plain and node_flags is None
        return child(table.dtrie, node, tokens, None if plain else table, node_flags)

    def mask(self, out: torch.Tensor, src: torch.Tensor, node: torch.Tensor, rows: Optional[torch.Tensor], table: Any,
             node_flags: Optional["NodeFlags"] = None) -> None:
        """Mask the state rows' logits rows of ``src`` into ``out`` (the same tensor, or one of the same shape)."""
        if _takes(out, src):
            _mask_rows(out, src, node, rows, table, node_flags)
            return
        if node_flags is not None:
            raise ValueError("node flags need logits the C kernel takes (see takes_filters)")
        if out is not src:
            out.copy_(src)
        NUMPY_KERNEL.mask(out, out, node, rows, table)
