"""The shared per-row state machine and masking kernel against a brute-force reference, in every mode."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trie_decode import ConstraintConfigError, InvalidTokenError, TokenTrie
from trie_decode.constraint import DONE, SpanRules, TrieConstraint
from trie_decode.bitmask import apply_token_bitmask_inplace

from reference import SPAN_RULE_CASES, SpanReference

V = 24
END = 1


entry_sets = st.lists(st.lists(st.integers(2, V - 1), min_size=1, max_size=5), min_size=1, max_size=12)
modes = st.sampled_from(SPAN_RULE_CASES)


def _allowed_sets(c: TrieConstraint, state, width: int) -> list[set[int] | None]:
    out = []
    mask = c.allowed(state, width)
    for row in mask:
        cols = set(row.nonzero().flatten().tolist())
        out.append(None if len(cols) == width else cols)
    return out


@settings(max_examples=120, deadline=None)
@given(
    tries=st.lists(entry_sets, min_size=1, max_size=3), mode=modes, seed=st.integers(0, 2**16), dense=st.booleans(),
    backend=st.sampled_from(["kernel", "numpy", "torch"]),
)
def test_state_machine_matches_reference(tries, mode, seed, dense, backend):
    """backend: the C kernel (the CPU default), numpy index arithmetic (CPU without the kernel), or torch index
    arithmetic (the CUDA/MPS path). ``allowed()`` always goes through the plans, so the kernel is also checked
    against them."""
    rng = random.Random(seed)
    built = [TokenTrie.from_sequences(t, vocab_size=V) for t in tries]
    rules = SpanRules(end_token_id=END, **mode)
    kernel = {"kernel": "native", "numpy": "numpy", "torch": "torch"}[backend]
    c = TrieConstraint(built, rules, "cpu", dense_min_fanout=2 if dense else None, kernel=kernel)
    assert c.kernel.name == kernel
    rows = 6
    tree = torch.tensor([rng.randrange(len(built)) for _ in range(rows)])
    tails = torch.tensor([[rng.randrange(2, V) for _ in range(3)] for _ in range(rows)])
    if rules.trigger:
        tails[0, -len(rules.trigger):] = torch.tensor(rules.trigger)
    refs = [SpanReference({tuple(s) for s in tries[t]}, rules, tuple(tails[i].tolist())) for i, t in enumerate(tree.tolist())]
    state = c.start(rows, tree, tails)
    history = tails.clone()
    width = V + 5  # logits wider than the trie's vocabulary
    for _ in range(14):
        expected = [r.allowed() for r in refs]
        assert _allowed_sets(c, state, width) == expected
        logits = torch.randn(rows, width)
        before = logits.clone()
        c.mask_(logits, state)
        for i, allowed in enumerate(expected):
            if allowed is None:
                assert torch.equal(logits[i], before[i])
            else:
                finite = set(logits[i].isfinite().nonzero().flatten().tolist())
                assert finite == allowed
                assert torch.equal(logits[i, sorted(allowed)], before[i, sorted(allowed)])
        # Choose allowed tokens mostly, junk (as beam search may) sometimes; also trigger tokens in free text.
        toks = []
        for r, allowed in zip(refs, expected):
            pool = sorted(allowed) if allowed is not None else list(range(2, V))
            if allowed is None and rules.trigger and rng.random() < 0.5:
                pool = [t for form in rules.triggers for t in form]
            tok = rng.choice(pool) if rng.random() < 0.9 else rng.randrange(V)
            toks.append(tok)
            r.step(tok)
        history = torch.cat([history, torch.tensor(toks)[:, None]], dim=1)
        state = c.advance(state, torch.tensor(toks), history)
    # The host-side replay of the finished rows runs the same transitions: it finds the reference's entries.
    generated = history[:, tails.shape[1]:].tolist()
    cut = [g[: rng.randrange(len(g) + 1)] for g in generated]  # rows that stopped early, too
    for rows_tokens in (generated, cut):
        got = c.replay(rows_tokens, tree.tolist(), tails.tolist())
        for i, toks in enumerate(rows_tokens):
            ref = SpanReference({tuple(s) for s in tries[tree[i]]}, rules, tuple(tails[i].tolist()))
            for tok in toks:
                ref.step(tok)
            assert [e.tokens for e in got[i]] == ref.finish(), (i, toks)


def test_bitmask_round_trip_matches_mask():
    trie = TokenTrie.from_sequences([[5, 6], [5, 7], [40, 41], [70]], vocab_size=80)
    c = TrieConstraint(trie, SpanRules(end_token_id=END), "cpu")
    state = c.start(3)
    state = c.advance(state, torch.tensor([5, 40, 70]))
    bitmask = c.bitmask(state, 80)
    assert bitmask.shape == (3, 3) and bitmask.dtype == torch.int32
    logits = torch.zeros(3, 80)
    apply_token_bitmask_inplace(logits, bitmask)
    direct = c.mask_(torch.zeros(3, 80), state)
    assert torch.equal(logits.isfinite(), direct.isfinite())
    assert logits[0].isfinite().nonzero().flatten().tolist() == [6, 7]
    assert logits[2].isfinite().nonzero().flatten().tolist() == [END]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_mask_dtypes_and_strided_rows(dtype):
    trie = TokenTrie.from_sequences([[2, 3], [2, 4], [9]], vocab_size=11)
    c = TrieConstraint(trie, SpanRules(end_token_id=0), "cpu")
    big = torch.randn(4, 16).to(dtype)
    logits = big[::2]  # non-contiguous rows
    c.mask_(logits, c.start(2))
    assert logits.isfinite().nonzero().tolist() == [[0, 2], [0, 9], [1, 2], [1, 9]]
    assert torch.isinf(big[::2][:, [0, 1, 3, 10, 15]]).all()
    assert big[1].isfinite().all()  # rows in between are untouched


def test_done_rows_and_end_token_fallback():
    trie = TokenTrie.from_sequences([[2]], vocab_size=5)
    c = TrieConstraint(trie, SpanRules(end_token_id=4), "cpu")
    state = c.advance(c.start(2), torch.tensor([2, 3]))  # row 1 took a junk token
    assert state.node.tolist()[1] == DONE
    logits = c.mask_(torch.zeros(2, 5), state)
    assert logits.isfinite().nonzero().tolist() == [[0, 4], [1, 4]]


def test_logits_narrower_than_vocab_is_an_error():
    trie = TokenTrie.from_sequences([[2, 90]], vocab_size=100)
    c = TrieConstraint(trie, SpanRules(end_token_id=0), "cpu")
    with pytest.raises(InvalidTokenError, match="logits have 50 columns"):
        c.mask_(torch.zeros(1, 50), c.start(1))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(end_token_id=-1), "end_token_id"),
        (dict(end_token_id=1, on_complete="stop"), "on_complete must be one of"),
        (dict(end_token_id=1, on_complete="repeat"), "needs a separator"),
        (dict(end_token_id=1, separator=(3,)), "only used with"),
        (dict(end_token_id=1, trigger=("a",)), "integer token ids"),
    ],
)
def test_bad_rules(kwargs, message):
    with pytest.raises(ConstraintConfigError, match=message):
        SpanRules(**kwargs)


def test_rules_outside_vocab():
    trie = TokenTrie.from_sequences([[2]], vocab_size=5)
    with pytest.raises(InvalidTokenError, match="end_token_id token 7"):
        TrieConstraint(trie, SpanRules(end_token_id=7), "cpu")


def test_forced_tokens():
    trie = TokenTrie.from_sequences([[2, 3, 4], [2, 3, 5, 6], [8, 9]], vocab_size=10)
    c = TrieConstraint(trie, SpanRules(end_token_id=1), "cpu")
    state = c.start(2)
    state = c.advance(state, torch.tensor([2, 8]))
    assert c.forced_tokens(state) == [[3], [9, 1]]


def test_out_of_place_mask_leaves_input_unchanged():
    trie = TokenTrie.from_sequences([[2, 3], [4]], vocab_size=6)
    c = TrieConstraint(trie, SpanRules(end_token_id=0, on_complete="release"), "cpu")
    logits = torch.randn(2, 6)
    before = logits.clone()
    state = c.advance(c.start(2), torch.tensor([2, 4]))  # row 1 completed its entry: released
    masked = c.mask_(logits, state, inplace=False)
    assert torch.equal(logits, before)
    assert masked[0].isfinite().nonzero().flatten().tolist() == [3]
    assert torch.equal(masked[1], before[1])
    assert torch.equal(c.mask_(logits.clone(), state), masked)


def test_bad_row_tries_are_named():
    c = TrieConstraint([TokenTrie.from_sequences([[3]], vocab_size=V)] * 2, SpanRules(end_token_id=END), "cpu")
    bad = [torch.tensor([0, 1, 1]), torch.tensor([[0, 1]]), torch.tensor([0.0, 1.0]), torch.tensor([True, False])]
    for tree in bad:
        with pytest.raises(ConstraintConfigError, match=r"one integer trie index per row: \(2,\)"):
            c.start(2, tree)
    with pytest.raises(ConstraintConfigError, match="one integer trie index per row"):
        c.replay([[3, END]], [0, 1])
    with pytest.raises(ConstraintConfigError, match="prompt_tails must give one prompt per row: 2 for 1 rows"):
        c.replay([[3, END]], None, [[5], [6]])


def test_row_tries_that_are_no_tensor_are_named():
    """start(2, tree=[0, 1]) and a numpy tree raised AttributeError ('list' object has no attribute 'shape')."""
    c = TrieConstraint([TokenTrie.from_sequences([[3]], vocab_size=V)] * 2, SpanRules(end_token_id=END), "cpu")
    for tree, got in (([0, 1], "list"), (np.array([0, 1]), "ndarray"), ((0, 1), "tuple")):
        with pytest.raises(ConstraintConfigError, match=rf"one integer trie index per row: \(2,\), got {got}$"):
            c.start(2, tree)
    assert c.start(2, torch.tensor([1, 0], dtype=torch.int32)).tree.tolist() == [1, 0]


@pytest.mark.parametrize("kernel", ["native", "numpy", "torch"])
def test_filters_for_other_rows_are_named(kernel):
    """Per-row filters made for 3 rows, used with 2 (the core API called directly): a named error in mask_ and
    advance on every kernel, never an error inside torch or a mask read past the filters' rows."""
    trie = TokenTrie.from_sequences([[3], [4], [5, 6]], vocab_size=V)
    c = TrieConstraint(trie, SpanRules(end_token_id=END), "cpu", kernel=kernel)
    filters = c.filters(3, deny=[[0], [1], [2]])
    state = c.start(2)
    with pytest.raises(ConstraintConfigError, match="sets for 3 rows, the state has 2 rows"):
        c.mask_(torch.zeros(2, V), state, filters=filters)
    with pytest.raises(ConstraintConfigError, match="sets for 3 rows, the state has 2 rows"):
        c.advance(state, torch.tensor([3, 4]), filters=filters)
    with pytest.raises(ConstraintConfigError, match="sets for 3 rows, the state has 2 rows"):
        c.mask_(torch.zeros(2, V), state, filters=c.filters(3, deny=[0]))  # one set for 3 rows: still for 3 rows
    c.mask_(torch.zeros(2, V), state, filters=c.filters(2, deny=[0]))


def test_replay_of_text_spans_reads_each_value_in_its_own_spans_trie():
    """A row moves from span to span: each value it completed is read in the trie of the span it was in (not in the
    row's first trie), and a span's ``after`` that ends in the prompt opens that span."""
    from trie_decode.fields import FieldRules

    vocab = [b"<eos>", b'{"', b"city", b'":', b' "', b"Par", b"is", b"ian", b'",', b'"}', b'"', b"Rome", b"country",
             b"Fr", b"ance"]
    cities = TokenTrie.from_sequences([[5, 6], [11]], vocab_size=len(vocab), names=["Paris", "Rome"])
    countries = TokenTrie.from_sequences([[13, 14]], vocab_size=len(vocab), names=["France"])
    fields = FieldRules.from_tokens([cities, countries], ['"city": "', '"country": "'], '"', vocab)
    c = TrieConstraint([cities, countries], SpanRules(end_token_id=0, on_complete="release", fields=fields), "cpu")
    rest = [11, 8, 4, 12, 3, 4, 13, 14, 9, 0]  # Rome", "country": "France"}
    names = lambda found: [[e.name for e in row] for row in found]  # noqa: E731
    assert names(c.replay([[1, 2, 3, 4] + rest])) == [["Rome", "France"]]
    with pytest.raises(ConstraintConfigError, match="closed by the end token: give end_token_id"):
        FieldRules.from_tokens([cities], ['"city": "'], None, vocab)  # end=None: the end token closes the span
    assert FieldRules.from_tokens([cities], ['"city": "'], None, vocab, end_token_id=0).ends[0].ids.tolist() == [0]
    assert names(c.replay([rest, [4] + rest], None, [[1, 2, 3, 4], [1, 2, 3]])) == [["Rome", "France"]] * 2


# ------------------------------------------------------------------ inputs every kernel takes, checked once

KERNELS = ["native", "numpy", "torch"]


def _small(kernel: str, **rules) -> TrieConstraint:
    trie = TokenTrie.from_sequences([[3, 4], [3, 5], [6]], vocab_size=10)
    return TrieConstraint(trie, SpanRules(0, **rules), "cpu", kernel=kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_logits_rows_no_state_covers_are_left_as_they_are(kernel):
    """Logits with more rows than the state, no row map: the rows past the state's are no state's (the numpy
    kernel set them all to -inf, in place and through out=)."""
    c = _small(kernel)
    logits = torch.ones(3, 10)
    c.mask_(logits, c.start(2))
    assert logits[2].tolist() == [1.0] * 10
    assert logits[:2].isfinite().nonzero()[:, 1].tolist() == [3, 6, 3, 6]
    out = torch.full((2, 10), 7.0)
    c.mask_(torch.ones(2, 10), c.start(1), out=out)
    assert out[1].tolist() == [1.0] * 10 and out[0].isfinite().nonzero().flatten().tolist() == [3, 6]
    assert c.mask_(torch.ones(3, 10), c.start(2), inplace=False)[2].tolist() == [1.0] * 10


@pytest.mark.parametrize("kernel", KERNELS)
def test_logits_that_no_kernel_takes_are_named(kernel):
    """(B, 1, V) logits were masked wrongly without error (native, numpy) and 1-D ones raised IndexError; a leaf
    requiring grad was masked in place by the C kernel and raised autograd's error on the others."""
    c = _small(kernel)
    for logits in (torch.zeros(2, 1, 10), torch.zeros(10), torch.zeros(1, 2, 1, 10)):
        with pytest.raises(ConstraintConfigError, match=r"logits must be Shape \(B, V\).*got " + re.escape(
                str(tuple(logits.shape)))):
            c.mask_(logits, c.start(2))
    with pytest.raises(ConstraintConfigError, match="floating-point.*torch.int64"):
        c.mask_(torch.zeros(2, 10, dtype=torch.long), c.start(2))
    with pytest.raises(TypeError, match="logits must be a torch.Tensor"):
        c.mask_(np.zeros((2, 10), dtype=np.float32), c.start(2))
    leaf = torch.zeros(2, 10, requires_grad=True)
    for kwargs in ({}, {"inplace": False}):
        with pytest.raises(ConstraintConfigError, match=r"logits require grad.*logits.detach\(\).*torch.no_grad\(\)"):
            c.mask_(leaf, c.start(2), **kwargs)
    assert leaf.eq(0).all()
    assert c.mask_(leaf.detach(), c.start(2)).isfinite().sum() == 4
    with torch.no_grad():
        assert c.mask_(leaf, c.start(2)).isfinite().sum() == 4


@pytest.mark.parametrize("kernel", KERNELS)
def test_float8_logits_are_named(kernel):
    """float8 logits are floating point, so they passed the dtype check and failed inside torch (NotImplementedError,
    "take_cpu" or "scatter_gather_tensor_cpu" not implemented); float8_e4m3fn cannot even hold -inf. Every dtype the
    kernels do mask still masks alike."""
    c = _small(kernel)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        logits = torch.zeros(2, 10).to(dtype)
        for kwargs in ({}, {"inplace": False}):
            with pytest.raises(ConstraintConfigError, match=r"float16, bfloat16, float32 or float64.*got "
                                                            + re.escape(str(dtype))):
                c.mask_(logits, c.start(2), **kwargs)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        assert c.mask_(torch.zeros(2, 10, dtype=dtype), c.start(2)).isfinite().nonzero()[:, 1].tolist() == [3, 6, 3, 6]


@pytest.mark.parametrize("kernel", ["native", "numpy"])
def test_a_logits_row_given_to_two_state_rows_is_named(kernel):
    """Two state rows on one logits row: the numpy kernel kept the union of their allowed sets, the C kernel their
    intersection in place and what the last one allowed out of place. The CPU kernels read their row map anyway: a
    repeated row is named there, by the C kernel itself (the torch kernel reads nothing on the host, see check_rows)."""
    c = _small(kernel)
    state = c.advance(c.start(2), torch.tensor([3, 6]))  # two rows that allow different tokens
    with pytest.raises(ValueError, match=r"rows gives logits row 1 to state rows \[0, 1\]"):
        c.mask_(torch.zeros(3, 10), state, rows=torch.tensor([1, 1]))
    out = c.mask_(torch.zeros(3, 10), state, rows=torch.tensor([2, 0]))
    assert [out[r].isfinite().nonzero().flatten().tolist() for r in (2, 0)] == c.allowed_tokens(state)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_row_count_that_is_no_count_is_named(kernel):
    """start(-1) and start(True) failed inside torch.zeros (a RuntimeError, a TypeError naming zeros' ``size``).
    Numpy ints and a 0-d integer tensor are counts."""
    c = _small(kernel)
    for bad in (-1, True, 1.5, "2", None):
        with pytest.raises(ConstraintConfigError, match=f"num_rows must be an int >= 0, got {re.escape(repr(bad))}"):
            c.start(bad)
    assert c.start(np.int64(2)).node.tolist() == c.start(torch.tensor(2)).node.tolist() == [0, 0]


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_dense_fanout_that_is_no_count_is_named(kernel):
    """dense_min_fanout="2" failed inside numpy's comparison (UFuncTypeError); 1.5, True and 0 were taken as they
    were (0: a dense row for every leaf)."""
    trie = TokenTrie.from_sequences([[3, 4], [3, 5], [6]], vocab_size=10)
    for bad in ("2", 1.5, True, 0, -1):
        with pytest.raises(ConstraintConfigError, match=rf"dense_min_fanout must be .*an int >= 1.*got {re.escape(repr(bad))}"):
            TrieConstraint(trie, SpanRules(0), "cpu", kernel=kernel, dense_min_fanout=bad)
    dense = TrieConstraint(trie, SpanRules(0), "cpu", kernel=kernel, dense_min_fanout=np.int32(2))
    assert dense.dtries[0].num_dense == 2 and dense.allowed_tokens(dense.start(1)) == [[3, 6]]


@pytest.mark.parametrize("kernel", KERNELS)
def test_an_allowed_width_that_is_no_count_is_named(kernel):
    """allowed(state, 10.5) and bitmask(state, 10.5) failed inside torch.ones (a TypeError naming its ``size``),
    allowed_tokens(state, 10.5) on a list index, a width "12" on a comparison; width 0 stood for the vocabulary's."""
    c = _small(kernel)
    for bad in (10.5, -3, "12"):
        with pytest.raises(ConstraintConfigError, match=f"width must be an int >= 0, got {re.escape(repr(bad))}"):
            c.allowed(c.start(1), bad)
        with pytest.raises(ConstraintConfigError, match="width must be an int >= 0"):
            c.allowed_tokens(c.start(1), bad)
        with pytest.raises(ConstraintConfigError, match="width must be an int >= 0"):
            c.bitmask(c.start(1), bad)
    with pytest.raises(InvalidTokenError, match="logits have 0 columns"):
        c.allowed(c.start(1), 0)
    assert c.allowed_tokens(c.start(1), np.int64(12)) == [[3, 6]] and c.bitmask(c.start(1), 33).shape == (1, 2)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_row_map_that_does_not_fit_is_named(kernel):
    """rows= out of range or of the wrong length: the C kernel named it, numpy and torch failed inside torch (and
    numpy would have read a negative row from the end)."""
    c = _small(kernel)
    for rows, bad in (([5, 0], 5), ([0, -1], -1), ([0, 3], 3)):
        with pytest.raises(IndexError, match=f"logits row {bad} is outside the batch of 3 rows"):
            c.mask_(torch.zeros(3, 10), c.start(2), rows=torch.tensor(rows))
    for rows in (torch.tensor([1]), torch.tensor([[0], [1]]), torch.tensor([0.0, 1.0]), torch.tensor([True, False])):
        with pytest.raises(ConstraintConfigError, match=r"rows must hold one integer logits row per state row: \(2,\)"):
            c.mask_(torch.zeros(3, 10), c.start(2), rows=rows)
    out = c.mask_(torch.ones(3, 10), c.start(2), rows=torch.tensor([2, 0], dtype=torch.int32))
    assert out[1].tolist() == [1.0] * 10 and out[2].isfinite().nonzero().flatten().tolist() == [3, 6]


@pytest.mark.parametrize("kernel", KERNELS)
def test_tokens_of_another_shape_than_the_state_are_named(kernel):
    """tokens (1,) for 2 rows gave both rows the token, (2, 1) a 2-D state (numpy, torch); only the C kernel refused."""
    c = _small(kernel)
    for tokens in (torch.tensor([3]), torch.tensor([[3], [6]]), torch.tensor([3.0, 6.0]), torch.tensor(3)):
        with pytest.raises(ConstraintConfigError, match=r"one integer token per state row: \(2,\) for the state's 2 rows"):
            c.advance(c.start(2), tokens)
    assert c.advance(c.start(2), torch.tensor([3, 6], dtype=torch.int32)).node.tolist() == [1, 2]


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_trigger_needs_tails(kernel):
    """Without tails= the trigger silently never fired; tails of another row count are named. Tails narrower than
    the trigger are a history that short (it cannot end with the trigger yet)."""
    c = _small(kernel, on_complete="release", trigger=(7, 8))
    state = c.start(1)
    with pytest.raises(ConstraintConfigError, match=r"advance needs tails= with a trigger.*\(1, >= 2\)"):
        c.advance(state, torch.tensor([7]))
    for tails in (torch.tensor([7, 8]), torch.tensor([[7, 8], [7, 8]])):
        with pytest.raises(ConstraintConfigError, match=r"tails must hold each row's last tokens"):
            c.advance(state, torch.tensor([8]), tails=tails)
    with pytest.raises(ConstraintConfigError, match="tails must hold"):
        c.start(1, tails=torch.tensor([8]))
    assert c.start(1, tails=torch.tensor([[8]])).node.tolist() == [-2]
    state = c.advance(state, torch.tensor([7]), tails=torch.tensor([[7]]))  # a history shorter than the trigger
    state = c.advance(state, torch.tensor([8]), tails=torch.tensor([[7, 8]]))
    assert c.allowed_tokens(state) == [[3, 6]]
    assert c.start(1).node.tolist() == [-2]  # start without tails: no prompt ends with the trigger


def test_an_entry_holding_a_stop_token_is_refused():
    """The entry [7158, 2, 7158] with stop token 2: generation stopped inside it (the output was no entry), whatever
    on_complete is. A separator inside an entry is fine (it is no stop token); an entry ending with it is fine."""
    from trie_decode.constraint import check_stop_tokens_outside_entries as check

    trie = TokenTrie.from_sequences([[5], [7158, 2, 7158]], vocab_size=8000, names=["a", "x"])
    with pytest.raises(ConstraintConfigError, match=r"entry 1 \('x'\), tokens \[7158, 2, 7158\], contains token 2, "
                                                      r"at which generation stops: a row would stop inside this "
                                                      r"entry.*; build the trie without such entries$"):
        check(trie, [2])  # the stop tokens are not the caller's to pick (vLLM: the model's EOS)
    with pytest.raises(ConstraintConfigError, match=r"; stop at a token no entry contains \(end_token_id=\), or build"):
        check(trie, [3, 2], change="end_token_id=")
    check(trie, [3])
    check(trie, [])
    check(TokenTrie.from_sequences([[5, 2], [2], [6]], vocab_size=10), [2])  # entries that end with it
    keyed = TokenTrie.from_sequences([[4, 1, 6, 7], [4, 5]], vocab_size=10, keys=["k1", "k2"])
    with pytest.raises(ConstraintConfigError, match=r"entry 0 \('k1'\), tokens \[4, 1, 6, 7\], contains token 1"):
        check(keyed, [9, 1])


@pytest.mark.parametrize("kernel", ["native", "numpy", "torch"])
def test_a_hand_built_state_outside_the_tries_is_named(kernel):
    """A RowState no start()/advance() made, with a node past the trie or a trie index past the tries, gets a named
    error from every call that indexes with it (the kernels read it on an error path), not torch's IndexError."""
    from trie_decode import RowState

    c = TrieConstraint(TokenTrie.from_sequences([[5, 6, 7], [5, 8]], vocab_size=20), SpanRules(end_token_id=1), "cpu",
                       kernel=kernel)
    for node, tree, what in [([100, 0], [0, 0], "state.node holds node 100"), ([0, 0], [3, 0], "state.tree holds")]:
        state = RowState(torch.tensor(node), torch.tensor(tree))
        calls = [lambda: c.mask_(torch.zeros(2, 20), state), lambda: c.allowed(state),
                 lambda: c.advance(state, torch.tensor([5, 5]))]
        named = 0
        for call in calls:
            try:
                call()  # the C kernel reads an unknown node as DONE and one trie's tree index is never read
            except ConstraintConfigError as exc:
                assert what in str(exc)
                named += 1
        assert named >= (1 if kernel == "torch" or node[0] == 100 else 0)  # allowed() indexes on every kernel


def test_stop_at_forced_arguments_of_another_shape_are_named():
    c = TrieConstraint(TokenTrie.from_sequences([[5, 6, 7], [5, 8]], vocab_size=20), SpanRules(end_token_id=1), "cpu")
    with pytest.raises(ConstraintConfigError, match="one value per state row"):
        c.stop_at_forced(c.start(3), torch.tensor([2]), torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ConstraintConfigError, match="one value per state row"):
        c.stop_at_forced(c.start(3), torch.full((3,), 2), False)
