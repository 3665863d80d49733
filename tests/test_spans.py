"""Text spans (catalog-valued fields inside free text and JSON): the step engine against a brute-force reference,
and the real model writing JSON whose fields are catalog entries, alone and beside XGrammar's JSON-schema processor.

Spans are data the one step engine reads (``SpanRules(fields=...)``, :mod:`trie_decode.fields`): every kernel is
checked against ``tests/reference.py``'s ``FieldReference`` on random vocabularies, tries and walks.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trie_decode import TokenTrie
from trie_decode.constraint import SpanRules, TrieConstraint
from trie_decode.errors import ConstraintConfigError, EmptyTrieError, InvalidEntryError, InvalidTokenError
from trie_decode.fields import FieldRules, Span
from trie_decode.spans import FREE
from trie_decode.text_spans import Trigger, end_token_table, vocabulary_bytes

from reference import FieldReference

KERNELS = ["native", "numpy", "torch"]


def _vocab(rng: random.Random) -> list[bytes]:
    """A byte-level vocabulary with the pieces JSON needs and random short words (duplicates allowed)."""
    base = [b"<eos>", b'{"', b"city", b"country", b'":', b' "', b'"', b'",', b'"}', b", ", b"\n", b'"\n', b' "\'']
    letters = [bytes([rng.choice(b"abcPRx'")]) * rng.randint(1, 2) for _ in range(rng.randint(6, 14))]
    return base + letters


@st.composite
def cases(draw):
    seed = draw(st.integers(0, 10_000))
    rng = random.Random(seed)
    vocab = _vocab(rng)
    words = list(range(13, len(vocab)))
    spans = []
    for _ in range(draw(st.integers(1, 2))):
        values = {tuple(rng.choice(words) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 6))}
        spans.append(sorted(values))
    afters = [b'"city": "', b'"country": "'][: len(spans)]
    ends = [b'"', draw(st.sampled_from([b'"', b"\n"]))][: len(spans)]  # spans may end differently
    return seed, vocab, spans, afters, ends


def _constraint(vocab, spans, afters, kernel, ends=(b'"', b'"')):
    tries = [TokenTrie.from_sequences([list(v) for v in span], vocab_size=len(vocab)) for span in spans]
    fields = FieldRules.from_tokens(tries, [a.decode() for a in afters], [e.decode() for e in ends[: len(spans)]], vocab)
    return TrieConstraint(tries, SpanRules(end_token_id=0, on_complete="release", fields=fields), "cpu", kernel=kernel)


@settings(max_examples=40, deadline=None)
@given(cases())
def test_every_kernel_follows_the_reference_on_random_walks(case):
    seed, vocab, spans, afters, ends = case
    rng = random.Random(seed + 1)
    ref = FieldReference(spans, afters, ends, vocab)
    # A prompt tail that ends in the middle of a trigger, so some walks complete it with their first tokens.
    prompt = [1, 2, 4] if rng.random() < 0.5 else [9]
    script = [5] + [rng.randrange(len(vocab)) for _ in range(30)]
    constraints = [_constraint(vocab, spans, afters, k, ends) for k in KERNELS]
    states = [c.start(1, tails=torch.tensor([prompt])) for c in constraints]
    rstate = ref.start(b"".join(vocab[t] for t in prompt))
    for want in script:
        allowed = ref.allowed(rstate)
        for c, s in zip(constraints, states):
            got = c.mask_(torch.zeros(1, len(vocab)), s)[0].isfinite().nonzero().flatten().tolist()
            assert set(got) == (set(range(len(vocab))) if allowed is None else allowed), (c.kernel.name, rstate)
        options = sorted(range(len(vocab)) if allowed is None else allowed)
        tok = want if want in options else rng.choice(options)
        rstate = ref.step(rstate, tok)
        states = [c.advance(s, torch.tensor([tok])) for c, s in zip(constraints, states)]


@settings(max_examples=30, deadline=None)
@given(cases(), st.data())
def test_a_prompt_that_ends_inside_a_value_starts_where_its_tokens_lead(case, data):
    """A prompt ending with ``after`` and the first tokens of a value (``'"city": "Rey'``) starts at their node, as
    if the row had written them: every kernel masks as the reference does from there; one that closes the value, or
    whose tokens are no path of the trie, starts in free text (the latter with a warning)."""
    seed, vocab, spans, afters, ends = case
    k = data.draw(st.integers(0, len(spans) - 1))
    value = data.draw(st.sampled_from(spans[k]))
    cut = data.draw(st.integers(1, len(value)))
    opening = [1, 2, 4, 5] if k == 0 else [1, 3, 4, 5]  # '{"' 'city'/'country' '":' ' "': ends with after k
    ref = FieldReference(spans, afters, ends, vocab)
    for kernel in KERNELS:
        c = _constraint(vocab, spans, afters, kernel, ends)
        s = c.start(1, tails=torch.tensor([opening + list(value[:cut])]))
        assert (int(s.tree[0]), int(s.node[0])) == (k, c.tries[k].walk(value[:cut])), kernel
        want = ref.allowed(("in", k, tuple(value[:cut])))
        assert set(c.mask_(torch.zeros(1, len(vocab)), s)[0].isfinite().nonzero().flatten().tolist()) == want
    if cut == len(value):  # a closed value, then more text: free, no warning
        closed = opening + list(value) + [int(c.rules.fields.ends[k].ids[0]), 9]
        assert int(c.start(1, tails=torch.tensor([closed])).node[0]) == FREE
    off = [t for t in range(13, len(vocab)) if c.tries[k].step(0, t) < 0]
    if off:  # a value the trie does not hold: free, and said
        with pytest.warns(UserWarning, match=f"the prompt ends inside a value of span {k}"):
            assert int(c.start(1, tails=torch.tensor([opening + off[:1]])).node[0]) == FREE


@pytest.mark.model
def test_a_prompt_into_a_value_with_the_real_tokenizer(model, tokenizer):
    """SmolLM2: ``'{"city": "Rey'`` ('R', 'ey': the first tokens of Reyburn in the span's trie) is finished as that
    entry (unconstrained, the model writes Reykjavik); an instruction that quotes the ``after`` before the chat
    template's turn ends starts free, without a warning; ``'{"city": "Reykj'`` (no value goes on with 'k') starts free, with one."""
    import warnings

    from trie_decode.integrations.transformers import TrieLogitsProcessor

    spans = [Span(["Paris", "Reyburn", "Oslo"], after='"city": "')]
    base = tokenizer.apply_chat_template([{"role": "user", "content": 'Name a city in Iceland, as {"city": "'}],
                                         tokenize=False, add_generation_prompt=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        proc = TrieLogitsProcessor(tokenizer=tokenizer, spans=spans)
        enc = tokenizer(base + '{"city": "Rey', return_tensors="pt")
        out = model.generate(**enc, logits_processor=[proc], max_new_tokens=6, do_sample=False)
        assert tokenizer.decode(out[0, enc["input_ids"].shape[1]:]).startswith('burn"')
        fields = proc.constraint("cpu").rules.fields
        assert fields.start_state(tokenizer(base)["input_ids"])[2] == FREE  # the quote, then <|im_end|>: free
    with pytest.warns(UserWarning, match="'Reykj' after its after text"):
        assert fields.start_state(tokenizer(base + '{"city": "Reykj')["input_ids"])[2] == FREE


def test_a_value_can_only_end_where_an_entry_is_complete_and_then_any_end_token_closes_it():
    vocab = [b"<eos>", b'{"', b"city", b'":', b' "', b"Par", b"is", b"ian", b'",', b'"}', b'"', b"Rome"]
    trie = TokenTrie.from_sequences([[5, 6], [5, 6, 7], [11]], vocab_size=len(vocab), names=["Paris", "Parisian", "Rome"])
    fields = FieldRules.from_tokens([trie], ['"city": "'], '"', vocab)
    c = TrieConstraint([trie], SpanRules(end_token_id=0, on_complete="release", fields=fields), "cpu")
    s = c.start(1, tails=torch.tensor([[1, 2, 3]]))
    seen = []
    for tok in [4, 5, 6, 7, 9]:
        seen.append(c.mask_(torch.zeros(1, len(vocab)), s)[0].isfinite().nonzero().flatten().tolist())
        s = c.advance(s, torch.tensor([tok]))
    assert seen == [list(range(12)), [5, 11], [6], [7, 10], [3, 8, 9, 10]]  # every token beginning with the quote
    assert s.node.tolist() == [-2]  # closed: free text again



@pytest.mark.parametrize("kernel", KERNELS)
def test_an_id_past_the_vocabulary_in_free_text_writes_no_text(kernel):
    """Logits wider than the vocabulary (a model's padded embeddings): a free row may sample such an id (in vLLM, a
    client's logit_bias can make it). It writes no text: the row's automaton stays where it was, at batch 1 and in a
    batch. Before, the automaton raised InvalidTokenError, which in vLLM's engine stopped every request."""
    vocab = [b"<eos>", b'{"', b"city", b'":', b' "', b"Par", b"is", b"ian", b'",', b'"}', b'"', b"Rome"]
    trie = TokenTrie.from_sequences([[5, 6], [11]], vocab_size=len(vocab))
    fields = FieldRules.from_tokens([trie], ['"city": "'], '"', vocab)
    c = TrieConstraint([trie], SpanRules(end_token_id=0, on_complete="release", fields=fields), "cpu", kernel=kernel)
    padded = len(vocab) + 3
    for rows in (1, 3):
        s = c.start(rows)
        for tok in [1, 2, padded, 3, padded, 4]:  # '{"city' <padded> '":' <padded> ' "': the span starts
            s = c.advance(s, torch.full((rows,), tok))
        assert s.node.tolist() == [0] * rows
        assert c.mask_(torch.zeros(rows, padded + 1), s).isfinite().nonzero()[:, 1].tolist() == [5, 11] * rows

def test_the_bare_end_is_not_a_byte_fallback_piece():
    """Of the shortest end tokens, the bare end (a complete entry that prefixes a longer one) is not a byte-fallback
    piece (``<0x22>``, id 3 here) where an ordinary token (id 9) spells the same bytes; else the lowest id."""
    vocab = [b"<eos>", b'{"', b"city", b'"', b"Paris", b" Texas", b'",', b'"}', b"x", b'"']
    trie = TokenTrie.from_sequences([[4], [4, 5]], vocab_size=len(vocab), names=["Paris", "Paris Texas"])
    triggers = FieldRules.from_tokens([trie], ['{"city'], '"', vocab).triggers
    end = end_token_table('"', vocab)
    assert FieldRules(triggers, end, vocab, [trie], byte_pieces={3}).bare_end == 9
    assert FieldRules(triggers, end, vocab, [trie]).bare_end == 3
    assert FieldRules(triggers, end, vocab, [trie], byte_pieces={3, 9}).bare_end == 3
    # The narrowest logits the constraint masks hold every end token (the trie's tokens stop at id 5).
    fields = FieldRules(triggers, end, vocab, [trie], byte_pieces={3})
    c = TrieConstraint([trie], SpanRules(end_token_id=0, on_complete="release", fields=fields), "cpu")
    assert c.needed_width == len(vocab)
    s = c.start(1, tails=torch.tensor([[1, 2]]))
    s = c.advance(s, torch.tensor([4]))  # "Paris": complete, and "Paris Texas" goes on
    assert c.mask_(torch.zeros(1, c.needed_width), s)[0].isfinite().nonzero().flatten().tolist() == [5, 9]


def test_options_that_do_not_combine_with_spans_are_named(tokenizer):
    from trie_decode.integrations.transformers import TrieLogitsProcessor

    span = Span(["Paris"], after='"city": "')
    with pytest.raises(ConstraintConfigError, match="trigger"):
        TrieLogitsProcessor(tokenizer=tokenizer, spans=[span], trigger="x")
    with pytest.raises(ConstraintConfigError, match="tokenizer"):
        TrieLogitsProcessor(spans=[span])
    with pytest.raises(ConstraintConfigError, match="not both"):
        TrieLogitsProcessor(TokenTrie.from_sequences([[1]], vocab_size=10), tokenizer, spans=[span])
    with pytest.raises(InvalidEntryError, match=r"contains the span's end '\"'.*give escape='json'.*Span\.end"):
        TrieLogitsProcessor(tokenizer=tokenizer, spans=[Span(['say "hi"'], after="q: ", end='"', escape=None)])
    with pytest.raises(InvalidEntryError) as err:  # escaping would not take '. ' out of the value: not offered
        TrieLogitsProcessor(tokenizer=tokenizer, spans=[Span(["St. Louis"], after="q: ", end=". ")])
    assert "escape" not in str(err.value) and "give the span another end (Span.end)" in str(err.value)
    # Errors about values name the span they belong to (several spans may be given).
    with pytest.raises(EmptyTrieError, match=r"^Span after '\"city\": \"' has no values: give at least one$"):
        TrieLogitsProcessor(tokenizer=tokenizer, spans=[span, Span([], after='"city": "')])
    with pytest.raises(InvalidEntryError, match=r"^Span after 'q: ' value 1 must be a non-empty string"):
        TrieLogitsProcessor(tokenizer=tokenizer, spans=[Span(["a", ""], after="q: ")])
    with pytest.raises(ConstraintConfigError, match="after"):
        Span(["Paris"], after="")
    with pytest.raises(ConstraintConfigError, match="Span.values must be a TokenTrie or a list of strings, got NoneType"):
        Span(None, after="A: ")
    with pytest.raises(ConstraintConfigError, match=r"end_token_id must be a non-negative token id, got -1"):
        FieldRules.build([Span(["Paris"], after="A: ", end=None)], tokenizer, end_token_id=-1)
    with pytest.raises(InvalidTokenError, match=r"token 99999, which closes a span's value, is outside the vocabulary"):
        FieldRules.build([Span(["Paris"], after="A: ", end=None)], tokenizer, end_token_id=99999)
    with pytest.raises(ConstraintConfigError, match="needs tries"):
        TrieLogitsProcessor()


@pytest.mark.parametrize("afters", [['"city": "', '"city": "'], ['": "', '"city": "'],
                                    [Trigger('"city": "', whitespace="any"), '"city": "']])
def test_a_span_that_an_earlier_span_always_preempts_is_refused(afters):
    """Where several patterns complete at one byte the earliest span is entered, so a span whose ``after`` is an
    earlier span's (or ends with it, or is matched by its whitespace-tolerant form) would never start: its catalog
    silently unused. Refused, naming both spans; the other order is fine."""
    vocab = [b"<eos>", b'{"', b"city", b'":', b' "', b"Paris", b"x", b'"']
    tries = [TokenTrie.from_sequences([[6]], vocab_size=len(vocab)), TokenTrie.from_sequences([[5]], vocab_size=len(vocab))]
    with pytest.raises(ConstraintConfigError, match=r"span 1 \(after '\"city\": \"'\) can never start.*span 0's"):
        FieldRules.from_tokens(tries, afters, '"', vocab)
    if afters[0] != afters[1]:
        fields = FieldRules.from_tokens(tries[::-1], afters[::-1], '"', vocab)
        state = fields.triggers.feed_token_ids(0, [1, 2, 3, 4])
        assert fields.triggers.triggers.completed(state) == 0


def test_a_span_whose_after_holds_another_spans_after_is_refused():
    """An exact ``after`` that holds another span's ``after`` before its end never completes: the other span is
    entered on the way. The name span of ``'"id": "1", "name": "'`` was silently unused (measured on SmolLM2, the
    row wrote the id span's values instead). A whitespace-tolerant pattern may be written otherwise: left alone."""
    vocab = [b"<eos>", b'{"', b"id", b'":', b' "', b"Paris", b"1", b'"', b", ", b"name"]
    tries = [TokenTrie.from_sequences([[6]], vocab_size=len(vocab)), TokenTrie.from_sequences([[5]], vocab_size=len(vocab))]
    afters = ['"id": "', '"id": "1", "name": "']
    with pytest.raises(ConstraintConfigError, match=r"span 1 \(after '\"id\": \"1\", \"name\": \"'\) can never "
                                                    r"start: its after text holds span 0's after text '\"id\": \"'"):
        FieldRules.from_tokens(tries, afters, '"', vocab)
    FieldRules.from_tokens(tries, [afters[0], Trigger(afters[1], whitespace="any")], '"', vocab)


@pytest.mark.parametrize("after,end", [('"', '"'), ('"', '"}'), (": ", ", x: ")])
def test_a_span_whose_end_completes_an_after_is_refused(after, end):
    """A value's end text that completes an ``after`` opens another value at once: with ``after='"'``, ``end='"'``
    SmolLM2 wrote ``Rome"Rome"Rome"...`` until max_new_tokens (the output could never end)."""
    vocab = [b"<eos>", b'"', b"Rome", b'"}', b": ", b", x: ", b"x"]
    tries = [TokenTrie.from_sequences([[2]], vocab_size=len(vocab))]
    with pytest.raises(ConstraintConfigError, match=r"span 0's end .* completes span 0's after .*could never end"):
        FieldRules.from_tokens(tries, [after], end, vocab)
    FieldRules.from_tokens(tries, ['x"'], end, vocab)  # an after its end does not complete


def test_the_tries_are_one_per_span():
    """More tries than spans failed with an IndexError inside the device trie; fewer were taken, and a row entering
    a span without a trie of its own masked with no catalog."""
    from trie_decode.constraint import TrieConstraint

    vocab = [b"<eos>", b'"', b"Rome", b"Oslo", b"a: ", b"b: "]
    tries = [TokenTrie.from_sequences([[2]], vocab_size=len(vocab)), TokenTrie.from_sequences([[3]], vocab_size=len(vocab))]
    fields = FieldRules.from_tokens(tries, ["a: ", "b: "], '"', vocab)
    rules = SpanRules(end_token_id=0, on_complete="release", fields=fields)
    for wrong in (tries[:1], tries + tries[:1]):
        with pytest.raises(ConstraintConfigError, match=rf"fields have 2 spans .* {len(wrong)} tries were given"):
            TrieConstraint(wrong, rules, "cpu")
    TrieConstraint(tries, rules, "cpu")


# ------------------------------------------------------------------------------------------------ the real model
CITIES = ["Paris", "Rome", "Berlin", "Madrid", "Tokyo", "Lima", "Cairo", "Ottawa", "Canberra", "Lisbon", "Vienna",
          "Athens", "Dublin", "Oslo", "Nairobi", "Seoul", "Hanoi", "Bogotá", "Quito", "Kyiv", "São Paulo", "Zürich"]
LANDMARKS = ["the Eiffel Tower", "the Colosseum", "the Brandenburg Gate", "the Prado", "Shibuya Crossing",
             "the Plaza Mayor of Lima", "the Egyptian Museum", "Parliament Hill", "the Parliament House of Australia",
             "the Belém Tower", "Schönbrunn Palace", "the Acropolis", "Trinity College", "the Opera House of Norway",
             "the Kenyatta Centre", "Gyeongbokgung", "Hoan Kiem Lake", "the Gold Museum"]


def _prompts(tokenizer, n):
    out = []
    for i in range(n):
        place = LANDMARKS[i % len(LANDMARKS)]
        q = f'Where is {place}? Answer in JSON with the keys "city" and "country".' + (" Be brief." if i >= len(LANDMARKS) else "")
        out.append(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True))
    return out


@pytest.fixture(scope="module")
def spans(country_names):
    return [Span(CITIES, after='"city": "'), Span(country_names, after='"country": "')]


def _check_outputs(texts, country_names):
    assert texts
    for text in texts:
        obj = json.loads(text)
        assert obj["city"] in CITIES and obj["country"] in country_names, text


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("do_sample", [False, True])
def test_json_fields_beside_xgrammar_are_valid_json_and_catalog_entries(model, tokenizer, spans, country_names, do_sample):
    """64 prompts, XGrammar's JSON-schema processor (the shape) and the spans (the catalog-valued fields): every
    output parses and both fields are entries of their catalogs."""
    import xgrammar as xgr  # installed with vLLM (the pinned environment runs this file)
    from xgrammar.contrib.hf import LogitsProcessor as XGrammarProcessor

    from trie_decode.integrations.transformers import TrieLogitsProcessor

    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model.config.vocab_size)
    grammar = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=False)
    tokenizer.padding_side = "left"
    prompts = _prompts(tokenizer, 64)
    texts = []
    torch.manual_seed(0)
    for lo in range(0, len(prompts), 16):
        enc = tokenizer(prompts[lo:lo + 16], return_tensors="pt", padding=True)
        procs = [XGrammarProcessor(grammar), TrieLogitsProcessor(tokenizer=tokenizer, spans=spans)]
        out = model.generate(**enc, logits_processor=procs, max_new_tokens=40, do_sample=do_sample,
                             pad_token_id=tokenizer.pad_token_id)
        texts += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    _check_outputs(texts, country_names)


@pytest.mark.model
def test_json_fields_alone_after_a_json_prompt(model, tokenizer, spans, country_names):
    """Without a grammar: the prompt opens the object, the spans keep both values in their catalogs."""
    from trie_decode.integrations.transformers import TrieLogitsProcessor

    _check_outputs(_json_answers(model, tokenizer, TrieLogitsProcessor(tokenizer=tokenizer, spans=spans), 8),
                   country_names)


def _json_answers(model, tokenizer, proc, n):
    """Greedy answers to ``n`` prompts that end by opening the JSON object (``{"city": "``), up to its ``}``."""
    tokenizer.padding_side = "left"
    prompts = [p + '{"city": "' for p in _prompts(tokenizer, n)]
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    out = model.generate(**enc, logits_processor=[proc], max_new_tokens=24, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return ['{"city": "' + t.split("}")[0] + "}" for t in texts]


def test_a_span_filter_is_its_trie_restricted(tokenizer):
    """``Span(allow=, deny=)``: a static filter, built into the span's trie: the same allowed tokens at every step as a
    span of only the kept values; unknown keys and filters that keep nothing are named."""
    from trie_decode.fields import FieldRules

    kept = [c for c in CITIES if c not in ("Paris", "Bogotá")]
    filtered = FieldRules.build([Span(CITIES, after='"city": "', deny=["Paris", "Bogotá"])], tokenizer)
    plain = FieldRules.build([Span(kept, after='"city": "')], tokenizer)
    assert filtered[0][0].sequences() == plain[0][0].sequences()
    assert filtered[0][0].names() == kept
    only = FieldRules.build([Span(CITIES, after='"city": "', allow=["Rome", "Lima", "Oslo"], deny=["Oslo"])], tokenizer)
    assert only[0][0].names() == ["Rome", "Lima"]
    unknown = r"Span after '\"city\": \"' deny: 1 keys are not entries of the trie, e.g. \['Atlantis'\]"
    with pytest.raises(ConstraintConfigError, match=unknown):
        FieldRules.build([Span(CITIES, after='"city": "', deny=["Atlantis"])], tokenizer)
    with pytest.raises(ConstraintConfigError, match="leave none of the 22 entries"):
        FieldRules.build([Span(CITIES, after='"city": "', allow=["Rome"], deny=["Rome"])], tokenizer)
    with pytest.raises(ConstraintConfigError, match="Span.deny must be a list"):
        Span(CITIES, after='"city": "', deny="Paris")


@pytest.mark.model
def test_a_denied_value_is_never_written(model, tokenizer, country_names):
    """The model's own answer for the Eiffel Tower is Paris; with Paris denied in the city span every output keeps
    a city of the catalog that is not Paris."""
    from trie_decode.integrations.transformers import TrieLogitsProcessor

    spans = [Span(CITIES, after='"city": "'), Span(country_names, after='"country": "')]
    plain = _json_answers(model, tokenizer, TrieLogitsProcessor(tokenizer=tokenizer, spans=spans), 4)
    assert any(json.loads(t)["city"] == "Paris" for t in plain)  # the filter has work to do
    spans[0] = Span(CITIES, after='"city": "', deny=["Paris"])
    texts = _json_answers(model, tokenizer, TrieLogitsProcessor(tokenizer=tokenizer, spans=spans), 4)
    _check_outputs(texts, country_names)
    assert all(json.loads(t)["city"] != "Paris" for t in texts), texts


def test_a_span_without_end_closes_with_the_end_token(tokenizer):
    """``Span(end=None)``: the value ends the output. Free text until ``after``, then only values; a complete value
    allows only the end token (beside its children when it prefixes a longer one), never text."""
    from trie_decode.fields import FieldRules

    eos = tokenizer.eos_token_id
    values = ["Paris", "Paris Hilton", "Rome"]
    tries, fields = FieldRules.build([Span(values, after="Final answer: ", end=None)], tokenizer)
    # No escaping without a quote; after a space each value twice: " Paris", and a lone space then "Paris".
    assert fields.ends[0].ids.tolist() == [eos] and tries[0].names() == values + values
    c = TrieConstraint(tries, SpanRules(end_token_id=eos, on_complete="release", fields=fields), "cpu")
    prompt = tokenizer("Think, then answer. Final answer: ", add_special_tokens=False)["input_ids"]
    s = c.start(1, None, torch.tensor([prompt]))
    # The prompt ends with ``after`` (its space a token of its own): inside the span at once, after that space.
    assert int(s.node[0]) == fields.start_node(0) == tries[0].step(0, prompt[-1]) > 0
    for value, last in [("Rome", [eos]), ("Paris", None)]:
        state = s
        for tok in tokenizer.encode(value, add_special_tokens=False):
            state = c.advance(state, torch.tensor([tok]))
        allowed = c.allowed_tokens(state)[0]
        if last is not None:
            assert allowed == last
        else:  # "Paris" prefixes "Paris Hilton": its next token or the end token
            assert eos in allowed and len(allowed) == 2
    with pytest.raises(ConstraintConfigError, match="closed by the end token: give end_token_id"):
        FieldRules.from_tokens(tries, ["Final answer: "], [None], [b""] * tries[0].vocab_size)


@pytest.mark.model
def test_a_final_answer_span_ends_the_output(model, tokenizer):
    """A span with ``end=None`` after ``"Final answer: "``: every output is one catalog value, then EOS."""
    from trie_decode.integrations.transformers import TrieLogitsProcessor

    proc = TrieLogitsProcessor(tokenizer=tokenizer, spans=[Span(CITIES, after="Final answer: ", end=None)])
    tokenizer.padding_side = "left"
    prompts = [p + "Final answer: " for p in _prompts(tokenizer, 4)]
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    out = model.generate(**enc, logits_processor=[proc], max_new_tokens=16, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    for row in out[:, enc["input_ids"].shape[1]:].tolist():
        end = row.index(tokenizer.eos_token_id)
        assert tokenizer.decode(row[:end]) in CITIES, tokenizer.decode(row)


def test_a_space_ending_after_holds_each_value_in_both_forms_and_filters_name_both(tokenizer):
    """``after`` ending in a space: the trie holds ``" Berlin"`` (the token the model writes after ``":"``) and a
    lone space then ``"Berlin"``, under one key. ``allow``/``deny`` by key or by value index keep or drop both forms,
    and an index past the values is refused (it would name one form only)."""
    from trie_decode.fields import FieldRules

    vocab = vocabulary_bytes(tokenizer)
    tries, _ = FieldRules.build([Span(["Berlin", "Paris"], after="Final answer: ", end=None)], tokenizer)
    spelled = sorted(b"".join(vocab[int(t)] for t in seq) for seq in tries[0].sequences())
    assert spelled == [b" Berlin", b" Berlin", b" Paris", b" Paris"]
    assert {len(seq) > 1 and vocab[int(seq[0])] == b" " for seq in tries[0].sequences()} == {True, False}
    for allow, deny in ((["Berlin"], None), ([0], None), (None, ["Paris"]), (None, [1])):
        tries, _ = FieldRules.build([Span(["Berlin", "Paris"], after="Final answer: ", end=None, allow=allow,
                                          deny=deny)], tokenizer)
        assert tries[0].names() == ["Berlin", "Berlin"], (allow, deny)
    with pytest.raises(ConstraintConfigError, match=r"Span.allow\[0\] is 2: not the index of one of the span's 2 values"):
        FieldRules.build([Span(["Berlin", "Paris"], after="Final answer: ", end=None, allow=[2])], tokenizer)


def test_start_refuses_prompt_tails_that_are_not_one_row_each(tokenizer):
    """``TrieConstraint.start(R, tails=...)`` with spans reads each row's prompt tail: tails of another row count, 1-D
    or not a tensor are a named error, not a state of the tails' row count or a crash in the automaton."""
    tries, fields = FieldRules.build([Span(["Paris", "Rome"], after='"city": "')], tokenizer)
    c = TrieConstraint(tries, SpanRules(end_token_id=tokenizer.eos_token_id, on_complete="release", fields=fields),
                       "cpu")
    ids = tokenizer('{"city": "', return_tensors="pt")["input_ids"]
    assert int(c.start(1, tails=ids).node[0]) == 0
    for rows, tails in ((3, ids), (1, torch.cat([ids, ids])), (1, ids[0]), (1, ids.tolist())):
        with pytest.raises(ConstraintConfigError, match=r"tails must hold each row's last prompt tokens"):
            c.start(rows, tails=tails)


def test_a_value_index_names_that_value_where_the_trie_holds_fewer_entries_than_values(tokenizer):
    """``allow``/``deny`` index ``i`` is value ``i``, also where the trie keeps one entry for several values' token
    sequences: a repeated value, or a value beginning with the space that ends ``after`` (its two forms are one)."""
    from trie_decode.fields import FieldRules

    for values, after in (([" Paris", "Rome", "Berlin"], "A: "), (["Paris", "Paris", "Rome"], '"city": "'),
                          (["Paris", "Paris", "Rome"], "A: ")):
        for i in range(len(values)):
            tries, _ = FieldRules.build([Span(values, after=after, allow=[i])], tokenizer)
            assert set(tries[0].names()) == {values[i]}, (values, after, i)
            tries, _ = FieldRules.build([Span(values, after=after, deny=[i])], tokenizer)
            assert set(tries[0].names()) == set(values) - {values[i]}, (values, after, i)


def test_values_given_as_a_generator_are_read_once_and_kept(tokenizer):
    """A generator of values is read when the span is made: each build (one per tokenizer, per vLLM request) sees
    every value, and an index in ``allow`` names the value it numbers."""
    from trie_decode.fields import FieldRules

    span = Span((v for v in ["Paris", "Rome", "Berlin"]), after='"city": "', allow=[2])
    for _ in range(2):
        tries, _ = FieldRules.build([span], tokenizer)
        assert tries[0].names() == ["Berlin"]


def test_a_prebuilt_span_trie_whose_value_goes_on_with_the_end_token_is_refused(tokenizer):
    """Value strings holding the span's end are refused as they are written; a prebuilt trie is checked where the
    end token itself continues a value: the shorter value could never end."""
    ids = [tokenizer.encode(v, add_special_tokens=False) for v in ("Inc", "Inc")]
    ids[1] = ids[1] + tokenizer.encode('"', add_special_tokens=False)
    trie = TokenTrie.from_sequences(ids, vocab_size=len(tokenizer), names=["Inc", 'Inc"'])
    with pytest.raises(InvalidEntryError, match=r"Span after '\"name\": \"': the value 'Inc' could never be written"):
        FieldRules.build([Span(trie, after='"name": "')], tokenizer)
    unnamed = TokenTrie.from_sequences(ids, vocab_size=len(tokenizer))  # named by entry number and tokens
    with pytest.raises(InvalidEntryError, match=r"the value of entry 0 \[\d+\] could never be written: the value of "
                                                r"entry 1 \[\d+, \d+\] goes on"):
        FieldRules.build([Span(unnamed, after='"name": "')], tokenizer)


def test_the_model_writing_the_space_alone_enters_only_where_a_value_begins_with_it(tokenizer):
    """After ``"Final answer:"`` the lone space completes ``after`` with nothing carried: for city names (``" Berlin"``
    is one token) it is blocked, so the value is written in the tokenizer's own tokens; for numbers (``" 42"`` is
    ``"Ġ"``, ``"4"``, ``"2"``) it is the value's own first token and allowed."""
    from trie_decode.fields import FieldRules

    space = tokenizer(" ", add_special_tokens=False)["input_ids"][0]
    prompt = torch.tensor([tokenizer("Think. Final answer:", add_special_tokens=False)["input_ids"]])
    for values, allowed in ((["Berlin", "Paris"], False), (["42", "7"], True)):
        tries, fields = FieldRules.build([Span(values, after="Final answer: ", end=None)], tokenizer)
        c = TrieConstraint(tries, SpanRules(end_token_id=tokenizer.eos_token_id, on_complete="release",
                                            fields=fields), "cpu")
        s = c.start(1, None, prompt)
        assert bool(c.allowed(s, c.needed_width)[0, space]) is allowed, values
        if allowed:  # on the value's own path: the digits follow
            s = c.advance(s, torch.tensor([space]))
            assert int(s.node[0]) == fields.start_node(0) > 0


def test_a_trie_that_starts_before_the_space_but_lost_its_lone_space_form_is_refused(tokenizer):
    """A span trie built for ``after="Final answer: "`` cut down to its spaced form only would leave a prompt ending
    with the space nowhere to start (an unconstrained row): refused when the rules are made."""
    from trie_decode.fields import FieldRules

    tries, _ = FieldRules.build([Span(["Berlin", "Paris"], after="Final answer: ", end=None)], tokenizer)
    vocab = vocabulary_bytes(tokenizer)
    spaced = [e for e, seq in enumerate(tries[0].sequences()) if vocab[int(seq[0])] != b" "]
    with pytest.raises(ConstraintConfigError, match="holds no value after that space alone"):
        FieldRules.build([Span(tries[0].subset(spaced), after="Final answer: ", end=None)], tokenizer)


def test_span_rules_refuse_fields_that_are_not_field_rules(tokenizer):
    """``SpanRules(fields=...)`` given the spans, or ``FieldRules.build``'s (tries, rules) pair, failed deep inside
    the constraint (``AttributeError: 'list' object has no attribute 'max_token'``); it is refused where it is given,
    naming what ``fields`` takes."""
    spans = [Span(["Paris"], after='"city": "')]
    built = FieldRules.build(spans, tokenizer)
    for wrong in (spans, built, True):
        with pytest.raises(ConstraintConfigError, match=r"fields must be the FieldRules of the spans .*got "
                                                        + type(wrong).__name__):
            SpanRules(end_token_id=tokenizer.eos_token_id, on_complete="release", fields=wrong)
    SpanRules(end_token_id=tokenizer.eos_token_id, on_complete="release", fields=built[1])


@pytest.mark.parametrize("end", ["2", 2.5, -3, True])
def test_field_rules_name_a_bad_end_token_id(tokenizer, end):
    """A span closed by the end token (``end=None``) read ``end_token_id`` with numpy: ``"2"`` and True closed the
    value with token 2 or 1, 2.5 with token 2 (``"x"`` failed inside numpy, a bare ValueError), -3 was reported as a
    token outside the vocabulary. The build names ``end_token_id`` and the value now."""
    spans = [Span(["Berlin"], after="Final answer: ", end=None)]
    with pytest.raises(ConstraintConfigError, match=r"end_token_id must be a non-negative token id, got "):
        FieldRules.build(spans, tokenizer, end)
    with pytest.raises(ConstraintConfigError, match=r"end_token_id must be a non-negative token id, got "):
        FieldRules.from_tokens([TokenTrie.from_sequences([[5]], vocab_size=10)], ["x"], None, [b"x"] * 10, end)


@pytest.mark.parametrize("spans", [None, 5, 2.5])
def test_spans_that_are_not_a_list_are_named(tokenizer, spans):
    """``FieldRules.build(None, tok)`` (and ``TrieLogitsProcessor(spans=None-like)``) failed with Python's bare
    ``TypeError: 'NoneType' object is not iterable``."""
    with pytest.raises(ConstraintConfigError, match=r"spans must be a list of Span, got "):
        FieldRules.build(spans, tokenizer)


# ------------------------------------------------------------------------------------------------ forms.check_prompt
def test_check_prompt_names_a_trie_or_tokenizer_of_the_wrong_kind(tokenizer):
    """``check_prompt(["France"], tok, ...)`` failed with ``AttributeError: 'list' object has no attribute 'names'``
    and ``check_prompt(trie, None, ...)`` with ``TypeError: 'NoneType' object is not callable``."""
    from trie_decode.forms import check_prompt

    trie = TokenTrie.from_strings(["France", "Japan"], tokenizer, leading_space=True)
    with pytest.raises(InvalidEntryError, match=r"check_prompt checks a TokenTrie, got list"):
        check_prompt(["France"], tokenizer, "The answer is")
    with pytest.raises(InvalidEntryError, match=r"check_prompt needs the model's tokenizer .*got NoneType"):
        check_prompt(trie, None, "The answer is")
    assert check_prompt(trie, tokenizer, "The answer is") == []


def test_numpy_bools_are_bools_for_the_forms():
    """``leading_space=np.True_`` (or a numpy array of bools) was refused with a message contradicting itself:
    "leading_space must be a bool or a list of them, got bool"."""
    import numpy as np

    from trie_decode.forms import resolve_forms

    assert resolve_forms(np.bool_(True)) == [("leading_space", True)]
    assert resolve_forms(np.array([True, False])) == [("leading_space", True), ("leading_space", False)]
    assert all(type(v) is bool for _, v in resolve_forms(np.array([True, False])))
    with pytest.raises(InvalidEntryError, match=r"leading_space\[1\] is int 1, not a bool"):
        resolve_forms([True, 1])


def test_a_lone_surrogate_in_a_span_is_named(tokenizer):
    """A lone surrogate (``json.loads('"\\\\ud800"')``) in a value or in ``after`` failed inside the tokenizer with
    ``TypeError: TextEncodeInput must be Union[...]``, and in ``end`` with a bare UnicodeEncodeError."""
    with pytest.raises(InvalidEntryError, match=r"Span after '\"x\": \"' value 1 'b\\ud800' holds the lone surrogate"):
        FieldRules.build([Span(["a", "b\ud800"], after='"x": "')], tokenizer)
    with pytest.raises(ConstraintConfigError, match=r"Span\.after 'x\\ud800: ' holds the lone surrogate '\\ud800'"):
        FieldRules.build([Span(["a"], after="x\ud800: ")], tokenizer)
    with pytest.raises(ConstraintConfigError, match=r"Span\.end '\\ud800' holds the lone surrogate"):
        FieldRules.build([Span(["a"], after="x: ", end="\ud800")], tokenizer)
