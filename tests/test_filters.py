"""Per-row allow and deny filters and distinct lists over one shared trie, against the brute-force reference.

A filtered row must behave exactly like a row on a trie of its usable entries (allowed, not denied); a distinct
list must never repeat an entry and must end when every entry is used.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from trie_decode import ConstraintConfigError, TokenTrie
from trie_decode.constraint import SpanRules, TrieConstraint

from reference import SpanReference

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


def test_allow_100_of_a_large_trie_equals_a_trie_of_those_100():
    rng = np.random.default_rng(0)
    n, vocab = 200_000, 5000
    seqs = rng.integers(3, vocab, size=(n, 4))
    big = TokenTrie.from_sequences(seqs, vocab_size=vocab)
    pick = rng.choice(big.num_entries, 100, replace=False)
    small = TokenTrie.from_sequences([list(big.entry(int(i)).tokens) for i in pick], vocab_size=vocab)
    rules = SpanRules(end_token_id=END)
    cb, cs = TrieConstraint(big, rules, "cpu"), TrieConstraint(small, rules, "cpu")
    f = cb.filters(8, allow=pick)
    sb, ss = cb.start(8), cs.start(8)
    walk = np.random.default_rng(1)
    for _ in range(6):
        lb = cb.mask_(torch.randn(8, vocab), sb, filters=f)
        ls = cs.mask_(torch.zeros(8, vocab), ss)
        assert torch.equal(lb.isfinite(), ls.isfinite())
        toks = torch.tensor([walk.choice(row.isfinite().nonzero().flatten().numpy()) for row in ls])
        sb, ss = cb.advance(sb, toks, filters=f), cs.advance(ss, toks)


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
    with pytest.raises(ConstraintConfigError, match="allow filter is empty"):
        c.filters(1, allow=["x"], deny=["x"])
    with pytest.raises(ConstraintConfigError, match="distinct=True needs"):
        c.filters(1, distinct=True)
    with pytest.raises(ConstraintConfigError, match="release"):
        TrieConstraint(trie, SpanRules(END, on_complete="release"), "cpu").filters(1)


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
    assert sorted(r.entry.key for r in raw) == sorted(KEYS) and raw.duplicates >= 0
    norm = rank(tiny_llama, inputs, trie, 6, end_token_id=END, num_beams=12, renormalize=True)[0]
    assert abs(sum(np.exp(r.log_prob) for r in norm) - 1.0) < 1e-3
    assert {r.entry.key for r in norm} == set(KEYS)
    by_key = {r.entry.key: r.log_prob for r in raw}
    mean = rank(tiny_llama, inputs, trie, 6, end_token_id=END, num_beams=12, length_normalize=True)[0]
    for r in mean:
        assert abs(r.log_prob - by_key[r.entry.key] / (len(r.entry.tokens) + 1)) < 1e-3
    only = rank(tiny_llama, inputs, trie, 3, end_token_id=END, allow=["a", "c", "f"])[0]
    assert {r.entry.key for r in only} == {"a", "c", "f"}
