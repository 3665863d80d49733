"""A trigger given as text fires wherever the model writes that text: at a line's start and after a space.

A token trigger is compared as token ids, and one text has several: SentencePiece writes ``"Answer:"`` as
``▁Answer :`` after a space but ``Answer :`` after a newline; byte-level BPE writes ``Answer :`` at a line's start
and ``ĠAnswer :`` after a space. With one form only, a row whose text reaches the trigger in another form stayed
unconstrained, silently. ``SpanRules.trigger_forms`` holds the other forms (``options.trigger_forms`` computes them
from the text); the step checks every form (the state-machine tests of ``reference.SPAN_RULE_CASES`` include a
trigger of several forms).
"""

from __future__ import annotations

import pytest
import torch

from trie_decode import TokenTrie
from trie_decode.constraint import SpanRules, TrieConstraint
from trie_decode.errors import ConstraintConfigError
from trie_decode.options import rule_args, trigger_forms

from model_fixtures.tokenizer_zoo import FAMILIES, load_tokenizer
from reference import first_refused


def test_forms_are_checked_and_kept_once():
    rules = SpanRules(end_token_id=2, trigger=[7, 8], trigger_forms=[[9, 8], (7, 8), [9, 8], [4]])
    assert rules.triggers == ((7, 8), (9, 8), (4,)) and rules.trigger_len == 2
    assert SpanRules(end_token_id=2).triggers == () and SpanRules(end_token_id=2).trigger_len == 0
    for forms, message in (([[5]], "give trigger= too"), ([[]], "an empty form"), ([5, 6], "got the id 5"),
                           ("ab", "a list of token-id lists"), ([[-1]], "negative token id")):
        with pytest.raises(ConstraintConfigError, match=message):
            SpanRules(end_token_id=2, trigger=[7] if message != "give trigger= too" else (), trigger_forms=forms)
    with pytest.raises(Exception, match="trigger token 99 is outside"):
        SpanRules(end_token_id=2, trigger=[7], trigger_forms=[[99]]).check_vocab(50)


def test_ids_need_no_tokenizer_and_get_no_other_forms():
    assert trigger_forms([5, 6], None) == () and trigger_forms("Answer:", None) == ()
    assert SpanRules(**rule_args(None, 2, "eos", None, [5, 6])).triggers == ((5, 6),)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_fires_at_a_line_start_and_after_a_space(family):
    """The ids each tokenizer writes for ``"Answer:"`` inside a whole text, after a newline and after a space,
    end with one of the rule's forms, and a constraint started on either text starts inside the trie."""
    tok = load_tokenizer(family)
    eos = tok.eos_token_id if tok.eos_token_id is not None else 0
    rules = SpanRules(**rule_args(tok, eos, "eos", None, "Answer:"))
    trie = TokenTrie.from_sequences([[100, 101]], vocab_size=len(tok))
    c = TrieConstraint(trie, rules, "cpu")
    for text in ("Question: where is Paris?\nAnswer:", "Question: where is Paris? Answer:"):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert any(tuple(ids[-len(f):]) == f for f in rules.triggers), (family, text, ids[-4:], rules.triggers)
        state = c.start(1, tails=torch.tensor([ids[-rules.trigger_len:]]))
        assert int(state.node) == 0, (family, text)  # inside the trie, at its root
    # without the other forms (the trigger's own ids only) one of the two texts stayed free: the bug this fixes
    plain = TrieConstraint(trie, SpanRules(eos, trigger=rules.trigger), "cpu")
    started = [int(plain.start(1, tails=torch.tensor([tok(t, add_special_tokens=False)["input_ids"][-8:]])).node) == 0
               for t in ("Question: where is Paris?\nAnswer:", "Question: where is Paris? Answer:")]
    assert started.count(True) == 1, (family, started)


def test_real_model_is_constrained_after_the_trigger_written_after_a_space(model, tokenizer):
    """SmolLM2 (byte-level BPE): the prompt ends with ``ĠAnswer :`` (after a space). With ``trigger="Answer:"`` the
    output is an entry at once (the trigger's own ids, ``Answer :``, alone would have left it free)."""
    from trie_decode.integrations.transformers import TrieLogitsProcessor

    colors = ["red", "green", "blue", "yellow"]
    trie = TokenTrie.from_strings(colors, tokenizer)
    inputs = tokenizer(["Which color is the sky on a clear day? Answer:"], return_tensors="pt")
    processor = TrieLogitsProcessor(trie, tokenizer, trigger="Answer:")
    assert inputs["input_ids"][0, -2:].tolist() in [list(f) for f in processor.rules.triggers]
    assert inputs["input_ids"][0, -2:].tolist() != list(processor.rules.trigger)
    out = tokenizer.eos_token_id
    full = model.generate(**inputs, logits_processor=[processor], max_new_tokens=6, do_sample=False,
                          pad_token_id=out)
    generated = full[0, inputs["input_ids"].shape[1]:]
    entry = processor.match(full)[0]
    assert entry is not None and entry.name in colors, tokenizer.decode(generated)
    assert first_refused(trie.sequences(), processor.rules, generated.tolist(),
                         prompt_tail=inputs["input_ids"][0].tolist()) is None


def test_a_text_that_starts_with_a_space_keeps_it(tokenizer):
    """``" Answer:"`` is text after a space only: no line-start form (a line's "Answer:" does not end with it)."""
    spaced = tuple(tokenizer(" Answer:", add_special_tokens=False)["input_ids"])
    assert SpanRules(**rule_args(tokenizer, 2, "eos", None, " Answer:")).triggers == (spaced,)
    assert len(SpanRules(**rule_args(tokenizer, 2, "eos", None, "Answer:")).triggers) == 2
