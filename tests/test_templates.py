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
])
def test_bad_templates_name_the_problem(args, kwargs, match):
    with pytest.raises(ConstraintConfigError, match=match):
        Template(*args, **kwargs)


def test_a_value_containing_the_text_that_ends_it_is_refused(tokenizer):
    with pytest.raises(InvalidEntryError, match=r"slot 'x' value 0.*contains the span's end '\.'"):
        Template("A: {x}.", x=["St. Louis"]).build(tokenizer, tokenizer.eos_token_id)


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
