"""Templates (issue 23 item 5): fixed text with catalog-valued slots, the fixed text forced token by token.

The core is checked on random walks with SmolLM2's tokenizer (every kernel, every walk a valid output whose slots
hold catalog entries, exactly one token allowed outside the slots); the real model through the transformers
processor and fast-forward (same tokens, the fixed text fed without a decision) is in the second half.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from trie_decode import TokenTrie
from trie_decode.constraint import TrieConstraint
from trie_decode.errors import ConstraintConfigError, InvalidEntryError
from trie_decode.spans import FREE
from trie_decode.templates import Template

KERNELS = ["native", "numpy", "torch"]
CITIES = ["Paris", "Rome", "Berlin", "New York", 'Eyn-e "Do', "Zürich", "Paris Hilton", "São Paulo"]
COUNTRIES = ["France", "Italy", "Germany", "United States", "Brazil"]


# ------------------------------------------------------------------------------------------------ parsing
def test_slots_and_literal_braces():
    t = Template('{"a": {{x}}, "city": "{city}"}', city=["Paris"])
    assert t.segments == ['{"a": {x}, "city": "', '"}'] and t.slot_names == ["city"]
    assert Template("{city} is a city.", city=["Rome"]).segments == ["", " is a city."]
    assert t.slot_escape(0) == "json" and Template("A: {x}.", x=["b"]).slot_escape(0) is None


@pytest.mark.parametrize("args, kwargs, match", [
    (("no slot here",), {}, r"has no slot"),
    (("A: {city}.",), {}, r"slots without values: \['city'\].*city=\[\.\.\.\]"),
    (("A: {city}.",), {"city": ["x"], "town": ["y"]}, r"slots the template does not have: \['town'\]"),
    (("{a}{b}.",), {"a": ["x"], "b": ["y"]}, r"\{a\} and \{b\} are adjacent"),
    (("A: {a}.",), {"a": ["x"], "escape": "xml"}, r"escape must be"),
    (("",), {}, r"non-empty str"),
    (("A: {x}.",), {"x": "Paris"}, r"slot 'x' must be a TokenTrie or a list of strings, not a single string"),
    (("A: {x}.",), {"x": None}, r"slot 'x' must be a TokenTrie or a list of strings, got NoneType"),
])
def test_bad_templates_name_the_problem(args, kwargs, match):
    with pytest.raises(ConstraintConfigError, match=match):
        Template(*args, **kwargs)


def test_a_value_containing_the_text_that_ends_it_is_refused(tokenizer):
    with pytest.raises(InvalidEntryError, match=r"slot 'x' value 0.*contains the text after \{x\} '\.'"):
        Template("A: {x}.", x=["St. Louis"]).build(tokenizer, tokenizer.eos_token_id)


@pytest.mark.parametrize("escape", ["auto", "json", None])
def test_the_refusal_of_a_value_containing_the_text_after_its_slot_names_only_fixes_a_template_has(tokenizer, escape):
    """A template has no ``end``: the message says to change the text after the slot; ``escape='json'`` is offered
    only where JSON escaping takes that text out of the value ('. Next' stays in it)."""
    with pytest.raises(InvalidEntryError) as err:
        Template("City: {city}. Next", city=["St. Louis. Next", "Paris"], escape=escape).build(
            tokenizer, tokenizer.eos_token_id)
    message = str(err.value)
    assert "contains the text after {city} '. Next'" in message and "span" not in message
    assert "change the template's text after {city}" in message
    assert "escape=" not in message and "another end" not in message
    with pytest.raises(InvalidEntryError, match=r"give escape='json'.*or change the template's text after \{x\}"):
        Template('Q: "{x}"', x=['say "hi"'], escape=None).build(tokenizer, tokenizer.eos_token_id)


def test_a_value_that_another_value_goes_on_from_with_the_only_token_ending_it_is_refused(tokenizer):
    """"Inc" before the text ". " ends only with ".", which is also the next token of "Inc.": every row that wrote
    "Inc" went on into "Inc." (writing "Inc.. "), so "Inc" could never be the value. The build says so."""
    with pytest.raises(InvalidEntryError, match=r"slot 'x': the value 'Inc' could never be written: the value 'Inc\.' "
                                                r"goes on from it with the token '\.'.*change the template's text after"):
        Template("Name: {x}.\nDone", x=["Inc", "Inc.", "Ltd"]).build(tokenizer, tokenizer.eos_token_id)
    Template("Name: {x}!\nDone", x=["Inc", "Inc.", "Ltd"]).build(tokenizer, tokenizer.eos_token_id)  # "!" ends it


def test_slots_may_be_named_like_the_templates_parameters(tokenizer):
    """``text`` is positional-only, so a slot may be named ``text``; ``escape=`` is the escaping mode, so a slot
    named ``escape`` takes its values through ``Template.from_slots`` (any name does), and the message for the
    keyword form says so."""
    t = Template('{"text": "{text}"}', text=["hello", "bye"])
    assert t.slot_names == ["text"] and t.slots == {"text": ["hello", "bye"]}
    t = Template.from_slots('{"escape": "{escape}", "text": "{text}"}', {"escape": ["yes"], "text": ["no"]},
                            escape=None)
    assert t.slot_names == ["escape", "text"] and t.escape is None and t.slots["escape"] == ["yes"]
    tries, _ = t.build(tokenizer, tokenizer.eos_token_id)
    assert [tr.num_entries for tr in tries] == [1, 1]
    for kwargs in ({"escape": ["yes", "no"]}, {}):
        with pytest.raises(ConstraintConfigError,
                           match=r"slots without values: \['escape'\]; the slot \{escape\} takes its values through "
                                 r"Template\.from_slots\(text, \{'escape': \[\.\.\.\]\}\)"):
            Template('{"escape": "{escape}"}', **kwargs)
    with pytest.raises(ConstraintConfigError, match=r"slots without values: \['x'\]; add them to the slots mapping"):
        Template.from_slots("A: {x}.", {})
    with pytest.raises(ConstraintConfigError, match=r"as a mapping \(slot name -> values\), got list"):
        Template.from_slots("A: {x}.", [["a"]])


# ------------------------------------------------------------------------------------------------ the core
def _walk(c: TrieConstraint, rng: random.Random, eos: int, max_steps: int = 60) -> tuple[list[int], int]:
    """A random walk over the allowed tokens; returns the tokens and how many FREE steps allowed one token."""
    s, ids, forced = c.start(1), [], 0
    for _ in range(max_steps):
        allowed = c.mask_(torch.zeros(1, c.vocab_size), s)[0].isfinite().nonzero().flatten().tolist()
        if int(s.node) == FREE:
            assert len(allowed) == 1, allowed
            forced += 1
        tok = rng.choice(allowed)
        ids.append(tok)
        if tok == eos:
            return ids, forced
        s = c.advance(s, torch.tensor([tok]))
    raise AssertionError(f"no end token after {max_steps} steps: {ids}")


@pytest.mark.parametrize("kernel", KERNELS)
def test_random_walks_write_the_template_with_catalog_values(tokenizer, kernel):
    t = Template('{"city": "{city}", "country": "{country}"}', city=CITIES, country=COUNTRIES)
    c = TrieConstraint(*t.rules(tokenizer, tokenizer.eos_token_id), "cpu", kernel=kernel)
    rng, seen = random.Random(7), set()
    for _ in range(40):
        ids, forced = _walk(c, rng, tokenizer.eos_token_id)
        out = json.loads(tokenizer.decode(ids, skip_special_tokens=True))
        assert out["city"] in CITIES and out["country"] in COUNTRIES and forced >= 6
        seen.add(out["city"])
    assert {'Eyn-e "Do', "Paris Hilton", "Paris"} <= seen  # escaped quotes, and an entry that prefixes another


def test_a_final_slot_ends_with_the_end_token_and_a_first_slot_starts_at_once(tokenizer):
    eos = tokenizer.eos_token_id
    for text, want in [("Capital: {city}", "Capital: {}"), ("{city} is a city.", "{} is a city.")]:
        c = TrieConstraint(*Template(text, city=CITIES).rules(tokenizer, eos), "cpu")
        rng = random.Random(3)
        outs = {tokenizer.decode(_walk(c, rng, eos)[0], skip_special_tokens=True) for _ in range(20)}
        assert outs <= {want.format(v) for v in CITIES} and len(outs) > 3


def test_a_slot_given_as_a_trie_keeps_the_space_before_it(tokenizer):
    """A prebuilt trie is used as given: the space ending the text before its slot is forced with that text (only
    value strings hold it in front of their values), so the output is still the template's text."""
    eos = tokenizer.eos_token_id
    for values in (CITIES, TokenTrie.from_strings(CITIES, tokenizer)):
        c = TrieConstraint(*Template("Capital: {city}", city=values).rules(tokenizer, eos), "cpu")
        rng = random.Random(3)
        outs = {tokenizer.decode(_walk(c, rng, eos)[0], skip_special_tokens=True) for _ in range(10)}
        assert outs <= {f"Capital: {v}" for v in CITIES} and len(outs) > 2, outs


def test_slot_values_given_as_a_generator_serve_every_build(tokenizer):
    eos = tokenizer.eos_token_id
    template = Template("Capital: {city}", city=(v for v in CITIES))
    for end in (eos, eos + 1):  # two end tokens: two builds
        tries = template.rules(tokenizer, end)[0]
        assert sorted(set(tries[0].names())) == sorted(CITIES)


def test_fixed_text_is_the_tokenizers_own_and_forced(tokenizer):
    t = Template('{"city": "{city}", "country": "{country}"}', city=CITIES, country=COUNTRIES)
    c = TrieConstraint(*t.rules(tokenizer, tokenizer.eos_token_id), "cpu")
    s = c.start(1)
    forced = c.forced_tokens(s)[0]
    assert forced == tokenizer('{"city": "', add_special_tokens=False)["input_ids"]
    for tok in forced:
        s = c.advance(s, torch.tensor([tok]))
    assert int(s.node) == 0 and int(s.tree) == 0  # at the city trie's root
    for tok in tokenizer("Rome", add_special_tokens=False)["input_ids"]:
        s = c.advance(s, torch.tensor([tok]))
    allowed = c.mask_(torch.zeros(1, c.vocab_size), s)[0].isfinite().nonzero().flatten().tolist()
    texts = {tokenizer.decode([a]) for a in allowed}
    assert '",' in texts and '"}' not in texts  # only the tokens that begin '", "country": "'
    s = c.advance(s, torch.tensor(tokenizer.convert_tokens_to_ids(['",'])))
    rest = tokenizer.decode(c.forced_tokens(s)[0])
    assert rest == ' "country": "'


def test_a_normalizing_tokenizer_still_writes_the_templates_own_text(tokenizer):
    """A tokenizer that normalizes its input (Qwen's NFC) tokenizes the template's first text into other bytes
    (``"Co\\u0302te"`` -> ``"Côte"``): the output still spells the template's bytes and reaches the slot, instead of
    stepping off the text into the dead state (only EOS left)."""
    from tokenizers import Tokenizer, normalizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.normalizer = normalizers.NFC()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=tokenizer.eos_token)
    eos = tok.eos_token_id
    c = TrieConstraint(*Template("Co\u0302te: {x}.", x=["Paris", "Rome"]).rules(tok, eos), "cpu")
    outs = {tok.decode(_walk(c, random.Random(i), eos)[0], skip_special_tokens=True) for i in range(6)}
    assert outs == {"Co\u0302te: Paris.", "Co\u0302te: Rome."}


def test_host_answers_and_the_fast_forward_stop_read_the_fixed_text(tokenizer):
    """``allowed``/``allowed_tokens``/``bitmask`` give a FREE template row its one fixed token (not "unconstrained"),
    and ``stop_at_forced`` ends a FREE row where at least ``min_run`` fixed tokens follow (with ``tail_only``, only
    where they end the output), as :meth:`TemplateRules.forced_text` counts them."""
    eos = tokenizer.eos_token_id
    t = Template('{"city": "{city}", "country": "{country}"}', city=CITIES, country=COUNTRIES)
    c = TrieConstraint(*t.rules(tokenizer, eos), "cpu")
    out = tokenizer('{"city": "São Paulo", "country": "Italy"}', add_special_tokens=False)["input_ids"] + [eos]
    s = c.start(1)
    runs = 0
    for i, tok in enumerate(out):
        free = int(s.node[0]) == FREE
        forced = c.forced_tokens(s)[0]
        (allowed,) = c.allowed_tokens(s)
        assert tok in allowed and c.allowed(s)[0].nonzero().flatten().tolist() == allowed
        if free:
            assert allowed == [tok] == forced[:1]
        ends = bool(forced) and forced[-1] == eos
        runs += bool(forced) and not free
        for min_run, tail_only in [(1, False), (2, False), (2, True), (len(forced) + 1, False)]:
            stopped = c.stop_at_forced(s, torch.tensor([min_run]), torch.tensor([tail_only]))
            # a run inside a value never ends the output: it stops only where tail_only is off
            want = len(forced) >= min_run and (not tail_only or (free and ends))
            assert c.allowed_tokens(stopped)[0] == ([eos] if want else allowed), (i, min_run, tail_only)
        s = c.advance(s, torch.tensor([tok]))
    assert runs  # the walk met a forced run inside a value too


# ------------------------------------------------------------------------------------------------ the real model
@pytest.fixture(scope="module")
def json_template(country_names):
    from test_spans import CITIES as REAL_CITIES

    return Template('{"city": "{city}", "country": "{country}"}', city=REAL_CITIES, country=list(country_names))


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("do_sample", [False, True])
def test_the_processor_writes_the_template_for_64_prompts(model, tokenizer, json_template, country_names, do_sample):
    """64 prompts through ``generate``: every output is the template (valid JSON) with both slots in their catalogs,
    and it ends with EOS."""
    from test_spans import CITIES as REAL_CITIES, _prompts

    from trie_decode.integrations.transformers import TrieLogitsProcessor

    tokenizer.padding_side = "left"
    prompts = _prompts(tokenizer, 64)
    torch.manual_seed(1)
    for lo in range(0, len(prompts), 16):
        enc = tokenizer(prompts[lo:lo + 16], return_tensors="pt", padding=True)
        proc = TrieLogitsProcessor(tokenizer=tokenizer, template=json_template)
        out = model.generate(**enc, logits_processor=[proc], max_new_tokens=40, do_sample=do_sample,
                             pad_token_id=tokenizer.pad_token_id)
        for row in out[:, enc["input_ids"].shape[1]:].tolist():
            assert tokenizer.eos_token_id in row, tokenizer.decode(row)
            obj = json.loads(tokenizer.decode(row, skip_special_tokens=True))
            assert obj["city"] in REAL_CITIES and obj["country"] in country_names, obj


@pytest.mark.model
def test_fast_forward_feeds_the_fixed_text_without_decisions(model, tokenizer, json_template):
    """Fast-forward gives the processor's tokens; the template's fixed text (and EOS) costs no decision of its own,
    through the hook (a template built beforehand) and as a plain call."""
    from test_spans import _prompts

    from trie_decode.integrations.fast_forward import fast_forward_generate
    from trie_decode.integrations.transformers import TrieLogitsProcessor

    tokenizer.padding_side = "left"
    enc = tokenizer(_prompts(tokenizer, 4), return_tensors="pt", padding=True)
    p = enc["input_ids"].shape[1]
    proc = TrieLogitsProcessor(tokenizer=tokenizer, template=json_template)
    want = model.generate(**enc, logits_processor=[proc], max_new_tokens=40, do_sample=False,
                          pad_token_id=tokenizer.pad_token_id)[:, p:]
    ff = fast_forward_generate(model, enc["input_ids"], attention_mask=enc["attention_mask"], template=json_template,
                               tokenizer=tokenizer, max_new_tokens=40, do_sample=False,
                               pad_token_id=tokenizer.pad_token_id, return_dict_in_generate=True)
    hooked = model.generate(**enc, custom_generate=fast_forward_generate, template=json_template, max_new_tokens=40,
                            do_sample=False, pad_token_id=tokenizer.pad_token_id, return_dict_in_generate=True)
    for out in (ff, hooked):
        got = out.sequences[:, p:]
        for a, b in zip(want.tolist(), got.tolist()):
            strip = lambda r: r[: r.index(tokenizer.eos_token_id) + 1]
            assert strip(a) == strip(b)
        fixed = len(tokenizer('{"city": "", "country": ""}', add_special_tokens=False)["input_ids"])
        assert out.stats.forced_tokens >= 4 * (fixed - 2), out.stats  # the fixed text and EOS of every row
        assert out.stats.forward_passes < max(out.stats.row_tokens)


def test_template_options_that_do_not_combine_are_named(tokenizer):
    from trie_decode.integrations.fast_forward import fast_forward_generate
    from trie_decode.integrations.transformers import TrieLogitsProcessor

    t = Template("A: {x}.", x=["b"])
    with pytest.raises(ConstraintConfigError, match=r"template= does not combine with \['trigger'\]"):
        TrieLogitsProcessor(tokenizer=tokenizer, template=t, trigger="x")
    with pytest.raises(ConstraintConfigError, match="either spans= or template="):
        TrieLogitsProcessor(tokenizer=tokenizer, template=t, spans=[])
    with pytest.raises(ConstraintConfigError, match="template= needs the tokenizer"):
        TrieLogitsProcessor(template=t)
    with pytest.raises(ConstraintConfigError, match="must be a trie_decode.Template"):
        TrieLogitsProcessor(tokenizer=tokenizer, template="A: {x}.")
    with pytest.raises(ConstraintConfigError, match=r"^this template was not built for end token 2: pass tokenizer=, "
                                                    r"or call template\.build\(tokenizer, 2\) once"):
        Template("B: {y}.", y=["c"]).prebuilt(tokenizer.eos_token_id)
    with pytest.raises(ConstraintConfigError, match="either trie= or template="):
        fast_forward_generate(None, None, trie=TokenTrie.from_sequences([[1]], vocab_size=10), template=t)


def test_a_template_without_its_tokenizer_names_what_fast_forward_takes(tiny_llama, tokenizer):
    """Through generate's hook, which keeps its tokenizer=, a template not built beforehand said "this template was
    built for 0 tokenizers ...: pass tokenizer=", and passing it changed nothing. The fixes named are the ones
    fast_forward_generate has; the bound tokenizer the message names works."""
    import functools

    from trie_decode.integrations.fast_forward import fast_forward_generate

    template = Template("A: {x}.", x=["b", "c"])
    inputs = {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    eos = tokenizer.eos_token_id
    fixes = (rf"^this template was not built for end token {eos}: call template\.build\(tokenizer, {eos}\) once before "
             r"generate, or give fast_forward_generate the tokenizer: .*functools\.partial\(fast_forward_generate, "
             r"tokenizer=tokenizer\)$")
    with pytest.raises(ConstraintConfigError, match=fixes):
        tiny_llama.generate(**inputs, custom_generate=fast_forward_generate, template=template, tokenizer=tokenizer,
                            max_new_tokens=8)
    with pytest.raises(ConstraintConfigError, match=fixes):
        fast_forward_generate(tiny_llama, **inputs, template=template, max_new_tokens=8)
    bound = functools.partial(fast_forward_generate, tokenizer=tokenizer)
    out = tiny_llama.generate(**inputs, custom_generate=bound, template=template, max_new_tokens=8)
    text = tokenizer.decode(out[0, 3:], skip_special_tokens=True)
    assert text in ("A: b.", "A: c."), text


def test_fixed_text_banned_by_another_processor_keeps_its_token_at_the_floor(tokenizer):
    from trie_decode.kernels.rules import ALL_MASKED_FLOOR

    c = TrieConstraint(*Template("A: {x}.", x=["b"]).rules(tokenizer, tokenizer.eos_token_id), "cpu")
    logits = torch.full((1, c.vocab_size), float("-inf"))
    out = c.mask_(logits, c.start(1))
    kept = out[0].isfinite().nonzero().flatten().tolist()
    assert len(kept) == 1 and out[0, kept[0]] == ALL_MASKED_FLOOR


@pytest.mark.parametrize("end", ["2", None, -5, 2.7, True])
def test_a_bad_end_token_id_is_named_by_build_prebuilt_and_rules(tokenizer, end):
    """``build`` read the end token with ``int()``: None failed inside Python's ``int`` (a bare TypeError; ``"x"`` a
    bare ValueError), and ``"2"``, -5, 2.7 and True built a template whose end token was 2, -5, 2 or 1. Every entry
    point names ``end_token_id`` and the value now."""
    t = Template("A: {x}.", x=["b"])
    for call in (lambda: t.build(tokenizer, end), lambda: t.prebuilt(end), lambda: t.rules(tokenizer, end)):
        with pytest.raises(ConstraintConfigError, match=r"end_token_id must be a non-negative token id, got "):
            call()
    assert not t._built  # nothing was built for a bad end token


def test_a_lone_surrogate_in_the_template_or_a_value_is_named(tokenizer):
    """Text read with ``json.loads`` from half an escaped pair (``"\\ud800"``) holds a lone surrogate, which no UTF-8
    text holds: the build failed inside the tokenizer with ``TypeError: TextEncodeInput must be Union[...]``, naming
    neither the slot nor the value. The template and the value are named now."""
    with pytest.raises(ConstraintConfigError, match=r"the template .* holds the lone surrogate '\\ud800' at index 1"):
        Template("A\ud800: {x}.", x=["a"])
    with pytest.raises(InvalidEntryError, match=r"slot 'x' value 1 'b\\ud800' holds the lone surrogate"):
        Template("A: {x}.", x=["a", "b\ud800"]).build(tokenizer, tokenizer.eos_token_id)


def test_an_end_token_outside_the_vocabulary_is_refused_before_the_vocabulary_is_padded_to_it(tokenizer):
    """``build(tok, 10**7)`` padded the vocabulary with ten million empty entries (seconds and hundreds of MB; 10**9
    exhausts memory) and returned rules whose logits had to be 10**7 wide, failing only at generation. Refused now,
    naming the id and the vocabulary."""
    from trie_decode.errors import InvalidTokenError

    size = len(tokenizer)
    with pytest.raises(InvalidTokenError, match=rf"end_token_id 10000000 is outside the vocabulary \[0, {size}\)"):
        Template("A: {x}.", x=["b"]).build(tokenizer, 10**7)
    ids = tokenizer("b", add_special_tokens=False)["input_ids"]
    wide = TokenTrie.from_sequences([ids], vocab_size=size + 64, names=["b"])
    Template("A: {x}.", x=wide).build(tokenizer, size + 10)  # an id of a slot trie's (padded) vocabulary
