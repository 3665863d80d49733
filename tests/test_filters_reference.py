"""Allow/deny filters and distinct lists against the shared brute-force reference (tests/reference.py), every
kernel: a filtered row allows exactly what the reference over the filtered entry set allows, at every step."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trie_decode import ConstraintConfigError, TokenTrie
from trie_decode import filters as filters_module
from trie_decode.constraint import SpanRules, TrieConstraint

from reference import SpanReference

V = 20
END, SEP = 1, 3

# Entries may hold the separator's token (3): a terminal node can then have a child that is also its separator.
entry_sets = st.lists(st.lists(st.integers(3, V - 1), min_size=1, max_size=4), min_size=1, max_size=10)


@settings(max_examples=80, deadline=None)
@given(entries=entry_sets, seed=st.integers(0, 2**16), kernel=st.sampled_from(["native", "numpy", "torch"]),
       mode=st.sampled_from(["eos", "repeat", "repeat-distinct"]), dense=st.booleans(), denied_only=st.booleans())
def test_filtered_rows_match_the_reference(entries, seed, kernel, mode, dense, denied_only):
    """``denied_only``: no row has an allow set, and the filter pass counts only the children that hold a denied
    rank, or after the C kernel applied a distinct list's static filter an emitted one (what it does on the CPU when
    they are fewer than the widest node's children), whatever their number."""
    with pytest.MonkeyPatch.context() as mp:
        if denied_only:
            mp.setattr(filters_module, "_counts_every_child",
                       lambda filters, node, dtrie, blocking, static_applied: filters.any_allow and not static_applied)
        check_filtered_rows(entries, seed, kernel, mode, dense, denied_only)


def check_filtered_rows(entries, seed, kernel, mode, dense, denied_only):
    rng = random.Random(seed)
    trie = TokenTrie.from_sequences(entries, vocab_size=V)
    distinct = mode == "repeat-distinct"
    rules = SpanRules(end_token_id=END, **({} if mode == "eos" else dict(on_complete="repeat", separator=(SEP,))))
    c = TrieConstraint(trie, rules, "cpu", dense_min_fanout=2 if dense else None, kernel=kernel)
    all_entries = [tuple(trie.entry(i).tokens) for i in range(trie.num_entries)]
    rows = 4
    allow = [None if denied_only or rng.random() < 0.3 else
             rng.sample(range(trie.num_entries), rng.randint(1, trie.num_entries)) for _ in range(rows)]
    deny = [rng.sample(range(trie.num_entries), rng.randint(0, trie.num_entries // 2)) for _ in range(rows)]
    usable = [(set(range(trie.num_entries)) if a is None else set(a)) - set(d) for a, d in zip(allow, deny)]
    if not all(usable):  # a row that could generate nothing is refused when the filters are made
        with pytest.raises(ConstraintConfigError, match="nothing could be generated"):
            c.filters(rows, allow=allow, deny=deny, distinct=distinct)
        return
    filters = c.filters(rows, allow=allow, deny=deny, distinct=distinct)
    refs = [SpanReference({all_entries[i] for i in u}, rules, distinct=distinct) for u in usable]
    state = c.start(rows)
    for _ in range(12):
        logits = c.mask_(torch.zeros(rows, V), state, filters=filters)
        toks = []
        for i, ref in enumerate(refs):
            got = set(logits[i].isfinite().nonzero().flatten().tolist())
            assert got == ref.allowed(), (i, got, ref.allowed(), ref.state)
            tok = rng.choice(sorted(got))
            ref.step(tok)
            toks.append(tok)
        state = c.advance(state, torch.tensor(toks), filters=filters)
