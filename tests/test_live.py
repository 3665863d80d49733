"""Live catalogs: a snapshot decodes as data (one trie plus a deny filter), removals at once, additions once compacted.

A view of a snapshot (:meth:`CatalogSnapshot.view`) is checked step by step against the brute-force reference over
the entries it serves (the live entries its trie holds), in every ``on_complete`` mode, with triggers, on every
kernel, after random adds and removes before and after a compaction; with per-request filters and distinct lists;
on the torch path with no host read; in the background compaction's life cycle (requests keep the last compacted
trie until the next one is ready; a failed compaction is reported); inside a real ``generate`` (a request keeps the
view it started with, the one-call step runs on a live catalog); and through delta files.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trie_decode import CatalogUpdateError, ConstraintConfigError, EmptyTrieError, TokenTrie, TrieFileError
from trie_decode.constraint import SpanRules, TrieConstraint
from trie_decode.errors import InvalidTokenError, TokenizerMismatchError
from trie_decode.live import CatalogView, LiveCatalog, _Compaction, apply_delta_file, constraint_for, delta_path_for

from reference import SPAN_RULE_CASES, SpanReference
from test_device_step import no_host_sync

V = 24
END = 1
MODES = SPAN_RULE_CASES


def key(seq) -> str:
    return "k" + "-".join(map(str, seq))


def random_changes(rng: random.Random, catalog: LiveCatalog, base: TokenTrie, live: set, fresh, count: int) -> None:
    """Random adds (some reviving removed base entries) and removes (by key, by base index, by tokens); ``live`` is
    kept equal to the set of entries the catalog holds."""
    seqs = base.sequences()
    for _ in range(count):
        if rng.random() < 0.5 or not live:
            batch = [rng.choice(seqs) if rng.random() < 0.3 else fresh() for _ in range(rng.randrange(1, 4))]
            catalog.add([list(s) for s in batch], keys=[key(s) for s in batch])
            live |= set(batch)
        else:
            s = rng.choice(sorted(live))
            how = rng.randrange(3)
            entry = base.lookup(s)
            if how == 0 or entry is None:
                catalog.remove([key(s)])
            elif how == 1:
                catalog.remove(sequences=[list(s)])
            else:
                catalog.remove([entry.index])
            live.discard(s)


def random_catalog(rng: random.Random, low: int = 2, max_len: int = 4) -> tuple[LiveCatalog, TokenTrie, set, set]:
    """A base trie with keys, random changes, sometimes a compaction, then more random changes. Returns the catalog,
    its base, the entries it holds and the entries its newest compacted trie (or the base) holds."""
    # A small alphabet often makes entries prefixes of one another (removed entry ends inside live paths).
    high = rng.choice([low + 3, low + 6, V])

    def fresh() -> tuple[int, ...]:
        return tuple(rng.randrange(low, high) for _ in range(rng.randrange(1, max_len + 1)))

    seqs = [fresh() for _ in range(rng.randrange(1, 12))]
    base = TokenTrie.from_sequences([list(s) for s in seqs], vocab_size=V, keys=[key(s) for s in seqs])
    catalog = LiveCatalog(base)
    live = set(seqs)
    random_changes(rng, catalog, base, live, fresh, rng.randrange(0, 10))
    compacted = set(seqs)
    if live and rng.random() < 0.6:
        assert catalog.wait_compacted()
        if live - compacted:  # additions to make visible: a compaction ran (revived base entries need none)
            compacted = set(live)
    random_changes(rng, catalog, base, live, fresh, rng.randrange(0, 8))
    return catalog, base, live, compacted


def _junk(rng: random.Random, rules: SpanRules) -> int:
    """A token the mask did not allow, most often one with a meaning (separator, end, trigger), as beam search's
    discarded rows may take."""
    special = [rules.end_token_id, *rules.separator, *rules.trigger]
    return rng.choice(special) if rng.random() < 0.6 else rng.randrange(V)


def _allowed(c: TrieConstraint, state, filters, width: int) -> list:
    out = c.mask_(torch.zeros(len(state), width), state, filters=filters)
    return [None if bool(row.isfinite().all()) else set(row.isfinite().nonzero().flatten().tolist()) for row in out]


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**20), mode=st.sampled_from(MODES), kernel=st.sampled_from(["native", "numpy", "torch"]),
       dense=st.booleans())
def test_a_view_decodes_like_a_trie_of_the_entries_it_serves(seed, mode, kernel, dense):
    rng = random.Random(seed)
    catalog, base, live, compacted = random_catalog(rng)
    snap = catalog.snapshot()
    assert sorted(snap.sequences()) == sorted(live)
    assert list(snap.added()) == (snap.delta.sequences() if snap.delta is not None else [])  # delta entry order
    rules = SpanRules(end_token_id=END, **mode)
    if not live:
        with pytest.raises(EmptyTrieError):
            snap.view(rules)
        with pytest.raises(EmptyTrieError):
            snap.compact()
        return
    whole = snap.compact()  # removals only: the base pruned; else a build. Either way a build's arrays
    want = TokenTrie.from_sequences([list(t) for t in snap.sequences()], vocab_size=V)
    assert all(np.array_equal(getattr(whole, a), getattr(want, a))
               for a in ("child_ptr", "token", "node_entry", "entry_node", "level_ptr"))
    assert [whole.entry(i).key for i in range(len(whole))] == [key(t) for t in snap.sequences()]
    served = live & compacted  # removals at once, additions once compacted
    if not served or (rules.on_complete == "release" and compacted - live):
        served = live  # nothing to serve yet, or "release" (no filter) with removals: the snapshot's own compaction
    view = snap.view(rules)
    held = set(view.trie.sequences())
    assert {view.trie.entry(int(i)).tokens for i in view.deny} == held - served
    assert held & live == served and view.pending == len(live - served) and view.visible == len(served)
    c = view.constraint(rules, "cpu", kernel=kernel, dense_min_fanout=2 if dense else None)
    assert c.kernel.name == kernel and c is view.constraint(rules, "cpu", kernel=kernel,
                                                             dense_min_fanout=2 if dense else None)
    filters = view.filters(c, 6)
    assert (filters is None) == (not view.deny.size)
    rows = 6
    tails = torch.tensor([[rng.randrange(2, V) for _ in range(3)] for _ in range(rows)])
    if rules.trigger:
        tails[0, -len(rules.trigger):] = torch.tensor(rules.trigger)
    state = c.start(rows, None, tails)
    refs = [SpanReference(served, rules, tuple(tails[i].tolist())) for i in range(rows)]
    history = tails.clone()
    width = V + 3  # logits wider than the vocabulary
    for _ in range(12):
        expected = [r.allowed() for r in refs]
        assert _allowed(c, state, filters, width) == expected
        toks = []
        for r, allowed in zip(refs, expected):
            pool = sorted(allowed) if allowed is not None else list(range(2, V))
            if allowed is None and rules.trigger and rng.random() < 0.5:
                pool = [t for form in rules.triggers for t in form]
            tok = rng.choice(pool) if rng.random() < 0.8 else _junk(rng, rules)
            toks.append(tok)
            r.step(tok)
        history = torch.cat([history, torch.tensor(toks)[:, None]], dim=1)
        state = c.advance(state, torch.tensor(toks), history, filters=filters)
    if filters is None:  # the entries each row completed, read back from the generated tokens
        got = c.replay(history[:, tails.shape[1]:].tolist(), None, tails.tolist())
        assert [[e.tokens for e in row] for row in got] == [r.finish() for r in refs]


@pytest.mark.parametrize("kernel", ["native", "numpy", "torch"])
@pytest.mark.parametrize("seed", range(8))
def test_request_filters_and_distinct_lists_over_a_view(kernel, seed):
    rng = random.Random(seed)
    catalog, base, live, compacted = random_catalog(rng, low=3, max_len=3)
    catalog.add([[20, 21], [22], [23]], keys=[key((20, 21)), key((22,)), key((23,))])
    live |= {(20, 21), (22,), (23,)}
    assert catalog.wait_compacted()
    gone = sorted(live)[0]
    catalog.remove(sequences=[list(gone)])  # a removal after the compaction: denied over the compacted trie
    live.discard(gone)
    snap = catalog.snapshot()
    distinct = seed % 2 == 1
    rules = SpanRules(end_token_id=END, on_complete="repeat", separator=(2,)) if distinct else SpanRules(END)
    view = snap.view(rules)
    assert view.deny.size == 1 and view.pending == 0
    c = view.constraint(rules, "cpu", kernel=kernel)
    entries = sorted(live)
    rows = 5
    allow = [None if i == 0 else [key(s) for s in rng.sample(entries, rng.randrange(1, len(entries) + 1))]
             for i in range(rows)]
    deny = [[key(s) for s in rng.sample(entries, rng.randrange(0, len(entries) // 2 + 1))] for _ in range(rows)]
    usable = [(set(a) if a is not None else {key(s) for s in entries}) - set(d) for a, d in zip(allow, deny)]
    keep = [i for i in range(rows) if usable[i]]
    allow, deny = [allow[i] for i in keep], [deny[i] for i in keep]
    filters = view.filters(c, len(keep), allow, deny, distinct=distinct, max_entries=8 if distinct else None)
    refs = [SpanReference({s for s in entries if key(s) in usable[i]}, rules, distinct=distinct) for i in keep]
    state = c.start(len(keep))
    for _ in range(14):
        expected = [r.allowed() for r in refs]
        assert _allowed(c, state, filters, V) == expected
        toks = [rng.choice(sorted(a)) for a in expected]
        for r, t in zip(refs, toks):
            r.step(t)
        state = c.advance(state, torch.tensor(toks), filters=filters)
        beams = torch.tensor([rng.randrange(len(keep)) for _ in range(len(keep))])  # beam search reorders rows
        filters, state = filters.select(beams), state.select(beams)
        refs = [_copy_ref(refs[b]) for b in beams.tolist()]
    for r in refs:
        assert not distinct or len(r.completed) == len(set(r.completed))


def _copy_ref(ref: SpanReference) -> SpanReference:
    out = SpanReference(set(ref.entries), ref.rules, distinct=ref.distinct, same_item=ref.same_item)
    out.history, out.state, out.completed = list(ref.history), ref.state, list(ref.completed)
    return out


@pytest.mark.parametrize("mode", MODES[:4], ids=lambda m: "-".join(str(v) for v in m.values()))
def test_a_view_step_never_reads_the_device(mode):
    rng = random.Random(3)
    base = TokenTrie.from_sequences([[rng.randrange(3, V) for _ in range(rng.randrange(1, 4))] for _ in range(40)]
                                    + [[8], [8, 9]], vocab_size=V, keys=[str(i) for i in range(42)])
    catalog = LiveCatalog(base)
    catalog.add([[10, 11, 12], [8, 13], [14]], keys=["x", "y", "z"])
    assert catalog.wait_compacted()
    catalog.remove(list(range(0, base.num_entries - 2, 3)), sequences=[[8]])
    rules = SpanRules(end_token_id=END, **mode)
    view = catalog.snapshot().view(rules)
    c = view.constraint(rules, "cpu", dense_min_fanout=4, kernel="torch")
    rows = 7
    filters = view.filters(c, rows) if mode["on_complete"] == "release" else view.filters(c, rows, deny=["y", "1"])
    assert (filters is None) == (mode["on_complete"] == "release")  # release: the snapshot's own compaction
    tails = torch.randint(2, V, (rows, 2))
    state = c.start(rows, None, tails)  # setup may read the device; the step may not
    for _ in range(6):
        tokens = torch.randint(0, V, (rows,))
        with no_host_sync():
            c.mask_(torch.randn(rows, V + 3), state, filters=filters)
            c.mask_(torch.randn(rows, V + 3), state, inplace=False, filters=filters)
            tails = torch.cat([tails[:, 1:], tokens.unsqueeze(1)], dim=1)
            state = c.advance(state, tokens, tails, filters=filters)
            state = state.select(torch.arange(rows).flip(0))
            filters = filters.select(torch.arange(rows).flip(0)) if filters is not None else None


def test_removals_are_immediate_and_additions_visible_after_a_compaction():
    base = TokenTrie.from_sequences([[3, 4], [3, 5], [6]], vocab_size=10, keys=["a", "b", "c"])
    catalog = LiveCatalog(base)
    rules = SpanRules(END)
    first = catalog.snapshot().view(rules)
    assert first.trie is base and not first.deny.size and first.filters(first.constraint(rules, "cpu"), 2) is None
    catalog.remove(["b"])
    removed = catalog.snapshot().view(rules)
    assert removed.trie is base and removed.deny.tolist() == [1]  # the base plus its tombstones
    catalog.add([[3, 7]], keys=["d"])
    pending = catalog.snapshot().view(rules)
    assert pending.pending == 1 and pending.trie is base and pending.deny.tolist() == [1]
    assert catalog.wait_compacted() and catalog.wait_compacted(timeout=0)
    compacted = catalog.snapshot().view(rules)
    assert compacted.trie is not base and sorted(compacted.trie.sequences()) == [(3, 4), (3, 7), (6,)]
    assert not compacted.deny.size and compacted.pending == 0
    c = compacted.constraint(rules, "cpu")
    assert c.allowed_tokens(c.advance(c.start(1), torch.tensor([3]))) == [[4, 7]]
    catalog.remove(["d", "a"])
    catalog.add([[9]], keys=["e"])
    later = catalog.snapshot().view(rules)  # the last compacted trie, its removed entries denied at once
    assert later.trie is compacted.trie and later.pending == 1
    assert sorted(later.trie.entry(int(i)).key for i in later.deny) == ["a", "d"]
    c = later.constraint(rules, "cpu")
    f = later.filters(c, 1)
    assert c.mask_(torch.zeros(1, 10), c.start(1), filters=f).isfinite().nonzero()[:, 1].tolist() == [6]
    assert first.trie is base and not first.deny.size  # a running request's view never changes
    assert catalog.wait_compacted()
    assert sorted(catalog.snapshot().view(rules).trie.sequences()) == [(6,), (9,)]
    new_base = catalog.rebase()
    assert catalog.snapshot().plain and catalog.snapshot().view(rules).trie is new_base
    assert "pending=0" in repr(catalog.snapshot().view(rules))


def test_requests_keep_the_last_compacted_trie_while_the_next_one_builds(monkeypatch):
    base = TokenTrie.from_sequences([[3, 4], [5]], vocab_size=10, keys=["a", "b"])
    catalog = LiveCatalog(base)
    started, release = threading.Event(), threading.Event()
    real = _Compaction.of

    def slow(snap, warm=()):
        started.set()
        assert release.wait(30)
        return real(snap, warm)

    monkeypatch.setattr(_Compaction, "of", staticmethod(slow))
    catalog.add([[6]], keys=["c"])
    view = catalog.snapshot().view()  # asks for the compaction and returns at once: it is built off this thread
    assert started.wait(30) and view.trie is base and view.pending == 1
    catalog.remove(["a"])
    assert catalog.snapshot().view().deny.tolist() == [0]  # still the base, the removal denied at once
    assert not catalog.wait_compacted(timeout=0.05)
    release.set()
    assert catalog.wait_compacted(timeout=30)
    view = catalog.snapshot().view()
    assert sorted(view.trie.sequences()) == [(5,), (6,)] and not view.deny.size


def test_a_compaction_builds_the_step_tables_requests_use():
    from trie_decode.device import DeviceTrie

    catalog = LiveCatalog(TokenTrie.from_sequences([[3, 4], [5]], vocab_size=10, keys=["a", "b"]))
    lists = SpanRules(END, on_complete="repeat", separator=(2,))
    catalog.snapshot().view(lists).constraint(lists, "cpu")  # a request decodes with these rules
    catalog.add([[6]], keys=["c"])
    assert catalog.wait_compacted()
    trie = catalog.snapshot().view(lists).trie
    assert trie is not catalog.base and lists in DeviceTrie.get(trie, "cpu")._tables  # off the request path


def test_a_failed_compaction_is_reported_and_requests_keep_decoding(monkeypatch):
    base = TokenTrie.from_sequences([[3, 4], [5]], vocab_size=10, keys=["a", "b"])
    catalog = LiveCatalog(base)

    def fail(snap, warm=()):
        raise MemoryError("no room for the compacted trie")

    monkeypatch.setattr(_Compaction, "of", staticmethod(fail))
    catalog.add([[6]], keys=["c"])
    with pytest.raises(MemoryError, match="no room"):
        catalog.wait_compacted()
    view = catalog.snapshot().view()
    assert view.trie is base and view.pending == 1


def test_view_filters_and_their_errors():
    catalog = LiveCatalog(TokenTrie.from_sequences([[3, 4], [5]], vocab_size=8, keys=["a", "b"]))
    catalog.add([[6]], keys=["c"])
    catalog.remove(["a"])
    view = catalog.snapshot().view()
    c = view.constraint(SpanRules(END), "cpu")
    with pytest.raises(ConstraintConfigError, match="not entries of the catalog"):
        view.filters(c, 1, deny=["zzz"])
    live_hint = r"^allow leaves no entry \(after deny\): nothing could be generated \(the catalog is live: its removed "
    with pytest.raises(ConstraintConfigError, match=live_hint):
        view.filters(c, 1, allow=["a"])  # removed
    with pytest.raises(ConstraintConfigError, match=live_hint):
        view.filters(c, 1, allow=["c"])  # added, not compacted yet
    with pytest.raises(ConstraintConfigError, match="outside the snapshot"):
        view.filters(c, 1, allow=[3])
    with pytest.raises(ConstraintConfigError, match="entry keys"):
        view.filters(c, 1, allow=[1.5])
    with pytest.raises(ConstraintConfigError, match="the string"):
        view.filters(c, 1, deny="b")
    with pytest.raises(ConstraintConfigError, match="2 row specs for 1 rows"):
        view.filters(c, 1, deny=[["b"], None])
    with pytest.raises(ConstraintConfigError, match="this view's own"):
        view.filters(TrieConstraint(TokenTrie.from_sequences([[3, 4], [5]], vocab_size=8), SpanRules(END), "cpu"), 1)
    assert catalog.wait_compacted()
    view = catalog.snapshot().view()
    c = view.constraint(SpanRules(END), "cpu")
    f = view.filters(c, 1, allow=[2])  # snapshot entry number 2: the added entry
    assert c.mask_(torch.zeros(1, 8), c.start(1), filters=f).isfinite().nonzero()[:, 1].tolist() == [6]
    catalog.remove(["b"])
    release = SpanRules(END, on_complete="release")
    loose = catalog.snapshot().view()
    with pytest.raises(ConstraintConfigError, match="release"):
        loose.filters(loose.constraint(release, "cpu"), 1)
    exact = catalog.snapshot().view(release)  # "release" takes no filter: the snapshot's own compaction
    assert exact.trie.sequences() == [(6,)] and not exact.deny.size and catalog.snapshot().view(release) is exact
    with pytest.raises(ConstraintConfigError, match="release"):
        exact.filters(exact.constraint(release, "cpu"), 1, deny=["c"])
    with pytest.raises(TypeError, match="SpanRules"):
        catalog.snapshot().view("eos")


def test_distinct_lists_over_a_changed_catalog():
    catalog = LiveCatalog(TokenTrie.from_sequences([[3, 4], [5], [6]], vocab_size=8, keys=["a", "b", "c"]))
    catalog.add([[7]], keys=["d"])
    assert catalog.wait_compacted()
    catalog.remove(["c"])
    lists = SpanRules(END, on_complete="repeat", separator=(2,))
    view = catalog.snapshot().view(lists)
    c = view.constraint(lists, "cpu")
    f = view.filters(c, 1, distinct=True, max_entries=4)
    state = c.start(1)
    assert c.allowed_tokens(state) == [[3, 5, 6, 7]] and _allowed(c, state, f, 8) == [{3, 5, 7}]
    for tok in (7, 2, 5, 2):
        state = c.advance(state, torch.tensor([tok]), filters=f)
    assert _allowed(c, state, f, 8) == [{3}]  # 7 and 5 are used, 6 is removed
    for tok in (3, 4):
        state = c.advance(state, torch.tensor([tok]), filters=f)
    assert _allowed(c, state, f, 8) == [{END}]  # every entry used: the list ends


def test_changes_and_their_errors():
    base = TokenTrie.from_sequences([[3, 4], [3, 5], [6], [6, 7]], vocab_size=10, keys=["a", "b", "c", "c"],
                                    names=["A", "B", "C", "C2"])
    catalog = LiveCatalog(base)
    assert catalog.remove(["c"]) == 2  # a key reaches every entry holding it
    assert catalog.num_entries == 2 and catalog.num_removed == 2
    assert catalog.add([[6], [9]], keys=["c", "d"], names=["C", "D"]) == 2  # [6] is revived, [9] added
    assert catalog.add([[9], [3, 4]], keys=["d", "a"], names=["D", "A"]) == 0  # already held
    assert catalog.remove(["d"]) == 1 and catalog.num_added == 0  # an added entry leaves the delta
    v = catalog.version
    assert catalog.remove(["zzz"], missing_ok=True) == 0 and catalog.version == v
    with pytest.raises(CatalogUpdateError, match="not in the catalog"):
        catalog.remove(["zzz", "a"])
    assert catalog.snapshot().lookup([3, 4]) is not None  # a failed change changes nothing
    with pytest.raises(CatalogUpdateError, match="not in the catalog"):
        catalog.remove([3])  # [6, 7] is already removed
    with pytest.raises(CatalogUpdateError, match="not a base entry"):
        catalog.remove([99])
    with pytest.raises(CatalogUpdateError, match="single string"):
        catalog.remove("a")
    with pytest.raises(CatalogUpdateError, match=r"base entry indices \(int\)"):
        catalog.remove([1.5])
    with pytest.raises(CatalogUpdateError, match="pass keys="):
        catalog.add([[8]], names=["E"])
    with pytest.raises(CatalogUpdateError, match="pass names="):
        catalog.add([[8]], keys=["e"])
    with pytest.raises(CatalogUpdateError, match="keys has 2 items"):
        catalog.add([[8]], keys=["e", "f"], names=["E"])
    with pytest.raises(InvalidTokenError, match="outside the vocabulary"):
        catalog.add([[10]], keys=["e"], names=["E"])
    with pytest.raises(CatalogUpdateError, match="tokenizer="):
        catalog.add([[8]], keys=["e"], names=["E"], leading_space=True)
    bare = LiveCatalog(TokenTrie.from_sequences([[3]], vocab_size=5))
    with pytest.raises(CatalogUpdateError, match="no entry keys"):
        bare.add([[4]], keys=["x"])
    with pytest.raises(CatalogUpdateError, match="neither keys nor names"):
        bare.remove(["x"])
    with pytest.raises(TypeError, match="TokenTrie"):
        LiveCatalog([[3]])


def test_snapshots_are_immutable_and_numbered():
    base = TokenTrie.from_sequences([[3, 4], [5]], vocab_size=8, keys=["a", "b"])
    catalog = LiveCatalog(base)
    before = catalog.snapshot()
    assert catalog.snapshot() is before  # cached until a change
    catalog.add([[6, 7]], keys=["c"])
    catalog.remove(["a"])
    after = catalog.snapshot()
    assert after.version == before.version + 2
    assert sorted(before.sequences()) == [(3, 4), (5,)]  # the old snapshot is unchanged
    assert sorted(after.sequences()) == [(5,), (6, 7)]
    assert after.entry(2).key == "c" and after.entry(2).index == 2 and after.lookup([6, 7]).index == 2
    with pytest.raises(IndexError, match="removed"):
        after.entry(0)
    assert after.lookup([3, 4]) is None and before.lookup([3, 4]).key == "a"
    assert not after.tombstones.flags.writeable and not after.view().deny.flags.writeable
    new_base = catalog.rebase()
    assert sorted(new_base.sequences()) == [(5,), (6, 7)] and catalog.base is new_base and catalog.snapshot().plain
    assert sorted(after.sequences()) == [(5,), (6, 7)]  # still readable by requests that hold it


def test_a_snapshot_made_from_a_delta_trie_of_ones_own_checks_it():
    """A delta trie without the base's keys failed inside compact() (numpy IndexError), and one that repeats a live
    base entry on an assert: both are refused when the snapshot is made, naming the problem."""
    from trie_decode import CatalogSnapshot

    base = TokenTrie.from_sequences([[3, 4], [6]], vocab_size=8, keys=["a", "c"])
    with pytest.raises(CatalogUpdateError, match=r"the delta's keys do not match the base's \(the base has keys\)"):
        CatalogSnapshot(base, TokenTrie.from_sequences([[7]], vocab_size=8))
    with pytest.raises(CatalogUpdateError, match="delta entry 1 is base entry 0, which the snapshot holds"):
        CatalogSnapshot(base, TokenTrie.from_sequences([[7], [3, 4]], vocab_size=8, keys=["d", "a2"]))
    snap = CatalogSnapshot(base, TokenTrie.from_sequences([[7], [3, 4]], vocab_size=8, keys=["d", "a2"]), [0])
    assert snap.compact().sequences() == [(6,), (7,), (3, 4)]  # a removed base entry's sequence may be added


def test_delta_files_round_trip_and_refuse_another_base(tmp_path):
    base = TokenTrie.from_sequences([[3, 4], [3, 5], [6]], vocab_size=10, keys=["a", "b", "c"], names=["A", "B", "C"])
    trie_path = tmp_path / "catalog.safetensors"
    base.save(trie_path)
    catalog = LiveCatalog.open(trie_path)
    catalog.add([[7, 8], [9]], keys=["d", "e"], names=["D", "É"])
    catalog.remove(["b"])
    delta_path = delta_path_for(trie_path)
    assert delta_path == str(tmp_path / "catalog.delta.safetensors")
    catalog.save_delta(delta_path)
    again = LiveCatalog.open(trie_path, delta_path)
    a, b = catalog.snapshot(), again.snapshot()
    assert a.sequences() == b.sequences() and b.entry(4).name == "É"
    assert [b.entry(i).key for i in (0, 2, 3, 4)] == ["a", "c", "d", "e"]
    assert np.array_equal(a.compact().token, b.compact().token) and a.compact().names() == b.compact().names()
    # An empty delta round-trips too.
    LiveCatalog(base).save_delta(tmp_path / "empty.safetensors")
    assert LiveCatalog(base).snapshot().sequences() == LiveCatalog.open(trie_path, tmp_path / "empty.safetensors"
                                                                        ).snapshot().sequences()
    other = TokenTrie.from_sequences([[3, 4], [3, 5], [6], [1]], vocab_size=10, keys=["a", "b", "c", "x"],
                                     names=["A", "B", "C", "X"])
    with pytest.raises(TrieFileError, match="written for another base trie"):
        LiveCatalog(other).load_delta(delta_path)
    with pytest.raises(TrieFileError, match="not a live catalog delta"):
        catalog.load_delta(trie_path)
    with pytest.raises(TrieFileError, match="is a live catalog.s delta file"):
        TokenTrie.load(delta_path)  # a delta is not a trie
    damaged = tmp_path / "damaged.safetensors"
    data = bytearray(open(delta_path, "rb").read())
    data[-3] ^= 0xFF
    damaged.write_bytes(bytes(data))
    with pytest.raises(TrieFileError):
        catalog.load_delta(damaged)
    assert catalog.snapshot().sequences() == a.sequences()  # a refused delta changes nothing


def test_strings_with_a_tokenizer(tokenizer):
    base = TokenTrie.from_strings(["Paris", "Berlin"], tokenizer, keys=["p", "b"])
    catalog = LiveCatalog(base)
    assert catalog.add(["Madrid", "Paris"], tokenizer=tokenizer, keys=["m", "p"]) == 1
    snap = catalog.snapshot()
    assert sorted(snap.compact().names()) == ["Berlin", "Madrid", "Paris"]
    madrid = TokenTrie.from_strings(["Madrid"], tokenizer).sequences()[0]
    assert snap.lookup(madrid).name == "Madrid"
    with pytest.raises(CatalogUpdateError, match="named by them"):
        catalog.add(["Rome"], tokenizer=tokenizer, keys=["r"], names=["Rome"])
    other = TokenTrie.from_sequences([[1]], vocab_size=10, fingerprint="not-this-one", keys=["x"])
    with pytest.raises(TokenizerMismatchError):
        LiveCatalog(other).add(["Rome"], tokenizer=tokenizer, keys=["r"])


def test_generate_keeps_the_view_it_started_with(tiny_llama, tokenizer):
    """A request that starts before a change decodes its view to the end; the next one sees the removals at once and
    the additions once compacted; greedy decoding of a compacted catalog steps in one C call (the fused step)."""
    from transformers import LogitsProcessor

    from trie_decode.integrations.transformers import TrieLogitsProcessor, rank

    words = ["apple pie", "banana split", "cherry tart", "date loaf"]
    base = TokenTrie.from_strings(words, tokenizer, keys=words)
    catalog = LiveCatalog(base)
    new_entry = "elderberry wine"

    class ChangeMidway(LogitsProcessor):
        """Replaces the whole catalog by one new entry at the second step of the generation."""

        def __init__(self) -> None:
            self.calls = 0

        def __call__(self, input_ids, scores):
            self.calls += 1
            if self.calls == 2:
                catalog.add([new_entry], tokenizer=tokenizer, keys=[new_entry])
                catalog.remove(words)
            return scores

    processor = TrieLogitsProcessor(catalog, tokenizer)
    inputs = tokenizer(["List a dessert:", "Another one:"], return_tensors="pt", padding=True)
    gen = dict(max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    out = tiny_llama.generate(**inputs, logits_processor=[ChangeMidway(), processor], **gen)
    assert processor._fused is not None  # an unchanged catalog: the base, no filter, one C call per step
    assert catalog.snapshot().sequences() == [tuple(TokenTrie.from_strings([new_entry], tokenizer).sequences()[0])]
    first = processor.match(out)
    assert all(e is not None and e.key in words for e in first), first  # the old view, to the end
    assert catalog.wait_compacted()
    out = tiny_llama.generate(**inputs, logits_processor=[processor], **gen)
    assert [e.key for e in processor.match(out)] == [new_entry, new_entry]
    assert processor._fused is not None  # a compacted catalog with nothing removed since: one C call per step too
    # Removals after the compaction are denied at once; additions wait for the next compaction.
    catalog.add(words[:2], tokenizer=tokenizer, keys=words[:2])
    out = tiny_llama.generate(**inputs, logits_processor=[processor], **gen)
    assert [e.key for e in processor.match(out)] == [new_entry, new_entry]
    assert catalog.wait_compacted()
    catalog.remove([words[0]])
    beams = tiny_llama.generate(**inputs, logits_processor=[processor], num_beams=4, num_return_sequences=3, **gen)
    assert {e.key for e in processor.match(beams)} <= {new_entry, words[1]}
    assert processor._fused is not None and processor._fused.filters is not None  # the removal's deny filter, in the one call
    ranked = rank(tiny_llama, inputs, catalog, k=3, tokenizer=tokenizer, pad_token_id=tokenizer.pad_token_id)
    assert [sorted(r.entry.key for r in row) for row in ranked] == [sorted([new_entry, words[1]])] * 2
    # A distinct list over the changed catalog.
    torch.manual_seed(0)
    lists = TrieLogitsProcessor(catalog, tokenizer, on_complete="repeat", separator=",", distinct=True)
    out = tiny_llama.generate(**inputs, logits_processor=[lists], max_new_tokens=30, do_sample=True,
                              pad_token_id=tokenizer.pad_token_id)
    for row in lists.match_all(out):
        keys = [e.key for e in row]
        assert len(keys) == len(set(keys)) and set(keys) <= {new_entry, words[1]}, keys


def test_a_server_reads_a_delta_file_beside_the_trie_file(tmp_path):
    """What a server's trie cache uses: the trie it decodes for a trie file and its delta (base plus changes,
    compacted), from the delta file's path or from a descriptor the server opened."""
    base = TokenTrie.from_sequences([[3, 4], [3, 5], [6]], vocab_size=10, keys=["a", "b", "c"])
    trie_path = tmp_path / "catalog.safetensors"
    base.save(trie_path)
    catalog = LiveCatalog.open(trie_path)
    catalog.add([[7]], keys=["d"])
    catalog.save_delta(delta_path_for(trie_path))
    served = apply_delta_file(TokenTrie.load(trie_path), delta_path_for(trie_path))
    assert sorted(served.sequences()) == [(3, 4), (3, 5), (6,), (7,)]
    catalog.remove(["a", "d"])
    catalog.save_delta(delta_path_for(trie_path))
    with open(delta_path_for(trie_path), "rb") as handle:
        served = apply_delta_file(TokenTrie.load(trie_path), handle)
    assert sorted(served.sequences()) == [(3, 5), (6,)] and served.lookup([3, 5]).key == "b"
    LiveCatalog(base).save_delta(delta_path_for(trie_path))  # an empty delta: the base itself
    loaded = TokenTrie.load(trie_path)
    assert apply_delta_file(loaded, delta_path_for(trie_path)) is loaded
    other = TokenTrie.from_sequences([[1]], vocab_size=10, keys=["x"])
    with pytest.raises(TrieFileError, match="another base trie"):
        apply_delta_file(other, delta_path_for(trie_path))
    with open(trie_path, "rb") as handle, pytest.raises(TrieFileError, match="catalog.safetensors is not a live"):
        apply_delta_file(loaded, handle)


def test_filters_name_a_catalogs_items_over_a_view():
    from trie_decode.catalogs import catalog_from_codes

    codes = np.array([[3, 1], [3, 2], [3, 1], [0, 5]])  # items a and c share one semantic id
    base = catalog_from_codes(codes, codebook_size=8, token_offset=100, vocab_size=200, keys=["a", "b", "c", "d"])
    catalog = LiveCatalog(base)
    catalog.add([[103, 111]], keys=["e"])
    assert catalog.wait_compacted()  # keys resolve over the snapshot (the compacted trie keeps the item lists too)
    view = catalog.snapshot().view()
    c = view.constraint(SpanRules(END), "cpu")
    state = c.advance(c.start(1), torch.tensor([103]))
    assert c.allowed_tokens(state) == [[109, 110, 111]]
    f = view.filters(c, 1, deny=["c", "e"])  # c: the id it shares with a
    assert c.mask_(torch.zeros(1, 200), state, filters=f).isfinite().nonzero()[:, 1].tolist() == [110]
    assert isinstance(view, CatalogView) and constraint_for(catalog, SpanRules(END), "cpu") is c


def test_adding_strings_without_a_tokenizer_points_to_add_s_tokenizer_argument():
    catalog = LiveCatalog(TokenTrie.from_sequences([[1]], vocab_size=10, keys=["a"]))
    with pytest.raises(CatalogUpdateError, match=r"pass tokenizer=") as info:
        catalog.add(["Chile"], keys=["CL"])
    assert "from_strings" not in str(info.value)
    with pytest.raises(CatalogUpdateError, match=r"pass tokenizer="):
        catalog.add("Chile", keys=["CL"])


def test_removing_strings_as_sequences_points_to_removal_by_key():
    # remove(sequences=["Chile"]) said "build from strings with TokenTrie.from_strings" (InvalidEntryError): the
    # builders' hint, for a call that removes entries by key instead.
    catalog = LiveCatalog(TokenTrie.from_sequences([[1]], vocab_size=10, keys=["Chile"]))
    for sequences in (["Chile"], "Chile", (s for s in ["Chile"])):
        with pytest.raises(CatalogUpdateError, match=r"remove entries by key, remove\(\[\.\.\.\]\)") as info:
            catalog.remove(sequences=sequences)
        assert "from_strings" not in str(info.value)
    assert catalog.version == 0 and catalog.remove(["Chile"]) == 1


# ------------------------------------------------------------------ removed entries' keys, items, pinned snapshots
def _keys_of(view: CatalogView, spec, what: str = "deny") -> list:
    """The keys of the entries a filter spec names that the view serves (not denied as removed)."""
    return sorted(view.trie.entry(int(i)).key for i in np.setdiff1d(view.entry_indices(spec, what), view.deny))


def test_a_filter_that_names_a_removed_entry_keeps_working(tmp_path):
    """A "seen items" deny list keeps working when an item is withdrawn, whether it was a base entry or an added
    one, before and after a compaction, through a delta file and after a rebase; a key the catalog never held is
    still an error."""
    base = TokenTrie.from_sequences([[3, 4], [3, 5], [6]], vocab_size=10, keys=["a", "b", "c"])
    catalog = LiveCatalog(base)
    catalog.add([[7], [8]], keys=["n", "m"])
    assert catalog.wait_compacted()
    rules = SpanRules(END)
    view = catalog.snapshot().view(rules)
    c = view.constraint(rules, "cpu")
    assert _keys_of(view, ["n"]) == ["n"]
    catalog.remove(["n", "a"])  # an added entry and a base entry, removed after the compaction
    for compacted in (False, True):
        if compacted:
            catalog.add([[9]], keys=["o"])
            assert catalog.wait_compacted()  # a new compacted trie, without n and a
        view = catalog.snapshot().view(rules)
        c = view.constraint(rules, "cpu")
        f = view.filters(c, 1, deny=["n", "a", "b"])
        assert c.mask_(torch.zeros(1, 10), c.start(1), filters=f).isfinite().nonzero()[:, 1].tolist() == (
            [6, 8, 9] if compacted else [6, 8])
        assert _keys_of(view, ["n", "a", "b"]) == ["b"]
        assert _keys_of(view, ["n", "c"], "allow") == ["c"]
        with pytest.raises(ConstraintConfigError, match=r"^allow leaves no entry \(after deny\): nothing"):
            view.filters(c, 1, allow=["n"])
        with pytest.raises(ConstraintConfigError, match="not entries of the catalog and never were"):
            view.filters(c, 1, deny=["n", "zzz"])
    assert catalog.snapshot().retired == {"n"}
    with pytest.raises(CatalogUpdateError, match="not in the catalog"):
        catalog.remove(["n"])  # known to filters, not held
    catalog.add([[7]], keys=["n"])  # added again: held, no longer retired
    assert catalog.snapshot().retired == frozenset() and _keys_of(catalog.snapshot().view(rules), ["n"]) == []
    catalog.remove(["n"])
    # A delta file keeps the retired keys; a rebase keeps every removed key in the new base.
    again = LiveCatalog(base)
    catalog.save_delta(tmp_path / "delta.safetensors")
    again.load_delta(tmp_path / "delta.safetensors")
    assert again.snapshot().retired == {"n"} and _keys_of(again.snapshot().view(rules), ["n", "a"]) == []
    new_base = catalog.rebase()
    assert sorted(new_base.sequences()) == [(3, 5), (6,), (8,), (9,)]
    view = catalog.snapshot().view(rules)
    assert _keys_of(view, ["n", "a", "m"]) == ["m"]
    catalog.remove(["m"])
    assert _keys_of(catalog.snapshot().view(rules), ["n", "a", "m"]) == []
    with pytest.raises(ConstraintConfigError, match="never were"):
        catalog.snapshot().view(rules).entry_indices(["zzz"], "deny")
    from trie_decode.filters import entry_indices

    assert entry_indices(new_base, ["n", "a", "b"], "deny").tolist() == [new_base.lookup([3, 5]).index]
    with pytest.raises(ConstraintConfigError, match="not entries of the trie"):
        entry_indices(new_base, ["zzz"], "deny")


def test_a_names_only_catalog_keeps_removed_names_too():
    catalog = LiveCatalog(TokenTrie.from_sequences([[3], [4]], vocab_size=8, names=["x", "y"]))
    catalog.add([[5]], names=["z"])
    catalog.remove(["z", "x"])
    view = catalog.snapshot().view(SpanRules(END))
    assert _keys_of(view, ["z", "x"]) == [] and view.entry_indices(["z"], "deny").tolist() == []
    assert catalog.compact().extra["retired_keys_blob"].tobytes() == b"xz"


def test_compaction_keeps_a_catalogs_items(tmp_path):
    """A live catalog over catalog_from_codes keeps every entry's item keys through compactions and rebases: rank,
    match and lookup results list them, filters name any item's key (a removed item's names nothing), items keep
    their rows, and the compacted trie saves and loads."""
    from trie_decode.catalogs import catalog_from_codes, item_entries, items_of

    codes = np.array([[3, 1], [3, 2], [3, 1], [0, 5]])  # items s0 and s2 share one semantic id
    base = catalog_from_codes(codes, codebook_size=8, token_offset=100, vocab_size=200, keys=["s0", "s1", "s2", "s3"])
    catalog = LiveCatalog(base)
    catalog.add([[103, 111]], keys=["new"])
    catalog.remove(["s1"])
    snap = catalog.snapshot()
    assert snap.entry(3).item_keys == ("new",) and snap.lookup([103, 109]).item_keys == ("s0", "s2")
    assert catalog.wait_compacted()
    view = catalog.snapshot().view(SpanRules(END))
    assert {e.key: e.item_keys for e in map(view.trie.entry, range(view.trie.num_entries))} == {
        "s0": ("s0", "s2"), "s3": ("s3",), "new": ("new",)}
    assert _keys_of(view, ["s2", "s1"]) == ["s0"]
    new_base = catalog.rebase()
    assert [new_base.entry(i).item_keys for i in range(new_base.num_entries)] == [("s0", "s2"), ("s3",), ("new",)]
    assert items_of(new_base, 0).tolist() == [0, 2] and items_of(new_base, 2).tolist() == [4]  # rows kept
    assert item_entries(new_base).tolist() == [0, -1, 0, 1, 2]  # s1 is held by no entry
    assert catalog.remove(["s2"]) == 1  # an item key names its entry after a rebase too
    assert _keys_of(catalog.snapshot().view(SpanRules(END)), ["s0", "s1", "s3"]) == ["s3"]
    with pytest.raises(ConstraintConfigError, match="never were"):
        catalog.snapshot().view(SpanRules(END)).entry_indices(["s9"], "deny")
    new_base.save(tmp_path / "rebased.safetensors")
    loaded = TokenTrie.load(tmp_path / "rebased.safetensors")  # validated: items and retired keys
    assert loaded.entry(0).item_keys == ("s0", "s2") and loaded.extra.keys() == new_base.extra.keys()


def test_a_pinned_snapshot_keeps_the_entries_it_could_generate():
    """A snapshot is immutable: later compactions (the catalog keeps the newest two) never take away an added entry
    it decoded, and one that was never decoded before its compaction was dropped gets its own."""
    base = TokenTrie.from_sequences([[3, 4], [5]], vocab_size=10, keys=["a", "b"])
    rules = SpanRules(END)
    catalog = LiveCatalog(base)
    catalog.add([[6]], keys=["x"])
    assert catalog.wait_compacted()
    pinned = catalog.snapshot()
    assert pinned.view(rules).pending == 0
    catalog.add([[7]], keys=["y"])
    unseen = catalog.snapshot()  # never viewed, never compacted: the catalog changed again first
    for key in ("z", "w"):
        catalog.add([[8 if key == "z" else 9]], keys=[key])
        assert catalog.wait_compacted()
    assert min(r.version for r in catalog._compactor.records) > unseen.version
    view = pinned.view(rules)
    assert view.pending == 0 and sorted(view.trie.sequences()) == [(3, 4), (5,), (6,)]
    c = view.constraint(rules, "cpu")
    assert c.allowed_tokens(c.start(1)) == [[3, 5, 6]]
    assert unseen.view(rules).pending == 2  # the base until its compaction, built for it in the background
    catalog._compactor.wait(None)
    view = unseen.view(rules)
    assert view.pending == 0 and sorted(view.trie.sequences()) == [(3, 4), (5,), (6,), (7,)]
    assert sorted(catalog.snapshot().view(rules).trie.sequences()) == [(3, 4), (5,), (6,), (7,), (8,), (9,)]


def test_an_added_entry_added_back_under_another_key_is_not_served_under_the_old_one():
    """An added entry removed, then added back with another key, is another entry: the compacted trie's copy (the
    old key) is denied and the new one waits for the next compaction, so no request reports the old key."""
    catalog = LiveCatalog(TokenTrie.from_sequences([[3, 4], [6]], vocab_size=8, keys=["a", "c"]))
    catalog.add([[7]], keys=["e"])
    assert catalog.wait_compacted()
    catalog.remove(["e"])
    catalog.add([[7]], keys=["e2"])
    rules = SpanRules(END)
    view = catalog.snapshot().view(rules)
    assert view.pending == 1 and [view.trie.entry(int(e)).key for e in view.deny] == ["e"]
    assert catalog.wait_compacted()
    c = constraint_for(catalog, rules, "cpu")
    assert [e.key for e in c.replay([[7, END]])[0]] == ["e2"] == [catalog.snapshot().lookup([7]).key]


def test_adding_strings_to_a_base_without_names(tokenizer):
    """Strings name themselves only where the base has names: a base with keys and no names takes strings with
    keys; a call with two column problems hears of both."""
    ids = [tokenizer.encode(w, add_special_tokens=False) for w in (" Paris", " Rome")]
    fingerprint = TokenTrie.from_strings(["x"], tokenizer).fingerprint
    base = TokenTrie.from_sequences(ids, vocab_size=len(tokenizer), keys=["fr", "it"], fingerprint=fingerprint)
    catalog = LiveCatalog(base)
    assert catalog.add([" Lisbon"], tokenizer=tokenizer, keys=["pt"]) == 1
    lisbon = tuple(tokenizer.encode(" Lisbon", add_special_tokens=False))
    found = catalog.snapshot().lookup(lisbon)
    assert found.key == "pt" and found.name is None and catalog.compact().names() is None
    named = LiveCatalog(TokenTrie.from_strings(["Paris"], tokenizer))
    with pytest.raises(CatalogUpdateError, match=r"pass names=.*leave keys= out"):
        named.add([[5]], keys=["k"])  # both problems of the call, at once


def test_remove_takes_a_list_and_says_so():
    """``remove`` takes a list: a single item (an index, a key, anything else) gets a named error showing the list."""
    catalog = LiveCatalog(TokenTrie.from_sequences([[3], [4]], vocab_size=8, keys=["fr", "it"]))
    for single, shown in ((0, r"single integer 0: pass \[0\]"), (np.int64(1), "single integer"),
                          ("fr", r"single string 'fr': pass \['fr'\]"), (1.5, "single float")):
        with pytest.raises(CatalogUpdateError, match=shown):
            catalog.remove(single)
    # a 0-d array or tensor failed inside numpy or torch ("iteration over a 0-d array"), and an index held in a 0-d
    # tensor was refused as neither a key nor an index
    for single in (np.array(0), torch.tensor(0)):
        with pytest.raises(CatalogUpdateError, match="single integer"):
            catalog.remove(single)
    assert catalog.remove([torch.tensor(1)]) == 1
    assert catalog.remove([0]) == 1


def test_a_served_delta_means_what_the_snapshot_means(tmp_path):
    """The trie a server decodes for a trie file and its delta (apply_delta_file) resolves filters as the catalog's
    snapshot does: entry numbers are the snapshot's (base indices, then the added entries), removed keys are
    accepted and name nothing, a catalog's items keep their keys; the numbering saves, loads and is validated."""
    from trie_decode.filters import entry_indices

    base = TokenTrie.from_sequences([[3, 4], [3, 5], [6], [7]], vocab_size=12, keys=["r", "g", "b", "y"])
    trie_path = tmp_path / "colors.safetensors"
    base.save(trie_path)
    catalog = LiveCatalog.open(trie_path)
    catalog.add([[8], [9]], keys=["az", "t"])
    catalog.remove(["r", "t"])
    catalog.save_delta(delta_path_for(trie_path))
    served = apply_delta_file(TokenTrie.load(trie_path), delta_path_for(trie_path))
    live = LiveCatalog.open(trie_path, delta_path_for(trie_path))
    assert live.wait_compacted()
    view = live.snapshot().view(SpanRules(END))

    def keys(trie, idx):
        return sorted(trie.entry(int(i)).key for i in idx)

    for spec in ([1], [0, 1], [4], (1, 4), ["r"], ["g", "r"], ["t", "b"], ["g", 2]):
        assert keys(served, entry_indices(served, spec, "allow")) == keys(view.trie, view.entry_indices(spec, "allow"))
    assert keys(served, entry_indices(served, [1, 4], "allow")) == ["az", "g"]
    resolved = entry_indices(served, [1, 4], "allow")
    assert entry_indices(served, resolved, "allow") is resolved  # resolved indices pass on as they are
    with pytest.raises(ConstraintConfigError, match="entry number 5 is outside the catalog's 5 entry numbers"):
        entry_indices(served, [5], "allow")
    with pytest.raises(ConstraintConfigError, match="not entries of the trie"):
        entry_indices(served, ["zzz"], "deny")
    path = tmp_path / "served.safetensors"
    served.save(path)
    assert keys(served, entry_indices(TokenTrie.load(path), [1, 4], "allow")) == ["az", "g"]
    served.extra["filter_number_entry"] = np.array([0, 0, 1, 2, -1], dtype=np.int64)
    served.save(path)
    with pytest.raises(TrieFileError, match="number every entry exactly once"):
        TokenTrie.load(path)
    # Nothing removed: the numbers are the compacted trie's own; only removed added keys: the base's arrays.
    catalog = LiveCatalog.open(trie_path)
    catalog.add([[10]], keys=["t"])
    catalog.remove(["t"])
    catalog.save_delta(delta_path_for(trie_path))
    served = apply_delta_file(TokenTrie.load(trie_path), delta_path_for(trie_path))
    assert "filter_number_entry" not in served.extra and served.num_entries == 4
    assert entry_indices(served, ["t", "g"], "deny").tolist() == [1]


def test_match_reads_a_live_catalog_as_its_snapshot_holds_it():
    """match() on a catalog reads the entries it holds now: not a removed entry that its view's trie still holds
    (a shorter live entry the tokens pass through is what a trie of the entries gives), not an added entry under
    the key it had before it was removed and added back, and a pending addition; numbers are the snapshot's."""
    from trie_decode.integrations.transformers import match

    catalog = LiveCatalog(TokenTrie.from_sequences([[3], [3, 4], [5, 6]], vocab_size=8, keys=["a", "x", "b"]))
    catalog.add([[7]], keys=["n"])
    assert catalog.wait_compacted()
    catalog.remove(["x", "n"])
    rows = [[3, 4, END], [7, END]]
    assert match(catalog, rows, end_token_id=END) == [catalog.snapshot().lookup([3]), None]
    catalog.add([[7], [2]], keys=["n2", "p"])
    found = match(catalog.snapshot(), rows + [[2, END]], end_token_id=END)
    assert [(e.index, e.key) for e in found] == [(0, "a"), (3, "n2"), (4, "p")]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**20))
def test_match_on_a_catalog_equals_match_on_a_trie_of_its_entries(seed):
    """Random changes, compactions or not: match() on the catalog finds what it finds on a trie built from the
    entries the catalog holds, for rows that walk into removed, pending and live entries and off them."""
    from trie_decode.integrations.transformers import match

    rng = random.Random(seed)
    catalog, base, live, _ = random_catalog(rng)
    if not live:
        return
    entries = sorted(live)
    reference = TokenTrie.from_sequences([list(s) for s in entries], vocab_size=V, keys=[key(s) for s in entries])
    walks = [list(s) for s in base.sequences() + entries] + [[rng.randrange(2, V) for _ in range(3)] for _ in range(4)]
    rows = [w[: rng.randrange(1, len(w) + 1)] + rng.choice([[END], [], [rng.randrange(V), END]]) for w in walks]
    found = [(e.tokens, e.key) if e is not None else None for e in match(catalog, rows, end_token_id=END)]
    assert found == [(e.tokens, e.key) if e is not None else None for e in match(reference, rows, end_token_id=END)]


def test_a_processors_match_reports_the_snapshots_entries():
    """Added, compacted, then removed: the processor's match reads its view (the compacted trie, the removal
    denied) and reports the snapshot's entries: the removed one is no match, the others keep their numbers."""
    from trie_decode.integrations.transformers import TrieLogitsProcessor

    catalog = LiveCatalog(TokenTrie.from_sequences([[3, 4], [5], [6]], vocab_size=8, keys=["a", "b", "c"]))
    catalog.remove(["b"])
    catalog.add([[7]], keys=["d"])
    assert catalog.wait_compacted()
    catalog.remove(["a"])
    processor = TrieLogitsProcessor(catalog, None, end_token_id=END)
    found = processor.match(torch.tensor([[2, 3, 4, END], [2, 7, END, END], [2, 6, END, END]]), prompt_length=1)
    snap = catalog.snapshot()
    assert found == [None, snap.entry(3), snap.entry(2)] and found[1].key == "d"


def test_a_delta_file_names_its_bases_item_lists(tmp_path):
    """Two catalogs of one trie whose item ``m`` moved to another entry: a delta written for one (``m`` removed,
    with the entry holding it) is refused on the other, where it would remove ``a`` and keep serving ``m``. A
    version 1 file (its identity leaves the extra arrays out) is read for a base without any, refused otherwise."""
    from trie_decode.catalogs import catalog_from_codes
    from trie_decode.fileio import read_arrays, write_arrays

    before = catalog_from_codes(np.array([[0, 0], [0, 0], [1, 0]]), vocab_size=8, codebook_size=2, keys=["a", "m", "b"])
    after = catalog_from_codes(np.array([[0, 0], [1, 0], [1, 0]]), vocab_size=8, codebook_size=2, keys=["a", "b", "m"])
    catalog = LiveCatalog(before)
    catalog.remove(["m"])
    path = tmp_path / "delta.safetensors"
    catalog.save_delta(path)
    with pytest.raises(TrieFileError, match="written for another base trie"):
        apply_delta_file(after, path)

    def as_version_1(catalog: LiveCatalog) -> str:
        catalog.save_delta(path)
        arrays, meta = read_arrays(path)
        write_arrays(path, arrays, {**meta, "delta_version": "1"})
        return path

    with pytest.raises(TrieFileError, match="version 1 delta file: its base identity leaves out the base's extra"):
        apply_delta_file(before, as_version_1(catalog))
    plain = LiveCatalog(TokenTrie.from_sequences([[3, 4], [6]], vocab_size=8, keys=["a", "c"]))
    plain.remove(["a"])
    assert apply_delta_file(plain.base, as_version_1(plain)).sequences() == [(6,)]


def test_added_names_and_keys_are_checked_as_the_builders_check_them():
    """add() wrote names and keys with str(): a key None became the key "None", a name 5 the name "5", a single
    string was split into one key per character, a set paired keys with sequences in its own order; a generator
    failed on len() (TypeError); and a lone surrogate was accepted, then failed every later snapshot (the catalog
    could no longer be read). Each is refused by name now, before anything changes."""
    from trie_decode.errors import InvalidEntryError

    keyed = LiveCatalog(TokenTrie.from_sequences([[3, 4], [6]], vocab_size=10, keys=["a", "c"]))
    named = LiveCatalog(TokenTrie.from_sequences([[3, 4], [6]], vocab_size=10, names=["A", "C"]))
    for catalog, kwargs, message in [
        (keyed, dict(keys=[None]), r"keys\[0\] is None"),
        (keyed, dict(keys=5), "not a list"),
        (named, dict(names=[None]), r"names\[0\] is NoneType None: a name is a string"),
        (named, dict(names=[5]), r"names\[0\] is int 5"),
        (keyed, dict(keys=["\ud800"]), "lone surrogate"),
        (named, dict(names=["\ud800"]), "lone surrogate"),
    ]:
        with pytest.raises(CatalogUpdateError, match=message) as info:
            catalog.add([[7]], **kwargs)
        assert isinstance(info.value, InvalidEntryError)  # the builders' class for the same problem
    with pytest.raises(CatalogUpdateError, match="single str 'xy'"):
        keyed.add([[7], [8]], keys="xy")
    with pytest.raises(CatalogUpdateError, match="no order of its own"):
        keyed.add([[7], [8]], keys={"x", "y"})
    for catalog in (keyed, named):  # nothing was applied, and the catalog is still readable
        assert catalog.version == 0 and catalog.snapshot().sequences() == [(3, 4), (6,)]
    assert keyed.add([[7], [8]], keys=iter(["x", 9])) == 2  # any iterable, read once; a number key is written
    assert [keyed.snapshot().lookup(s).key for s in ([7], [8])] == ["x", "9"]
    with pytest.raises(CatalogUpdateError, match="pass tokenizer="):  # a generator of strings is strings too
        keyed.add(s for s in ["Chile"])


def test_a_snapshot_entry_number_is_an_integer():
    """CatalogSnapshot.entry(1.5), entry(True) and entry("1") returned entry 1 (int() truncated or parsed them);
    TokenTrie.entry refuses them: so does a snapshot now, by name."""
    from trie_decode.errors import InvalidEntryError

    catalog = LiveCatalog(TokenTrie.from_sequences([[3, 4], [3, 5], [6]], vocab_size=8, keys=["a", "b", "c"]))
    catalog.add([[7]], keys=["d"])
    snap = catalog.snapshot()
    for bad in (1.5, True, "1"):
        with pytest.raises(InvalidEntryError, match="not an integer"):
            snap.entry(bad)
    assert snap.entry(np.int64(3)).key == "d" and snap.entry(torch.tensor(1)).key == "b"


def test_a_delta_file_is_not_applied_to_a_base_rebased_while_it_was_read(tmp_path, monkeypatch):
    """load_delta checked the file against the base it found at its start, then applied it to whatever base the
    catalog had by then: a rebase() from another thread in between (here, while the arrays are checked) renumbers the
    entries, and the delta's tombstones removed other entries than the ones it names, silently. It is refused now."""
    import trie_decode.live as live

    base = TokenTrie.from_sequences([[3, 4], [3, 5], [6]], vocab_size=8, keys=["a", "b", "c"])
    writer = LiveCatalog(base)
    writer.remove(["a"])
    delta = tmp_path / "d.safetensors"
    writer.save_delta(delta)
    catalog = LiveCatalog(base)
    catalog.remove(["a"])
    real = live.check_vectors

    def rebased_meanwhile(*args, **kwargs):
        catalog.rebase()  # the new base: [3, 5] is entry 0, [6] entry 1
        return real(*args, **kwargs)

    monkeypatch.setattr(live, "check_vectors", rebased_meanwhile)
    with pytest.raises(TrieFileError, match="rebased while the delta file was read"):
        catalog.load_delta(delta)
    assert sorted(catalog.snapshot().sequences()) == [(3, 5), (6,)]  # the rebased catalog, unchanged


@pytest.mark.parametrize("table", ["names", "retired"])
def test_a_delta_file_with_an_empty_offsets_array_is_refused_by_name(tmp_path, table):
    """A string table whose offsets array is empty (not even its end) failed with a bare ValueError from len() of
    the table (-1), not the TrieFileError of every other malformed delta file."""
    from trie_decode.fileio import read_arrays, write_arrays

    base = TokenTrie.from_sequences([[1], [2]], vocab_size=8, names=["a", "b"])
    catalog = LiveCatalog(base)
    catalog.add([[3]], names=["c"])
    catalog.remove(sequences=[[3]])  # its name is retired
    catalog.add([[4]], names=["d"])
    catalog.save_delta(tmp_path / "good.delta")
    arrays, meta = read_arrays(tmp_path / "good.delta")
    arrays = {name: np.array(a) for name, a in arrays.items()}
    arrays[f"{table}_offsets"] = np.zeros(0, np.int64)
    write_arrays(tmp_path / "bad.delta", arrays, {k: v for k, v in meta.items() if k not in ("format", "crc32")})
    fresh = LiveCatalog(base)
    with pytest.raises(TrieFileError, match=f"the {table} (key )?table does not match"):
        fresh.load_delta(tmp_path / "bad.delta")
    assert fresh.version == 0


def test_a_delta_file_of_a_trie_built_for_another_tokenizer_is_refused(tmp_path):
    # The base identity covers the trie's structure, numbering, names and keys, not the tokenizer: the same entries
    # built for another tokenizer took its delta file, whose token ids mean other text there.
    from trie_decode.live import LiveCatalog

    seqs, names = [[1, 2], [1, 3]], ["a", "b"]
    mine = LiveCatalog(TokenTrie.from_sequences(seqs, vocab_size=10, names=names, fingerprint="tok-A"))
    mine.add([[4, 5]], names=["c"])
    mine.save_delta(tmp_path / "d.delta")
    other = LiveCatalog(TokenTrie.from_sequences(seqs, vocab_size=10, names=names, fingerprint="tok-B"))
    with pytest.raises(TrieFileError, match="written for a trie of another tokenizer"):
        other.load_delta(tmp_path / "d.delta")
    for fingerprint in ("tok-A", ""):  # the same tokenizer, or one not recorded: taken
        same = LiveCatalog(TokenTrie.from_sequences(seqs, vocab_size=10, names=names, fingerprint=fingerprint))
        same.load_delta(tmp_path / "d.delta")
        assert same.num_added == 1
