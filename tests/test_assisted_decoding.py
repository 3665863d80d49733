"""TrieLogitsProcessor under transformers' assisted decoding: prompt lookup and an assistant model.

Assisted decoding calls the processors on candidate prefixes that are then partly rejected, so a call's prefix may
be shorter than the last call's, and a prompt lookup or the assistant model's own ``generate`` call them between the
loop's calls. Greedy assisted decoding returns exactly the tokens of plain greedy decoding, so each case here
compares the two on the real model (before the fix, prompt lookup restarted the trie mid-entry and wrote
``" Brazilian American American ..."``).
"""

from __future__ import annotations

import pytest
import torch

from trie_decode import Span, TokenTrie, Template
from trie_decode.integrations.transformers import TrieLogitsProcessor

SIGN_LANGUAGES = ["Brazilian Sign Language", "British Sign Language", "French Sign Language",
                  "Japanese Sign Language", "American Sign Language"]
TEXT = "Deaf people in Rio use Brazilian Sign Language; in Lyon, French Sign Language; in Osaka, Japanese Sign Language."


@pytest.fixture(scope="module")
def sign_languages(tokenizer):
    return TokenTrie.from_strings(SIGN_LANGUAGES, tokenizer, leading_space=True)


def _both(model, tokenizer, prompt: str, make, assist: dict, max_new_tokens: int = 24):
    """Plain greedy and assisted greedy outputs, each with a new processor from ``make()``."""
    inputs = tokenizer(prompt, return_tensors="pt")
    outs = []
    for extra in ({}, assist):
        processor = make()
        outs.append((model.generate(**inputs, logits_processor=[processor], max_new_tokens=max_new_tokens,
                                    do_sample=False, **extra), processor))
    return inputs["input_ids"].shape[1], outs


@pytest.mark.parametrize("assist", [{"prompt_lookup_num_tokens": 3}, {"prompt_lookup_num_tokens": 10}, "tiny"],
                         ids=["lookup-3", "lookup-10", "assistant"])
def test_assisted_greedy_equals_greedy(model, tiny_llama, tokenizer, sign_languages, assist):
    assist = {"assistant_model": tiny_llama} if assist == "tiny" else assist
    start, [(plain, _), (assisted, processor)] = _both(
        model, tokenizer, f"Text: {TEXT}\nThe language used in Rio is", lambda: TrieLogitsProcessor(sign_languages, tokenizer),
        assist)
    assert processor.match(assisted)[0] is not None
    assert assisted.tolist() == plain.tolist(), tokenizer.decode(assisted[0, start:])


@pytest.mark.parametrize("distinct", [False, True], ids=["static-filter", "distinct-list"])
def test_assisted_lists_with_filters_equal_greedy(model, tokenizer, sign_languages, distinct):
    # A list of entries (on_complete="repeat"): a deny filter keeps each state of the prefix (a trail); a distinct
    # list changes the filters at every entry, so a rewind feeds the prefix again from the start.
    def make():
        return TrieLogitsProcessor(sign_languages, tokenizer, on_complete="repeat", separator=",",
                                   deny=["British Sign Language"], distinct=distinct)

    prompt = f"Text: {TEXT}\nEvery sign language in the text, separated by commas:"
    for assist in ({"prompt_lookup_num_tokens": 4}, {"prompt_lookup_num_tokens": 2}):
        start, [(plain, _), (assisted, processor)] = _both(model, tokenizer, prompt, make, assist, max_new_tokens=30)
        assert assisted.tolist() == plain.tolist(), tokenizer.decode(assisted[0, start:])
        names = [e.name for e in processor.match_all(assisted)[0]]
        assert names and "British Sign Language" not in names
        if distinct:
            assert len(names) == len(set(names))


def test_assisted_template_equals_greedy(model, tokenizer):
    cities = ["Rio de Janeiro", "Lyon", "Osaka", "Paris"]
    template = Template('{"city": "{city}", "language": "{language}"}', city=cities, language=SIGN_LANGUAGES)
    prompt = (f"Text: {TEXT}\nAs JSON, the first city and its language: "
              '{"city": "Paris", "language": "French Sign Language"} is an example of the format. Answer: ')
    start, [(plain, _), (assisted, _)] = _both(model, tokenizer, prompt,
                                               lambda: TrieLogitsProcessor(tokenizer=tokenizer, template=template),
                                               {"prompt_lookup_num_tokens": 5}, max_new_tokens=40)
    assert assisted.tolist() == plain.tolist(), tokenizer.decode(assisted[0, start:])
    text = tokenizer.decode(assisted[0, start:], skip_special_tokens=True)
    assert text.startswith('{"city": "') and any(f'"language": "{name}"}}' in text for name in SIGN_LANGUAGES), text


def test_assisted_spans_equal_greedy(model, tokenizer):
    spans = [Span(SIGN_LANGUAGES, after='"language": "', end='"')]
    prompt = f'Text: {TEXT}\nAnswer in JSON, e.g. {{"language": "French Sign Language"}}. Rio uses: {{"language": "'
    start, [(plain, _), (assisted, _)] = _both(model, tokenizer, prompt,
                                               lambda: TrieLogitsProcessor(tokenizer=tokenizer, spans=spans),
                                               {"prompt_lookup_num_tokens": 3}, max_new_tokens=16)
    assert assisted.tolist() == plain.tolist(), tokenizer.decode(assisted[0, start:])


def test_assisted_sampling_stays_in_the_trie(model, tokenizer, sign_languages):
    inputs = tokenizer(f"Text: {TEXT}\nThe language used in Osaka is", return_tensors="pt")
    for seed in range(3):
        processor = TrieLogitsProcessor(sign_languages, tokenizer)
        torch.manual_seed(seed)
        out = model.generate(**inputs, logits_processor=[processor], max_new_tokens=12, do_sample=True,
                             temperature=1.5, prompt_lookup_num_tokens=4)
        entry = processor.match(out)[0]
        assert entry is not None, tokenizer.decode(out[0, inputs["input_ids"].shape[1]:])
        tail = out[0, inputs["input_ids"].shape[1] + len(entry.tokens):].tolist()
        assert tail[:1] == [tokenizer.eos_token_id]


def test_the_same_processor_serves_plain_and_assisted_calls(model, tokenizer, sign_languages):
    # One instance across generate calls of both kinds: each call starts afresh.
    processor = TrieLogitsProcessor(sign_languages, tokenizer)
    inputs = tokenizer(f"Text: {TEXT}\nThe language used in Lyon is", return_tensors="pt")
    first = model.generate(**inputs, logits_processor=[processor], max_new_tokens=10, do_sample=False,
                           prompt_lookup_num_tokens=3)
    second = model.generate(**inputs, logits_processor=[processor], max_new_tokens=10, do_sample=False)
    third = model.generate(**inputs, logits_processor=[processor], max_new_tokens=10, do_sample=False,
                           prompt_lookup_num_tokens=3)
    assert first.tolist() == second.tolist() == third.tolist()
    assert processor.match(first)[0] is not None


@pytest.mark.parametrize("assist", [{"prompt_lookup_num_tokens": 3}, "tiny"], ids=["lookup", "assistant"])
def test_assisted_decoding_outside_the_verified_transformers(model, tiny_llama, tokenizer, sign_languages, monkeypatch,
                                                             assist):
    # The general path reads no loop's locals; the LogitsProcessorList calling it still tells one generation's calls.
    from trie_decode.integrations import transformers_internals as internals

    assist = {"assistant_model": tiny_llama} if assist == "tiny" else assist
    prompt = f"Text: {TEXT}\nThe language used in Rio is"
    _, [(plain, _), _] = _both(model, tokenizer, prompt, lambda: TrieLogitsProcessor(sign_languages, tokenizer), {})
    monkeypatch.setattr(internals, "_VERIFIED", False)
    monkeypatch.setattr(internals, "_warned", set())
    with pytest.warns(internals.UnverifiedTransformersWarning, match="general path"):
        _, [_, (assisted, _)] = _both(model, tokenizer, prompt, lambda: TrieLogitsProcessor(sign_languages, tokenizer),
                                      assist)
    assert assisted.tolist() == plain.tolist()
