"""TrieLogitsProcessor inside transformers' own generate loops: greedy, sampling, beams, batches, modes."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from trie_decode import ConstraintConfigError, TokenTrie, TokenizerMismatchError
from trie_decode.constraint import SpanRules

from reference import allowed_after
from trie_decode.integrations.transformers import (
    TrieLogitsProcessor,
    match,
    match_all,
    prefix_allowed_tokens_fn,
    rank,
)

QUESTIONS = [
    "Which country is Paris the capital of?",
    "Which country has Tokyo as its capital?",
    "Which country is famous for pizza and pasta?",
    "Which country has the city of Toronto?",
]


def chat(tokenizer, question: str, prefill: str = "The answer is") -> str:
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + prefill


@pytest.fixture(scope="module")
def countries(tokenizer, country_names):
    return TokenTrie.from_strings(country_names, tokenizer, leading_space=True)


@pytest.fixture(scope="module")
def left_tok(tokenizer):
    tokenizer.padding_side = "left"
    return tokenizer


def generated(out, inputs):
    return out[:, inputs["input_ids"].shape[1] :]


def test_greedy_real_model_answers_from_the_list(model, left_tok, countries):
    inputs = left_tok([chat(left_tok, q) for q in QUESTIONS], return_tensors="pt", padding=True)
    processor = TrieLogitsProcessor(countries, left_tok)
    out = model.generate(**inputs, logits_processor=[processor], max_new_tokens=16, do_sample=False)
    names = [e.name for e in processor.match(out)]
    assert names == ["France", "Japan", "Italy", "Canada"]
    # Every row ends with the end token right after its entry.
    for row, entry in zip(generated(out, inputs).tolist(), processor.match(out)):
        assert row[: len(entry.tokens) + 1] == list(entry.tokens) + [left_tok.eos_token_id]


def test_sampling_outputs_are_members(model, left_tok, countries):
    inputs = left_tok([chat(left_tok, q) for q in QUESTIONS[:2]], return_tensors="pt", padding=True)
    processor = TrieLogitsProcessor(countries, left_tok)
    for seed in range(4):
        torch.manual_seed(seed)
        out = model.generate(
            **inputs, logits_processor=[processor], max_new_tokens=16, do_sample=True, temperature=1.5,
            num_return_sequences=3,
        )
        assert all(e is not None for e in processor.match(out)), seed


def test_beam_search_returns_distinct_members(model, left_tok, countries):
    inputs = left_tok([chat(left_tok, q) for q in QUESTIONS[:2]], return_tensors="pt", padding=True)
    processor = TrieLogitsProcessor(countries, left_tok)
    out = model.generate(
        **inputs, logits_processor=[processor], max_new_tokens=16, num_beams=4, num_return_sequences=4,
        do_sample=False,
    )
    entries = processor.match(out)
    assert all(e is not None for e in entries)
    for p in range(2):
        assert len({e.index for e in entries[p * 4 : (p + 1) * 4]}) == 4
    assert entries[0].name == "France"


def test_rank_real_model(model, left_tok, countries):
    inputs = left_tok([chat(left_tok, QUESTIONS[0])], return_tensors="pt")
    ranked = rank(model, inputs, countries, 4, tokenizer=left_tok)[0]
    assert ranked[0].entry.name == "France"
    scores = [r.log_prob for r in ranked]
    assert scores == sorted(scores, reverse=True) and all(s < 0 for s in scores)


def _exact_log_prob(model, prompt_ids: list[int], tokens: list[int], end: int) -> float:
    """The model's summed raw log-prob of ``tokens`` then ``end`` after the prompt, by one forward pass."""
    ids = torch.tensor([prompt_ids + tokens + [end]])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    return sum(lp[len(prompt_ids) - 1 + j, t].item() for j, t in enumerate(tokens + [end]))


def test_rank_does_not_stop_before_a_longer_entry_that_ranks_higher(model, left_tok):
    # The best entry has 3 tokens, the others 1: with early_stopping=True the search ended once it held num_beams
    # finished beams (after 2 steps), and the best entry was missing from [Italy, France].
    trie = TokenTrie.from_strings(["United Arab Emirates", "Italy", "France"], left_tok, leading_space=True)
    inputs = left_tok([chat(left_tok, "Which country is Dubai in?")], return_tensors="pt")
    prompt = inputs["input_ids"][0].tolist()
    exact = sorted(((_exact_log_prob(model, prompt, list(trie.entry(i).tokens), left_tok.eos_token_id), trie.entry(i).name)
                    for i in range(3)), reverse=True)
    for k, beams in ((2, 4), (3, 3), (1, None)):
        ranked = rank(model, inputs, trie, k, tokenizer=left_tok, num_beams=beams)[0]
        assert [r.entry.name for r in ranked] == [name for _, name in exact[:k]], (k, beams)
        assert [round(r.log_prob, 3) for r in ranked] == [round(lp, 3) for lp, _ in exact[:k]]
    with pytest.raises(ConstraintConfigError, match=r"rank sets \['do_sample'\] itself"):
        rank(model, inputs, trie, 2, tokenizer=left_tok, do_sample=True)


def test_rank_scores_only_entries_closed_by_the_end_token(tiny_llama, tokenizer):
    """max_new_tokens=2 cut the 2-token entries before their end token, and rank reported them with scores that
    lack it; min_new_tokens banned the end token, and every score carried the floor (-1e4): both were wrong."""
    end = tokenizer.eos_token_id
    trie = TokenTrie.from_sequences([[5071], [7158], [7158, 4000], [4001, 4002]], vocab_size=len(tokenizer))
    inputs = {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    ranked = rank(tiny_llama, inputs, trie, 4, end_token_id=end, max_new_tokens=2)[0]
    assert sorted(r.entry.tokens for r in ranked) == [(5071,), (7158,)]
    for r in ranked:
        assert r.log_prob == pytest.approx(_exact_log_prob(tiny_llama, [5, 6, 7], list(r.entry.tokens), end), abs=1e-4)
    for options in (dict(min_new_tokens=3), dict(min_length=6)):
        with pytest.raises(ConstraintConfigError, match=rf"^rank does not take {next(iter(options))}= \(they ban "
                                                        r"the end token.*\): leave them out$"):
            rank(tiny_llama, inputs, trie, 4, end_token_id=end, **options)


def test_rank_names_the_distinct_list_options_it_does_not_take(tiny_llama, tokenizer):
    """distinct= and max_entries= reached generate, which refused them as model kwargs the model does not use (no
    fix named): rank returns k distinct entries, and a distinct list is the processor's."""
    trie = TokenTrie.from_strings(["France", "Japan"], tokenizer)
    inputs = {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    fix = re.escape("a distinct list is made by model.generate(..., logits_processor=[TrieLogitsProcessor(trie, "
                    "on_complete='repeat', separator=..., distinct=True)])")
    for options, asked in ((dict(distinct=True), "distinct="), (dict(max_entries=4), "max_entries="),
                           (dict(distinct=True, max_entries=4), "distinct= or max_entries=")):
        with pytest.raises(ConstraintConfigError, match=rf"^rank does not take {asked} \(it returns k distinct entries"
                                                        rf".*\): {fix}$"):
            rank(tiny_llama, inputs, trie, 2, end_token_id=tokenizer.eos_token_id, **options)
    options = dict(on_complete="repeat", separator=", ", distinct=True)  # the processor the message names makes one
    TrieLogitsProcessor(trie, tokenizer, **options)


def test_rank_k_and_num_beams_are_positive_integers(tiny_llama, tokenizer):
    """k="3" failed inside rank's own comparison (TypeError: '<' not supported between str and int), num_beams=2.5
    ran as 2 beams, k=True as k=1: each is now refused by name."""
    trie = TokenTrie.from_strings(["France", "Japan"], tokenizer)
    inputs = {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    for options, message in ((dict(k="3"), "k must be a positive integer, got '3'"),
                             (dict(k=0), "k must be a positive integer, got 0"),
                             (dict(k=True), "k must be a positive integer, got True"),
                             (dict(k=2, num_beams=2.5), "num_beams must be a positive integer, got 2.5")):
        with pytest.raises(ConstraintConfigError, match=f"^{re.escape(message)}$"):
            rank(tiny_llama, inputs, trie, end_token_id=tokenizer.eos_token_id, **options)
    with pytest.raises(ConstraintConfigError, match=re.escape("num_beams (2) must be at least k (3)")):
        rank(tiny_llama, inputs, trie, 3, num_beams=2, end_token_id=tokenizer.eos_token_id)
    assert len(rank(tiny_llama, inputs, trie, np.int64(2), end_token_id=tokenizer.eos_token_id)[0]) == 2


def test_rank_names_the_processor_options_it_does_not_take(tiny_llama, tokenizer):
    """on_complete=, trigger=, spans=, ... reached generate, which refused them as model kwargs the model does not
    use ("typos in the generate arguments"), with no fix: rank ranks whole entries closed by the end token."""
    trie = TokenTrie.from_strings(["France", "Japan"], tokenizer)
    inputs = {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    for options in (dict(on_complete="release"), dict(separator=", "), dict(trigger="x"), dict(check_prompt=True),
                    dict(spans=[]), dict(tries=trie)):
        asked = f"{next(iter(options))}="
        with pytest.raises(ConstraintConfigError, match=rf"^rank does not take {asked} \(it ranks whole entries, each "
                                                        r"closed by the end token\): rank\(model, inputs, trie, k"):
            rank(tiny_llama, inputs, trie, 2, end_token_id=tokenizer.eos_token_id, **options)
    ranked = rank(tiny_llama, inputs, trie, 2, end_token_id=tokenizer.eos_token_id, template=None)  # unset: fine
    assert len(ranked[0]) == 2


def test_rank_names_its_own_trie_argument(tiny_llama, tokenizer):
    """rank(model, inputs, None, k) asked for tries=, spans= or template=, which rank refuses: its argument is trie."""
    inputs = {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    for trie, message in ((None, "trie must be a TokenTrie or a list of them (one per prompt), got None"),
                          ([], "trie is empty: pass one TokenTrie, or one per prompt")):
        with pytest.raises(ConstraintConfigError, match=f"^{re.escape(message)}$"):
            rank(tiny_llama, inputs, trie, 2, end_token_id=tokenizer.eos_token_id)


def test_per_prompt_tries_and_filters_must_give_one_per_prompt(tiny_llama, tokenizer):
    """2 tries for 4 prompts divide the 4 rows, and were read as 2 prompts of 2 rows: prompt 1 decoded with trie 0,
    silently; so were 2 tries for 3 prompts of 2 beams (6 rows). generate's rows per prompt are known: refused."""
    a = TokenTrie.from_strings(["France", "Italy"], tokenizer, leading_space=True, keys=["FR", "IT"])
    b = TokenTrie.from_strings(["Japan", "Spain"], tokenizer, leading_space=True)
    ids = torch.randint(100, 5000, (4, 5), generator=torch.Generator().manual_seed(0))
    four = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    three = {k: v[:3] for k, v in four.items()}
    two = {k: v[:2] for k, v in four.items()}
    refused = re.escape("gives 2, one per prompt, but the batch has")
    cases = [(four, dict(tries=[a, b]), {}, "tries " + refused + re.escape(" 4 prompts (4 rows, 1 per prompt)")),
             (three, dict(tries=[a, b]), dict(num_beams=2),
              "tries " + refused + re.escape(" 3 prompts (6 rows, 2 per")),
             (three, dict(tries=[a, b]), dict(do_sample=True, num_return_sequences=2), "tries " + refused),
             (four, dict(tries=a, allow=[["FR"], ["IT"]]), {}, "allow/deny " + refused)]
    for inputs, options, generate_options, message in cases:
        processor = TrieLogitsProcessor(options.pop("tries"), tokenizer, **options)
        with pytest.raises(ConstraintConfigError, match=message):
            tiny_llama.generate(**inputs, logits_processor=[processor], max_new_tokens=3, **generate_options)
    with pytest.raises(ConstraintConfigError, match="^trie " + refused + re.escape(" 4 prompts (4 rows, 1 per")):
        rank(tiny_llama, four, [a, b], 2, tokenizer=tokenizer)  # rank's own option: trie=
    # One per prompt, whatever the beams or return sequences: each prompt decodes its own trie.
    for generate_options in (dict(num_beams=3, num_return_sequences=2), dict(do_sample=True, num_return_sequences=3)):
        processor = TrieLogitsProcessor([a, b], tokenizer)
        out = tiny_llama.generate(**two, logits_processor=[processor], max_new_tokens=3, **generate_options)
        rows = out.shape[0] // 2
        assert [e.name in ("France", "Italy") for e in processor.match(out)] == [True] * rows + [False] * rows


def test_own_loop_with_a_new_prompt_one_token_longer_starts_afresh(model, left_tok, countries):
    # Called directly (no LogitsProcessorList): a new prompt exactly one token longer than the last call looked like
    # the next step; its prefix was found in no row, every row could only end, and the output was the end token.
    processor = TrieLogitsProcessor(countries, left_tok)

    def own_loop(ids: torch.Tensor, steps: int = 3) -> list[int]:
        start = ids.shape[1]
        for _ in range(steps):
            with torch.no_grad():
                nxt = processor(ids, model(ids).logits[:, -1, :]).argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
            if nxt.item() == left_tok.eos_token_id:
                break
        return ids[0, start:].tolist()

    first = left_tok(chat(left_tok, QUESTIONS[0]), return_tensors="pt")["input_ids"]
    own_loop(first)
    other = left_tok(chat(left_tok, "Which country is New York City in? Give a long answer"), return_tensors="pt")["input_ids"]
    other = torch.cat([other[:, :1], other[:, -processor._last_len:]], 1)  # one token longer than the last call
    assert other.shape[1] == processor._last_len + 1
    got = own_loop(other)
    processor.reset()
    assert got == own_loop(other) and countries.lookup(got[:-1]) is not None


def test_batch_with_different_tries_and_left_padding(model, left_tok):
    tries = [
        TokenTrie.from_strings(["France", "Spain", "Portugal"], left_tok, leading_space=True),
        TokenTrie.from_strings(["Japan", "China", "Korea", "Vietnam"], left_tok, leading_space=True),
        TokenTrie.from_strings(["red", "green", "blue"], left_tok, leading_space=True),
    ]
    questions = [QUESTIONS[0], QUESTIONS[1], "What colour is the sky on a clear day?"]
    inputs = left_tok([chat(left_tok, q) for q in questions], return_tensors="pt", padding=True)
    assert (inputs["attention_mask"][:, 0] == 0).any()  # really left-padded
    processor = TrieLogitsProcessor(tries, left_tok)
    out = model.generate(**inputs, logits_processor=[processor], max_new_tokens=8, do_sample=False)
    entries = processor.match(out)
    assert [e.name for e in entries][:2] == ["France", "Japan"]
    # Each row equals what its prompt gives alone, unpadded, with its own trie.
    for i, q in enumerate(questions):
        alone = left_tok([chat(left_tok, q)], return_tensors="pt")
        single = TrieLogitsProcessor(tries[i], left_tok)
        model.generate(**alone, logits_processor=[single], max_new_tokens=8, do_sample=False)
        assert single.match(model.generate(**alone, logits_processor=[single], max_new_tokens=8, do_sample=False))[0] == entries[i]
    # Several sequences per prompt map back to their prompt's trie.
    torch.manual_seed(0)
    out = model.generate(**inputs, logits_processor=[processor], max_new_tokens=8, do_sample=True, num_return_sequences=2)
    for i, e in enumerate(processor.match(out)):
        assert e is not None and e.name in tries[i // 2].names()


def test_fewer_branches_than_beams(model, left_tok):
    trie = TokenTrie.from_strings(["France", "Germany"], left_tok, leading_space=True)
    inputs = left_tok([chat(left_tok, QUESTIONS[0])], return_tensors="pt")
    processor = TrieLogitsProcessor(trie, left_tok)
    out = model.generate(
        **inputs, logits_processor=[processor], max_new_tokens=8, num_beams=4, num_return_sequences=4, do_sample=False,
        output_scores=True, return_dict_in_generate=True,
    )
    entries = processor.match(out.sequences)
    finite = out.sequences_scores.isfinite().tolist()
    valid = [e.name for e, ok in zip(entries, finite) if ok]
    assert sorted(set(valid)) == ["France", "Germany"]
    assert entries[0].name == "France"
    assert [r.entry.name for r in rank(model, inputs, trie, 4, tokenizer=left_tok)[0]] == ["France", "Germany"]


def test_reused_instance_starts_fresh(model, left_tok, countries):
    processor = TrieLogitsProcessor(countries, left_tok)
    first = left_tok([chat(left_tok, QUESTIONS[0])], return_tensors="pt")
    second = left_tok([chat(left_tok, QUESTIONS[1], prefill="The answer is:")], return_tensors="pt")
    model.generate(**first, logits_processor=[processor], max_new_tokens=8, do_sample=False)
    out = model.generate(**second, logits_processor=[processor], max_new_tokens=8, do_sample=False)
    assert processor.generation_start == second["input_ids"].shape[1]
    assert processor.match(out)[0] is not None


def test_tokenizer_mismatch_raises_at_construction(left_tok):
    other = TokenTrie.from_sequences([[1, 2]], vocab_size=len(left_tok), fingerprint="0" * 32)
    with pytest.raises(TokenizerMismatchError, match="fingerprint"):
        TrieLogitsProcessor(other, left_tok)



def _record(processor):
    log = []

    def wrapped(input_ids, scores):
        out = processor(input_ids, scores)
        log.append((input_ids.clone(), out.isfinite().clone()))
        return out

    return wrapped, log


@pytest.mark.parametrize("mode", ["greedy", "sample", "beam"])
def test_every_step_matches_brute_force_tiny_model(tiny_llama, tokenizer, mode):
    entries = [[100, 200, 300], [100, 200, 301], [100, 250], [400], [400, 401, 402], [500, 501]]
    trie = TokenTrie.from_sequences(entries, vocab_size=len(tokenizer))
    processor = TrieLogitsProcessor(trie, end_token_id=2)
    wrapped, log = _record(processor)
    inputs = {"input_ids": torch.tensor([[5, 6, 7], [0, 8, 9]]), "attention_mask": torch.tensor([[1, 1, 1], [0, 1, 1]])}
    kwargs = dict(greedy=dict(do_sample=False), sample=dict(do_sample=True, num_return_sequences=3),
                  beam=dict(num_beams=4, num_return_sequences=4, do_sample=False))[mode]
    torch.manual_seed(0)
    out = tiny_llama.generate(**inputs, logits_processor=[wrapped], max_new_tokens=6, pad_token_id=2, eos_token_id=2, **kwargs)
    assert processor._fused is not None, "generate's own loops step in one C call on a CPU"
    refs = {tuple(e) for e in entries}
    checked = 0
    for input_ids, allowed in log:
        for row in range(input_ids.shape[0]):
            gen = input_ids[row, 3:].tolist()
            if 2 in gen:
                gen = gen[: gen.index(2) + 1]
                expected = {2}
            else:
                expected = allowed_after(refs, processor.rules, gen)
            assert set(allowed[row].nonzero().flatten().tolist()) == expected, (mode, gen)
            checked += 1
    assert checked >= 6
    for e in processor.match(out):
        assert e is not None and list(e.tokens) in entries


def test_padded_vocab_model(tiny_llama_padded_vocab, tokenizer):
    trie = TokenTrie.from_sequences([[10, 11], [12]], vocab_size=len(tokenizer))
    processor = TrieLogitsProcessor(trie, tokenizer)
    assert tiny_llama_padded_vocab.config.vocab_size > len(tokenizer)
    out = tiny_llama_padded_vocab.generate(
        input_ids=torch.tensor([[5, 6]]), logits_processor=[processor], max_new_tokens=4, do_sample=True,
        pad_token_id=tokenizer.eos_token_id,
    )
    assert processor.match(out)[0] is not None


def test_release_repeat_and_trigger_modes(tiny_llama, tokenizer):
    eos = tokenizer.eos_token_id
    entries = [[100, 101], [102], [103, 104, 105]]
    trie = TokenTrie.from_sequences(entries, vocab_size=len(tokenizer))
    prompt = torch.tensor([[5, 6, 7]])
    # repeat: a list of entries separated by token 300, ended by EOS.
    processor = TrieLogitsProcessor(trie, tokenizer, on_complete="repeat", separator=[300])
    torch.manual_seed(1)
    for _ in range(3):
        out = tiny_llama.generate(input_ids=prompt, logits_processor=[processor], max_new_tokens=12, do_sample=True, pad_token_id=eos)
        found = processor.match_all(out)[0]
        assert found and all(list(e.tokens) in entries for e in found)
        # The generated text is exactly entries joined by the separator (possibly cut by max_new_tokens).
        gen = out[0, 3:].tolist()
        rebuilt = []
        for e in found:
            rebuilt += list(e.tokens) + [300]
        assert gen[: len(rebuilt) - 1] == rebuilt[:-1]
    # release: after the entry, the model writes freely (the tiny model is random, so no EOS is forced).
    processor = TrieLogitsProcessor(trie, tokenizer, on_complete="release")
    out = tiny_llama.generate(input_ids=prompt, logits_processor=[processor], max_new_tokens=10, do_sample=False, pad_token_id=eos)
    entry = processor.match(out)[0]
    assert entry is not None and out.shape[1] - 3 > len(entry.tokens)
    # trigger: free text until the trigger appears in the prompt's tail, then an entry.
    processor = TrieLogitsProcessor(trie, tokenizer, trigger=[7], on_complete="release")
    out = tiny_llama.generate(input_ids=prompt, logits_processor=[processor], max_new_tokens=6, do_sample=False, pad_token_id=eos)
    assert processor.match(out)[0] is not None and out[0, 3:].tolist()[: len(processor.match(out)[0].tokens)] == list(processor.match(out)[0].tokens)


def test_trigger_span_real_model(model, left_tok, countries):
    """Free text, then a constrained country after the trigger, then free text again."""
    prompt = chat(left_tok, "Describe the country whose capital is Paris in one line, starting with 'Country:'.", prefill="")
    inputs = left_tok([prompt], return_tensors="pt")
    forced_prefix = left_tok("Country:", add_special_tokens=False, return_tensors="pt")["input_ids"]
    inputs = {
        "input_ids": torch.cat([inputs["input_ids"], forced_prefix], dim=1),
        "attention_mask": torch.ones(1, inputs["input_ids"].shape[1] + forced_prefix.shape[1], dtype=torch.long),
    }
    # The text fires at a line's start and after a space alike (tests/test_trigger_forms.py).
    processor = TrieLogitsProcessor(countries, left_tok, trigger="Country:", on_complete="release")
    out = model.generate(**inputs, logits_processor=[processor], max_new_tokens=12, do_sample=False)
    entry = processor.match(out)[0]
    assert entry is not None and entry.name == "France"


def test_prefix_allowed_tokens_fn_drop_in(tiny_llama, tokenizer):
    entries = [[100, 200, 300], [100, 250], [400, 401]]
    trie = TokenTrie.from_sequences(entries, vocab_size=len(tokenizer))
    fn = prefix_allowed_tokens_fn(trie, end_token_id=2)
    prompt = torch.tensor([[5, 6, 7]])
    ours = TrieLogitsProcessor(trie, end_token_id=2)
    a = tiny_llama.generate(input_ids=prompt, prefix_allowed_tokens_fn=fn, max_new_tokens=5, do_sample=False, pad_token_id=2, eos_token_id=2)
    b = tiny_llama.generate(input_ids=prompt, logits_processor=[ours], max_new_tokens=5, do_sample=False, pad_token_id=2, eos_token_id=2)
    assert a.tolist() == b.tolist()
    # Outside generate a row alone does not say where its prompt ends (docs/transformers.md): prompt_length= does.
    with pytest.raises(ConstraintConfigError, match=r"must be called by generate\(\).*pass prompt_length="):
        fn(0, torch.tensor([5, 6, 7, 100]))
    stateless = prefix_allowed_tokens_fn(trie, end_token_id=2, prompt_length=3)
    assert stateless(0, torch.tensor([5, 6, 7, 100])) == [200, 250]


@pytest.mark.parametrize("kwargs", [
    dict(do_sample=False),
    dict(do_sample=True, top_k=0),
    dict(num_beams=3, num_return_sequences=3, do_sample=False),
])
def test_prefix_allowed_tokens_fn_is_reusable(tiny_llama, kwargs):
    """One function reused across generate calls with other prompt lengths and batch sizes, greedy, sampling and
    beam search (every beam of a prompt shares a batch_id), and a chained call whose prompt is the previous output:
    each call equals the processor's output on the same inputs, and with a fresh function."""
    entries = [[100, 200, 300], [100, 250], [400, 401], [400, 401, 402], [500]]
    trie = TokenTrie.from_sequences(entries, vocab_size=tiny_llama.config.vocab_size)
    fn = prefix_allowed_tokens_fn(trie, end_token_id=2)
    gen = dict(max_new_tokens=5, pad_token_id=2, eos_token_id=2, **kwargs)
    prompts = [torch.arange(10, 13).repeat(2, 1), torch.arange(20, 29).view(1, 9), torch.arange(30, 35).repeat(3, 1)]
    previous = None
    for ids in prompts + ["chained"]:
        if ids == "chained":
            ids = previous[:1]  # the previous output, EOS included, as the next prompt
        results = []
        for constraint in (dict(prefix_allowed_tokens_fn=fn),
                           dict(prefix_allowed_tokens_fn=prefix_allowed_tokens_fn(trie, end_token_id=2)),
                           dict(logits_processor=[TrieLogitsProcessor(trie, end_token_id=2)])):
            torch.manual_seed(0)
            results.append(tiny_llama.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **constraint, **gen))
        assert results[0].tolist() == results[1].tolist() == results[2].tolist()
        generated = results[0][:, ids.shape[1]:].tolist()
        assert all(tuple(t for t in row if t != 2) in {tuple(e) for e in entries} for row in generated), generated
        previous = results[0]


@pytest.mark.parametrize("kwargs", [
    dict(do_sample=False),
    dict(do_sample=True, num_return_sequences=3),
    dict(num_beams=5, num_return_sequences=5, do_sample=False),
    dict(num_beams=10, num_return_sequences=3, do_sample=False),
])
def test_prefix_allowed_tokens_fn_answers_every_row_as_a_fresh_walk(tiny_llama, kwargs):
    """The function remembers each row's node by its generated tokens and steps from the row one token shorter;
    at every step of every generate call, each row's allowed set (the finite scores after it masked them) equals a
    fresh function's answer from the whole row and the reference's, though beams are reordered between steps (a
    row's prefix is another row's of the step before plus a token), and a second call with the same function (its
    caches warm) writes the same."""
    from transformers import LogitsProcessor

    rng = np.random.default_rng(3)  # few tokens at many depths: a wrong node gives another set
    entries = sorted({tuple(rng.integers(100, 106, size=rng.integers(1, 6)).tolist()) for _ in range(60)})
    trie = TokenTrie.from_sequences(entries, vocab_size=tiny_llama.config.vocab_size)
    ids = torch.tensor([[5, 6, 7], [0, 8, 9]])
    fn = prefix_allowed_tokens_fn(trie, end_token_id=2)

    class Seen(LogitsProcessor):  # runs after generate's PrefixConstrainedLogitsProcessor
        def __call__(self, input_ids, scores):
            steps.append((input_ids[:, 3:].tolist(), [row.isfinite().nonzero().flatten().tolist() for row in scores]))
            return scores

    def fresh(row: tuple) -> list[int]:  # a new function (no cache) walking the whole row
        return prefix_allowed_tokens_fn(trie, end_token_id=2, prompt_length=3)(0, torch.tensor([5, 6, 7, *row]))

    outs, answers = [], {}
    for _ in range(2):
        steps: list = []
        torch.manual_seed(0)
        outs.append(tiny_llama.generate(input_ids=ids, attention_mask=(ids > 0).long(), prefix_allowed_tokens_fn=fn,
                                        logits_processor=[Seen()], max_new_tokens=7, pad_token_id=2, eos_token_id=2,
                                        **kwargs).tolist())
        assert len(steps) > 3
        for rows, finite in steps:
            for row, kept in zip(map(tuple, rows), finite):
                if row not in answers:
                    answers[row] = fresh(row)
                    assert answers[row] == sorted(allowed_after(entries, SpanRules(end_token_id=2), row)), row
                assert kept == answers[row], row
        if "num_beams" in kwargs:
            assert any(now[:-1] != before for (was, _), (rows, _) in zip(steps, steps[1:])
                       for before, now in zip(was, rows)), "no beam was reordered"
    assert outs[0] == outs[1]


def test_match_helpers():
    trie = TokenTrie.from_sequences([[5, 6], [5, 6, 7], [9]], vocab_size=12, names=["a", "b", "c"])
    assert [e.name if e else None for e in match(trie, [[5, 6, 1, 1], [5, 6, 7, 1], [9, 1, 0], [4, 1]])] == ["a", "b", "c", None]
    rules = SpanRules(end_token_id=1, on_complete="repeat", separator=(10,))
    assert [e.name for e in match_all(trie, [[5, 6, 10, 9, 10, 5, 6, 7, 1]], rules)[0]] == ["a", "c", "b"]


def test_raw_logits_are_not_masked(tiny_llama, tokenizer):
    """generate() keeps the tensor it hands to processors as the raw logits; the processor must not mask it."""
    trie = TokenTrie.from_sequences([[100, 101], [102]], vocab_size=len(tokenizer))
    processor = TrieLogitsProcessor(trie, end_token_id=2)
    out = tiny_llama.generate(
        input_ids=torch.tensor([[5, 6]]), logits_processor=[processor], max_new_tokens=3, do_sample=False,
        pad_token_id=2, eos_token_id=2, output_logits=True, output_scores=True, return_dict_in_generate=True,
    )
    assert out.logits[0].isfinite().all()
    assert out.scores[0].isfinite().sum().item() == 2  # tokens 100 and 102


def test_check_prompt_warns_with_the_fix(model, tokenizer):
    """check_prompt=True: a prompt ending with a space, and a trie form the model does not write after the prompt,
    each give a PromptMismatchWarning naming the fix; a prompt and trie that agree give none."""
    import warnings

    from trie_decode import PromptMismatchWarning

    names = ["France", "Germany", "Italy"]
    spaced = TokenTrie.from_strings(names, tokenizer, leading_space=True)
    bare = TokenTrie.from_strings(names, tokenizer, leading_space=False)
    cases = [("The answer is", spaced, []), ("The answer is ", spaced, ["trailing_space"]),
             ("The answer is", bare, ["form_mismatch"])]
    for prompt, trie, codes in cases:
        ids = tokenizer([prompt, prompt], return_tensors="pt")
        proc = TrieLogitsProcessor(trie, tokenizer, check_prompt=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.generate(**ids, logits_processor=[proc], max_new_tokens=1, do_sample=False)
        found = [w.message for w in caught if issubclass(w.category, PromptMismatchWarning)]
        assert [str(m).split(":")[0] for m in found] == codes, (prompt, found)
        assert all("Fix:" in str(m) for m in found)
    with pytest.raises(ConstraintConfigError, match="check_prompt=True needs the tokenizer"):
        TrieLogitsProcessor(spaced, check_prompt=True, end_token_id=0)
