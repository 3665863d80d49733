"""trie_decode combined with transformers' own constraints, and every reusable object reused.

The invariant: no token outside the trie is ever emitted, whatever other processors did to the logits first. When
``min_new_tokens``, ``suppress_tokens``, ``bad_words_ids`` or ``begin_suppress_tokens`` ban every token the trie
allows at a step, the row's allowed tokens get a finite floor (``ALL_MASKED_FLOOR``) and it still emits one of them.
Each generated token is checked against the brute-force reference of tests/reference.py.
"""

from __future__ import annotations

import pytest
import torch

from trie_decode import TokenTrie
from trie_decode.constraint import SpanRules
from trie_decode.integrations.fast_forward import fast_forward_generate
from trie_decode.integrations.transformers import TrieLogitsProcessor, prefix_allowed_tokens_fn

from reference import SpanReference

END = 2
ENTRIES = [[100, 200, 300], [100, 200, 301], [100, 250], [400], [400, 401, 402], [500, 501]]
# Each option set bans, at some step, every token some rows may emit.
OTHERS = {
    "min_new_tokens": dict(min_new_tokens=7),  # longer than every entry: the end token is banned when it is due
    "suppress_tokens": dict(suppress_tokens=[200, 401, 501]),  # the only child after [100], and more
    "bad_words_ids": dict(bad_words_ids=[[250], [200], [300], [301]]),  # every way on after [100]
    "begin_suppress_tokens": dict(begin_suppress_tokens=[100, 400, 500]),  # every first token
}
MODES = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, num_return_sequences=2),
    "beam": dict(num_beams=3, num_return_sequences=3, do_sample=False),
}


def _inputs():
    return {"input_ids": torch.tensor([[5, 6, 7], [0, 8, 9]]), "attention_mask": torch.tensor([[1, 1, 1], [0, 1, 1]])}


def _assert_inside_trie(rows: list[list[int]]) -> None:
    entries = {tuple(e) for e in ENTRIES}
    rules = SpanRules(end_token_id=END)
    for row in rows:
        ref = SpanReference(entries, rules)
        for tok in row:
            allowed = ref.allowed()
            assert tok in allowed, (row, tok, allowed)
            ref.step(tok)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("other", OTHERS)
def test_processor_with_transformers_constraints(tiny_llama, mode, other):
    trie = TokenTrie.from_sequences(ENTRIES, vocab_size=tiny_llama.config.vocab_size)
    torch.manual_seed(0)
    out = tiny_llama.generate(**_inputs(), logits_processor=[TrieLogitsProcessor(trie, end_token_id=END)],
                              max_new_tokens=8, pad_token_id=END, eos_token_id=END, **MODES[mode], **OTHERS[other])
    _assert_inside_trie(out[:, 3:].tolist())


@pytest.mark.parametrize("mode", ["greedy", "sample"])
@pytest.mark.parametrize("other", OTHERS)
def test_fast_forward_with_transformers_constraints(tiny_llama, mode, other):
    trie = TokenTrie.from_sequences(ENTRIES, vocab_size=tiny_llama.config.vocab_size)
    torch.manual_seed(0)
    out = tiny_llama.generate(**_inputs(), custom_generate=fast_forward_generate, trie=trie, end_token_id=END,
                              max_new_tokens=8, pad_token_id=END, eos_token_id=END, **MODES[mode], **OTHERS[other])
    _assert_inside_trie(out[:, 3:].tolist())


def test_floor_keeps_a_banned_beam_below_every_live_beam(tiny_llama):
    """A row whose allowed tokens were all banned gets a low finite floor, not 0: under beam search it must not
    become the best beam (it would with transformers' rule of resetting the allowed logits to 0)."""
    from trie_decode.integrations.transformers import rank

    trie = TokenTrie.from_sequences(ENTRIES, vocab_size=tiny_llama.config.vocab_size)
    inputs = {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.tensor([[1, 1, 1]])}
    plain = rank(tiny_llama, inputs, trie, 6, end_token_id=END)[0]
    banned = rank(tiny_llama, inputs, trie, 6, end_token_id=END, bad_words_ids=[[401]])[0]
    # [400, 401, 402] is banned half way; every other entry keeps its place and its score.
    live = [r for r in plain if r.entry.tokens != (400, 401, 402)]
    assert [r.entry.tokens for r in banned[: len(live)]] == [r.entry.tokens for r in live]
    assert all(abs(a.log_prob - b.log_prob) < 1e-4 for a, b in zip(banned, live))


def test_prefix_allowed_tokens_fn_reused_across_generate_calls(tiny_llama):
    """One function, three generate calls with other prompt lengths and batch sizes: every output stays in the
    trie (it used to remember the first call's prompt length and allow only the end token afterwards)."""
    trie = TokenTrie.from_sequences(ENTRIES, vocab_size=tiny_llama.config.vocab_size)
    fn = prefix_allowed_tokens_fn(trie, end_token_id=END)
    for length, batch in ((3, 2), (9, 1), (5, 3)):
        ids = torch.arange(10, 10 + length).repeat(batch, 1)
        out = tiny_llama.generate(input_ids=ids, attention_mask=torch.ones_like(ids), prefix_allowed_tokens_fn=fn,
                                  max_new_tokens=5, do_sample=False, pad_token_id=END, eos_token_id=END)
        rows = out[:, length:].tolist()
        _assert_inside_trie(rows)
        assert all(row[0] != END for row in rows), "the first generated token must start an entry"


def test_prefix_allowed_tokens_fn_with_prompt_length_is_stateless():
    trie = TokenTrie.from_sequences(ENTRIES, vocab_size=1000)
    fn = prefix_allowed_tokens_fn(trie, end_token_id=END, prompt_length=[2, 3])
    calls = [(0, [1, 2, 100]), (1, [1, 2, 3]), (0, [1, 2]), (1, [1, 2, 3, 400, 401])]
    first = [fn(b, torch.tensor(r)) for b, r in calls]
    again = [fn(b, torch.tensor(r)) for b, r in reversed(calls)][::-1]
    assert first == again == [[200, 250], [100, 400, 500], [100, 400, 500], [402]]


def test_reused_objects_give_the_same_results(tiny_llama):
    """Processor and fast-forward: a second identical call equals the first (no state leaks between calls)."""
    trie = TokenTrie.from_sequences(ENTRIES, vocab_size=tiny_llama.config.vocab_size)
    processor = TrieLogitsProcessor(trie, end_token_id=END)
    kwargs = dict(max_new_tokens=6, pad_token_id=END, eos_token_id=END, do_sample=False)
    short = {"input_ids": torch.tensor([[11, 12]]), "attention_mask": torch.tensor([[1, 1]])}
    first = tiny_llama.generate(**_inputs(), logits_processor=[processor], **kwargs)
    tiny_llama.generate(**short, logits_processor=[processor], **kwargs)  # another prompt shape in between
    assert torch.equal(tiny_llama.generate(**_inputs(), logits_processor=[processor], **kwargs), first)
    assert [e.tokens for e in processor.match(first)] == [e.tokens for e in TrieLogitsProcessor(trie, end_token_id=END).match(first, prompt_length=3)]
    ff = [tiny_llama.generate(**_inputs(), custom_generate=fast_forward_generate, trie=trie, end_token_id=END, **kwargs)
          for _ in range(2)]
    assert torch.equal(ff[0], ff[1])
