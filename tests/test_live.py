"""Live catalogs: a snapshot (base minus tombstones, plus a delta) decodes exactly like the one trie compact() builds.

Checked step by step against :class:`TrieConstraint` over ``compact()`` and the brute-force reference, in every
``on_complete`` mode, with triggers, on every kernel, after random adds and removes; with per-request filters and
distinct lists; on the torch path with no host read; inside a real ``generate`` (a request keeps the snapshot it
started with, the next one sees the change); and through delta files.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trie_decode import CatalogUpdateError, ConstraintConfigError, EmptyTrieError, TokenTrie, TrieFileError
from trie_decode.constraint import DONE, SpanRules, TrieConstraint
from trie_decode.errors import InvalidTokenError, TokenizerMismatchError
from trie_decode.live import CatalogSnapshot, LiveCatalog, SnapshotConstraint, constraint_for, delta_path_for

from reference import SPAN_RULE_CASES, SpanReference
from test_device_step import no_host_sync

V = 24
END = 1
MODES = SPAN_RULE_CASES


def key(seq) -> str:
    return "k" + "-".join(map(str, seq))


def random_catalog(rng: random.Random, low: int = 2, max_len: int = 4) -> tuple[LiveCatalog, TokenTrie, set]:
    """A base trie with keys, then random adds (some reviving removed base entries) and removes (by key, by base
    index, by tokens). Returns the catalog, its base and the set of live sequences it must hold."""
    # A small alphabet often makes entries prefixes of one another (removed entry ends inside live paths).
    high = rng.choice([low + 3, low + 6, V])

    def fresh() -> tuple[int, ...]:
        return tuple(rng.randrange(low, high) for _ in range(rng.randrange(1, max_len + 1)))

    seqs = [fresh() for _ in range(rng.randrange(1, 12))]
    base = TokenTrie.from_sequences([list(s) for s in seqs], vocab_size=V, keys=[key(s) for s in seqs])
    catalog = LiveCatalog(base)
    live = set(seqs)
    for _ in range(rng.randrange(0, 14)):
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
    return catalog, base, live


def _junk(rng: random.Random, rules: SpanRules) -> int:
    """A token the mask did not allow, most often one with a meaning (separator, end, trigger), as beam search's
    discarded rows may take."""
    special = [rules.end_token_id, *rules.separator, *rules.trigger]
    return rng.choice(special) if rng.random() < 0.6 else rng.randrange(V)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**20), mode=st.sampled_from(MODES), kernel=st.sampled_from(["native", "numpy", "torch"]),
       dense=st.booleans())
def test_snapshot_decodes_like_its_compacted_trie(seed, mode, kernel, dense):
    rng = random.Random(seed)
    catalog, base, live = random_catalog(rng)
    snap = catalog.snapshot()
    assert sorted(snap.sequences()) == sorted(live)
    rules = SpanRules(end_token_id=END, **mode)
    if not live:
        with pytest.raises(EmptyTrieError):
            SnapshotConstraint(snap, rules, "cpu")
        with pytest.raises(EmptyTrieError):
            snap.compact()
        return
    compact = snap.compact()
    assert sorted(compact.sequences()) == sorted(live)
    assert {compact.entry(i).key for i in range(compact.num_entries)} == {key(s) for s in live}
    fanout = dict(dense_min_fanout=2 if dense else None)
    cs = SnapshotConstraint(snap, rules, "cpu", kernel=kernel, **fanout)
    cc = TrieConstraint(compact, rules, "cpu", kernel=kernel, **fanout)
    assert cs.kernel.name == kernel
    rows = 6
    tails = torch.tensor([[rng.randrange(2, V) for _ in range(3)] for _ in range(rows)])
    if rules.trigger:
        tails[0, -len(rules.trigger):] = torch.tensor(rules.trigger)
    s_snap, s_comp = cs.start(rows, None, tails), cc.start(rows, None, tails)
    refs = [SpanReference(live, rules, tuple(tails[i].tolist())) for i in range(rows)]
    history = tails.clone()
    width = V + 3  # logits wider than the vocabulary
    for _ in range(12):
        logits = torch.randn(rows, width)
        masked = cs.mask_(logits.clone(), s_snap)
        assert torch.equal(masked, cc.mask_(logits.clone(), s_comp))
        expected = [r.allowed() for r in refs]
        assert cs.allowed_tokens(s_snap, width) == [None if a is None else sorted(a) for a in expected]
        toks = []
        for r, allowed in zip(refs, expected):
            pool = sorted(allowed) if allowed is not None else list(range(2, V))
            if allowed is None and rules.trigger and rng.random() < 0.5:
                pool = list(rules.trigger)
            tok = rng.choice(pool) if rng.random() < 0.8 else _junk(rng, rules)
            toks.append(tok)
            r.step(tok)
        history = torch.cat([history, torch.tensor(toks)[:, None]], dim=1)
        s_snap = cs.advance(s_snap, torch.tensor(toks), history)
        s_comp = cc.advance(s_comp, torch.tensor(toks), history)
    generated = history[:, tails.shape[1]:].tolist()
    cut = [g[: rng.randrange(len(g) + 1)] for g in generated]
    for rows_tokens in (generated, cut):
        got = cs.replay(rows_tokens, None, tails.tolist())
        want = cc.replay(rows_tokens, None, tails.tolist())
        assert [[(e.tokens, e.key) for e in row] for row in got] == [[(e.tokens, e.key) for e in row] for row in want]
        for row in got:  # snapshot entry numbers lead back to the entries
            for e in row:
                assert snap.entry(e.index) == e


@pytest.mark.parametrize("kernel", ["native", "numpy", "torch"])
@pytest.mark.parametrize("seed", range(8))
def test_filters_over_a_snapshot_match_the_compacted_trie(kernel, seed):
    rng = random.Random(seed)
    catalog, base, live = random_catalog(rng, low=3, max_len=3)
    if len(live) < 2:
        catalog.add([[20, 21], [22]], keys=[key((20, 21)), key((22,))])
        live |= {(20, 21), (22,)}
    snap = catalog.snapshot()
    compact = snap.compact()
    repeat = seed % 2 == 1
    rules = SpanRules(end_token_id=END, on_complete="repeat", separator=(2,)) if repeat else SpanRules(END)
    cs = SnapshotConstraint(snap, rules, "cpu", kernel=kernel)
    cc = TrieConstraint(compact, rules, "cpu", kernel=kernel)
    entries = sorted(live)
    rows = 5
    allow = [None if i == 0 else [key(s) for s in rng.sample(entries, rng.randrange(1, len(entries) + 1))]
             for i in range(rows)]
    deny = [[key(s) for s in rng.sample(entries, rng.randrange(0, len(entries) // 2 + 1))] for _ in range(rows)]
    usable = [(set(a) if a is not None else {key(s) for s in entries}) - set(d) for a, d in zip(allow, deny)]
    keep = [i for i in range(rows) if usable[i]]
    allow, deny = [allow[i] for i in keep], [deny[i] for i in keep]
    fs = cs.filters(len(keep), allow, deny)
    fc = cc.filters(len(keep), allow, deny)
    s_snap, s_comp = cs.start(len(keep)), cc.start(len(keep))
    for _ in range(14):
        logits = torch.randn(len(keep), V)
        masked = cs.mask_(logits.clone(), s_snap, filters=fs)
        assert torch.equal(masked, cc.mask_(logits.clone(), s_comp, filters=fc))
        toks = torch.tensor([rng.choice(row.isfinite().nonzero().flatten().tolist()) if rng.random() < 0.9
                             else _junk(rng, rules) for row in masked])
        beams = torch.tensor([rng.randrange(len(keep)) for _ in range(len(keep))])  # beam search reorders rows
        fs, fc = fs.select(beams), fc.select(beams)
        s_snap = cs.advance(s_snap.select(beams), toks, filters=fs)
        s_comp = cc.advance(s_comp.select(beams), toks, filters=fc)


@pytest.mark.parametrize("mode", MODES[:4], ids=lambda m: "-".join(str(v) for v in m.values()))
def test_snapshot_step_never_reads_the_device(mode):
    rng = random.Random(3)
    base = TokenTrie.from_sequences([[rng.randrange(3, V) for _ in range(rng.randrange(1, 4))] for _ in range(40)]
                                    + [[8], [8, 9]], vocab_size=V, keys=[str(i) for i in range(42)])
    catalog = LiveCatalog(base)
    catalog.remove(list(range(0, base.num_entries - 2, 3)), sequences=[[8]])
    catalog.add([[10, 11, 12], [8, 13], [14]], keys=["x", "y", "z"])
    rules = SpanRules(end_token_id=END, **mode)
    c = SnapshotConstraint(catalog.snapshot(), rules, "cpu", dense_min_fanout=4, kernel="torch")
    rows = 7
    filters = None if mode["on_complete"] == "release" else c.filters(rows, deny=["y", base.entry(1).key])
    tails = torch.randint(2, V, (rows, 2))
    state = c.start(rows, None, tails)  # setup may read the device; the step may not
    for _ in range(6):
        tokens = torch.randint(0, V, (rows,))
        with no_host_sync():
            c.mask_(torch.randn(rows, V + 3), state)
            c.mask_(torch.randn(rows, V + 3), state, inplace=False, filters=filters)
            c.mask_(torch.randn(rows + 2, V + 3), state, torch.arange(rows) + 1)  # a row mapping (vLLM)
            tails = torch.cat([tails[:, 1:], tokens.unsqueeze(1)], dim=1)
            state = c.advance(state, tokens, tails, filters=filters)
            state = state.select(torch.arange(rows).flip(0))


def test_a_plain_snapshot_is_the_base_constraint():
    base = TokenTrie.from_sequences([[3, 4], [5]], vocab_size=8)
    catalog = LiveCatalog(base)
    rules = SpanRules(END)
    assert isinstance(catalog.snapshot().constraint(rules, "cpu"), TrieConstraint)
    catalog.add([[6]])
    c = catalog.snapshot().constraint(rules, "cpu")
    assert isinstance(c, SnapshotConstraint)
    assert c.base is catalog.snapshot().constraint(rules, "cpu").base  # the base's constraint is built once
    catalog.remove(sequences=[[6]])
    assert catalog.snapshot().plain and isinstance(constraint_for(catalog, rules, "cpu"), TrieConstraint)


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
    assert not after.tombstones.flags.writeable
    new_base = catalog.rebase()
    assert sorted(new_base.sequences()) == [(5,), (6, 7)] and catalog.base is new_base and catalog.snapshot().plain
    assert sorted(after.sequences()) == [(5,), (6, 7)]  # still readable by requests that hold it


def test_filters_errors_over_a_snapshot():
    catalog = LiveCatalog(TokenTrie.from_sequences([[3, 4], [5]], vocab_size=8, keys=["a", "b"]))
    catalog.add([[6]], keys=["c"])
    catalog.remove(["a"])
    c = SnapshotConstraint(catalog.snapshot(), SpanRules(END), "cpu")
    with pytest.raises(ConstraintConfigError, match="not entries of the catalog"):
        c.filters(1, deny=["zzz"])
    with pytest.raises(ConstraintConfigError, match="holds no live entry"):
        c.filters(1, allow=["a"])  # removed
    with pytest.raises(ConstraintConfigError, match="outside the snapshot"):
        c.filters(1, allow=[3])
    f = c.filters(1, allow=[2])  # snapshot index 2: the added entry
    assert c.allowed_tokens(c.start(1), filters=f) == [[6]]
    lists = SpanRules(END, on_complete="repeat", separator=(2,))
    with pytest.raises(ConstraintConfigError, match="rebase"):
        SnapshotConstraint(catalog.snapshot(), lists, "cpu").filters(1, distinct=True)
    catalog.rebase()
    plain = SnapshotConstraint(catalog.snapshot(), lists, "cpu")  # unchanged: the base's own distinct lists
    f = plain.filters(1, distinct=True)
    state = plain.start(1)
    for tok in (6, 2):
        state = plain.advance(state, torch.tensor([tok]), filters=f)
    assert plain.allowed_tokens(state, filters=f) == [[5]]  # 6 is used
    release = SnapshotConstraint(catalog.snapshot(), SpanRules(END, on_complete="release"), "cpu")
    with pytest.raises(ConstraintConfigError, match="release"):
        release.filters(1, deny=["b"])
    with pytest.raises(ConstraintConfigError, match="trie index must be 0"):
        c.start(2, torch.tensor([0, 1]))


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
    with pytest.raises(TrieFileError, match="missing arrays"):
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


def test_generate_keeps_the_snapshot_it_started_with(tiny_llama, tokenizer):
    """A request that starts before a change decodes against its snapshot to the end; the next one sees it."""
    from transformers import LogitsProcessor

    from trie_decode.integrations.transformers import TrieLogitsProcessor

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
    out = tiny_llama.generate(**inputs, logits_processor=[ChangeMidway(), processor], max_new_tokens=12,
                              do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert catalog.snapshot().sequences() == [tuple(TokenTrie.from_strings([new_entry], tokenizer).sequences()[0])]
    first = processor.match(out)
    assert all(e is not None and e.key in words for e in first), first  # the old snapshot, to the end
    out = tiny_llama.generate(**inputs, logits_processor=[processor], max_new_tokens=12, do_sample=False,
                              pad_token_id=tokenizer.pad_token_id)
    assert [e.key for e in processor.match(out)] == [new_entry, new_entry]
    # Beam search over a snapshot with a delta and tombstones: every beam is a live entry.
    catalog.add(words[:2], tokenizer=tokenizer, keys=words[:2])
    beams = tiny_llama.generate(**inputs, logits_processor=[processor], max_new_tokens=12, num_beams=4,
                                num_return_sequences=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert {e.key for e in processor.match(beams)} <= {new_entry, *words[:2]}
    from trie_decode.integrations.transformers import rank

    ranked = rank(tiny_llama, inputs, catalog, k=3, tokenizer=tokenizer, pad_token_id=tokenizer.pad_token_id)
    assert [sorted(r.entry.key for r in row) for row in ranked] == [sorted([new_entry, *words[:2]])] * 2


def test_a_server_picks_up_a_delta_file_beside_the_trie_file(tmp_path):
    """The pieces a server's trie cache uses: the delta file's identity (a new or replaced delta changes the key)
    and the trie it decodes (base plus changes, compacted)."""
    from trie_decode.live import apply_delta_file, delta_stat

    base = TokenTrie.from_sequences([[3, 4], [3, 5], [6]], vocab_size=10, keys=["a", "b", "c"])
    trie_path = tmp_path / "catalog.safetensors"
    base.save(trie_path)
    assert delta_stat(trie_path) is None
    catalog = LiveCatalog.open(trie_path)
    catalog.add([[7]], keys=["d"])
    catalog.save_delta(delta_path_for(trie_path))
    first = delta_stat(trie_path)
    assert first is not None and first[0] == delta_path_for(trie_path)
    served = apply_delta_file(TokenTrie.load(trie_path), first[0])
    assert sorted(served.sequences()) == [(3, 4), (3, 5), (6,), (7,)]
    catalog.remove(["a", "d"])
    catalog.save_delta(delta_path_for(trie_path))  # replaced: a new file identity
    second = delta_stat(trie_path)
    assert second != first
    served = apply_delta_file(TokenTrie.load(trie_path), second[0])
    assert sorted(served.sequences()) == [(3, 5), (6,)] and served.lookup([3, 5]).key == "b"
    LiveCatalog(base).save_delta(delta_path_for(trie_path))  # an empty delta: the base itself
    loaded = TokenTrie.load(trie_path)
    assert apply_delta_file(loaded, delta_path_for(trie_path)) is loaded
    other = TokenTrie.from_sequences([[1]], vocab_size=10, keys=["x"])
    with pytest.raises(TrieFileError, match="another base trie"):
        apply_delta_file(other, delta_path_for(trie_path))


def test_filters_name_a_catalogs_items_over_a_snapshot():
    from trie_decode.catalogs import catalog_from_codes

    codes = np.array([[3, 1], [3, 2], [3, 1], [0, 5]])  # items a and c share one semantic id
    base = catalog_from_codes(codes, codebook_size=8, token_offset=100, vocab_size=200, keys=["a", "b", "c", "d"])
    catalog = LiveCatalog(base)
    catalog.add([[103, 111]], keys=["e"])
    c = catalog.snapshot().constraint(SpanRules(END), "cpu")
    state = c.advance(c.start(1), torch.tensor([103]))
    assert c.allowed_tokens(state) == [[109, 110, 111]]
    assert c.allowed_tokens(state, filters=c.filters(1, deny=["c", "e"])) == [[110]]  # c: the id it shares with a
