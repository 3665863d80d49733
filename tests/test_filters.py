"""Per-row allow and deny filters and distinct lists over one shared trie, against the brute-force reference.

A filtered row must behave exactly like a row on a trie of its usable entries (allowed, not denied); a distinct
list must never repeat an entry and must end when every entry is used or its capacity is reached. The filtered
torch step reads no device value (the device step's guard) and compiles with ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from trie_decode import ConstraintConfigError, TokenTrie
from trie_decode.catalogs import catalog_from_codes
from trie_decode.constraint import RowState, SpanRules, TrieConstraint
from trie_decode.filters import distinct_capacity

from reference import SpanReference
from test_device_step import no_host_sync

V = 30
END, SEP = 1, 2


def _allowed(c, state, filters, width):
    out = c.mask_(torch.zeros(len(state), width), state, filters=filters)
    return [set(row.isfinite().nonzero().flatten().tolist()) for row in out]


@pytest.mark.parametrize("kernel", ["native", "numpy", "torch"])
@pytest.mark.parametrize("seed", range(6))
def test_filtered_rows_behave_like_a_trie_of_their_usable_entries(kernel, seed):
    rng = random.Random(seed)
    seqs = [tuple(rng.randrange(3, V) for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(5, 60))]
    seqs += [(7,), (7, 8), (7, 8, 9)]
    trie = TokenTrie.from_sequences([list(s) for s in seqs], vocab_size=V)
    entries = trie.sequences()
    rules = SpanRules(end_token_id=END)
    c = TrieConstraint(trie, rules, "cpu", dense_min_fanout=4 if seed % 2 else None, kernel=kernel)
    rows = 6
    allow = [None if i % 3 == 0 else rng.sample(range(len(entries)), rng.randrange(1, len(entries) + 1)) for i in range(rows)]
    deny = [rng.sample(range(len(entries)), rng.randrange(0, len(entries) // 2 + 1)) for i in range(rows)]
    usable = [set(range(len(entries)) if a is None else a) - set(d) for a, d in zip(allow, deny)]
    keep = [i for i in range(rows) if usable[i]]
    allow, deny, usable = [allow[i] for i in keep], [deny[i] for i in keep], [usable[i] for i in keep]
    filters = c.filters(len(keep), allow=allow, deny=deny)
    refs = [SpanReference({entries[e] for e in u}, rules) for u in usable]
    state = c.start(len(keep))
    for _ in range(6):
        expected = [r.allowed() for r in refs]
        assert _allowed(c, state, filters, V + 2) == expected
        toks = [rng.choice(sorted(a)) for a in expected]
        for r, t in zip(refs, toks):
            r.step(t)
        state = c.advance(state, torch.tensor(toks), filters=filters)


@pytest.mark.parametrize("seed", range(4))
def test_filter_bits_are_one_rule_however_they_are_counted(seed):
    """The filter rule lives in one place (filters.usable_count + filters.filter_bits): the static per-node table the
    C kernel reads, the per-row counts of the torch pass and of the state update, and the brute-force meaning of
    the bits (CHILD_EXCLUDED: no usable entry below; END_EXCLUDED: the entry ending here is not usable) agree at
    every node, for allow and deny filters."""
    from trie_decode.filters import CHILD_EXCLUDED, END_EXCLUDED, usable_count

    rng = random.Random(seed)
    seqs = [[rng.randrange(3, V) for _ in range(rng.randrange(1, 5))] for _ in range(rng.randrange(5, 60))]
    seqs += [[7], [7, 8], [7, 8, 9]]
    trie = TokenTrie.from_sequences(seqs, vocab_size=V)
    c = TrieConstraint(trie, SpanRules(end_token_id=END), "cpu")
    e, n = trie.num_entries, trie.num_nodes
    allow = [None, None] + [rng.sample(range(e), rng.randrange(1, e + 1)) for _ in range(2)]
    deny = [[], rng.sample(range(e), rng.randrange(0, e))] + [rng.sample(range(e), rng.randrange(0, e // 2 + 1))
                                                              for _ in range(2)]
    allow = [a if a is None or set(a) - set(d) else None for a, d in zip(allow, deny)]
    f = c.filters(len(allow), allow=allow, deny=deny)
    flags = f.node_flags(trie)
    table = torch.from_numpy(np.stack(flags.rows))[flags.filter_of_row].long()  # (R, N): each row's static bits
    counted = f.bits(torch.arange(n).repeat(len(allow), 1)).long()  # (R, N): the same rule, counted per row
    assert torch.equal(table, counted)
    from trie_decode import _kernel  # the C kernel reads the same bits

    assert (_kernel.CHILD_EXCLUDED, _kernel.END_EXCLUDED) == (CHILD_EXCLUDED, END_EXCLUDED)
    # The bits' meaning, brute force: the entries below each node, and the entry ending at it.
    seq_of = {i: tuple(s) for i, s in enumerate(trie.sequences())}
    for r, (a, d) in enumerate(zip(allow, deny)):
        usable = (set(range(e)) if a is None else set(a)) - set(d)
        for node in range(n):
            path = tuple(trie.tokens_of(node))
            below = [i for i, sq in seq_of.items() if sq[: len(path)] == path]
            own = trie.node_entry[node]
            want = (CHILD_EXCLUDED if not set(below) & usable else 0) | (
                END_EXCLUDED if own >= 0 and own not in usable else 0)
            assert int(table[r, node]) == want, (r, node)
    # numpy and torch evaluate the one count alike.
    ranks = np.sort(np.array(rng.sample(range(e), rng.randrange(0, e)), dtype=np.int64))
    bounds = np.sort(np.array([rng.randrange(0, e + 1) for _ in range(9)], dtype=np.int64))
    for allow_set in (None, ranks):
        want = usable_count(torch.from_numpy(bounds), None if allow_set is None else torch.from_numpy(allow_set),
                            torch.from_numpy(ranks))
        assert usable_count(bounds, allow_set, ranks).tolist() == want.tolist()


def test_allow_100_of_a_1m_catalog_equals_a_trie_of_those_100():
    """A 1M-item semantic-id catalog (4 levels x 256 codes) filtered to 100 entries masks exactly like a trie built
    from those 100, at every step of walks that follow them to the end token."""
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, size=(1_000_000, 4))
    codes[:, 0] = (rng.zipf(1.2, size=len(codes)) - 1) % 256  # a skewed first level, as real semantic ids
    vocab = 3 + 4 * 256
    big = catalog_from_codes(codes, codebook_size=256, token_offset=3, vocab_size=vocab)
    assert big.num_entries > 900_000
    pick = rng.choice(big.num_entries, 100, replace=False)
    small = TokenTrie.from_sequences([list(big.entry(int(i)).tokens) for i in pick], vocab_size=vocab)
    rules = SpanRules(end_token_id=END)
    cb, cs = TrieConstraint(big, rules, "cpu"), TrieConstraint(small, rules, "cpu")
    rows = 16
    f = cb.filters(rows, allow=pick)
    sb, ss = cb.start(rows), cs.start(rows)
    walk = np.random.default_rng(1)
    for _ in range(6):  # 4 levels, the end token, then the end token only
        lb = cb.mask_(torch.randn(rows, vocab), sb, filters=f)
        ls = cs.mask_(torch.zeros(rows, vocab), ss)
        assert torch.equal(lb.isfinite(), ls.isfinite())
        toks = torch.tensor([walk.choice(row.isfinite().nonzero().flatten().numpy()) for row in ls])
        sb, ss = cb.advance(sb, toks, filters=f), cs.advance(ss, toks)
    assert (sb.node == -1).all()  # every row ended


LIST = [[5], [6, 7], [6, 8], [9, 10, 11], [9, 10], [12]]
SEP2 = (SEP, 3)  # a two-token separator: its second token is forced


def _walk_lists(c, f, rows, seed, steps=80):
    """Random walks that never choose the end token while anything else is allowed: the lists each row emits, and
    whether each list ended right after an entry (not after a separator)."""
    rng = random.Random(seed)
    state = c.start(rows)
    lists, current = [[] for _ in range(rows)], [[] for _ in range(rows)]
    ended, clean = [False] * rows, [True] * rows
    last = [None] * rows
    for _ in range(steps):
        allowed = _allowed(c, state, f, 20)
        toks = []
        for i, a in enumerate(allowed):
            others = sorted(a - {END})
            tok = rng.choice(others) if others and not ended[i] else END
            if tok == END and not ended[i]:
                ended[i] = True
                clean[i] = last[i] not in SEP2
                if current[i]:
                    lists[i].append(tuple(current[i]))
            elif tok == SEP:
                lists[i].append(tuple(current[i]))
                current[i] = []
            elif tok not in SEP2 and not ended[i]:
                current[i].append(tok)
            last[i] = tok
            toks.append(tok)
        state = c.advance(state, torch.tensor(toks), filters=f)
        if all(ended):
            break
    assert all(ended), "a row never ended"
    return lists, clean


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("max_entries", [1, 2, 4, 6])
def test_distinct_list_past_its_capacity_ends_and_never_repeats(kernel, max_entries):
    """More usable entries than ``max_entries``: each row's list holds exactly ``min(max_entries, usable)`` distinct
    entries (no slot is overwritten, so nothing repeats; the list is not cut short either), its last entry ends with
    the end token (the separator is blocked at the last slot), and ``full`` says which lists reached capacity.
    The rows' deny sets differ in size: the capacity is per row, not shared."""
    trie = TokenTrie.from_sequences(LIST, vocab_size=20)
    entries = trie.sequences()
    c = TrieConstraint(trie, SpanRules(end_token_id=END, on_complete="repeat", separator=SEP2), "cpu", kernel=kernel)
    deny = [None, [0], [1, 2, 3], [0, 1, 2, 3, 4]]
    usable = [set(entries) - {entries[d] for d in (ds or [])} for ds in deny]
    for seed in range(6):
        f = c.filters(len(deny), deny=deny, distinct=True, max_entries=max_entries)
        lists, clean = _walk_lists(c, f, len(deny), seed)
        for i, got in enumerate(lists):
            assert len(got) == len(set(got)), (i, got)
            assert set(got) <= usable[i], (i, got)
            assert len(got) == min(max_entries, len(usable[i])), (i, got, max_entries)
            assert clean[i], (i, got)
        assert f.full.tolist() == [len(got) == max_entries for got in lists]


def test_distinct_capacity_admits_every_list_that_fits_the_budget():
    """With ``max_entries=distinct_capacity(trie, budget, len(separator))`` every distinct list whose tokens (entries,
    separators, end token) fit the budget is accepted token by token: no list is cut short for want of room."""
    trie = TokenTrie.from_sequences([[5], [6], [7], [8, 9], [10], [11, 12]], vocab_size=20)
    entries = trie.sequences()
    budget = 9
    cap = distinct_capacity(trie, budget, len(SEP2))
    assert cap == 3  # 5 2 3 6 2 3 7 END: 8 tokens; a fourth entry would need 11
    c = TrieConstraint(trie, SpanRules(end_token_id=END, on_complete="repeat", separator=SEP2), "cpu")
    rng = random.Random(0)
    longest = 0
    for _ in range(60):
        chosen = rng.sample(entries, rng.randint(1, 4))
        tokens = [t for i, e in enumerate(chosen) for t in (list(SEP2) if i else []) + list(e)] + [END]
        if len(tokens) > budget:
            continue
        longest = max(longest, len(chosen))
        f = c.filters(1, distinct=True, max_entries=cap)
        state = c.start(1)
        for tok in tokens:
            assert tok in _allowed(c, state, f, 20)[0], (chosen, tok)
            state = c.advance(state, torch.tensor([tok]), filters=f)
    assert longest == cap
    with pytest.raises(ConstraintConfigError, match="max_new_tokens"):
        distinct_capacity(trie, 0, 1)


#: Keys that several entries of LIST share: a distinct list then denies every entry of a key it emits.
SHARED_KEYS = ["a", "b", "a", "c", "b", "a"]


def _filtered_constraint(keys=None):
    trie = TokenTrie.from_sequences(LIST, vocab_size=20, keys=keys)
    c = TrieConstraint(trie, SpanRules(end_token_id=END, on_complete="repeat", separator=SEP2), "cpu", kernel="torch")
    allow = [None, [0, 1, 2, 5], None, [3, 4, 5]]
    deny = [[1], None, [4, 5], [3]]
    # Setup may read the device (the step may not): the lazy device tables are built by a first step.
    warm = c.filters(len(allow), allow=allow, deny=deny, distinct=True)
    c.advance(c.start(len(allow)), torch.tensor([5, 5, 5, 9]), filters=warm)
    c.mask_(torch.randn(len(allow), 20), c.start(len(allow)), filters=warm)
    return c, allow, deny


@pytest.mark.parametrize("keys", [None, SHARED_KEYS])
def test_filtered_torch_step_never_reads_the_device(keys):
    """Allow, deny and distinct filters on mixed rows, beam reordering included: mask, advance and select run under
    the device step's guard (any host read of a tensor raises), with entries that share keys too."""
    c, allow, deny = _filtered_constraint(keys)
    rows = len(allow)
    f = c.filters(rows, allow=allow, deny=deny, distinct=True, max_entries=2)
    state = c.start(rows)
    perm = torch.tensor([1, 0, 3, 2])
    gen = torch.Generator().manual_seed(0)
    with no_host_sync():
        for step in range(12):
            scores = torch.randn(rows, 20, generator=gen)
            scores[:, END] = -50.0  # rows go on with their lists while they may: the lists fill up
            logits = c.mask_(scores, state, filters=f)
            state = c.advance(state, logits.argmax(1), filters=f)
            if step % 3 == 2:
                f, state = f.select(perm), state.select(perm)
    assert f.full.any()  # the walk went past the lists' capacity under the guard


@pytest.mark.slow
@pytest.mark.parametrize("keys", [None, SHARED_KEYS])
def test_filtered_step_compiles_fullgraph_and_matches_eager(keys):
    """``torch.compile(fullgraph=True)`` of advance + filtered mask (distinct lists, allow and deny rows, entries that
    share keys): no graph break, and the compiled masks, states and deny sets equal the eager step's, past the lists'
    capacity."""
    torch._dynamo.reset()
    c, allow, deny = _filtered_constraint(keys)
    rows = len(allow)
    eager_f = c.filters(rows, allow=allow, deny=deny, distinct=True, max_entries=2)
    comp_f = c.filters(rows, allow=allow, deny=deny, distinct=True, max_entries=2)

    def step(node, tree, tokens, logits, f):
        new = c.advance(RowState(node, tree), tokens, filters=f)
        return new.node, c.mask_(logits, new, inplace=False, filters=f)

    start = c.start(rows)
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    node_e = node_c = start.node
    first = c.mask_(torch.randn(rows, 20), start, filters=eager_f, inplace=False)
    tokens = first.argmax(1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(14):
        logits = torch.randn(rows, 20, generator=gen)
        logits[:, END] = -50.0  # the end token only when nothing else is allowed: the lists fill up
        node_e, masked_e = step(node_e, start.tree, tokens, logits, eager_f)
        node_c, masked_c = compiled(node_c, start.tree, tokens, logits, comp_f)
        assert torch.equal(node_e, node_c)
        assert torch.equal(masked_e, masked_c)
        assert torch.equal(eager_f.deny, comp_f.deny) and torch.equal(eager_f.deny_count, comp_f.deny_count)
        tokens = masked_e.argmax(1)
    assert eager_f.full.all()


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_distinct_lists_never_repeat_and_end_when_everything_is_used(kernel):
    trie = TokenTrie.from_sequences([[5], [6, 7], [6, 8], [9, 10, 11]], vocab_size=20, keys=list("abcd"))
    rules = SpanRules(end_token_id=END, on_complete="repeat", separator=(SEP,))
    c = TrieConstraint(trie, rules, "cpu", kernel=kernel)
    rng = random.Random(0)
    for trial in range(20):
        f = c.filters(1, deny=["b"] if trial % 2 else None, distinct=True, max_entries=8)
        state = c.start(1)
        emitted, current = [], []
        for _ in range(40):
            allowed = _allowed(c, state, f, 20)[0]
            if allowed == {END}:
                break
            tok = rng.choice(sorted(allowed))
            if tok == END:
                break
            if tok == SEP:
                emitted.append(tuple(current))
                current = []
            else:
                current.append(tok)
            state = c.advance(state, torch.tensor([tok]), filters=f)
        if current:
            emitted.append(tuple(current))
        assert len(emitted) == len(set(emitted)), emitted
        assert ((6, 7) not in emitted) or trial % 2 == 0


def test_bad_filters_are_named():
    trie = TokenTrie.from_sequences([[5], [6]], vocab_size=10, keys=["x", "y"])
    c = TrieConstraint(trie, SpanRules(end_token_id=END), "cpu")
    with pytest.raises(ConstraintConfigError, match="not entries of the trie"):
        c.filters(1, allow=["nope"])
    with pytest.raises(ConstraintConfigError, match="outside the trie's 2 entries"):
        c.filters(1, deny=[5])
    with pytest.raises(ConstraintConfigError, match=r"^allow leaves no entry \(after deny\): nothing"):
        c.filters(1, allow=["x"], deny=["x"])
    with pytest.raises(ConstraintConfigError, match="distinct=True needs"):
        c.filters(1, distinct=True)
    with pytest.raises(ConstraintConfigError, match="release"):
        TrieConstraint(trie, SpanRules(END, on_complete="release"), "cpu").filters(1)


def test_a_key_filters_every_entry_that_carries_it():
    """The forms of one string share its key: deny by key blocks every form (else the other form slips through),
    allow by key admits every form."""
    trie = TokenTrie.from_sequences([[5], [6, 7], [8], [9]], vocab_size=12, keys=["paris", "rome", "paris", "oslo"])
    c = TrieConstraint(trie, SpanRules(end_token_id=END), "cpu")

    def first_tokens(**spec):
        out = c.mask_(torch.zeros(1, 12), c.start(1), filters=c.filters(1, **spec))
        return out.isfinite().nonzero()[:, 1].tolist()

    assert first_tokens(deny=["paris"]) == [6, 9]
    assert first_tokens(allow=["paris"]) == [5, 8]
    assert first_tokens(allow=["paris", "oslo"], deny=["oslo"]) == [5, 8]


ENTRIES = [[100, 200, 300], [100, 200, 301], [100, 250], [400], [400, 401, 402], [500, 501]]
KEYS = ["a", "b", "c", "d", "e", "f"]


def _members(rows, allowed_keys):
    from trie_decode.integrations.transformers import match

    trie = TokenTrie.from_sequences(ENTRIES, vocab_size=49152, keys=KEYS)
    found = match(trie, rows, end_token_id=END)
    return [None if e is None else e.key for e in found]


@pytest.mark.parametrize("beams", [1, 4])
def test_processor_filters_per_prompt_in_generate(tiny_llama, beams):
    from trie_decode.integrations.transformers import TrieLogitsProcessor

    trie = TokenTrie.from_sequences(ENTRIES, vocab_size=tiny_llama.config.vocab_size, keys=KEYS)
    allow = [["a", "d", "f"], None]
    deny = [["d"], ["a", "b", "c", "e"]]
    proc = TrieLogitsProcessor(trie, end_token_id=END, allow=allow, deny=deny)
    inputs = {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 10]]), "attention_mask": torch.ones(2, 3, dtype=torch.long)}
    out = tiny_llama.generate(**inputs, logits_processor=[proc], max_new_tokens=5, pad_token_id=END, eos_token_id=END,
                              num_beams=beams, num_return_sequences=beams, do_sample=False)
    keys = [e.key for e in proc.match(out)]
    assert all(k in {"a", "f"} for k in keys[:beams]), keys
    assert all(k in {"d", "f"} for k in keys[beams:]), keys


@pytest.mark.parametrize("beams", [1, 4])
def test_filtered_generate_steps_in_one_call_as_the_general_path_does(tiny_llama, beams, monkeypatch):
    """Static per-prompt filters no longer keep generate off the one-call step: the processor takes it, and its
    tokens and scores equal the general path's (advance with the filters, then mask with them)."""
    from trie_decode.integrations.transformers import TrieLogitsProcessor

    trie = TokenTrie.from_sequences(ENTRIES, vocab_size=tiny_llama.config.vocab_size, keys=KEYS)
    spec = dict(allow=[["a", "b", "d", "f"], None], deny=[["d"], ["a", "c", "e"]])
    inputs = {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 10]]), "attention_mask": torch.ones(2, 3, dtype=torch.long)}
    kwargs = dict(max_new_tokens=5, pad_token_id=END, eos_token_id=END, num_beams=beams, num_return_sequences=beams,
                  do_sample=False, output_scores=True, return_dict_in_generate=True)
    proc = TrieLogitsProcessor(trie, end_token_id=END, **spec)
    fast = tiny_llama.generate(**inputs, logits_processor=[proc], **kwargs)
    assert proc._fused is not None and proc._fused.filters is not None
    monkeypatch.setattr(TrieConstraint, "fused_step", lambda self, state, filters=None: None)
    general = TrieLogitsProcessor(trie, end_token_id=END, **spec)
    slow = tiny_llama.generate(**inputs, logits_processor=[general], **kwargs)
    assert general._fused is None
    assert torch.equal(fast.sequences, slow.sequences)
    assert all(torch.equal(a, b) for a, b in zip(fast.scores, slow.scores))
    keys = [e.key for e in proc.match(fast.sequences)]
    assert all(k in {"a", "b", "f"} for k in keys[:beams]) and all(k in {"b", "d", "f"} for k in keys[beams:]), keys


def test_node_flags_are_built_once_per_filter_and_stay_right(monkeypatch):
    """A trie keeps the node flags of the filters it saw last, keyed by their content: a filter seen before is not
    counted again (in another RowFilters, another row order), a different filter is, and whatever the cache holds
    or evicts, the flags equal a fresh count."""
    from trie_decode import filters as F

    rng = random.Random(3)
    seqs = [[rng.randrange(3, V) for _ in range(rng.randrange(1, 5))] for _ in range(80)]
    trie = TokenTrie.from_sequences(seqs, vocab_size=V)
    c = TrieConstraint(trie, SpanRules(end_token_id=END), "cpu")
    e = trie.num_entries
    specs = [dict(deny=rng.sample(range(e), 10)), dict(allow=rng.sample(range(e), 12)),
             dict(allow=rng.sample(range(e), 12), deny=rng.sample(range(e), 6))]
    built = []
    real = F._node_flags
    monkeypatch.setattr(F, "_node_flags", lambda *a: built.append(1) or real(*a))

    def table(spec_rows):
        f = c.filters(len(spec_rows), allow=[s.get("allow") for s in spec_rows],
                      deny=[s.get("deny") for s in spec_rows])
        flags = f.node_flags(trie)
        return torch.from_numpy(np.stack(flags.rows))[flags.filter_of_row]

    def fresh(spec):
        f = c.filters(1, **{k: [v] for k, v in spec.items()})
        allow_r, deny_r = f._host_sets
        return torch.from_numpy(real(f.order, trie, allow_r[0], deny_r[0]))

    first = table(specs)
    assert len(built) == 3
    again = table(specs[::-1])  # the same filters in another order, in a new RowFilters: nothing counted
    assert len(built) == 3 and torch.equal(again, first.flip(0))
    for i, spec in enumerate(specs):
        assert torch.equal(first[i], fresh(spec))
    monkeypatch.setattr(F, "NODE_FLAG_CACHE_BYTES", trie.num_nodes)  # room for one filter: evictions
    for spec in specs * 2:
        assert torch.equal(table([spec])[0], fresh(spec))


def test_a_batch_rebuilt_with_known_filters_finds_them_by_identity(monkeypatch):
    """A batch whose filtered rows change (a vLLM request replaced) rebuilds its filters: the filters of arrays made
    here (read only) are found by identity, with no hash of their ranks and no count; only a new filter is counted.
    Found or counted, each row's flags are a fresh count of its own filter (rows that share a deny array but not
    an allow set get their own flags), and the flags of a user's array (which its owner may change) are found by
    content, every time."""
    from trie_decode import filters as F
    from trie_decode.filters import entry_indices

    rng = random.Random(11)
    trie = TokenTrie.from_sequences([[rng.randrange(3, V) for _ in range(rng.randrange(1, 4))] for _ in range(80)],
                                    vocab_size=V)
    c = TrieConstraint(trie, SpanRules(end_token_id=END), "cpu")
    e = trie.num_entries
    denies = [entry_indices(trie, rng.sample(range(e), 8), "deny") for _ in range(5)]
    allows = [entry_indices(trie, rng.sample(range(e), 20), "allow") for _ in range(2)]
    built, hashed = [], []
    real = F._node_flags
    monkeypatch.setattr(F, "_node_flags", lambda *a: built.append(1) or real(*a))

    def table(allow, deny):
        f = c.filters(len(deny), allow=allow, deny=deny)
        flags = f.node_flags(trie)
        got = torch.from_numpy(np.stack(flags.rows))[flags.filter_of_row]
        allow_r, deny_r = f._host_sets
        for i in range(len(deny)):  # each row's flags: a fresh count of its own filter
            assert torch.equal(got[i], torch.from_numpy(real(f.order, trie, allow_r[i], deny_r[i])))
        return flags

    first = table([None, allows[0], allows[1], None], denies[:4])
    assert len(built) == 4
    monkeypatch.setattr(F, "hash", lambda x: hashed.append(1) or hash(x), raising=False)
    again = table([allows[1], None, None, allows[0]], [denies[2], denies[0], denies[3], denies[1]])
    assert len(built) == 4 and not hashed  # every row found by identity
    assert {id(r) for r in again.rows} == {id(r) for r in first.rows}
    table([None, allows[0], allows[1], None], [denies[0], denies[4], denies[2], denies[3]])  # one request replaced
    assert len(built) == 5 and len(hashed) == 2  # the new filter's own sets (allow, deny) only
    table([allows[0], allows[1]], [denies[0], denies[0]])  # one deny array, two allow sets: two filters
    assert len(built) == 7
    theirs = np.array(rng.sample(range(e), 8), dtype=np.int64)
    theirs.setflags(write=False)
    hashed.clear()
    table([None], [theirs])
    table([None], [theirs])
    assert len(built) == 8 and len(hashed) == 2  # counted once, then found by content


def test_filters_for_node_flags_build_their_padded_sets_only_when_read():
    """Static filters for the C kernel (which masks and moves with node flags) build their padded rank sets when
    first read, not at setup: a vLLM batch change builds only what is new. Built late, they are the sets built at
    once (and so are their rows after a select), and the torch pass masks with them as with those."""
    from trie_decode.filters import EntryOrder, RowFilters, apply_filters_, entry_indices

    rng = random.Random(4)
    trie = TokenTrie.from_sequences([[rng.randrange(3, V) for _ in range(rng.randrange(1, 4))] for _ in range(60)],
                                    vocab_size=V)
    rules = SpanRules(end_token_id=END)
    c = TrieConstraint(trie, rules, "cpu", kernel="native")
    e = trie.num_entries
    allow = [None, rng.sample(range(e), 30), None, rng.sample(range(e), 5)]
    deny = [rng.sample(range(e), 10), rng.sample(range(e), 4), None, []]
    late = c.filters(4, allow=allow, deny=deny)
    state = c.start(4)
    masked = c.mask_(torch.zeros(4, V), state, filters=late)
    c.advance(state, masked.argmax(1), filters=late)
    assert late._allow is None and late._deny is None  # the kernel read the node flags only
    spec = lambda s: None if s is None else entry_indices(trie, s, "filter")  # noqa: E731
    now = RowFilters(EntryOrder.of(trie), [spec(a) for a in allow], [spec(d) for d in deny], "cpu")
    assert now._allow is not None
    names = ["allow", "deny", "has_allow", "deny_count", "deny_limit"]
    index = torch.tensor([3, 0, 0, 2, 1])
    picked = late.select(index)
    for name in names:
        assert torch.equal(getattr(late, name), getattr(now, name)), name
        assert torch.equal(getattr(picked, name), getattr(now.select(index), name)), name
    d = c.dtries[0]
    for node in (state.node, torch.tensor([0, 1, 2, 3])):
        assert torch.equal(apply_filters_(torch.zeros(4, V), node, late, d, rules),
                           apply_filters_(torch.zeros(4, V), node, now, d, rules))
    bigger = entry_indices(trie, [e - 1], "deny")  # made here for this trie: checked once, and again for a smaller
    smaller = TokenTrie.from_sequences([[5], [6]], vocab_size=V)
    assert entry_indices(trie, bigger, "deny") is bigger
    with pytest.raises(ConstraintConfigError, match="outside the trie's 2 entries"):
        entry_indices(smaller, bigger, "deny")


def test_one_processor_reused_over_generations_filters_as_a_fresh_one(tiny_llama):
    """A processor keeps its static filters built between generations (per batch size): reused over generations of
    other widths, in any order, it gives what a fresh processor gives; a distinct list starts empty every time."""
    from trie_decode.integrations.transformers import TrieLogitsProcessor

    trie = TokenTrie.from_sequences(ENTRIES, vocab_size=tiny_llama.config.vocab_size, keys=KEYS)
    spec = dict(allow=[["a", "d", "f"], None], deny=[["d"], ["a", "b", "c", "e"]])
    reused = TrieLogitsProcessor(trie, end_token_id=END, **spec)
    inputs = {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 10]]), "attention_mask": torch.ones(2, 3, dtype=torch.long)}
    for beams in (4, 1, 2, 4, 1):
        kwargs = dict(max_new_tokens=5, pad_token_id=END, eos_token_id=END, num_beams=beams,
                      num_return_sequences=beams, do_sample=False)
        fresh = tiny_llama.generate(**inputs, logits_processor=[TrieLogitsProcessor(trie, end_token_id=END, **spec)],
                                    **kwargs)
        assert torch.equal(tiny_llama.generate(**inputs, logits_processor=[reused], **kwargs), fresh), beams
    distinct = TrieLogitsProcessor(trie, end_token_id=END, on_complete="repeat", separator=[SEP], distinct=True,
                                   max_entries=len(KEYS))
    one = {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    for _ in range(3):
        out = tiny_llama.generate(**one, logits_processor=[distinct], max_new_tokens=30, pad_token_id=END,
                                  eos_token_id=END, do_sample=False)
        keys = [e.key for e in distinct.match_all(out)[0]]
        assert keys and len(keys) == len(set(keys)), keys


def test_wide_beams_all_members_and_fewer_entries_than_beams(tiny_llama):
    """256 beams over 6 entries: every returned beam is a member (no dead end), duplicates of an entry included."""
    from trie_decode.integrations.transformers import TrieLogitsProcessor

    trie = TokenTrie.from_sequences(ENTRIES, vocab_size=tiny_llama.config.vocab_size, keys=KEYS)
    proc = TrieLogitsProcessor(trie, end_token_id=END)
    inputs = {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    out = tiny_llama.generate(**inputs, logits_processor=[proc], max_new_tokens=5, pad_token_id=END, eos_token_id=END,
                              num_beams=256, num_return_sequences=16, do_sample=False, length_penalty=0.0)
    found = proc.match(out)
    assert all(e is not None for e in found)
    assert {e.key for e in found} == set(KEYS)


def test_distinct_list_in_generate(tiny_llama):
    from trie_decode.integrations.transformers import TrieLogitsProcessor

    trie = TokenTrie.from_sequences(ENTRIES, vocab_size=tiny_llama.config.vocab_size, keys=KEYS)
    proc = TrieLogitsProcessor(trie, end_token_id=END, on_complete="repeat", separator=[SEP], distinct=True)
    inputs = {"input_ids": torch.tensor([[5, 6, 7]] * 3), "attention_mask": torch.ones(3, 3, dtype=torch.long)}
    torch.manual_seed(0)
    out = tiny_llama.generate(**inputs, logits_processor=[proc], max_new_tokens=30, pad_token_id=END, eos_token_id=END,
                              do_sample=True)
    for row in proc.match_all(out):
        keys = [e.key for e in row]
        assert len(keys) == len(set(keys)) and keys, keys


def test_rank_distinct_renormalized_and_filtered(tiny_llama):
    """rank() gives distinct entries; renormalized log-probs over every entry of a small trie sum to 1; length
    normalization divides by the tokens; filters restrict the ranking."""
    from trie_decode.integrations.transformers import rank

    trie = TokenTrie.from_sequences(ENTRIES, vocab_size=tiny_llama.config.vocab_size, keys=KEYS)
    inputs = {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    raw = rank(tiny_llama, inputs, trie, 6, end_token_id=END, num_beams=12)[0]
    assert sorted(r.entry.key for r in raw) == sorted(KEYS) and raw.duplicates == 0  # unfinished beams are not results
    norm = rank(tiny_llama, inputs, trie, 6, end_token_id=END, num_beams=12, renormalize=True)[0]
    assert abs(sum(np.exp(r.log_prob) for r in norm) - 1.0) < 1e-3
    assert {r.entry.key for r in norm} == set(KEYS)
    by_key = {r.entry.key: r.log_prob for r in raw}
    mean = rank(tiny_llama, inputs, trie, 6, end_token_id=END, num_beams=12, length_normalize=True)[0]
    for r in mean:
        assert abs(r.log_prob - by_key[r.entry.key] / (len(r.entry.tokens) + 1)) < 1e-3
    only = rank(tiny_llama, inputs, trie, 3, end_token_id=END, allow=["a", "c", "f"])[0]
    assert {r.entry.key for r in only} == {"a", "c", "f"}


def test_rank_merges_two_tokenizations_of_one_entry_and_counts_them(tiny_llama, tokenizer):
    """Each name stored in two forms (with and without a leading space): 6 beams end on 6 trie entries, which are 3
    entries for the user. ``rank`` returns each once, with the better form's log-probability (checked against a
    forward pass), and counts the 3 merged beams in ``duplicates``."""
    from trie_decode.integrations.transformers import rank

    names = ["Paris", "Rome", "Berlin"]
    trie = TokenTrie.from_strings(names, tokenizer, leading_space=[True, False], keys=["p", "r", "b"])
    assert trie.num_entries == 6  # the two forms differ in tokens
    prompt = [5, 6, 7]
    inputs = {"input_ids": torch.tensor([prompt]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    ranked = rank(tiny_llama, inputs, trie, 3, end_token_id=END, num_beams=6)[0]
    assert sorted(r.entry.key for r in ranked) == ["b", "p", "r"]
    assert ranked.duplicates == 3
    with torch.no_grad():
        for r in ranked:
            scores = []
            for e in range(trie.num_entries):
                if trie.entry(e).key != r.entry.key:
                    continue
                ids = prompt + list(trie.entry(e).tokens) + [END]
                logp = torch.log_softmax(tiny_llama(torch.tensor([ids])).logits[0].float(), -1)
                scores.append(sum(logp[i - 1, ids[i]].item() for i in range(len(prompt), len(ids))))
            assert len(scores) == 2 and abs(r.log_prob - max(scores)) < 1e-3, (r, scores)
    assert [r.log_prob for r in ranked] == sorted((r.log_prob for r in ranked), reverse=True)


def test_processor_distinct_lists_hold_max_entries(tiny_llama):
    """TrieLogitsProcessor(max_entries=k): each row's distinct list holds at most k entries, then ends."""
    from trie_decode.integrations.transformers import TrieLogitsProcessor

    trie = TokenTrie.from_sequences(ENTRIES, vocab_size=tiny_llama.config.vocab_size, keys=KEYS)
    proc = TrieLogitsProcessor(trie, end_token_id=END, on_complete="repeat", separator=[SEP], distinct=True, max_entries=2)
    inputs = {"input_ids": torch.tensor([[5, 6, 7]] * 4), "attention_mask": torch.ones(4, 3, dtype=torch.long)}
    torch.manual_seed(1)
    out = tiny_llama.generate(**inputs, logits_processor=[proc], max_new_tokens=30, pad_token_id=END, eos_token_id=END,
                              do_sample=True)
    lists = [[e.key for e in row] for row in proc.match_all(out)]
    assert all(1 <= len(keys) <= 2 and len(set(keys)) == len(keys) for keys in lists), lists
    with pytest.raises(ConstraintConfigError, match="max_entries must be a positive integer"):
        TrieLogitsProcessor(trie, end_token_id=END, on_complete="repeat", separator=[SEP], distinct=True, max_entries=0)


def test_a_frozen_filter_is_ranked_once_and_a_users_array_every_time():
    """Indices made from a list or keys are read only, so their sorted ranks are kept while the array lives (a vLLM
    request's filter is not sorted again at every batch change); a caller's own array may change between calls and
    is ranked again every time: a filter always masks with what it holds now."""
    import gc

    from trie_decode.filters import EntryOrder, entry_indices

    trie = TokenTrie.from_sequences([[3 + i] for i in range(10)], vocab_size=V)  # entry i is token 3 + i
    c = TrieConstraint(trie, SpanRules(end_token_id=END), "cpu")
    order = EntryOrder.of(trie)
    mine = entry_indices(trie, [5, 1, 5, 3], "deny")
    assert not mine.flags.writeable
    first = order.sorted_ranks(mine)
    assert first.tolist() == sorted({int(order.rank[i]) for i in (1, 3, 5)})
    assert order.sorted_ranks(mine) is first and order._ranks_of.get(mine) is first
    assert entry_indices(trie, mine, "deny") is mine  # passed on as it is (vLLM's rows hold such arrays)
    assert c.filters(2, deny=[mine, mine]).node_flags(trie).rows[0] is c.filters(1, deny=[mine]).node_flags(trie).rows[0]
    theirs = np.array([0, 2], dtype=np.int64)

    def blocked() -> list[int]:
        logits = c.mask_(torch.zeros(1, V), c.start(1), filters=c.filters(1, deny=[theirs]))
        return [t for t in range(3, 13) if logits[0, t] == float("-inf")]

    theirs.setflags(write=False)  # read only for now, but its owner may change it again
    assert blocked() == [3, 5]
    theirs.setflags(write=True)
    theirs[:] = [4, 6]  # changed in place between two filters: the second masks with what it holds now
    theirs.setflags(write=False)
    assert blocked() == [7, 9]
    assert order._ranks_of.get(theirs) is None
    key = id(mine)
    del mine
    gc.collect()
    assert (key,) not in order._ranks_of._found  # gone with its array


def test_flags_a_batch_holds_are_found_beyond_the_cache_budget(monkeypatch):
    """A batch whose filters' flags together exceed the cache's budget (64 vLLM requests with their own filters on a
    big catalog) finds them all again at its next change while it holds them: only a new filter is counted. Flags
    nothing holds any more are forgotten."""
    import gc

    from trie_decode import filters as F

    rng = random.Random(5)
    trie = TokenTrie.from_sequences([[rng.randrange(3, V) for _ in range(3)] for _ in range(60)], vocab_size=V)
    c = TrieConstraint(trie, SpanRules(end_token_id=END), "cpu")
    e = trie.num_entries
    denies = [rng.sample(range(e), 5) for _ in range(4)]
    built = []
    real = F._node_flags
    monkeypatch.setattr(F, "_node_flags", lambda *a: built.append(1) or real(*a))
    monkeypatch.setattr(F, "NODE_FLAG_CACHE_BYTES", trie.num_nodes)  # room for one filter's flags
    batch = c.filters(3, deny=denies[:3])
    assert len(built) == 3
    changed = c.filters(3, deny=[denies[0], denies[1], denies[3]])  # one request replaced: one new count
    assert len(built) == 4
    held = batch.node_flags(trie).rows + changed.node_flags(trie).rows
    assert all(a is b for a, b in zip(changed.node_flags(trie).rows[:2], batch.node_flags(trie).rows[:2]))
    cache = trie.derived("NodeFlagCache", F._NodeFlagCache)
    assert len(cache._known) == 4
    del batch, changed, held
    gc.collect()
    assert len(cache._known) == 1  # what the budget keeps; the rest went with their last holder


def test_a_spec_that_is_no_list_of_keys_or_indices_is_named():
    """A single string is refused (its characters are no keys: "ab" denied "a" and "b"), as is a numpy array of
    bools or floats (a mask [True, False, True] denied entries 1 and 0); a numpy array of keys works as their list."""
    from trie_decode.filters import EntryOrder, RowFilters

    trie = TokenTrie.from_sequences([[5], [6], [7]], vocab_size=10, keys=["a", "b", "ab"])
    c = TrieConstraint(trie, SpanRules(end_token_id=END), "cpu")
    for spec in ["ab", b"ab"]:
        with pytest.raises(ConstraintConfigError, match="got the string"):
            c.filters(1, deny=spec)
    for spec in [np.array([True, False, True]), np.array([1.0, 2.0])]:
        with pytest.raises(ConstraintConfigError, match="entry keys .str. or entry indices .int."):
            c.filters(1, allow=spec)
    by_array = c.filters(1, deny=np.array(["a", "ab"]))
    by_list = c.filters(1, deny=["a", "ab"])
    assert _allowed(c, c.start(1), by_array, V) == _allowed(c, c.start(1), by_list, V) == [{6}]
    with pytest.raises(ConstraintConfigError, match="2 allow sets, 1 deny sets"):
        RowFilters(EntryOrder.of(trie), [None, None], [None], "cpu")


def test_masking_with_filters_keeps_no_rules_alive():
    """The end columns the filters' pass caches are keyed by their token ids: the rules (and a text span's automata
    they may hold) go with their constraint."""
    import gc
    import weakref

    def run():
        trie = TokenTrie.from_sequences([[5, 6], [7]], vocab_size=V, keys=["a", "b"])
        rules = SpanRules(end_token_id=END, on_complete="repeat", separator=(SEP,))
        c = TrieConstraint(trie, rules, "cpu", kernel="torch")
        assert _allowed(c, c.start(1), c.filters(1, deny=["a"]), V) == [{7}]
        return weakref.ref(rules)

    rules = run()
    gc.collect()
    assert rules() is None


def test_a_spec_may_mix_keys_and_indices_as_a_live_catalog_takes_it():
    """["a", 2] raised "must hold entry keys (str) or entry indices (int), got 'a'" although 'a' is a key, while a
    live catalog's view took the same spec: one rule (filters.spec_items) for both."""
    from trie_decode.live import LiveCatalog

    trie = TokenTrie.from_sequences([[3, 4], [3, 5], [6]], vocab_size=V, keys=["a", "b", "c"])
    c = TrieConstraint(trie, SpanRules(end_token_id=END), "cpu")
    mixed = c.filters(1, allow=["a", 2])
    assert _allowed(c, c.start(1), mixed, V) == _allowed(c, c.start(1), c.filters(1, allow=[0, 2]), V) == [{3, 6}]
    assert _allowed(c, c.start(1), c.filters(1, deny=np.array(["b", 2], dtype=object)), V) == [{3}]
    view = LiveCatalog(trie).snapshot().view(SpanRules(end_token_id=END))
    assert view.entry_indices(["a", 2], "allow").tolist() == [0, 2]
    for spec in (["a", 1.5], [2, None], ["a", True]):
        with pytest.raises(ConstraintConfigError, match="entry keys .str. or entry indices .int., got"):
            c.filters(1, allow=spec)
        with pytest.raises(ConstraintConfigError, match="entry keys .str. or entry numbers .int., got"):
            view.entry_indices(spec, "allow")


# ------------------------------------------------------------------------------- entries that share a key, distinct
def _keyed_trie(seed):
    """A random trie whose entries share keys in groups of 1 to 3 (the forms of one string share its key)."""
    rng = random.Random(seed)
    seqs = sorted({tuple(rng.randrange(4, V) for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(8, 30))})
    keys, k = [], 0
    while len(keys) < len(seqs):
        keys += [f"k{k}"] * rng.choice([1, 1, 2, 3])
        k += 1
    keys = keys[: len(seqs)]
    rng.shuffle(keys)
    trie = TokenTrie.from_sequences([list(s) for s in seqs], vocab_size=V, keys=keys)
    entries = trie.sequences()
    same = {entries[i]: {entries[j] for j in range(len(entries)) if keys[j] == keys[i]} for i in range(len(entries))}
    return trie, entries, keys, same, rng


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("seed", range(6))
def test_a_distinct_list_counts_the_entries_of_a_key_as_one_item(kernel, seed):
    """A key stands for every entry that carries it (filters, rank): once a distinct list holds one of them, none
    of the others may follow (``from_strings(..., leading_space=[True, False])`` wrote 'Paris, Paris', keys
    ['fr', 'fr']), and the separator is blocked where no other item is left. Masks against the reference, with
    per-row deny sets that name some forms of a key only."""
    trie, entries, keys, same, rng = _keyed_trie(seed)
    rules = SpanRules(end_token_id=END, on_complete="repeat", separator=(SEP,))
    c = TrieConstraint(trie, rules, "cpu", kernel=kernel)
    rows = 4
    deny = [None] + [rng.sample(range(len(entries)), rng.randrange(0, len(entries) // 2)) for _ in range(rows - 1)]
    f = c.filters(rows, deny=deny, distinct=True, max_entries=len(entries))
    refs = [SpanReference(set(entries) - {entries[d] for d in (ds or [])}, rules, distinct=True, same_item=same)
            for ds in deny]
    state = c.start(rows)
    for _ in range(40):
        expected = [r.allowed() for r in refs]
        assert _allowed(c, state, f, V) == expected
        toks = [rng.choice(sorted(a - {END})) if a - {END} and rng.random() < 0.9 else END for a in expected]
        for r, t in zip(refs, toks):
            r.step(t)
        state = c.advance(state, torch.tensor(toks), filters=f)
    for r in refs:
        listed = [keys[entries.index(e)] for e in r.completed]
        assert len(listed) == len(set(listed)), listed


@pytest.mark.parametrize("max_entries", [1, 2, 3])
def test_a_distinct_list_of_keys_shared_by_several_entries_keeps_its_capacity(max_entries):
    """Each item of a list denies all its entries: the deny set has room for the list's largest items, so a list
    holds exactly ``min(max_entries, items)`` items, none twice, and ends with an entry and the end token."""
    trie = TokenTrie.from_sequences(LIST, vocab_size=20, keys=["a", "b", "a", "c", "b", "a"])  # a: 3 entries, b: 2
    entries = trie.sequences()
    key_of = dict(zip(entries, ["a", "b", "a", "c", "b", "a"]))
    c = TrieConstraint(trie, SpanRules(end_token_id=END, on_complete="repeat", separator=SEP2), "cpu")
    deny = [None, [0], ["c"]]
    items = [3, 3, 2]
    for seed in range(8):
        f = c.filters(len(deny), deny=deny, distinct=True, max_entries=max_entries)
        lists, clean = _walk_lists(c, f, len(deny), seed)
        for i, got in enumerate(lists):
            listed = [key_of[e] for e in got]
            assert len(listed) == len(set(listed)) == min(max_entries, items[i]), (i, listed, max_entries)
            assert clean[i], (i, got)


def test_a_distinct_list_does_not_repeat_a_string_stored_in_both_forms(tokenizer):
    """The reviewer's case: after 'Paris,' the form ' Paris' was still allowed."""
    trie = TokenTrie.from_strings(["Paris", "Berlin", "Rome"], tokenizer, leading_space=[True, False],
                                  keys=["fr", "de", "it"])
    sep = tuple(tokenizer.encode(",", add_special_tokens=False))
    c = TrieConstraint(trie, SpanRules(end_token_id=tokenizer.eos_token_id, on_complete="repeat", separator=sep), "cpu")
    f = c.filters(1, distinct=True, max_entries=8)
    state = c.start(1)
    for t in list(tokenizer.encode("Paris", add_special_tokens=False)) + list(sep):
        state = c.advance(state, torch.tensor([t]), filters=f)
    allowed = c.mask_(torch.zeros(1, len(tokenizer)), state, filters=f).isfinite().nonzero()[:, 1].tolist()
    assert tokenizer.encode(" Paris", add_special_tokens=False)[0] not in allowed
    assert tokenizer.encode(" Rome", add_special_tokens=False)[0] in allowed


def test_item_groups_follow_the_key_index():
    """Entries group by key (a key of several entries), else by name; a trie with neither has no groups."""
    from trie_decode.filters import EntryOrder, ItemGroups

    keyed = TokenTrie.from_sequences([[5], [9], [6, 7], [8]], vocab_size=12, keys=["x", "y", "x", "x"])
    groups = ItemGroups.of(keyed)
    rank = EntryOrder.of(keyed).rank
    assert groups.width == 3 and groups.size[rank].tolist() == [3, 1, 3, 3]
    assert groups.size[rank[1]] == 1 and groups.room(1) == 3 and groups.room(2) == 4 and groups.room(9) == 4
    mixed = TokenTrie.from_sequences([[5], [9], [6, 7], [8], [10], [11]], vocab_size=12,
                                     keys=["x", "y", "x", "x", "y", "z"])
    rank = EntryOrder.of(mixed).rank
    mates = ItemGroups.of(mixed).mates(torch.as_tensor(rank), pad=6).tolist()
    x, y = sorted(rank[[0, 2, 3]].tolist()), sorted(rank[[1, 4]].tolist())
    assert mates == [x, y + [6], x, x, y + [6], [rank[5], 6, 6]]  # each entry's item, padded to the widest
    named = TokenTrie.from_sequences([[5], [6]], vocab_size=12, names=["p", "p"])
    assert ItemGroups.of(named).width == 2
    bare = TokenTrie.from_sequences([[5], [6]], vocab_size=12)
    assert ItemGroups.of(bare).width == 1 and ItemGroups.of(bare).room(2) == 2


def test_item_groups_hold_one_slot_per_entry_however_wide_the_widest_group():
    """An entity with 2,000 aliases beside 9,000 pairs: the groups take O(entries) memory (padded to the widest group
    they took 144 MB), and each entry's item is still all of its group's ranks."""
    from trie_decode.filters import EntryOrder, ItemGroups

    n = 20_000
    seqs = [[1 + i // 1000, 1 + i % 1000] for i in range(n)]
    keys = ["Q0"] * 2_000 + [f"Q{1 + i // 2}" for i in range(n - 2_000)]
    trie = TokenTrie.from_sequences(seqs, vocab_size=1_001, keys=keys)
    groups = ItemGroups.of(trie)
    held = sum(a.nbytes for a in vars(groups).values() if isinstance(a, np.ndarray))
    assert groups.width == 2_000 and held <= 4 * 8 * n
    rank = EntryOrder.of(trie).rank
    mates = groups.mates(torch.as_tensor(rank[[7, 2_000, 2_001, 2_002]]), pad=n)
    assert mates.shape == (4, 2_000)
    assert mates[0].tolist() == sorted(rank[:2_000].tolist())
    pair = sorted(rank[[2_000, 2_001]].tolist())
    assert mates[1, :2].tolist() == mates[2, :2].tolist() == pair and (mates[1:3, 2:] == n).all()
    assert mates[3, :2].tolist() == sorted(rank[[2_002, 2_003]].tolist())


# ------------------------------------------------------------------------------- one trie per prompt, filtered
def test_one_trie_per_prompt_with_filters_reports_the_catalogs_own_entries(tiny_llama):
    """With one trie per prompt, a filter makes each prompt's trie of the entries it leaves (renumbered, without the
    catalog's item lists); match and rank still report the catalog's entry index, key and item keys, as they do
    over a shared trie (items_of(catalog, e.index) gave another item)."""
    from trie_decode.catalogs import items_of
    from trie_decode.integrations.transformers import TrieLogitsProcessor, rank

    codes = np.array([[1, 2], [1, 3], [1, 2], [2, 0], [3, 3]])
    vocab = tiny_llama.config.vocab_size
    a = catalog_from_codes(codes, vocab_size=vocab, codebook_size=4, token_offset=100, keys=[f"s{i}" for i in range(5)])
    b = catalog_from_codes(codes[::-1].copy(), vocab_size=vocab, codebook_size=4, token_offset=100,
                           keys=[f"t{i}" for i in range(5)])
    inputs = {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 10]]), "attention_mask": torch.ones(2, 3, dtype=torch.long)}
    for tries, allow, deny in (([a, a], ["s3", "s4"], None), ([a, b], [["s3", "s4"], ["t0", 3]], None),
                               ([a, b], None, [["s0", "s1"], ["t4"]])):
        proc = TrieLogitsProcessor(tries, end_token_id=END, allow=allow, deny=deny)
        out = tiny_llama.generate(**inputs, logits_processor=[proc], max_new_tokens=4, pad_token_id=END,
                                  eos_token_id=END, do_sample=False)
        for p, (e, row) in enumerate(zip(proc.match(out), out[:, 3:].tolist())):
            want = tries[p].lookup([t for t in row if t != END])
            assert e == want and e.item_keys is not None, (e, want)
        for p, ranked in enumerate(rank(tiny_llama, inputs, tries, 2, end_token_id=END, allow=allow, deny=deny)):
            for r in ranked:
                assert r.entry == tries[p].lookup(r.entry.tokens), r.entry
                assert items_of(tries[p], r.entry.index).size and r.entry.item_keys
    shared = rank(tiny_llama, inputs, a, 2, end_token_id=END, allow=["s3", "s4"])
    per_prompt = rank(tiny_llama, inputs, [a, a], 2, end_token_id=END, allow=["s3", "s4"])
    assert [[r.entry for r in p] for p in per_prompt] == [[r.entry for r in p] for p in shared]


# ------------------------------------------------------------------------------- rank's renormalizer
def test_rank_renormalizes_over_the_entries_the_filters_leave(tiny_llama):
    """An allow filter of k entries behaves exactly like a trie of those k entries: renormalized log-probs equal the
    subset trie's and sum to 1 over them, with allow, with deny, and over a live catalog with removals (the
    normalizer summed over every entry of the trie: 0.54 in the reviewer's case). A beam that did not finish (its
    raw score is transformers' padding) is no result, renormalized or not: on the subset trie the second prompt's
    sum was 1.14, an unfinished beam [500, 501, pad] standing for 'f' with a better score than its finished one."""
    from trie_decode import LiveCatalog
    from trie_decode.integrations.transformers import rank

    trie = TokenTrie.from_sequences(ENTRIES, vocab_size=tiny_llama.config.vocab_size, keys=KEYS)
    inputs = {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 10]]), "attention_mask": torch.ones(2, 3, dtype=torch.long)}
    kept = ["a", "c", "d", "f"]
    subset = trie.subset(np.array([KEYS.index(k) for k in kept]))

    def scores(source, **kw):
        got = rank(tiny_llama, inputs, source, 6, end_token_id=END, num_beams=12, renormalize=True, **kw)
        return [{r.entry.key: r.log_prob for r in p} for p in got]

    want = scores(subset)
    for p in want:
        assert set(p) == set(kept) and abs(sum(np.exp(v) for v in p.values()) - 1.0) < 1e-3
    live = LiveCatalog(trie)
    live.remove(["b", "e"])
    for got in (scores(trie, allow=kept), scores(trie, deny=["b", "e"]), scores(live),
                scores(trie, allow=[kept, kept])):
        for g, w in zip(got, want):
            assert g.keys() == w.keys() and all(abs(g[k] - w[k]) < 1e-4 for k in w), (g, w)


# ------------------------------------------------------------------------------- per-prompt filters as numpy arrays
def test_a_2d_numpy_filter_is_one_row_per_prompt_as_a_list_of_lists(tiny_llama):
    """np.array([[0], [2]]) was flattened into one filter shared by every prompt (both reached a and c); it is one
    row per prompt, as the list [[0], [2]] is, over a shared trie, one trie per prompt and in the core. A filter
    that is not 1-D where one filter is taken (a span, a 3-D array, a torch tensor) is refused by name."""
    from trie_decode.fields import Span
    from trie_decode.integrations.transformers import TrieLogitsProcessor, rank

    trie = TokenTrie.from_sequences([[100], [101], [102], [103]], vocab_size=tiny_llama.config.vocab_size,
                                    keys=list("abcd"))
    inputs = {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 10]]), "attention_mask": torch.ones(2, 3, dtype=torch.long)}
    for tries in (trie, [trie, trie]):
        for spec in ([[0], [2]], np.array([[0], [2]]), np.array([["a"], ["c"]])):
            for kw in (dict(allow=spec), dict(deny=[[1, 2, 3], [0, 1, 3]] if isinstance(spec, list)
                                              else np.array([[1, 2, 3], [0, 1, 3]]))):
                got = rank(tiny_llama, inputs, tries, 4, end_token_id=END, num_beams=4, **kw)
                assert [[r.entry.key for r in p] for p in got] == [["a"], ["c"]], (type(spec), kw)
    c = TrieConstraint(trie, SpanRules(end_token_id=END), "cpu")
    assert _allowed(c, c.start(2), c.filters(2, allow=np.array([[0, 1], [2, 3]])), 104) == [{100, 101}, {102, 103}]
    for bad in (np.zeros((2, 1, 1), dtype=np.int64), np.array(0)):
        with pytest.raises(ConstraintConfigError, match=r"allow must be one list \(or 1-D array\) of entry keys or "
                                                        r"entry indices, got an array of shape"):
            c.filters(2, allow=bad)
    with pytest.raises(ConstraintConfigError, match="got a torch tensor of shape .2, 1.: pass its .tolist"):
        TrieLogitsProcessor(trie, end_token_id=END, allow=torch.tensor([[0], [2]]))
    with pytest.raises(ConstraintConfigError, match=r"^Span\.allow must be one list .* shape \(2, 1\)"):  # when made
        Span(trie, after="x", allow=np.array([[0], [1]])).build_trie(None)


def test_live_view_refuses_max_entries_without_a_distinct_list():
    from trie_decode.live import LiveCatalog

    trie = TokenTrie.from_sequences([[5], [6]], vocab_size=V, keys=["a", "b"])
    live = LiveCatalog(trie)
    live.remove(["a"])
    rules = SpanRules(end_token_id=END, on_complete="repeat", separator=(SEP,))
    view = live.snapshot().view(rules)
    with pytest.raises(ConstraintConfigError, match="max_entries=4 is the room of a distinct list"):
        view.filters(view.constraint(rules, "cpu"), 1, max_entries=4)


@pytest.mark.parametrize("seed", range(4))
def test_counting_only_the_children_that_hold_a_denied_entry_masks_as_counting_every_child(seed, monkeypatch):
    """On the CPU a filter pass without allow sets counts only the children of each row's node that hold a denied
    entry (a distinct list at a wide root: O(R * D), not O(R * F)). It gives the same logits, bit for bit, as
    counting every child (the pass the reference tests check): rows 1 to 4 stand where a rule of that path matters
    (the separator is an open child of a denied entry; one child holds two denied entries; the node's own entry is
    denied; another processor banned every child but a denied one: the floor, over children not counted), then
    random rows: bans, rows whose kept values are all banned, NaN, full distinct lists, a row outside the trie."""
    from trie_decode.constraint import DONE
    from trie_decode.filters import _counts_every_child, _filter_rows_
    from trie_decode.kernels.rules import ALL_MASKED_FLOOR

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    v = 64
    made = [[50], [50, SEP], [50, SEP, 51], [52, 53], [52, 53, 54], [52, 55], [56, 57], [58], [58, 59]]
    seqs = made + sorted({tuple(rng.randrange(SEP, 50) for _ in range(rng.randrange(1, 4))) for _ in range(300)})
    keys = [f"item{i // 2}" for i in range(len(seqs))]  # pairs of entries are one item in a distinct list
    trie = TokenTrie.from_sequences(seqs, vocab_size=v, keys=keys)
    rules = SpanRules(end_token_id=END, on_complete="repeat", separator=(SEP,))
    c = TrieConstraint(trie, rules, "cpu")
    e, rows = trie.num_entries, 12
    at = trie.walk
    entry = lambda tokens: int(trie.node_entry[at(tokens)])  # noqa: E731
    deny = [[], [entry([50])], [entry([52, 53]), entry([52, 53, 54])], [entry([56, 57]), entry([58])],
            [entry([52, 55])]] + [rng.sample(range(e), rng.randrange(0, 20)) for _ in range(rows - 5)]
    floors = fulls = 0
    for distinct in (False, True):
        f = c.filters(rows, deny=deny, distinct=distinct, **({"max_entries": 2} if distinct else {}))
        node = torch.tensor([DONE, at([50]), at([52]), at([58]), at([52])] + [
            rng.choice([0, rng.randrange(trie.num_nodes)]) for _ in range(rows - 5)])
        if distinct:  # lists part-way: some rows hold one entry, some are full
            for _ in range(2):
                where = torch.rand(rows, generator=gen) < 0.6
                where[:5] = False
                f.add_denied(torch.randint(0, e, (rows,), generator=gen), where)
            fulls += int((f.full & (node >= 0)).sum())
        assert not _counts_every_child(f, node, c.dtries[0], f.deny, False)  # the path apply_filters_ takes here
        logits = torch.randn(rows, v, generator=gen)
        logits[5:][torch.rand(rows - 5, v, generator=gen) < 0.7] = float("-inf")  # another processor's bans
        logits[4, 53] = float("-inf")
        logits[rows // 2 :: 2] = float("-inf")  # every kept value banned: the floor
        logits[2, 55] = logits[2, 53] = float("nan")  # a NaN is kept where its child is open, blocked where not
        masked = c.mask_(logits, RowState(node, torch.zeros_like(node)))  # the trie mask, then the filter pass
        every, counted = masked.clone(), masked.clone()
        _filter_rows_(every, node, f, c.dtries[0], rules, None)
        _filter_rows_(counted, node, f, c.dtries[0], rules, f.deny)
        torch.testing.assert_close(counted, every, rtol=0, atol=0, equal_nan=True)
        assert every[1, SEP].isfinite() and every[2, 55].isnan() and every[2, 53] == float("-inf")
        assert every[3, 59].isfinite()
        assert every[4, 53] == ALL_MASKED_FLOOR and every[4, 55] == float("-inf")
        if distinct:  # a full list allows the end token alone, wherever the row stands
            full = (f.full & (node >= 0)).nonzero().flatten()
            assert (every[full].isfinite().nonzero()[:, 1] == END).all()
        floors += int((every == ALL_MASKED_FLOOR).any(1).sum())
    assert floors and fulls  # the cases this test is for did occur
    # That path reads flags on the host: under torch.compile (fullgraph) the pass counts every child.
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert _counts_every_child(f, node, c.dtries[0], f.deny, False)


@pytest.mark.parametrize("seed", range(4))
def test_a_distinct_list_beside_a_static_filter_masks_as_counting_every_child(seed):
    """The C kernel masks a distinct list's static filter (its allow and deny sets as made) with their node flags,
    and the filter pass then counts only the children that hold an entry the list emitted since: the same logits,
    bit for bit, as the trie mask followed by a filter pass that counts every child against the whole sets. Rows
    with allow sets, wide deny sets, bans, NaN, rows whose kept values are all banned, full lists."""
    from trie_decode.constraint import DONE
    from trie_decode.filters import _counts_every_child, _filter_rows_

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    v = 64
    seqs = sorted({tuple(rng.randrange(SEP, v) for _ in range(rng.randrange(1, 4))) for _ in range(600)})
    trie = TokenTrie.from_sequences(seqs, vocab_size=v, keys=[f"item{i // 2}" for i in range(len(seqs))])
    rules = SpanRules(end_token_id=END, on_complete="repeat", separator=(SEP,))
    c = TrieConstraint(trie, rules, "cpu", kernel="native")
    e, rows = trie.num_entries, 10
    allow = [None] * 6 + [rng.sample(range(e), rng.randrange(e // 4, e)) for _ in range(rows - 6)]
    deny = [rng.sample(range(e), rng.randrange(0, e // 3)) for _ in range(rows)]
    f = c.filters(rows, allow=allow, deny=deny, distinct=True, max_entries=3)
    # Each row stands where the entry its list emitted last was one child (a leaf) of several, usable until then:
    # that child is blocked now, by the list and not by the static filter. Lists part-way: some rows are full.
    fanout = np.diff(trie.child_ptr)
    leaves = [i for i in range(e) if fanout[trie.entry_node[i]] == 0 and fanout[trie.parent[trie.entry_node[i]]] > 1]
    usable = [[i for i in leaves if i not in d and (a is None or i in a)] for a, d in zip(allow, deny)]
    for last in (False, False, True):
        emit = [rng.choice(u) for u in usable]
        f.add_denied(torch.from_numpy(f.order.rank[emit]), torch.ones(rows, dtype=torch.bool) if last else
                     torch.rand(rows, generator=gen) < 0.6)
    node = torch.tensor([DONE] + [int(trie.parent[trie.entry_node[i]]) for i in emit[1:]])
    node[-1] = 0  # the root
    assert f.full.any() and not f.full[1:-1].all() and f.has_static
    assert not _counts_every_child(f, node, c.dtries[0], f.emitted, True)  # the path mask_ takes here
    logits = torch.randn(rows, v, generator=gen)
    logits[torch.rand(rows, v, generator=gen) < 0.6] = float("-inf")
    logits[torch.arange(rows), torch.tensor([trie.token[trie.entry_node[i]] for i in emit])] = 1.0  # the emitted
    logits[1::3] = float("-inf")
    logits[2, :] = float("nan")
    got = c.mask_(logits.clone(), RowState(node, torch.zeros_like(node)), filters=f)
    want = c.mask_(logits.clone(), RowState(node, torch.zeros_like(node)))  # the trie mask, then every child counted
    _filter_rows_(want, node, f, c.dtries[0], rules, None)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("kernel", ["native", "numpy", "torch"])
def test_the_floor_does_not_revive_the_separator_a_list_ends_at(kernel):
    """At the entry that fills a distinct list (or is its last usable one) the separator is blocked, also where its
    token is a child the filter blocks (an entry continues with the separator's token). When another processor
    banned what the row keeps (here the end token), the floor goes to what it keeps, the end token alone: not to
    the separator's column, which that blocked child held."""
    from trie_decode.kernels.rules import ALL_MASKED_FLOOR

    trie = TokenTrie.from_sequences([[5], [5, SEP, 6], [7]], vocab_size=10, keys=["a", "a,b", "c"])
    rules = SpanRules(end_token_id=END, on_complete="repeat", separator=(SEP,))
    c = TrieConstraint(trie, rules, "cpu", kernel=kernel)
    for deny, max_entries in ((["a,b"], 1), (["a,b", "c"], 4)):  # "a" fills the list / is the last usable entry
        f = c.filters(1, deny=deny, distinct=True, max_entries=max_entries)
        state = c.advance(c.start(1), torch.tensor([5]), filters=f)
        assert _allowed(c, state, f, 10) == [{END}]
        logits = torch.full((1, 10), float("-inf"))
        logits[0, SEP] = 0.0  # the separator's token was finite, the end token banned
        out = c.mask_(logits, state, filters=f)[0]
        assert out.isfinite().nonzero().flatten().tolist() == [END] and out[END] == ALL_MASKED_FLOOR


def test_a_distinct_list_selection_keeps_its_rows_whatever_the_index_tensor_becomes():
    """``select`` maps a distinct list's static sets to its rows lazily (when the C kernel first builds their node
    flags): from a copy of the index, as every other set of the selection, so a caller that reuses its index tensor
    after the selection does not move the rows' static filters (row 0's filter here would allow token 4)."""
    trie = TokenTrie.from_sequences([[t] for t in range(3, 40)], vocab_size=40)  # a wide root: the counted path
    rules = SpanRules(end_token_id=END, on_complete="repeat", separator=(SEP,))
    c = TrieConstraint(trie, rules, "cpu", kernel="native")
    f = c.filters(2, deny=[[0], [1]], distinct=True, max_entries=3)  # row 0 denies token 3, row 1 token 4
    index = torch.tensor([1, 1])
    picked = f.select(index)
    index[:] = 0
    assert [4 in a or 3 not in a for a in _allowed(c, c.start(2), picked, 40)] == [False, False]


@pytest.mark.parametrize("max_entries", [2**40, 10**30])
def test_a_distinct_list_larger_than_the_trie_holds_every_entry_once(max_entries):
    """A list's room is at most the trie's entries: max_entries=2**40 allocated 8 TB per row (RuntimeError inside
    torch), 10**30 overflowed; both walk as a list that may hold every entry."""
    trie = TokenTrie.from_sequences(LIST, vocab_size=20)
    c = TrieConstraint(trie, SpanRules(end_token_id=END, on_complete="repeat", separator=SEP2), "cpu")
    every = c.filters(2, deny=[None, [0]], distinct=True, max_entries=trie.num_entries)
    huge = c.filters(2, deny=[None, [0]], distinct=True, max_entries=max_entries)
    assert _walk_lists(c, huge, 2, seed=3) == _walk_lists(c, every, 2, seed=3)
