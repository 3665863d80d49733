"""trie_decode combined with transformers' own constraints, and every reusable object reused.

The invariant: no token outside the trie is ever emitted, whatever other processors did to the logits first. When
``min_new_tokens``, ``suppress_tokens``, ``bad_words_ids`` or ``begin_suppress_tokens`` ban every token the trie
allows at a step, the row's allowed tokens get a finite floor (``ALL_MASKED_FLOOR``) and it still emits one of them.

Each option set below empties a row at some step whatever the model picks (the tiny model is random), and each test
checks three things from ``output_scores``: the floor fired (some row at some step has only ``ALL_MASKED_FLOOR``
among its finite scores), it fired in exactly the columns the trie allows there (greedy, sampling, fast-forward:
per the brute-force reference of tests/reference.py), and every generated token is allowed by the reference.
With the floor replaced by -inf (every kernel), every one of these generate tests fails.
"""

from __future__ import annotations

import math

import pytest
import torch

from trie_decode import TokenTrie
from trie_decode.constraint import SpanRules
from trie_decode.integrations.fast_forward import fast_forward_generate
from trie_decode.integrations.transformers import TrieLogitsProcessor, prefix_allowed_tokens_fn
from trie_decode.kernels import vectorized

from reference import SpanReference

END = 2
ENTRIES = [[100, 200, 300], [100, 200, 301], [100, 250], [400], [400, 401, 402], [500, 501]]
# Each option set empties a row at some step, whatever the model picks.
OTHERS = {
    # Longer than every entry and its end token: every row reaches a node whose only way on is the end token
    # (after [100, 250], [400, 401, 402], ...) before the 7th token, and the end token is banned there.
    "min_new_tokens": dict(min_new_tokens=7),
    # Every way on after each first token: [100] -> {200, 250}, [400] -> {401, end}, [500] -> {501}.
    "suppress_tokens": dict(suppress_tokens=[200, 250, 401, 501, END]),
    # The same with bad words; a bad word equal to the end token alone is dropped by transformers, so [400, END]
    # bans the end token after 400 only.
    "bad_words_ids": dict(bad_words_ids=[[200], [250], [401], [501], [400, END]]),
    # Every first token of the trie.
    "begin_suppress_tokens": dict(begin_suppress_tokens=[100, 400, 500]),
}
# All four at once: step 0 by begin_suppress_tokens, step 1 by suppress_tokens + bad_words_ids together (after
# [100]: 250 suppressed, 200 a bad word; after [400]: 401 suppressed, the end token a bad word; after [500]: 501 a
# bad word), and the end token after a complete entry by min_new_tokens.
ALL_FOUR = dict(min_new_tokens=7, suppress_tokens=[250, 401], bad_words_ids=[[200], [501], [400, END]],
                begin_suppress_tokens=[100, 400, 500])
MODES = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, num_return_sequences=2),
    "beam": dict(num_beams=3, num_return_sequences=3, do_sample=False),
}
PROMPT = 3


def _inputs():
    return {"input_ids": torch.tensor([[5, 6, 7], [0, 8, 9]]), "attention_mask": torch.tensor([[1, 1, 1], [0, 1, 1]])}


def _reference() -> SpanReference:
    return SpanReference({tuple(e) for e in ENTRIES}, SpanRules(end_token_id=END))


def _assert_inside_trie(rows: list[list[int]]) -> None:
    for row in rows:
        ref = _reference()
        for tok in row:
            allowed = ref.allowed()
            assert tok in allowed, (row, tok, allowed)
            ref.step(tok)


def _generate(model, mode: str, others: dict, *, fast_forward: bool = False):
    trie = TokenTrie.from_sequences(ENTRIES, vocab_size=model.config.vocab_size)
    if fast_forward:
        how = dict(custom_generate=fast_forward_generate, trie=trie, end_token_id=END)
    else:
        how = dict(logits_processor=[TrieLogitsProcessor(trie, end_token_id=END)])
    torch.manual_seed(0)
    return model.generate(**_inputs(), **how, max_new_tokens=8, pad_token_id=END, eos_token_id=END,
                          output_scores=True, return_dict_in_generate=True, **MODES[mode], **others)


def _floored(scores: tuple[torch.Tensor, ...]) -> list[tuple[int, int, set[int]]]:
    """(step, row, columns) of every score row whose finite values are all ``ALL_MASKED_FLOOR``: a row the other
    processors emptied and the trie floored."""
    found = []
    for step, x in enumerate(scores):
        finite = torch.isfinite(x)
        floor = (x == vectorized.ALL_MASKED_FLOOR) & finite
        for row in torch.nonzero(finite.any(1) & (floor == finite).all(1)).flatten().tolist():
            found.append((step, row, set(torch.nonzero(floor[row]).flatten().tolist())))
    return found


def _check(out, mode: str) -> None:
    rows = out.sequences[:, PROMPT:].tolist()
    _assert_inside_trie(rows)
    floored = _floored(out.scores)
    assert floored, "no row was emptied: the test does not exercise the floor"
    assert not math.isinf(vectorized.ALL_MASKED_FLOOR)
    if mode == "beam":  # score rows are beams, reordered at every step: only the generic check above applies
        return
    for step, row, columns in floored:
        ref = _reference()
        for tok in rows[row][:step]:
            ref.step(tok)
        assert columns == ref.allowed(), (step, rows[row], columns)
        assert rows[row][step] in columns


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("other", OTHERS)
def test_processor_with_transformers_constraints(tiny_llama, mode, other):
    _check(_generate(tiny_llama, mode, OTHERS[other]), mode)


@pytest.mark.parametrize("mode", ["greedy", "sample"])
@pytest.mark.parametrize("other", OTHERS)
def test_fast_forward_with_transformers_constraints(tiny_llama, mode, other):
    _check(_generate(tiny_llama, mode, OTHERS[other], fast_forward=True), mode)


@pytest.mark.parametrize("mode", MODES)
def test_all_four_constraints_at_once(tiny_llama, mode):
    out = _generate(tiny_llama, mode, ALL_FOUR)
    _check(out, mode)
    if mode != "beam":
        # Every row was emptied at step 0 and at step 1, and ended on the end token at the floor (min_new_tokens).
        steps = {(step, row) for step, row, _ in _floored(out.scores)}
        rows = range(out.sequences.shape[0])
        assert all((0, r) in steps and (1, r) in steps for r in rows), sorted(steps)
        for r, row in enumerate(out.sequences[:, PROMPT:].tolist()):
            end_at = row.index(END)
            assert end_at < 7 and (end_at, r) in steps, (row, sorted(steps))
    ff = _generate(tiny_llama, "greedy" if mode == "beam" else mode, ALL_FOUR, fast_forward=True)
    _check(ff, "greedy")


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


@pytest.mark.parametrize("scoring", [{}, {"length_normalize": True}, {"renormalize": True}])
def test_rank_leaves_out_entries_reached_through_the_floor(tiny_llama, scoring):
    """Banning both ways on after [100] leaves its three entries reachable only through the floor: rank leaves them
    out (it listed them with -1e4 in the score, or with a plausible renormalized one) and keeps every other entry,
    its place and its score. A batch with a padded prompt, so each beam's steps are gathered from its own rows."""
    from trie_decode.integrations.transformers import rank

    trie = TokenTrie.from_sequences(ENTRIES, vocab_size=tiny_llama.config.vocab_size)
    plain = rank(tiny_llama, _inputs(), trie, 6, end_token_id=END, **scoring)
    banned = rank(tiny_llama, _inputs(), trie, 6, end_token_id=END, bad_words_ids=[[200], [250]], **scoring)
    for p, b in zip(plain, banned):
        live = [r for r in p if r.entry.tokens[0] != 100]
        assert [r.entry.tokens for r in b] == [r.entry.tokens for r in live]
        assert all(abs(x.log_prob - y.log_prob) < 1e-4 for x, y in zip(b, live))


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
