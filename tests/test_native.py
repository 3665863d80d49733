"""The fused CPU kernel (trie_decode/_kernel.c) against the numpy/torch path it replaces on CPU.

Both paths read the same step table; here they must give bit-identical logits for every kind of row (inside an
entry, dense, done, free, in a separator), in place and out of place, with a row mapping, wider logits, strided
rows and every float dtype; and the kernel must survive corrupt states without touching memory it does not own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional

import numpy as np
import pytest
import torch

from trie_decode import TokenTrie
from trie_decode.constraint import DONE, FREE, SpanRules, TrieConstraint
from trie_decode.errors import InvalidTokenError
from trie_decode.kernels import native as _native
from trie_decode.kernels.vectorized import NUMPY_KERNEL
from trie_decode.spans import COUNT

from reference import SPAN_RULE_CASES

V = 300
END = 1


def test_kernel_is_built():
    """setup.py compiles the kernel wherever a C compiler exists (this project's machines and CI all have one)."""
    assert _native.AVAILABLE, "trie_decode._kernel did not build: run `make venv` (pip install -e .) with a C compiler"
    assert _native.ENABLED


def _random_trie(rng: np.random.Generator, n: int) -> TokenTrie:
    seqs = [rng.integers(2, V, size=rng.integers(1, 5)).tolist() for _ in range(n)]
    seqs += [[7], [7, 8], [7, 8, 9]]  # entries that prefix others
    return TokenTrie.from_sequences(seqs, vocab_size=V)


def _fallback(c: TrieConstraint, logits, state, rows=None, *, kernel="numpy"):
    """The same constraint (same tries, rules and dense rows) masking through another kernel, in place."""
    return c.with_kernel(kernel).mask_(logits, state, rows)


def _states(c: TrieConstraint, rng: np.random.Generator, rows: int) -> torch.Tensor:
    """Nodes from every part of the tries, plus every negative code the rules use."""
    n = min(d.num_nodes for d in c.dtries)
    codes = [DONE, FREE] + [-2 - k for k in range(1, len(c.rules.separator))]
    pool = list(range(min(n, 50))) + rng.integers(0, n, 20).tolist() + codes
    return torch.tensor(rng.choice(pool, size=rows), dtype=torch.long)


@pytest.mark.parametrize("on_complete", ["eos", "release", "repeat"])
@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_kernel_equals_fallback(on_complete, dense, dtype):
    rng = np.random.default_rng(hash((on_complete, dense, str(dtype))) % 2**32)
    tries = [_random_trie(rng, 400), _random_trie(rng, 30)]
    sep = (3, 4) if on_complete == "repeat" else ()
    rules = SpanRules(end_token_id=END, on_complete=on_complete, separator=sep)
    c = TrieConstraint(tries, rules, "cpu", dense_min_fanout=8 if dense else None)
    assert c.kernel.name == "native"
    if dense:
        assert all(d.num_dense > 0 for d in c.dtries)
    for trial in range(6):
        rows = 17
        state = c.start(rows, torch.from_numpy(rng.integers(0, 2, rows)))
        state.node = _states(c, rng, rows)
        state.node[state.tree == 1] = state.node[state.tree == 1].clamp(max=c.dtries[1].num_nodes - 1)
        width = V + 7
        logits = torch.randn(rows, width).to(dtype)
        # Other processors' bans: random -inf columns, and whole rows at -inf (every kept value banned: the floor).
        logits[torch.from_numpy(rng.random((rows, width)) < 0.3)] = float("-inf")
        logits[torch.from_numpy(rng.random(rows) < 0.3)] = float("-inf")
        # in place and out of place
        ref = _fallback(c, logits.clone(), state)
        got = c.mask_(logits.clone(), state)
        assert torch.equal(got, ref)
        assert torch.equal(_fallback(c, logits.clone(), state, kernel="torch"), ref)
        before = logits.clone()
        got = c.mask_(logits, state, inplace=False)
        assert torch.equal(got, ref) and torch.equal(logits, before)
        # a row mapping into a larger batch (vLLM: only some rows are constrained); strided rows
        big = torch.randn(2 * rows + 3, width).to(dtype)
        mapping = torch.from_numpy(rng.permutation(2 * rows + 3)[:rows].astype(np.int64))
        ref = _fallback(c, big.clone(), state, mapping)
        assert torch.equal(c.mask_(big.clone(), state, mapping), ref)
        assert torch.equal(c.mask_(big, state, mapping, inplace=False), ref)
        wide = torch.randn(rows, 2 * width).to(dtype)
        view = wide[:, :width]
        ref = _fallback(c, view.clone(), state)
        c.mask_(view, state)
        assert torch.equal(view, ref) and wide[:, width:].isfinite().all()


@pytest.mark.parametrize("kernel", ["native", "numpy", "torch"])
@pytest.mark.parametrize("dense", [False, True])
def test_logits_narrower_than_the_vocabulary(kernel, dense):
    """A tokenizer wider than the model's logits: every kernel masks the logits' own width, and the result equals
    masking full-width logits then dropping the extra columns (no padded copy of the vocabulary is made)."""
    rng = np.random.default_rng(7)
    seqs = [rng.integers(2, 60, size=rng.integers(1, 4)).tolist() for _ in range(300)]
    trie = TokenTrie.from_sequences(seqs, vocab_size=10_000)  # every trie token < 60, a vocabulary of 10k
    rules = SpanRules(end_token_id=END, on_complete="repeat", separator=(3,))
    c = TrieConstraint(trie, rules, "cpu", dense_min_fanout=8 if dense else None, kernel=kernel)
    assert c.needed_width <= 60 and (c.dtries[0].num_dense > 0) == dense
    state = c.start(9)
    state.node = _states(c, rng, 9)
    full = torch.randn(9, trie.vocab_size)
    full[:, :60][torch.from_numpy(rng.random((9, 60)) < 0.3)] = float("-inf")
    ref = c.mask_(full.clone(), state)
    for width in (60, 64):
        assert torch.equal(c.mask_(full[:, :width].clone(), state), ref[:, :width])
        assert torch.equal(c.mask_(full[:, :width], state, inplace=False), ref[:, :width])
    with pytest.raises(InvalidTokenError, match="logits have 40 columns"):
        c.mask_(torch.zeros(9, 40), state)


def test_child_equals_searchsorted():
    rng = np.random.default_rng(1)
    trie = _random_trie(rng, 2000)
    c = TrieConstraint(trie, SpanRules(end_token_id=END), "cpu", dense_min_fanout=16)
    d = c.dtries[0]
    nodes = np.concatenate([rng.integers(0, trie.num_nodes, 500), [-1, -2, -7, trie.num_nodes, 2**40]])
    tokens = np.concatenate([rng.integers(-3, V + 3, 500), [5, 5, 5, 5, 5]])
    # every real edge too
    edges_node, edges_tok = trie.parent[1:].astype(np.int64), trie.token[1:].astype(np.int64)
    nodes, tokens = np.concatenate([nodes, edges_node]), np.concatenate([tokens, edges_tok])
    ref = NUMPY_KERNEL.child(d, nodes.copy(), tokens.copy())
    got = _native.child(d, torch.from_numpy(nodes), torch.from_numpy(tokens)).numpy()
    assert np.array_equal(got, ref)
    strided = torch.stack([torch.from_numpy(tokens), torch.from_numpy(tokens)], dim=1)[:, 0]  # generate's ids[:, -1]
    assert not strided.is_contiguous()
    assert np.array_equal(_native.child(d, torch.from_numpy(nodes), strided).numpy(), ref)
    assert np.array_equal(got[-len(edges_node):], np.arange(1, trie.num_nodes))


def test_corrupt_states_never_read_out_of_bounds():
    """A corrupt node id (a bug elsewhere, or a hand-made RowState) reads as DONE: only the end token survives."""
    trie = TokenTrie.from_sequences([[5, 6], [9]], vocab_size=20)
    c = TrieConstraint(trie, SpanRules(end_token_id=2), "cpu")
    state = c.start(4)
    state.node = torch.tensor([2**40, -(2**40), trie.num_nodes, -50])
    out = c.mask_(torch.zeros(4, 20), state)
    assert out.isfinite().nonzero().tolist() == [[0, 2], [1, 2], [2, 2], [3, 2]]
    for rows in (torch.tensor([0, 1, 7, 1]), torch.tensor([0, -3, 1, 1])):
        with pytest.raises(IndexError, match="outside the batch of 2 rows"):
            c.mask_(torch.zeros(2, 20), c.start(4), rows)
    with pytest.raises(IndexError, match="4 states for a batch of 2"):
        c.mask_(torch.zeros(2, 20), c.start(4))


def test_out_of_place_rows_of_several_tries_in_logits_the_kernel_does_not_take():
    """Logits with a column stride go to the numpy kernel, one trie at a time, in place: out of place, the copy
    into ``out`` is made once, not once per trie (which undid the rows of the tries masked before)."""
    tries = [TokenTrie.from_sequences([[5, 6], [7]], vocab_size=50),
             TokenTrie.from_sequences([[9, 10], [11]], vocab_size=50)]
    c = TrieConstraint(tries, SpanRules(end_token_id=END), "cpu")
    assert c.kernel.name == "native"
    state = c.start(3, torch.tensor([0, 1, 0]))
    logits = torch.randn(50, 3).t()  # column stride 3
    assert not _native.usable_logits(logits)
    ref = _fallback(c, logits.contiguous(), state)
    assert torch.equal(c.mask_(logits, state, inplace=False), ref)
    assert torch.equal(c.mask_(logits, state, out=torch.zeros(3, 50)), ref)
    assert [row.isfinite().nonzero().flatten().tolist() for row in ref] == [[5, 7], [9, 11], [5, 7]]


def test_zero_rows():
    """A batch with no constrained row: the kernel's calls take empty tensors (whose data address is 0)."""
    trie = TokenTrie.from_sequences([[5, 6], [7]], vocab_size=20)
    for tries in ([trie], [trie, trie]):
        c = TrieConstraint(tries, SpanRules(end_token_id=END), "cpu")
        state = c.start(0, torch.zeros(0, dtype=torch.long))
        assert c.advance(state, torch.zeros(0, dtype=torch.long)).node.shape == (0,)
        logits = torch.randn(2, 20)
        assert torch.equal(c.mask_(logits.clone(), state), logits)
    step = _native.FusedStep(c.tables[0], torch.zeros(0, dtype=torch.long), c.needed_width)
    assert step(torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, 20)).shape == (0, 20)
    assert step(None, torch.zeros(0, 20)).shape == (0, 20)


def test_wrapper_rejects_bad_arrays():
    trie = TokenTrie.from_sequences([[5, 6]], vocab_size=20)
    c = TrieConstraint(trie, SpanRules(end_token_id=2), "cpu")
    table, logits = c.tables[0], torch.zeros(2, 20)
    with pytest.raises(ValueError, match="int64"):
        _native.mask_rows(logits, logits, torch.zeros(2, dtype=torch.int32), None, table)
    with pytest.raises(ValueError, match="n=2"):
        _native.mask_rows(logits, logits, torch.zeros(2, dtype=torch.long), torch.zeros(3, dtype=torch.long), table)
    with pytest.raises(ValueError, match="out and src alike"):
        _native.mask_rows(torch.zeros(3, 20), logits, torch.zeros(2, dtype=torch.long), None, table)
    with pytest.raises(ValueError, match="unit column stride"):
        _native.mask_rows(logits.t(), logits.t(), torch.zeros(20, dtype=torch.long), None, table)
    with pytest.raises(ValueError, match="int64"):
        _native.child(c.dtries[0], torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.float32))
    # logits the kernel cannot take (integer dtype, column stride) go to the fallback, which raises or copes
    assert not _native.usable_logits(torch.zeros(2, 20, dtype=torch.int32))
    assert not _native.usable_logits(torch.zeros(20, 2).t())
    t_logits = torch.randn(20, 2).t()
    ref = _fallback(c, t_logits.contiguous(), c.start(2))
    assert torch.equal(c.mask_(t_logits, c.start(2), inplace=False), ref)


def test_kernel_rows_of_several_tries_check_out_before_its_pointer_goes_to_c():
    """The kernel's one-call path for rows of several tries packs ``out``'s pointer with ``src``'s geometry: an out
    of another shape or dtype is refused before C could write past it."""
    trie = TokenTrie.from_sequences([[5, 6], [7]], vocab_size=20)
    c = TrieConstraint([trie, trie], SpanRules(end_token_id=END), "cpu")
    state = c.start(3, torch.tensor([0, 1, 0]))
    src = torch.randn(3, 20)
    fewer_rows, narrower = torch.zeros(3, 20), torch.zeros(3, 20, dtype=torch.float16)
    for buffer, out in ((fewer_rows, fewer_rows[:1]), (narrower, narrower)):
        with pytest.raises(ValueError, match="out and src alike"):
            c.kernel.mask_rows(c._prepared, out, src, state.node, state.tree, None)
        assert not buffer.any()


def test_environment_switch_turns_the_kernel_off():
    code = ("from trie_decode.kernels import native, select; "
            "print(native.AVAILABLE, native.enabled(), select('cpu').name)")
    env = {**os.environ, "TRIE_DECODE_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False", "numpy"]


@pytest.mark.parametrize("kernel", ["native", "numpy", "torch"])
@pytest.mark.parametrize("dense", [False, True])
def test_rows_other_processors_emptied_keep_the_tries_tokens(kernel, dense):
    """Every allowed token already -inf (min_new_tokens banned the end token, bad_words the only child): the row's
    allowed tokens get the finite floor, so it still emits a token of the trie; other rows are untouched."""
    from trie_decode.kernels.vectorized import ALL_MASKED_FLOOR

    trie = TokenTrie.from_sequences([[5, 6], [5, 7], [9]] + [[10 + i] for i in range(40)], vocab_size=60)
    c = TrieConstraint(trie, SpanRules(end_token_id=2), "cpu", dense_min_fanout=8 if dense else None, kernel=kernel)
    state = c.advance(c.start(3), torch.tensor([5, 9, 10]))  # at [5]: {6, 7}; at [9] and [10]: only the end token
    root = c.start(1)
    logits = torch.randn(4, 64)
    logits[0, [6, 7]] = float("-inf")  # both children banned
    logits[1, 2] = float("-inf")  # the end token banned
    state = type(state).cat([state, root])
    logits[3] = float("-inf")  # a whole row banned, at the (dense) root
    before = logits.clone()
    out = c.mask_(logits, state)
    assert out[0].isfinite().nonzero().flatten().tolist() == [6, 7] and (out[0, [6, 7]] == ALL_MASKED_FLOOR).all()
    assert out[1].isfinite().nonzero().flatten().tolist() == [2] and out[1, 2] == ALL_MASKED_FLOOR
    assert out[2].isfinite().nonzero().flatten().tolist() == [2] and out[2, 2] == before[2, 2]
    root_allowed = sorted(trie.children(0)[0].tolist())
    assert out[3].isfinite().nonzero().flatten().tolist() == root_allowed
    assert (out[3, root_allowed] == ALL_MASKED_FLOOR).all()


@pytest.mark.parametrize("on_complete", ["eos", "repeat"])
@pytest.mark.parametrize("dense", [False, True])
def test_filters_in_the_kernel_equal_the_filter_pass(on_complete, dense):
    """Static allow/deny filters masked in the C kernel's own pass (per-node flags) give exactly the logits of the
    numpy and torch kernels followed by the filter pass, values included: other processors' -inf bans, the floor,
    rows the filters leave with nothing, per-row filters, a row mapping, dense rows, and entries holding the
    separator's token."""
    rng = np.random.default_rng(hash((on_complete, dense)) % 2**32)
    for trial in range(40):
        seqs = [rng.integers(3, 40, size=rng.integers(1, 4)).tolist() for _ in range(rng.integers(2, 60))]
        trie = TokenTrie.from_sequences(seqs, vocab_size=V)
        rules = SpanRules(end_token_id=END, **(dict(on_complete="repeat", separator=(3,)) if on_complete == "repeat" else {}))
        c = TrieConstraint(trie, rules, "cpu", dense_min_fanout=4 if dense else None)
        assert c.kernel.name == "native"
        e = trie.num_entries
        rows = 7
        allow = [None if rng.random() < 0.5 else rng.choice(e, rng.integers(1, e + 1), replace=False) for _ in range(rows)]
        deny = [rng.choice(e, rng.integers(0, e // 2 + 1), replace=False) for _ in range(rows)]
        usable = [(set(range(e)) if a is None else set(a.tolist())) - set(d.tolist()) for a, d in zip(allow, deny)]
        if not all(usable):
            continue
        f = c.filters(rows, allow=allow, deny=deny)
        state = c.start(rows)
        state.node = _states(c, rng, rows)
        logits = torch.randn(rows + 2, V + 3)
        logits[torch.from_numpy(rng.random(logits.shape) < 0.4)] = float("-inf")
        logits[torch.from_numpy(rng.random(rows + 2) < 0.2)] = float("-inf")
        mapping = torch.from_numpy(rng.permutation(rows + 2)[:rows].astype(np.int64))
        got = c.mask_(logits.clone(), state, mapping, filters=f)
        for other in ("numpy", "torch"):
            ref = c.with_kernel(other).mask_(logits.clone(), state, mapping, filters=f)
            assert torch.equal(got, ref), (trial, other)


@pytest.mark.parametrize("case", [c for c in SPAN_RULE_CASES if not c.get("trigger")])
@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("parents_dtype", [None, torch.int32, torch.int64])
def test_fused_step_equals_advance_then_mask(case, dense, parents_dtype):
    """``TrieConstraint.fused_step`` (one C call: advance by input_ids' last column, from each row's parent, then mask)
    gives the same nodes and the same logits as ``advance`` + ``mask_``, step after step, in place and out of place,
    with tokens on and off the trie and rows other processors emptied."""
    rng = np.random.default_rng(hash((str(case), dense, str(parents_dtype))) % 2**32)
    trie = _random_trie(rng, 300)
    c = TrieConstraint(trie, SpanRules(end_token_id=END, **case), "cpu", dense_min_fanout=8 if dense else None)
    rows, width = 9, V + 5
    ref = c.start(rows)
    state = c.start(rows)
    step = c.fused_step(state)
    assert step is not None and step.nodes is state.node
    ids = torch.from_numpy(rng.integers(0, V, (rows, 3)))
    for t in range(12):
        # the logits' width and the parents' presence change between some steps (the step repacks its job's fixed
        # fields then) and stay between others (it reuses them)
        logits = torch.randn(rows, width + (t // 4))
        logits[torch.from_numpy(rng.random(rows) < 0.2)] = float("-inf")
        parents = None
        if t:
            if parents_dtype is not None and t != 6:
                parents = torch.from_numpy(rng.integers(0, rows, rows)).to(parents_dtype)
                ref = ref.select(parents.long())
            ref = c.advance(ref, ids[:, -1])
        expected = c.mask_(logits.clone(), ref)
        if t % 2:
            out = torch.empty_like(logits)
            before = logits.clone()
            got = step(ids if t else None, logits, out, parents)
            assert got is out and torch.equal(logits, before)
        else:
            got = step(ids if t else None, logits, None, parents)
            assert got is logits
        assert torch.equal(state.node, ref.node), t
        assert torch.equal(got, expected), t
        # the next token: mostly one the row may emit, sometimes any token (off the trie)
        allowed = [torch.isfinite(expected[i]).nonzero().flatten().tolist() for i in range(rows)]
        nxt = [int(rng.choice(a)) if a and rng.random() < 0.85 else int(rng.integers(0, V)) for a in allowed]
        ids = torch.cat([ids, torch.tensor(nxt).unsqueeze(1)], 1)


def test_fused_step_where_it_applies_and_its_errors():
    rng = np.random.default_rng(7)
    trie = _random_trie(rng, 50)
    plain = TrieConstraint(trie, SpanRules(end_token_id=END), "cpu")
    assert TrieConstraint(trie, SpanRules(end_token_id=END, trigger=(5,)), "cpu").fused_step(plain.start(2)) is None
    assert TrieConstraint([trie, trie], SpanRules(end_token_id=END), "cpu").fused_step(plain.start(2)) is None
    assert plain.with_kernel("numpy").fused_step(plain.start(2)) is None
    state = plain.start(2)
    step = plain.fused_step(state)
    ids, logits = torch.tensor([[7, 7], [7, 8]]), torch.zeros(2, V)
    before = state.node.clone()
    with pytest.raises(IndexError, match="parent row 2"):
        step(ids, logits, parents=torch.tensor([0, 2], dtype=torch.int32))
    assert torch.equal(state.node, before)  # nothing moved
    with pytest.raises(ValueError, match="input_ids"):
        step(ids.int(), logits)
    with pytest.raises(ValueError, match="input_ids"):
        step(ids[:1], logits)
    with pytest.raises(ValueError, match="logits"):
        step(ids, torch.zeros(3, V))
    with pytest.raises(ValueError, match="columns"):
        step(ids, torch.zeros(2, 8))
    with pytest.raises(ValueError, match="out must match"):
        step(ids, logits, torch.zeros(2, V, dtype=torch.float16))
    with pytest.raises(ValueError, match="parents"):
        step(ids, logits, parents=torch.tensor([0.0, 1.0]))
    assert torch.equal(state.node, before)
    # strided input_ids (a column view of a wider buffer, as generate's own may be) read the right column
    buf = torch.zeros(2, 10, dtype=torch.long)
    buf[:, :2] = ids
    step(buf[:, :2], logits)
    ref = plain.advance(plain.start(2), ids[:, -1])
    assert torch.equal(state.node, ref.node)


def test_c_boundary_takes_packed_fields():
    """Each C entry point takes two packed field buffers (the trie's, packed once per step table, and the call's);
    a buffer of the wrong size, type or count is refused before anything is read, and both sides agree on the
    field counts."""
    from trie_decode import _kernel

    assert (_kernel.TRIE_FIELDS, _kernel.MASK_FIELDS, _kernel.STEP_FIELDS, _kernel.CHILD_FIELDS) == tuple(
        map(len, (_native.TRIE_FIELDS, _native.MASK_FIELDS, _native.STEP_FIELDS, _native.CHILD_FIELDS)))
    assert _native.MASK_FIELDS[: len(_native.LOGITS_FIELDS)] == _native.LOGITS_FIELDS
    assert _native.STEP_FIELDS[: len(_native.LOGITS_FIELDS)] == _native.LOGITS_FIELDS
    trie = TokenTrie.from_sequences([[5, 6], [9]], vocab_size=20)
    c = TrieConstraint(trie, SpanRules(end_token_id=2), "cpu")
    packed = _native.trie_fields(c.tables[0])
    assert packed is _native.trie_fields(c.tables[0])  # packed once per table
    assert len(packed) == 8 * len(_native.TRIE_FIELDS)
    for fn, job_fields in ((_kernel.mask, _native.MASK_FIELDS), (_kernel.child, _native.CHILD_FIELDS),
                           (_kernel.step, _native.STEP_FIELDS)):
        with pytest.raises(TypeError, match=r"takes 2( or [0-9]+)? arguments"):
            fn(packed)
        with pytest.raises(TypeError, match=f"job must be bytes of {len(job_fields)} packed int64 fields"):
            fn(packed, bytes(8 * (len(job_fields) - 1)))
        with pytest.raises(TypeError, match="tries? must be bytes"):
            fn(bytearray(packed), bytes(8 * len(job_fields)))
    # step's per-call fields follow its job, all six or none, each an int
    job = bytes(8 * len(_native.STEP_FIELDS))
    for call in ((0,) * 5, (0,) * 7):
        with pytest.raises(TypeError, match="takes 2 or 8 arguments"):
            _kernel.step(packed, job, *call)
    with pytest.raises(TypeError):
        _kernel.step(packed, job, 0, 0, 0, 0, 0, "0")
    # A job without its arrays (null pointers) is refused, not dereferenced.
    with pytest.raises(ValueError, match="out, nodes and tokens"):
        _kernel.child(packed, bytes(8 * len(_native.CHILD_FIELDS)))
    with pytest.raises(ValueError, match="lack the step table"):
        _kernel.mask(bytes(8 * len(_native.TRIE_FIELDS)), bytes(8 * len(_native.MASK_FIELDS)))


def test_kernels_are_chosen_by_their_declared_capabilities():
    """One dispatcher: each kernel declares its devices, filters and fused step; the constraint asks those, so a
    kernel without a fused step gives None, and a kernel without filters leaves them to the filters' pass."""
    from trie_decode import kernels

    native, numpy_k, torch_k = (kernels.select("cpu", name) for name in ("native", "numpy", "torch"))
    assert kernels.select("cpu") is native and kernels.select("cuda") is torch_k and kernels.select("mps") is torch_k
    assert [k.supports_fused_step for k in (native, numpy_k, torch_k)] == [True, False, False]
    assert [k.supports_filters for k in (native, numpy_k, torch_k)] == [True, False, False]
    assert native.runs_on(torch.device("cpu")) and not native.runs_on(torch.device("cuda"))
    assert torch_k.runs_on(torch.device("cuda")) and torch_k.runs_on(torch.device("cpu"))
    for name in ("native", "numpy"):
        with pytest.raises(ValueError, match="runs on CPU logits only"):
            kernels.select("cuda", name)
    with pytest.raises(ValueError, match="kernel must be one of"):
        kernels.select("cpu", "fast")
    trie = TokenTrie.from_sequences([[5, 6], [5, 7]], vocab_size=10)
    for name in ("native", "numpy", "torch"):
        c = TrieConstraint(trie, SpanRules(end_token_id=0), "cpu", kernel=name)
        step = c.fused_step(c.start(2))
        assert (step is not None) == (name == "native")
        if step is not None:
            assert step(None, torch.zeros(2, 10)).isfinite().nonzero()[:, 1].tolist() == [5, 5]
        if not c.kernel.supports_filters:
            logits, state = torch.zeros(2, 10), c.start(2)
            bits = (torch.zeros(1, trie.num_nodes, dtype=torch.uint8), torch.zeros(2, dtype=torch.long))
            with pytest.raises(ValueError, match="filter bits"):
                c.kernel.mask_rows(c._prepared, logits, logits, state.node, state.tree, None, bits)
            with pytest.raises(ValueError, match="filter bits"):
                c.kernel.advance_rows(c._prepared, state.node, state.tree, torch.tensor([5, 5]), bits)


def test_floor_rule_is_one_definition():
    """The floor rule's reference definition (kernels/rules.py): rows whose kept values are all -inf get the floor,
    others keep their values; every kernel's floor equals it (test_rows_other_processors_emptied...)."""
    from trie_decode.kernels import rules, vectorized

    assert vectorized.ALL_MASKED_FLOOR == rules.ALL_MASKED_FLOOR  # re-exported, not redefined
    kept = torch.tensor([[float("-inf"), float("-inf")], [1.0, float("-inf")], [float("-inf"), 2.0]])
    alive = rules.kept_alive(kept).any(1, keepdim=True)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        got = rules.floor_rule(kept.to(dtype), alive)
        assert got.dtype == dtype
        floor = torch.tensor(rules.ALL_MASKED_FLOOR, dtype=dtype).item()  # the floor as the dtype holds it
        assert got.double().tolist() == [[floor] * 2, [1.0, float("-inf")], [float("-inf"), 2.0]]
    assert _native._DTYPE_ARGS[torch.float32][2] == _native._bits(rules.ALL_MASKED_FLOOR, torch.float32)


@pytest.mark.parametrize("with_rows", [False, True])
def test_rows_spread_over_many_tries_mask_as_the_numpy_kernel(with_rows):
    """Many tries in one batch (per-prompt tries, 100 spans): the C kernel's one sort and one call per trie present
    masks every row as the numpy kernel does, with and without a logits-row map, in place and out of place."""
    rng = np.random.default_rng(5)
    # Tokens from 1: an entry holding the end token (0) is refused (check_stop_tokens_outside_entries).
    tries = [TokenTrie.from_sequences([rng.integers(1, 40, rng.integers(1, 4)).tolist() for _ in range(6)],
                                      vocab_size=40) for _ in range(7)]
    rules = SpanRules(end_token_id=0)
    c = TrieConstraint(tries, rules, "cpu", kernel="native")
    ref = c.with_kernel("numpy")
    tree = torch.from_numpy(rng.integers(0, 7, 20))
    node = torch.tensor([int(rng.integers(0, tries[int(k)].num_nodes)) for k in tree])
    state = c.start(20, tree)
    state.node.copy_(node)
    logits = torch.randn(25, 40)
    rows = torch.from_numpy(rng.permutation(25)[:20]) if with_rows else None
    for inplace in (True, False):
        got = c.mask_(logits.clone(), state, rows=rows, inplace=inplace)
        want = ref.mask_(logits.clone(), state, rows=rows, inplace=inplace)
        assert torch.equal(got, want)


def test_many_tries_masking_refuses_rows_that_do_not_fit():
    from trie_decode import _kernel

    trie = TokenTrie.from_sequences([[5, 6], [9]], vocab_size=20)
    c = TrieConstraint([trie, trie], SpanRules(end_token_id=2), "cpu")
    packed = b"".join(_native.trie_fields(t) for t in c.tables)
    logits = torch.zeros(2, 20)
    rows, nodes = np.array([0, 1], dtype=np.int64), np.array([0, 0], dtype=np.int64)
    job = _native._PACK["mask"].pack(logits.data_ptr(), logits.data_ptr(), 2, 20, 20, 20,
                                     *_native._DTYPE_ARGS[torch.float32], 2, rows.ctypes.data, nodes.ctypes.data, 0, 0, 0)
    bad = np.array([0, 2], dtype=np.int64)
    with pytest.raises(IndexError, match="row 1 names trie 2 of 2"):
        _kernel.mask(packed, job, bad.ctypes.data)
    tree = np.array([1, 0], dtype=np.int64)
    with pytest.raises(TypeError, match="k \\* .* packed int64 fields"):
        _kernel.mask(packed[:-8], job, tree.ctypes.data)
    with pytest.raises(ValueError, match="several tries need each row's trie"):
        _kernel.mask(packed, job)
    negative = _native._PACK["mask"].pack(logits.data_ptr(), logits.data_ptr(), 2, 20, 20, 20,
                                          *_native._DTYPE_ARGS[torch.float32], -1, 0, nodes.ctypes.data, 0, 0, 0)
    with pytest.raises(ValueError, match="names -1 rows"):
        _kernel.mask(packed, negative, tree.ctypes.data)
    filtered = _native._PACK["mask"].pack(logits.data_ptr(), logits.data_ptr(), 2, 20, 20, 20,
                                          *_native._DTYPE_ARGS[torch.float32], 2, rows.ctypes.data, nodes.ctypes.data,
                                          rows.ctypes.data, rows.ctypes.data, 1)
    with pytest.raises(ValueError, match="filter flags are one trie's"):
        _kernel.mask(packed, filtered, tree.ctypes.data)
    assert not logits.isfinite().logical_not().any()  # nothing written by a refused call
    _kernel.mask(packed, job, tree.ctypes.data)
    assert logits[0].isfinite().nonzero().flatten().tolist() == [5, 9]


# ---------------------------------------------------------------- the bitmap pass (AVX-512) and many tries in one mask call

_FANOUTS = {"f62": 62, "f63": 63, "f64": 64, "f65": 65, "f130": 130, "f700": 700, "f1500": 1500, "f3000": 3000}
_EDGE_COLS = (2, 63, 64, 127, 128)  # the bitmaps' word boundaries (and limit - 64, limit - 1, added below)


def _wide_trie(seed: int, vocab: int, limit: Optional[int] = None) -> tuple[TokenTrie, dict]:
    """A trie whose root and inner nodes have 62..3000 children over tokens [2, limit) (default: the whole
    vocabulary): nodes of exactly 62, 63, 64 and 65 children (BITS_MIN_KEPT is 64), wider ones, children on the
    bitmaps' word boundaries and at the vocabulary's end, entries ending at wide nodes (their extras: the end token,
    the separator), a wide node two levels down, and ~1000 random entries under the root. Returns the trie and the
    named nodes."""
    rng = np.random.default_rng(seed)
    limit = limit or vocab
    edge = list(_EDGE_COLS) + [limit - 64, limit - 1]
    heads = rng.choice(np.arange(5, limit), len(_FANOUTS), replace=False).tolist()
    seqs: list[list[int]] = []
    for (name, k), h in zip(_FANOUTS.items(), heads):
        first = edge if name in ("f64", "f65", "f130") else []
        kids = list(dict.fromkeys(first + rng.permutation(np.arange(2, limit))[:k].tolist()))[:k]
        seqs += [[h, int(t)] for t in kids]
    named = dict(zip(_FANOUTS, heads))
    seqs += [[named[n]] for n in ("f62", "f63", "f64", "f130")]  # entries that end at (wide) nodes
    c0 = min(t for s, t in (x for x in seqs if len(x) == 2) if s == named["f130"])
    seqs += [[named["f130"], c0]] + [[named["f130"], c0, int(t)] for t in
                                       list(dict.fromkeys(edge + rng.permutation(np.arange(2, limit))[:100].tolist()))[:100]]
    randoms = (rng.integers(2, limit, size=rng.integers(1, 4)).tolist() for _ in range(1200))
    seqs += [s for s in randoms if s[0] not in heads]
    trie = TokenTrie.from_sequences(seqs, vocab_size=vocab)
    nodes = {name: trie.walk([h]) for name, h in named.items()}
    nodes["deep"] = trie.walk([named["f130"], c0])
    nodes["root"] = 0
    fan = trie.fanout
    assert {n: int(fan[nodes[n]]) for n in _FANOUTS} == _FANOUTS and fan[nodes["deep"]] == 100
    return trie, nodes


def _run_states(c: TrieConstraint, rng: np.random.Generator, named: dict, tree: int = 0) -> list[int]:
    """Runs of rows in one state (every named node, some twice, in separate runs) and single rows at other nodes and
    codes, in a random order."""
    d = c.dtries[tree]
    codes = [DONE, FREE] + [-2 - k for k in range(1, len(c.rules.separator))]
    runs = [[v] * int(rng.integers(1, 4)) for v in list(named.values()) * 2]
    runs += [[int(v)] for v in rng.integers(0, d.num_nodes, 12)] + [[v] for v in codes]
    return [v for i in rng.permutation(len(runs)) for v in runs[i]]


def _bitmap_reference(table) -> tuple[np.ndarray, np.ndarray]:
    """What kernel_bits should build, the slow way: each dense row's unblocked columns, each wide node's children."""
    from trie_decode import _kernel

    d = table.dtrie
    trie, step = d.trie, table.array[:d.num_nodes]
    wide = np.flatnonzero(step[:, COUNT] >= _kernel.BITS_MIN_KEPT)
    rows = [~d.tensors.dense_blocked.numpy()[h] for h in range(d.num_dense)]
    for m in wide:
        row = np.zeros(d.vocab_size, dtype=bool)
        row[trie.children(int(m))[0]] = True
        rows.append(row)
    return np.array(rows).reshape(len(rows), d.vocab_size), wide


def _unpack(bits: np.ndarray, vocab: int) -> np.ndarray:
    return np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)


def _check_dtypes(c: TrieConstraint, state, rows: torch.Tensor, batch: int, width: int, floor_rows: list[int],
                  rng: np.random.Generator) -> None:
    """Every float dtype: random -inf columns (other processors' bans), three whole rows at -inf, and the rows
    ``floor_rows`` with every column they keep (per the numpy kernel) at -inf while the others stay finite (the floor
    rule); then :func:`_compare_all_ways`."""
    kept = c.with_kernel("numpy").mask_(torch.zeros(len(state), width), state).isfinite()[floor_rows]
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        logits = torch.randn(batch, width).to(dtype)
        logits[torch.from_numpy(rng.random((batch, width)) < 0.3)] = float("-inf")
        logits[rows[torch.from_numpy(rng.choice(len(state), 3, replace=False))]] = float("-inf")
        for i, k in zip(floor_rows, kept):
            assert k.sum() >= 1
            logits[int(rows[i]), k] = float("-inf")
        _compare_all_ways(c, state, logits, rows, what=str(dtype))


def _compare_all_ways(c: TrieConstraint, state, logits: torch.Tensor, rows: torch.Tensor, filters=None,
                      what: str = "") -> None:
    """The native kernel against the numpy kernel, values included: with the row map (in place, out of place,
    ``out=``) and without it, on the mapped rows gathered in state order (in place, and out of place, where the
    kernel writes every row of a new tensor)."""
    want = c.with_kernel("numpy").mask_(logits.clone(), state, rows, filters=filters)
    assert torch.equal(c.mask_(logits.clone(), state, rows, filters=filters), want), what
    before = logits.clone()
    assert torch.equal(c.mask_(logits, state, rows, inplace=False, filters=filters), want), what
    out = torch.full_like(logits, 7.0)
    assert torch.equal(c.mask_(logits, state, rows, out=out, filters=filters), want) and torch.equal(logits, before), what
    head, want = logits[rows], want[rows]  # state row i masks row i: the same rows, the same result
    assert torch.equal(c.mask_(head.clone(), state, filters=filters), want), what
    assert torch.equal(c.mask_(head, state, inplace=False, filters=filters), want), what


@pytest.mark.parametrize("case, on_complete", [("v5000", "eos"), ("v5000", "repeat"), ("v49152", "repeat"),
                                               ("narrow", "eos")])
def test_bitmap_pass_equals_the_numpy_kernel(case, on_complete):
    """Rows keeping >= BITS_MIN_KEPT (64) columns: wide nodes (62..3000 children, the threshold's 63/64/65), dense
    rows, nodes whose children plus extras reach 64 (a terminal node of 62 or 63 children under "repeat"), per-row
    filters over wide nodes; in runs of rows in one state and single rows, through a row map into a larger batch,
    with logits wider than the vocabulary (or, ``narrow``, narrower than a 49152 vocabulary whose tries use tokens
    below 5000), in every float dtype, with rows whose kept values are all -inf (the floor rule): the native kernel's
    logits equal the numpy kernel's, values included.

    On AVX-512 machines (``_kernel.BITMAP_PASS``) this covers the bitmap pass: the trie's bitmaps (dense rows, wide
    nodes) are checked against the trie, and corrupting one bit of a wide node's and of a dense row's bitmap must
    change the native kernel's output (so the rows at those nodes did take the bitmap pass). Elsewhere the same
    comparisons run (the gap loop and the dense row's select) and kernel_bits builds nothing."""
    from trie_decode import _kernel

    vocab, limit, width, fanout = {"v5000": (5000, None, 5037, 1400), "v49152": (49152, None, 49152 + 37, 1000),
                                   "narrow": (49152, 5000, 5003, 1000)}[case]
    seed = {"v5000": 11, "v49152": 12, "narrow": 13}[case] + (100 if on_complete == "repeat" else 0)
    rng = np.random.default_rng(seed)
    trie, named = _wide_trie(seed, vocab, limit)
    sep = (3, 4) if on_complete == "repeat" else ()
    c = TrieConstraint(trie, SpanRules(end_token_id=END, on_complete=on_complete, separator=sep), "cpu",
                       dense_min_fanout=fanout, kernel="native")
    table, d = c.tables[0], c.dtries[0]
    dense_nodes = {n for n in named if trie.fanout[named[n]] >= fanout}
    assert {"f1500", "f3000"} <= dense_nodes and ("root" in dense_nodes) == (case != "v5000")
    assert c.needed_width <= width and (width < vocab) == (case == "narrow")

    # Which path each node takes: the trie's bitmaps are exactly its dense rows and its non-dense nodes of >= 64
    # children (f64, f65, f130, f700, deep; the root too where it is not dense), never f62 or f63.
    found = table.kernel_cache["native_bits"]
    if _kernel.BITMAP_PASS:
        bits, wide = found
        ref_rows, ref_wide = _bitmap_reference(table)
        assert np.array_equal(wide, ref_wide) and bits.shape == (d.num_dense + len(wide), -(-vocab // 64))
        assert np.array_equal(_unpack(bits, vocab), ref_rows)
        assert not _unpack(bits, -(-vocab // 64) * 64)[:, vocab:].any()  # the last word's padding
        wide_named = {n for n in named if named[n] in set(wide.tolist())}
        assert wide_named == {"f64", "f65", "f130", "f700", "deep"} | ({"root"} if case == "v5000" else set())
    else:
        assert found is None

    state_nodes = _run_states(c, rng, named)
    n = len(state_nodes)
    state = c.start(n)
    state.node = torch.tensor(state_nodes, dtype=torch.long)
    batch = n + 9
    rows = torch.from_numpy(rng.permutation(batch)[:n].astype(np.int64))
    # The threshold: a row keeps 63 columns at f62 (the gap loop), 64 at f63 (a bitmap per run), 65 at f64 (the
    # trie's bitmap): the children and the end token (and under "repeat" the separator, unless it is a child).
    kept = c.with_kernel("numpy").mask_(torch.zeros(n, width), state).isfinite().sum(1)
    for name in ("f62", "f63", "f64"):
        sep_extra = on_complete == "repeat" and 3 not in trie.children(named[name])[0]
        at_node = kept[torch.tensor(state_nodes) == named[name]]
        assert len(at_node) and (at_node == _FANOUTS[name] + 1 + sep_extra).all(), name
    # the floor rule: rows keeping only -inf at f65 (the trie's bitmap), at f3000 (a dense row) and inside runs;
    # and (in _check_dtypes) whole rows at -inf
    run_rows = [i for i in range(1, n - 1) if state_nodes[i - 1] == state_nodes[i] == state_nodes[i + 1]]
    floor_rows = [i for i in range(n) if state_nodes[i] == named["f65"]][:1] + \
                 [i for i in range(n) if state_nodes[i] == named["f3000"]][:1] + run_rows[:2]
    _check_dtypes(c, state, rows, batch, width, floor_rows, rng)

    # Per-row filters (single trie): a filtered row at a wide or dense node lists its kept children (a run's
    # bitmap, built from the list or from the dense row's bitmap less the excluded children).
    e = trie.num_entries
    deny = [rng.choice(e, e // 3, replace=False) for _ in range(n)]
    f = c.filters(n, deny=deny)
    logits = torch.randn(batch, width)
    logits[torch.from_numpy(rng.random((batch, width)) < 0.3)] = float("-inf")
    _compare_all_ways(c, state, logits, rows, filters=f, what="filters")

    if _kernel.BITMAP_PASS:
        # The rows at a wide node and at a dense node read the trie's bitmaps: one bit off, their logits change.
        bits, wide = found
        logits = torch.randn(batch, width)
        want = c.with_kernel("numpy").mask_(logits.clone(), state, rows)
        for node, slot in ((named["f700"], d.num_dense + int(np.searchsorted(wide, named["f700"]))),
                           (named["f1500"], int(d.dense_slots()[named["f1500"]]))):
            col = int(trie.children(node)[0][1])  # a kept column, not the anchor (the first child)
            word, bit = col >> 6, np.uint64(1) << np.uint64(col & 63)
            bits[slot, word] ^= bit
            try:
                got = c.mask_(logits.clone(), state, rows)
            finally:
                bits[slot, word] ^= bit
            at = rows[torch.tensor(state_nodes) == node]
            assert not torch.equal(got[at], want[at]) and torch.isinf(got[at, col]).all()
            assert torch.equal(c.mask_(logits.clone(), state, rows), want)


@pytest.mark.parametrize("budget", ["default", "small"])
def test_rows_of_many_wide_tries_in_one_call(budget, monkeypatch):
    """A constraint of several tries (text spans, per-prompt tries) masks its rows in one C call (_kernel.mask with each row's trie,
    each run of rows of one trie a job): tries of wide nodes with other vocabularies (5000; 49152 with tokens below
    6000, so the logits are narrower than it; a small one of 300 without a bitmap), rows of the tries interleaved,
    runs of rows in one state (also one node id in two tries, one run after the other), every float dtype, the
    floor rule, with and without a row map, in place and out of place: the logits equal the numpy kernel's, values
    included.

    ``small``: WIDE_BITS_BUDGET_BYTES holds the bitmaps of 3 wide nodes of the 5000 trie (the widest: its root, f700
    and f130) and none of the 49152 one (its rows at wide nodes build a bitmap per run; its dense rows keep theirs).
    On AVX-512 machines (``_kernel.BITMAP_PASS``) this covers the bitmap pass in mask with several tries; elsewhere the same
    comparisons run and no bitmap is built."""
    from trie_decode import _kernel

    rng = np.random.default_rng(31 + (budget == "small"))
    if budget == "small":
        monkeypatch.setattr(_native, "WIDE_BITS_BUDGET_BYTES", 3 * 8 * -(-5000 // 64))
    a, a_named = _wide_trie(41, 5000)
    b, b_named = _wide_trie(42, 49152, limit=6000)
    tries = [a, b, _random_trie(rng, 30)]
    named = [a_named, b_named, {"root": 0, "seven": tries[2].walk([7])}]
    rules = SpanRules(end_token_id=END, on_complete="repeat", separator=(3, 4))
    c = TrieConstraint(tries, rules, "cpu", dense_min_fanout=1400, kernel="native")
    width = 6021
    assert c.needed_width <= width < b.vocab_size

    found = [t.kernel_cache["native_bits"] for t in c.tables]
    if not _kernel.BITMAP_PASS:
        assert found == [None] * 3
    else:
        assert found[2] is None  # no node of 64 children, no dense row
        wide = [set(f[1].tolist()) for f in found[:2]]
        wide_named = [{n for n in nn if nn[n] in w} for nn, w in zip(named, wide)]
        everything = {"root", "f64", "f65", "f130", "f700", "deep"}
        if budget == "small":
            assert wide_named == [{"root", "f700", "f130"}, set()] and len(wide[0]) == 3 and not wide[1]
        else:
            assert wide_named == [everything, everything]
        for t in c.tables[:2]:
            ref_rows, ref_wide = _bitmap_reference(t)
            bits, w = t.kernel_cache["native_bits"]
            keep = np.concatenate([np.arange(t.dtrie.num_dense), t.dtrie.num_dense + np.searchsorted(ref_wide, w)])
            assert set(w.tolist()) <= set(ref_wide.tolist())
            assert np.array_equal(_unpack(bits, t.dtrie.vocab_size), ref_rows[keep])

    # rows: runs of every trie's named nodes and random nodes, interleaved; first the root of tries 0, 1, 0
    runs = [[(0, 0)] * 2, [(1, 0)] * 3, [(0, 0)]]
    for k in range(3):
        states = _run_states(c, rng, named[k], tree=k)
        cuts = [0] + [i for i in range(1, len(states)) if states[i] != states[i - 1]] + [len(states)]
        runs += [[(k, v) for v in states[x:y]] for x, y in zip(cuts, cuts[1:])]
    pairs = runs[0] + runs[1] + runs[2] + [p for i in rng.permutation(len(runs) - 3) for p in runs[3 + i]]
    n = len(pairs)
    tree = torch.tensor([p[0] for p in pairs])
    assert (tree[1:] != tree[:-1]).sum() >= 20  # many runs of one trie: many jobs in one call
    state = c.start(n, tree)
    state.node = torch.tensor([p[1] for p in pairs])
    batch = n + 7
    rows = torch.from_numpy(rng.permutation(batch)[:n].astype(np.int64))
    by_node = lambda k, name: [i for i, p in enumerate(pairs) if p == (k, named[k][name])]  # noqa: E731
    floor_rows = by_node(0, "f65")[:1] + by_node(1, "f700")[:1] + by_node(0, "f3000")[:1] + by_node(2, "seven")[:1]

    calls = []
    real = _kernel.mask
    monkeypatch.setattr(_kernel, "mask", lambda *a: calls.append(a[1]) or real(*a))
    _check_dtypes(c, state, rows, batch, width, floor_rows, rng)
    assert len(calls) == 4 * 5  # every native call of _compare_all_ways, every dtype: one mask call each


def test_a_batch_of_filters_reads_the_tries_flag_rows_in_place():
    """The C kernel reads each filter's flags from the trie's cache through a table of row addresses: a batch of
    filters copies no (F, N) matrix, two batches of the same filters share the rows, and flags that do not fit the
    call (another trie's, a filter without its row, a row naming a filter that is not there) are refused with a
    named error before anything is written."""
    from trie_decode.filters import NodeFlags
    from trie_decode.kernels import native

    rng = np.random.default_rng(5)
    trie = _random_trie(rng, 200)
    c = TrieConstraint(trie, SpanRules(end_token_id=END), "cpu")
    e = trie.num_entries
    denies = [rng.choice(e, 20, replace=False) for _ in range(3)]
    one = c.filters(4, deny=[denies[0], denies[1], denies[0], denies[2]]).node_flags(trie)
    two = c.filters(2, deny=[denies[2], denies[1]]).node_flags(trie)
    assert len(one.rows) == 3 and one.filter_of_row.tolist() == [0, 1, 0, 2]
    assert one.rows[1] is two.rows[1] and one.rows[2] is two.rows[0]  # the trie's rows, not copies
    assert one.addresses.tolist() == [r.ctypes.data for r in one.rows]
    table = c.tables[0]
    logits = torch.randn(4, V)
    nodes = torch.zeros(4, dtype=torch.long)
    other = TokenTrie.from_sequences([[5]], vocab_size=V)
    theirs = TrieConstraint(other, SpanRules(end_token_id=END), "cpu").filters(4, deny=[[0]] * 4).node_flags(other)
    with pytest.raises(ValueError, match="node flags of 2 nodes for a trie of"):
        native.mask_rows(logits, logits, nodes, None, table, theirs)
    unset = NodeFlags(one.rows, one.filter_of_row, torch.tensor([one.rows[0].ctypes.data, 0, 1], dtype=torch.long))
    before = logits.clone()
    with pytest.raises(ValueError, match="filter 1 has no flags"):
        native.mask_rows(logits, logits, nodes, None, table, unset)
    missing = NodeFlags(one.rows, torch.tensor([0, 1, 3, 2]))
    with pytest.raises(IndexError, match="row 2 names filter 3 of 3"):
        native.mask_rows(logits, logits, nodes, None, table, missing)
    with pytest.raises(IndexError, match="row 2 names filter 3 of 3"):
        native.child(c.dtries[0], nodes, torch.full((4,), 5, dtype=torch.long), table, missing)
    assert torch.equal(logits, before)
    with pytest.raises(ValueError, match="one contiguous"):
        NodeFlags([one.rows[0], one.rows[0][:-1]], torch.tensor([0]))
    # each row's filter as a strided view (e.g. a column): read as the kernel reads it, kept alive through the call
    strided = NodeFlags(one.rows, torch.tensor([[9, 1], [9, 2], [9, 0], [9, 1]])[:, 1], one.addresses)
    plain = NodeFlags(one.rows, torch.tensor([1, 2, 0, 1]), one.addresses)
    nodes = torch.tensor([0, 0, 0, 0])
    got = torch.randn(4, V)
    want = got.clone()
    native.mask_rows(got, got, nodes, None, table, strided)
    native.mask_rows(want, want, nodes, None, table, plain)
    assert torch.equal(got, want)
    # zero rows: zero filters are fine, and rows naming filters that are not there are refused
    assert c.filters(0, deny=[]).node_flags(trie).rows == ()
    native.mask_rows(torch.zeros(0, V), torch.zeros(0, V), torch.zeros(0, dtype=torch.long), None, table,
                     NodeFlags([], torch.zeros(0, dtype=torch.long), num_nodes=trie.num_nodes))
    with pytest.raises(ValueError, match="name filters, but the node flags hold none"):
        native.mask_rows(logits, logits, nodes, None, table,
                         NodeFlags([], torch.zeros(4, dtype=torch.long), num_nodes=trie.num_nodes))


@pytest.mark.parametrize("on_complete", ["eos", "repeat"])
@pytest.mark.parametrize("dense", [False, True])
def test_fused_step_with_filters_equals_advance_then_mask(on_complete, dense):
    """With static per-row filters the one-call step moves each row over the trie its filter leaves it and masks with
    that filter, each row taking its parent row's filter, as ``filters.select(parents)``, ``advance`` and ``mask_``
    do; and ``filters.following(step.filters)`` hands the rows' filters back to that general path at any step."""
    rng = np.random.default_rng(hash((on_complete, dense)) % 2**32)
    trie = _random_trie(rng, 300)
    rules = SpanRules(end_token_id=END, **(dict(on_complete="repeat", separator=(3,)) if on_complete == "repeat" else {}))
    c = TrieConstraint(trie, rules, "cpu", dense_min_fanout=8 if dense else None)
    rows, e = 9, trie.num_entries
    specs = [rng.choice(e, e // 2, replace=False) for _ in range(2)] + [
        rng.choice(e, e // 6, replace=False) for _ in range(2)]  # two allow sets, two deny sets
    allow = [None, specs[0], None, specs[0], specs[1], None, specs[1], None, None]
    deny = [specs[2], None, specs[3], specs[2], None, None, specs[2], specs[3], specs[2]]
    filters = c.filters(rows, allow=allow, deny=deny)
    ref_filters = filters
    ref, state = c.start(rows), c.start(rows)
    step = c.fused_step(state, filters)
    assert step is not None and step.filters is not None and len(set(step.filters.tolist())) > 2
    if on_complete == "repeat":  # a distinct list changes every step: the general path's
        assert c.fused_step(c.start(rows), c.filters(rows, deny=deny, distinct=True, max_entries=3)) is None
    ids = torch.from_numpy(rng.integers(0, V, (rows, 2)))
    for t in range(14):
        logits = torch.randn(rows, V + 2)
        parents = None
        if t:
            if t % 3:
                parents = torch.from_numpy(rng.integers(0, rows, rows))
                ref = ref.select(parents)
                ref_filters = ref_filters.select(parents)
            ref = c.advance(ref, ids[:, -1], filters=ref_filters)
        expected = c.mask_(logits.clone(), ref, filters=ref_filters)
        got = step(ids if t else None, logits.clone(), None, parents)
        assert torch.equal(state.node, ref.node), t
        assert torch.equal(got, expected), t
        handed = filters.following(step.filters)  # the general path from here: the same filters, row by row
        assert torch.equal(c.mask_(logits.clone(), ref, filters=handed), expected), t
        allowed = [torch.isfinite(expected[i]).nonzero().flatten().tolist() for i in range(rows)]
        nxt = [int(rng.choice(a)) if a and rng.random() < 0.85 else int(rng.integers(0, V)) for a in allowed]
        ids = torch.cat([ids, torch.tensor(nxt).unsqueeze(1)], 1)
